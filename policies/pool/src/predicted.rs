//! The router's cache predictions held against what the engines served.
//!
//! Each pick reads, for every endpoint, how many of the prompt's leading
//! tokens the index says it holds (`rngd_pd.prefix_cache`). Nothing in the
//! answer shows whether that was true: an index that drifted from an
//! engine (a lost event, a reset not heard yet, a publisher that lies)
//! routes turns to caches that are not there while every answer is still a
//! 200. So the door keeps, per routed request, the prediction for the
//! endpoint that prefilled it ([`Expected`]), and when the answer's usage
//! arrives (`usage.prompt_tokens_details.cached_tokens`, which the PD path
//! carries from the prefill worker) it hands the served figure back:
//!
//! - two counters per endpoint (`rngd_pd_router_predicted_cached_tokens_total`,
//!   `rngd_pd_router_served_cached_tokens_total`) and a histogram of served
//!   minus predicted;
//! - a miss budget per endpoint ([`CheckOptions`]): a request whose served
//!   figure is off the prediction by more than the tolerance is a miss; when
//!   the misses among an endpoint's last `window` checked requests reach
//!   `max_misses`, its index entries are dropped at once (no cache
//!   information until a replay rebuilds them: the policy routes it on load)
//!   and rebuilt by replay ([`PrefixSource::resync`]), counted in
//!   `rngd_pd_router_index_resyncs_total{reason="prediction_miss"}` and
//!   logged;
//! - restarts ([`CacheCheck::follow_restarts`]): an endpoint the scrape saw
//!   come back as a new process (`process_start_time_seconds` changed) has
//!   its entries dropped before the next pick reads them
//!   (`reason="restart"`).
//!
//! Label values are endpoint addresses of the pool (bounded by its size);
//! an address that leaves the pool keeps its counters (they are totals).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use rngd_telemetry::names;

use crate::PoolError;
use crate::prefix::PrefixSource;

/// The miss budget.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CheckOptions {
    /// The last checked requests per endpoint the budget looks at. Default 16.
    pub window: usize,
    /// Misses among them that drop the endpoint's entries; 0 = never.
    /// Default 4.
    pub max_misses: usize,
    /// A difference of at most this many tokens is no miss (the engine
    /// counts whole blocks, and may recompute a prompt's last block).
    /// Default 32 (two of the workers' 16-token blocks).
    pub tolerance_tokens: usize,
    /// ... nor one of at most this share of the prediction. Default 0.1.
    pub tolerance_share: f64,
}

impl Default for CheckOptions {
    fn default() -> Self {
        CheckOptions {
            window: 16,
            max_misses: 4,
            tolerance_tokens: 32,
            tolerance_share: 0.1,
        }
    }
}

impl CheckOptions {
    /// Whether `served` is off `predicted` beyond the tolerance.
    pub fn is_miss(&self, predicted: usize, served: usize) -> bool {
        let diff = predicted.abs_diff(served);
        let share = (predicted as f64 * self.tolerance_share).floor() as usize;
        diff > self.tolerance_tokens.max(share)
    }
}

/// The checks of one door.
pub struct CacheCheck {
    options: CheckOptions,
    source: Option<Arc<dyn PrefixSource>>,
    recent: Mutex<HashMap<String, VecDeque<bool>>>,
    /// The endpoint source's restart total last followed, and each
    /// address's restarts then ([`CacheCheck::follow_restarts`]).
    restarts: Mutex<(u64, HashMap<String, u64>)>,
    predicted: prometheus::IntCounterVec,
    served: prometheus::IntCounterVec,
    error: prometheus::Histogram,
    resyncs: prometheus::IntCounterVec,
}

impl std::fmt::Debug for CacheCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CacheCheck")
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

/// One routed request's prediction, handed back with the served figure
/// ([`Expected::served`]); dropped unused when the answer carries no usage.
#[derive(Debug)]
pub struct Expected {
    check: Arc<CacheCheck>,
    endpoint: String,
    predicted: usize,
}

// === impl Expected ===

impl Expected {
    /// The endpoint that prefilled the request.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The cached tokens the index predicted there.
    pub fn predicted(&self) -> usize {
        self.predicted
    }

    /// The engine served `cached_tokens` from its cache: counted and held
    /// against the prediction.
    pub fn served(self, cached_tokens: usize) {
        self.check
            .observe(&self.endpoint, self.predicted, cached_tokens);
    }
}

// === impl CacheCheck ===

fn metric_err(name: &str) -> impl FnOnce(prometheus::Error) -> PoolError + '_ {
    move |e| PoolError::Config(format!("metric {name}: {e}"))
}

/// Buckets of served minus predicted tokens, symmetric around 0.
const ERROR_BUCKETS: [f64; 13] = [
    -512.0, -256.0, -128.0, -64.0, -32.0, -16.0, 0.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0,
];

impl CacheCheck {
    /// A check with `options`, resyncing through `source` (none: counted only).
    pub fn new(
        options: CheckOptions,
        source: Option<Arc<dyn PrefixSource>>,
    ) -> Result<Self, PoolError> {
        let counter = |name: &'static str, help: &str, label: &str| {
            prometheus::IntCounterVec::new(prometheus::Opts::new(name, help), &[label])
                .map_err(metric_err(name))
        };
        Ok(CacheCheck {
            options,
            source,
            recent: Mutex::default(),
            restarts: Mutex::default(),
            predicted: counter(
                names::ROUTER_PREDICTED_CACHED_TOKENS_TOTAL,
                "Cached prompt tokens the router's index predicted on the endpoint that prefilled each routed request.",
                "endpoint",
            )?,
            served: counter(
                names::ROUTER_SERVED_CACHED_TOKENS_TOTAL,
                "Cached prompt tokens the engine reported for the same requests.",
                "endpoint",
            )?,
            error: prometheus::Histogram::with_opts(
                prometheus::HistogramOpts::new(
                    names::ROUTER_CACHED_TOKENS_ERROR,
                    "Served minus predicted cached prompt tokens of one routed request.",
                )
                .buckets(ERROR_BUCKETS.to_vec()),
            )
            .map_err(metric_err(names::ROUTER_CACHED_TOKENS_ERROR))?,
            resyncs: counter(
                names::ROUTER_INDEX_RESYNCS_TOTAL,
                "Endpoints whose index entries were dropped and rebuilt by replay, by reason.",
                "reason",
            )?,
        })
    }

    /// Registers the metrics in `r`.
    pub fn register(&self, r: &prometheus::Registry) -> Result<(), PoolError> {
        r.register(Box::new(self.predicted.clone()))
            .map_err(metric_err(names::ROUTER_PREDICTED_CACHED_TOKENS_TOTAL))?;
        r.register(Box::new(self.served.clone()))
            .map_err(metric_err(names::ROUTER_SERVED_CACHED_TOKENS_TOTAL))?;
        r.register(Box::new(self.error.clone()))
            .map_err(metric_err(names::ROUTER_CACHED_TOKENS_ERROR))?;
        r.register(Box::new(self.resyncs.clone()))
            .map_err(metric_err(names::ROUTER_INDEX_RESYNCS_TOTAL))
    }

    /// The options.
    pub fn options(&self) -> &CheckOptions {
        &self.options
    }

    /// A prediction of `predicted` cached tokens on `endpoint`, to hand
    /// back with what was served.
    pub fn expect(self: &Arc<Self>, endpoint: &str, predicted: usize) -> Expected {
        Expected {
            check: Arc::clone(self),
            endpoint: endpoint.to_string(),
            predicted,
        }
    }

    /// Resyncs counted for `reason` so far.
    pub fn resyncs(&self, reason: &str) -> u64 {
        self.resyncs.with_label_values(&[reason]).get()
    }

    /// Drops the entries of every endpoint of `snapshot` that `endpoints`
    /// saw restart since the last call (a new process on the same address
    /// holds an empty cache), before the pick that called it reads them:
    /// no turn is routed to a cache that died with its process. Costs one
    /// atomic read when nothing restarted.
    pub fn follow_restarts(
        &self,
        endpoints: &dyn crate::EndpointSource,
        snapshot: &[rngd_policy_core::Endpoint],
    ) {
        let total = endpoints.restarts();
        let mut seen = self.restarts.lock().unwrap_or_else(|p| p.into_inner());
        if seen.0 == total {
            return;
        }
        seen.0 = total;
        for e in snapshot {
            let now = endpoints.restarts_of(&e.address);
            let before = seen.1.insert(e.address.clone(), now).unwrap_or(0);
            if now <= before {
                continue;
            }
            let dropped = self.source.as_deref().is_some_and(|s| s.resync(&e.address));
            self.resyncs.with_label_values(&["restart"]).inc();
            self.recent
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&e.address);
            tracing::info!(
                endpoint = %e.address,
                dropped,
                "endpoint restarted: its index entries are dropped and rebuilt by replay"
            );
        }
        // Bounded by the endpoints listed now.
        seen.1
            .retain(|a, _| snapshot.iter().any(|e| &e.address == a));
    }

    fn observe(&self, endpoint: &str, predicted: usize, served: usize) {
        self.predicted
            .with_label_values(&[endpoint])
            .inc_by(predicted as u64);
        self.served
            .with_label_values(&[endpoint])
            .inc_by(served as u64);
        self.error.observe(served as f64 - predicted as f64);
        let miss = self.options.is_miss(predicted, served);
        let over_budget = {
            let mut recent = self.recent.lock().unwrap_or_else(|p| p.into_inner());
            let w = recent.entry(endpoint.to_string()).or_default();
            w.push_back(miss);
            while w.len() > self.options.window.max(1) {
                w.pop_front();
            }
            let misses = w.iter().filter(|m| **m).count();
            let over = self.options.max_misses > 0 && misses >= self.options.max_misses;
            if over {
                // A fresh budget after the resync: the requests routed
                // before it were routed on the entries it dropped.
                recent.remove(endpoint);
            }
            over
        };
        if !over_budget {
            return;
        }
        let dropped = self.source.as_deref().is_some_and(|s| s.resync(endpoint));
        self.resyncs.with_label_values(&["prediction_miss"]).inc();
        tracing::warn!(
            endpoint,
            predicted,
            served,
            window = self.options.window,
            max_misses = self.options.max_misses,
            dropped,
            "router cache predictions missed the engine's reports beyond the budget: the endpoint's index entries are dropped and rebuilt by replay"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[derive(Default)]
    struct Resyncs(AtomicUsize);

    impl PrefixSource for Resyncs {
        fn cached_all(
            &self,
            addresses: &[&str],
            _ids: &[u32],
            _salt: Option<&str>,
        ) -> Vec<Option<usize>> {
            vec![None; addresses.len()]
        }
        fn resync(&self, _address: &str) -> bool {
            self.0.fetch_add(1, Ordering::Relaxed);
            true
        }
    }

    #[test]
    fn a_miss_is_beyond_both_tolerances() {
        let o = CheckOptions::default();
        for (predicted, served, miss) in [
            (0, 0, false),
            (64, 48, false),
            (64, 32, false),
            (64, 31, true),
            (0, 33, true),
            (1000, 905, false),
            (1000, 899, true),
            (480, 0, true),
        ] {
            assert_eq!(o.is_miss(predicted, served), miss, "{predicted} {served}");
        }
    }

    #[test]
    fn the_budget_resyncs_once_then_starts_afresh() {
        let src = Arc::new(Resyncs::default());
        let check = Arc::new(
            CacheCheck::new(
                CheckOptions::default(),
                Some(Arc::clone(&src) as Arc<dyn PrefixSource>),
            )
            .unwrap(),
        );
        // Good predictions on one endpoint, misses on another.
        for _ in 0..40 {
            check.expect("a:1", 256).served(240);
        }
        assert_eq!(src.0.load(Ordering::Relaxed), 0);
        for i in 0..3 {
            check.expect("b:1", 256).served(0);
            assert_eq!(src.0.load(Ordering::Relaxed), 0, "after miss {}", i + 1);
        }
        check.expect("b:1", 256).served(0);
        assert_eq!(src.0.load(Ordering::Relaxed), 1);
        assert_eq!(check.resyncs("prediction_miss"), 1);
        // The window restarted: three more misses are not yet a resync.
        for _ in 0..3 {
            check.expect("b:1", 256).served(0);
        }
        assert_eq!(src.0.load(Ordering::Relaxed), 1);
        // Misses spread thinner than the budget inside the window never are.
        let check = Arc::new(CacheCheck::new(CheckOptions::default(), None).unwrap());
        for i in 0..200 {
            let served = if i % 8 == 0 { 0 } else { 256 };
            check.expect("c:1", 256).served(served);
        }
        assert_eq!(check.resyncs("prediction_miss"), 0);
        assert_eq!(check.predicted.with_label_values(&["c:1"]).get(), 200 * 256);
        assert_eq!(check.served.with_label_values(&["c:1"]).get(), 175 * 256);
    }
}
