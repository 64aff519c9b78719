//! The worker's Prometheus metrics (names from [`rngd_telemetry::names`]).

use prometheus::{Gauge, Histogram, IntCounter, IntCounterVec, Registry};
use rngd_engine::Engine;
use rngd_telemetry::{MS_BUCKETS, TelemetryError, names};

/// Tokens/s buckets for decode speed.
const TPS_BUCKETS: &[f64] = &[
    1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 50.0, 75.0, 100.0, 200.0, 500.0, 1000.0, 5000.0,
];

/// Every metric a worker exports, in its own registry.
#[derive(Debug, Clone)]
pub struct WorkerMetrics {
    registry: Registry,
    waiting: Gauge,
    running: Gauge,
    kv_usage: Gauge,
    /// KV push time, seconds.
    pub kv_save_seconds: Histogram,
    /// KV pull time, seconds.
    pub kv_load_seconds: Histogram,
    /// Prefill compute time, seconds.
    pub prefill_seconds: Histogram,
    /// Decode speed per request, tokens/s.
    pub decode_tokens_per_s: Histogram,
    /// Prefills run here (PD prefills and local prefills of whole requests).
    pub prefills: IntCounter,
    /// KV caches loaded from a transport.
    pub kv_loads: IntCounter,
    /// Requests by HTTP status.
    pub requests: IntCounterVec,
}

impl WorkerMetrics {
    /// Creates and registers the metrics in a fresh registry.
    pub fn new() -> Result<Self, TelemetryError> {
        let r = Registry::new();
        Ok(WorkerMetrics {
            waiting: rngd_telemetry::gauge(
                &r,
                names::VLLM_NUM_REQUESTS_WAITING,
                "Requests waiting for a decode slot",
            )?,
            running: rngd_telemetry::gauge(
                &r,
                names::VLLM_NUM_REQUESTS_RUNNING,
                "Requests running",
            )?,
            kv_usage: rngd_telemetry::gauge(
                &r,
                names::VLLM_KV_CACHE_USAGE_PERC,
                "KV cache usage, 0..1",
            )?,
            kv_save_seconds: rngd_telemetry::histogram(
                &r,
                names::WORKER_KV_SAVE_SECONDS,
                "KV push on the prefill side, seconds",
                &rngd_telemetry::seconds_buckets(MS_BUCKETS, 1e3),
            )?,
            kv_load_seconds: rngd_telemetry::histogram(
                &r,
                names::WORKER_KV_LOAD_SECONDS,
                "KV pull on the decode side, seconds",
                &rngd_telemetry::seconds_buckets(MS_BUCKETS, 1e3),
            )?,
            prefill_seconds: rngd_telemetry::histogram(
                &r,
                names::WORKER_PREFILL_SECONDS,
                "Prefill compute, seconds",
                &rngd_telemetry::seconds_buckets(MS_BUCKETS, 1e3),
            )?,
            decode_tokens_per_s: rngd_telemetry::histogram(
                &r,
                names::WORKER_DECODE_TOKENS_PER_S,
                "Decode speed per request, tokens/s",
                TPS_BUCKETS,
            )?,
            prefills: rngd_telemetry::counter(&r, names::WORKER_PREFILLS_TOTAL, "Prefills run")?,
            kv_loads: rngd_telemetry::counter(
                &r,
                names::WORKER_KV_LOADS_TOTAL,
                "KV caches loaded from a transport",
            )?,
            requests: rngd_telemetry::counter_vec(
                &r,
                names::WORKER_REQUESTS_TOTAL,
                "Requests by HTTP status",
                &["status"],
            )?,
            registry: r,
        })
    }

    /// Refreshes the engine gauges (if an engine is loaded) and renders the text format.
    pub fn render(&self, engine: Option<&dyn Engine>) -> String {
        if let Some(e) = engine {
            self.waiting.set(e.waiting() as f64);
            self.running.set(e.running() as f64);
            self.kv_usage.set(e.kv_usage());
        }
        rngd_telemetry::render(&self.registry)
    }
}
