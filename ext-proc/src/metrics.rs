//! Prometheus metrics of the endpoint picker (names from `rngd_telemetry::names`).

use prometheus::{Histogram, IntCounter, IntCounterVec, Registry};
use rngd_telemetry::names;

use crate::ExtProcError;

/// The picker's metrics, registered in their own registry (served on the metrics port).
#[derive(Clone, Debug)]
pub struct EppMetrics {
    /// The registry the metrics live in.
    pub registry: Registry,
    /// Picks by result (`route`, `reject_<status>`).
    pub picks: IntCounterVec,
    /// Pick latency (body complete → decision), seconds.
    pub pick_seconds: Histogram,
    /// Failed `/metrics` scrapes.
    pub scrape_failures: IntCounter,
}

impl EppMetrics {
    /// Creates the metrics in a fresh registry.
    pub fn new() -> Result<Self, ExtProcError> {
        let registry = Registry::new();
        let err = |source| ExtProcError::Metrics { source };
        let picks = rngd_telemetry::counter_vec(
            &registry,
            names::EPP_PICKS_TOTAL,
            "Endpoint picks by result",
            &["result"],
        )
        .map_err(err)?;
        let pick_seconds = rngd_telemetry::histogram(
            &registry,
            names::EPP_PICK_SECONDS,
            "Endpoint pick latency (body complete to decision), seconds",
            &rngd_telemetry::seconds_buckets(rngd_telemetry::US_BUCKETS, 1e6),
        )
        .map_err(err)?;
        let scrape_failures = rngd_telemetry::counter(
            &registry,
            names::EPP_SCRAPE_FAILURES_TOTAL,
            "Failed endpoint /metrics scrapes",
        )
        .map_err(err)?;
        Ok(EppMetrics {
            registry,
            picks,
            pick_seconds,
            scrape_failures,
        })
    }

    /// The metrics in the Prometheus text format.
    pub fn render(&self) -> String {
        rngd_telemetry::render(&self.registry)
    }
}
