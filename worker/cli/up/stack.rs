//! `rngd-pd up`'s children: starting one (this same executable) and reading
//! its printed address, waiting for its readiness, noticing one exit, and
//! stopping every one of them ([`Stack`]: killed and reaped on `stop` or
//! drop, the shm root and the scratch directory removed).

use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// A started child.
struct Proc {
    /// Its name in logs (`relay`, `prefill-0`, `decode-1`, `gateway`, ...).
    name: String,
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

    /// Kills every child, waits for each (10 s at most), removes the
    /// directories.
    pub(super) async fn stop(&mut self) {
        // Reverse start order: the gateway first, the relay last.
        for p in self.procs.iter_mut().rev() {
            let _ = p.child.start_kill();
        }
        for p in self.procs.iter_mut().rev() {
            match tokio::time::timeout(Duration::from_secs(10), p.child.wait()).await {
                Ok(Ok(status)) => tracing::debug!(child = %p.name, %status, "child stopped"),
                Ok(Err(e)) => note!("rngd-pd up: waiting for {}: {e}", p.name),
                Err(_) => note!("rngd-pd up: {} did not stop within 10 s", p.name),
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
