//! Flags of `rngd-pd-bench replay` ([`rngd_bench_replay::Options`]).

use std::path::PathBuf;

/// `--trace-format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum TraceFormatArg {
    /// By the file name: `.jsonl` is mooncake, anything else azure.
    Auto,
    /// The Azure LLM inference trace CSV.
    Azure,
    /// The Mooncake conversation trace (JSON lines with hash_ids).
    Mooncake,
}

impl From<TraceFormatArg> for rngd_bench_replay::TraceFormat {
    fn from(f: TraceFormatArg) -> Self {
        match f {
            TraceFormatArg::Auto => rngd_bench_replay::TraceFormat::Auto,
            TraceFormatArg::Azure => rngd_bench_replay::TraceFormat::Azure,
            TraceFormatArg::Mooncake => rngd_bench_replay::TraceFormat::Mooncake,
        }
    }
}

/// Flags of `rngd-pd-bench replay`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// The trace: the Azure CSV (TIMESTAMP,ContextTokens,GeneratedTokens) or
    /// the Mooncake JSON lines (timestamp, input_length, output_length,
    /// hash_ids); default: `../shared/data/AzureLLMInferenceTrace_conv.csv`
    /// from the repository root.
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// The trace's format (auto: `.jsonl` is mooncake).
    #[arg(long, value_enum, default_value = "auto")]
    pub trace_format: TraceFormatArg,
    /// Mooncake: token ids per trace block (each 512-token block of the
    /// trace becomes this many ids, the same block id always the same ids).
    #[arg(long, default_value_t = 16)]
    pub block_tokens: u32,
    /// Base URL of an OpenAI-compatible server (the gateway, Envoy in
    /// front of the picker, or one worker), e.g. http://127.0.0.1:8000.
    #[arg(
        long,
        conflicts_with_all = ["spawn_up", "spawn_worker", "policies", "llama_server"],
        required_unless_present_any = ["spawn_up", "spawn_worker", "policies", "llama_server"]
    )]
    pub url: Option<String>,
    /// `model` of the requests; default: the first of /v1/models.
    #[arg(long)]
    pub model: Option<String>,
    /// Arrival-time divisor (10 = ten times faster than the trace).
    #[arg(long, default_value_t = 1.0)]
    pub speedup: f64,
    /// First trace row replayed (0 = the first data row).
    #[arg(long, default_value_t = 0)]
    pub skip: usize,
    /// At most this many requests.
    #[arg(long)]
    pub max_requests: Option<usize>,
    /// Mooncake: first send the earlier turns of the window's
    /// conversations (rows before --skip), untimed, so the caches hold what
    /// a server running since the trace's start would.
    #[arg(long)]
    pub history: bool,
    /// Only requests scheduled within this many seconds of the start.
    #[arg(long)]
    pub duration_s: Option<f64>,
    /// Compiled context: prompt + max_tokens are scaled to fit seq_len - margin.
    #[arg(long, default_value_t = 512)]
    pub seq_len: u32,
    /// Tokens of the context kept free.
    #[arg(long, default_value_t = 16)]
    pub margin: u32,
    /// Requests open at once; arrivals beyond it are counted as client_dropped.
    #[arg(long, default_value_t = 256)]
    pub max_in_flight: usize,
    /// Deadline of each request (send to end of stream), seconds.
    #[arg(long, default_value_t = 120.0)]
    pub request_timeout_s: f64,
    /// TPOT SLO, ms (slo_share, goodput_rps).
    #[arg(long, default_value_t = 150.0)]
    pub slo_tpot_ms: f64,
    /// TTFT SLO, ms: a request meets the SLO only with TTFT within it too
    /// (default: TPOT alone).
    #[arg(long)]
    pub slo_ttft_ms: Option<f64>,
    /// Pids whose RSS is sampled at start and end.
    #[arg(long, value_delimiter = ',')]
    pub pids: Vec<u32>,
    /// Command-line substrings: matching processes' RSS is sampled.
    #[arg(long = "proc-name", value_delimiter = ',')]
    pub proc_names: Vec<String>,
    /// Worker or gateway metrics URLs (base or /metrics; LABEL=URL names
    /// one) read for leaked KV after the run.
    #[arg(long, value_delimiter = ',')]
    pub kv_metrics: Vec<String>,
    /// Directory whose files are counted as leaked KV after the run (the shm transport's root).
    #[arg(long)]
    pub shm_root: Option<PathBuf>,
    /// Bound on waiting for the workers to go idle after the run, seconds.
    #[arg(long, default_value_t = 30.0)]
    pub settle_s: f64,
    /// Start `rngd-pd up` (gateway port 0), replay against it, watch its
    /// processes and shm root, stop it (SIGINT) at the end.
    #[arg(long, conflicts_with_all = ["spawn_worker", "policies", "llama_server"])]
    pub spawn_up: bool,
    /// Start one solo `rngd-pd worker` (port 0), replay against it, read
    /// its metrics and watch its RSS, stop it (SIGINT) at the end.
    #[arg(long, conflicts_with_all = ["policies", "llama_server"])]
    pub spawn_worker: bool,
    /// The comparison run's flags (--policies, --llama-server, …).
    #[command(flatten)]
    pub compare: Box<CompareArgs>,
    /// The rngd-pd binary for --spawn-up and --spawn-worker; default: $RNGD_PD_BIN, else
    /// $CARGO_TARGET_DIR/release/rngd-pd, else beside this executable.
    #[arg(long)]
    pub rngd_pd: Option<PathBuf>,
    /// Extra argument of `rngd-pd up` (repeat it), e.g. --up-arg=--kv-transport --up-arg=tcp.
    #[arg(long = "up-arg", allow_hyphen_values = true)]
    pub up_args: Vec<String>,
    /// Extra argument of the spawned `rngd-pd worker` (repeat it), e.g.
    /// --worker-arg=--prefix-cache-bytes --worker-arg=1000000.
    #[arg(long = "worker-arg", allow_hyphen_values = true)]
    pub worker_args: Vec<String>,
    /// How long `rngd-pd up` (or the spawned worker) may take to be ready, seconds.
    #[arg(long, default_value_t = 900.0)]
    pub up_timeout_s: f64,
    /// The fault run's flags (--kill-every-s, --texts-out, …).
    #[command(flatten)]
    pub chaos: Box<ChaosArgs>,
    /// Print only the JSON line (no progress on stderr).
    #[arg(long)]
    pub json: bool,
}

/// Flags of a run with faults and text checks (`rngd_bench_replay::chaos`),
/// boxed in [`Args`] to keep the subcommand enum small.
#[derive(Debug, Clone, clap::Args)]
pub struct ChaosArgs {
    /// With --spawn-up: SIGKILL the worker --kill-worker every this many
    /// seconds (`rngd-pd up` restarts it).
    #[arg(long, requires = "spawn_up")]
    pub kill_every_s: Option<f64>,
    /// The worker killed, as `rngd-pd up` names it (decode-1, prefill, …).
    #[arg(long, default_value = "decode-1")]
    pub kill_worker: String,
    /// Write every answer's text here (JSON lines).
    #[arg(long)]
    pub texts_out: Option<PathBuf>,
    /// Hold every answer's text against this file from another run of the
    /// same window (greedy requests: counted in chaos.texts_differ).
    #[arg(long)]
    pub texts_against: Option<PathBuf>,
}

/// Flags of a comparison run (`rngd_bench_replay::compare`), boxed in
/// [`Args`] to keep the subcommand enum small.
#[derive(Debug, Clone, clap::Args)]
pub struct CompareArgs {
    /// Compare routing strategies of the default policy in one run
    /// (cache, load, round_robin, comma-separated): for each, start `rngd-pd
    /// up --decode-workers D --prefill-workers P` with `{"routing": …}` as
    /// its policy configuration, replay the same requests, stop it. The
    /// JSON line gets a `systems` array.
    #[arg(long, value_delimiter = ',')]
    pub policies: Vec<String>,
    /// Settings of the default policy (a JSON object, e.g.
    /// '{"queue_ms_per_request":0}') added to each --policies run's
    /// configuration, the same for every routing strategy.
    #[arg(long, value_name = "JSON")]
    pub policy_settings: Option<String>,
    /// Decode workers of each `rngd-pd up` of --policies.
    #[arg(long, default_value_t = 2)]
    pub decode_workers: u32,
    /// Prefill workers of each `rngd-pd up` of --policies.
    #[arg(long, default_value_t = 1)]
    pub prefill_workers: u32,
    /// llama.cpp's `llama-server` binary: after the policies, the same
    /// requests against it (`-t`, `-np`, `-c` = np × --seq-len, its prompt
    /// cache on), as a system of the comparison.
    #[arg(long)]
    pub llama_server: Option<PathBuf>,
    /// The GGUF llama-server loads; default: what `rngd-pd model fetch` prints.
    #[arg(long)]
    pub llama_model: Option<PathBuf>,
    /// llama-server's `-t`.
    #[arg(long, default_value_t = 2)]
    pub llama_threads: u32,
    /// llama-server's `-np`.
    #[arg(long, default_value_t = 4)]
    pub llama_parallel: u32,
    /// Extra argument of llama-server (repeat it).
    #[arg(long = "llama-arg", allow_hyphen_values = true)]
    pub llama_args: Vec<String>,
}

impl From<Args> for rngd_bench_replay::Options {
    fn from(a: Args) -> Self {
        let c = *a.compare;
        rngd_bench_replay::Options {
            trace: a.trace.unwrap_or_else(rngd_bench_replay::default_trace),
            trace_format: a.trace_format.into(),
            block_tokens: a.block_tokens,
            url: a.url,
            model: a.model,
            speedup: a.speedup,
            skip: a.skip,
            max_requests: a.max_requests,
            history: a.history,
            duration_s: a.duration_s,
            seq_len: a.seq_len,
            margin: a.margin,
            max_in_flight: a.max_in_flight,
            request_timeout_s: a.request_timeout_s,
            slo_tpot_ms: a.slo_tpot_ms,
            slo_ttft_ms: a.slo_ttft_ms,
            pids: a.pids,
            proc_names: a.proc_names,
            kv_metrics: a.kv_metrics,
            shm_root: a.shm_root,
            settle_s: a.settle_s,
            spawn_up: a.spawn_up,
            spawn_worker: a.spawn_worker,
            rngd_pd: a.rngd_pd,
            up_args: a.up_args,
            worker_args: a.worker_args,
            up_timeout_s: a.up_timeout_s,
            kill_every_s: a.chaos.kill_every_s,
            kill_worker: a.chaos.kill_worker,
            texts_out: a.chaos.texts_out,
            texts_against: a.chaos.texts_against,
            policies: c.policies,
            policy_settings: c.policy_settings,
            decode_workers: c.decode_workers,
            prefill_workers: c.prefill_workers,
            llama_server: c.llama_server,
            llama_model: c.llama_model,
            llama_threads: c.llama_threads,
            llama_parallel: c.llama_parallel,
            llama_args: c.llama_args,
            json: a.json,
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use crate::{Cli, Command};

    fn parse(args: &[&str]) -> Result<rngd_bench_replay::Options, clap::Error> {
        let argv = ["rngd-pd-bench", "replay"]
            .into_iter()
            .chain(args.iter().copied());
        match Cli::try_parse_from(argv)?.command {
            Command::Replay(a) => Ok(a.into()),
            other => panic!("parsed as {other:?}"),
        }
    }

    /// With only `--url`, the flags give the library's defaults.
    #[test]
    fn defaults_match_the_library() {
        let o = parse(&["--url", "http://h:1"]).expect("parses");
        let d = rngd_bench_replay::Options {
            url: Some("http://h:1".into()),
            ..rngd_bench_replay::Options::default()
        };
        assert_eq!(format!("{o:?}"), format!("{d:?}"));
    }

    /// Exactly one of `--url` and `--spawn-up`; lists split on commas;
    /// `--up-arg` takes values that start with `--`.
    #[test]
    fn flags_parse() {
        assert!(parse(&[]).is_err(), "neither --url nor --spawn-up");
        assert!(
            parse(&["--url", "http://h:1", "--spawn-up"]).is_err(),
            "both"
        );
        assert!(
            parse(&["--url", "http://h:1", "--spawn-worker"]).is_err(),
            "url and worker"
        );
        assert!(
            parse(&["--spawn-up", "--spawn-worker"]).is_err(),
            "up and worker"
        );
        let o = parse(&[
            "--spawn-worker",
            "--trace",
            "t.jsonl",
            "--trace-format",
            "mooncake",
            "--block-tokens",
            "8",
            "--worker-arg",
            "--prefix-cache-bytes",
            "--worker-arg=1000",
        ])
        .expect("parses");
        assert!(o.spawn_worker && !o.spawn_up && o.url.is_none());
        assert_eq!(o.trace_format, rngd_bench_replay::TraceFormat::Mooncake);
        assert_eq!(o.block_tokens, 8);
        assert_eq!(o.worker_args, ["--prefix-cache-bytes", "1000"]);
        let o = parse(&[
            "--spawn-up",
            "--pids",
            "1,2",
            "--proc-name",
            "a,b",
            "--kv-metrics",
            "decode=http://h:1,http://h:2",
            "--up-arg",
            "--kv-transport",
            "--up-arg=tcp",
            "--speedup",
            "50",
            "--max-requests",
            "200",
            "--duration-s",
            "60",
            "--skip",
            "3",
            "--max-in-flight",
            "8",
            "--request-timeout-s",
            "5",
            "--seq-len",
            "256",
            "--json",
        ])
        .expect("parses");
        assert!(o.spawn_up && o.json);
        assert_eq!(o.pids, [1, 2]);
        assert_eq!(o.proc_names, ["a", "b"]);
        assert_eq!(o.kv_metrics, ["decode=http://h:1", "http://h:2"]);
        assert_eq!(o.up_args, ["--kv-transport", "tcp"]);
        assert_eq!(
            (o.speedup, o.max_requests, o.duration_s, o.skip),
            (50.0, Some(200), Some(60.0), 3)
        );
        assert_eq!(
            (o.max_in_flight, o.request_timeout_s, o.seq_len),
            (8, 5.0, 256)
        );
    }

    /// `--policies` and `--llama-server` make a comparison run of their own:
    /// neither `--url` nor a spawn flag, the policy list split on commas.
    #[test]
    fn comparison_flags_parse() {
        let o = parse(&[
            "--policies",
            "cache,load,round_robin",
            "--llama-server",
            "/x/llama-server",
            "--llama-arg=--metrics",
            "--slo-ttft-ms",
            "2000",
            "--slo-tpot-ms",
            "100",
        ])
        .expect("parses");
        assert_eq!(o.policies, ["cache", "load", "round_robin"]);
        assert_eq!((o.decode_workers, o.prefill_workers), (2, 1));
        assert_eq!(o.llama_server.as_deref(), Some("/x/llama-server".as_ref()));
        assert_eq!((o.llama_threads, o.llama_parallel), (2, 4));
        assert_eq!(o.llama_args, ["--metrics"]);
        assert_eq!((o.slo_ttft_ms, o.slo_tpot_ms), (Some(2000.0), 100.0));
        assert!(o.url.is_none() && !o.spawn_up);
        assert!(parse(&["--policies", "cache", "--spawn-up"]).is_err());
        assert!(parse(&["--policies", "cache", "--url", "http://h:1"]).is_err());
        assert!(parse(&["--llama-server", "l", "--spawn-worker"]).is_err());
    }
}
