//! `rngd-pd up`'s children: starting one (this same executable) and reading
//! its printed address, waiting for its readiness, noticing one exit, and
//! stopping every one of them ([`Stack`]: drained tier by tier and reaped on
//! `stop`, killed on drop; the shm root and the scratch directory removed).

use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

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

/// A started child.
struct Proc {
    /// Its name in logs (`relay`, `prefill-0`, `decode-1`, `gateway`, ...).
    name: String,
    tier: Tier,
    child: Child,
}

/// The children, stopped (killed and reaped) on drop or `stop`.
pub(super) struct Stack {
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
    /// at once. Then the directories are removed.
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

    /// Starts `exe ARGS`, returns once a stdout line starts with `prefix`:
    /// the rest of that line and the lines printed before it. Later stdout
    /// lines are echoed to stderr prefixed with the child's name.
    pub(super) async fn start(
        &mut self,
        name: &str,
        tier: Tier,
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
            .kill_on_drop(true)
            // Its own process group: a Ctrl-C at the terminal reaches `up`
            // alone, which stops the children in order (`stop`).
            .process_group(0);
        cmd.env(rngd_api::env::RNGD_PD_LOG_FORMAT, self.log_format);
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
        self.procs.push(Proc {
            name: name.to_string(),
            tier,
            child,
        });
        let mut lines = BufReader::new(stdout).lines();
        let mut before = Vec::new();
        let found = loop {
            match lines.next_line().await {
                Ok(Some(line)) => {
                    if let Some(rest) = line.strip_prefix(prefix) {
                        break rest.trim().to_string();
                    }
                    note!("[{name}] {line}");
                    before.push(line);
                }
                Ok(None) => bail!("{name} exited before printing its address (see its log above)"),
                Err(e) => bail!("reading {name}'s output: {e}"),
            }
        };
        let name = name.to_string();
        tokio::spawn(async move {
            while let Ok(Some(line)) = lines.next_line().await {
                note!("[{name}] {line}");
            }
        });
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

    /// Resolves with `NAME exited (STATUS)` for the first child that exits.
    pub(super) async fn watch_children(&mut self) -> String {
        loop {
            if let Some(name) = self.exited() {
                return name;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
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
