//! Flags of `rngd-pd-bench kv` ([`rngd_bench_kv::Options`]).

/// Flags of `rngd-pd-bench kv`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Transport to measure: `shm`, `tcp` or `nixl-ucx` (which also measures `tcp`).
    #[arg(long, default_value = "shm")]
    pub transport: String,
    /// Requests in flight at once.
    #[arg(long = "in-flight", default_value_t = 8)]
    pub in_flight: usize,
    /// Requests per round.
    #[arg(long, default_value_t = 16)]
    pub requests: usize,
    /// Rounds (each: one baseline pass and one transport pass).
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Skip CRC-32 on the tcp transport (as `AIRM_KV_TCP_CRC=0`).
    #[arg(long = "no-crc")]
    pub no_crc: bool,
    /// `--transport tcp` only: TLS on the relay connections (keyed by a
    /// shared secret); plaintext tcp is measured in the same rounds and
    /// `ratio_vs_tcp` is TLS over plaintext.
    #[arg(long)]
    pub tls: bool,
    /// Also move a prompt of N tokens (1 to 512) in the trimmed wire (only
    /// its valid positions) in the same rounds, next to the S-wide wire.
    #[arg(
        long = "prompt-tokens",
        value_name = "N",
        conflicts_with = "prompt_trace"
    )]
    pub prompt_tokens: Option<usize>,
    /// As --prompt-tokens, with request i of each round taking the prompt
    /// length of row i of this Azure trace CSV (scaled to S = 512 with its
    /// generation, as `replay` sends it), e.g.
    /// ../shared/data/AzureLLMInferenceTrace_conv.csv.
    #[arg(long = "prompt-trace", value_name = "CSV")]
    pub prompt_trace: Option<std::path::PathBuf>,
    /// Print a last line with the report as one JSON object.
    #[arg(long)]
    pub json: bool,
}

impl From<Args> for rngd_bench_kv::Options {
    fn from(a: Args) -> Self {
        rngd_bench_kv::Options {
            transport: a.transport,
            in_flight: a.in_flight,
            requests: a.requests,
            rounds: a.rounds,
            no_crc: a.no_crc,
            tls: a.tls,
            prompt_tokens: a.prompt_tokens,
            prompt_trace: a.prompt_trace,
            json: a.json,
        }
    }
}
