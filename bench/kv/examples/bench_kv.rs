//! Runs the KV benchmark through the library, with the default options and
//! the transport given as the first argument (`shm` or `tcp`):
//! `cargo run --release -p rngd-bench-kv --example bench_kv -- tcp`.
//! Every flag is in `rngd-pd-bench kv`.

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut opts = rngd_bench_kv::Options {
        json: true,
        ..Default::default()
    };
    if let Some(transport) = std::env::args().nth(1) {
        opts.transport = transport;
    }
    let report = rngd_bench_kv::run(opts).await?;
    if !report.byte_exact {
        return Err("the transport did not return the bytes it was given".into());
    }
    Ok(())
}
