//! `--spawn-worker` (and `rngd-pd-bench prefix`): starting one solo
//! `rngd-pd worker --port 0`, reading the line it prints once its model is
//! loaded (`rngd-pd worker listening on http://ADDR`), and stopping it with
//! SIGINT at the end.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use crate::Error;

/// What a worker prints on stdout once it serves with its model loaded
/// (`rngd_worker::LISTENING_PREFIX`), followed by its address.
pub const LISTENING_PREFIX: &str = "rngd-pd worker listening on http://";

/// What a worker prints on stdout once its admin listener is bound
/// (`rngd_worker::ADMIN_PREFIX`), followed by its address.
pub const ADMIN_PREFIX: &str = "rngd-pd worker admin on http://";

/// A running worker started here.
#[derive(Debug)]
pub struct Worker {
    child: Child,
    /// Its process id.
    pub pid: u32,
    /// Its base URL (`http://ADDR`).
    pub url: String,
    /// Its admin listener's base URL, when it has one (`--admin-listen`).
    pub admin_url: Option<String>,
}

/// The worker's base URL from one stdout line, if it is the listening line.
pub fn listening_url(line: &str) -> Option<String> {
    let addr = line.trim().strip_prefix(LISTENING_PREFIX)?;
    (!addr.is_empty()).then(|| format!("http://{addr}"))
}

/// Starts `bin worker --role solo --host 127.0.0.1 --port 0 --seq-len
/// SEQ_LEN EXTRA...` and waits (up to `timeout`) for its listening line.
/// Its stderr is inherited (`RUST_LOG=warn` unless `RUST_LOG` is set);
/// later stdout lines are echoed to stderr.
pub async fn start(
    bin: &Path,
    seq_len: u32,
    extra: &[String],
    timeout: Duration,
) -> Result<Worker, Error> {
    start_with_env(bin, seq_len, extra, &[], timeout).await
}

/// [`start`] with extra environment variables (e.g. the admin token).
pub async fn start_with_env(
    bin: &Path,
    seq_len: u32,
    extra: &[String],
    env: &[(String, String)],
    timeout: Duration,
) -> Result<Worker, Error> {
    let mut cmd = Command::new(bin);
    cmd.envs(env.iter().map(|(k, v)| (k, v)));
    cmd.args([
        "worker",
        "--role",
        "solo",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
    ])
    .args(["--seq-len", &seq_len.to_string()])
    .args(extra)
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(Stdio::inherit())
    .kill_on_drop(true);
    if std::env::var_os("RUST_LOG").is_none() {
        cmd.env("RUST_LOG", "warn");
    }
    let mut child = cmd
        .spawn()
        .map_err(|e| Error::Worker(format!("starting {}: {e}", bin.display())))?;
    let pid = child
        .id()
        .ok_or_else(|| Error::Worker("rngd-pd worker exited at once".into()))?;
    let stdout = child
        .stdout
        .take()
        .ok_or_else(|| Error::Worker("no stdout".into()))?;
    let mut lines = BufReader::new(stdout).lines();
    let mut admin_url = None;
    let read = async {
        while let Some(line) = lines
            .next_line()
            .await
            .map_err(|e| Error::Worker(format!("reading its output: {e}")))?
        {
            if let Some(url) = listening_url(&line) {
                return Ok(url);
            }
            if let Some(a) = line.trim().strip_prefix(ADMIN_PREFIX) {
                admin_url = Some(format!("http://{a}"));
            }
            eprintln!("[worker] {line}");
        }
        Err(Error::Worker(
            "rngd-pd worker exited before its listening line (see its log above; \
             `rngd-pd model fetch` gets the default model)"
                .into(),
        ))
    };
    let url = match tokio::time::timeout(timeout, read).await {
        Ok(r) => r?,
        Err(_) => {
            return Err(Error::Worker(format!(
                "no listening line within {} s",
                timeout.as_secs()
            )));
        }
    };
    tokio::spawn(async move {
        while let Ok(Some(line)) = lines.next_line().await {
            eprintln!("[worker] {line}");
        }
    });
    Ok(Worker {
        child,
        pid,
        url,
        admin_url,
    })
}

impl Worker {
    /// SIGINT, then waits up to `grace` for it to exit, else kills it.
    pub async fn stop(mut self, grace: Duration) -> Result<(), Error> {
        crate::procs::interrupt_and_wait(&mut self.child, self.pid, grace)
            .await
            .map_err(Error::Worker)
    }
}
