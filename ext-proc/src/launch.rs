//! Assembles a running endpoint picker from [`Options`]: the policy, the
//! endpoint source and its scraper, the prefix cache, the tokenizer (all loaded through
//! `rngd_pool::wiring`, as the gateway loads them) and the gRPC, health and
//! metrics listeners. Used by `rngd-pd ext-proc` and the benchmark; the same
//! shape as `rngd_gateway::launch`.

use std::net::SocketAddr;
use std::sync::Arc;

use rngd_pool::wiring::{RunningSource, ScrapeOptions};
use rngd_pool::{PolicyChoice, SourceChoice, TokenizerChoice};

use crate::ExtProcError;
use crate::metrics::EppMetrics;
use crate::picker::{Picker, PickerLimits};
use crate::processor::ProcessorConfig;
use crate::server::{self, RunningServer, ServerConfig};
use crate::tls::TlsChoice;

/// Everything a picker is started from.
#[derive(Debug, Clone)]
pub struct Options {
    /// ext_proc gRPC listener (port 0 = pick one).
    pub grpc: SocketAddr,
    /// gRPC health listener.
    pub health: SocketAddr,
    /// Metrics listener; `None` = off.
    pub metrics: Option<SocketAddr>,
    /// Where the endpoints come from.
    pub endpoints: SourceChoice,
    /// Where each prompt's prefix is cached (`rngd_pd.prefix_cache`): the
    /// KV-event index over the given streams and those the endpoint source
    /// names, with the router's estimates (`rngd_pool::cache`); `None` =
    /// routing on load alone.
    pub cache: Option<rngd_pool::CacheOptions>,
    /// Live load scraping of the endpoints.
    pub scrape: ScrapeOptions,
    /// The policy.
    pub policy: PolicyChoice,
    /// The prompt counter; `None` = prompt tokens are not counted (the
    /// request rules still apply).
    pub tokenizer: Option<TokenizerChoice>,
    /// State-machine limits (largest buffered body, re-sent chunk size).
    pub processor: ProcessorConfig,
    /// Admission (slots, waiting room, body-byte budget) and the model names
    /// that label metrics.
    pub limits: PickerLimits,
    /// Bearer token of the policy admin API (`GET`/`PUT /admin/policy`, every
    /// verb authenticated); `None` = off.
    pub admin_token: Option<String>,
    /// The admin API's own listener (loopback by default); port 0 picks one
    /// ([`Launched::admin_addr`]).
    pub admin_listen: SocketAddr,
    /// TLS of the ext_proc gRPC listener (the reference picker's default is
    /// TLS with a self-signed certificate); the health and metrics listeners
    /// stay plaintext.
    pub tls: TlsChoice,
}

/// A running picker.
#[derive(Debug)]
pub struct Launched {
    /// The listeners.
    pub server: RunningServer,
    /// The picker (metrics).
    pub picker: Arc<Picker>,
    /// Bound address of the admin listener, when the admin API is on.
    pub admin_addr: Option<SocketAddr>,
    _admin: Option<rngd_policy_host::admin::AdminServer>,
    _source: RunningSource,
    _cache: Option<rngd_pool::RunningCache>,
    _policy_watch: AbortOnDrop,
}

impl Launched {
    /// Waits for the listeners to stop; the first error wins.
    pub async fn wait(&mut self) -> Result<(), ExtProcError> {
        self.server.wait().await
    }

    /// Drains and stops the picker ([`RunningServer::drain`]); whether every
    /// stream ended within `timeout`.
    pub async fn drain(self, timeout: std::time::Duration) -> bool {
        self.server.drain(timeout).await
    }
}

/// The policy file watcher, stopped with the picker.
#[derive(Debug)]
struct AbortOnDrop(Option<tokio::task::JoinHandle<()>>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if let Some(t) = &self.0 {
            t.abort();
        }
    }
}

/// Starts a picker.
pub async fn launch(opts: Options) -> Result<Launched, ExtProcError> {
    let tls = opts.tls.start()?;
    let metrics = EppMetrics::new()?;
    let loaded = opts
        .policy
        .load()
        .await
        .map_err(|source| ExtProcError::Policy {
            path: match &opts.policy {
                PolicyChoice::Wasm { module, .. } => module.clone(),
                PolicyChoice::Custom(_) => "(custom)".into(),
            },
            source,
        })?;
    if let Some(rt) = &loaded.runtime {
        rt.register_metrics(&metrics.registry)
            .map_err(|source| ExtProcError::Metrics {
                source: rngd_telemetry::TelemetryError::Metric {
                    name: "policy runtime metrics".into(),
                    source,
                },
            })?;
    }
    let source = opts
        .endpoints
        .start(opts.scrape, Some(metrics.scrape_failures.clone()))
        .await?;
    source.register_metrics(&metrics.registry)?;
    let counter = match &opts.tokenizer {
        Some(t) => Some(t.load().await?),
        None => {
            tracing::warn!("prompt tokens are not counted (no tokenizer)");
            None
        }
    };
    let mut pool = rngd_pool::Picker::new(loaded.policy.clone(), source.source.clone())
        .with_tokenizer_digest(counter.as_ref().and_then(|c| c.digest().map(String::from)));
    pool.register_metrics(&metrics.registry)?;
    let cache = match &opts.cache {
        Some(c) => {
            let running = rngd_pool::PrefixCache::start(c.clone(), source.source.clone()).await?;
            running.cache.register_metrics(&metrics.registry)?;
            pool = pool.with_prefix_source(running.cache.clone());
            Some(running)
        }
        None => None,
    };
    let picker = Arc::new(Picker::with_limits(
        pool,
        counter,
        metrics,
        opts.limits.clone(),
    ));
    if let Some(name) = opts.endpoints.pool_name() {
        picker.set_pool_name(name);
    }
    // The admin API on its own listener, never the metrics port.
    let token = opts
        .admin_token
        .as_deref()
        .and_then(rngd_policy_host::AdminToken::new);
    let admin = match (&loaded.runtime, token) {
        (Some(rt), Some(token)) => Some(
            rngd_policy_host::admin::serve(
                Arc::clone(rt),
                rngd_policy_host::AdminOptions {
                    listen: opts.admin_listen,
                    token: Some(token),
                    ..Default::default()
                },
            )
            .await
            .map_err(|source| ExtProcError::Policy {
                path: "(admin listener)".into(),
                source,
            })?,
        ),
        _ => None,
    };
    let server = server::start(
        Arc::clone(&picker),
        ServerConfig {
            grpc: opts.grpc,
            health: opts.health,
            metrics: opts.metrics,
            processor: opts.processor,
            extra_routes: None,
            tls,
        },
    )
    .await?;
    Ok(Launched {
        server,
        picker,
        admin_addr: admin.as_ref().map(|a| a.local_addr()),
        _admin: admin,
        _source: source,
        _cache: cache,
        _policy_watch: AbortOnDrop(loaded.watch),
    })
}
