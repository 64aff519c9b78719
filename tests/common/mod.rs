//! What the root tests that start real `rngd-pd` processes share: the model
//! they need and [`Proc`], a child process started and awaited by its ready
//! line, killed on drop (its log printed when the test failed); [`http`], the
//! requests they send; [`shm`], what a `shm` root holds.
#![allow(dead_code)]

pub mod http;
pub mod shm;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// The name the default model is served under (from its GGUF metadata;
/// docs/engine.md): every door refuses any other with 404.
pub const SERVED_MODEL: &str = "smollm2-135M-instruct";

/// Longest wait for a process's ready line (a worker loads the model).
pub const STARTUP: Duration = Duration::from_secs(600);

/// The real model (`RNGD_PD_MODEL`, or the cache `rngd-pd model fetch` fills).
pub fn model() -> PathBuf {
    match rngd_engine::model_fetch::resolve(None) {
        Ok(p) => p,
        Err(e) => panic!(
            "these tests need the real model: {e} (run `rngd-pd model fetch` or set RNGD_PD_MODEL)"
        ),
    }
}

/// A child process killed on drop (SIGKILL also ends a stopped one).
pub struct Proc {
    /// Name in messages and the log file.
    pub name: String,
    /// The process.
    pub child: Child,
    /// What followed the ready prefix on stdout (its address).
    pub addr: String,
    /// Its stderr log.
    pub log: PathBuf,
}

impl Proc {
    /// Starts `rngd-pd <args>` and waits for the stdout line starting with `prefix`.
    pub fn start(
        name: &str,
        dir: &Path,
        args: &[&str],
        envs: &[(&str, String)],
        prefix: &str,
    ) -> Proc {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_rngd-pd"));
        cmd.args(args);
        Proc::launch(name, dir, cmd, envs, prefix)
    }

    /// Starts `rngd-pd <args>` inside the network namespace `ns`
    /// (`ip netns exec`, which execs the binary: the pid is the worker's).
    pub fn start_in_netns(
        ns: &str,
        name: &str,
        dir: &Path,
        args: &[&str],
        envs: &[(&str, String)],
        prefix: &str,
    ) -> Proc {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", ns, env!("CARGO_BIN_EXE_rngd-pd")])
            .args(args);
        Proc::launch(name, dir, cmd, envs, prefix)
    }

    /// Runs `cmd` with `envs`, its stderr in `dir/<name>.log`, and waits for
    /// the stdout line starting with `prefix`; what follows it is `addr`.
    fn launch(
        name: &str,
        dir: &Path,
        mut cmd: Command,
        envs: &[(&str, String)],
        prefix: &str,
    ) -> Proc {
        let log = dir.join(format!("{name}.log"));
        cmd.env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).unwrap());
        for (k, v) in envs {
            cmd.env(k, v);
        }
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("spawning {name}: {e}"));
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        let p = prefix.to_string();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if let Some(addr) = line.strip_prefix(&p) {
                    let _ = tx.send(addr.trim().to_string());
                }
            }
        });
        let mut proc = Proc {
            name: name.to_string(),
            child,
            addr: String::new(),
            log,
        };
        match rx.recv_timeout(STARTUP) {
            Ok(addr) => proc.addr = addr,
            Err(_) => {
                let status = proc.child.try_wait().ok().flatten();
                panic!(
                    "{name} did not print `{prefix}…` (exit status {status:?}); its log:\n{}",
                    std::fs::read_to_string(&proc.log).unwrap_or_default()
                );
            }
        }
        proc
    }

    /// `rngd-pd worker --role ROLE --port 0`, ready when it prints its address.
    pub fn worker(name: &str, dir: &Path, role: &str, envs: &[(&str, String)]) -> Proc {
        let mut p = Proc::start(
            name,
            dir,
            &["worker", "--role", role, "--port", "0"],
            envs,
            "rngd-pd worker listening on http://",
        );
        p.addr = p.addr.trim_start_matches("http://").to_string();
        p
    }

    /// `http://ADDR{path}`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// Sends `sig` (e.g. `-STOP`) with kill(1).
    pub fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args([sig, &self.child.id().to_string()])
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        assert!(ok, "kill {sig} {} ({}) failed", self.child.id(), self.name);
    }

    /// SIGKILL, no cleanup.
    pub fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Its log so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("--- log of {} ---\n{}", self.name, self.log_text());
        }
    }
}
