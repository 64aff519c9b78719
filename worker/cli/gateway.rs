//! `rngd-pd gateway`: the OpenAI-compatible gateway. Parses flags and starts
//! [`rngd_gateway::launch`].

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use rngd_api::env;
use rngd_gateway::GatewayConfig;
use rngd_gateway::launch::{
    LaunchOptions, PolicyChoice, ScrapeOptions, SourceChoice, TokenizerChoice,
};
use rngd_policy_core::Role;
use rngd_pool::source as endpoints;

/// Start of the line naming the KPI endpoint (printed before the listening line).
pub const KPI_PREFIX: &str = "rngd-pd gateway kpi metrics on http://";

/// Flags.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Listen address `HOST:PORT` (port 0 = pick one; the bound address is printed).
    #[arg(long, env = env::RNGD_PD_GATEWAY_LISTEN, default_value = "127.0.0.1:8000")]
    pub listen: String,
    /// Prefill worker URL (`http://HOST:PORT`); repeat for several.
    #[arg(long = "prefill", value_name = "URL")]
    pub prefill: Vec<String>,
    /// Decode worker URL (`http://HOST:PORT`); repeat for several.
    #[arg(long = "decode", value_name = "URL")]
    pub decode: Vec<String>,
    /// Solo worker URL (whole requests only); repeat for several.
    #[arg(long = "solo", value_name = "URL")]
    pub solo: Vec<String>,
    /// Endpoints file: a JSON list of endpoints (address, role, vendor, node, seq_len, transports).
    #[arg(long, env = env::RNGD_PD_ENDPOINTS)]
    pub endpoints: Option<PathBuf>,
    /// InferencePool discovery (instead of `--endpoints` and worker URLs).
    #[command(flatten)]
    pub pool: crate::pool::PoolArgs,
    /// Policy module (`.wasm`, proxy-wasm 0.2.1); default: the built `pd_default` guest.
    #[arg(long, env = env::RNGD_PD_POLICY)]
    pub policy: Option<PathBuf>,
    /// Plugin configuration of the policy (JSON file).
    #[arg(long, env = env::RNGD_PD_POLICY_CONFIG)]
    pub policy_config: Option<PathBuf>,
    /// The model: file, chat template, served names.
    #[command(flatten)]
    pub model_args: crate::flags::ModelArgs,
    /// Bearer token of the policy admin API (every verb, GET included); unset = admin API off.
    #[arg(long, env = env::RNGD_PD_ADMIN_TOKEN, hide_env_values = true)]
    pub admin_token: Option<String>,
    /// API key of the public routes (vLLM's `--api-key`): every route but
    /// `/health`, `/ping`, `/metrics` and `/version` wants `Authorization:
    /// Bearer KEY`; the gateway sends it to the workers (give them the same).
    #[arg(long, env = env::VLLM_API_KEY, hide_env_values = true, value_parser = crate::flags::parse_api_key)]
    pub api_key: Option<rngd_http_edge::api_key::ApiKey>,
    /// Listener of the policy admin API (`GET`/`PUT /admin/policy`), apart
    /// from the public and metrics ports; loopback by default.
    #[arg(long, env = env::RNGD_PD_ADMIN_LISTEN, default_value_t = rngd_policy_host::admin::DEFAULT_ADMIN_LISTEN)]
    pub admin_listen: std::net::SocketAddr,
    /// Compiled context length of the workers given by URL.
    #[arg(long, env = env::RNGD_PD_SEQ_LEN, default_value_t = 512)]
    pub seq_len: u32,
    /// KV transports the workers given by URL support; default: every
    /// transport this build has (`rngd_kv_transport::registry::KNOWN`).
    #[arg(long = "worker-transport", default_values_t = rngd_kv_transport::registry::KNOWN.iter().map(|t| t.to_string()))]
    pub worker_transports: Vec<String>,
    /// Port of the separate KPI endpoint (`airm_*` gauges); unset = off.
    #[arg(long, env = env::AIRM_METRICS_PORT)]
    pub metrics_port: Option<u16>,
    /// Host of the KPI endpoint.
    #[arg(long, default_value = "127.0.0.1")]
    pub metrics_host: String,
    /// Largest request body, bytes.
    #[arg(long, env = env::RNGD_PD_BODY_LIMIT, default_value_t = 1 << 20)]
    pub body_limit: usize,
    /// Prefill call timeout, ms.
    #[arg(long, env = env::RNGD_PD_GATEWAY_PREFILL_TIMEOUT_MS, default_value_t = 120_000)]
    pub prefill_timeout_ms: u64,
    /// Decode call timeout (to the first byte when streaming), ms.
    #[arg(long, env = env::RNGD_PD_GATEWAY_DECODE_TIMEOUT_MS, default_value_t = 600_000)]
    pub decode_timeout_ms: u64,
    /// Longest silence inside a streamed decode, ms.
    #[arg(long, default_value_t = 60_000)]
    pub stream_idle_timeout_ms: u64,
    /// Times one answer may move to another decode-capable worker when its
    /// worker dies or its stream breaks (0 = never): a stream continues
    /// where it stopped, a whole answer is asked again.
    #[arg(long, default_value_t = rngd_gateway::state::DEFAULT_MIGRATION_LIMIT)]
    pub migration_limit: u32,
    /// What a handoff whose decode worker cannot load the KV (lease over,
    /// KV gone or taken) becomes: `recompute` serves it whole
    /// on that worker with the prefill's seed; `fail` answers the refusal.
    #[arg(long, env = env::RNGD_PD_GATEWAY_KV_LOAD_FAILURE_POLICY, default_value = "recompute")]
    pub kv_load_failure_policy: rngd_api::pd::KvLoadFailurePolicy,
    /// Requests served at once (policy call to the end of the response).
    #[arg(long, default_value_t = 256)]
    pub max_concurrent: usize,
    /// Requests that may wait for a slot beyond `--max-concurrent`; more get
    /// 429 with `Retry-After` at once.
    #[arg(long, default_value_t = 1024)]
    pub max_queued: usize,
    /// Longest wait for a slot, ms; then 429.
    #[arg(long, default_value_t = 5_000)]
    pub queue_timeout_ms: u64,
    /// Time a client has to send its whole body, ms; then 408.
    #[arg(long, default_value_t = 30_000)]
    pub body_timeout_ms: u64,
    /// PEM certificate chain (leaf first) for TLS on the main listener
    /// (vLLM's flag); needs `--ssl-keyfile`. Loaded once at start. The KPI
    /// and admin listeners stay plain HTTP on their own (loopback by
    /// default) addresses.
    #[arg(long, value_name = "FILE", requires = "ssl_keyfile")]
    pub ssl_certfile: Option<PathBuf>,
    /// PEM private key of `--ssl-certfile`.
    #[arg(long, value_name = "FILE", requires = "ssl_certfile")]
    pub ssl_keyfile: Option<PathBuf>,
    /// The listener limits.
    #[command(flatten)]
    pub listener: crate::flags::ListenerArgs,
    /// Worker `/metrics` scrape period, ms.
    #[arg(long, default_value_t = 50)]
    pub scrape_interval_ms: u64,
    /// Load data older than this marks an endpoint unhealthy, ms.
    #[arg(long, default_value_t = 2_000)]
    pub stale_after_ms: u64,
    /// The load gauges' names (model servers that are not vLLM).
    #[command(flatten)]
    pub load_names: crate::pool::LoadNameArgs,
    #[command(flatten)]
    pub prefix: crate::pool::PrefixArgs,
    /// Poll period of the policy module, ms (0 = no hot reload); the
    /// picker's flag of the same name also polls its endpoints file.
    /// `--policy-watch-ms` is its older spelling.
    #[arg(long, alias = "policy-watch-ms", default_value_t = 1_000)]
    pub watch_ms: u64,
    /// Validate the flags and files (endpoints, policy module and its
    /// configuration through the module's self-test, the model's tokenizer)
    /// and exit: 0 and `ok`, or a clear error.
    #[arg(long)]
    pub check: bool,
}

/// The default policy module, as every component finds it
/// ([`rngd_policy_host::locate::default_module`]: `$RNGD_PD_POLICY`, beside
/// this executable, the image path, `$CARGO_TARGET_DIR`); the error lists
/// where it looked.
pub fn default_policy_module() -> anyhow::Result<PathBuf> {
    Ok(rngd_policy_host::locate::default_module(None)?)
}

/// The endpoints file alone is watched and reloaded; URL flags (with or
/// without a file) make a fixed list.
fn endpoints_from(args: &Args) -> anyhow::Result<SourceChoice> {
    if let Some(kube) = args.pool.options() {
        if args.endpoints.is_some()
            || !args.prefill.is_empty()
            || !args.decode.is_empty()
            || !args.solo.is_empty()
        {
            anyhow::bail!(
                "--pool-name discovers the endpoints: give no --endpoints, --prefill, --decode or --solo with it"
            );
        }
        return Ok(SourceChoice::Kube(kube));
    }
    let mut eps = Vec::new();
    for (urls, role) in [
        (&args.prefill, Role::Prefill),
        (&args.decode, Role::Decode),
        (&args.solo, Role::Solo),
    ] {
        for url in urls {
            eps.push(endpoints::local_endpoint(
                endpoints::address_of(url)?,
                role,
                args.seq_len,
                &args.worker_transports,
            ));
        }
    }
    match &args.endpoints {
        Some(path) if eps.is_empty() => Ok(SourceChoice::file(path)),
        Some(path) => {
            let mut all = endpoints::load_endpoints_file(path)?;
            all.extend(eps);
            Ok(SourceChoice::Static(all))
        }
        None => Ok(SourceChoice::Static(eps)),
    }
}

/// Runs the subcommand.
pub async fn run(args: Args) -> anyhow::Result<()> {
    let endpoints = endpoints_from(&args)?;
    let module = match &args.policy {
        Some(p) => p.clone(),
        None => default_policy_module()?,
    };
    let policy_config = match &args.policy_config {
        Some(p) => std::fs::read(p)
            .with_context(|| format!("reading the policy configuration {}", p.display()))?,
        None => Vec::new(),
    };
    let model = rngd_engine::model_fetch::resolve(args.model_args.model.as_deref())?;
    let overrides = rngd_pool::TokenizerOverrides {
        chat_template: args.model_args.chat_template.clone(),
        served_model_name: args.model_args.served_model_name.first().cloned(),
    };
    let tls = match (&args.ssl_certfile, &args.ssl_keyfile) {
        (Some(cert), Some(key)) => Some(rngd_http_edge::tls::ServerTls::from_pem_files(cert, key)?),
        _ => None,
    };
    let scheme = if tls.is_some() { "https" } else { "http" };
    if args.check {
        args.listener.options().check()?;
        args.load_names.names()?;
        args.listen
            .parse::<std::net::SocketAddr>()
            .with_context(|| format!("--listen {}: expected HOST:PORT", args.listen))?;
        rngd_policy_host::check(&module, &policy_config)
            .with_context(|| format!("policy module {}", module.display()))?;
        rngd_pool::gguf_counter_with(&model, &overrides)?;
        match &endpoints {
            SourceChoice::Kube(kube) => kube.check()?,
            SourceChoice::File { path, .. } => {
                endpoints::load_endpoints_file(path)?;
            }
            _ => {}
        }
        println!("ok");
        return Ok(());
    }
    let cache = args.prefix.options(&endpoints);
    let opts = LaunchOptions {
        listen: args.listen.clone(),
        kpi_listen: args
            .metrics_port
            .map(|p| format!("{}:{p}", args.metrics_host)),
        endpoints,
        policy: PolicyChoice::Wasm {
            module,
            config: policy_config,
            limits: Default::default(),
            watch_every: (args.watch_ms > 0).then(|| Duration::from_millis(args.watch_ms)),
        },
        admin_token: args.admin_token.clone(),
        admin_listen: args.admin_listen,
        tokenizer: TokenizerChoice::Gguf(model.clone(), overrides),
        config: GatewayConfig {
            model_aliases: rngd_api::models::aliases(
                &args.model_args.served_model_name,
                Some(&model),
            ),
            model_root: None,
            api_key: args.api_key.clone(),
            seq_len: args.seq_len,
            body_limit: args.body_limit,
            prefill_timeout: Duration::from_millis(args.prefill_timeout_ms),
            decode_timeout: Duration::from_millis(args.decode_timeout_ms),
            stream_idle_timeout: Duration::from_millis(args.stream_idle_timeout_ms),
            migration_limit: args.migration_limit,
            kv_load_failure_policy: args.kv_load_failure_policy,
            max_concurrent: args.max_concurrent,
            max_queued: args.max_queued,
            queue_timeout: Duration::from_millis(args.queue_timeout_ms),
            body_timeout: Duration::from_millis(args.body_timeout_ms),
            edge: rngd_http_edge::Options {
                tls,
                ..args.listener.options()
            },
            ..GatewayConfig::default()
        },
        scrape: ScrapeOptions {
            every: Some(Duration::from_millis(args.scrape_interval_ms.max(1))),
            stale_after: Duration::from_millis(args.stale_after_ms),
            names: args.load_names.names()?,
        },
        cache,
    };
    let launched = rngd_gateway::launch::launch(opts).await?;
    // Installed before the ready lines: a signal right after them is handled.
    let stop = rngd_http_edge::shutdown_signal();
    // The KPI line comes first: readers stop at the listening line.
    if let Some(k) = launched.kpi_addr {
        println!("{KPI_PREFIX}{k}/metrics");
    }
    println!("rngd-pd gateway listening on {scheme}://{}", launched.addr);
    println!("rngd-pd gateway model {}", launched.gateway.model_name());
    use std::io::Write;
    let _ = std::io::stdout().flush();
    stop.await;
    rngd_http_edge::exit_on_next_signal();
    tracing::info!("gateway stopping: draining");
    launched.shutdown();
    launched.join().await?;
    Ok(())
}
