//! What a worker is started from ([`WorkerOptions`]); the `rngd-pd worker`
//! flags (in the CLI) fill it, each also read from an environment variable
//! named in [`rngd_api::env`].

use std::path::PathBuf;

use crate::allow::{ClientAllow, PrefillAllow};

/// What a worker does with requests (the one role type, owned by `rngd-api`).
pub use rngd_api::Role;

/// Which engine runs the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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

/// Default of the completion requests a worker admits at once
/// ([`WorkerOptions::max_in_flight`], and the serving configuration's).
pub const DEFAULT_MAX_IN_FLIGHT: usize = 64;

/// Default of the largest request body, bytes: 2 MiB
/// ([`WorkerOptions::body_limit`], and the serving configuration's).
pub const DEFAULT_BODY_LIMIT: usize = 2 << 20;

/// Everything a worker is started from (`rngd-pd worker` flags; defaults in [`Default`]).
#[derive(Debug, Clone)]
pub struct WorkerOptions {
    /// Role of this worker.
    pub role: Role,
    /// Engine backend.
    pub backend: Backend,
    /// Card ordinal, or -1 for the card the device plugin allocated to this pod.
    pub chip: i64,
    /// Listen host.
    pub host: String,
    /// Listen port; 0 picks a free one (the bound address is printed on stdout).
    pub port: u16,
    /// Default KV transport (`shm`, `tcp`); a request may name another.
    pub kv_transport: String,
    /// GGUF model file, or a directory holding exactly one; default: the
    /// model cache (`rngd-pd model fetch`).
    pub model: Option<PathBuf>,
    /// Jinja chat template file used instead of the model's own
    /// `tokenizer.chat_template` (`--chat-template`).
    pub chat_template: Option<PathBuf>,
    /// Model names served (`--served-model-name`, repeated): the first in
    /// `/v1/models`, answers and metrics instead of the one derived from the
    /// file's metadata, the others accepted as aliases. Empty: the
    /// metadata's name, with the file's stem as the alias
    /// ([`rngd_api::models::aliases`]).
    pub served_model_name: Vec<String>,
    /// Compiled context length S.
    pub seq_len: usize,
    /// Decode streams stepped together.
    pub batch: usize,
    /// CPU threads of the `cpu` backend (default: all cores).
    pub threads: Option<usize>,
    /// Node this worker runs on (informational; reported in PD responses).
    pub node: Option<String>,
    /// Kubelet device-plugin checkpoint (for `--chip -1`).
    pub kubelet_checkpoint: PathBuf,
    /// How long a decode waits for the KV pull, ms.
    pub kv_pull_timeout_ms: u64,
    /// What an orchestrated decode does when the KV cannot be loaded
    /// (`--kv-load-failure-policy`: `recompute`, the default, or `fail`).
    pub kv_load_failure_policy: rngd_api::pd::KvLoadFailurePolicy,
    /// How long a decode worker waits for its prefill peer, ms.
    pub prefill_timeout_ms: u64,
    /// The prefill peers an `x-prefiller-host-port` header may name
    /// (`--prefill-allow`: `HOST:PORT`, `IP/PREFIX:PORT`, `[IPV6]/PREFIX:PORT`;
    /// see [`crate::allow`]). Default empty: this worker orchestrates no
    /// prefill, and a request with the header is refused (403, code
    /// `prefiller_not_allowed`).
    pub prefill_allow: PrefillAllow,
    /// Clients (their connection's IP) that may send prefill-only requests
    /// (`do_remote_decode`): the gateways, Envoy and the decode workers
    /// (`--front-door-allow`: `IP` or `IP/PREFIX` entries). Default loopback;
    /// anyone else gets 403 (code `pd_not_allowed`).
    pub front_door_allow: ClientAllow,
    /// Largest request body, bytes; larger is an OpenAI-style 413. Default 2 MiB.
    pub body_limit: usize,
    /// Time a client has to send its whole body, ms; then 408. Default 30 s.
    pub body_timeout_ms: u64,
    /// Completion requests admitted at once (queued in the engine or
    /// running); one more is a 429 with `Retry-After`. Default 64.
    pub max_in_flight: usize,
    /// The listener's limits (`--header-timeout-ms`, `--idle-timeout-ms`,
    /// `--max-connections`, `--max-inflight-body-bytes`; defaults in
    /// [`rngd_http_edge::Options`]).
    pub edge: rngd_http_edge::Options,
    /// The engine's prefix cache (`--enable-prefix-caching` /
    /// `--no-enable-prefix-caching`, `--block-size`, `--prefix-cache-bytes`;
    /// default on, blocks of 16, 256 MiB). See `docs/engine.md`, "Prefix cache".
    pub prefix_cache: rngd_engine::prefix::PrefixCacheOptions,
    /// Chunked prefill's per-iteration token budget
    /// (`--enable-chunked-prefill`, `--max-num-batched-tokens`). Default
    /// `None`: each prefill runs whole. See `docs/engine.md`, "Chunked
    /// prefill".
    pub max_num_batched_tokens: Option<usize>,
    /// The kernel of prefills' projections (`--prefill-projections`;
    /// default `auto`). See `docs/engine.md`, "Kernels".
    pub prefill_projections: rngd_engine::cpu::PrefillProjections,
    /// KV-cache events as vLLM publishes them (`--kv-events-config`, vLLM's
    /// JSON); none: no publisher. See `docs/engine.md`, "KV events".
    pub kv_events: Option<rngd_kv_events::KvEventsConfig>,
    /// The admin API's listener and token (`--admin-listen`, default
    /// `127.0.0.1:9904`; `RNGD_PD_ADMIN_TOKEN`, none: no admin listener).
    pub admin: crate::admin::AdminListen,
    /// The API key of the public routes (`--api-key` / `VLLM_API_KEY`); the
    /// worker also sends it to its prefill peers. None: every route open.
    pub api_key: Option<rngd_http_edge::api_key::ApiKey>,
}

impl Default for WorkerOptions {
    fn default() -> Self {
        WorkerOptions {
            role: Role::Solo,
            backend: Backend::Cpu,
            chip: 0,
            host: "127.0.0.1".into(),
            port: 0,
            kv_transport: "shm".into(),
            model: None,
            chat_template: None,
            served_model_name: Vec::new(),
            seq_len: 512,
            batch: 8,
            threads: None,
            node: None,
            kubelet_checkpoint: rngd_devices::DEFAULT_CHECKPOINT.into(),
            kv_pull_timeout_ms: 30_000,
            kv_load_failure_policy: rngd_api::pd::KvLoadFailurePolicy::Recompute,
            prefill_timeout_ms: 120_000,
            prefill_allow: PrefillAllow::default(),
            front_door_allow: ClientAllow::loopback(),
            body_limit: DEFAULT_BODY_LIMIT,
            body_timeout_ms: 30_000,
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
            edge: rngd_http_edge::Options::default(),
            prefix_cache: rngd_engine::prefix::PrefixCacheOptions::default(),
            max_num_batched_tokens: None,
            prefill_projections: rngd_engine::cpu::PrefillProjections::Auto,
            kv_events: None,
            admin: crate::admin::AdminListen::default(),
            api_key: None,
        }
    }
}
