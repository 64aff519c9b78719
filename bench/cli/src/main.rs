//! `rngd-pd-bench`: the benchmark harnesses, in a binary of their own so the
//! serving binary `rngd-pd` links none of them (the policy benchmark's native
//! baseline defines the proxy-wasm host functions as `proxy_*` symbols).
//!
//! One subcommand per harness crate under `bench/`. Each module here holds
//! the subcommand's flags (clap) and turns them into the library's
//! `Options`; the library does the work. Each harness measures its baseline
//! in the same run and, with `--json`, ends with one JSON line.

mod chat_render;
mod chunked;
mod engine;
mod epp;
mod gateway;
mod kv;
mod logits;
mod policy;
mod prefix;
mod replay;
mod tokenize;
mod weights;

use clap::{Parser, Subcommand};

/// Benchmarks of rngd-pd, each against its baseline in the same run.
#[derive(Debug, Parser)]
#[command(name = "rngd-pd-bench", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// KV transport throughput against memcpy / a raw TCP stream.
    Kv(kv::Args),
    /// CPU engine prefill and decode timings (bench/engine_vs_llamacpp compares with llama.cpp).
    Engine(engine::Args),
    /// The stall a long prefill causes running decode streams, per chunked-prefill budget, against unchunked.
    Chunked(chunked::Args),
    /// Policy decision cost in wasm against the same logic compiled natively.
    Policy(policy::Args),
    /// Latency the gateway adds over calling a worker directly.
    Gateway(gateway::Args),
    /// Latency Envoy + the endpoint picker add over Envoy routing directly.
    Epp(epp::Args),
    /// The CPU engine's raw logits at every position (prefill or decode path), as .npy.
    Logits(logits::Args),
    /// Renders chats (JSON on stdin) with the engine's chat template, one JSON line each.
    ChatRender(chat_render::Args),
    /// Open-loop replay of the Azure or Mooncake trace against an OpenAI-compatible URL.
    Replay(replay::Args),
    /// TTFT with 0%, 50% and 90% of a prompt in the worker's prefix cache against cold.
    Prefix(prefix::Args),
    /// The engine tokenizer's ids of texts (one JSON line), for the tokenizer fidelity test.
    Tokenize(tokenize::Args),
    /// Time to the first token on new weights: a delta update of a running worker against a restart.
    Weights(weights::Args),
}

fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_env(rngd_api::env::RUST_LOG)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    init_tracing();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        match cli.command {
            Command::Kv(a) => {
                rngd_bench_kv::run(a.into()).await?;
            }
            Command::Engine(a) => {
                rngd_bench_engine::run(a.into()).await?;
            }
            Command::Chunked(a) => {
                rngd_bench_engine::stall::run(a.into()).await?;
            }
            Command::Policy(a) => {
                rngd_bench_policy::run(a.into()).await?;
            }
            Command::Gateway(a) => {
                rngd_bench_gateway::run(a.into()).await?;
            }
            Command::Epp(a) => {
                rngd_bench_epp::run(a.into()).await?;
            }
            Command::Logits(a) => {
                logits::run(a)?;
            }
            Command::ChatRender(a) => {
                chat_render::run(a)?;
            }
            Command::Replay(a) => {
                rngd_bench_replay::run(a.into()).await?;
            }
            Command::Prefix(a) => {
                rngd_bench_prefix::run(a.into()).await?;
            }
            Command::Tokenize(a) => {
                tokenize::run(a)?;
            }
            Command::Weights(a) => {
                rngd_bench_weights::run(a.into()).await?;
            }
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The flags parse into exactly the libraries' defaults when none are given.
    #[test]
    fn no_flags_means_the_library_defaults() {
        let parse = |args: &[&str]| Cli::try_parse_from(args).expect("parses").command;
        let Command::Kv(a) = parse(&["rngd-pd-bench", "kv"]) else {
            panic!("kv")
        };
        let (o, d) = (
            rngd_bench_kv::Options::from(a),
            rngd_bench_kv::Options::default(),
        );
        assert_eq!(format!("{o:?}"), format!("{d:?}"));
        let Command::Engine(a) = parse(&["rngd-pd-bench", "engine"]) else {
            panic!("engine")
        };
        let (o, d) = (
            rngd_bench_engine::Options::from(a),
            rngd_bench_engine::Options::default(),
        );
        assert_eq!(format!("{o:?}"), format!("{d:?}"));
        let Command::Chunked(a) = parse(&["rngd-pd-bench", "chunked"]) else {
            panic!("chunked")
        };
        let (o, d) = (
            rngd_bench_engine::stall::StallOptions::from(a),
            rngd_bench_engine::stall::StallOptions::default(),
        );
        assert_eq!(format!("{o:?}"), format!("{d:?}"));
        let Command::Policy(a) = parse(&["rngd-pd-bench", "policy"]) else {
            panic!("policy")
        };
        let (o, d) = (
            rngd_bench_policy::Options::from(a),
            rngd_bench_policy::Options::default(),
        );
        assert_eq!(format!("{o:?}"), format!("{d:?}"));
        let Command::Gateway(a) = parse(&["rngd-pd-bench", "gateway"]) else {
            panic!("gateway")
        };
        let (o, d) = (
            rngd_bench_gateway::Options::from(a),
            rngd_bench_gateway::Options::default(),
        );
        assert_eq!(format!("{o:?}"), format!("{d:?}"));
        let Command::Epp(a) = parse(&["rngd-pd-bench", "epp"]) else {
            panic!("epp")
        };
        let (o, d) = (
            rngd_bench_epp::Options::from(a),
            rngd_bench_epp::Options::default(),
        );
        assert_eq!(format!("{o:?}"), format!("{d:?}"));
    }

    /// Every flag keeps the name it had under `rngd-pd bench`.
    #[test]
    fn flag_names_are_unchanged() {
        for args in [
            &[
                "kv",
                "--transport",
                "tcp",
                "--in-flight",
                "2",
                "--requests",
                "3",
                "--rounds",
                "4",
                "--no-crc",
                "--json",
            ][..],
            &[
                "engine",
                "--model",
                "m.gguf",
                "--prompt-tokens",
                "1,2",
                "--prompt-ids",
                "ids.json",
                "--decode-tokens",
                "5",
                "--runs",
                "6",
                "--batch",
                "7",
                "--threads",
                "2",
                "--seq-len",
                "256",
                "--json",
            ],
            &[
                "policy",
                "--endpoints",
                "8",
                "--iterations",
                "9",
                "--fresh-iterations",
                "10",
                "--block",
                "11",
                "--module",
                "m.wasm",
                "--json",
            ],
            &[
                "gateway",
                "--requests",
                "1",
                "--warmup",
                "2",
                "--max-tokens",
                "3",
                "--stream",
                "--policy",
                "p.wasm",
                "--json",
            ],
            &[
                "epp",
                "--requests",
                "1",
                "--warmup",
                "2",
                "--envoy",
                "/bin/envoy",
                "--policy",
                "p.wasm",
                "--epp-threads",
                "3",
                "--epp-shared-runtime",
                "--envoy-concurrency",
                "4",
                "--profile",
                "--skip-response-processing",
                "--json",
            ],
        ] {
            let argv = std::iter::once("rngd-pd-bench").chain(args.iter().copied());
            if let Err(e) = Cli::try_parse_from(argv) {
                panic!("{args:?}: {e}");
            }
        }
    }
}
