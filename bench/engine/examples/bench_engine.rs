//! Runs the engine benchmark through the library with the default options
//! (the default model, prompts of 32, 197 and 470 tokens) and prints the JSON
//! line: `cargo run --release -p rngd-bench-engine --example bench_engine`.
//! Every flag is in `rngd-pd-bench engine`.

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    rngd_bench_engine::run(rngd_bench_engine::Options {
        json: true,
        ..Default::default()
    })
    .await?;
    Ok(())
}
