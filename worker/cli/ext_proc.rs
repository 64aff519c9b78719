//! `rngd-pd ext-proc`: the Envoy ext_proc endpoint picker (GIE protocol); the
//! work is in `rngd-ext-proc`. This module parses flags, loads the policy, the
//! endpoints file and the tokenizer, and prints the bound addresses.

use std::io::Write;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use rngd_api::env;
use rngd_ext_proc::BoxError;
use rngd_ext_proc::endpoints::{
    DEFAULT_FILE_POLL, EndpointSource, FileEndpoints, HttpFetcher, ScrapedEndpoints,
};
use rngd_ext_proc::metrics::EppMetrics;
use rngd_ext_proc::picker::{Picker, PromptCounter};
use rngd_ext_proc::policy::RuntimeDecider;
use rngd_ext_proc::processor::{DEFAULT_MAX_BODY, MAX_CHUNK, ProcessorConfig};
use rngd_ext_proc::server::{self, ServerConfig};
use rngd_policy_host::{PolicyRuntime, PolicySource, SandboxLimits};

/// Flags.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Listen host of every port (Envoy usually runs elsewhere, hence all interfaces).
    #[arg(long, env = env::RNGD_PD_HOST, default_value = "0.0.0.0")]
    pub host: IpAddr,
    /// ext_proc gRPC port (0 = pick one and print it).
    #[arg(long, default_value_t = server::DEFAULT_GRPC_PORT)]
    pub grpc_port: u16,
    /// gRPC health port (services `liveness`, `readiness`, the ext_proc service).
    #[arg(long, default_value_t = server::DEFAULT_HEALTH_PORT)]
    pub health_port: u16,
    /// Prometheus metrics port (`GET /metrics`; also the policy admin API when an admin token is set).
    #[arg(long, default_value_t = server::DEFAULT_METRICS_PORT)]
    pub metrics_port: u16,
    /// Endpoints file: JSON list of endpoints (hot-reloaded).
    #[arg(long, env = env::RNGD_PD_ENDPOINTS)]
    pub endpoints: PathBuf,
    /// Policy module (`.wasm`, hot-reloaded when the file changes).
    #[arg(long, env = env::RNGD_PD_POLICY)]
    pub policy: PathBuf,
    /// Policy plugin configuration (JSON file); default `{}`.
    #[arg(long, env = env::RNGD_PD_POLICY_CONFIG)]
    pub policy_config: Option<PathBuf>,
    /// GGUF model whose tokenizer counts prompt tokens (default: `$RNGD_PD_MODEL`, then the cache).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Do not count prompt tokens (the policy then cannot check the context length).
    #[arg(long)]
    pub no_tokenizer: bool,
    /// Interval of the endpoints' `/metrics` scrapes, ms (0 = no scraping: the file's `healthy` is used as is).
    #[arg(long, default_value_t = 50)]
    pub scrape_interval_ms: u64,
    /// Scraped data older than this marks an endpoint unhealthy, ms.
    #[arg(long, default_value_t = 2000)]
    pub stale_after_ms: u64,
    /// Poll interval of the endpoints file and the policy module, ms.
    #[arg(long, default_value_t = DEFAULT_FILE_POLL.as_millis() as u64)]
    pub watch_ms: u64,
    /// Largest request body buffered for a pick, bytes.
    #[arg(long, default_value_t = DEFAULT_MAX_BODY)]
    pub max_body_bytes: usize,
    /// Bearer token for `PUT /admin/policy` on the metrics port; unset = admin API off.
    #[arg(long, env = env::RNGD_PD_ADMIN_TOKEN, hide_env_values = true)]
    pub admin_token: Option<String>,
}

/// The engine's GGUF tokenizer as a prompt counter.
struct GgufCounter(rngd_engine::tokenizer::Tokenizer);

impl PromptCounter for GgufCounter {
    fn count(&self, text: &str) -> Result<usize, BoxError> {
        Ok(self.0.encode(text)?.len())
    }
}

fn load_counter(args: &Args) -> anyhow::Result<Option<Arc<dyn PromptCounter>>> {
    if args.no_tokenizer {
        tracing::warn!("prompt tokens are not counted (--no-tokenizer)");
        return Ok(None);
    }
    let path = rngd_engine::model_fetch::resolve(args.model.as_deref())
        .context("model for the tokenizer")?;
    let tok = rngd_engine::tokenizer::Tokenizer::from_gguf(&path)
        .with_context(|| format!("tokenizer of {}", path.display()))?;
    tracing::info!(model = %path.display(), "tokenizer loaded");
    Ok(Some(Arc::new(GgufCounter(tok))))
}

fn read_config(path: Option<&Path>) -> anyhow::Result<Vec<u8>> {
    match path {
        Some(p) => {
            std::fs::read(p).with_context(|| format!("reading policy config {}", p.display()))
        }
        None => Ok(b"{}".to_vec()),
    }
}

/// Runs the subcommand.
pub async fn run(args: Args) -> anyhow::Result<()> {
    let watch = Duration::from_millis(args.watch_ms.max(10));
    let runtime = PolicyRuntime::new(
        PolicySource {
            module: args.policy.clone(),
            config: read_config(args.policy_config.as_deref())?,
        },
        SandboxLimits::default(),
    )
    .with_context(|| format!("loading policy {}", args.policy.display()))?;
    let _policy_watch = runtime.watch(watch);

    let metrics = EppMetrics::new()?;
    runtime
        .register_metrics(&metrics.registry)
        .context("registering the policy metrics")?;

    let file = FileEndpoints::load(&args.endpoints)?;
    let _file_watch = file.watch(watch);
    let mut _scrape = None;
    let source: Arc<dyn EndpointSource> = if args.scrape_interval_ms == 0 {
        file
    } else {
        let stale = Duration::from_millis(args.stale_after_ms);
        let scraped = ScrapedEndpoints::new(
            file,
            Arc::new(HttpFetcher::new(stale)),
            stale,
            Some(metrics.clone()),
        );
        _scrape = Some(scraped.spawn(Duration::from_millis(args.scrape_interval_ms)));
        scraped
    };

    let counter = load_counter(&args)?;
    let picker = Picker::new(
        Arc::new(RuntimeDecider(Arc::clone(&runtime))),
        source,
        counter,
        metrics,
    );
    let running = server::start(
        Arc::new(picker),
        ServerConfig {
            grpc: SocketAddr::new(args.host, args.grpc_port),
            health: SocketAddr::new(args.host, args.health_port),
            metrics: Some(SocketAddr::new(args.host, args.metrics_port)),
            processor: ProcessorConfig {
                max_body_bytes: args.max_body_bytes,
                chunk_size: MAX_CHUNK,
            },
            extra_routes: args
                .admin_token
                .clone()
                .map(|token| rngd_policy_host::admin_router(Arc::clone(&runtime), Some(token))),
        },
    )
    .await?;
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "rngd-pd ext-proc grpc listening on {}",
        running.grpc_addr
    )?;
    writeln!(
        out,
        "rngd-pd ext-proc health listening on {}",
        running.health_addr
    )?;
    if let Some(m) = running.metrics_addr {
        writeln!(out, "rngd-pd ext-proc metrics listening on {m}")?;
    }
    out.flush()?;
    drop(out);
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        r = running.wait() => r?,
        _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT: stopping"),
        _ = term.recv() => tracing::info!("SIGTERM: stopping"),
    }
    Ok(())
}
