//! Flags of `rngd-pd-bench policy` ([`rngd_bench_policy::Options`]).

use std::path::PathBuf;

/// Flags of `rngd-pd-bench policy`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Endpoints in the snapshot.
    #[arg(long, default_value_t = 64)]
    pub endpoints: usize,
    /// Timed decisions per variant (warm wasm, native).
    #[arg(long, default_value_t = 20_000)]
    pub iterations: usize,
    /// Timed decisions on a fresh instance.
    #[arg(long, default_value_t = 300)]
    pub fresh_iterations: usize,
    /// Decisions a variant makes in a row before the next variant's turn
    /// (1: the three alternate decision by decision).
    #[arg(long, default_value_t = 1)]
    pub block: usize,
    /// Policy module; default: `$RNGD_PD_POLICY`, else the built
    /// `pd_default.wasm` (wasm32-unknown-unknown) beside this executable, in
    /// the image, or under `$CARGO_TARGET_DIR`.
    #[arg(long)]
    pub module: Option<PathBuf>,
    /// Print only the JSON line.
    #[arg(long)]
    pub json: bool,
}

impl From<Args> for rngd_bench_policy::Options {
    fn from(a: Args) -> Self {
        rngd_bench_policy::Options {
            endpoints: a.endpoints,
            iterations: a.iterations,
            fresh_iterations: a.fresh_iterations,
            block: a.block,
            module: a.module,
            json: a.json,
        }
    }
}
