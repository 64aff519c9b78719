//! Metric names (all of them, in [`names`]) and small helpers around the
//! `prometheus` crate that every rngd-pd server uses to expose `/metrics`,
//! with the `process_*` families of every registry (`process`,
//! [`registry`]).

pub mod names;
#[cfg(target_os = "linux")]
pub mod process;
#[cfg(feature = "test-util")]
pub mod promtool;

use prometheus::{Encoder, Registry, TextEncoder};

/// Errors of this crate.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    /// A metric could not be created or registered.
    #[error("metric {name}: {source}")]
    Metric {
        /// Metric name.
        name: String,
        /// Cause.
        #[source]
        source: prometheus::Error,
    },
}

/// A fresh registry holding the `process_*` families (on Linux): every
/// server's `/metrics` starts from one.
pub fn registry() -> Result<Registry, TelemetryError> {
    let r = Registry::new();
    #[cfg(target_os = "linux")]
    process::register(&r)?;
    Ok(r)
}

/// Renders a registry in the Prometheus text exposition format.
pub fn render(registry: &Registry) -> String {
    let mut buf = Vec::new();
    // Encoding into a Vec cannot fail for the text format except on invalid
    // metric families, which registration already rejects.
    let _ = TextEncoder::new().encode(&registry.gather(), &mut buf);
    String::from_utf8(buf).unwrap_or_default()
}

/// Content type of the text exposition format.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Latency buckets in milliseconds, 0.05 ms … 60 s.
pub const MS_BUCKETS: &[f64] = &[
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2500.0,
    5000.0, 10000.0, 30000.0, 60000.0,
];

/// Latency buckets in microseconds, 1 µs … 100 ms (policy decisions).
pub const US_BUCKETS: &[f64] = &[
    1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 5000.0, 20000.0, 100000.0,
];

/// `buckets` given in a smaller unit (`per_second` of them make a second),
/// in seconds: every time histogram is exported in seconds, as Prometheus
/// recommends (`MS_BUCKETS` → `seconds_buckets(MS_BUCKETS, 1e3)`).
pub fn seconds_buckets(buckets: &[f64], per_second: f64) -> Vec<f64> {
    buckets.iter().map(|b| b / per_second).collect()
}

/// Creates and registers a histogram.
pub fn histogram(
    registry: &Registry,
    name: &str,
    help: &str,
    buckets: &[f64],
) -> Result<prometheus::Histogram, TelemetryError> {
    let err = |source| TelemetryError::Metric {
        name: name.to_string(),
        source,
    };
    let h = prometheus::Histogram::with_opts(
        prometheus::HistogramOpts::new(name, help).buckets(buckets.to_vec()),
    )
    .map_err(err)?;
    registry.register(Box::new(h.clone())).map_err(err)?;
    Ok(h)
}

/// Creates and registers a histogram with labels.
pub fn histogram_vec(
    registry: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
    buckets: &[f64],
) -> Result<prometheus::HistogramVec, TelemetryError> {
    let err = |source| TelemetryError::Metric {
        name: name.to_string(),
        source,
    };
    let h = prometheus::HistogramVec::new(
        prometheus::HistogramOpts::new(name, help).buckets(buckets.to_vec()),
        labels,
    )
    .map_err(err)?;
    registry.register(Box::new(h.clone())).map_err(err)?;
    Ok(h)
}

/// Creates and registers a counter.
pub fn counter(
    registry: &Registry,
    name: &str,
    help: &str,
) -> Result<prometheus::IntCounter, TelemetryError> {
    let err = |source| TelemetryError::Metric {
        name: name.to_string(),
        source,
    };
    let c = prometheus::IntCounter::new(name, help).map_err(err)?;
    registry.register(Box::new(c.clone())).map_err(err)?;
    Ok(c)
}

/// Creates and registers a counter with labels.
pub fn counter_vec(
    registry: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
) -> Result<prometheus::IntCounterVec, TelemetryError> {
    let err = |source| TelemetryError::Metric {
        name: name.to_string(),
        source,
    };
    let c =
        prometheus::IntCounterVec::new(prometheus::Opts::new(name, help), labels).map_err(err)?;
    registry.register(Box::new(c.clone())).map_err(err)?;
    Ok(c)
}

/// Creates and registers a gauge.
pub fn gauge(
    registry: &Registry,
    name: &str,
    help: &str,
) -> Result<prometheus::Gauge, TelemetryError> {
    let err = |source| TelemetryError::Metric {
        name: name.to_string(),
        source,
    };
    let g = prometheus::Gauge::new(name, help).map_err(err)?;
    registry.register(Box::new(g.clone())).map_err(err)?;
    Ok(g)
}

/// Creates and registers a gauge with labels.
pub fn gauge_vec(
    registry: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
) -> Result<prometheus::GaugeVec, TelemetryError> {
    let err = |source| TelemetryError::Metric {
        name: name.to_string(),
        source,
    };
    let g = prometheus::GaugeVec::new(prometheus::Opts::new(name, help), labels).map_err(err)?;
    registry.register(Box::new(g.clone())).map_err(err)?;
    Ok(g)
}
