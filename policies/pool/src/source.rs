//! Where the endpoint list comes from: the [`EndpointSource`] seam and its
//! configured sources — a fixed list ([`StaticEndpoints`], also what the
//! gateway's `--prefill`/`--decode` flags make) and a JSON file reloaded when
//! it changes ([`FileEndpoints`]). Live load is added on top by
//! [`crate::scrape::ScrapedEndpoints`].

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use rngd_policy_core::{Endpoint, Role, Vendor};
use tokio::task::JoinHandle;

use crate::PoolError;

/// Default poll interval of the endpoints file.
pub const DEFAULT_FILE_POLL: Duration = Duration::from_millis(200);

/// A source of the endpoint snapshot the policy sees.
pub trait EndpointSource: Send + Sync + 'static {
    /// The endpoints now. A source hands out the same `Arc` while its list is
    /// unchanged, so a consumer can recognise an unchanged list by pointer
    /// (the policy host then skips re-serializing it).
    fn snapshot(&self) -> Arc<[Endpoint]>;
}

/// Whether at least one endpoint that can decode is healthy in `snapshot`.
pub fn can_serve(snapshot: &[Endpoint]) -> bool {
    snapshot
        .iter()
        .any(|e| e.healthy && matches!(e.role, Role::Decode | Role::Solo))
}

// === impl StaticEndpoints ===

/// A fixed, replaceable list (flags, tests, embedding).
#[derive(Debug, Default)]
pub struct StaticEndpoints {
    list: RwLock<Arc<[Endpoint]>>,
}

impl StaticEndpoints {
    /// A source with these endpoints.
    pub fn new(list: Vec<Endpoint>) -> Arc<Self> {
        Arc::new(StaticEndpoints {
            list: RwLock::new(list.into()),
        })
    }

    /// Replaces the list.
    pub fn set(&self, list: Vec<Endpoint>) {
        *self.list.write().unwrap_or_else(|e| e.into_inner()) = list.into();
    }
}

impl EndpointSource for StaticEndpoints {
    fn snapshot(&self) -> Arc<[Endpoint]> {
        Arc::clone(&self.list.read().unwrap_or_else(|e| e.into_inner()))
    }
}

// === impl FileEndpoints ===

/// Endpoints from a JSON file (a list of [`Endpoint`]), reloaded on change.
///
/// A file that fails to parse on reload is logged and ignored: the last good
/// list stays active.
#[derive(Debug)]
pub struct FileEndpoints {
    path: PathBuf,
    state: RwLock<(Vec<u8>, Arc<[Endpoint]>)>,
}

/// Parses the text of an endpoints file (`path` names it in the error).
pub fn parse_endpoints(path: &Path, raw: &[u8]) -> Result<Vec<Endpoint>, PoolError> {
    serde_json::from_slice(raw).map_err(|source| PoolError::EndpointsParse {
        path: path.to_path_buf(),
        source,
    })
}

/// Reads and parses an endpoints file.
pub fn load_endpoints_file(path: &Path) -> Result<Vec<Endpoint>, PoolError> {
    let raw = std::fs::read(path).map_err(|source| PoolError::EndpointsRead {
        path: path.to_path_buf(),
        source,
    })?;
    parse_endpoints(path, &raw)
}

fn read_endpoints(path: &Path) -> Result<(Vec<u8>, Arc<[Endpoint]>), PoolError> {
    let raw = std::fs::read(path).map_err(|source| PoolError::EndpointsRead {
        path: path.to_path_buf(),
        source,
    })?;
    let list = parse_endpoints(path, &raw)?;
    Ok((raw, list.into()))
}

impl FileEndpoints {
    /// Loads the file (it must exist and parse).
    pub fn load(path: impl Into<PathBuf>) -> Result<Arc<Self>, PoolError> {
        let path = path.into();
        let state = read_endpoints(&path)?;
        tracing::info!(path = %path.display(), endpoints = state.1.len(), "endpoints loaded");
        Ok(Arc::new(FileEndpoints {
            path,
            state: RwLock::new(state),
        }))
    }

    /// Re-reads the file; returns whether the list changed.
    pub fn reload(&self) -> Result<bool, PoolError> {
        let (raw, list) = read_endpoints(&self.path)?;
        let mut state = self.state.write().unwrap_or_else(|e| e.into_inner());
        if state.0 == raw {
            return Ok(false);
        }
        tracing::info!(path = %self.path.display(), endpoints = list.len(), "endpoints reloaded");
        *state = (raw, list);
        Ok(true)
    }

    /// Polls the file every `every` and reloads it when its content changes.
    pub fn watch(self: &Arc<Self>, every: Duration) -> JoinHandle<()> {
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut last_error = String::new();
            loop {
                tick.tick().await;
                let Some(this) = weak.upgrade() else { break };
                match this.reload() {
                    Ok(_) => last_error.clear(),
                    Err(e) => {
                        let msg = e.to_string();
                        if msg != last_error {
                            tracing::warn!(error = %e, "endpoints file not reloaded; keeping the last good list");
                            last_error = msg;
                        }
                    }
                }
            }
        })
    }
}

impl EndpointSource for FileEndpoints {
    fn snapshot(&self) -> Arc<[Endpoint]> {
        Arc::clone(&self.state.read().unwrap_or_else(|e| e.into_inner()).1)
    }
}

// === endpoints from flags ===

/// `host:port` of a worker URL (`http://host:port/…`, or already `host:port`).
pub fn address_of(url: &str) -> Result<String, PoolError> {
    if url.starts_with("https://") {
        return Err(PoolError::Config(format!("{url}: workers are plain http")));
    }
    let rest = url
        .strip_prefix("http://")
        .or_else(|| url.strip_prefix("HTTP://"))
        .unwrap_or(url);
    let addr = rest.split('/').next().unwrap_or("");
    if addr.is_empty() || !addr.contains(':') {
        return Err(PoolError::Config(format!(
            "{url}: expected http://HOST:PORT"
        )));
    }
    Ok(addr.to_string())
}

/// An endpoint of the CPU backend on this node (from `--prefill`/`--decode` flags).
pub fn local_endpoint(
    address: String,
    role: Role,
    seq_len: u32,
    transports: &[String],
) -> Endpoint {
    Endpoint {
        address,
        role,
        vendor: Vendor::Cpu,
        node: "local".to_string(),
        seq_len,
        queue_depth: 0,
        running: 0,
        kv_usage: 0.0,
        healthy: true,
        transports: transports.to_vec(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ep(addr: &str) -> Endpoint {
        local_endpoint(addr.to_string(), Role::Solo, 512, &[])
    }

    #[test]
    fn addresses_from_urls() {
        assert_eq!(
            address_of("http://127.0.0.1:8000").unwrap(),
            "127.0.0.1:8000"
        );
        assert_eq!(address_of("http://h:1/v1").unwrap(), "h:1");
        assert_eq!(address_of("h:2").unwrap(), "h:2");
        assert!(address_of("https://h:1").is_err());
        assert!(address_of("http://nohost").is_err());
    }

    #[tokio::test]
    async fn file_endpoints_reload_on_change_and_keep_last_good() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("endpoints.json");
        std::fs::write(&path, serde_json::to_vec(&vec![ep("1.1.1.1:1")]).unwrap()).unwrap();
        let src = FileEndpoints::load(&path).expect("load");
        assert_eq!(src.snapshot().len(), 1);
        let first = src.snapshot();
        assert!(!src.reload().expect("reload"));
        assert!(Arc::ptr_eq(&first, &src.snapshot()), "unchanged → same Arc");
        std::fs::write(
            &path,
            serde_json::to_vec(&vec![ep("1.1.1.1:1"), ep("2.2.2.2:2")]).unwrap(),
        )
        .unwrap();
        assert!(src.reload().expect("reload"));
        assert_eq!(src.snapshot()[1].address, "2.2.2.2:2");
        std::fs::write(&path, b"not json").unwrap();
        assert!(matches!(
            src.reload(),
            Err(PoolError::EndpointsParse { .. })
        ));
        assert_eq!(src.snapshot().len(), 2, "last good list stays");
    }

    #[test]
    fn serving_needs_a_healthy_decoder() {
        let mut p = local_endpoint("a:1".into(), Role::Prefill, 512, &[]);
        assert!(!can_serve(std::slice::from_ref(&p)));
        p.role = Role::Decode;
        assert!(can_serve(std::slice::from_ref(&p)));
        p.healthy = false;
        assert!(!can_serve(&[p]));
    }
}
