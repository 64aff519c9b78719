//! `rngd-pd up`: the whole local stack in one command, on the CPU backend.
//!
//! Fetches the model if it is missing, then starts — as child processes of this
//! same executable, on loopback — the KV relay, a prefill worker, a decode
//! worker, the gateway and the Envoy ext-proc endpoint picker, reading each
//! one's printed address. Prints the URLs
//! and a ready-to-paste curl, then waits; Ctrl-C / SIGTERM (or any child
//! exiting) stops every child and removes the stack's shm directory and its
//! private scratch directory ([`scratch`]).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use rngd_api::env;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

mod scratch;

/// Flags.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Host every server binds to.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Gateway port (0 = pick).
    #[arg(long, default_value_t = 8000)]
    pub gateway_port: u16,
    /// Prefill worker port (0 = pick).
    #[arg(long, default_value_t = 0)]
    pub prefill_port: u16,
    /// Decode worker port (0 = pick).
    #[arg(long, default_value_t = 0)]
    pub decode_port: u16,
    /// KV relay port (0 = pick).
    #[arg(long, default_value_t = 0)]
    pub relay_port: u16,
    /// Port of the gateway's KPI endpoint (`airm_*`); unset = off.
    #[arg(long, env = env::AIRM_METRICS_PORT)]
    pub metrics_port: Option<u16>,
    /// Model file (GGUF), or a directory holding exactly one; default: the
    /// cached SmolLM2-135M-Instruct, fetched if missing.
    #[arg(long, env = env::RNGD_PD_MODEL)]
    pub model: Option<PathBuf>,
    /// Jinja chat template file instead of the model's own (passed to the
    /// workers, the gateway and the picker alike).
    #[arg(long, value_name = "FILE")]
    pub chat_template: Option<PathBuf>,
    /// Model name to serve instead of the one from the file's metadata
    /// (passed to the workers and the gateway); repeat for aliases.
    #[arg(long = "served-model-name", value_name = "NAME")]
    pub served_model_name: Vec<String>,
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
    /// Compiled context length.
    #[arg(long, env = env::RNGD_PD_SEQ_LEN, default_value_t = 512)]
    pub seq_len: u32,
    /// CPU threads per worker (default: the worker's own default).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Do not start the Envoy ext-proc endpoint picker.
    #[arg(long)]
    pub no_ext_proc: bool,
    /// ext-proc gRPC port (0 = pick).
    #[arg(long, default_value_t = 0)]
    pub ext_proc_port: u16,
    /// How long to wait for the workers to load the model, seconds.
    #[arg(long, default_value_t = 600)]
    pub ready_timeout_s: u64,
    /// Do not publish the workers' KV-cache events (by default each worker
    /// publishes vLLM's KV events on loopback, on ports it picks; printed).
    #[arg(long)]
    pub no_kv_events: bool,
    /// Bytes each worker's prefix cache may hold (`rngd-pd worker
    /// --prefix-cache-bytes`); default the worker's.
    #[arg(long)]
    pub prefix_cache_bytes: Option<u64>,
    /// Turn the workers' prefix cache off.
    #[arg(long)]
    pub no_enable_prefix_caching: bool,
}

/// A started child and what it printed.
struct Proc {
    name: &'static str,
    child: Child,
}

/// The children, stopped (killed and reaped) on drop or `stop`.
struct Stack {
    procs: Vec<Proc>,
    shm_root: PathBuf,
    scratch: PathBuf,
}

impl Stack {
    async fn stop(&mut self) {
        // Reverse start order: the gateway first, the relay last.
        for p in self.procs.iter_mut().rev() {
            let _ = p.child.start_kill();
        }
        for p in self.procs.iter_mut().rev() {
            match tokio::time::timeout(Duration::from_secs(10), p.child.wait()).await {
                Ok(Ok(status)) => tracing::debug!(child = p.name, %status, "child stopped"),
                Ok(Err(e)) => eprintln!("rngd-pd up: waiting for {}: {e}", p.name),
                Err(_) => eprintln!("rngd-pd up: {} did not stop within 10 s", p.name),
            }
        }
        self.procs.clear();
        self.cleanup_dirs();
    }

    fn cleanup_dirs(&self) {
        for d in [&self.shm_root, &self.scratch] {
            if d.exists()
                && let Err(e) = std::fs::remove_dir_all(d)
            {
                eprintln!("rngd-pd up: removing {}: {e}", d.display());
            }
        }
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        for p in &mut self.procs {
            let _ = p.child.start_kill();
        }
        self.cleanup_dirs();
    }
}

/// Starts `exe ARGS`, returns once a stdout line starts with `prefix`: the
/// rest of that line and the lines printed before it. Later stdout lines are
/// echoed to stderr prefixed with the child's name.
async fn start(
    stack: &mut Stack,
    name: &'static str,
    args: &[String],
    envs: &[(&str, String)],
    prefix: &str,
) -> anyhow::Result<(String, Vec<String>)> {
    let exe = std::env::current_exe().context("locating this executable")?;
    let mut cmd = Command::new(&exe);
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true);
    for (k, v) in envs {
        cmd.env(k, v);
    }
    // The child stops with this process even if it is SIGKILLed (see main.rs).
    cmd.env(
        rngd_api::env::RNGD_PD_UP_PARENT,
        std::process::id().to_string(),
    );
    let mut child = cmd
        .spawn()
        .with_context(|| format!("starting {name}: {} {}", exe.display(), args.join(" ")))?;
    let stdout = child.stdout.take().context("child stdout")?;
    stack.procs.push(Proc { name, child });
    let mut lines = BufReader::new(stdout).lines();
    let mut before = Vec::new();
    let found = loop {
        match lines.next_line().await {
            Ok(Some(line)) => {
                if let Some(rest) = line.strip_prefix(prefix) {
                    break rest.trim().to_string();
                }
                eprintln!("[{name}] {line}");
                before.push(line);
            }
            Ok(None) => bail!("{name} exited before printing its address (see its log above)"),
            Err(e) => bail!("reading {name}'s output: {e}"),
        }
    };
    tokio::spawn(async move {
        while let Ok(Some(line)) = lines.next_line().await {
            eprintln!("[{name}] {line}");
        }
    });
    Ok((found, before))
}

/// Polls `url` until it answers 200, a child exits, or the deadline passes.
async fn wait_ready(
    stack: &mut Stack,
    what: &str,
    url: &str,
    timeout: Duration,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok((200, _)) = rngd_gateway::probe::get(url, Duration::from_secs(2)).await {
            return Ok(());
        }
        for p in &mut stack.procs {
            if let Ok(Some(status)) = p.child.try_wait() {
                bail!("{} exited ({status}) while waiting for {what}", p.name);
            }
        }
        if Instant::now() > deadline {
            bail!("{what} not ready at {url} after {} s", timeout.as_secs());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
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
    eprintln!(
        "rngd-pd up: model not found at {}; fetching it into {} …",
        default.display(),
        cache.display()
    );
    let p = rngd_engine::model_fetch::fetch(&cache)
        .context("fetching the default model (or pass --model PATH)")?;
    eprintln!("rngd-pd up: model ready at {}", p.display());
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
    eprintln!(
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
pub async fn run(args: Args) -> anyhow::Result<()> {
    let known = rngd_kv_transport::registry::KNOWN;
    if !known.contains(&args.kv_transport.as_str()) {
        bail!(
            "--kv-transport must be one of {}, not {}",
            known.join(", "),
            args.kv_transport
        );
    }
    let model = {
        let m = args.model.clone();
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
    let mut stack = Stack {
        procs: Vec::new(),
        shm_root: PathBuf::from(format!("/dev/shm/rngd_pd_up_{pid}")),
        // Fresh and private (mkdtemp semantics), removed by `stop`/drop.
        scratch: scratch::fresh_private_dir(&std::env::temp_dir(), "rngd_pd_up_")
            .context("creating the scratch directory")?,
    };
    let result = bring_up(&args, &model, &policy, &mut stack).await;
    let outcome = match result {
        Ok(()) => {
            let mut exited = None;
            tokio::select! {
                _ = rngd_http_edge::shutdown_signal() => eprintln!("rngd-pd up: stopping"),
                name = watch_children(&mut stack) => exited = Some(name),
            }
            match exited {
                Some(name) => Err(anyhow::anyhow!("{name} exited; stopping the stack")),
                None => Ok(()),
            }
        }
        Err(e) => Err(e),
    };
    stack.stop().await;
    eprintln!("rngd-pd up: stopped");
    outcome
}

/// Resolves with the name of the first child that exits.
async fn watch_children(stack: &mut Stack) -> &'static str {
    loop {
        for p in &mut stack.procs {
            if let Ok(Some(_)) = p.child.try_wait() {
                return p.name;
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn bring_up(
    args: &Args,
    model: &Path,
    policy: &Path,
    stack: &mut Stack,
) -> anyhow::Result<()> {
    let host = &args.host;
    let model_s = model.display().to_string();
    // The same chat template and names for every child: the gateway and the
    // picker count prompt tokens as the workers render them.
    let mut model_flags: Vec<String> = Vec::new();
    if let Some(t) = &args.chat_template {
        if !t.is_file() {
            bail!("chat template file {} does not exist", t.display());
        }
        model_flags.extend(["--chat-template".into(), t.display().to_string()]);
    }
    let mut name_flags: Vec<String> = Vec::new();
    for n in &args.served_model_name {
        name_flags.extend(["--served-model-name".into(), n.clone()]);
    }

    // One secret for this stack: the relay admits only its workers, and the
    // decode worker takes only KV handles its prefill worker signed. Made
    // fresh for every `up`, passed in the children's environment, never printed.
    let secret = rngd_worker::handles::random_hex(32);
    // KV relay (the `tcp` transport's server).
    let (relay, _) = start(
        stack,
        "relay",
        &[
            "relay".into(),
            "--listen".into(),
            format!("{host}:{}", args.relay_port),
        ],
        &[(env::AIRM_KV_TCP_SECRET, secret.clone())],
        "relay listening on ",
    )
    .await?;
    let relay = relay
        .trim_start_matches("tcp://")
        .trim_start_matches("http://")
        .to_string();

    let envs = [
        (env::PD_SHM_ROOT, stack.shm_root.display().to_string()),
        (env::AIRM_KV_TCP_ADDR, relay.clone()),
        (env::AIRM_KV_TCP_SECRET, secret.clone()),
    ];
    let mut urls: Vec<String> = Vec::new();
    let mut kv_events: Vec<(&'static str, String)> = Vec::new();
    for (name, role, port) in [
        ("prefill", "prefill", args.prefill_port),
        ("decode", "decode", args.decode_port),
    ] {
        let mut a: Vec<String> = vec![
            "worker".into(),
            "--role".into(),
            role.into(),
            "--backend".into(),
            "cpu".into(),
            "--host".into(),
            host.clone(),
            "--port".into(),
            port.to_string(),
            "--model".into(),
            model_s.clone(),
            "--kv-transport".into(),
            args.kv_transport.clone(),
            "--seq-len".into(),
            args.seq_len.to_string(),
        ];
        if let Some(t) = args.threads {
            a.extend(["--threads".into(), t.to_string()]);
        }
        if let Some(b) = args.prefix_cache_bytes {
            a.extend(["--prefix-cache-bytes".into(), b.to_string()]);
        }
        if args.no_enable_prefix_caching {
            a.push("--no-enable-prefix-caching".into());
        }
        if !args.no_kv_events {
            // Loopback, free ports (the worker prints the bound ones).
            let cfg = serde_json::json!({
                "enable_kv_cache_events": true,
                "publisher": "zmq",
                "endpoint": "tcp://127.0.0.1:*",
                "replay_endpoint": "tcp://127.0.0.1:*",
                "topic": format!("kv@{name}"),
            });
            a.extend(["--kv-events-config".into(), cfg.to_string()]);
        }
        // The worker admin API (/reset_prefix_cache) only with a token, on a
        // free loopback port.
        a.extend(["--admin-listen".into(), "127.0.0.1:0".into()]);
        a.extend(model_flags.iter().chain(&name_flags).cloned());
        if let Some(prefill) = urls.first() {
            // The decode worker may orchestrate (`x-prefiller-host-port`, the
            // picker's PD route) on this stack's prefill worker only.
            a.extend([
                "--prefill-allow".into(),
                prefill.trim_start_matches("http://").to_string(),
            ]);
        }
        let name: &'static str = if name == "prefill" {
            "prefill"
        } else {
            "decode"
        };
        let (addr, before) = start(stack, name, &a, &envs, rngd_worker::LISTENING_PREFIX).await?;
        if let Some(ev) = before
            .iter()
            .find_map(|l| l.strip_prefix(rngd_worker::KV_EVENTS_PREFIX))
        {
            kv_events.push((name, ev.trim().to_string()));
        }
        let url = if addr.starts_with("http://") {
            addr
        } else {
            format!("http://{addr}")
        };
        urls.push(url);
    }
    let (prefill_url, decode_url) = (urls[0].clone(), urls[1].clone());
    let ready = Duration::from_secs(args.ready_timeout_s);
    wait_ready(
        stack,
        "the prefill worker",
        &format!("{prefill_url}/ready"),
        ready,
    )
    .await?;
    wait_ready(
        stack,
        "the decode worker",
        &format!("{decode_url}/ready"),
        ready,
    )
    .await?;

    // The policy's configuration: the user's, or the defaults with the chosen
    // transport for these same-node workers.
    let policy_config = match &args.policy_config {
        Some(p) => p.clone(),
        None => {
            let p = stack.scratch.join("policy-config.json");
            let cfg = serde_json::json!({
                "same_node_transport": args.kv_transport,
                "cross_node_transport": args.kv_transport,
            });
            std::fs::write(&p, serde_json::to_vec_pretty(&cfg)?)
                .context("writing the policy configuration")?;
            p
        }
    };

    // The gateway.
    let mut g: Vec<String> = vec![
        "gateway".into(),
        "--listen".into(),
        format!("{host}:{}", args.gateway_port),
        "--prefill".into(),
        prefill_url.clone(),
        "--decode".into(),
        decode_url.clone(),
        "--policy".into(),
        policy.display().to_string(),
        "--policy-config".into(),
        policy_config.display().to_string(),
        "--model".into(),
        model_s.clone(),
        "--seq-len".into(),
        args.seq_len.to_string(),
    ];
    // The gateway indexes the workers' KV events (routing on cached prefixes).
    for (name, ev) in &kv_events {
        let url = if *name == "prefill" {
            &prefill_url
        } else {
            &decode_url
        };
        let (publ, replay) = match ev.split_once(" replay ") {
            Some((p, r)) => (p, format!(",{r}")),
            None => (ev.as_str(), String::new()),
        };
        g.extend([
            "--kv-events".into(),
            format!("{}={publ}{replay}", url.trim_start_matches("http://")),
        ]);
    }
    g.extend(model_flags.iter().chain(&name_flags).cloned());
    if let Some(p) = args.metrics_port {
        g.extend([
            "--metrics-port".into(),
            p.to_string(),
            "--metrics-host".into(),
            host.clone(),
        ]);
    }
    let (gw, before) = start(stack, "gateway", &g, &[], "rngd-pd gateway listening on ").await?;
    let kpis = before
        .iter()
        .find_map(|l| l.strip_prefix(crate::gateway::KPI_PREFIX))
        .map(|rest| format!("http://{rest}"));
    let gw = if gw.starts_with("http://") {
        gw
    } else {
        format!("http://{gw}")
    };
    wait_ready(
        stack,
        "the gateway",
        &format!("{gw}/health"),
        Duration::from_secs(60),
    )
    .await?;

    // The Envoy ext-proc endpoint picker, on the same workers and policy (for
    // an Envoy in front; see docs/epp.md and deploy/envoy/).
    let mut epp = None;
    if !args.no_ext_proc {
        let eps_file = stack.scratch.join("endpoints.json");
        let eps = vec![
            rngd_pool::source::local_endpoint(
                rngd_pool::source::address_of(&prefill_url)?,
                rngd_policy_core::Role::Prefill,
                args.seq_len,
                std::slice::from_ref(&args.kv_transport),
            ),
            rngd_pool::source::local_endpoint(
                rngd_pool::source::address_of(&decode_url)?,
                rngd_policy_core::Role::Decode,
                args.seq_len,
                std::slice::from_ref(&args.kv_transport),
            ),
        ];
        std::fs::write(&eps_file, serde_json::to_vec_pretty(&eps)?)
            .context("writing the endpoints file")?;
        let mut e: Vec<String> = vec![
            "ext-proc".into(),
            "--host".into(),
            host.clone(),
            "--grpc-port".into(),
            args.ext_proc_port.to_string(),
            "--grpc-health-port".into(),
            "0".into(),
            // TLS with a self-signed certificate, as the reference picker and
            // deploy/envoy/envoy.yaml (whose epp cluster accepts it).
            "--secure-serving=true".into(),
            "--metrics-port".into(),
            "0".into(),
            "--endpoints".into(),
            eps_file.display().to_string(),
            "--policy".into(),
            policy.display().to_string(),
            "--policy-config".into(),
            policy_config.display().to_string(),
            "--model".into(),
            model_s.clone(),
        ];
        e.extend(model_flags.iter().cloned());
        let (_, before) = start(
            stack,
            "ext-proc",
            &e,
            &[],
            "rngd-pd ext-proc metrics listening on ",
        )
        .await?;
        epp = before
            .iter()
            .find_map(|l| l.strip_prefix("rngd-pd ext-proc grpc listening on "))
            .map(str::to_string);
    }

    let (_, models) =
        rngd_gateway::probe::get(&format!("{gw}/v1/models"), Duration::from_secs(5)).await?;
    let models: serde_json::Value = serde_json::from_str(&models).context("parsing /v1/models")?;
    let model_name = models["data"][0]["id"]
        .as_str()
        .unwrap_or("default")
        .to_string();
    println!("rngd-pd up: relay     tcp://{relay}");
    println!("rngd-pd up: prefill   {prefill_url}");
    println!("rngd-pd up: decode    {decode_url}");
    println!("rngd-pd up: shm root  {}", stack.shm_root.display());
    println!("rngd-pd up: transport {}", args.kv_transport);
    for (name, ev) in &kv_events {
        println!("rngd-pd up: kv events {name:<8}{ev}");
    }
    if let Some(k) = kpis {
        println!("rngd-pd up: kpis      {k}");
    }
    if let Some(g) = &epp {
        println!("rngd-pd up: ext-proc  grpc {g} (TLS, self-signed certificate)");
    }
    println!("rngd-pd up: model     {model_name}");
    println!("rngd-pd up: gateway   {gw}");
    let body = serde_json::json!({
        "model": model_name,
        "prompt": "The capital of France is",
        "max_tokens": 16,
        "temperature": 0
    });
    println!(
        "rngd-pd up: try       curl -s {gw}/v1/completions -H 'content-type: application/json' -d '{}'",
        body.to_string().replace('\'', "'\\''")
    );
    println!("rngd-pd up: ready (Ctrl-C stops everything)");
    use std::io::Write;
    let _ = std::io::stdout().flush();
    Ok(())
}
