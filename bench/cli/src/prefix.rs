//! Flags of `rngd-pd-bench prefix` ([`rngd_bench_prefix::Options`]).

use std::path::PathBuf;

/// Flags of `rngd-pd-bench prefix`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Base URL of a running worker; default: start a solo `rngd-pd worker`
    /// (port 0) and stop it at the end.
    #[arg(long)]
    pub url: Option<String>,
    /// The rngd-pd binary to start; default: $RNGD_PD_BIN, else
    /// $CARGO_TARGET_DIR/release/rngd-pd, else beside this executable.
    #[arg(long)]
    pub rngd_pd: Option<PathBuf>,
    /// Extra argument of the started worker (repeat it), e.g.
    /// --worker-arg=--threads --worker-arg=2.
    #[arg(long = "worker-arg", allow_hyphen_values = true)]
    pub worker_args: Vec<String>,
    /// --seq-len of the started worker.
    #[arg(long, default_value_t = 512)]
    pub seq_len: u32,
    /// How long the started worker may take to load its model, seconds.
    #[arg(long, default_value_t = 900.0)]
    pub worker_timeout_s: f64,
    /// `model` of the requests; default: the first of /v1/models.
    #[arg(long)]
    pub model: Option<String>,
    /// Prompt length, tokens (random ordinary token ids).
    #[arg(long, default_value_t = 480)]
    pub prompt_tokens: u32,
    /// Shares of the prompt cached, percent (0: a warm request sharing no block).
    #[arg(long, value_delimiter = ',', default_values_t = [0u32, 50, 90])]
    pub cached_percents: Vec<u32>,
    /// Rounds (one timed request per variant each, order rotated).
    #[arg(long, default_value_t = 10)]
    pub rounds: usize,
    /// Untimed requests of fresh prompts before the rounds.
    #[arg(long, default_value_t = 2)]
    pub warmup: usize,
    /// Positions per cache block; default: the worker's
    /// vllm:cache_config_info block_size, else 16.
    #[arg(long)]
    pub block_size: Option<u32>,
    /// Seed of the random prompts; default: from the clock.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Deadline of each request, seconds.
    #[arg(long, default_value_t = 120.0)]
    pub request_timeout_s: f64,
    /// Model layers (memory per block); default SmolLM2-135M's.
    #[arg(long, default_value_t = 30)]
    pub layers: u32,
    /// KV heads (memory per block).
    #[arg(long, default_value_t = 3)]
    pub kv_heads: u32,
    /// Head dimension (memory per block).
    #[arg(long, default_value_t = 64)]
    pub head_dim: u32,
    /// The worker's --prefix-cache-bytes (num_gpu_blocks is checked against it).
    #[arg(long, default_value_t = 256 << 20)]
    pub prefix_cache_bytes: u64,
    /// Print only the JSON line (no progress on stderr).
    #[arg(long)]
    pub json: bool,
}

impl From<Args> for rngd_bench_prefix::Options {
    fn from(a: Args) -> Self {
        rngd_bench_prefix::Options {
            url: a.url,
            rngd_pd: a.rngd_pd,
            worker_args: a.worker_args,
            seq_len: a.seq_len,
            worker_timeout_s: a.worker_timeout_s,
            model: a.model,
            prompt_tokens: a.prompt_tokens,
            cached_percents: a.cached_percents,
            rounds: a.rounds,
            warmup: a.warmup,
            block_size: a.block_size,
            seed: a.seed,
            request_timeout_s: a.request_timeout_s,
            layers: a.layers,
            kv_heads: a.kv_heads,
            head_dim: a.head_dim,
            prefix_cache_bytes: a.prefix_cache_bytes,
            json: a.json,
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use crate::{Cli, Command};

    fn parse(args: &[&str]) -> Result<rngd_bench_prefix::Options, clap::Error> {
        let argv = ["rngd-pd-bench", "prefix"]
            .into_iter()
            .chain(args.iter().copied());
        match Cli::try_parse_from(argv)?.command {
            Command::Prefix(a) => Ok(a.into()),
            other => panic!("parsed as {other:?}"),
        }
    }

    /// No flag: the library's defaults; the lists and values parse.
    #[test]
    fn flags_parse() {
        let o = parse(&[]).expect("parses");
        assert_eq!(
            format!("{o:?}"),
            format!("{:?}", rngd_bench_prefix::Options::default())
        );
        let o = parse(&[
            "--url",
            "http://h:1",
            "--cached-percents",
            "25,75",
            "--rounds",
            "3",
            "--worker-arg",
            "--threads",
            "--worker-arg=2",
            "--seed",
            "7",
            "--json",
        ])
        .expect("parses");
        assert_eq!(o.url.as_deref(), Some("http://h:1"));
        assert_eq!(o.cached_percents, [25, 75]);
        assert_eq!((o.rounds, o.seed, o.json), (3, Some(7), true));
        assert_eq!(o.worker_args, ["--threads", "2"]);
    }
}
