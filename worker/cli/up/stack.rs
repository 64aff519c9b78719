//! `rngd-pd up`'s children: starting one (this same executable) and reading
//! its printed address, waiting for its readiness, keeping each one serving
//! (one that exits is started again, after a backoff, on the addresses it
//! had: [`Stack::supervise`]), and stopping every one of them ([`Stack`]:
//! drained tier by tier and reaped on `stop`, killed on drop; the shm root
//! and the scratch directory removed).

use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::oneshot;

use super::plan::{self, Backoff, ChildKind};

/// How often [`Stack::supervise`] looks at its children.
const SUPERVISE_EVERY: Duration = Duration::from_millis(100);

/// When a child is stopped: the front doors first (their requests in flight
/// still need the workers), then the workers (their PD transfers still need
/// the relay), then the relay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Tier {
    /// The gateway and the picker.
    Front,
    /// The prefill and decode workers.
    Worker,
    /// The KV relay.
    Relay,
}

// === impl Tier ===

impl Tier {
    /// The tier of a child of `kind`.
    fn of(kind: ChildKind) -> Self {
        match kind {
            ChildKind::Gateway | ChildKind::ExtProc => Tier::Front,
            ChildKind::Worker => Tier::Worker,
            ChildKind::Relay => Tier::Relay,
        }
    }
}

/// What a child printed up to its address line: the rest of that line and
/// the lines before it, or why it printed no such line.
type Printed = Result<(String, Vec<String>), String>;

/// Where a child stands.
enum State {
    /// Serving (started, and ready if its kind has a readiness path) since
    /// `since`.
    Serving {
        /// When it started (or came back).
        since: Instant,
    },
    /// Exited (reaped), or failed to start again; started again at `until`.
    Waiting {
        /// When the next attempt starts.
        until: Instant,
    },
    /// Started again; its address line is awaited until `deadline`.
    Starting {
        /// What it printed up to its address line, once it has.
        printed: oneshot::Receiver<Printed>,
        /// The end of this attempt.
        deadline: Instant,
    },
    /// Started again and printed `addr`; `url` is polled until `deadline`.
    Readying {
        /// Its printed address, as logged.
        addr: String,
        /// Its readiness URL.
        url: String,
        /// The end of this attempt.
        deadline: Instant,
    },
}

/// A started child.
struct Proc {
    /// Its name in logs (`relay`, `prefill-0`, `decode-1`, `gateway`, ...).
    name: String,
    /// What it is (its address line, its readiness, its ports).
    kind: ChildKind,
    /// When it is stopped.
    tier: Tier,
    /// The process (the last one started).
    child: Child,
    /// Its command line: once it printed its address, the ports it bound in
    /// place of 0 ([`plan::restart_args`]), so a restart binds them again.
    args: Vec<String>,
    /// Its environment beyond `up`'s own.
    envs: Vec<(String, String)>,
    /// Times it was started again.
    restarts: u32,
    /// The delay before its next restart.
    backoff: Backoff,
    /// Where it stands.
    state: State,
}

/// The children, kept serving by [`Stack::supervise`], stopped (killed and
/// reaped) on drop or `stop`.
pub(super) struct Stack {
    /// Every child, each with its last process (a restarted one replaces the
    /// one that exited, so `stop` and drop reach it).
    procs: Vec<Proc>,
    /// The workers' shm-transport root.
    pub(super) shm_root: PathBuf,
    /// The private scratch directory (policy configuration, endpoints file).
    pub(super) scratch: PathBuf,
    /// `--log-format` of every child, as `up` was given it.
    log_format: &'static str,
}

// === impl Stack ===

impl Stack {
    /// A stack with no child yet.
    pub(super) fn new(shm_root: PathBuf, scratch: PathBuf, log_format: &'static str) -> Self {
        Stack {
            procs: Vec::new(),
            shm_root,
            scratch,
            log_format,
        }
    }

    /// Stops every child, tier by tier ([`Tier`]): each is sent SIGTERM and
    /// given `drain` (its `--shutdown-timeout`) plus 5 s to drain and exit,
    /// then killed. A second Ctrl-C / SIGTERM meanwhile kills what is left
    /// at once. Then the directories are removed. A child waiting for its
    /// restart has already exited; one being restarted is stopped as any.
    pub(super) async fn stop(&mut self, drain: Duration) {
        let forced = rngd_http_edge::shutdown_signal();
        tokio::pin!(forced);
        let mut killing = false;
        for tier in [Tier::Front, Tier::Worker, Tier::Relay] {
            let group: Vec<&mut Proc> = self.procs.iter_mut().filter(|p| p.tier == tier).collect();
            for p in group {
                if !killing {
                    terminate(&p.child);
                }
                let waited = tokio::select! {
                    w = tokio::time::timeout(drain + Duration::from_secs(5), p.child.wait()), if !killing => Some(w),
                    _ = &mut forced, if !killing => {
                        note!("rngd-pd up: second signal: killing the stack");
                        killing = true;
                        None
                    }
                };
                match waited {
                    Some(Ok(Ok(status))) => {
                        tracing::debug!(child = %p.name, %status, "child stopped");
                        continue;
                    }
                    Some(Ok(Err(e))) => note!("rngd-pd up: waiting for {}: {e}", p.name),
                    Some(Err(_)) => note!(
                        "rngd-pd up: {} did not stop within {} s; killing it",
                        p.name,
                        (drain + Duration::from_secs(5)).as_secs()
                    ),
                    None => {}
                }
                let _ = p.child.start_kill();
                let _ = tokio::time::timeout(Duration::from_secs(5), p.child.wait()).await;
            }
        }
        if killing {
            for p in &mut self.procs {
                let _ = p.child.start_kill();
                let _ = tokio::time::timeout(Duration::from_secs(5), p.child.wait()).await;
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
                note!("rngd-pd up: removing {}: {e}", d.display());
            }
        }
    }

    /// Starts `exe ARGS` as the child `name`, returns once a stdout line
    /// starts with its kind's [`ChildKind::ready_prefix`]: the rest of that
    /// line and the lines printed before it. Other stdout lines are echoed
    /// to stderr prefixed with the child's name. The child is kept (for
    /// `stop`, and for its restarts: with the ports it printed).
    pub(super) async fn start(
        &mut self,
        name: &str,
        kind: ChildKind,
        args: &[String],
        envs: &[(&str, String)],
    ) -> anyhow::Result<(String, Vec<String>)> {
        let envs: Vec<(String, String)> = envs
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect();
        let (child, printed) = spawn(name, kind, args, &envs, self.log_format)?;
        let at = self.procs.len();
        self.procs.push(Proc {
            name: name.to_string(),
            kind,
            tier: Tier::of(kind),
            child,
            args: args.to_vec(),
            envs,
            restarts: 0,
            backoff: Backoff::default(),
            state: State::Serving {
                since: Instant::now(),
            },
        });
        let (found, before) = match printed.await {
            Ok(Ok(p)) => p,
            Ok(Err(why)) => bail!("{name} {why}"),
            Err(_) => bail!("{name}: its output reader stopped"),
        };
        let p = &mut self.procs[at];
        p.args = plan::restart_args(kind, &p.args, &found, &before);
        Ok((found, before))
    }

    /// Polls `url` until it answers 200, a child exits, or the deadline passes.
    pub(super) async fn wait_ready(
        &mut self,
        what: &str,
        url: &str,
        timeout: Duration,
    ) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok((200, _)) = rngd_gateway::probe::get(url, Duration::from_secs(2)).await {
                return Ok(());
            }
            if let Some(exited) = self.exited() {
                bail!("{exited} while waiting for {what}");
            }
            if Instant::now() > deadline {
                bail!("{what} not ready at {url} after {} s", timeout.as_secs());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// `NAME exited (STATUS)` for a child that has exited, if any.
    fn exited(&mut self) -> Option<String> {
        self.procs
            .iter_mut()
            .find_map(|p| match p.child.try_wait() {
                Ok(Some(status)) => Some(format!("{} exited ({status})", p.name)),
                _ => None,
            })
    }

    /// Keeps every child serving, as a kubelet keeps a pod's containers: a
    /// child that exits is started again after its [`Backoff`], with the
    /// command line it had (so on the addresses it had bound: the others
    /// were given them), while the others keep serving; each attempt has
    /// `timeout` to print its address and, for a worker or the gateway, to
    /// answer its readiness path; one that fails is retried after the next
    /// delay. Never returns: the caller drops it on Ctrl-C / SIGTERM, and
    /// every process it started is in the stack for `stop`.
    pub(super) async fn supervise(&mut self, timeout: Duration) -> std::convert::Infallible {
        let log_format = self.log_format;
        loop {
            for p in &mut self.procs {
                p.step(log_format, timeout).await;
            }
            tokio::time::sleep(SUPERVISE_EVERY).await;
        }
    }
}

// === impl Proc ===

impl Proc {
    /// Moves this child's restart along, by what happened since the last
    /// step; waits at most one readiness probe (2 s).
    async fn step(&mut self, log_format: &'static str, timeout: Duration) {
        let now = Instant::now();
        match &mut self.state {
            State::Serving { since } => {
                let since = *since;
                if let Ok(Some(status)) = self.child.try_wait() {
                    self.retry(format!("exited ({status})"), since.elapsed());
                }
            }
            State::Waiting { until } => {
                if now < *until {
                    return;
                }
                match spawn(&self.name, self.kind, &self.args, &self.envs, log_format) {
                    Ok((child, printed)) => {
                        // The one it replaces has exited and been reaped.
                        self.child = child;
                        self.state = State::Starting {
                            printed,
                            deadline: now + timeout,
                        };
                    }
                    Err(e) => self.retry(
                        format!("did not come back (restart {}: {e:#})", self.restarts),
                        Duration::ZERO,
                    ),
                }
            }
            State::Starting { printed, deadline } => {
                let deadline = *deadline;
                match printed.try_recv() {
                    Ok(Ok((found, before))) => {
                        self.args = plan::restart_args(self.kind, &self.args, &found, &before);
                        let addr = self.kind.address(&found);
                        match self.kind.ready_path() {
                            Some(path) => {
                                self.state = State::Readying {
                                    url: format!("{addr}{path}"),
                                    addr,
                                    deadline,
                                };
                            }
                            None => self.restarted(&addr),
                        }
                    }
                    Ok(Err(why)) => self.failed(why).await,
                    Err(oneshot::error::TryRecvError::Closed) => {
                        self.failed("its output reader stopped".into()).await;
                    }
                    Err(oneshot::error::TryRecvError::Empty) => {
                        if let Ok(Some(status)) = self.child.try_wait() {
                            self.failed(format!("exited ({status}) before printing its address"))
                                .await;
                        } else if now > deadline {
                            self.failed(format!(
                                "printed no address within {} s",
                                timeout.as_secs()
                            ))
                            .await;
                        }
                    }
                }
            }
            State::Readying {
                addr,
                url,
                deadline,
            } => {
                let (addr, url, deadline) = (addr.clone(), url.clone(), *deadline);
                if let Ok(Some(status)) = self.child.try_wait() {
                    self.failed(format!("exited ({status}) before it was ready"))
                        .await;
                } else if let Ok((200, _)) =
                    rngd_gateway::probe::get(&url, Duration::from_secs(2)).await
                {
                    self.restarted(&addr);
                } else if now > deadline {
                    self.failed(format!("not ready at {url} within {} s", timeout.as_secs()))
                        .await;
                }
            }
        }
    }

    /// Schedules the next restart of this child, which exited (`what`)
    /// after serving `served`.
    fn retry(&mut self, what: String, served: Duration) {
        let delay = self.backoff.next(served);
        self.restarts += 1;
        note!(
            "rngd-pd up: {} {what}; restarting in {} s (restart {})",
            self.name,
            delay.as_secs_f64(),
            self.restarts
        );
        self.state = State::Waiting {
            until: Instant::now() + delay,
        };
    }

    /// The restart under way failed (`why`): its process is killed and
    /// reaped, and the next attempt scheduled.
    async fn failed(&mut self, why: String) {
        let _ = self.child.start_kill();
        let _ = tokio::time::timeout(Duration::from_secs(5), self.child.wait()).await;
        self.retry(
            format!("did not come back (restart {}: {why})", self.restarts),
            Duration::ZERO,
        );
    }

    /// The restart under way succeeded: the child serves at `addr` again.
    fn restarted(&mut self, addr: &str) {
        note!(
            "rngd-pd up: {} restarted on {addr} (restart {})",
            self.name,
            self.restarts
        );
        self.state = State::Serving {
            since: Instant::now(),
        };
    }
}

/// Starts this same executable as the child `name` (`kind`) with `args` and
/// `envs`: the process, and what it prints up to its address line (a task
/// reads its stdout, echoes every other line to stderr prefixed with the
/// name, and keeps doing so after that line).
fn spawn(
    name: &str,
    kind: ChildKind,
    args: &[String],
    envs: &[(String, String)],
    log_format: &'static str,
) -> anyhow::Result<(Child, oneshot::Receiver<Printed>)> {
    let exe = std::env::current_exe().context("locating this executable")?;
    // The running binary itself, even if its file was replaced since (a
    // rebuild while `up` runs): a restart runs what `up` runs, under the
    // same name in `ps`.
    let mut cmd = if cfg!(target_os = "linux") {
        let mut c = Command::new("/proc/self/exe");
        c.arg0(&exe);
        c
    } else {
        Command::new(&exe)
    };
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        // Its own process group: a Ctrl-C at the terminal reaches `up`
        // alone, which stops the children in order (`stop`).
        .process_group(0);
    cmd.env(rngd_api::env::RNGD_PD_LOG_FORMAT, log_format);
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
    let (tx, rx) = oneshot::channel();
    let name = name.to_string();
    let prefix = kind.ready_prefix();
    tokio::spawn(async move {
        let mut lines = BufReader::new(stdout).lines();
        let mut before = Vec::new();
        let found: Printed = loop {
            match lines.next_line().await {
                Ok(Some(line)) => {
                    if let Some(rest) = line.strip_prefix(prefix) {
                        break Ok((rest.trim().to_string(), before));
                    }
                    note!("[{name}] {line}");
                    before.push(line);
                }
                Ok(None) => {
                    break Err("exited before printing its address (see its log above)".into());
                }
                Err(e) => break Err(format!("reading its output: {e}")),
            }
        };
        let serving = found.is_ok();
        let _ = tx.send(found);
        if serving {
            while let Ok(Some(line)) = lines.next_line().await {
                note!("[{name}] {line}");
            }
        }
    });
    Ok((child, rx))
}

/// Sends SIGTERM to `child` (if it still runs): it drains and exits.
fn terminate(child: &Child) {
    if let Some(id) = child
        .id()
        .and_then(|id| rustix::process::Pid::from_raw(id as i32))
    {
        let _ = rustix::process::kill_process(id, rustix::process::Signal::TERM);
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

/// `http://ADDR` for a printed `ADDR` (or `http://ADDR`).
pub(super) fn http_url(addr: String) -> String {
    if addr.starts_with("http://") {
        addr
    } else {
        format!("http://{addr}")
    }
}
