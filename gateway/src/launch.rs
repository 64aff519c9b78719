//! Assembles a running gateway from options: tokenizer from the model file,
//! the wasm policy (with hot reload and the admin API), the endpoint table and
//! its scraper, the main listener and the optional KPI listener. Used by
//! `rngd-pd gateway` and by the benchmark.

use std::net::SocketAddr;
use std::sync::Arc;

use rngd_pool::wiring::RunningSource;
pub use rngd_pool::wiring::{PolicyChoice, ScrapeOptions, SourceChoice, TokenizerChoice};
use tokio_util::sync::CancellationToken;

use crate::error::GatewayError;
use crate::server;
use crate::state::{Gateway, GatewayConfig};

/// Everything a gateway is started from.
#[derive(Debug, Clone)]
pub struct LaunchOptions {
    /// Main listener `host:port` (port 0 = pick).
    pub listen: String,
    /// KPI listener `host:port` (`AIRM_METRICS_PORT`); `None` = off.
    pub kpi_listen: Option<String>,
    /// The workers.
    pub endpoints: SourceChoice,
    /// The policy.
    pub policy: PolicyChoice,
    /// Bearer token of the policy admin API (`GET`/`PUT /admin/policy`, every
    /// verb authenticated); `None` = admin API off.
    pub admin_token: Option<String>,
    /// The admin API's own listener (loopback by default, never the public
    /// one); port 0 picks one ([`Launched::admin_addr`]).
    pub admin_listen: SocketAddr,
    /// The tokenizer.
    pub tokenizer: TokenizerChoice,
    /// Request handling settings.
    pub config: GatewayConfig,
    /// Live load scraping of the workers' `/metrics`.
    pub scrape: ScrapeOptions,
    /// Where each prompt's prefix is cached (`rngd_pd.prefix_cache`): the
    /// KV-event index over the streams given here (`--kv-events`) and those
    /// the endpoint source names, with the router's estimates
    /// (`rngd_pool::cache`); `None` = routing on load alone.
    pub cache: Option<rngd_pool::CacheOptions>,
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
    /// Bound address of the admin listener, when the admin API is on.
    pub admin_addr: Option<SocketAddr>,
    _admin: Option<rngd_policy_host::admin::AdminServer>,
    stop: CancellationToken,
    tasks: Vec<tokio::task::JoinHandle<Result<(), GatewayError>>>,
    background: Vec<tokio::task::JoinHandle<()>>,
    _source: RunningSource,
    _cache: Option<rngd_pool::RunningCache>,
}

impl Launched {
    /// Asks every listener to stop (in-flight requests finish).
    pub fn shutdown(&self) {
        self.stop.cancel();
    }

    /// Waits (at most `within`) until an endpoint that can decode is
    /// healthy in the snapshot, i.e. the scraper has seen it answer; returns
    /// whether it did.
    pub async fn wait_ready(&self, within: std::time::Duration) -> bool {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            if rngd_pool::can_serve(&self.gateway.endpoints().snapshot()) {
                return true;
            }
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
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
    if let SourceChoice::Static(list) = &opts.endpoints
        && list.is_empty()
    {
        return Err(GatewayError::Config(
            "no endpoints: give --prefill/--decode URLs or an endpoints file".into(),
        ));
    }
    opts.config
        .edge
        .check()
        .map_err(|e| GatewayError::Config(e.to_string()))?;
    let mut config = opts.config.clone();
    let tokenizer = opts.tokenizer.load().await?;
    if config.model_root.is_none() {
        config.model_root = opts.tokenizer.file_name();
    }
    let loaded = opts
        .policy
        .load()
        .await
        .map_err(|e| GatewayError::Policy(Box::new(e)))?;
    let background: Vec<tokio::task::JoinHandle<()>> = loaded.watch.into_iter().collect();
    let source = opts.endpoints.start(opts.scrape, None).await?;
    let mut picker = rngd_pool::Picker::new(loaded.policy.clone(), source.source.clone())
        .with_tokenizer_digest(tokenizer.digest().map(String::from));
    let cache = match &opts.cache {
        Some(c) => {
            let running = rngd_pool::PrefixCache::start(c.clone(), source.source.clone()).await?;
            picker = picker.with_prefix_source(running.cache.clone());
            Some(running)
        }
        None => None,
    };
    let gateway = Gateway::new(config, picker, tokenizer)?;
    source
        .register_metrics(gateway.metrics().registry())
        .map_err(GatewayError::Pool)?;
    gateway
        .picker
        .register_metrics(gateway.metrics().registry())
        .map_err(GatewayError::Pool)?;
    if let Some(c) = &cache {
        c.cache
            .register_metrics(gateway.metrics().registry())
            .map_err(GatewayError::Pool)?;
    }
    let app = server::router(gateway.clone());
    let mut admin = None;
    if let Some(rt) = &loaded.runtime {
        rt.register_metrics(gateway.metrics().registry())
            .map_err(|e| GatewayError::Policy(Box::new(e)))?;
        // The admin API on its own listener, never the public one.
        if let Some(token) = opts
            .admin_token
            .as_deref()
            .and_then(rngd_policy_host::AdminToken::new)
        {
            admin = Some(
                rngd_policy_host::admin::serve(
                    rt.clone(),
                    rngd_policy_host::AdminOptions {
                        listen: opts.admin_listen,
                        token: Some(token),
                        ..Default::default()
                    },
                )
                .await
                .map_err(|e| GatewayError::Policy(Box::new(e)))?,
            );
        }
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
    let edge = gateway.config.edge.clone();
    tasks.push(tokio::spawn(server::serve(
        listener,
        app,
        edge.clone(),
        async move { s.cancelled().await },
    )));
    let mut kpi_addr = None;
    if let Some(k) = &opts.kpi_listen {
        let l = bind(k).await?;
        kpi_addr = Some(l.local_addr().map_err(|source| GatewayError::Listen {
            addr: k.clone(),
            source,
        })?);
        let s = stop.clone();
        let app = server::kpi_router(gateway.metrics().clone());
        // The KPI listener stays plain HTTP (a scraper's), whatever the main one.
        let kpi_edge = rngd_http_edge::Options { tls: None, ..edge };
        tasks.push(tokio::spawn(server::serve(l, app, kpi_edge, async move {
            s.cancelled().await
        })));
    }
    tracing::info!(%addr, kpi = ?kpi_addr, model = gateway.model_name(), endpoints = gateway.endpoints().snapshot().len(), "gateway up");
    Ok(Launched {
        addr,
        kpi_addr,
        admin_addr: admin.as_ref().map(|a| a.local_addr()),
        _admin: admin,
        gateway,
        stop,
        tasks,
        background,
        _source: source,
        _cache: cache,
    })
}
