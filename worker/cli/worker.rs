//! `rngd-pd worker`: a worker sidecar (prefill, decode or solo). Parses the
//! flags into [`rngd_worker::WorkerOptions`] and runs [`rngd_worker::launch`]
//! until SIGINT/SIGTERM.

use std::path::PathBuf;

use rngd_api::env;
use rngd_worker::{AllowEntry, Backend, ClientAllow, PrefillAllow, Role, WorkerOptions};

/// `--role`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum RoleArg {
    /// Prefill only: answers `do_remote_decode` requests, pushes the KV.
    Prefill,
    /// Decode: continues from a pulled KV cache; also serves whole requests
    /// (prefilling locally) and orchestrates `x-prefiller-host-port` requests.
    Decode,
    /// Everything on one worker (also answers prefill-only requests).
    Solo,
}

/// `--backend`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BackendArg {
    /// The embedded CPU engine (candle).
    Cpu,
    /// FuriosaAI RNGD (needs the vendor runtime; not in this build).
    Rngd,
    /// Rebellions ATOM (needs the vendor runtime; not in this build).
    Atom,
}

/// One `--prefill-allow` value: an entry, or nothing for an empty value.
#[derive(Debug, Clone)]
pub struct AllowArg(Option<AllowEntry>);

/// Parses one `--prefill-allow` value (the error names the entry).
fn parse_allow(s: &str) -> Result<AllowArg, rngd_worker::AllowError> {
    if s.trim().is_empty() {
        return Ok(AllowArg(None));
    }
    s.parse().map(|e| AllowArg(Some(e)))
}

/// Flags of `rngd-pd worker`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Role of this worker.
    #[arg(long, value_enum, env = env::RNGD_PD_ROLE, default_value = "solo")]
    pub role: RoleArg,
    /// Engine backend.
    #[arg(long, value_enum, env = env::RNGD_PD_BACKEND, default_value = "cpu")]
    pub backend: BackendArg,
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
    /// The model: file, chat template, served names.
    #[command(flatten)]
    pub model_args: crate::flags::ModelArgs,
    /// Compiled context length S.
    #[arg(long, env = env::RNGD_PD_SEQ_LEN, default_value_t = 512)]
    pub seq_len: usize,
    /// Decode streams stepped together.
    #[arg(long, env = env::RNGD_PD_BATCH, default_value_t = 8)]
    pub batch: usize,
    /// CPU threads of the `cpu` backend (default: all cores).
    #[arg(long, env = env::RNGD_PD_THREADS)]
    pub threads: Option<usize>,
    /// Scheduling niceness (0 to 19) this process takes before it starts any
    /// thread, so every thread runs at it. For workers that share cores:
    /// `rngd-pd up` starts its prefill workers at `--prefill-nice`, so a long
    /// prefill yields the CPU to the decode steps (Linux; only ever lowers
    /// the priority). Default 0: unchanged.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(i32).range(0..=19))]
    pub nice: i32,
    /// Node this worker runs on (informational; reported in PD responses).
    #[arg(long, env = env::RNGD_PD_NODE)]
    pub node: Option<String>,
    /// Kubelet device-plugin checkpoint (for `--chip -1`).
    #[arg(long, env = env::RNGD_PD_KUBELET_CHECKPOINT, default_value = rngd_devices::DEFAULT_CHECKPOINT)]
    pub kubelet_checkpoint: PathBuf,
    /// How long a decode waits for the KV pull, ms.
    #[arg(long, env = env::RNGD_PD_KV_PULL_TIMEOUT_MS, default_value_t = 30_000)]
    pub kv_pull_timeout_ms: u64,
    /// What a decode worker serving `x-prefiller-host-port` does when it
    /// cannot load the KV (expired, gone, taken): `recompute`
    /// serves the request whole here; `fail` answers 410 `kv_unavailable`.
    #[arg(long, env = env::RNGD_PD_KV_LOAD_FAILURE_POLICY, default_value = "recompute")]
    pub kv_load_failure_policy: rngd_api::pd::KvLoadFailurePolicy,
    /// How long a decode worker waits for its prefill peer, ms.
    #[arg(long, env = env::RNGD_PD_PREFILL_TIMEOUT_MS, default_value_t = 120_000)]
    pub prefill_timeout_ms: u64,
    /// Prefill peers an `x-prefiller-host-port` header may name:
    /// `HOST:PORT` (exact name or IP), `IP/PREFIX:PORT` or
    /// `[IPV6]/PREFIX:PORT` (CIDR), `[IPV6]:PORT`, `dns:NAME:PORT` (the
    /// addresses NAME resolves to, looked up every 5 s); the port is always
    /// required and checked (no `*`). Comma-separated, repeatable. Default
    /// none: requests with the header are refused (403).
    /// Empty entries (an empty variable, a trailing comma) are skipped.
    #[arg(long, env = env::RNGD_PD_PREFILL_ALLOW, value_delimiter = ',', value_name = "ENTRY", value_parser = parse_allow)]
    pub prefill_allow: Vec<AllowArg>,
    /// Clients that may send prefill-only requests
    /// (`kv_transfer_params.do_remote_decode`), by the IP of their
    /// connection: the gateways, Envoy and the decode workers. `IP`,
    /// `IP/PREFIX` or `dns:NAME` (the addresses NAME resolves to, looked up
    /// every 5 s) entries, comma-separated; anyone else gets 403.
    #[arg(long, env = env::RNGD_PD_FRONT_DOOR_ALLOW, default_value = "127.0.0.0/8,::1")]
    pub front_door_allow: ClientAllow,
    /// Largest request body, bytes; larger is a 413 (OpenAI error body).
    #[arg(long, env = env::RNGD_PD_WORKER_BODY_LIMIT, default_value_t = rngd_worker::args::DEFAULT_BODY_LIMIT)]
    pub body_limit: usize,
    /// Time a client has to send its whole body, ms; then 408.
    #[arg(long, default_value_t = 30_000)]
    pub body_timeout_ms: u64,
    /// Completion requests admitted at once (queued in the engine or running,
    /// their pulled KV held); one more is a 429 with `Retry-After`, never a wait.
    #[arg(long, default_value_t = rngd_worker::args::DEFAULT_MAX_IN_FLIGHT)]
    pub max_in_flight: usize,
    /// The listener limits (the same flags as the gateway's).
    #[command(flatten)]
    pub listener: crate::flags::ListenerArgs,
    /// Reuse the KV of cached prompt prefixes (vLLM's flag; on by default).
    #[arg(long, overrides_with = "no_enable_prefix_caching")]
    pub enable_prefix_caching: bool,
    /// Turn the prefix cache off.
    #[arg(long, overrides_with = "enable_prefix_caching")]
    pub no_enable_prefix_caching: bool,
    /// Positions per prefix-cache block (only full blocks are cached).
    #[arg(long, env = env::RNGD_PD_BLOCK_SIZE, default_value_t = rngd_engine::prefix::DEFAULT_BLOCK_SIZE, value_parser = at_least_one)]
    pub block_size: usize,
    /// Bytes the prefix cache may hold; least recently used blocks are
    /// evicted past it (a block of 16 positions of SmolLM2-135M is 368,640
    /// bytes). Default 256 MiB.
    #[arg(long, env = env::RNGD_PD_PREFIX_CACHE_BYTES, default_value_t = rngd_engine::prefix::DEFAULT_PREFIX_CACHE_BYTES)]
    pub prefix_cache_bytes: u64,
    /// With chunked prefill, the tokens one engine iteration computes at
    /// most: a prefill is computed in chunks of this budget less the running
    /// decode streams (one token each), so a long prompt does not stall them
    /// for its whole length, and what a chunk leaves takes the waiting
    /// prefills that fit whole (vLLM's flag; at least 8).
    #[arg(long, env = env::RNGD_PD_MAX_NUM_BATCHED_TOKENS, default_value_t = rngd_engine::cpu::DEFAULT_MAX_NUM_BATCHED_TOKENS, value_parser = parse_budget)]
    pub max_num_batched_tokens: usize,
    /// Chunk prefills under `--max-num-batched-tokens` (vLLM's flag; off by
    /// default here: on this CPU engine it trades TTFT for shorter decode
    /// stalls, docs/engine.md "Chunked prefill").
    #[arg(long, overrides_with = "no_enable_chunked_prefill")]
    pub enable_chunked_prefill: bool,
    /// Run each prefill whole, in one engine iteration (the default).
    #[arg(long, overrides_with = "enable_chunked_prefill")]
    pub no_enable_chunked_prefill: bool,
    /// Kernel of the prefills' projections: `int8` (the decode path's
    /// kernel; 2-4x faster prefills here, activations rounded to 8 bits as
    /// llama.cpp rounds them), `f32` (dequantized weights, the f32 GEMM:
    /// the lowest error, ~4 bytes per parameter more memory) or `auto`:
    /// int8 for each projection whose int8 blocks hold the file's weights
    /// exactly (Q4_1, Q8_0), f32 for the others (F16, BF16, F32,
    /// K-quants). Every worker of a PD pair must take the same choice for
    /// PD to equal solo bit for bit (docs/engine.md, "Kernels").
    #[arg(long, env = env::RNGD_PD_PREFILL_PROJECTIONS, default_value_t)]
    pub prefill_projections: rngd_engine::cpu::PrefillProjections,
    /// KV-cache events as vLLM publishes them: vLLM's JSON, e.g.
    /// `{"enable_kv_cache_events":true,"endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5558","topic":"kv@pod@model"}`
    /// with vLLM's keys (`publisher`, `endpoint`, `replay_endpoint`, `topic`,
    /// `buffer_steps`, `hwm`, `max_queue_size`) and defaults; an unknown key is
    /// refused. As in vLLM an endpoint with `*` or `::` binds (`tcp://*:PORT`:
    /// every interface; `tcp://127.0.0.1:*`: loopback, a free port, logged),
    /// any other is connected to; see docs/engine.md, "KV events".
    #[arg(long = "kv-events-config", env = env::RNGD_PD_KV_EVENTS_CONFIG, value_name = "JSON", value_parser = parse_kv_events)]
    pub kv_events_config: Option<rngd_kv_events::KvEventsConfig>,
    /// Listener of the worker admin API (`POST /reset_prefix_cache`), apart
    /// from the public one; served only with a token. Port 0 picks a free port.
    #[arg(long, env = env::RNGD_PD_WORKER_ADMIN_LISTEN, default_value_t = rngd_worker::admin::DEFAULT_WORKER_ADMIN_LISTEN)]
    pub admin_listen: std::net::SocketAddr,
    /// API key of the public routes (vLLM's `--api-key`): every route but
    /// `/health`, `/ready`, `/ping`, `/metrics` and `/version` wants
    /// `Authorization: Bearer KEY`; the worker sends it to its prefill peers.
    #[arg(long, env = env::VLLM_API_KEY, hide_env_values = true, value_parser = crate::flags::parse_api_key)]
    pub api_key: Option<rngd_http_edge::api_key::ApiKey>,
    /// Bearer token of the worker admin API; unset: no admin listener.
    #[arg(long, env = env::RNGD_PD_ADMIN_TOKEN, hide_env_values = true)]
    pub admin_token: Option<String>,
    /// Validate the flags and files (backend, model, KV transport
    /// configuration) and exit: 0 and `ok`, or a clear error.
    #[arg(long)]
    pub check: bool,
}

impl Args {
    /// The flags as the library's options.
    pub fn into_options(self) -> WorkerOptions {
        WorkerOptions {
            role: match self.role {
                RoleArg::Prefill => Role::Prefill,
                RoleArg::Decode => Role::Decode,
                RoleArg::Solo => Role::Solo,
            },
            backend: match self.backend {
                BackendArg::Cpu => Backend::Cpu,
                BackendArg::Rngd => Backend::Rngd,
                BackendArg::Atom => Backend::Atom,
            },
            chip: self.chip,
            host: self.host,
            port: self.port,
            kv_transport: self.kv_transport,
            model: self.model_args.model,
            chat_template: self.model_args.chat_template,
            served_model_name: self.model_args.served_model_name,
            seq_len: self.seq_len,
            batch: self.batch,
            threads: self.threads,
            node: self.node,
            kubelet_checkpoint: self.kubelet_checkpoint,
            kv_pull_timeout_ms: self.kv_pull_timeout_ms,
            kv_load_failure_policy: self.kv_load_failure_policy,
            prefill_timeout_ms: self.prefill_timeout_ms,
            prefill_allow: PrefillAllow::new(
                self.prefill_allow.into_iter().filter_map(|a| a.0).collect(),
            ),
            front_door_allow: self.front_door_allow,
            body_limit: self.body_limit,
            body_timeout_ms: self.body_timeout_ms,
            max_in_flight: self.max_in_flight,
            edge: self.listener.options(),
            prefix_cache: rngd_engine::prefix::PrefixCacheOptions {
                enabled: !self.no_enable_prefix_caching,
                block_size: self.block_size,
                max_bytes: self.prefix_cache_bytes,
            },
            max_num_batched_tokens: self
                .enable_chunked_prefill
                .then_some(self.max_num_batched_tokens),
            prefill_projections: self.prefill_projections,
            kv_events: self.kv_events_config,
            api_key: self.api_key,
            admin: rngd_worker::admin::AdminListen {
                listen: self.admin_listen,
                token: self
                    .admin_token
                    .as_deref()
                    .and_then(rngd_http_edge::admin::AdminToken::new),
            },
        }
    }
}

/// `--kv-events-config`: the message names what is wrong (an unknown key by name).
fn parse_kv_events(s: &str) -> Result<rngd_kv_events::KvEventsConfig, String> {
    rngd_kv_events::KvEventsConfig::parse(s).map_err(|e| {
        let mut msg = e.to_string();
        let mut src = std::error::Error::source(&e);
        while let Some(x) = src {
            msg.push_str(&format!(": {x}"));
            src = x.source();
        }
        msg
    })
}

/// `--block-size`: a positive integer.
fn at_least_one(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(format!("{s} is not a positive integer")),
    }
}

/// `--max-num-batched-tokens`: at least the smallest prefill step.
fn parse_budget(s: &str) -> Result<usize, String> {
    let min = rngd_engine::cpu::MIN_ROWS;
    match s.parse::<usize>() {
        Ok(n) if n >= min => Ok(n),
        Ok(n) => Err(format!(
            "{n} is below the smallest prefill step, {min} tokens"
        )),
        _ => Err(format!("{s} is not a token count")),
    }
}

/// Runs the subcommand (`--check`: validates and exits).
pub async fn run(args: Args) -> anyhow::Result<()> {
    let check = args.check;
    let opts = args.into_options();
    if check {
        check_options(&opts)?;
        println!("ok");
        return Ok(());
    }
    // Installed now, before the ready line; a second signal ends the drain.
    let signal = rngd_http_edge::shutdown_signal();
    let shutdown = async move {
        signal.await;
        rngd_http_edge::exit_on_next_signal();
    };
    rngd_worker::launch(opts, shutdown).await?;
    Ok(())
}

/// What `--check` validates, without binding, loading weights or creating a
/// transport: the backend is in this build, the sizes are usable, the default
/// KV transport is one this build has and its environment configuration
/// parses, and the model file is a GGUF whose tokenizer loads.
fn check_options(opts: &WorkerOptions) -> anyhow::Result<()> {
    use anyhow::Context;
    rngd_worker::check_backend(opts.backend)?;
    opts.edge.check()?;
    anyhow::ensure!(
        opts.seq_len > 0 && opts.batch > 0,
        "--seq-len and --batch must be at least 1"
    );
    // A known name this build cannot run (`nixl`) fails here with its reason.
    rngd_kv_transport::registry::check_name(&opts.kv_transport)
        .with_context(|| format!("--kv-transport {}", opts.kv_transport))?;
    let kv =
        rngd_kv_transport::TransportConfig::from_env().context("KV transport configuration")?;
    rngd_worker::kv_auth(opts.role, &kv)?;
    let model = rngd_engine::model_fetch::resolve(opts.model.as_deref())?;
    let overrides = rngd_engine::tokenizer::TokenizerOverrides {
        chat_template: opts.chat_template.clone(),
        served_model_name: opts.served_model_name.first().cloned(),
    };
    rngd_engine::tokenizer::Tokenizer::from_gguf(&model)
        .and_then(|t| t.with_overrides(&overrides))
        .with_context(|| format!("model {}", model.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: Args,
    }

    fn options(flags: &[&str]) -> Result<WorkerOptions, clap::Error> {
        let argv = std::iter::once("worker").chain(flags.iter().copied());
        Cli::try_parse_from(argv).map(|c| c.args.into_options())
    }

    #[test]
    fn the_prefill_kernel_flag_reaches_the_options() {
        use rngd_engine::cpu::PrefillProjections;
        assert_eq!(
            options(&[]).unwrap().prefill_projections,
            PrefillProjections::Auto
        );
        assert_eq!(
            WorkerOptions::default().prefill_projections,
            PrefillProjections::Auto
        );
        for (flag, want) in [
            ("f32", PrefillProjections::F32),
            ("int8", PrefillProjections::Int8),
            ("auto", PrefillProjections::Auto),
        ] {
            let got = options(&["--prefill-projections", flag]).unwrap();
            assert_eq!(got.prefill_projections, want);
        }
        let err = options(&["--prefill-projections", "fp16"])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("`fp16` is not one of auto, f32, int8"),
            "{err}"
        );
    }

    #[test]
    fn chunked_prefill_flags_reach_the_options() {
        // No flag: the library's default (unchunked).
        assert_eq!(options(&[]).unwrap().max_num_batched_tokens, None);
        assert_eq!(WorkerOptions::default().max_num_batched_tokens, None);
        // A budget alone does not turn chunking on (as in vLLM's flags).
        assert_eq!(
            options(&["--max-num-batched-tokens", "256"])
                .unwrap()
                .max_num_batched_tokens,
            None
        );
        assert_eq!(
            options(&[
                "--enable-chunked-prefill",
                "--max-num-batched-tokens",
                "256"
            ])
            .unwrap()
            .max_num_batched_tokens,
            Some(256)
        );
        assert_eq!(
            options(&["--enable-chunked-prefill"])
                .unwrap()
                .max_num_batched_tokens,
            Some(rngd_engine::cpu::DEFAULT_MAX_NUM_BATCHED_TOKENS)
        );
        // The last of the pair wins, as for the prefix cache's.
        assert_eq!(
            options(&["--enable-chunked-prefill", "--no-enable-chunked-prefill"])
                .unwrap()
                .max_num_batched_tokens,
            None
        );
        // Below the smallest prefill step: refused, naming it.
        let err = options(&["--max-num-batched-tokens", "7"])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("below the smallest prefill step, 8 tokens"),
            "{err}"
        );
        assert!(options(&["--max-num-batched-tokens", "x"]).is_err());
    }
}
