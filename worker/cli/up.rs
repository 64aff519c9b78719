//! `rngd-pd up`: the whole local stack in one command, on the CPU backend.
//!
//! Fetches the model if it is missing, then starts — as child processes of this
//! same executable, on loopback — the KV relay, `--prefill-workers` prefill
//! workers and `--decode-workers` decode workers (one of each by default;
//! with no prefill worker the decode workers prefill locally), the gateway in
//! front of all of them and the Envoy ext-proc endpoint picker, reading each
//! one's printed address. Prints the URLs and a ready-to-paste curl, then
//! keeps the stack serving: a child that exits (any of them) is started
//! again with exponential backoff, on the addresses it had, while the others
//! keep serving ([`stack::Stack::supervise`]). Only Ctrl-C / SIGTERM stops
//! it: every child, in order, then the stack's shm directory and its
//! private scratch directory ([`scratch`]) are removed. This file owns the
//! flags and the order of the start-up; [`plan`] what each child is given
//! (and given again on a restart), [`stack`] the children themselves.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail};
use rngd_api::env;

use plan::{ChildKind, SharedFlags, StartedWorker, WorkerPlan};
use stack::{Stack, http_url};

/// (Defined before the `mod`s below: visible in them by textual scope.)
/// A line on stdout that never panics: `up 2>&1 | tee log` and a Ctrl-C
/// close the pipe before the last lines, and `println!` would panic (the
/// stack still stops cleanly).
macro_rules! say {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout().lock(), $($t)*);
    }};
}

/// [`say!`] on stderr.
macro_rules! note {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr().lock(), $($t)*);
    }};
}

mod plan;
mod scratch;
mod stack;

/// Every port the flags name (not 0) is bindable now: a busy one fails at
/// once with its flag, before any model loads (a server binding it later
/// would fail only after the workers had loaded the model).
fn ports_are_free(args: &Args, plans: &[WorkerPlan]) -> anyhow::Result<()> {
    let mut named: Vec<(u16, String)> = vec![
        (args.gateway_port, "--port/--gateway-port".into()),
        (args.relay_port, "--relay-port".into()),
        (args.ext_proc_port, "--ext-proc-port".into()),
    ];
    if let Some(m) = args.metrics_port {
        named.push((m, "--metrics-port".into()));
    }
    for w in plans {
        named.push((w.port, format!("the port of worker {}", w.name)));
    }
    for (port, flag) in named.into_iter().filter(|(p, _)| *p != 0) {
        if let Err(e) = std::net::TcpListener::bind((args.host.as_str(), port)) {
            bail!(
                "{}:{port} ({flag}) cannot be bound: {e}; stop what holds it or pick another port (0 = any)",
                args.host
            );
        }
    }
    Ok(())
}

/// Flags.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Host every server binds to.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Gateway port (0 = pick); `--port` as vLLM spells it.
    #[arg(long, visible_alias = "port", default_value_t = 8000)]
    pub gateway_port: u16,
    /// Prefill worker port (0 = pick); prefill worker i binds this port + i.
    #[arg(long, default_value_t = 0)]
    pub prefill_port: u16,
    /// Decode worker port (0 = pick); decode worker i binds this port + i.
    #[arg(long, default_value_t = 0)]
    pub decode_port: u16,
    /// Prefill workers to start (0 to 16; 0 = no PD: the decode workers
    /// prefill locally). Each has its own port, admin listener, KV-event
    /// publisher and metrics, and the gateway is given every one.
    #[arg(long, default_value_t = 1)]
    pub prefill_workers: usize,
    /// Decode workers to start (1 to 16), each as a prefill worker is.
    #[arg(long, default_value_t = 1)]
    pub decode_workers: usize,
    /// KV relay port (0 = pick).
    #[arg(long, default_value_t = 0)]
    pub relay_port: u16,
    /// Port of the gateway's KPI endpoint (`airm_*`); unset = off.
    #[arg(long, env = env::AIRM_METRICS_PORT)]
    pub metrics_port: Option<u16>,
    /// The model: file, chat template, served names.
    #[command(flatten)]
    pub model_args: crate::flags::ModelArgs,
    /// KV transport between prefill and decode: one of this build's
    /// transports (`shm`, `tcp`, `nixl-ucx`; `rngd-pd kv doctor` shows what
    /// each would use here). The relay runs whichever is chosen: `tcp`
    /// carries the KV through it, `nixl-ucx` its descriptors.
    #[arg(long, default_value = "shm")]
    pub kv_transport: String,
    /// Policy module (`.wasm`); default: the `pd_default` guest built by `policies/build.sh`.
    #[arg(long, env = env::RNGD_PD_POLICY)]
    pub policy: Option<PathBuf>,
    /// Policy plugin configuration (JSON file); default: the default policy's
    /// defaults, with the chosen transport.
    #[arg(long, env = env::RNGD_PD_POLICY_CONFIG)]
    pub policy_config: Option<PathBuf>,
    /// Compiled context length; `--max-model-len` as vLLM spells it.
    #[arg(long, visible_alias = "max-model-len", env = env::RNGD_PD_SEQ_LEN, default_value_t = 512)]
    pub seq_len: u32,
    /// On Ctrl-C / SIGTERM, seconds the gateway and the workers have to
    /// finish the requests in flight (their `--shutdown-timeout`): the front
    /// doors drain first, then the workers, then the relay. A second Ctrl-C
    /// kills the stack at once.
    #[arg(long, value_name = "SECONDS", value_parser = crate::flags::seconds,
          default_value_t = rngd_http_edge::DEFAULT_SHUTDOWN_TIMEOUT.as_secs_f64())]
    pub shutdown_timeout: f64,
    /// Decode streams each worker steps together (the workers' `--batch`);
    /// `--max-num-seqs` as vLLM spells it. Default: the worker's (8).
    #[arg(long, visible_alias = "max-num-seqs")]
    pub batch: Option<usize>,
    /// CPU threads per worker (default: the worker's own default).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Niceness of the prefill workers (`rngd-pd worker --nice`, 0 to 19):
    /// on the cores they share with the decode workers here, a prefill
    /// yields the CPU to the decode steps, whose token cadence (TPOT) it
    /// would otherwise stretch (`docs/benchmarks-prefix.md` measures it).
    /// 0 = the same priority as the decode workers.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(i32).range(0..=19))]
    pub prefill_nice: i32,
    /// Do not start the Envoy ext-proc endpoint picker.
    #[arg(long)]
    pub no_ext_proc: bool,
    /// API key of the gateway's and the workers' public routes (vLLM's
    /// `--api-key`): given to them in their environment, never printed;
    /// the picker path is guarded by the workers.
    #[arg(long, env = env::VLLM_API_KEY, hide_env_values = true)]
    pub api_key: Option<String>,
    /// ext-proc gRPC port (0 = pick).
    #[arg(long, default_value_t = 0)]
    pub ext_proc_port: u16,
    /// How long to wait for the workers to load the model, seconds; also
    /// how long each restart of a child that exited has to serve again
    /// (print its address and, for a worker, answer `/ready`) before it is
    /// killed and retried.
    #[arg(long, default_value_t = 600)]
    pub ready_timeout_s: u64,
    /// Do not publish the workers' KV-cache events (by default each worker
    /// publishes vLLM's KV events on loopback, on ports it picks; printed).
    #[arg(long)]
    pub no_kv_events: bool,
    /// Times the gateway moves one answer to another decode worker when
    /// its worker dies or its stream breaks (`rngd-pd gateway
    /// --migration-limit`; 0 = never).
    #[arg(long, default_value_t = rngd_gateway::state::DEFAULT_MIGRATION_LIMIT)]
    pub migration_limit: u32,
    /// What a handoff whose decode worker cannot load the KV becomes, at
    /// the gateway and at decode workers serving `x-prefiller-host-port`
    /// (`rngd-pd gateway --kv-load-failure-policy`): `recompute` or `fail`.
    #[arg(long, default_value = "recompute")]
    pub kv_load_failure_policy: rngd_api::pd::KvLoadFailurePolicy,
    /// Bytes each worker's prefix cache may hold (`rngd-pd worker
    /// --prefix-cache-bytes`); default the worker's.
    #[arg(long)]
    pub prefix_cache_bytes: Option<u64>,
    /// Turn the workers' prefix cache off.
    #[arg(long)]
    pub no_enable_prefix_caching: bool,
    /// The workers chunk their prefills (`rngd-pd worker
    /// --enable-chunked-prefill`; off by default, as the worker's).
    #[arg(long)]
    pub enable_chunked_prefill: bool,
    /// Which workers the two chunked-prefill flags reach: `all`, or
    /// `decode` (the decode workers' local prefills chunk, so the decodes
    /// batched beside them keep stepping; the prefill workers, whom no
    /// decode waits on, prefill whole).
    #[arg(long, value_enum, default_value_t = ChunkedPrefillRoles::All)]
    pub chunked_prefill_roles: ChunkedPrefillRoles,
    /// Each worker's per-iteration token budget of chunked prefill
    /// (`rngd-pd worker --max-num-batched-tokens`); default the worker's.
    #[arg(long)]
    pub max_num_batched_tokens: Option<usize>,
    /// Kernel of every worker's prefill projections (`rngd-pd worker
    /// --prefill-projections`); default the worker's (`auto`).
    #[arg(long)]
    pub prefill_projections: Option<rngd_engine::cpu::PrefillProjections>,
}

/// The workers `up`'s chunked-prefill flags reach.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ChunkedPrefillRoles {
    /// Every worker.
    All,
    /// The decode workers only.
    Decode,
}

fn ensure_model(model: Option<&Path>) -> anyhow::Result<PathBuf> {
    if let Some(p) = model {
        if !p.exists() {
            bail!("model file {} does not exist", p.display());
        }
        return Ok(rngd_engine::model_fetch::resolve(Some(p))?);
    }
    let default = rngd_engine::model_fetch::default_model_path();
    if default.is_file() {
        return Ok(default);
    }
    let cache = rngd_engine::model_fetch::default_cache_dir();
    note!(
        "rngd-pd up: model not found at {}; fetching it into {} …",
        default.display(),
        cache.display()
    );
    let p = rngd_engine::model_fetch::fetch(&cache)
        .context("fetching the default model (or pass --model PATH)")?;
    note!("rngd-pd up: model ready at {}", p.display());
    Ok(p)
}

/// Builds the default policy module from the source tree this binary was
/// built from (a fresh clone's first `cargo run --release -- up`), into the
/// same target directory, then finds it again.
async fn build_default_policy() -> anyhow::Result<PathBuf> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("policies/build.sh");
    if !script.is_file() {
        bail!("no source tree at {} to build it from", script.display());
    }
    let exe = std::env::current_exe().context("locating the rngd-pd executable")?;
    // <target>/release/rngd-pd → <target>
    let target = exe
        .parent()
        .and_then(Path::parent)
        .context("the executable is not inside a cargo target directory")?;
    note!(
        "rngd-pd up: building the default policy module ({})",
        script.display()
    );
    let status = tokio::process::Command::new("bash")
        .arg(&script)
        .env("CARGO_TARGET_DIR", target)
        .status()
        .await
        .context("running policies/build.sh")?;
    if !status.success() {
        bail!("policies/build.sh failed ({status})");
    }
    Ok(rngd_policy_host::locate::default_module(None)?)
}

/// Runs the subcommand.
pub async fn run(args: Args, log_format: crate::LogFormat) -> anyhow::Result<()> {
    // The flags first: a wrong count or port fails before any download.
    let plans = plan::plan_workers(&args)?;
    if let Some(t) = &args.model_args.chat_template
        && !t.is_file()
    {
        bail!("chat template file {} does not exist", t.display());
    }
    // An unknown name, or a known one this build cannot run (`nixl`), fails
    // here with its reason, before any worker starts.
    rngd_kv_transport::registry::check_name(&args.kv_transport)
        .with_context(|| format!("--kv-transport {}", args.kv_transport))?;
    if let Some(k) = &args.api_key {
        crate::flags::parse_api_key(k).map_err(|e| anyhow::anyhow!("--api-key: {e}"))?;
    }
    ports_are_free(&args, &plans)?;
    let model = {
        let m = args.model_args.model.clone();
        tokio::task::spawn_blocking(move || ensure_model(m.as_deref())).await??
    };
    // --policy or $RNGD_PD_POLICY must exist; with neither, a module not
    // found anywhere is built from the source tree.
    let policy = match rngd_policy_host::locate::default_module(args.policy.as_deref()) {
        Ok(p) => p,
        Err(missing @ rngd_policy_host::locate::LocateError::NotFound { .. }) => {
            build_default_policy()
                .await
                .map_err(|e| anyhow::Error::from(missing).context(e))?
        }
        Err(named) => return Err(named.into()),
    };
    let pid = std::process::id();
    let mut stack = Stack::new(
        PathBuf::from(format!("/dev/shm/rngd_pd_up_{pid}")),
        // Fresh and private (mkdtemp semantics), removed by `stop`/drop.
        scratch::fresh_private_dir(&std::env::temp_dir(), "rngd_pd_up_")
            .context("creating the scratch directory")?,
        log_format.as_str(),
    );
    let shutdown = rngd_http_edge::shutdown_signal();
    tokio::pin!(shutdown);
    // Ctrl-C / SIGTERM while the stack starts stops what started, too.
    let started = tokio::select! {
        r = bring_up(&args, &model, &policy, &plans, &mut stack) => r,
        _ = &mut shutdown => Err(anyhow::anyhow!("interrupted while starting")),
    };
    // Serving: a child that exits is restarted (the others keep serving)
    // until Ctrl-C / SIGTERM, which also cuts a backoff wait or a restart
    // under way short (the process being restarted is in the stack).
    let outcome = match started {
        Ok(()) => tokio::select! {
            _ = &mut shutdown => {
                note!("rngd-pd up: stopping");
                Ok(())
            }
            never = stack.supervise(Duration::from_secs(args.ready_timeout_s)) => match never {},
        },
        Err(e) => Err(e),
    };
    stack
        .stop(Duration::from_secs_f64(args.shutdown_timeout))
        .await;
    note!("rngd-pd up: stopped");
    outcome
}

// === the start-up, in order ===

/// Starts the relay, the workers, the gateway and the picker, in that order
/// (each waits for what it needs), then prints the stack's lines. On an
/// error the caller stops whatever started.
async fn bring_up(
    args: &Args,
    model: &Path,
    policy: &Path,
    plans: &[WorkerPlan],
    stack: &mut Stack,
) -> anyhow::Result<()> {
    let shared = SharedFlags::new(args, model);
    // One secret for this stack: the relay admits only its workers, and the
    // decode workers take only KV handles its prefill workers signed. Made
    // fresh for every `up`, passed in the children's environment, never printed.
    let secret = rngd_worker::handles::random_hex(32);
    let relay = start_relay(args, &secret, stack).await?;
    let mut envs = vec![
        (env::PD_SHM_ROOT, stack.shm_root.display().to_string()),
        (env::AIRM_KV_TCP_ADDR, relay.addr.clone()),
        (env::AIRM_KV_TCP_SECRET, secret),
    ];
    // The API key reaches the workers and the gateway in their environment,
    // never on a command line (`ps` shows those).
    if let Some(k) = &args.api_key {
        envs.push((env::VLLM_API_KEY, k.clone()));
    }
    let workers = start_workers(args, &shared, plans, &envs, stack).await?;
    let policy_config = policy_config(args, &stack.scratch)?;
    let front = Front {
        args,
        shared: &shared,
        policy,
        policy_config: &policy_config,
        workers: &workers,
    };
    let (gateway, kpis) = start_gateway(&front, stack).await?;
    let epp = if args.no_ext_proc {
        None
    } else {
        start_ext_proc(&front, stack).await?
    };
    let ready = Ready {
        relay,
        workers,
        gateway,
        kpis,
        epp,
    };
    ready.print(args, stack).await
}

/// The relay's addresses.
struct StartedRelay {
    /// Its `HOST:PORT`.
    addr: String,
    /// Its metrics page (a free loopback port).
    metrics: Option<String>,
}

/// Starts the KV relay (the `tcp` transport's server) with its metrics on a
/// free loopback port.
async fn start_relay(args: &Args, secret: &str, stack: &mut Stack) -> anyhow::Result<StartedRelay> {
    let (relay, before) = stack
        .start(
            "relay",
            ChildKind::Relay,
            &plan::relay_args(args),
            &[(env::AIRM_KV_TCP_SECRET, secret.to_string())],
        )
        .await?;
    let metrics = before
        .iter()
        .find_map(|l| l.strip_prefix(plan::RELAY_METRICS_PREFIX))
        .map(|a| format!("http://{}/metrics", a.trim()));
    Ok(StartedRelay {
        addr: relay
            .trim_start_matches("tcp://")
            .trim_start_matches("http://")
            .to_string(),
        metrics,
    })
}

/// Starts every planned worker (prefill workers first: the decode workers
/// are told their addresses), then waits for each one's `/ready`.
async fn start_workers(
    args: &Args,
    shared: &SharedFlags,
    plans: &[WorkerPlan],
    envs: &[(&str, String)],
    stack: &mut Stack,
) -> anyhow::Result<Vec<StartedWorker>> {
    let mut workers: Vec<StartedWorker> = Vec::new();
    for w in plans {
        let peers: Vec<String> = workers
            .iter()
            .filter(|s| s.plan.role == plan::WorkerRole::Prefill)
            .map(|s| s.url.trim_start_matches("http://").to_string())
            .collect();
        let a = plan::worker_args(args, shared, w, &peers);
        workers.push(spawn_worker(w, &a, envs, stack).await?);
    }
    let timeout = Duration::from_secs(args.ready_timeout_s);
    for w in &workers {
        let what = format!("worker {}", w.plan.name);
        stack
            .wait_ready(&what, &format!("{}/ready", w.url), timeout)
            .await?;
    }
    Ok(workers)
}

/// Starts one worker and reads its address and KV-event endpoints.
async fn spawn_worker(
    w: &WorkerPlan,
    args: &[String],
    envs: &[(&str, String)],
    stack: &mut Stack,
) -> anyhow::Result<StartedWorker> {
    let (addr, before) = stack.start(&w.name, ChildKind::Worker, args, envs).await?;
    let kv_events = before
        .iter()
        .find_map(|l| l.strip_prefix(rngd_worker::KV_EVENTS_PREFIX))
        .map(|ev| ev.trim().to_string());
    Ok(StartedWorker {
        plan: w.clone(),
        url: http_url(addr),
        kv_events,
    })
}

/// The policy's configuration: the user's, or (written into the scratch
/// directory) the defaults with the chosen transport for these same-node
/// workers.
fn policy_config(args: &Args, scratch: &Path) -> anyhow::Result<PathBuf> {
    if let Some(p) = &args.policy_config {
        return Ok(p.clone());
    }
    let p = scratch.join("policy-config.json");
    let cfg = serde_json::json!({
        "same_node_transport": args.kv_transport,
        "cross_node_transport": args.kv_transport,
    });
    std::fs::write(&p, serde_json::to_vec_pretty(&cfg)?)
        .context("writing the policy configuration")?;
    Ok(p)
}

/// What both front doors are started from: the flags, the policy and its
/// configuration, the workers they route over.
struct Front<'a> {
    args: &'a Args,
    shared: &'a SharedFlags,
    policy: &'a Path,
    policy_config: &'a Path,
    workers: &'a [StartedWorker],
}

/// Starts the gateway in front of every worker and waits for its
/// `/health`; its URL and its KPI endpoint's, if any.
async fn start_gateway(
    front: &Front<'_>,
    stack: &mut Stack,
) -> anyhow::Result<(String, Option<String>)> {
    let Front {
        args,
        shared,
        policy,
        policy_config,
        workers,
    } = *front;
    let g = plan::gateway_args(
        args,
        shared,
        &policy.display().to_string(),
        &policy_config.display().to_string(),
        workers,
    );
    let envs: Vec<(&str, String)> = args
        .api_key
        .iter()
        .map(|k| (env::VLLM_API_KEY, k.clone()))
        .collect();
    let (gw, before) = stack
        .start("gateway", ChildKind::Gateway, &g, &envs)
        .await?;
    let kpis = before
        .iter()
        .find_map(|l| l.strip_prefix(crate::gateway::KPI_PREFIX))
        .map(|rest| format!("http://{rest}"));
    let gw = http_url(gw);
    stack
        .wait_ready(
            "the gateway",
            &format!("{gw}/health"),
            Duration::from_secs(60),
        )
        .await?;
    Ok((gw, kpis))
}

/// Starts the Envoy ext-proc endpoint picker on the same workers and policy
/// (for an Envoy in front; see docs/epp.md and deploy/envoy/); its
/// listeners, if it printed its gRPC address.
async fn start_ext_proc(f: &Front<'_>, stack: &mut Stack) -> anyhow::Result<Option<Picker>> {
    let (args, shared) = (f.args, f.shared);
    let eps_file = stack.scratch.join("endpoints.json");
    let eps = plan::picker_endpoints(args, f.workers)?;
    std::fs::write(&eps_file, serde_json::to_vec_pretty(&eps)?)
        .context("writing the endpoints file")?;
    let e = plan::ext_proc_args(
        args,
        shared,
        &eps_file.display().to_string(),
        &f.policy.display().to_string(),
        &f.policy_config.display().to_string(),
    );
    let (metrics, before) = stack.start("ext-proc", ChildKind::ExtProc, &e, &[]).await?;
    let line = |prefix: &str| {
        before
            .iter()
            .find_map(|l| l.strip_prefix(prefix))
            .map(|a| a.trim().to_string())
    };
    Ok(line(plan::EXT_PROC_GRPC_PREFIX).map(|grpc| Picker {
        grpc,
        health: line(plan::EXT_PROC_HEALTH_PREFIX).unwrap_or_default(),
        metrics,
    }))
}

/// The picker's listeners, as it printed them.
struct Picker {
    /// ext_proc gRPC `HOST:PORT`.
    grpc: String,
    /// gRPC health `HOST:PORT`.
    health: String,
    /// Prometheus `HOST:PORT` (or URL, as printed).
    metrics: String,
}

/// What started, for the lines `up` prints once everything is ready.
struct Ready {
    /// The relay.
    relay: StartedRelay,
    /// Every worker.
    workers: Vec<StartedWorker>,
    /// The gateway's URL.
    gateway: String,
    /// The gateway's KPI endpoint, if on.
    kpis: Option<String>,
    /// The picker's listeners, if it runs.
    epp: Option<Picker>,
}

// === impl Ready ===

impl Ready {
    /// Asks the gateway for the model's name, prints the stack's lines and
    /// a curl line, then `rngd-pd up: ready`.
    async fn print(&self, args: &Args, stack: &Stack) -> anyhow::Result<()> {
        let gw = &self.gateway;
        let key = args
            .api_key
            .as_deref()
            .and_then(rngd_http_edge::api_key::ApiKey::new);
        let (_, models) = rngd_gateway::probe::get_with_key(
            &format!("{gw}/v1/models"),
            Duration::from_secs(5),
            key.as_ref(),
        )
        .await?;
        let models: serde_json::Value =
            serde_json::from_str(&models).context("parsing /v1/models")?;
        let model_name = models["data"][0]["id"].as_str().unwrap_or("default");
        say!("rngd-pd up: relay     tcp://{}", self.relay.addr);
        if let Some(m) = &self.relay.metrics {
            say!("rngd-pd up: relay     metrics {m}");
        }
        for line in plan::address_lines(&self.workers) {
            say!("{line}");
        }
        say!("rngd-pd up: shm root  {}", stack.shm_root.display());
        say!("rngd-pd up: transport {}", args.kv_transport);
        for line in plan::kv_event_lines(&self.workers) {
            say!("{line}");
        }
        if let Some(k) = &self.kpis {
            say!("rngd-pd up: kpis      {k}");
        }
        if let Some(p) = &self.epp {
            say!(
                "rngd-pd up: ext-proc  grpc {} (TLS, self-signed certificate)",
                p.grpc
            );
            say!(
                "rngd-pd up: ext-proc  metrics {}/metrics, grpc health {}",
                http_url(p.metrics.clone()),
                p.health
            );
        }
        say!("rngd-pd up: model     {model_name}");
        say!("rngd-pd up: gateway   {gw}");
        let body = serde_json::json!({
            "model": model_name,
            "prompt": "The capital of France is",
            "max_tokens": 16,
            "temperature": 0
        });
        // The key itself is never printed: the line reads it from the shell.
        let auth = if key.is_some() {
            " -H \"Authorization: Bearer $VLLM_API_KEY\""
        } else {
            ""
        };
        say!(
            "rngd-pd up: try       curl -s {gw}/v1/completions{auth} -H 'content-type: application/json' -d '{}'",
            body.to_string().replace('\'', "'\\''")
        );
        say!("rngd-pd up: ready (Ctrl-C stops everything)");
        use std::io::Write;
        let _ = std::io::stdout().flush();
        Ok(())
    }
}
