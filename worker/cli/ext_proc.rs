//! `rngd-pd ext-proc`: the Envoy ext_proc endpoint picker (GIE protocol). This
//! module parses flags into `rngd_ext_proc::launch::Options`, starts
//! [`rngd_ext_proc::launch::launch`] and prints the bound addresses.

use std::io::Write;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use rngd_api::env;
use rngd_ext_proc::launch::{Options, launch};
use rngd_ext_proc::picker::PickerLimits;
use rngd_ext_proc::processor::{DEFAULT_MAX_BODY, MAX_CHUNK, ProcessorConfig};
use rngd_ext_proc::server;
use rngd_ext_proc::tls::TlsChoice;
use rngd_policy_host::SandboxLimits;
use rngd_pool::admission;
use rngd_pool::source::DEFAULT_FILE_POLL;
use rngd_pool::wiring::ScrapeOptions;
use rngd_pool::{PolicyChoice, SourceChoice, TokenizerChoice};

/// Flags.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Listen host of every port (Envoy usually runs elsewhere, hence all interfaces).
    #[arg(long, env = env::RNGD_PD_HOST, default_value = "0.0.0.0")]
    pub host: IpAddr,
    /// ext_proc gRPC port (0 = pick one and print it).
    #[arg(long, default_value_t = server::DEFAULT_GRPC_PORT)]
    pub grpc_port: u16,
    /// gRPC health port (services `liveness`, `readiness`, the ext_proc
    /// service); always plaintext (kubelet gRPC probes), `--health-port` is an alias.
    #[arg(long, alias = "health-port", default_value_t = server::DEFAULT_HEALTH_PORT)]
    pub grpc_health_port: u16,
    /// Prometheus metrics port (`GET /metrics`).
    #[arg(long, default_value_t = server::DEFAULT_METRICS_PORT)]
    pub metrics_port: u16,
    /// Serve the ext_proc gRPC port over TLS (default, as the reference
    /// endpoint picker); `--secure-serving=false` = plaintext HTTP/2.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub secure_serving: bool,
    /// Directory with `tls.crt` and `tls.key` (PEM), re-read every `--watch-ms`
    /// when they change; unset = a self-signed certificate generated at start.
    #[arg(long)]
    pub cert_path: Option<PathBuf>,
    /// Endpoints file: JSON list of endpoints (hot-reloaded); exactly one of
    /// this and `--pool-name`.
    #[arg(long, env = env::RNGD_PD_ENDPOINTS, required_unless_present = "pool_name", conflicts_with = "pool_name")]
    pub endpoints: Option<PathBuf>,
    /// InferencePool discovery.
    #[command(flatten)]
    pub pool: crate::pool::PoolArgs,
    /// The load gauges' names (model servers that are not vLLM).
    #[command(flatten)]
    pub load_names: crate::pool::LoadNameArgs,
    /// Prefix-cache routing.
    #[command(flatten)]
    pub prefix: crate::pool::PrefixArgs,
    /// Policy module (`.wasm`, hot-reloaded when the file changes).
    #[arg(long, env = env::RNGD_PD_POLICY)]
    pub policy: PathBuf,
    /// Policy plugin configuration (JSON file); default `{}`.
    #[arg(long, env = env::RNGD_PD_POLICY_CONFIG)]
    pub policy_config: Option<PathBuf>,
    /// The model: file, chat template, served names.
    #[command(flatten)]
    pub model_args: crate::flags::ModelArgs,
    /// Do not count prompt tokens (the policy then cannot check the context
    /// length); refused with `--chat-template`.
    #[arg(long, conflicts_with = "chat_template")]
    pub no_tokenizer: bool,
    /// Interval of the endpoints' `/metrics` scrapes, ms (0 = no scraping: the file's `healthy` is used as is).
    #[arg(long, default_value_t = 50)]
    pub scrape_interval_ms: u64,
    /// Scraped data older than this marks an endpoint unhealthy, ms.
    #[arg(long, default_value_t = 2000)]
    pub stale_after_ms: u64,
    /// On SIGTERM or Ctrl-C, seconds the ext_proc streams in flight have to
    /// end (fractions allowed); meanwhile gRPC readiness is NOT_SERVING and
    /// no new connection is taken. A second signal exits at once.
    #[arg(long, value_name = "SECONDS", value_parser = crate::flags::seconds,
          default_value_t = rngd_http_edge::DEFAULT_SHUTDOWN_TIMEOUT.as_secs_f64())]
    pub shutdown_timeout: f64,
    /// Poll interval of the endpoints file and the policy module, ms.
    #[arg(long, default_value_t = DEFAULT_FILE_POLL.as_millis() as u64)]
    pub watch_ms: u64,
    /// Largest request body buffered for a pick, bytes (also the policy's
    /// body cap); a larger one, declared or received, is a 413 before it is
    /// buffered whole. The gateway's `--body-limit` has the same default.
    /// `--max-body-bytes` is its older spelling.
    #[arg(long, alias = "max-body-bytes", default_value_t = DEFAULT_MAX_BODY)]
    pub body_limit: usize,
    /// Requests in their request phase at once (headers to the pick: body
    /// buffering, prompt counting, the policy call).
    #[arg(long, default_value_t = admission::DEFAULT_MAX_CONCURRENT)]
    pub max_concurrent: usize,
    /// Requests that may wait for a slot beyond `--max-concurrent`; more get
    /// 429 with `Retry-After` at once.
    #[arg(long, default_value_t = admission::DEFAULT_MAX_QUEUED)]
    pub max_queued: usize,
    /// Longest wait for a slot, ms; then 429.
    #[arg(long, default_value_t = admission::DEFAULT_QUEUE_TIMEOUT.as_millis() as u64)]
    pub queue_timeout_ms: u64,
    /// Request body bytes all requests together may hold or have reserved
    /// (declared `content-length` reserved up front); past it, 429 with
    /// `Retry-After` before anything is buffered.
    #[arg(long, default_value_t = admission::DEFAULT_MAX_INFLIGHT_BODY_BYTES)]
    pub max_inflight_body_bytes: usize,
    /// Longest wait for Envoy's next ext_proc message before the pick, ms
    /// (a stalled request stream is ended; Envoy fails the request).
    #[arg(long, default_value_t = rngd_ext_proc::processor::DEFAULT_REQUEST_IDLE_TIMEOUT.as_millis() as u64)]
    pub request_idle_timeout_ms: u64,
    /// Longest wait for Envoy's next ext_proc message after the pick (the
    /// response path), ms.
    #[arg(long, default_value_t = rngd_ext_proc::processor::DEFAULT_RESPONSE_IDLE_TIMEOUT.as_millis() as u64)]
    pub response_idle_timeout_ms: u64,
    /// Bearer token of the policy admin API (every verb, GET included, on `--admin-listen`); unset = admin API off.
    #[arg(long, env = env::RNGD_PD_ADMIN_TOKEN, hide_env_values = true)]
    pub admin_token: Option<String>,
    /// Listener of the policy admin API (`GET`/`PUT /admin/policy`), apart
    /// from the public and metrics ports; loopback by default.
    #[arg(long, env = env::RNGD_PD_ADMIN_LISTEN, default_value_t = rngd_policy_host::admin::DEFAULT_ADMIN_LISTEN)]
    pub admin_listen: std::net::SocketAddr,
    /// Validate the flags and files (endpoints file or pool names and
    /// kubeconfig — no API call —, policy module and its configuration
    /// through the module's self-test, the tokenizer, the TLS certificate)
    /// and exit: 0 and `ok`, or a clear error.
    #[arg(long)]
    pub check: bool,
}

fn read_config(path: Option<&Path>) -> anyhow::Result<Vec<u8>> {
    match path {
        Some(p) => {
            std::fs::read(p).with_context(|| format!("reading policy config {}", p.display()))
        }
        None => Ok(b"{}".to_vec()),
    }
}

/// The flags as the library's options.
fn options(args: &Args) -> anyhow::Result<Options> {
    let watch = Duration::from_millis(args.watch_ms.max(10));
    let tokenizer = if args.no_tokenizer {
        None
    } else {
        let path = rngd_engine::model_fetch::resolve(args.model_args.model.as_deref())
            .context("model for the tokenizer")?;
        let overrides = rngd_pool::TokenizerOverrides {
            chat_template: args.model_args.chat_template.clone(),
            served_model_name: args.model_args.served_model_name.first().cloned(),
        };
        Some(TokenizerChoice::Gguf(path, overrides))
    };
    let endpoints = match (args.pool.options(), &args.endpoints) {
        (Some(kube), _) => SourceChoice::Kube(kube),
        (None, Some(path)) => SourceChoice::File {
            path: path.clone(),
            poll: watch,
        },
        (None, None) => anyhow::bail!("give --endpoints FILE or --pool-name NAME"),
    };
    let served_models = served_models(args, tokenizer.as_ref());
    Ok(Options {
        grpc: SocketAddr::new(args.host, args.grpc_port),
        health: SocketAddr::new(args.host, args.grpc_health_port),
        metrics: Some(SocketAddr::new(args.host, args.metrics_port)),
        cache: args.prefix.options(&endpoints),
        endpoints,
        scrape: ScrapeOptions {
            every: (args.scrape_interval_ms > 0)
                .then(|| Duration::from_millis(args.scrape_interval_ms)),
            stale_after: Duration::from_millis(args.stale_after_ms),
            names: args.load_names.names()?,
        },
        policy: PolicyChoice::Wasm {
            module: args.policy.clone(),
            config: read_config(args.policy_config.as_deref())?,
            // The door's body limit is the policy's too.
            limits: SandboxLimits {
                max_body_bytes: args.body_limit,
                ..SandboxLimits::default()
            },
            watch_every: Some(watch),
        },
        tokenizer,
        processor: ProcessorConfig {
            max_body_bytes: args.body_limit,
            chunk_size: MAX_CHUNK,
            request_idle_timeout: Duration::from_millis(args.request_idle_timeout_ms),
            response_idle_timeout: Duration::from_millis(args.response_idle_timeout_ms),
        },
        limits: PickerLimits {
            admission: admission::AdmissionOptions {
                max_concurrent: args.max_concurrent,
                max_queued: args.max_queued,
                queue_timeout: Duration::from_millis(args.queue_timeout_ms),
                max_inflight_body_bytes: args.max_inflight_body_bytes,
            },
            served_models,
        },
        admin_token: args.admin_token.clone(),
        admin_listen: args.admin_listen,
        tls: TlsChoice::from_flags(args.secure_serving, args.cert_path.clone(), watch),
    })
}

/// The names the picker serves besides the tokenizer's, by the workers' rule
/// ([`rngd_api::models::aliases`]): the flags, else the model file's stem.
fn served_models(args: &Args, tokenizer: Option<&TokenizerChoice>) -> Vec<String> {
    if !args.model_args.served_model_name.is_empty() {
        return args.model_args.served_model_name.clone();
    }
    let file = match tokenizer {
        Some(TokenizerChoice::Gguf(p, _)) => Some(p.as_path()),
        _ => None,
    };
    rngd_api::models::aliases(&[], file)
}

/// Runs the subcommand.
pub async fn run(args: Args) -> anyhow::Result<()> {
    if args.check {
        let opts = options(&args)?;
        match &opts.endpoints {
            SourceChoice::Kube(kube) => kube.check()?,
            SourceChoice::File { path, .. } => {
                rngd_pool::source::load_endpoints_file(path)?;
            }
            _ => {}
        }
        if let PolicyChoice::Wasm { module, config, .. } = &opts.policy {
            rngd_policy_host::check(module, config)
                .with_context(|| format!("policy module {}", module.display()))?;
        }
        if let Some(TokenizerChoice::Gguf(model, overrides)) = &opts.tokenizer {
            rngd_pool::gguf_counter_with(model, overrides)?;
        }
        opts.tls.start().context("TLS certificate")?;
        println!("ok");
        return Ok(());
    }
    let launched = launch(options(&args)?).await.with_context(|| {
        format!(
            "starting the endpoint picker (policy {})",
            args.policy.display()
        )
    })?;
    let running = &launched.server;
    // Installed before the ready lines: a signal right after them is handled.
    let stop = rngd_http_edge::shutdown_signal();
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "rngd-pd ext-proc grpc listening on {}",
        running.grpc_addr
    )?;
    let security = match &args.cert_path {
        _ if !args.secure_serving => "plaintext".to_string(),
        None => "tls self-signed".to_string(),
        Some(d) => format!("tls {}", d.display()),
    };
    writeln!(out, "rngd-pd ext-proc grpc security {security}")?;
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
    let mut launched = launched;
    tokio::select! {
        r = launched.wait() => return Ok(r?),
        _ = stop => {}
    }
    rngd_http_edge::exit_on_next_signal();
    tracing::info!("stopping: draining");
    let timeout = std::time::Duration::from_secs_f64(args.shutdown_timeout);
    if !launched.drain(timeout).await {
        tracing::warn!("stopped with ext_proc streams cut by --shutdown-timeout");
    }
    Ok(())
}
