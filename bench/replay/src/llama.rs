//! `--llama-server`: the peer of a comparison run ([`crate::compare`]).
//! Starts llama.cpp's `llama-server -m GGUF -t THREADS -np PARALLEL -c
//! PARALLEL×SEQ_LEN --host 127.0.0.1 --port PORT` (each slot gets the compiled
//! context; its prompt cache is on by default: `cache_prompt` defaults to
//! true per request, and `--cache-ram` keeps prompt states across slots),
//! waits for `GET /health` to answer 200 (503 while the model loads), and
//! stops it with SIGINT. Its `/v1/completions` takes token-id prompts and
//! reports `usage.prompt_tokens_details.cached_tokens` in the final chunk of
//! a stream, which the replay reads as for rngd-pd.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use tokio::process::{Child, Command};

use crate::Error;

/// How the peer is started.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LlamaConfig {
    /// The `llama-server` binary.
    pub bin: PathBuf,
    /// The GGUF it loads (the one rngd-pd serves).
    pub model: PathBuf,
    /// `-t`: threads.
    pub threads: u32,
    /// `-np`: parallel slots.
    pub parallel: u32,
    /// Context of one slot (`-c` is this × `parallel`).
    pub seq_len: u32,
    /// More arguments, appended.
    pub extra: Vec<String>,
}

impl LlamaConfig {
    /// Its arguments for a server on `port`.
    pub fn args(&self, port: u16) -> Vec<String> {
        let mut a: Vec<String> = vec![
            "-m".into(),
            self.model.display().to_string(),
            "-t".into(),
            self.threads.to_string(),
            "-np".into(),
            self.parallel.to_string(),
            "-c".into(),
            (u64::from(self.seq_len) * u64::from(self.parallel)).to_string(),
            "--host".into(),
            "127.0.0.1".into(),
            "--port".into(),
            port.to_string(),
        ];
        a.extend(self.extra.iter().cloned());
        a
    }
}

/// A running `llama-server`.
#[derive(Debug)]
pub struct LlamaServer {
    child: Child,
    /// Its process id.
    pub pid: u32,
    /// Its base URL.
    pub url: String,
    /// Its port.
    pub port: u16,
    /// Where its output goes.
    pub log: PathBuf,
}

/// A free loopback port (bound and released; the server binds it next).
fn free_port() -> Result<u16, Error> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| Error::LlamaServer(format!("finding a free port: {e}")))
}

/// Starts the server and waits (up to `timeout`) for `/health` to answer
/// 200. Its stdout and stderr go to a log file in the temporary directory
/// (named in errors).
pub async fn start(cfg: &LlamaConfig, timeout: Duration) -> Result<LlamaServer, Error> {
    if !cfg.model.is_file() {
        return Err(Error::LlamaServer(format!(
            "no model at {} (pass --llama-model or run `rngd-pd model fetch`)",
            cfg.model.display()
        )));
    }
    let port = free_port()?;
    let log = std::env::temp_dir().join(format!(
        "rngd-pd-bench-llama-server-{}.log",
        std::process::id()
    ));
    let out = std::fs::File::create(&log)
        .map_err(|e| Error::LlamaServer(format!("creating {}: {e}", log.display())))?;
    let err = out
        .try_clone()
        .map_err(|e| Error::LlamaServer(format!("{}: {e}", log.display())))?;
    let mut child = Command::new(&cfg.bin)
        .args(cfg.args(port))
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| Error::LlamaServer(format!("starting {}: {e}", cfg.bin.display())))?;
    let pid = child
        .id()
        .ok_or_else(|| Error::LlamaServer("llama-server exited at once".into()))?;
    let url = format!("http://127.0.0.1:{port}");
    let client = reqwest::Client::new();
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Err(Error::LlamaServer(format!(
                "exited ({status}) before it was healthy; see {}",
                log.display()
            )));
        }
        let healthy = client
            .get(format!("{url}/health"))
            .timeout(Duration::from_secs(2))
            .send()
            .await
            .is_ok_and(|r| r.status().is_success());
        if healthy {
            return Ok(LlamaServer {
                child,
                pid,
                url,
                port,
                log,
            });
        }
        if Instant::now() >= deadline {
            let _ = child.kill().await;
            return Err(Error::LlamaServer(format!(
                "not healthy within {} s; see {}",
                timeout.as_secs(),
                log.display()
            )));
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

impl LlamaServer {
    /// SIGINT, then waits up to `grace` for it to exit, else kills it.
    pub async fn stop(mut self, grace: Duration) -> Result<(), Error> {
        crate::procs::interrupt_and_wait(&mut self.child, self.pid, grace)
            .await
            .map_err(Error::LlamaServer)
    }
}

/// The GGUF `rngd-pd` serves by default: the path `rngd-pd model fetch`
/// prints (it downloads the model only when it is missing).
pub async fn default_model(rngd_pd: &Path) -> Result<PathBuf, Error> {
    let out = Command::new(rngd_pd)
        .args(["model", "fetch"])
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .await
        .map_err(|e| Error::LlamaServer(format!("{} model fetch: {e}", rngd_pd.display())))?;
    let text = String::from_utf8_lossy(&out.stdout);
    match text.lines().rev().find(|l| !l.trim().is_empty()) {
        Some(line) if out.status.success() => Ok(PathBuf::from(line.trim())),
        _ => Err(Error::LlamaServer(format!(
            "{} model fetch failed ({}); pass --llama-model",
            rngd_pd.display(),
            out.status
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments_give_each_slot_the_compiled_context() {
        let cfg = LlamaConfig {
            bin: "llama-server".into(),
            model: "/m/x.gguf".into(),
            threads: 2,
            parallel: 4,
            seq_len: 512,
            extra: vec!["--metrics".into()],
        };
        assert_eq!(
            cfg.args(8080).join(" "),
            "-m /m/x.gguf -t 2 -np 4 -c 2048 --host 127.0.0.1 --port 8080 --metrics"
        );
    }
}
