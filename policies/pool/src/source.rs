//! Where the endpoint list comes from: the [`EndpointSource`] seam and its
//! configured sources — a fixed list ([`StaticEndpoints`], also what the
//! gateway's `--prefill`/`--decode` flags make) and a JSON file reloaded when
//! it changes ([`FileEndpoints`], whose entries may also name the worker's
//! KV-event stream). Live load is added on top by
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

    /// The KV-event streams of the endpoints this source knows of (an
    /// endpoints-file field, a discovery annotation), indexed by
    /// [`crate::cache::PrefixCache`]; the spec's id is the endpoint's
    /// `ip:port`. Default: none.
    fn kv_streams(&self) -> Arc<[KvStream]> {
        Arc::from([])
    }

    /// Restarts seen over all endpoints (a new process on an address the
    /// source already knew): a total that only grows, so a reader can tell
    /// cheaply whether any endpoint restarted since it last looked.
    /// Default: a source that cannot tell, 0.
    fn restarts(&self) -> u64 {
        0
    }

    /// Restarts seen of the endpoint at `address` (0 for one never seen
    /// to restart).
    fn restarts_of(&self, _address: &str) -> u64 {
        0
    }

    /// Changes seen of the endpoints' tokenizer digests (one learnt, one
    /// changed, one forgotten): a total that only grows, so a reader can
    /// tell cheaply whether to look again ([`crate::tokenizers`]).
    /// Default: a source that cannot tell, 0.
    fn tokenizer_changes(&self) -> u64 {
        0
    }

    /// The tokenizer digest the endpoint at `address` last showed
    /// (`rngd_pd_worker_tokenizer_info`), if any.
    fn tokenizer_digest_of(&self, _address: &str) -> Option<String> {
        None
    }
}

/// One endpoint's KV-event stream (its id is the endpoint's `ip:port`).
pub type KvStream = rngd_kv_index::EndpointSpec;

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
    state: RwLock<FileState>,
}

/// The file's bytes and what they parse to.
#[derive(Debug)]
struct FileState {
    raw: Vec<u8>,
    list: Arc<[Endpoint]>,
    streams: Arc<[KvStream]>,
}

/// The stream fields an endpoints-file entry may carry beside the
/// [`Endpoint`] fields.
#[derive(Debug, serde::Deserialize)]
struct StreamFields {
    address: String,
    /// The worker's KV-event PUB endpoint (`tcp://HOST:PORT`).
    #[serde(default)]
    kv_events: Option<String>,
    /// Its replay (ROUTER) endpoint.
    #[serde(default)]
    kv_events_replay: Option<String>,
    /// The topic prefix to subscribe to (default: every topic).
    #[serde(default)]
    kv_events_topic: Option<String>,
}

/// Whether `s` is a ZMQ address the index may connect to: `tcp://HOST:PORT`
/// with a numeric port.
pub fn stream_address_ok(s: &str) -> bool {
    let Some(rest) = s.strip_prefix("tcp://") else {
        return false;
    };
    match rest.rsplit_once(':') {
        Some((host, port)) => {
            !host.is_empty()
                && !host.contains(['/', '*', ' '])
                && port.parse::<u16>().is_ok_and(|p| p != 0)
        }
        None => false,
    }
}

/// The KV-event streams named in the text of an endpoints file (entries
/// without `kv_events` have none); `path` names the file in the error.
pub fn parse_streams(path: &Path, raw: &[u8]) -> Result<Vec<KvStream>, PoolError> {
    let entries: Vec<StreamFields> =
        serde_json::from_slice(raw).map_err(|source| PoolError::EndpointsParse {
            path: path.to_path_buf(),
            source,
        })?;
    let mut out = Vec::new();
    for e in entries {
        let Some(pub_addr) = e.kv_events else {
            if e.kv_events_replay.is_some() {
                return Err(PoolError::Config(format!(
                    "{}: endpoint {}: kv_events_replay without kv_events",
                    path.display(),
                    e.address
                )));
            }
            continue;
        };
        for a in std::iter::once(&pub_addr).chain(e.kv_events_replay.as_ref()) {
            if !stream_address_ok(a) {
                return Err(PoolError::Config(format!(
                    "{}: endpoint {}: {a:?} is not tcp://HOST:PORT",
                    path.display(),
                    e.address
                )));
            }
        }
        out.push(KvStream {
            id: e.address,
            endpoint: pub_addr,
            replay_endpoint: e.kv_events_replay,
            topic: e.kv_events_topic.unwrap_or_default(),
        });
    }
    Ok(out)
}

/// Parses the text of an endpoints file (`path` names it in the error).
pub fn parse_endpoints(path: &Path, raw: &[u8]) -> Result<Vec<Endpoint>, PoolError> {
    serde_json::from_slice(raw).map_err(|source| PoolError::EndpointsParse {
        path: path.to_path_buf(),
        source,
    })
}

/// Reads and parses an endpoints file (its KV-event stream fields are
/// checked too).
pub fn load_endpoints_file(path: &Path) -> Result<Vec<Endpoint>, PoolError> {
    let state = read_endpoints(path)?;
    Ok(state.list.to_vec())
}

fn read_endpoints(path: &Path) -> Result<FileState, PoolError> {
    let raw = std::fs::read(path).map_err(|source| PoolError::EndpointsRead {
        path: path.to_path_buf(),
        source,
    })?;
    let list = parse_endpoints(path, &raw)?;
    let streams = parse_streams(path, &raw)?;
    Ok(FileState {
        raw,
        list: list.into(),
        streams: streams.into(),
    })
}

impl FileEndpoints {
    /// Loads the file (it must exist and parse).
    pub fn load(path: impl Into<PathBuf>) -> Result<Arc<Self>, PoolError> {
        let path = path.into();
        let state = read_endpoints(&path)?;
        tracing::info!(path = %path.display(), endpoints = state.list.len(), kv_streams = state.streams.len(), "endpoints loaded");
        Ok(Arc::new(FileEndpoints {
            path,
            state: RwLock::new(state),
        }))
    }

    /// Re-reads the file; returns whether the list changed.
    pub fn reload(&self) -> Result<bool, PoolError> {
        let new = read_endpoints(&self.path)?;
        let mut state = self.state.write().unwrap_or_else(|e| e.into_inner());
        if state.raw == new.raw {
            return Ok(false);
        }
        tracing::info!(path = %self.path.display(), endpoints = new.list.len(), kv_streams = new.streams.len(), "endpoints reloaded");
        *state = new;
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

impl FileEndpoints {
    fn state(&self) -> std::sync::RwLockReadGuard<'_, FileState> {
        self.state.read().unwrap_or_else(|e| e.into_inner())
    }
}

impl EndpointSource for FileEndpoints {
    fn snapshot(&self) -> Arc<[Endpoint]> {
        Arc::clone(&self.state().list)
    }

    fn kv_streams(&self) -> Arc<[KvStream]> {
        Arc::clone(&self.state().streams)
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
        weight_version: None,
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
    fn file_entries_may_name_their_kv_event_stream() {
        let path = Path::new("e.json");
        let raw = br#"[
            {"address":"10.0.0.1:8000","role":"decode","vendor":"cpu","seq_len":512,
             "kv_events":"tcp://10.0.0.1:5557","kv_events_replay":"tcp://10.0.0.1:5558"},
            {"address":"10.0.0.2:8000","role":"prefill","vendor":"cpu","seq_len":512}
        ]"#;
        assert_eq!(parse_endpoints(path, raw).unwrap().len(), 2);
        let s = parse_streams(path, raw).unwrap();
        assert_eq!(s.len(), 1);
        assert_eq!(s[0].id, "10.0.0.1:8000");
        assert_eq!(s[0].endpoint, "tcp://10.0.0.1:5557");
        assert_eq!(s[0].replay_endpoint.as_deref(), Some("tcp://10.0.0.1:5558"));
        assert_eq!(s[0].topic, "");
        for bad in [
            r#"[{"address":"a:1","kv_events":"ipc:///tmp/x"}]"#,
            r#"[{"address":"a:1","kv_events":"tcp://*:5557"}]"#,
            r#"[{"address":"a:1","kv_events":"tcp://h:0"}]"#,
            r#"[{"address":"a:1","kv_events":"tcp://h:1","kv_events_replay":"h:2"}]"#,
            r#"[{"address":"a:1","kv_events_replay":"tcp://h:2"}]"#,
        ] {
            let e = parse_streams(path, bad.as_bytes()).unwrap_err();
            assert!(e.to_string().contains("a:1"), "{e}");
        }
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
