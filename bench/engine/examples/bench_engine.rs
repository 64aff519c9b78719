//! Runs `rngd-pd bench engine` without the CLI: `cargo run --release -p rngd-bench-engine --example bench_engine -- --json`.

use clap::Parser;

/// The benchmark's flags.
#[derive(Debug, Parser)]
struct Cli {
    #[command(flatten)]
    args: rngd_bench_engine::Args,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let cli = Cli::parse();
    rngd_bench_engine::run(cli.args).await?;
    Ok(())
}
