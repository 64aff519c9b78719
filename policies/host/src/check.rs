//! `rngd-pd policy check FILE.wasm`: compile, instantiate, run the built-in
//! canned requests and print the decisions.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use rngd_policy_core::Decision;

use crate::abi::{CapHits, HostEnv, LogBucket};
use crate::guest::{Guest, SnapshotProps};
use crate::runtime::{canned_requests, compile, sandbox_engine, sandbox_linker};
use crate::{PolicyError, SandboxLimits, sha256_hex};

/// What `rngd-pd policy check` is asked to check (the flags are the CLI's).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckOptions {
    /// The `.wasm` module to check. No default.
    pub module: PathBuf,
    /// Plugin configuration file (JSON) the module is configured with;
    /// `None` (the default) configures it with `{}`.
    pub config: Option<PathBuf>,
}

// === impl CheckOptions ===

impl CheckOptions {
    /// Reads the configuration and runs [`check`].
    pub fn run(&self) -> Result<String, PolicyError> {
        let config = match &self.config {
            Some(p) => std::fs::read(p).map_err(|e| PolicyError::Io {
                path: p.clone(),
                source: e,
            })?,
            None => b"{}".to_vec(),
        };
        check(&self.module, &config)
    }
}

struct StopOnDrop(Arc<AtomicBool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// Compiles and instantiates the module with `config`, runs the canned
/// requests and returns a printable report of the decisions; any guest fault
/// or missing decision is an error.
pub fn check(path: &Path, config: &[u8]) -> Result<String, PolicyError> {
    let wasm = std::fs::read(path).map_err(|e| PolicyError::Io {
        path: path.to_path_buf(),
        source: e,
    })?;
    let limits = SandboxLimits {
        instances: 1,
        ..SandboxLimits::default()
    };
    let stop = StopOnDrop(Arc::new(AtomicBool::new(false)));
    let env = HostEnv {
        ticks: Arc::default(),
        log_bucket: Arc::new(LogBucket::new(limits.log_lines_per_second)),
        caps: CapHits::unregistered(),
    };
    let engine = sandbox_engine(&limits, stop.0.clone(), env.ticks.clone())?;
    let linker = sandbox_linker(&engine)?;
    let pre = compile(&engine, &linker, &wasm)?;
    let mut guest = Guest::new(&engine, &pre, &limits, config.to_vec().into(), &env)?;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "module  {} ({} bytes, sha256 {})",
        path.display(),
        wasm.len(),
        sha256_hex(&wasm)
    );
    for (i, (name, mut req)) in canned_requests().into_iter().enumerate() {
        let snap = req.endpoints.as_ref().map(|eps| SnapshotProps {
            json: serde_json::to_string(&**eps).unwrap_or_default().into(),
            version: format!("check-{i}").into(),
        });
        let decision = guest
            .run(&mut req, |_| snap)
            .map_err(|e| PolicyError::SelfTest {
                request: name,
                source: Box::new(e),
            })?;
        let line = match decision {
            Decision::Route(r) => format!(
                "route  decode={} prefill={} transport={}",
                r.decode,
                r.prefill.as_deref().unwrap_or("(local)"),
                r.kv_transport.as_deref().unwrap_or("-")
            ),
            Decision::Reject(l) => format!(
                "reject {} {}",
                l.status,
                l.message()
                    .unwrap_or_else(|| String::from_utf8_lossy(&l.body).into_owned())
            ),
        };
        let _ = writeln!(out, "{name:<32} {line}");
    }
    Ok(out)
}
