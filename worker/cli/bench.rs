//! `rngd-pd bench …`: one subcommand per harness crate under `bench/`. Each
//! measures its baseline in the same run and, with `--json`, ends with one
//! JSON line.

/// Benchmarks.
#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// KV transport throughput against memcpy / a raw TCP stream.
    Kv(rngd_bench_kv::Args),
    /// CPU engine prefill and decode timings (bench/engine_vs_llamacpp compares with llama.cpp).
    Engine(rngd_bench_engine::Args),
    /// Policy decision cost in wasm against the same logic compiled natively.
    Policy(rngd_bench_policy::Args),
    /// Latency the gateway adds over calling a worker directly.
    Gateway(rngd_bench_gateway::Args),
    /// Latency Envoy + the endpoint picker add over Envoy routing directly.
    Epp(rngd_bench_epp::Args),
}

/// Runs the benchmark.
pub async fn run(cmd: Command) -> anyhow::Result<()> {
    match cmd {
        Command::Kv(a) => {
            rngd_bench_kv::run(a).await?;
        }
        Command::Engine(a) => {
            rngd_bench_engine::run(a).await?;
        }
        Command::Policy(a) => {
            rngd_bench_policy::run(a).await?;
        }
        Command::Gateway(a) => {
            rngd_bench_gateway::run(a).await?;
        }
        Command::Epp(a) => {
            rngd_bench_epp::run(a).await?;
        }
    }
    Ok(())
}
