//! Assembles a running gateway from options: tokenizer from the model file,
//! the wasm policy (with hot reload and the admin API), the endpoint table and
//! its scraper, the main listener and the optional KPI listener. Used by
//! `rngd-pd gateway` and by the benchmark.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use rngd_policy_core::Endpoint;
use rngd_policy_host::{PolicyRuntime, PolicySource, SandboxLimits};
use tokio_util::sync::CancellationToken;

use crate::endpoints::{EndpointTable, HttpLoadSource};
use crate::error::{BoxError, GatewayError};
use crate::policy::Policy;
use crate::server::{self, Gateway, GatewayConfig};
use crate::tokens::PromptTokenizer;

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

/// Where the tokenizer comes from.
#[derive(Clone)]
pub enum TokenizerChoice {
    /// A GGUF model file (metadata only is read).
    Gguf(PathBuf),
    /// Any other implementation.
    Custom(Arc<dyn PromptTokenizer>),
}

impl std::fmt::Debug for TokenizerChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TokenizerChoice::Gguf(p) => f.debug_tuple("Gguf").field(p).finish(),
            TokenizerChoice::Custom(_) => f.write_str("Custom"),
        }
    }
}

/// Everything a gateway is started from.
#[derive(Debug, Clone)]
pub struct LaunchOptions {
    /// Main listener `host:port` (port 0 = pick).
    pub listen: String,
    /// KPI listener `host:port` (`AIRM_METRICS_PORT`); `None` = off.
    pub kpi_listen: Option<String>,
    /// The workers.
    pub endpoints: Vec<Endpoint>,
    /// The policy.
    pub policy: PolicyChoice,
    /// Bearer token of `PUT /admin/policy`; `None` = admin API off.
    pub admin_token: Option<String>,
    /// The tokenizer.
    pub tokenizer: TokenizerChoice,
    /// Request handling settings.
    pub config: GatewayConfig,
    /// Scrape period of the workers' `/metrics`.
    pub scrape_every: Duration,
    /// Load data older than this marks an endpoint unhealthy.
    pub stale_after: Duration,
}

/// A running gateway.
#[derive(Debug)]
pub struct Launched {
    /// Bound address of the main listener.
    pub addr: SocketAddr,
    /// Bound address of the KPI listener.
    pub kpi_addr: Option<SocketAddr>,
    /// The state (metrics, endpoints).
    pub gateway: Arc<Gateway>,
    stop: CancellationToken,
    tasks: Vec<tokio::task::JoinHandle<Result<(), GatewayError>>>,
    background: Vec<tokio::task::JoinHandle<()>>,
}

impl Launched {
    /// Asks every listener to stop (in-flight requests finish).
    pub fn shutdown(&self) {
        self.stop.cancel();
    }

    /// Waits for the listeners to stop; the first error wins.
    pub async fn join(self) -> Result<(), GatewayError> {
        let mut result = Ok(());
        for t in self.tasks {
            match t.await {
                Ok(Err(e)) if result.is_ok() => result = Err(e),
                Err(e) if result.is_ok() => {
                    result = Err(GatewayError::Config(format!("listener task failed: {e}")))
                }
                _ => {}
            }
        }
        for b in self.background {
            b.abort();
        }
        result
    }
}

async fn bind(addr: &str) -> Result<tokio::net::TcpListener, GatewayError> {
    tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| GatewayError::Listen {
            addr: addr.to_string(),
            source,
        })
}

/// Starts a gateway.
pub async fn launch(opts: LaunchOptions) -> Result<Launched, GatewayError> {
    if opts.endpoints.is_empty() {
        return Err(GatewayError::Config(
            "no endpoints: give --prefill/--decode URLs or an endpoints file".into(),
        ));
    }
    let mut config = opts.config.clone();
    let tokenizer: Arc<dyn PromptTokenizer> = match &opts.tokenizer {
        TokenizerChoice::Gguf(path) => {
            let path = path.clone();
            let t = tokio::task::spawn_blocking(move || {
                rngd_engine::tokenizer::Tokenizer::from_gguf(&path)
            })
            .await
            .map_err(|e| GatewayError::Tokenizer(Box::new(e)))?
            .map_err(|e| GatewayError::Tokenizer(Box::new(e)))?;
            if let Some(stem) = match &opts.tokenizer {
                TokenizerChoice::Gguf(p) => p.file_stem().and_then(|s| s.to_str()),
                TokenizerChoice::Custom(_) => None,
            } {
                config.model_aliases.push(stem.to_string());
            }
            Arc::new(t)
        }
        TokenizerChoice::Custom(t) => t.clone(),
    };
    let mut background = Vec::new();
    let (policy, runtime): (Arc<dyn Policy>, Option<Arc<PolicyRuntime>>) = match &opts.policy {
        PolicyChoice::Wasm {
            module,
            config: pcfg,
            limits,
            watch_every,
        } => {
            let source = PolicySource {
                module: module.clone(),
                config: pcfg.clone(),
            };
            let limits = limits.clone();
            let rt = tokio::task::spawn_blocking(move || PolicyRuntime::new(source, limits))
                .await
                .map_err(|e| GatewayError::Policy(Box::new(e)))?
                .map_err(|e| GatewayError::Policy(Box::new(e) as BoxError))?;
            if let Some(every) = watch_every {
                background.push(rt.watch(*every));
            }
            (rt.clone(), Some(rt))
        }
        PolicyChoice::Custom(p) => (p.clone(), None),
    };
    let table = EndpointTable::new(opts.endpoints.clone(), opts.stale_after);
    let source = Arc::new(HttpLoadSource::new(
        opts.scrape_every.max(Duration::from_millis(200)),
    )?);
    background.push(table.spawn_scraper(source, opts.scrape_every));
    let gateway = Gateway::new(config, policy, tokenizer, table)?;
    let mut app = server::router(gateway.clone());
    if let Some(rt) = &runtime {
        rt.register_metrics(gateway.metrics().registry())
            .map_err(|e| GatewayError::Policy(Box::new(e)))?;
        app = app.merge(rngd_policy_host::admin_router(
            rt.clone(),
            opts.admin_token.clone(),
        ));
    }
    let stop = CancellationToken::new();
    let listener = bind(&opts.listen).await?;
    let addr = listener
        .local_addr()
        .map_err(|source| GatewayError::Listen {
            addr: opts.listen.clone(),
            source,
        })?;
    let mut tasks = Vec::new();
    let s = stop.clone();
    tasks.push(tokio::spawn(server::serve(listener, app, async move {
        s.cancelled().await
    })));
    let mut kpi_addr = None;
    if let Some(k) = &opts.kpi_listen {
        let l = bind(k).await?;
        kpi_addr = Some(l.local_addr().map_err(|source| GatewayError::Listen {
            addr: k.clone(),
            source,
        })?);
        let s = stop.clone();
        let app = server::kpi_router(gateway.metrics().clone());
        tasks.push(tokio::spawn(server::serve(l, app, async move {
            s.cancelled().await
        })));
    }
    tracing::info!(%addr, kpi = ?kpi_addr, model = gateway.model_name(), endpoints = opts.endpoints.len(), "gateway up");
    Ok(Launched {
        addr,
        kpi_addr,
        gateway,
        stop,
        tasks,
        background,
    })
}
