//! `rngd-pd up`'s plan, as pure functions of the flags and of what the
//! children printed: the worker counts checked, one [`WorkerPlan`] per worker
//! (name, role, port), each worker's command line, the gateway's command line,
//! the picker's endpoints and the lines `up` prints about its workers; and
//! the restart of a child that exits: the command line it is started again
//! with (the ports it bound in place of 0, [`restart_args`]) and the delay
//! before each attempt ([`Backoff`]). Nothing here starts a process or
//! touches a file.

use std::time::Duration;

use anyhow::bail;

use super::{Args, ChunkedPrefillRoles};

/// Most workers of one role `up` starts.
pub(super) const MAX_WORKERS: usize = 16;

/// What a worker does in the stack.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum WorkerRole {
    /// Prefills prompts and hands their KV to a decode worker.
    Prefill,
    /// Decodes from a pulled KV cache (or prefills locally).
    Decode,
}

// === impl WorkerRole ===

impl WorkerRole {
    /// `--role` of `rngd-pd worker`, and the start of the worker's name.
    pub(super) fn as_str(self) -> &'static str {
        match self {
            WorkerRole::Prefill => "prefill",
            WorkerRole::Decode => "decode",
        }
    }

    /// The role in the policy's endpoint list.
    pub(super) fn policy_role(self) -> rngd_policy_core::Role {
        match self {
            WorkerRole::Prefill => rngd_policy_core::Role::Prefill,
            WorkerRole::Decode => rngd_policy_core::Role::Decode,
        }
    }
}

/// One worker to start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct WorkerPlan {
    /// Its role.
    pub(super) role: WorkerRole,
    /// Its index among the workers of its role, from 0.
    pub(super) index: usize,
    /// Its name in logs and in its KV-event topic: `prefill-0`, `decode-1`, ...
    pub(super) name: String,
    /// The port it binds (0 = the OS picks).
    pub(super) port: u16,
}

// === impl WorkerPlan ===

impl WorkerPlan {
    /// The key of the lines `up` prints about this worker: the role alone
    /// for worker 0 (`rngd-pd up: prefill   URL`, the line parsers read as
    /// "the prefill worker"), its name for the others (`decode-1`).
    pub(super) fn key(&self) -> String {
        if self.index == 0 {
            self.role.as_str().to_string()
        } else {
            self.name.clone()
        }
    }
}

/// A worker that started: its plan, its URL and its printed KV-event
/// endpoints (`PUB[ replay REPLAY]`, when it publishes them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct StartedWorker {
    /// What was planned.
    pub(super) plan: WorkerPlan,
    /// `http://HOST:PORT`.
    pub(super) url: String,
    /// The rest of its `rngd-pd worker kv events on ` line.
    pub(super) kv_events: Option<String>,
}

/// Checks `--prefill-workers` and `--decode-workers`.
pub(super) fn check_counts(prefill: usize, decode: usize) -> anyhow::Result<()> {
    if prefill == 0 && decode == 0 {
        bail!(
            "--prefill-workers 0 and --decode-workers 0: no worker would serve; \
             give at least one decode worker"
        );
    }
    if decode == 0 {
        bail!(
            "--decode-workers must be at least 1 (decode workers answer every request; \
             prefill workers only hand them KV)"
        );
    }
    for (flag, n) in [("--prefill-workers", prefill), ("--decode-workers", decode)] {
        if n > MAX_WORKERS {
            bail!("{flag} {n} is more than {MAX_WORKERS}, the most `rngd-pd up` starts");
        }
    }
    Ok(())
}

/// Port of worker `index` given the base port `base` of `flag`: 0 stays 0
/// (the OS picks), else `base + index`.
fn worker_port(flag: &str, base: u16, index: usize) -> anyhow::Result<u16> {
    if base == 0 {
        return Ok(0);
    }
    match u16::try_from(usize::from(base) + index) {
        Ok(p) => Ok(p),
        Err(_) => {
            bail!("{flag} {base}: worker {index} would need port {base} + {index}, past 65535")
        }
    }
}

/// Every worker to start, prefill workers first (the decode workers are
/// told their addresses), after checking the counts and that no two workers
/// were given the same explicit port.
pub(super) fn plan_workers(args: &Args) -> anyhow::Result<Vec<WorkerPlan>> {
    check_counts(args.prefill_workers, args.decode_workers)?;
    let mut plans = Vec::new();
    for (role, count, flag, base) in [
        (
            WorkerRole::Prefill,
            args.prefill_workers,
            "--prefill-port",
            args.prefill_port,
        ),
        (
            WorkerRole::Decode,
            args.decode_workers,
            "--decode-port",
            args.decode_port,
        ),
    ] {
        for index in 0..count {
            plans.push(WorkerPlan {
                role,
                index,
                name: format!("{}-{index}", role.as_str()),
                port: worker_port(flag, base, index)?,
            });
        }
    }
    for (i, a) in plans.iter().enumerate() {
        if let Some(b) = plans[i + 1..]
            .iter()
            .find(|b| a.port != 0 && b.port == a.port)
        {
            bail!(
                "{} and {} would both bind port {} (worker i of a role takes its --*-port + i)",
                a.name,
                b.name,
                a.port
            );
        }
    }
    Ok(plans)
}

/// Flags every child shares: the model, its chat template, its served names
/// (so the gateway and the picker count prompt tokens as the workers render
/// them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct SharedFlags {
    /// The model file.
    pub(super) model: String,
    /// `--chat-template FILE`, or nothing.
    pub(super) template: Vec<String>,
    /// `--served-model-name NAME`, repeated.
    pub(super) names: Vec<String>,
}

// === impl SharedFlags ===

impl SharedFlags {
    /// From the flags (the template file is checked by the caller).
    pub(super) fn new(args: &Args, model: &std::path::Path) -> Self {
        let mut template = Vec::new();
        if let Some(t) = &args.model_args.chat_template {
            template.extend(["--chat-template".into(), t.display().to_string()]);
        }
        let mut names = Vec::new();
        for n in &args.model_args.served_model_name {
            names.extend(["--served-model-name".into(), n.clone()]);
        }
        SharedFlags {
            model: model.display().to_string(),
            template,
            names,
        }
    }
}

/// `rngd-pd worker ...` for `w`; `prefill_peers` are the prefill workers'
/// `HOST:PORT`, the peers a decode worker may orchestrate on.
pub(super) fn worker_args(
    args: &Args,
    shared: &SharedFlags,
    w: &WorkerPlan,
    prefill_peers: &[String],
) -> Vec<String> {
    let mut a: Vec<String> = [
        "worker",
        "--role",
        w.role.as_str(),
        "--backend",
        "cpu",
        "--host",
        &args.host,
        "--port",
        &w.port.to_string(),
        "--model",
        &shared.model,
        "--kv-transport",
        &args.kv_transport,
        "--seq-len",
        &args.seq_len.to_string(),
        "--shutdown-timeout",
        &args.shutdown_timeout.to_string(),
    ]
    .map(String::from)
    .to_vec();
    if let Some(b) = args.batch {
        a.extend(["--batch".into(), b.to_string()]);
    }
    if let Some(t) = args.threads {
        a.extend(["--threads".into(), t.to_string()]);
    }
    if w.role == WorkerRole::Decode
        && args.kv_load_failure_policy != rngd_api::pd::KvLoadFailurePolicy::default()
    {
        a.extend([
            "--kv-load-failure-policy".into(),
            args.kv_load_failure_policy.as_str().into(),
        ]);
    }
    if w.role == WorkerRole::Prefill && args.prefill_nice > 0 {
        a.extend(["--nice".into(), args.prefill_nice.to_string()]);
    }
    if let Some(b) = args.prefix_cache_bytes {
        a.extend(["--prefix-cache-bytes".into(), b.to_string()]);
    }
    if args.no_enable_prefix_caching {
        a.push("--no-enable-prefix-caching".into());
    }
    let chunks = match args.chunked_prefill_roles {
        ChunkedPrefillRoles::All => true,
        ChunkedPrefillRoles::Decode => w.role == WorkerRole::Decode,
    };
    if chunks && args.enable_chunked_prefill {
        a.push("--enable-chunked-prefill".into());
    }
    if let Some(b) = args.max_num_batched_tokens.filter(|_| chunks) {
        a.extend(["--max-num-batched-tokens".into(), b.to_string()]);
    }
    if let Some(p) = args.prefill_projections {
        a.extend(["--prefill-projections".into(), p.to_string()]);
    }
    if !args.no_kv_events {
        // Loopback, free ports (the worker prints the bound ones).
        let cfg = serde_json::json!({
            "enable_kv_cache_events": true,
            "publisher": "zmq",
            "endpoint": "tcp://127.0.0.1:*",
            "replay_endpoint": "tcp://127.0.0.1:*",
            "topic": format!("kv@{}", w.name),
        });
        a.extend(["--kv-events-config".into(), cfg.to_string()]);
    }
    // The worker admin API (/reset_prefix_cache) only with a token, on a
    // free loopback port.
    a.extend(["--admin-listen".into(), "127.0.0.1:0".into()]);
    a.extend(shared.template.iter().chain(&shared.names).cloned());
    if w.role == WorkerRole::Decode {
        // A decode worker may orchestrate (`x-prefiller-host-port`, the
        // picker's PD route) on this stack's prefill workers only.
        for p in prefill_peers {
            a.extend(["--prefill-allow".into(), p.clone()]);
        }
    }
    a
}

/// `rngd-pd relay ...`: on `--host` and `--relay-port`, its metrics on a
/// free loopback port.
pub(super) fn relay_args(args: &Args) -> Vec<String> {
    vec![
        "relay".into(),
        "--listen".into(),
        format!("{}:{}", args.host, args.relay_port),
        "--metrics-listen".into(),
        "127.0.0.1:0".into(),
    ]
}

/// `rngd-pd ext-proc ...` on the workers in `endpoints_file`, with the
/// policy and its configuration: TLS with a self-signed certificate, its
/// health and metrics listeners on ports it picks.
pub(super) fn ext_proc_args(
    args: &Args,
    shared: &SharedFlags,
    endpoints_file: &str,
    policy: &str,
    policy_config: &str,
) -> Vec<String> {
    let mut e: Vec<String> = [
        "ext-proc",
        "--host",
        &args.host,
        "--grpc-port",
        &args.ext_proc_port.to_string(),
        "--grpc-health-port",
        "0",
        // TLS with a self-signed certificate, as the reference picker and
        // deploy/envoy/envoy.yaml (whose epp cluster accepts it).
        "--secure-serving=true",
        "--metrics-port",
        "0",
        "--endpoints",
        endpoints_file,
        "--policy",
        policy,
        "--policy-config",
        policy_config,
        "--model",
        &shared.model,
    ]
    .map(String::from)
    .to_vec();
    e.extend(shared.template.iter().cloned());
    // The picker serves the workers' names (it refuses any other with 404).
    e.extend(shared.names.iter().cloned());
    e
}

/// The gateway's `--kv-events` value for a worker at `url` that printed
/// `printed` (`PUB` or `PUB replay REPLAY`): `HOST:PORT=PUB[,REPLAY]`.
pub(super) fn kv_events_spec(url: &str, printed: &str) -> String {
    let (publ, replay) = printed_streams(printed);
    let replay = replay.map(|r| format!(",{r}")).unwrap_or_default();
    format!("{}={publ}{replay}", url.trim_start_matches("http://"))
}

/// A worker's printed KV-event endpoints (`PUB` or `PUB replay REPLAY`) as
/// (PUB, REPLAY).
fn printed_streams(printed: &str) -> (&str, Option<&str>) {
    match printed.split_once(" replay ") {
        Some((p, r)) => (p, Some(r)),
        None => (printed, None),
    }
}

/// `rngd-pd gateway ...` in front of `workers`, with the policy and its
/// configuration; it indexes every worker's KV events.
pub(super) fn gateway_args(
    args: &Args,
    shared: &SharedFlags,
    policy: &str,
    policy_config: &str,
    workers: &[StartedWorker],
) -> Vec<String> {
    let mut g: Vec<String> = vec![
        "gateway".into(),
        "--listen".into(),
        format!("{}:{}", args.host, args.gateway_port),
    ];
    for w in workers {
        g.extend([format!("--{}", w.plan.role.as_str()), w.url.clone()]);
    }
    g.extend(
        [
            "--policy",
            policy,
            "--policy-config",
            policy_config,
            "--model",
            &shared.model,
            "--seq-len",
            &args.seq_len.to_string(),
            "--shutdown-timeout",
            &args.shutdown_timeout.to_string(),
            "--migration-limit",
            &args.migration_limit.to_string(),
            "--kv-load-failure-policy",
            args.kv_load_failure_policy.as_str(),
        ]
        .map(String::from),
    );
    // The gateway indexes the workers' KV events (routing on cached prefixes).
    for w in workers {
        if let Some(ev) = &w.kv_events {
            g.extend(["--kv-events".into(), kv_events_spec(&w.url, ev)]);
        }
    }
    g.extend(shared.template.iter().chain(&shared.names).cloned());
    if let Some(p) = args.metrics_port {
        g.extend([
            "--metrics-port".into(),
            p.to_string(),
            "--metrics-host".into(),
            args.host.clone(),
        ]);
    }
    g
}

/// The picker's endpoints file: every worker, with its role and, when it
/// publishes them, its KV-event endpoints (`kv_events`,
/// `kv_events_replay`), so the picker routes on the workers' caches as the
/// gateway does.
pub(super) fn picker_endpoints(
    args: &Args,
    workers: &[StartedWorker],
) -> anyhow::Result<Vec<serde_json::Value>> {
    workers
        .iter()
        .map(|w| {
            let ep = rngd_pool::source::local_endpoint(
                rngd_pool::source::address_of(&w.url)?,
                w.plan.role.policy_role(),
                args.seq_len,
                std::slice::from_ref(&args.kv_transport),
            );
            let mut v = serde_json::to_value(ep)?;
            if let Some(printed) = &w.kv_events {
                let (publ, replay) = printed_streams(printed);
                v["kv_events"] = publ.into();
                if let Some(r) = replay {
                    v["kv_events_replay"] = r.into();
                }
            }
            Ok(v)
        })
        .collect()
}

/// The lines `up` prints about its workers' addresses, in start order.
pub(super) fn address_lines(workers: &[StartedWorker]) -> Vec<String> {
    workers
        .iter()
        .map(|w| format!("rngd-pd up: {:<9} {}", w.plan.key(), w.url))
        .collect()
}

/// The lines `up` prints about its workers' KV-event endpoints.
pub(super) fn kv_event_lines(workers: &[StartedWorker]) -> Vec<String> {
    workers
        .iter()
        .filter_map(|w| {
            let key = format!("{} ", w.plan.key());
            let ev = w.kv_events.as_ref()?;
            Some(format!("rngd-pd up: kv events {key:<8}{ev}"))
        })
        .collect()
}

// === restarts ===

/// Delay before a child's first restart.
pub(super) const BACKOFF_START: Duration = Duration::from_millis(500);

/// Longest delay between two restarts of one child.
pub(super) const BACKOFF_MAX: Duration = Duration::from_secs(30);

/// A child that has served this long since its last (re)start is back to
/// [`BACKOFF_START`] when it exits.
pub(super) const STABLE_AFTER: Duration = Duration::from_secs(60);

/// The delays between a child's restarts, as a kubelet's: [`BACKOFF_START`],
/// doubled after each attempt up to [`BACKOFF_MAX`], back to the start once
/// the child has served [`STABLE_AFTER`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Backoff {
    /// The delay the next attempt waits.
    next: Duration,
}

// === impl Backoff ===

impl Default for Backoff {
    fn default() -> Self {
        Backoff {
            next: BACKOFF_START,
        }
    }
}

impl Backoff {
    /// The delay before the next attempt of a child that exited (or failed
    /// to start) after serving `served` (zero for a failed start); the one
    /// after it doubles.
    pub(super) fn next(&mut self, served: Duration) -> Duration {
        if served >= STABLE_AFTER {
            *self = Backoff::default();
        }
        let d = self.next;
        self.next = (d * 2).min(BACKOFF_MAX);
        d
    }
}

/// Which of `up`'s children a process is: the line it prints once it
/// serves, what `up` polls before it counts as up, and which of its flags
/// name the ports it binds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ChildKind {
    /// The KV relay.
    Relay,
    /// A prefill or decode worker.
    Worker,
    /// The gateway.
    Gateway,
    /// The Envoy ext-proc endpoint picker.
    ExtProc,
}

/// `rngd-pd relay`'s line for its metrics listener.
pub(super) const RELAY_METRICS_PREFIX: &str = "relay metrics listening on ";
/// `rngd-pd ext-proc`'s line for its gRPC listener.
pub(super) const EXT_PROC_GRPC_PREFIX: &str = "rngd-pd ext-proc grpc listening on ";
/// `rngd-pd ext-proc`'s line for its gRPC health listener.
pub(super) const EXT_PROC_HEALTH_PREFIX: &str = "rngd-pd ext-proc health listening on ";

// === impl ChildKind ===

impl ChildKind {
    /// The start of the stdout line the child prints once it serves; its
    /// address follows (the lines before it name its other listeners).
    pub(super) fn ready_prefix(self) -> &'static str {
        match self {
            ChildKind::Relay => "relay listening on ",
            ChildKind::Worker => rngd_worker::LISTENING_PREFIX,
            ChildKind::Gateway => "rngd-pd gateway listening on ",
            // Printed last, after the gRPC and health lines.
            ChildKind::ExtProc => "rngd-pd ext-proc metrics listening on ",
        }
    }

    /// The path `up` polls on the printed address until it answers 200
    /// before the child counts as serving; `None`: the printed line is enough.
    pub(super) fn ready_path(self) -> Option<&'static str> {
        match self {
            ChildKind::Worker => Some("/ready"),
            ChildKind::Gateway => Some("/health"),
            ChildKind::Relay | ChildKind::ExtProc => None,
        }
    }

    /// The printed address (the rest of the [`Self::ready_prefix`] line) as
    /// `up` logs it: a URL for the HTTP servers.
    pub(super) fn address(self, printed: &str) -> String {
        match self {
            ChildKind::Worker | ChildKind::Gateway => super::stack::http_url(printed.to_string()),
            ChildKind::Relay | ChildKind::ExtProc => printed.to_string(),
        }
    }
}

/// The port of a printed address: `HOST:PORT`, `[V6]:PORT`, or a URL
/// (`SCHEME://HOST:PORT[/PATH]`).
pub(super) fn port_of(printed: &str) -> Option<u16> {
    let rest = printed.trim();
    let rest = rest.split_once("://").map_or(rest, |(_, r)| r);
    let authority = rest.split('/').next()?;
    authority.rsplit_once(':')?.1.parse().ok()
}

/// `HOST:PORT` with its port replaced by `port`.
fn with_port(host_port: &str, port: u16) -> Option<String> {
    let (host, _) = host_port.rsplit_once(':')?;
    Some(format!("{host}:{port}"))
}

/// The rest of the first of `lines` that starts with `prefix`, trimmed.
fn printed_after<'a>(lines: &'a [String], prefix: &str) -> Option<&'a str> {
    lines
        .iter()
        .find_map(|l| l.strip_prefix(prefix))
        .map(str::trim)
}

/// Replaces the value after `flag` (given as its own argument, as `up`
/// builds every command line) by `make(old)`, when that is `Some`.
fn replace_value(args: &mut [String], flag: &str, make: impl FnOnce(&str) -> Option<String>) {
    if let Some(at) = args.iter().position(|a| a == flag)
        && let Some(v) = args.get_mut(at + 1)
        && let Some(new) = make(v)
    {
        *v = new;
    }
}

/// The `--kv-events-config` JSON `config` with its publisher's and replay
/// endpoints (`tcp://127.0.0.1:*`) replaced by the ones the worker printed
/// (`PUB[ replay REPLAY]`, after [`rngd_worker::KV_EVENTS_PREFIX`]).
fn kv_events_bound(config: &str, printed: &str) -> Option<String> {
    let mut cfg: serde_json::Value = serde_json::from_str(config).ok()?;
    let (publ, replay) = printed_streams(printed);
    cfg["endpoint"] = publ.into();
    if let Some(r) = replay {
        cfg["replay_endpoint"] = r.into();
    }
    Some(cfg.to_string())
}

/// The command line a child of `kind` that was started with `args` is
/// started again with, so that it comes back on the addresses it had (the
/// other children, and the user, were given those): every listener it was
/// told to bind on port 0 (or `*`) gets the port it bound, read from
/// `found` (the rest of its [`ChildKind::ready_prefix`] line) and `before`
/// (the lines it printed before it). A listener it printed nothing about
/// keeps its flag.
pub(super) fn restart_args(
    kind: ChildKind,
    args: &[String],
    found: &str,
    before: &[String],
) -> Vec<String> {
    let mut a = args.to_vec();
    let bound = port_of(found);
    let line_port = |prefix: &str| printed_after(before, prefix).and_then(port_of);
    match kind {
        ChildKind::Relay => {
            replace_value(&mut a, "--listen", |v| with_port(v, bound?));
            let metrics = line_port(RELAY_METRICS_PREFIX);
            replace_value(&mut a, "--metrics-listen", |v| with_port(v, metrics?));
        }
        ChildKind::Worker => {
            replace_value(&mut a, "--port", |_| Some(bound?.to_string()));
            let events = printed_after(before, rngd_worker::KV_EVENTS_PREFIX);
            replace_value(&mut a, "--kv-events-config", |v| {
                kv_events_bound(v, events?)
            });
            let admin = line_port(rngd_worker::ADMIN_PREFIX);
            replace_value(&mut a, "--admin-listen", |v| with_port(v, admin?));
        }
        ChildKind::Gateway => {
            replace_value(&mut a, "--listen", |v| with_port(v, bound?));
            let kpis = line_port(crate::gateway::KPI_PREFIX);
            replace_value(&mut a, "--metrics-port", |_| Some(kpis?.to_string()));
        }
        ChildKind::ExtProc => {
            let grpc = line_port(EXT_PROC_GRPC_PREFIX);
            replace_value(&mut a, "--grpc-port", |_| Some(grpc?.to_string()));
            let health = line_port(EXT_PROC_HEALTH_PREFIX);
            replace_value(&mut a, "--grpc-health-port", |_| Some(health?.to_string()));
            replace_value(&mut a, "--metrics-port", |_| Some(bound?.to_string()));
        }
    }
    a
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        up: Args,
    }

    fn args(flags: &[&str]) -> Args {
        Cli::try_parse_from(std::iter::once("up").chain(flags.iter().copied()))
            .unwrap()
            .up
    }

    fn plan(flags: &[&str]) -> anyhow::Result<Vec<WorkerPlan>> {
        plan_workers(&args(flags))
    }

    fn err(flags: &[&str]) -> String {
        plan(flags).unwrap_err().to_string()
    }

    /// `read` of each planned worker's command line under `flags`, with its
    /// role.
    fn per_worker<T>(flags: &[&str], read: impl Fn(&[String]) -> T) -> Vec<(WorkerRole, T)> {
        let a = args(flags);
        let shared = SharedFlags::new(&a, std::path::Path::new("/m.gguf"));
        plan_workers(&a)
            .unwrap()
            .iter()
            .map(|w| (w.role, read(&worker_args(&a, &shared, w, &[]))))
            .collect()
    }

    /// The value after `flag` on a command line, if the flag is there.
    fn value_of(v: &[String], flag: &str) -> Option<String> {
        let at = v.iter().position(|x| x == flag)?;
        v.get(at + 1).cloned()
    }

    fn started(plans: &[WorkerPlan]) -> Vec<StartedWorker> {
        plans
            .iter()
            .enumerate()
            .map(|(i, p)| StartedWorker {
                plan: p.clone(),
                url: format!("http://127.0.0.1:{}", 7000 + i),
                kv_events: Some(format!(
                    "tcp://127.0.0.1:{} replay tcp://127.0.0.1:{}",
                    8000 + i,
                    9000 + i
                )),
            })
            .collect()
    }

    #[test]
    fn the_default_is_one_worker_of_each_role_on_picked_ports() {
        let p = plan(&[]).unwrap();
        let names: Vec<_> = p
            .iter()
            .map(|w| (w.name.as_str(), w.role, w.port))
            .collect();
        assert_eq!(
            names,
            [
                ("prefill-0", WorkerRole::Prefill, 0),
                ("decode-0", WorkerRole::Decode, 0)
            ]
        );
        assert_eq!(p[0].key(), "prefill");
        assert_eq!(p[1].key(), "decode");
    }

    #[test]
    fn vllm_spellings_of_the_sizes_are_accepted() {
        let a = args(&[
            "--port",
            "9000",
            "--max-model-len",
            "1024",
            "--max-num-seqs",
            "4",
        ]);
        assert_eq!((a.gateway_port, a.seq_len, a.batch), (9000, 1024, Some(4)));
        let shared = SharedFlags::new(&a, std::path::Path::new("/m.gguf"));
        let p = plan_workers(&a).unwrap();
        let w = worker_args(&a, &shared, &p[1], &[]);
        let joined = w.join(" ");
        assert!(
            joined.contains("--seq-len 1024") && joined.contains("--batch 4"),
            "{joined}"
        );
        // Without it the worker's own default stands.
        let a = args(&[]);
        let w = worker_args(&a, &shared, &plan_workers(&a).unwrap()[1], &[]);
        assert!(!w.iter().any(|x| x == "--batch"), "{w:?}");
    }

    #[test]
    fn prefill_workers_yield_the_cpu_to_decode_workers() {
        let nice = |flags: &[&str]| per_worker(flags, |v| value_of(v, "--nice"));
        assert_eq!(
            nice(&["--decode-workers", "2"]),
            [
                (WorkerRole::Prefill, Some("10".to_string())),
                (WorkerRole::Decode, None),
                (WorkerRole::Decode, None)
            ]
        );
        assert_eq!(
            nice(&["--prefill-nice", "3"])[0],
            (WorkerRole::Prefill, Some("3".to_string()))
        );
        assert!(
            nice(&["--prefill-nice", "0"])
                .iter()
                .all(|(_, n)| n.is_none())
        );
        for bad in ["20", "-1"] {
            assert!(
                Cli::try_parse_from(["up", &format!("--prefill-nice={bad}")]).is_err(),
                "{bad}"
            );
        }
    }

    #[test]
    fn chunked_prefill_reaches_the_roles_asked_for() {
        let chunking = |flags: &[&str]| {
            per_worker(flags, |v| {
                let on = v.iter().any(|x| x == "--enable-chunked-prefill");
                (on, value_of(v, "--max-num-batched-tokens"))
            })
            .into_iter()
            .map(|(role, (on, budget))| (role, on, budget))
            .collect::<Vec<_>>()
        };
        let on = ["--enable-chunked-prefill", "--max-num-batched-tokens", "64"];
        let b = Some("64".to_string());
        assert_eq!(
            chunking(&on),
            [
                (WorkerRole::Prefill, true, b.clone()),
                (WorkerRole::Decode, true, b.clone())
            ]
        );
        let decode_only = [&on[..], &["--chunked-prefill-roles", "decode"]].concat();
        assert_eq!(
            chunking(&decode_only),
            [
                (WorkerRole::Prefill, false, None),
                (WorkerRole::Decode, true, b)
            ]
        );
        assert_eq!(
            chunking(&[]),
            [
                (WorkerRole::Prefill, false, None),
                (WorkerRole::Decode, false, None)
            ]
        );
        assert!(Cli::try_parse_from(["up", "--chunked-prefill-roles", "prefill"]).is_err());
    }

    #[test]
    fn counts_are_checked_with_clear_errors() {
        assert!(
            err(&["--prefill-workers", "0", "--decode-workers", "0"])
                .contains("no worker would serve")
        );
        assert!(err(&["--decode-workers", "0"]).contains("--decode-workers must be at least 1"));
        assert!(err(&["--prefill-workers", "17"]).contains("--prefill-workers 17 is more than 16"));
        assert!(err(&["--decode-workers", "17"]).contains("--decode-workers 17 is more than 16"));
        assert_eq!(
            plan(&["--prefill-workers", "16", "--decode-workers", "16"])
                .unwrap()
                .len(),
            32
        );
        // No prefill worker: the decode workers prefill locally.
        let p = plan(&["--prefill-workers", "0", "--decode-workers", "2"]).unwrap();
        assert!(p.iter().all(|w| w.role == WorkerRole::Decode));
        assert_eq!(p.len(), 2);
    }

    #[test]
    fn explicit_ports_count_up_from_the_flag_and_are_checked() {
        let p = plan(&[
            "--prefill-port",
            "9100",
            "--decode-workers",
            "3",
            "--decode-port",
            "9200",
        ])
        .unwrap();
        let ports: Vec<_> = p.iter().map(|w| (w.name.as_str(), w.port)).collect();
        assert_eq!(
            ports,
            [
                ("prefill-0", 9100),
                ("decode-0", 9200),
                ("decode-1", 9201),
                ("decode-2", 9202)
            ]
        );
        // Port 0 stays 0 for every worker (the OS picks each).
        assert!(
            plan(&["--decode-workers", "3"])
                .unwrap()
                .iter()
                .all(|w| w.port == 0)
        );
        assert!(err(&["--decode-port", "65535", "--decode-workers", "2"]).contains("past 65535"));
        let e = err(&[
            "--prefill-workers",
            "2",
            "--prefill-port",
            "9000",
            "--decode-port",
            "9001",
        ]);
        assert!(
            e.contains("prefill-1 and decode-0 would both bind port 9001"),
            "{e}"
        );
    }

    #[test]
    fn every_worker_has_its_own_port_topic_and_admin_listener() {
        let a = args(&["--decode-workers", "2", "--decode-port", "9200"]);
        let shared = SharedFlags::new(&a, std::path::Path::new("/m.gguf"));
        let p = plan_workers(&a).unwrap();
        let peers = ["127.0.0.1:7000".to_string()];
        let d1 = worker_args(&a, &shared, &p[2], &peers).join(" ");
        assert!(d1.starts_with(
            "worker --role decode --backend cpu --host 127.0.0.1 --port 9201 --model /m.gguf"
        ));
        assert!(d1.contains(r#""topic":"kv@decode-1""#), "{d1}");
        assert!(d1.contains("--admin-listen 127.0.0.1:0"));
        assert!(d1.contains("--prefill-allow 127.0.0.1:7000"));
        let p0 = worker_args(&a, &shared, &p[0], &peers).join(" ");
        assert!(
            p0.contains("--role prefill") && !p0.contains("--prefill-allow"),
            "{p0}"
        );
        let quiet = args(&["--no-kv-events"]);
        assert!(
            !worker_args(&quiet, &shared, &p[0], &[])
                .join(" ")
                .contains("--kv-events-config")
        );
    }

    #[test]
    fn the_gateway_gets_every_worker_and_its_kv_events() {
        let a = args(&[
            "--prefill-workers",
            "2",
            "--decode-workers",
            "2",
            "--gateway-port",
            "0",
        ]);
        let shared = SharedFlags::new(&a, std::path::Path::new("/m.gguf"));
        let w = started(&plan_workers(&a).unwrap());
        let g = gateway_args(&a, &shared, "/p.wasm", "/c.json", &w).join(" ");
        assert!(g.starts_with(
            "gateway --listen 127.0.0.1:0 --prefill http://127.0.0.1:7000 --prefill http://127.0.0.1:7001 \
             --decode http://127.0.0.1:7002 --decode http://127.0.0.1:7003 --policy /p.wasm"
        ), "{g}");
        for i in 0..4 {
            let spec = format!(
                "--kv-events 127.0.0.1:{}=tcp://127.0.0.1:{},tcp://127.0.0.1:{}",
                7000 + i,
                8000 + i,
                9000 + i
            );
            assert!(g.contains(&spec), "{g}");
        }
        assert_eq!(kv_events_spec("http://h:1", "tcp://h:2"), "h:1=tcp://h:2");
        let eps = picker_endpoints(&a, &w).unwrap();
        assert_eq!(eps.len(), 4);
        assert_eq!(eps[3]["role"], "decode");
        // The picker follows the same streams as the gateway.
        let text = serde_json::to_vec(&eps).unwrap();
        let streams = rngd_pool::source::parse_streams(std::path::Path::new("e"), &text).unwrap();
        assert_eq!(streams.len(), 4);
        assert_eq!(streams[3].endpoint, format!("tcp://127.0.0.1:{}", 8000 + 3));
    }

    /// The flags whose values differ between two command lines of the
    /// same shape.
    fn changed_flags(before: &[String], after: &[String]) -> Vec<String> {
        assert_eq!(before.len(), after.len(), "{before:?} → {after:?}");
        (1..before.len())
            .filter(|&i| before[i] != after[i])
            .map(|i| before[i - 1].clone())
            .collect()
    }

    #[test]
    fn printed_ports_are_read_from_addresses_and_urls() {
        assert_eq!(port_of("127.0.0.1:8000"), Some(8000));
        assert_eq!(port_of(" http://127.0.0.1:8001/metrics "), Some(8001));
        assert_eq!(port_of("https://[::1]:8002"), Some(8002));
        assert_eq!(port_of("[::1]:8003"), Some(8003));
        assert_eq!(port_of("tcp://127.0.0.1:8004"), Some(8004));
        assert_eq!(port_of("no port here"), None);
        assert_eq!(port_of("http://host:99999"), None);
    }

    #[test]
    fn a_restarted_worker_binds_its_port_kv_event_streams_and_admin_again() {
        let a = args(&["--decode-workers", "2"]);
        let shared = SharedFlags::new(&a, std::path::Path::new("/m.gguf"));
        let p = plan_workers(&a).unwrap();
        let w = worker_args(&a, &shared, &p[2], &["127.0.0.1:7000".into()]);
        let before = [
            format!(
                "{}tcp://127.0.0.1:41001 replay tcp://127.0.0.1:41002",
                rngd_worker::KV_EVENTS_PREFIX
            ),
            format!("{}127.0.0.1:41003", rngd_worker::ADMIN_PREFIX),
        ];
        let r = restart_args(ChildKind::Worker, &w, "127.0.0.1:41000", &before);
        assert_eq!(
            changed_flags(&w, &r),
            ["--port", "--kv-events-config", "--admin-listen"]
        );
        assert_eq!(value_of(&r, "--port").unwrap(), "41000");
        assert_eq!(value_of(&r, "--admin-listen").unwrap(), "127.0.0.1:41003");
        let cfg: serde_json::Value =
            serde_json::from_str(&value_of(&r, "--kv-events-config").unwrap()).unwrap();
        assert_eq!(cfg["endpoint"], "tcp://127.0.0.1:41001");
        assert_eq!(cfg["replay_endpoint"], "tcp://127.0.0.1:41002");
        // The rest of the configuration is kept.
        assert_eq!(cfg["topic"], "kv@decode-1");
        assert_eq!(cfg["enable_kv_cache_events"], true);
        assert_eq!(cfg["publisher"], "zmq");
        // A second restart gives the same line; what it did not print keeps
        // its flag (only the port it printed changes).
        assert_eq!(
            restart_args(ChildKind::Worker, &r, "127.0.0.1:41000", &before),
            r
        );
        let bare = restart_args(ChildKind::Worker, &w, "127.0.0.1:41000", &[]);
        assert_eq!(changed_flags(&w, &bare), ["--port"]);
        // An explicit port stays what it was.
        let a = args(&["--decode-port", "9200"]);
        let w = worker_args(&a, &shared, &plan_workers(&a).unwrap()[1], &[]);
        let r = restart_args(ChildKind::Worker, &w, "127.0.0.1:9200", &before[..1]);
        assert_eq!(value_of(&r, "--port").unwrap(), "9200");
        assert_eq!(changed_flags(&w, &r), ["--kv-events-config"]);
    }

    #[test]
    fn the_relay_gateway_and_picker_come_back_on_their_ports() {
        let a = args(&["--gateway-port", "0", "--metrics-port", "0"]);
        let shared = SharedFlags::new(&a, std::path::Path::new("/m.gguf"));

        let relay = relay_args(&a);
        let r = restart_args(
            ChildKind::Relay,
            &relay,
            "127.0.0.1:5001",
            &[format!("{RELAY_METRICS_PREFIX}127.0.0.1:5002")],
        );
        assert_eq!(
            r.join(" "),
            "relay --listen 127.0.0.1:5001 --metrics-listen 127.0.0.1:5002"
        );

        let w = started(&plan_workers(&a).unwrap());
        let g = gateway_args(&a, &shared, "/p.wasm", "/c.json", &w);
        let kpis = format!("{}127.0.0.1:6002/metrics", crate::gateway::KPI_PREFIX);
        let r = restart_args(
            ChildKind::Gateway,
            &g,
            "http://127.0.0.1:6001",
            std::slice::from_ref(&kpis),
        );
        assert_eq!(changed_flags(&g, &r), ["--listen", "--metrics-port"]);
        assert_eq!(value_of(&r, "--listen").unwrap(), "127.0.0.1:6001");
        assert_eq!(value_of(&r, "--metrics-port").unwrap(), "6002");

        let e = ext_proc_args(&a, &shared, "/e.json", "/p.wasm", "/c.json");
        let before = [
            format!("{EXT_PROC_GRPC_PREFIX}127.0.0.1:7001"),
            "rngd-pd ext-proc grpc security tls self-signed".to_string(),
            format!("{EXT_PROC_HEALTH_PREFIX}127.0.0.1:7002"),
        ];
        let r = restart_args(ChildKind::ExtProc, &e, "127.0.0.1:7003", &before);
        assert_eq!(
            changed_flags(&e, &r),
            ["--grpc-port", "--grpc-health-port", "--metrics-port"]
        );
        assert_eq!(
            ["--grpc-port", "--grpc-health-port", "--metrics-port"]
                .map(|f| value_of(&r, f).unwrap()),
            ["7001", "7002", "7003"]
        );
        // The lines `up` reads them from are the ones the children print.
        assert!(
            ChildKind::ExtProc
                .ready_prefix()
                .starts_with("rngd-pd ext-proc ")
        );
        assert_eq!(
            ChildKind::Worker.address("127.0.0.1:1"),
            "http://127.0.0.1:1"
        );
        assert_eq!(ChildKind::Relay.address("127.0.0.1:1"), "127.0.0.1:1");
    }

    #[test]
    fn restarts_back_off_doubling_to_the_cap_and_reset_once_stable() {
        let mut b = Backoff::default();
        let secs: Vec<f64> = (0..9)
            .map(|_| b.next(Duration::ZERO).as_secs_f64())
            .collect();
        assert_eq!(secs, [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]);
        // Served a while, but not long enough: the delay keeps its course.
        assert_eq!(b.next(STABLE_AFTER - Duration::from_millis(1)), BACKOFF_MAX);
        // Served long enough: back to the start.
        assert_eq!(b.next(STABLE_AFTER), BACKOFF_START);
        assert_eq!(b.next(Duration::ZERO), BACKOFF_START * 2);
    }

    #[test]
    fn worker_lines_keep_the_single_worker_format() {
        let a = args(&["--decode-workers", "2"]);
        let w = started(&plan_workers(&a).unwrap());
        let mut lines = address_lines(&w);
        lines.extend(kv_event_lines(&w));
        assert_eq!(lines[0], "rngd-pd up: prefill   http://127.0.0.1:7000");
        assert_eq!(lines[1], "rngd-pd up: decode    http://127.0.0.1:7001");
        assert_eq!(lines[2], "rngd-pd up: decode-1  http://127.0.0.1:7002");
        assert_eq!(
            lines[3],
            "rngd-pd up: kv events prefill tcp://127.0.0.1:8000 replay tcp://127.0.0.1:9000"
        );
        assert_eq!(
            lines[4],
            "rngd-pd up: kv events decode  tcp://127.0.0.1:8001 replay tcp://127.0.0.1:9001"
        );
        assert_eq!(
            lines[5],
            "rngd-pd up: kv events decode-1 tcp://127.0.0.1:8002 replay tcp://127.0.0.1:9002"
        );
    }
}
