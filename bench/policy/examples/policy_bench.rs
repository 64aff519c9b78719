//! Runs the policy benchmark without the CLI:
//! `cargo run --release -p rngd-bench-policy --example policy_bench -- --endpoints 64`.

use clap::Parser;

/// Command line of the example.
#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: rngd_bench_policy::Args,
}

#[tokio::main]
async fn main() -> Result<(), rngd_bench_policy::Error> {
    rngd_bench_policy::run(Cli::parse().args).await.map(|_| ())
}
