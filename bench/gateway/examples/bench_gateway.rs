//! Runs the gateway benchmark through the library with the default options
//! (2000 requests per path, the default module): `cargo run --release -p
//! rngd-bench-gateway --example bench_gateway`. Every flag is in
//! `rngd-pd-bench gateway`.

#[tokio::main]
async fn main() -> Result<(), rngd_bench_gateway::Error> {
    rngd_bench_gateway::run(rngd_bench_gateway::Options::default())
        .await
        .map(|_| ())
}
