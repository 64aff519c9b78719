//! Flags of `rngd-pd-bench weights` ([`rngd_bench_weights::Options`]).

use std::path::PathBuf;

/// Flags of `rngd-pd-bench weights`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// The model file the checkpoints derive from; default: the cached
    /// default model ($RNGD_PD_MODEL, else `rngd-pd model fetch`'s).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// The rngd-pd binary to start; default: $RNGD_PD_BIN, else
    /// $CARGO_TARGET_DIR/release/rngd-pd, else beside this executable.
    #[arg(long)]
    pub rngd_pd: Option<PathBuf>,
    /// Extra argument of every started worker (repeat it).
    #[arg(long = "worker-arg", allow_hyphen_values = true)]
    pub worker_args: Vec<String>,
    /// --seq-len of the workers.
    #[arg(long, default_value_t = rngd_bench_weights::Options::default().seq_len)]
    pub seq_len: u32,
    /// Tensors to alter, comma-separated: checkpoint k alters the first k.
    #[arg(long, value_delimiter = ',', default_values_t = rngd_bench_weights::Options::default().tensors)]
    pub tensors: Vec<String>,
    /// Rounds (one update and one restart per k each).
    #[arg(long, default_value_t = rngd_bench_weights::Options::default().rounds)]
    pub rounds: usize,
    /// How long a worker may take to load its model, seconds.
    #[arg(long, default_value_t = rngd_bench_weights::Options::default().worker_timeout_s)]
    pub worker_timeout_s: f64,
    /// Deadline of each request, seconds.
    #[arg(long, default_value_t = rngd_bench_weights::Options::default().request_timeout_s)]
    pub request_timeout_s: f64,
    /// Context length of the variant swapped to.
    #[arg(long, default_value_t = rngd_bench_weights::Options::default().variant_seq_len)]
    pub variant_seq_len: u32,
    /// Batch of the variant swapped to.
    #[arg(long, default_value_t = rngd_bench_weights::Options::default().variant_max_batch)]
    pub variant_max_batch: u32,
    /// Print only the JSON line (no progress on stderr).
    #[arg(long)]
    pub json: bool,
}

impl From<Args> for rngd_bench_weights::Options {
    fn from(a: Args) -> Self {
        rngd_bench_weights::Options {
            model: a.model,
            rngd_pd: a.rngd_pd,
            worker_args: a.worker_args,
            seq_len: a.seq_len,
            tensors: a.tensors,
            rounds: a.rounds,
            worker_timeout_s: a.worker_timeout_s,
            request_timeout_s: a.request_timeout_s,
            variant_seq_len: a.variant_seq_len,
            variant_max_batch: a.variant_max_batch,
            json: a.json,
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use crate::{Cli, Command};

    fn parse(args: &[&str]) -> rngd_bench_weights::Options {
        let argv = ["rngd-pd-bench", "weights"]
            .into_iter()
            .chain(args.iter().copied());
        match Cli::try_parse_from(argv).expect("parses").command {
            Command::Weights(a) => a.into(),
            other => panic!("parsed as {other:?}"),
        }
    }

    /// No flag: the library's defaults; the list parses.
    #[test]
    fn flags_parse() {
        assert_eq!(
            format!("{:?}", parse(&[])),
            format!("{:?}", rngd_bench_weights::Options::default())
        );
        let o = parse(&[
            "--tensors",
            "a,b",
            "--rounds",
            "1",
            "--worker-arg=--threads",
        ]);
        assert_eq!(o.tensors, ["a", "b"]);
        assert_eq!(o.rounds, 1);
        assert_eq!(o.worker_args, ["--threads"]);
    }
}
