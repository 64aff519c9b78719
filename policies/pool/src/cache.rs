//! [`PrefixCache`]: where each endpoint holds a prompt's prefix, for both
//! front doors. It owns the KV-event index ([`rngd_kv_index::KvIndexer`])
//! and keeps it subscribed to the streams the endpoint source names (an
//! endpoints-file field, a discovery annotation) plus those given by flags;
//! it answers the picker's lookups ([`crate::prefix::PrefixSource`]) and
//! remembers what the picker routed:
//!
//! - an endpoint with a live stream: the indexed prefix, raised by
//!   *speculative* entries (what was routed there in the last
//!   [`EstimateOptions::speculative_ttl`], until its events confirm it);
//! - an endpoint whose stream is down (stale, broken, replaying): no cache
//!   information (`ADDRESS=?`), so the policy routes it on load alone; the
//!   `rngd_pd_kv_index_stream_up` gauge drops to 0, the lookup counts as
//!   `stream_down` and one WARN line says so (one INFO line when it is back);
//! - an endpoint without a stream: with [`EstimateOptions::approximate`],
//!   what the router sent there in the last [`EstimateOptions::ttl`]
//!   (`estimated`), else no information (`no_stream`).
//!
//! - [`estimate`]: the bounded memory of routed blocks;
//! - [`metrics`]: the index and lookup metrics.

pub mod estimate;
pub mod metrics;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use rngd_kv_index::{Health, KvIndexer, salted_block_keys};
use rngd_policy_core::Route;
use tokio::task::JoinHandle;

use crate::PoolError;
use crate::source::{EndpointSource, KvStream};
use estimate::Estimates;
use metrics::{CacheMetrics, Exported};

/// The router's own estimates of what it sent where.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EstimateOptions {
    /// Approximate mode: endpoints without a KV-event stream are credited
    /// with the blocks routed to them in the last [`EstimateOptions::ttl`]
    /// (labelled `estimated` in `rngd_pd_prefix_lookups_total`). Default
    /// off: without a stream an endpoint has no cache information.
    pub approximate: bool,
    /// How long an approximate entry lives. Default 120 s.
    pub ttl: Duration,
    /// How long a speculative entry (an endpoint with a stream, after a
    /// pick, before its events arrive) lives; zero = none. Default 2 s.
    pub speculative_ttl: Duration,
    /// Entries remembered at most, per kind. Default 200,000.
    pub max_entries: usize,
    /// Block size of the estimates, in tokens (endpoints that published
    /// events use their own). Default 16 (vLLM's and the workers').
    pub block_size: usize,
}

impl Default for EstimateOptions {
    fn default() -> Self {
        EstimateOptions {
            approximate: false,
            ttl: Duration::from_secs(120),
            speculative_ttl: Duration::from_secs(2),
            max_entries: 200_000,
            block_size: 16,
        }
    }
}

/// Everything a [`PrefixCache`] is started from.
#[derive(Debug, Clone)]
pub struct CacheOptions {
    /// Streams given by flags (`--kv-events ADDRESS=PUB[,REPLAY]`); they
    /// win over a stream the source names for the same endpoint.
    pub streams: Vec<KvStream>,
    /// The index's bounds and deadlines.
    pub index: rngd_kv_index::Options,
    /// How often the stream list is compared with the source's and the
    /// metrics refreshed. Default 500 ms.
    pub sync_every: Duration,
    /// The router's own estimates.
    pub estimate: EstimateOptions,
}

impl Default for CacheOptions {
    fn default() -> Self {
        CacheOptions {
            streams: Vec::new(),
            index: rngd_kv_index::Options::default(),
            sync_every: Duration::from_millis(500),
            estimate: EstimateOptions::default(),
        }
    }
}

/// The prefix cache the doors' picker asks.
pub struct PrefixCache {
    indexer: KvIndexer,
    source: Arc<dyn EndpointSource>,
    flags: Vec<KvStream>,
    estimate: EstimateOptions,
    /// The endpoints whose streams the index follows now.
    streamed: RwLock<Arc<HashSet<String>>>,
    speculative: Mutex<Estimates>,
    approximate: Mutex<Estimates>,
    metrics: CacheMetrics,
    sync: Mutex<SyncState>,
}

impl std::fmt::Debug for PrefixCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefixCache")
            .field("estimate", &self.estimate)
            .finish_non_exhaustive()
    }
}

#[derive(Debug, Default)]
struct SyncState {
    applied: Option<Vec<KvStream>>,
    last_error: String,
    /// Streamed endpoints without cache information now, by state.
    down: HashMap<String, Health>,
    exported: Exported,
}

/// A running [`PrefixCache`] and its sync task (stopped on drop).
#[derive(Debug)]
pub struct RunningCache {
    /// The cache the picker asks.
    pub cache: Arc<PrefixCache>,
    task: JoinHandle<()>,
}

impl Drop for RunningCache {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl PrefixCache {
    /// Starts the index, subscribes it to the streams known now (flags and
    /// `source`), and spawns the task that follows the source.
    pub async fn start(
        opts: CacheOptions,
        source: Arc<dyn EndpointSource>,
    ) -> Result<RunningCache, PoolError> {
        if opts.sync_every.is_zero() {
            return Err(PoolError::Config(
                "the cache sync interval must be > 0".into(),
            ));
        }
        if opts.estimate.block_size == 0 {
            return Err(PoolError::Config(
                "the estimate block size must be > 0".into(),
            ));
        }
        let indexer = KvIndexer::start(opts.index.clone())
            .map_err(|e| PoolError::Config(format!("the KV-event index: {e}")))?;
        let e = &opts.estimate;
        let cache = Arc::new(PrefixCache {
            indexer,
            source,
            flags: opts.streams.clone(),
            estimate: e.clone(),
            streamed: RwLock::new(Arc::new(HashSet::new())),
            speculative: Mutex::new(Estimates::new(e.speculative_ttl, e.max_entries)),
            approximate: Mutex::new(Estimates::new(e.ttl, e.max_entries)),
            metrics: CacheMetrics::new()?,
            sync: Mutex::new(SyncState::default()),
        });
        // The flags' streams must subscribe now: a bad one fails the start.
        let c = Arc::clone(&cache);
        tokio::task::spawn_blocking(move || c.sync_streams(true))
            .await
            .map_err(|e| PoolError::Config(format!("the KV-event index: {e}")))??;
        let weak = Arc::downgrade(&cache);
        let every = opts.sync_every;
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(c) = weak.upgrade() else { break };
                // set_endpoints waits on the index thread: off the async threads.
                let _ = tokio::task::spawn_blocking(move || {
                    let _ = c.sync_streams(false);
                    c.refresh();
                })
                .await;
            }
        });
        Ok(RunningCache { cache, task })
    }

    /// Registers the cache's metrics in `r`.
    pub fn register_metrics(&self, r: &prometheus::Registry) -> Result<(), PoolError> {
        self.metrics.register(r)
    }

    /// The index (its stats, its health per endpoint).
    pub fn indexer(&self) -> &KvIndexer {
        &self.indexer
    }

    /// The streams wanted now: the flags', then the source's for endpoints
    /// the flags do not name.
    fn wanted(&self) -> Vec<KvStream> {
        let mut out: Vec<KvStream> = Vec::new();
        let mut named: HashSet<String> = HashSet::new();
        // An address named twice (a flag and the source, or a file listing
        // it twice) keeps its first stream.
        for s in self.flags.iter().chain(self.source.kv_streams().iter()) {
            if named.insert(s.id.clone()) {
                out.push(s.clone());
            }
        }
        out.sort_by(|a, b| a.id.cmp(&b.id));
        out
    }

    /// Applies the wanted stream list to the index when it changed. With
    /// `strict` an error is returned; otherwise it is logged (once per
    /// distinct message) and tried again on the next sync.
    fn sync_streams(&self, strict: bool) -> Result<(), PoolError> {
        let wanted = self.wanted();
        let mut st = lock(&self.sync);
        if st.applied.as_ref() == Some(&wanted) {
            return Ok(());
        }
        match self.indexer.set_endpoints(wanted.clone()) {
            Ok(()) => {
                let ids: HashSet<String> = wanted.iter().map(|s| s.id.clone()).collect();
                let before = self
                    .streamed
                    .read()
                    .unwrap_or_else(|e| e.into_inner())
                    .clone();
                for gone in before.difference(&ids) {
                    lock(&self.speculative).forget(gone);
                    st.down.remove(gone);
                }
                tracing::info!(
                    streams = wanted.len(),
                    "KV-event index follows the endpoints' streams"
                );
                *self.streamed.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(ids);
                st.applied = Some(wanted);
                st.last_error.clear();
                Ok(())
            }
            Err(e) => {
                let msg = e.to_string();
                if strict {
                    return Err(PoolError::Config(format!("--kv-events: {msg}")));
                }
                if msg != st.last_error {
                    tracing::warn!(error = %msg, "KV-event streams not updated; retrying");
                    st.last_error = msg;
                }
                Ok(())
            }
        }
    }

    /// Refreshes the metrics and says (once per change) which endpoints are
    /// routed on load alone because their stream is down.
    fn refresh(&self) {
        let stats = self.indexer.stats();
        let mut st = lock(&self.sync);
        st.exported.update(&self.metrics, &stats);
        for (id, s) in &stats.endpoints {
            let was = st.down.get(id).copied();
            if s.health == Health::Live {
                if was.is_some() {
                    st.down.remove(id);
                    if was != Some(Health::Unknown) && was != Some(Health::Replaying) {
                        tracing::info!(endpoint = %id, "KV-event stream live again: routing this endpoint on its cached prefixes");
                    }
                }
                continue;
            }
            // A stream just subscribed starts unknown or replaying: no WARN
            // for that; every other state (or a change to one) is said once.
            let quiet = matches!(s.health, Health::Unknown | Health::Replaying);
            if was != Some(s.health) && !quiet {
                tracing::warn!(endpoint = %id, state = s.health.as_str(), "KV-event stream down: routing this endpoint on load alone until it recovers");
            }
            st.down.insert(id.clone(), s.health);
        }
        drop(st);
        let now = Instant::now();
        let present: HashSet<String> = self
            .source
            .snapshot()
            .iter()
            .map(|e| e.address.clone())
            .collect();
        let (spec, approx) = {
            let mut s = lock(&self.speculative);
            s.purge(now);
            let mut a = lock(&self.approximate);
            a.purge(now);
            // An endpoint that left the pool is forgotten.
            a.retain_endpoints(|e| present.contains(e));
            (s.len(), a.len())
        };
        self.metrics.set_estimated(spec, approx);
    }

    fn streamed(&self) -> Arc<HashSet<String>> {
        Arc::clone(&self.streamed.read().unwrap_or_else(|e| e.into_inner()))
    }

    fn estimate_keys(&self, prompt_ids: &[u32], salt: Option<&str>) -> Vec<u64> {
        salted_block_keys(self.estimate.block_size, prompt_ids, salt)
    }
}

impl crate::prefix::PrefixSource for PrefixCache {
    fn active(&self) -> bool {
        self.estimate.approximate || !self.streamed().is_empty()
    }

    /// The index's entries for `address` dropped and replayed; the
    /// router's own speculative and approximate entries for it forgotten
    /// too (they raised the prediction that missed).
    fn resync(&self, address: &str) -> bool {
        lock(&self.speculative).forget(address);
        lock(&self.approximate).forget(address);
        self.indexer.resync(address)
    }

    fn cached_all(
        &self,
        addresses: &[&str],
        prompt_ids: &[u32],
        salt: Option<&str>,
    ) -> Vec<Option<usize>> {
        let streamed = self.streamed();
        let indexed: HashMap<String, Option<usize>> = if streamed.is_empty() {
            HashMap::new()
        } else {
            self.indexer
                .match_all_salted(prompt_ids, salt)
                .into_iter()
                .collect()
        };
        let bs = self.estimate.block_size;
        let now = Instant::now();
        let lookups = &self.metrics.lookups;
        // The estimates' key chain is hashed only when an estimate store is
        // consulted (approximate mode, or speculative entries held).
        let mut keys: Option<Vec<u64>> = None;
        let mut matched = |store: &Mutex<Estimates>, a: &str| {
            let store = lock(store);
            if store.is_empty() {
                return 0;
            }
            let k = keys.get_or_insert_with(|| self.estimate_keys(prompt_ids, salt));
            store.matched(a, k, now) * bs
        };
        let mut out = Vec::with_capacity(addresses.len());
        for a in addresses {
            out.push(if streamed.contains(*a) {
                match indexed.get(*a).copied().flatten() {
                    Some(n) => {
                        lookups.with_label_values(&["indexed"]).inc();
                        Some(n.max(matched(&self.speculative, a)))
                    }
                    None => {
                        lookups.with_label_values(&["stream_down"]).inc();
                        None
                    }
                }
            } else if self.estimate.approximate {
                lookups.with_label_values(&["estimated"]).inc();
                Some(matched(&self.approximate, a))
            } else {
                lookups.with_label_values(&["no_stream"]).inc();
                None
            });
        }
        out
    }

    fn routed(&self, route: &Route, prompt_ids: &[u32], salt: Option<&str>) {
        let streamed = self.streamed();
        let now = Instant::now();
        // Hashed once, and only when some endpoint of the route is recorded.
        let mut keys: Option<Vec<u64>> = None;
        for a in std::iter::once(&route.decode).chain(route.prefill.as_ref()) {
            let store = if streamed.contains(a.as_str()) {
                (!self.estimate.speculative_ttl.is_zero()).then_some(&self.speculative)
            } else {
                self.estimate.approximate.then_some(&self.approximate)
            };
            if let Some(store) = store {
                let k = keys.get_or_insert_with(|| self.estimate_keys(prompt_ids, salt));
                lock(store).record(a, k, now);
            }
        }
    }
}
