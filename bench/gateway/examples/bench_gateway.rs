//! Runs the gateway benchmark without the CLI:
//! `cargo run --release -p rngd-bench-gateway --example bench_gateway -- --requests 2000`.

use clap::Parser;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: rngd_bench_gateway::Args,
}

#[tokio::main]
async fn main() -> Result<(), rngd_bench_gateway::Error> {
    rngd_bench_gateway::run(Cli::parse().args).await.map(|_| ())
}
