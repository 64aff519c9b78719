//! Runs the policy benchmark through the library with the default options
//! (64 endpoints, the default module): `cargo run --release -p
//! rngd-bench-policy --example policy_bench`. Every flag is in
//! `rngd-pd-bench policy`.

#[tokio::main]
async fn main() -> Result<(), rngd_bench_policy::Error> {
    rngd_bench_policy::run(rngd_bench_policy::Options::default())
        .await
        .map(|_| ())
}
