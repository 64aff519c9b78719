//! Flags of `rngd-pd-bench chunked` ([`rngd_bench_engine::stall::StallOptions`]).

use std::path::PathBuf;

use rngd_bench_engine::stall::StallOptions;

/// Flags of `rngd-pd-bench chunked`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// GGUF model (default: `$RNGD_PD_MODEL`, else the cached default model).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Per-iteration token budgets to measure (`off` = unchunked, always
    /// measured first as the baseline), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "off,64,128,256", value_parser = parse_budget)]
    pub budgets: Vec<Budget>,
    /// Decode streams running during the prefills.
    #[arg(long, default_value_t = 4)]
    pub running: usize,
    /// Tokens of the long prompt.
    #[arg(long = "prompt-tokens", default_value_t = 470)]
    pub prompt_tokens: usize,
    /// Long prefills per budget (medians are reported).
    #[arg(long, default_value_t = 5)]
    pub prefills: usize,
    /// Compiled context length S.
    #[arg(long = "seq-len", default_value_t = 512)]
    pub seq_len: usize,
    /// Threads of the decode matmul (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Print a last line with the report as one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// One `--budgets` entry: a token count or `off`.
#[derive(Debug, Clone, Copy)]
pub struct Budget(Option<usize>);

fn parse_budget(s: &str) -> Result<Budget, String> {
    if s == "off" {
        return Ok(Budget(None));
    }
    s.parse::<usize>()
        .map(|n| Budget(Some(n)))
        .map_err(|_| format!("{s} is neither a token count nor `off`"))
}

impl From<Args> for StallOptions {
    fn from(a: Args) -> Self {
        StallOptions {
            model: a.model,
            budgets: a.budgets.into_iter().map(|b| b.0).collect(),
            running: a.running,
            prompt_tokens: a.prompt_tokens,
            prefills: a.prefills,
            seq_len: a.seq_len,
            threads: a.threads,
            json: a.json,
        }
    }
}
