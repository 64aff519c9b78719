//! What both front doors are started from and load the same way: the policy
//! ([`PolicyChoice`]), the prompt counter ([`TokenizerChoice`]) and the
//! endpoint source with its scraper ([`SourceChoice`]). Each door's
//! `launch()` calls these and adds its own listeners.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use rngd_policy_core::Endpoint;
use rngd_policy_host::{PolicyError, PolicyRuntime, PolicySource, SandboxLimits};
use tokio::task::JoinHandle;

use crate::pick::Policy;
use crate::prompt::PromptCounter;
use crate::scrape::{HttpFetcher, ScrapedEndpoints};
use crate::source::{DEFAULT_FILE_POLL, EndpointSource, FileEndpoints, StaticEndpoints};
use crate::{PoolError, TokenizerOverrides, gguf_counter_with};

/// Where the policy comes from.
#[derive(Clone)]
pub enum PolicyChoice {
    /// A `.wasm` module run by `rngd-policy-host` (hot-reloaded, admin API).
    Wasm {
        /// The module file.
        module: PathBuf,
        /// Its plugin configuration (JSON; empty = defaults).
        config: Vec<u8>,
        /// Sandbox limits.
        limits: SandboxLimits,
        /// How often the file is checked for changes; `None` = never.
        watch_every: Option<Duration>,
    },
    /// Any other implementation (tests, benchmarks).
    Custom(Arc<dyn Policy>),
}

impl std::fmt::Debug for PolicyChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PolicyChoice::Wasm { module, .. } => f
                .debug_struct("Wasm")
                .field("module", module)
                .finish_non_exhaustive(),
            PolicyChoice::Custom(_) => f.write_str("Custom"),
        }
    }
}

/// A loaded policy.
pub struct LoadedPolicy {
    /// What the picker calls.
    pub policy: Arc<dyn Policy>,
    /// The wasm runtime behind it, if it is one (metrics, admin API).
    pub runtime: Option<Arc<PolicyRuntime>>,
    /// The module file watcher, if hot reload is on.
    pub watch: Option<JoinHandle<()>>,
}

impl PolicyChoice {
    /// Compiles the module (off the async threads) and starts its watcher.
    pub async fn load(&self) -> Result<LoadedPolicy, PolicyError> {
        match self {
            PolicyChoice::Wasm {
                module,
                config,
                limits,
                watch_every,
            } => {
                let source = PolicySource {
                    module: module.clone(),
                    config: config.clone(),
                };
                let limits = limits.clone();
                let rt = tokio::task::spawn_blocking(move || PolicyRuntime::new(source, limits))
                    .await
                    .map_err(|e| PolicyError::Unavailable {
                        detail: format!("the loading thread failed: {e}"),
                    })??;
                let watch = watch_every.map(|every| rt.watch(every));
                Ok(LoadedPolicy {
                    policy: rt.clone(),
                    runtime: Some(rt),
                    watch,
                })
            }
            PolicyChoice::Custom(p) => Ok(LoadedPolicy {
                policy: p.clone(),
                runtime: None,
                watch: None,
            }),
        }
    }
}

/// Where the prompt counter comes from.
#[derive(Clone)]
pub enum TokenizerChoice {
    /// A GGUF model file (metadata only is read), with the user's
    /// `--chat-template` / `--served-model-name`.
    Gguf(PathBuf, TokenizerOverrides),
    /// Any other implementation.
    Custom(Arc<dyn PromptCounter>),
}

impl std::fmt::Debug for TokenizerChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TokenizerChoice::Gguf(p, o) => f.debug_tuple("Gguf").field(p).field(o).finish(),
            TokenizerChoice::Custom(_) => f.write_str("Custom"),
        }
    }
}

impl TokenizerChoice {
    /// Loads the counter (off the async threads).
    pub async fn load(&self) -> Result<Arc<dyn PromptCounter>, PoolError> {
        match self {
            TokenizerChoice::Gguf(path, overrides) => {
                let path = path.clone();
                let p2 = path.clone();
                let o = overrides.clone();
                tokio::task::spawn_blocking(move || gguf_counter_with(&p2, &o))
                    .await
                    .map_err(|e| PoolError::Tokenizer {
                        path,
                        source: Box::new(e),
                    })?
            }
            TokenizerChoice::Custom(c) => Ok(c.clone()),
        }
    }

    /// The model file's name (the `root` of `/v1/models`), if a file.
    pub fn file_name(&self) -> Option<String> {
        match self {
            TokenizerChoice::Gguf(p, _) => Some(rngd_api::models::root(p)),
            TokenizerChoice::Custom(_) => None,
        }
    }
}

/// Where the endpoint list comes from.
#[derive(Clone)]
pub enum SourceChoice {
    /// A fixed list (flags).
    Static(Vec<Endpoint>),
    /// A JSON file, reloaded when it changes (checked every `poll`).
    File {
        /// The file.
        path: PathBuf,
        /// Poll interval ([`DEFAULT_FILE_POLL`] is the usual one).
        poll: Duration,
    },
    /// The ready pods of an `InferencePool`, watched through the Kubernetes API.
    #[cfg(feature = "kube")]
    Kube(crate::discovery::KubeOptions),
    /// Any other source (tests, benchmarks).
    Custom(Arc<dyn EndpointSource>),
}

impl std::fmt::Debug for SourceChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SourceChoice::Static(v) => f.debug_tuple("Static").field(&v.len()).finish(),
            SourceChoice::File { path, .. } => f.debug_tuple("File").field(path).finish(),
            #[cfg(feature = "kube")]
            SourceChoice::Kube(k) => f
                .debug_tuple("Kube")
                .field(&format_args!("{}/{}", k.namespace, k.pool_name))
                .finish(),
            SourceChoice::Custom(_) => f.write_str("Custom"),
        }
    }
}

impl SourceChoice {
    /// The InferencePool this source follows (the `name` label of the
    /// `inference_pool_*` metrics), if it is discovery.
    pub fn pool_name(&self) -> Option<&str> {
        match self {
            #[cfg(feature = "kube")]
            SourceChoice::Kube(k) => Some(&k.pool_name),
            _ => None,
        }
    }

    /// A file source polled at the default interval.
    pub fn file(path: impl Into<PathBuf>) -> Self {
        SourceChoice::File {
            path: path.into(),
            poll: DEFAULT_FILE_POLL,
        }
    }
}

/// How live load is added to the list.
#[derive(Debug, Clone)]
pub struct ScrapeOptions {
    /// Interval of the endpoints' `/metrics` scrapes; `None` = no scraping
    /// (the list's own `healthy` and load figures are used as they are).
    pub every: Option<Duration>,
    /// Scraped data older than this marks an endpoint unhealthy.
    pub stale_after: Duration,
    /// The load gauges' names on the endpoints' pages (default: vLLM's).
    pub names: crate::LoadNames,
}

impl Default for ScrapeOptions {
    fn default() -> Self {
        ScrapeOptions {
            every: Some(crate::scrape::DEFAULT_SCRAPE_INTERVAL),
            stale_after: crate::scrape::DEFAULT_STALE_AFTER,
            names: crate::LoadNames::default(),
        }
    }
}

/// A running endpoint source and its background tasks (stopped on drop).
pub struct RunningSource {
    /// The snapshot source the picker reads.
    pub source: Arc<dyn EndpointSource>,
    tasks: Vec<JoinHandle<()>>,
    /// The discovery under the scraper, if the source is one.
    #[cfg(feature = "kube")]
    discovery: Option<Arc<crate::discovery::KubeEndpoints>>,
}

impl RunningSource {
    /// Registers the source's own metrics (discovery's) in `r`; nothing for
    /// other sources.
    pub fn register_metrics(&self, r: &prometheus::Registry) -> Result<(), PoolError> {
        #[cfg(feature = "kube")]
        if let Some(d) = &self.discovery {
            d.register_metrics(r)?;
        }
        let _ = r;
        Ok(())
    }

    /// The discovery under the scraper, if the source is one (its sync and
    /// staleness state).
    #[cfg(feature = "kube")]
    pub fn discovery(&self) -> Option<&Arc<crate::discovery::KubeEndpoints>> {
        self.discovery.as_ref()
    }
}

impl Drop for RunningSource {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl std::fmt::Debug for RunningSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunningSource")
            .field("tasks", &self.tasks.len())
            .finish_non_exhaustive()
    }
}

impl SourceChoice {
    /// Builds the source, starts the file or Kubernetes watch and the
    /// scraper. `scrape_failures` counts failed scrapes.
    pub async fn start(
        &self,
        scrape: ScrapeOptions,
        scrape_failures: Option<prometheus::IntCounter>,
    ) -> Result<RunningSource, PoolError> {
        #[cfg(feature = "kube")]
        let mut discovery = None;
        let mut tasks = Vec::new();
        let base: Arc<dyn EndpointSource> = match self {
            SourceChoice::Static(list) => StaticEndpoints::new(list.clone()),
            SourceChoice::File { path, poll } => {
                let f = FileEndpoints::load(path)?;
                tasks.push(f.watch(*poll));
                f
            }
            #[cfg(feature = "kube")]
            SourceChoice::Kube(opts) => {
                let d = crate::discovery::start(opts).await?;
                tasks.push(d.task);
                discovery = Some(Arc::clone(&d.source));
                d.source
            }
            SourceChoice::Custom(s) => s.clone(),
        };
        let source: Arc<dyn EndpointSource> = match scrape.every {
            None => base,
            Some(every) => {
                let timeout = scrape.stale_after.max(Duration::from_millis(200));
                let scraped = ScrapedEndpoints::named(
                    base,
                    Arc::new(HttpFetcher::new(timeout)?),
                    scrape.stale_after,
                    scrape_failures,
                    scrape.names,
                );
                tasks.push(scraped.spawn(every));
                scraped
            }
        };
        Ok(RunningSource {
            source,
            tasks,
            #[cfg(feature = "kube")]
            discovery,
        })
    }
}
