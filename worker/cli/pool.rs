//! The pool flags `ext-proc` and `gateway` share: discovery (`--pool-name`,
//! `--pool-namespace`, `--kubeconfig`, as the reference endpoint picker
//! names them) and their [`KubeOptions`]; prefix-cache routing
//! (`--kv-events`, the router's estimates) and its [`CacheOptions`].

use std::path::PathBuf;
use std::time::Duration;

use rngd_pool::discovery::{DEFAULT_STALE_AFTER, KubeOptions};
use rngd_pool::{CacheOptions, KvStream, SourceChoice};

/// Flags of InferencePool discovery.
#[derive(Debug, Clone, clap::Args)]
pub struct PoolArgs {
    /// Name of the InferencePool (`inference.networking.k8s.io/v1`) whose
    /// ready pods are the endpoints, watched through the Kubernetes API
    /// (instead of an endpoints file).
    #[arg(long)]
    pub pool_name: Option<String>,
    /// Namespace of the InferencePool and its pods; unset = `$NAMESPACE`
    /// (the pod's own, from the downward API), else `default`.
    #[arg(long, env = rngd_api::env::NAMESPACE, default_value = "default")]
    pub pool_namespace: String,
    /// kubeconfig file for use outside a cluster; unset = `$KUBECONFIG` or
    /// `~/.kube/config` if present, else the pod's service account.
    #[arg(long)]
    pub kubeconfig: Option<PathBuf>,
    /// A watch that keeps failing marks the endpoint list stale after this
    /// (the last good list is still served), ms.
    #[arg(long, default_value_t = DEFAULT_STALE_AFTER.as_millis() as u64)]
    pub pool_stale_after_ms: u64,
}

impl PoolArgs {
    /// The discovery options, when `--pool-name` is given.
    pub fn options(&self) -> Option<KubeOptions> {
        let name = self.pool_name.as_ref()?;
        let mut o = KubeOptions::new(name.clone(), self.pool_namespace.clone());
        o.kubeconfig = self.kubeconfig.clone();
        o.stale_after = Duration::from_millis(self.pool_stale_after_ms.max(1));
        Some(o)
    }
}

/// The load gauges' names on the endpoints' pages, as the reference picker
/// spells the flags, for model servers that are not vLLM (plain metric
/// names; a label selector is refused).
#[derive(Debug, Clone, clap::Args)]
pub struct LoadNameArgs {
    /// Gauge of the requests waiting on a model server.
    #[arg(long, default_value = rngd_telemetry::names::VLLM_NUM_REQUESTS_WAITING)]
    pub total_queued_requests_metric: String,
    /// Gauge of the requests running on a model server.
    #[arg(long, default_value = rngd_telemetry::names::VLLM_NUM_REQUESTS_RUNNING)]
    pub total_running_requests_metric: String,
    /// Gauge of a model server's KV-cache usage, 0..1.
    #[arg(long, default_value = rngd_telemetry::names::VLLM_KV_CACHE_USAGE_PERC)]
    pub kv_cache_usage_percentage_metric: String,
}

impl LoadNameArgs {
    /// The names, checked.
    pub fn names(&self) -> anyhow::Result<rngd_pool::LoadNames> {
        let n = rngd_pool::LoadNames {
            waiting: self.total_queued_requests_metric.clone(),
            running: self.total_running_requests_metric.clone(),
            kv_usage: self.kv_cache_usage_percentage_metric.clone(),
        };
        n.check()
            .map_err(|e| anyhow::anyhow!("load metric names: {e}"))?;
        Ok(n)
    }
}

/// Flags of prefix-cache routing (`docs/kv-index.md`).
#[derive(Debug, Clone, clap::Args)]
pub struct PrefixArgs {
    /// A worker's KV-event stream to index (repeat per worker):
    /// `ADDRESS=PUB[,REPLAY]`, ADDRESS the worker's `host:port` as the
    /// endpoints name it, PUB and REPLAY its `--kv-events-config` endpoints
    /// (`tcp://host:port`). Streams named by an endpoints file
    /// (`kv_events`) or a pod annotation (`rngd-pd.io/kv-events-port`) are
    /// followed too; a flag wins for its address.
    #[arg(long = "kv-events", value_name = "ADDRESS=PUB[,REPLAY]", value_parser = parse_kv_events)]
    pub kv_events: Vec<KvStream>,
    /// Route on load alone: no KV-event index, no estimates.
    #[arg(long)]
    pub no_prefix_routing: bool,
    /// Approximate mode: credit endpoints without a KV-event stream with the
    /// prompt blocks routed to them recently (labelled `estimated`).
    #[arg(long)]
    pub approximate_prefix: bool,
    /// How long an approximate entry lives, ms.
    #[arg(long, default_value_t = CacheOptions::default().estimate.ttl.as_millis() as u64)]
    pub approximate_prefix_ttl_ms: u64,
    /// How long a routed prompt counts as cached on an endpoint with a
    /// stream before its events confirm it, ms (0 = not at all).
    #[arg(long, default_value_t = CacheOptions::default().estimate.speculative_ttl.as_millis() as u64)]
    pub speculative_prefix_ttl_ms: u64,
    /// Blocks the KV-event index holds at most over all endpoints (least
    /// recently used evicted past it).
    #[arg(long, default_value_t = CacheOptions::default().index.max_blocks)]
    pub kv_index_max_blocks: usize,
}

impl PrefixArgs {
    /// The cache options; `None` (load alone) with `--no-prefix-routing`, or
    /// when nothing could inform it: no `--kv-events`, no approximate mode
    /// and a fixed endpoint list (a file or discovery may name streams).
    pub fn options(&self, source: &SourceChoice) -> Option<CacheOptions> {
        if self.no_prefix_routing {
            return None;
        }
        let source_may_name_streams = !matches!(source, SourceChoice::Static(_));
        if self.kv_events.is_empty() && !self.approximate_prefix && !source_may_name_streams {
            return None;
        }
        let mut o = CacheOptions {
            streams: self.kv_events.clone(),
            ..CacheOptions::default()
        };
        o.estimate.approximate = self.approximate_prefix;
        o.estimate.ttl = Duration::from_millis(self.approximate_prefix_ttl_ms.max(1));
        o.estimate.speculative_ttl = Duration::from_millis(self.speculative_prefix_ttl_ms);
        o.index.max_blocks = self.kv_index_max_blocks.max(1);
        Some(o)
    }
}

/// `--kv-events ADDRESS=PUB[,REPLAY]`.
fn parse_kv_events(s: &str) -> Result<KvStream, String> {
    let bad = || format!("{s}: expected ADDRESS=tcp://HOST:PORT[,tcp://HOST:PORT]");
    let (id, rest) = s.split_once('=').ok_or_else(bad)?;
    let (publ, replay) = match rest.split_once(',') {
        Some((p, r)) => (p, Some(r.to_string())),
        None => (rest, None),
    };
    if id.is_empty()
        || !rngd_pool::source::stream_address_ok(publ)
        || replay
            .as_deref()
            .is_some_and(|r| !rngd_pool::source::stream_address_ok(r))
    {
        return Err(bad());
    }
    Ok(KvStream {
        id: id.to_string(),
        endpoint: publ.to_string(),
        replay_endpoint: replay,
        topic: String::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_events_flags_name_tcp_endpoints_only() {
        let s = parse_kv_events("127.0.0.1:8001=tcp://127.0.0.1:5557,tcp://127.0.0.1:5558")
            .expect("parses");
        assert_eq!(s.id, "127.0.0.1:8001");
        assert_eq!(s.replay_endpoint.as_deref(), Some("tcp://127.0.0.1:5558"));
        for bad in [
            "tcp://h:1",
            "=tcp://h:1",
            "a:1=ipc:///tmp/s",
            "a:1=tcp://h:1,",
            "a:1=tcp://*:1",
        ] {
            assert!(parse_kv_events(bad).is_err(), "{bad}");
        }
    }
}
