//! Flags of `rngd-pd-bench gateway` ([`rngd_bench_gateway::Options`]).

use std::path::PathBuf;

/// Flags of `rngd-pd-bench gateway`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Measured requests per path.
    #[arg(long, default_value_t = 2000)]
    pub requests: usize,
    /// Warm-up requests per path (not measured).
    #[arg(long, default_value_t = 200)]
    pub warmup: usize,
    /// Tokens generated per request.
    #[arg(long, default_value_t = 8)]
    pub max_tokens: u32,
    /// Stream the responses (SSE) instead of one JSON body.
    #[arg(long)]
    pub stream: bool,
    /// Policy module; default: `$RNGD_PD_POLICY`, else the `pd_default` guest
    /// built by `policies/build.sh` beside this executable, in the image, or
    /// under `$CARGO_TARGET_DIR`.
    #[arg(long)]
    pub policy: Option<PathBuf>,
    /// Print only the JSON line.
    #[arg(long)]
    pub json: bool,
}

impl From<Args> for rngd_bench_gateway::Options {
    fn from(a: Args) -> Self {
        rngd_bench_gateway::Options {
            requests: a.requests,
            warmup: a.warmup,
            max_tokens: a.max_tokens,
            stream: a.stream,
            policy: a.policy,
            json: a.json,
        }
    }
}
