//! [`CacheMetrics`]: the index's counters (read from
//! [`rngd_kv_index::KvIndexer::stats`] on each sync, exported as deltas so
//! the families stay counters) and the per-request lookup results.

use std::collections::HashMap;

use prometheus::{GaugeVec, IntCounter, IntCounterVec, Registry};
use rngd_kv_index::{EndpointStats, Health, IndexStats};
use rngd_telemetry::names;

use crate::PoolError;

/// Reads one counter of an endpoint's stats.
type Field = fn(&EndpointStats) -> u64;

/// The stream faults counted, with the stats field each comes from.
const FAULTS: [(&str, Field); 6] = [
    ("gap", |s| s.gaps),
    ("replay_failed", |s| s.replay_failures),
    ("unknown_parent", |s| s.unknown_parents),
    ("restart", |s| s.restarts),
    ("stale", |s| s.stale),
    ("undecodable", |s| s.undecodable),
];

/// The cache metrics, registered in a door's registry.
#[derive(Debug, Clone)]
pub struct CacheMetrics {
    events: IntCounterVec,
    faults: IntCounterVec,
    replays: IntCounterVec,
    blocks: GaugeVec,
    evicted: IntCounter,
    since: GaugeVec,
    up: GaugeVec,
    /// Lookups by result.
    pub lookups: IntCounterVec,
    estimated: GaugeVec,
}

fn metric_err(name: &str) -> impl FnOnce(prometheus::Error) -> PoolError + '_ {
    move |e| PoolError::Config(format!("metric {name}: {e}"))
}

impl CacheMetrics {
    /// Creates the families (unregistered).
    pub fn new() -> Result<Self, PoolError> {
        let cv = |n: &str, h: &str, l: &[&str]| {
            IntCounterVec::new(prometheus::Opts::new(n, h), l).map_err(metric_err(n))
        };
        let gv = |n: &str, h: &str, l: &[&str]| {
            GaugeVec::new(prometheus::Opts::new(n, h), l).map_err(metric_err(n))
        };
        let m = CacheMetrics {
            events: cv(
                names::KV_INDEX_EVENTS_TOTAL,
                "KV events applied from the endpoint's stream.",
                &["endpoint"],
            )?,
            faults: cv(
                names::KV_INDEX_STREAM_FAULTS_TOTAL,
                "KV-event stream faults by kind.",
                &["endpoint", "fault"],
            )?,
            replays: cv(
                names::KV_INDEX_REPLAYS_TOTAL,
                "KV-event replays completed.",
                &["endpoint"],
            )?,
            blocks: gv(
                names::KV_INDEX_BLOCKS,
                "Blocks of the endpoint held in the router's KV-event index.",
                &["endpoint"],
            )?,
            evicted: IntCounter::new(
                names::KV_INDEX_EVICTED_BLOCKS_TOTAL,
                "Blocks evicted by the KV-event index's block cap.",
            )
            .map_err(metric_err(names::KV_INDEX_EVICTED_BLOCKS_TOTAL))?,
            since: gv(
                names::KV_INDEX_SECONDS_SINCE_EVENT,
                "Seconds since the endpoint's last KV-event batch or answered probe.",
                &["endpoint"],
            )?,
            up: gv(
                names::KV_INDEX_STREAM_UP,
                "1 when the endpoint's KV-event stream is live, 0 when it is routed on load alone.",
                &["endpoint"],
            )?,
            lookups: cv(
                names::PREFIX_LOOKUPS_TOTAL,
                "Per-endpoint prefix lookups of routed requests by result.",
                &["result"],
            )?,
            estimated: gv(
                names::PREFIX_ESTIMATED_BLOCKS,
                "Blocks the router remembers having sent, by kind.",
                &["kind"],
            )?,
        };
        for r in ["indexed", "estimated", "stream_down", "no_stream"] {
            m.lookups.with_label_values(&[r]);
        }
        for k in ["speculative", "approximate"] {
            m.estimated.with_label_values(&[k]).set(0.0);
        }
        Ok(m)
    }

    /// Registers every family in `r`.
    pub fn register(&self, r: &Registry) -> Result<(), PoolError> {
        let all: [(&str, Box<dyn prometheus::core::Collector>); 9] = [
            (names::KV_INDEX_EVENTS_TOTAL, Box::new(self.events.clone())),
            (
                names::KV_INDEX_STREAM_FAULTS_TOTAL,
                Box::new(self.faults.clone()),
            ),
            (
                names::KV_INDEX_REPLAYS_TOTAL,
                Box::new(self.replays.clone()),
            ),
            (names::KV_INDEX_BLOCKS, Box::new(self.blocks.clone())),
            (
                names::KV_INDEX_EVICTED_BLOCKS_TOTAL,
                Box::new(self.evicted.clone()),
            ),
            (
                names::KV_INDEX_SECONDS_SINCE_EVENT,
                Box::new(self.since.clone()),
            ),
            (names::KV_INDEX_STREAM_UP, Box::new(self.up.clone())),
            (names::PREFIX_LOOKUPS_TOTAL, Box::new(self.lookups.clone())),
            (
                names::PREFIX_ESTIMATED_BLOCKS,
                Box::new(self.estimated.clone()),
            ),
        ];
        for (name, c) in all {
            r.register(c).map_err(metric_err(name))?;
        }
        Ok(())
    }

    /// Sets the estimate gauges.
    pub fn set_estimated(&self, speculative: usize, approximate: usize) {
        self.estimated
            .with_label_values(&["speculative"])
            .set(speculative as f64);
        self.estimated
            .with_label_values(&["approximate"])
            .set(approximate as f64);
    }
}

/// What was exported last, to add only the difference.
#[derive(Debug, Default)]
pub struct Exported {
    per_endpoint: HashMap<String, EndpointStats>,
    evicted: u64,
}

/// Adds `now - before` (a counter that restarted counts from 0).
fn delta(now: u64, before: u64) -> u64 {
    if now >= before { now - before } else { now }
}

impl Exported {
    /// Brings the families up to `stats`; endpoints no longer listed lose
    /// their series.
    pub fn update(&mut self, m: &CacheMetrics, stats: &IndexStats) {
        let mut seen = HashMap::new();
        for (id, s) in &stats.endpoints {
            let before = self.per_endpoint.remove(id);
            let b = |f: Field| before.as_ref().map_or(0, f);
            let l = [id.as_str()];
            m.events
                .with_label_values(&l)
                .inc_by(delta(s.events, b(|x| x.events)));
            m.replays
                .with_label_values(&l)
                .inc_by(delta(s.replays, b(|x| x.replays)));
            for (fault, f) in FAULTS {
                m.faults
                    .with_label_values(&[id.as_str(), fault])
                    .inc_by(delta(f(s), b(f)));
            }
            m.blocks.with_label_values(&l).set(s.blocks as f64);
            match s.seconds_since_last_event {
                Some(v) => m.since.with_label_values(&l).set(v),
                None => {
                    let _ = m.since.remove_label_values(&l);
                }
            }
            m.up.with_label_values(&l)
                .set(if s.health == Health::Live { 1.0 } else { 0.0 });
            seen.insert(id.clone(), s.clone());
        }
        for gone in self.per_endpoint.keys() {
            let l = [gone.as_str()];
            let _ = m.events.remove_label_values(&l);
            let _ = m.replays.remove_label_values(&l);
            let _ = m.blocks.remove_label_values(&l);
            let _ = m.since.remove_label_values(&l);
            let _ = m.up.remove_label_values(&l);
            for (fault, _) in FAULTS {
                let _ = m.faults.remove_label_values(&[gone.as_str(), fault]);
            }
        }
        self.per_endpoint = seen;
        m.evicted.inc_by(delta(stats.total.evicted, self.evicted));
        self.evicted = stats.total.evicted;
    }
}
