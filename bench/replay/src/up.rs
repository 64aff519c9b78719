//! `--spawn-up`: starting `rngd-pd up --gateway-port 0 --metrics-port 0`,
//! reading the lines it prints until `rngd-pd up: ready` (gateway URL,
//! workers, shm root), and stopping it with SIGINT at the end.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use crate::Error;

/// Prefix of every line `rngd-pd up` prints on stdout.
const PREFIX: &str = "rngd-pd up: ";

/// What `rngd-pd up` printed before its ready line.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UpInfo {
    /// `gateway` URL.
    pub gateway: Option<String>,
    /// `prefill` worker URL.
    pub prefill: Option<String>,
    /// `decode` worker URL.
    pub decode: Option<String>,
    /// `shm root` directory.
    pub shm_root: Option<PathBuf>,
    /// Workers past the first of their role (`--decode-workers N`,
    /// `--prefill-workers N`): (`decode-1`, URL), … in the order printed.
    pub more_workers: Vec<(String, String)>,
    /// The `ready` line was seen.
    pub ready: bool,
}

impl UpInfo {
    /// Takes one stdout line of `rngd-pd up`.
    pub fn line(&mut self, line: &str) {
        let Some(rest) = line.strip_prefix(PREFIX) else {
            return;
        };
        let field = |key: &str| {
            rest.strip_prefix(key)
                .filter(|r| r.starts_with(' '))
                .map(|r| r.trim().to_string())
        };
        if let Some(v) = field("gateway") {
            self.gateway = Some(v);
        } else if let Some(v) = field("prefill") {
            self.prefill = Some(v);
        } else if let Some(v) = field("decode") {
            self.decode = Some(v);
        } else if let Some((key, url)) = rest.split_once(' ')
            && let Some((role, n)) = key.split_once('-')
            && matches!(role, "prefill" | "decode")
            && !n.is_empty()
            && n.bytes().all(|b| b.is_ascii_digit())
        {
            self.more_workers
                .push((key.to_string(), url.trim().to_string()));
        } else if let Some(v) = field("shm root") {
            self.shm_root = Some(PathBuf::from(v));
        } else if rest.starts_with("ready") {
            self.ready = true;
        }
    }
}

/// A running `rngd-pd up`.
#[derive(Debug)]
pub struct Up {
    child: Child,
    /// Its process id.
    pub pid: u32,
    /// What it printed.
    pub info: UpInfo,
}

/// The `rngd-pd` binary: `explicit`, else `$RNGD_PD_BIN`, else
/// `$CARGO_TARGET_DIR/release/rngd-pd`, else `rngd-pd` beside this
/// executable (the same target directory).
pub fn locate(explicit: Option<&Path>) -> Result<PathBuf, Error> {
    let mut tried = Vec::new();
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Some(p) = explicit {
        candidates.push(p.to_path_buf());
    } else {
        if let Some(p) = std::env::var_os("RNGD_PD_BIN") {
            candidates.push(PathBuf::from(p));
        }
        if let Some(t) = std::env::var_os("CARGO_TARGET_DIR") {
            candidates.push(PathBuf::from(t).join("release/rngd-pd"));
        }
        if let Some(dir) = std::env::current_exe()
            .ok()
            .and_then(|e| e.parent().map(Path::to_path_buf))
        {
            // A test binary lives in `<target>/release/deps`.
            let dir = match dir.parent() {
                Some(p) if dir.ends_with("deps") => p.to_path_buf(),
                _ => dir,
            };
            candidates.push(dir.join("rngd-pd"));
        }
    }
    for c in candidates {
        if c.is_file() {
            return Ok(c);
        }
        tried.push(c.display().to_string());
    }
    Err(Error::NoBinary(tried.join(", ")))
}

/// Starts `bin up --gateway-port 0 --metrics-port 0 --seq-len SEQ_LEN
/// EXTRA...` and waits (up to `timeout`) for its ready line. Its later
/// stdout lines are echoed to stderr; its stderr is inherited.
pub async fn start(
    bin: &Path,
    seq_len: u32,
    extra: &[String],
    timeout: Duration,
) -> Result<Up, Error> {
    let mut cmd = Command::new(bin);
    cmd.args(["up", "--gateway-port", "0", "--metrics-port", "0"])
        .args(["--seq-len", &seq_len.to_string()])
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true);
    let mut child = cmd
        .spawn()
        .map_err(|e| Error::Up(format!("starting {}: {e}", bin.display())))?;
    let pid = child
        .id()
        .ok_or_else(|| Error::Up("rngd-pd up exited at once".into()))?;
    let stdout = child
        .stdout
        .take()
        .ok_or_else(|| Error::Up("no stdout".into()))?;
    let mut lines = BufReader::new(stdout).lines();
    let mut info = UpInfo::default();
    let read = async {
        while let Some(line) = lines
            .next_line()
            .await
            .map_err(|e| Error::Up(format!("reading its output: {e}")))?
        {
            eprintln!("[up] {line}");
            info.line(&line);
            if info.ready {
                return Ok(());
            }
        }
        Err(Error::Up(
            "rngd-pd up exited before its ready line (see its log above)".into(),
        ))
    };
    match tokio::time::timeout(timeout, read).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return Err(e),
        Err(_) => {
            return Err(Error::Up(format!(
                "no ready line within {} s",
                timeout.as_secs()
            )));
        }
    }
    if info.gateway.is_none() {
        return Err(Error::Up("ready, but no gateway line".into()));
    }
    tokio::spawn(async move {
        while let Ok(Some(line)) = lines.next_line().await {
            eprintln!("[up] {line}");
        }
    });
    Ok(Up { child, pid, info })
}

impl Up {
    /// SIGINT, then waits up to `grace` for it to exit (it stops its
    /// children and removes its shm root), else kills it.
    pub async fn stop(mut self, grace: Duration) -> Result<(), Error> {
        crate::procs::interrupt_and_wait(&mut self.child, self.pid, grace)
            .await
            .map_err(Error::Up)
    }
}
