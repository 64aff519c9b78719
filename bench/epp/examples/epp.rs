//! Runs the epp benchmark without the `rngd-pd` binary:
//! `cargo run --release -p rngd-bench-epp --example epp -- --requests 2000`.

use clap::Parser;

#[derive(Debug, Parser)]
struct Cli {
    #[command(flatten)]
    args: rngd_bench_epp::Args,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let cli = Cli::parse();
    rngd_bench_epp::run(cli.args).await?;
    Ok(())
}
