//! Flags of `rngd-pd-bench engine` ([`rngd_bench_engine::Options`]).

use std::path::PathBuf;

/// Flags of `rngd-pd-bench engine`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// GGUF model (default: `$RNGD_PD_MODEL`, else the cached default model).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Prompt lengths in tokens, cut from a fixed text (ignored with --prompt-ids).
    #[arg(long = "prompt-tokens", value_delimiter = ',', default_values_t = vec![32, 197, 470])]
    pub prompt_tokens: Vec<usize>,
    /// JSON file with the prompts as token ids (`[[1, 2, …], …]`).
    #[arg(long = "prompt-ids")]
    pub prompt_ids: Option<PathBuf>,
    /// Tokens to decode per prompt.
    #[arg(long = "decode-tokens", default_value_t = 32)]
    pub decode_tokens: usize,
    /// Repetitions (medians are reported).
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// Streams decoded together for the batch measurement.
    #[arg(long, default_value_t = 8)]
    pub batch: usize,
    /// Threads of the decode matmul (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Compiled context length S.
    #[arg(long = "seq-len", default_value_t = 512)]
    pub seq_len: usize,
    /// Kernel of the prefills' projections: auto, f32 or int8 (as the
    /// worker's flag of the same name).
    #[arg(long = "prefill-projections", default_value_t)]
    pub prefill_projections: rngd_engine::cpu::PrefillProjections,
    /// Print a last line with the report as one JSON object.
    #[arg(long)]
    pub json: bool,
}

impl From<Args> for rngd_bench_engine::Options {
    fn from(a: Args) -> Self {
        rngd_bench_engine::Options {
            model: a.model,
            prompt_tokens: a.prompt_tokens,
            prompt_ids: a.prompt_ids,
            decode_tokens: a.decode_tokens,
            runs: a.runs,
            batch: a.batch,
            threads: a.threads,
            seq_len: a.seq_len,
            prefill_projections: a.prefill_projections,
            json: a.json,
        }
    }
}
