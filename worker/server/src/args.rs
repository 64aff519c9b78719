//! Command-line flags of the worker ([`WorkerArgs`]); every flag also reads an
//! environment variable named in [`rngd_api::env`].

use std::path::PathBuf;

use rngd_api::env;

/// What a worker does with requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Role {
    /// Prefill only: answers `do_remote_decode` requests, pushes the KV.
    Prefill,
    /// Decode: continues from a pulled KV cache; also serves whole requests
    /// (prefilling locally) and orchestrates `x-prefiller-host-port` requests.
    Decode,
    /// Everything on one worker (also answers prefill-only requests).
    Solo,
}

impl Role {
    /// Lower-case name (`prefill`, `decode`, `solo`).
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Solo => "solo",
        }
    }
}

/// Which engine runs the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Backend {
    /// The embedded CPU engine (candle).
    Cpu,
    /// FuriosaAI RNGD (needs the vendor runtime; not in this build).
    Rngd,
    /// Rebellions ATOM (needs the vendor runtime; not in this build).
    Atom,
}

impl Backend {
    /// Lower-case name.
    pub fn as_str(self) -> &'static str {
        match self {
            Backend::Cpu => "cpu",
            Backend::Rngd => "rngd",
            Backend::Atom => "atom",
        }
    }
}

/// Flags of `rngd-pd worker`.
#[derive(Debug, Clone, clap::Args)]
pub struct WorkerArgs {
    /// Role of this worker.
    #[arg(long, value_enum, env = env::RNGD_PD_ROLE, default_value = "solo")]
    pub role: Role,
    /// Engine backend.
    #[arg(long, value_enum, env = env::RNGD_PD_BACKEND, default_value = "cpu")]
    pub backend: Backend,
    /// Card ordinal, or -1 for the card the device plugin allocated to this pod.
    #[arg(long, env = env::RNGD_PD_CHIP, default_value_t = 0, allow_negative_numbers = true)]
    pub chip: i64,
    /// Listen host.
    #[arg(long, env = env::RNGD_PD_HOST, default_value = "127.0.0.1")]
    pub host: String,
    /// Listen port; 0 picks a free one (the bound address is printed on stdout).
    #[arg(long, env = env::RNGD_PD_PORT, default_value_t = 0)]
    pub port: u16,
    /// Default KV transport (`shm`, `tcp`); a request may name another.
    #[arg(long, env = env::AIRM_KV_TRANSPORT, default_value = "shm")]
    pub kv_transport: String,
    /// GGUF model file; default: the model cache (`rngd-pd model fetch`).
    #[arg(long, env = env::RNGD_PD_MODEL)]
    pub model: Option<PathBuf>,
    /// Compiled context length S.
    #[arg(long, env = env::RNGD_PD_SEQ_LEN, default_value_t = 512)]
    pub seq_len: usize,
    /// Decode streams stepped together.
    #[arg(long, env = env::RNGD_PD_BATCH, default_value_t = 8)]
    pub batch: usize,
    /// CPU threads of the `cpu` backend (default: all cores).
    #[arg(long, env = env::RNGD_PD_THREADS)]
    pub threads: Option<usize>,
    /// Node this worker runs on (informational; reported in PD responses).
    #[arg(long, env = env::RNGD_PD_NODE)]
    pub node: Option<String>,
    /// Kubelet device-plugin checkpoint (for `--chip -1`).
    #[arg(long, env = env::RNGD_PD_KUBELET_CHECKPOINT, default_value = rngd_devices::DEFAULT_CHECKPOINT)]
    pub kubelet_checkpoint: PathBuf,
    /// How long a decode waits for the KV pull, ms.
    #[arg(long, env = env::RNGD_PD_KV_PULL_TIMEOUT_MS, default_value_t = 30_000)]
    pub kv_pull_timeout_ms: u64,
    /// How long a decode worker waits for its prefill peer, ms.
    #[arg(long, env = env::RNGD_PD_PREFILL_TIMEOUT_MS, default_value_t = 120_000)]
    pub prefill_timeout_ms: u64,
}
