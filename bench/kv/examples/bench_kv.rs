//! Runs the KV benchmark without the CLI:
//! `cargo run --release -p rngd-bench-kv --example bench_kv -- --transport tcp --json`.

use clap::Parser;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: rngd_bench_kv::Args,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let report = rngd_bench_kv::run(Cli::parse().args).await?;
    if !report.byte_exact {
        return Err("the transport did not return the bytes it was given".into());
    }
    Ok(())
}
