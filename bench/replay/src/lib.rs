//! `rngd-pd-bench replay`: replays the Azure LLM inference trace
//! (`TIMESTAMP,ContextTokens,GeneratedTokens`) or the Mooncake conversation
//! trace (JSON lines with `hash_ids`, [`mooncake`]) against any
//! OpenAI-compatible base URL (the rngd-pd gateway, Envoy + the endpoint
//! picker, one worker) with streaming `/v1/completions`, open loop, and ends
//! with one JSON line.
//!
//! - arrivals: the trace's timestamps from row `skip`, divided by `speedup`,
//!   bounded by `max_requests` and `duration`; each request fires at its time
//!   whatever the others are doing, unless `max_in_flight` requests are
//!   already open, in which case it is counted as `client_dropped` and not sent;
//! - lengths: prompt + `max_tokens` scaled down proportionally to fit
//!   `seq_len - margin`; the prompt is that many common words; the server may
//!   stop before `max_tokens` (no `ignore_eos`), so output tokens are the
//!   stream's `usage`; a Mooncake prompt is token ids, each trace block a
//!   fixed run of `block_tokens` ids, cut to whole leading blocks, and the
//!   JSON gains `prefix`: the trace's own reuse share next to the served
//!   cached share (`usage.prompt_tokens_details.cached_tokens`) and the
//!   worker's prefix-cache counters ([`metrics`]);
//! - per request: TTFT (to the first content chunk), TPOT ((last - first) /
//!   (tokens - 1)), status; every request has a deadline;
//! - around the run: RSS of watched processes at start and end, KV left after
//!   it ([`kv`]); with `spawn_up`, the whole stack started and stopped here
//!   ([`up`]); with `spawn_worker`, one solo worker ([`worker`]);
//! - with `policies` (and `llama_server`): the same requests against
//!   `rngd-pd up` once per routing strategy of the default policy, then
//!   against llama.cpp's `llama-server`, one JSON line with a `systems`
//!   array and the ratios of issue 26 ([`compare`], [`llama`]).
//!
//! Modules: [`trace`] (CSV, offsets, scaling, prompts), [`mooncake`] (its
//! JSON lines, blocks, cuts, reuse), [`client`] (one request), [`stats`]
//! (outcomes, percentiles, summary), [`procs`] (`/proc`), [`kv`],
//! [`metrics`] (prefix-cache counters), [`up`], [`worker`], [`compare`],
//! [`llama`]; this file:
//! [`Options`], [`Error`], [`run`] and the [`Report`] it prints.

pub mod chaos;
pub mod client;
pub mod compare;
pub mod kpi;
pub mod kv;
pub mod llama;
pub mod metrics;
pub mod mooncake;
pub mod procs;
pub mod stats;
pub mod trace;
pub mod up;
pub mod worker;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use tokio::sync::Semaphore;

/// Errors of the replay.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Reading the trace file failed.
    #[error("reading the trace {path}: {source}")]
    ReadTrace {
        /// The file.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// The trace is malformed (the message names the line).
    #[error("trace: {0}")]
    Trace(String),
    /// The options do not make a run.
    #[error("options: {0}")]
    Options(String),
    /// The `rngd-pd` binary was not found (the places tried).
    #[error("no rngd-pd binary (tried {0}); pass --rngd-pd or set RNGD_PD_BIN")]
    NoBinary(String),
    /// `rngd-pd up` failed to start or stop.
    #[error("rngd-pd up: {0}")]
    Up(String),
    /// The spawned `rngd-pd worker` failed to start or stop.
    #[error("rngd-pd worker: {0}")]
    Worker(String),
    /// The `llama-server` peer failed to start or stop.
    #[error("llama-server: {0}")]
    LlamaServer(String),
    /// Building the HTTP client failed.
    #[error("http client: {0}")]
    Client(#[source] reqwest::Error),
}

/// Which trace a file holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum TraceFormat {
    /// By the file name: `.jsonl` is [`TraceFormat::Mooncake`], anything
    /// else [`TraceFormat::Azure`].
    #[default]
    Auto,
    /// The Azure LLM inference trace CSV ([`trace`]).
    Azure,
    /// The Mooncake trace's JSON lines ([`mooncake`]).
    Mooncake,
}

impl TraceFormat {
    /// The format of `path`: `self` unless [`TraceFormat::Auto`].
    pub fn of(self, path: &Path) -> TraceFormat {
        match self {
            TraceFormat::Auto if path.extension().is_some_and(|e| e == "jsonl") => {
                TraceFormat::Mooncake
            }
            TraceFormat::Auto => TraceFormat::Azure,
            f => f,
        }
    }
}

/// What to run (the flags of `rngd-pd-bench replay`).
#[derive(Debug, Clone)]
pub struct Options {
    /// The trace file. Default [`default_trace`].
    pub trace: PathBuf,
    /// Its format. Default [`TraceFormat::Auto`].
    pub trace_format: TraceFormat,
    /// Mooncake: token ids per trace block (a 512-token block of the trace
    /// becomes this many). Default 16.
    pub block_tokens: u32,
    /// Base URL of the OpenAI-compatible server (`http://host:port`, no
    /// `/v1`). Default `None`: required unless `spawn_up` or `spawn_worker`.
    pub url: Option<String>,
    /// `model` of the requests. Default `None`: the first of `/v1/models`,
    /// else `default`.
    pub model: Option<String>,
    /// Arrival-time divisor (10 = ten times faster than the trace). Default 1.
    pub speedup: f64,
    /// First trace row replayed (0 = the first data row). Default 0.
    pub skip: usize,
    /// At most this many requests scheduled. Default `None`: no bound.
    pub max_requests: Option<usize>,
    /// Mooncake: before the timed requests, send the earlier turns of their
    /// conversations ([`mooncake::history`]) in trace order, at most
    /// [`HISTORY_IN_FLIGHT`] at a time, untimed and left out of every
    /// figure, so a window from `skip` on meets the caches a server running
    /// since the trace's start would have. Default off.
    pub history: bool,
    /// Only requests scheduled within this many seconds. Default `None`: no bound.
    pub duration_s: Option<f64>,
    /// Compiled context length the lengths are scaled to. Default 512.
    pub seq_len: u32,
    /// Tokens kept free of the context (prompt-length error, special tokens). Default 16.
    pub margin: u32,
    /// Requests open at once; an arrival beyond it is `client_dropped`. Default 256.
    pub max_in_flight: usize,
    /// Deadline of each request (send to end of stream), seconds. Default 120.
    pub request_timeout_s: f64,
    /// TPOT SLO, ms (`slo_share`, `goodput_rps`). Default 150.
    pub slo_tpot_ms: f64,
    /// TTFT SLO, ms: with it a request meets the SLO only if its TTFT is
    /// within it too. Default `None`: TPOT alone.
    pub slo_ttft_ms: Option<f64>,
    /// Pids whose RSS is sampled at start and end (keyed by pid). Default none.
    pub pids: Vec<u32>,
    /// Command-line substrings; matching processes are sampled (keyed
    /// `pattern:pid`). Default none.
    pub proc_names: Vec<String>,
    /// Worker (or gateway) metrics URLs (base or `/metrics`, optionally
    /// `LABEL=URL`) read for leaked KV after the run. Default none (with `spawn_up`: its prefill and
    /// decode workers and its gateway).
    pub kv_metrics: Vec<String>,
    /// Directory whose files are counted as leaked KV after the run. Default
    /// `None` (with `spawn_up`: its shm root).
    pub shm_root: Option<PathBuf>,
    /// How long to wait after the run for the workers to report nothing
    /// running or waiting, seconds. Default 30.
    pub settle_s: f64,
    /// Start `rngd-pd up` here, replay against its gateway, watch its
    /// processes and shm root, stop it at the end. Default off.
    pub spawn_up: bool,
    /// Start one solo `rngd-pd worker` here ([`worker`]), replay against
    /// it, read its metrics, stop it at the end. Default off.
    pub spawn_worker: bool,
    /// The `rngd-pd` binary for `spawn_up` and `spawn_worker`. Default
    /// `None`: [`up::locate`].
    pub rngd_pd: Option<PathBuf>,
    /// Extra arguments of `rngd-pd up` (e.g. `--kv-transport tcp`). Default none.
    pub up_args: Vec<String>,
    /// Extra arguments of `rngd-pd worker` with `spawn_worker` (e.g.
    /// `--prefix-cache-bytes 1000000`). Default none.
    pub worker_args: Vec<String>,
    /// How long `rngd-pd up` (or the worker) may take to be ready, seconds. Default 900.
    pub up_timeout_s: f64,
    /// With `spawn_up`: SIGKILL the worker `kill_worker` every this many
    /// seconds of the replay (`rngd-pd up` restarts it; [`chaos`]).
    /// Default `None`: no faults.
    pub kill_every_s: Option<f64>,
    /// The worker killed, by the name `rngd-pd up` prints (`decode-1`,
    /// `prefill`, …). Default `decode-1`.
    pub kill_worker: String,
    /// Write every answer's text here (JSON lines, [`chaos::Text`]).
    /// Default none.
    pub texts_out: Option<PathBuf>,
    /// Hold every answer's text against this file from another run of the
    /// same window (greedy requests: they must be equal). Default none.
    pub texts_against: Option<PathBuf>,
    /// Routing strategies of the default policy to compare
    /// ([`compare::POLICIES`]): `rngd-pd up` is started once for each and
    /// replayed against ([`compare`]). Default none: a single run.
    pub policies: Vec<String>,
    /// Settings of the default policy (a JSON object, e.g.
    /// `{"queue_ms_per_request":0}`) added to the configuration of every
    /// routing strategy of `policies`; `routing` is refused (`policies`
    /// sets it). Default none.
    pub policy_settings: Option<String>,
    /// `rngd-pd up --decode-workers` of a comparison run. Default 2.
    pub decode_workers: u32,
    /// `rngd-pd up --prefill-workers` of a comparison run. Default 1.
    pub prefill_workers: u32,
    /// llama.cpp's `llama-server` binary: replayed against after the
    /// policies ([`llama`]). Default `None`: no peer.
    pub llama_server: Option<PathBuf>,
    /// The GGUF the peer loads. Default `None`: what `rngd-pd model fetch`
    /// prints (rngd-pd's default model).
    pub llama_model: Option<PathBuf>,
    /// The peer's `-t`. Default 2.
    pub llama_threads: u32,
    /// The peer's `-np`. Default 4.
    pub llama_parallel: u32,
    /// More arguments of the peer. Default none.
    pub llama_args: Vec<String>,
    /// Print only the JSON line (no progress on stderr). Default off.
    pub json: bool,
}

/// How long the replay's client keeps an idle connection: under the 5 s
/// keep-alive of the gateway and workers (`rngd_http_edge`).
const CLIENT_POOL_IDLE: Duration = Duration::from_secs(4);

/// The trace in the repository's sibling data directory:
/// `<repo root>/../shared/data/AzureLLMInferenceTrace_conv.csv`.
pub fn default_trace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/data/AzureLLMInferenceTrace_conv.csv")
}

impl Default for Options {
    fn default() -> Self {
        Options {
            trace: default_trace(),
            trace_format: TraceFormat::Auto,
            block_tokens: 16,
            url: None,
            model: None,
            speedup: 1.0,
            skip: 0,
            max_requests: None,
            history: false,
            duration_s: None,
            seq_len: 512,
            margin: 16,
            max_in_flight: 256,
            request_timeout_s: 120.0,
            slo_tpot_ms: 150.0,
            slo_ttft_ms: None,
            pids: Vec::new(),
            proc_names: Vec::new(),
            kv_metrics: Vec::new(),
            shm_root: None,
            settle_s: 30.0,
            spawn_up: false,
            spawn_worker: false,
            rngd_pd: None,
            up_args: Vec::new(),
            worker_args: Vec::new(),
            up_timeout_s: 900.0,
            kill_every_s: None,
            kill_worker: "decode-1".into(),
            texts_out: None,
            texts_against: None,
            policies: Vec::new(),
            policy_settings: None,
            decode_workers: 2,
            prefill_workers: 1,
            llama_server: None,
            llama_model: None,
            llama_threads: 2,
            llama_parallel: 4,
            llama_args: Vec::new(),
            json: false,
        }
    }
}

/// The settings a run used (in the JSON line under `settings`).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Settings {
    /// Trace file.
    pub trace: String,
    /// Its format (`azure` or `mooncake`).
    pub trace_format: TraceFormat,
    /// Mooncake: token ids per trace block (`null` for the Azure trace).
    pub block_tokens: Option<u32>,
    /// Base URL replayed against.
    pub url: String,
    /// `model` sent.
    pub model: String,
    /// Arrival-time divisor.
    pub speedup: f64,
    /// First row.
    pub skip: usize,
    /// Bound on requests scheduled.
    pub max_requests: Option<usize>,
    /// Whether the window's history was sent first.
    pub history: bool,
    /// Bound on the arrival window, seconds.
    pub duration_s: Option<f64>,
    /// Context scaled to.
    pub seq_len: u32,
    /// Tokens kept free.
    pub margin: u32,
    /// In-flight bound.
    pub max_in_flight: usize,
    /// Per-request deadline, seconds.
    pub request_timeout_s: f64,
    /// TPOT SLO, ms.
    pub slo_tpot_ms: f64,
    /// TTFT SLO, ms (`null`: none).
    pub slo_ttft_ms: Option<f64>,
    /// Whether the stack was started here.
    pub spawn_up: bool,
    /// Whether one solo worker was started here.
    pub spawn_worker: bool,
}

/// Prefix reuse of a Mooncake replay: the trace's own, what the server
/// served from its cache, and the worker's counters.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PrefixReplay {
    /// Token ids per trace block.
    pub block_tokens: u32,
    /// History requests sent before the timed ones (`history`; 0 without).
    pub history_requests: u64,
    /// Of those, the ones that did not complete.
    pub history_errors: u64,
    /// Their prompt tokens. The trace figures below count the timed
    /// requests only, with the history's blocks already sent.
    pub history_prompt_tokens: u64,
    /// Prompt tokens of the requests sent.
    pub trace_prompt_tokens: u64,
    /// Of those, tokens in leading full blocks whose chain an earlier
    /// request sent (an infinite cache on one worker).
    pub trace_reused_tokens: u64,
    /// `trace_reused_tokens / trace_prompt_tokens`: the trace's own reuse share.
    pub trace_reuse_share: Option<f64>,
    /// The same under the engine's rule that a prefill computes its last
    /// token (and at least 8 rows): the most a server can serve cached.
    pub trace_reuse_share_capped: Option<f64>,
    /// Distinct blocks the requests sent (what an infinite cache holds;
    /// compare with `worker_end.num_gpu_blocks`).
    pub trace_unique_blocks: u64,
    /// The trace's reuse share with a least-recently-used cache of the
    /// worker's `num_gpu_blocks`, requests one at a time, prompt blocks only
    /// ([`mooncake::reused_with_lru`]; `null` without that label).
    pub trace_reuse_share_lru: Option<f64>,
    /// Prompt tokens of successful requests (`usage.prompt_tokens`).
    pub served_prompt_tokens: u64,
    /// Of those, cached (`usage.prompt_tokens_details.cached_tokens`).
    pub served_cached_tokens: u64,
    /// `served_cached_tokens / served_prompt_tokens`: the served cached share.
    pub served_cached_share: Option<f64>,
    /// Successful requests whose usage carried `cached_tokens`.
    pub served_usage_with_cached: u64,
    /// The worker's figures before the run (`null`: not readable at the URL).
    pub worker_start: Option<metrics::PrefixMetrics>,
    /// The worker's figures after the run.
    pub worker_end: Option<metrics::PrefixMetrics>,
    /// Hits over queries counted by the worker during the run.
    pub worker_hit_share: Option<f64>,
}

/// The JSON line.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Report {
    /// Requests sent.
    pub requests: u64,
    /// Requests the schedule held (`requests + client_dropped`).
    pub scheduled: u64,
    /// Arrivals not sent because `max_in_flight` requests were open.
    pub client_dropped: u64,
    /// Requests completed (2xx, whole stream).
    pub ok: u64,
    /// Requests sent that did not complete (the sum of the next six).
    pub errors: u64,
    /// Answered 429.
    pub http_429: u64,
    /// Answered 5xx.
    pub http_5xx: u64,
    /// Answered another non-2xx status.
    pub http_other: u64,
    /// Error object inside a 2xx stream.
    pub stream_errors: u64,
    /// Past the per-request deadline.
    pub timeouts: u64,
    /// Connection-level failures (or a stream cut before `[DONE]`).
    pub transport: u64,
    /// Successful streams without `usage` (tokens counted from chunks).
    pub usage_missing: u64,
    /// TTFT p50 of successful requests, ms.
    pub ttft_p50_ms: Option<f64>,
    /// TTFT p90, ms.
    pub ttft_p90_ms: Option<f64>,
    /// TTFT p99, ms.
    pub ttft_p99_ms: Option<f64>,
    /// TPOT p50 of successful requests of two tokens or more, ms.
    pub tpot_p50_ms: Option<f64>,
    /// TPOT p90, ms.
    pub tpot_p90_ms: Option<f64>,
    /// TPOT p99, ms.
    pub tpot_p99_ms: Option<f64>,
    /// p50 over successful requests of each one's longest gap between two
    /// content chunks (its worst stall), ms.
    pub max_gap_p50_ms: Option<f64>,
    /// Its p99, ms.
    pub max_gap_p99_ms: Option<f64>,
    /// Share of successful requests with TPOT ≤ the SLO (one-token answers
    /// meet it) and, with a TTFT SLO, TTFT within it.
    pub slo_share: Option<f64>,
    /// Successful requests meeting the SLO per second of wall time.
    pub goodput_rps: f64,
    /// Output tokens (successful requests) per second of wall time.
    pub tok_s: f64,
    /// Output tokens of successful requests.
    pub output_tokens: u64,
    /// Prompt tokens asked for (scaled, summed over requests sent).
    pub prompt_tokens_sent: u64,
    /// `max_tokens` asked for (summed over requests sent).
    pub max_tokens_sent: u64,
    /// Prompt tokens of successful requests as the server counted them
    /// (`usage.prompt_tokens`; compare with `prompt_tokens_sent` to see how
    /// close the word-built prompts come to their target length).
    pub prompt_tokens_usage: u64,
    /// The first error body seen per kind (`429`, `503`, …, `stream`): which
    /// component refused, and how.
    pub error_bodies: BTreeMap<String, String>,
    /// RSS at start, MB, by process label.
    pub rss_mb_start: BTreeMap<String, Option<f64>>,
    /// RSS at end (after the settle), MB, by process label.
    pub rss_mb_end: BTreeMap<String, Option<f64>>,
    /// KV left after the run (`null` with no metrics URL and no shm root).
    pub leaked_kv: Option<kv::LeakedKv>,
    /// Mooncake traces only: prefix reuse (left out for the Azure trace).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefix: Option<PrefixReplay>,
    /// The original system's KPIs: MFU with its peak's derivation, tokens
    /// per joule (or why not), devices by role and vendor ([`kpi`]).
    pub kpis: kpi::Kpis,
    /// The requests by the router's reason for their route (the
    /// `x-rngd-pd-route-reason` header): how each kind of route fared.
    /// Empty when no router of ours answered (llama-server, one worker). At
    /// most [`MAX_ROUTES`] reasons, then [`OTHER_ROUTES`].
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub by_route: BTreeMap<String, stats::RouteStats>,
    /// First arrival to the last request's end, seconds.
    pub wall_s: f64,
    /// Faults injected, texts held against another run, the router's
    /// predictions against the engines' reports ([`chaos`]; with
    /// `spawn_up`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub chaos: Option<chaos::Chaos>,
    /// The settings used.
    pub settings: Settings,
}

impl Report {
    /// The one-line JSON text.
    pub fn json_line(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
    }
}

/// Runs the replay (or the comparison, [`compare::wanted`]) and prints the
/// JSON line (the last line of stdout).
pub async fn run(opts: Options) -> Result<(), Error> {
    let line = if compare::wanted(&opts) {
        compare::launch(opts).await?.json_line()
    } else {
        launch(opts).await?.json_line()
    };
    println!("{line}");
    Ok(())
}

/// Most route reasons [`Report::by_route`] keeps apart; the requests of
/// any further reason are grouped under [`OTHER_ROUTES`].
pub const MAX_ROUTES: usize = 32;

/// The group of the reasons past [`MAX_ROUTES`].
pub const OTHER_ROUTES: &str = "(other)";

/// Adds `o` to its route's group: the server chose the reasons, so past
/// [`MAX_ROUTES`] of them a new one joins [`OTHER_ROUTES`].
pub fn group_by_route(
    routes: &mut BTreeMap<String, Vec<stats::Outcome>>,
    route: String,
    o: stats::Outcome,
) {
    let key = if routes.len() < MAX_ROUTES || routes.contains_key(&route) {
        route
    } else {
        OTHER_ROUTES.to_string()
    };
    routes.entry(key).or_default().push(o);
}

/// One request of the run, whichever trace it came from.
#[derive(Debug, Clone)]
struct Planned {
    offset: Duration,
    prompt: client::Prompt,
    prompt_tokens: u32,
    max_tokens: u32,
    /// Mooncake: the full blocks' trace ids (for the reuse share).
    full_blocks: Vec<u64>,
}

/// Requests of the history open at once (`history` in [`Options`]).
pub const HISTORY_IN_FLIGHT: usize = 4;

impl Planned {
    /// The request that sends it to `endpoint` (`…/v1/completions`).
    fn request(&self, endpoint: &str, model: &str) -> client::Request {
        client::Request {
            url: endpoint.to_string(),
            model: model.to_string(),
            prompt: self.prompt.clone(),
            max_tokens: self.max_tokens,
        }
    }
}

/// The requests of the run from the trace file in `opts`, and the history
/// sent before them (empty unless `opts.history`).
fn plan(
    opts: &Options,
    format: TraceFormat,
    budget: u32,
) -> Result<(Vec<Planned>, Vec<Planned>), Error> {
    let text = std::fs::read_to_string(&opts.trace).map_err(|source| Error::ReadTrace {
        path: opts.trace.clone(),
        source,
    })?;
    let duration = opts.duration_s.map(Duration::from_secs_f64);
    let mut history_planned = Vec::new();
    let (planned, rows) = if format == TraceFormat::Mooncake {
        if opts.block_tokens == 0 || opts.block_tokens > budget {
            return Err(Error::Options(format!(
                "--block-tokens must be between 1 and --seq-len minus --margin ({budget})"
            )));
        }
        let rows = mooncake::parse(&text)?;
        let window = mooncake::schedule(
            &rows,
            opts.skip,
            opts.max_requests,
            duration,
            opts.speedup,
            opts.block_tokens,
            budget,
        );
        let history = if opts.history {
            mooncake::history(&rows, &window, opts.block_tokens, budget)
        } else {
            Vec::new()
        };
        let convert = |p: mooncake::Planned| Planned {
            offset: p.offset,
            prompt_tokens: p.cut.prompt_tokens,
            max_tokens: p.cut.max_tokens,
            prompt: client::Prompt::Tokens(p.prompt),
            full_blocks: p.full_blocks,
        };
        history_planned = history.into_iter().map(convert).collect();
        (
            window.into_iter().map(convert).collect::<Vec<_>>(),
            rows.len(),
        )
    } else {
        if opts.history {
            return Err(Error::Options(
                "--history needs a Mooncake trace (its block ids name the conversations)".into(),
            ));
        }
        let rows = trace::parse(&text)?;
        let planned = trace::schedule(
            &rows,
            opts.skip,
            opts.max_requests,
            duration,
            opts.speedup,
            budget,
        )
        .into_iter()
        .map(|a| Planned {
            offset: a.offset,
            prompt: client::Prompt::Text(trace::prompt_text(a.prompt_tokens, a.row)),
            prompt_tokens: a.prompt_tokens,
            max_tokens: a.max_tokens,
            full_blocks: Vec::new(),
        })
        .collect::<Vec<_>>();
        (planned, rows.len())
    };
    if planned.is_empty() {
        return Err(Error::Options(format!(
            "no request to replay ({rows} rows, --skip {})",
            opts.skip
        )));
    }
    Ok((planned, history_planned))
}

/// The options checked and the run's requests planned (a single run or a
/// comparison, [`compare`]): the format, the timed requests, the history.
fn prepare(opts: &Options) -> Result<(TraceFormat, Vec<Planned>, Vec<Planned>), Error> {
    if !opts.speedup.is_finite() || opts.speedup <= 0.0 {
        return Err(Error::Options("--speedup must be > 0".into()));
    }
    if opts.max_in_flight == 0 {
        return Err(Error::Options("--max-in-flight must be ≥ 1".into()));
    }
    if opts.slo_ttft_ms.is_some_and(|t| !t.is_finite() || t <= 0.0) {
        return Err(Error::Options("--slo-ttft-ms must be > 0".into()));
    }
    let targets = [
        opts.url.is_some(),
        opts.spawn_up,
        opts.spawn_worker,
        compare::wanted(opts),
    ];
    if targets.iter().filter(|t| **t).count() != 1 {
        return Err(Error::Options(
            "give exactly one of --url, --spawn-up, --spawn-worker and --policies/--llama-server"
                .into(),
        ));
    }
    let budget = opts.seq_len.saturating_sub(opts.margin);
    if budget < 2 {
        return Err(Error::Options(
            "--seq-len minus --margin leaves fewer than 2 tokens".into(),
        ));
    }
    let format = opts.trace_format.of(&opts.trace);
    let (planned, history) = plan(opts, format, budget)?;
    Ok((format, planned, history))
}

/// Runs the replay and returns its report without printing it.
pub async fn launch(opts: Options) -> Result<Report, Error> {
    if compare::wanted(&opts) {
        return Err(Error::Options(
            "--policies/--llama-server make a comparison run (compare::launch)".into(),
        ));
    }
    let (format, planned, history) = prepare(&opts)?;
    let mut stack = None;
    let mut solo = None;
    if opts.spawn_up || opts.spawn_worker {
        let bin = up::locate(opts.rngd_pd.as_deref())?;
        let what = if opts.spawn_up { "up" } else { "worker" };
        if !opts.json {
            eprintln!("replay: starting {} {what}", bin.display());
        }
        let timeout = Duration::from_secs_f64(opts.up_timeout_s);
        if opts.spawn_up {
            stack = Some(up::start(&bin, opts.seq_len, &opts.up_args, timeout).await?);
        } else {
            solo = Some(worker::start(&bin, opts.seq_len, &opts.worker_args, timeout).await?);
        }
    }
    let result = replay(
        &opts,
        format,
        &planned,
        &history,
        stack.as_ref(),
        solo.as_ref(),
    )
    .await;
    if let Some(s) = stack
        && let Err(e) = s.stop(Duration::from_secs(30)).await
    {
        eprintln!("replay: {e}");
    }
    if let Some(w) = solo
        && let Err(e) = w.stop(Duration::from_secs(30)).await
    {
        eprintln!("replay: {e}");
    }
    result
}

/// One replay of `planned` against the stack, the worker or `opts.url`,
/// after `history` (untimed).
async fn replay(
    opts: &Options,
    format: TraceFormat,
    planned: &[Planned],
    history: &[Planned],
    stack: Option<&up::Up>,
    solo: Option<&worker::Worker>,
) -> Result<Report, Error> {
    let url = match (stack, solo, &opts.url) {
        (Some(s), _, _) => s.info.gateway.clone().unwrap_or_default(),
        (None, Some(w), _) => w.url.clone(),
        (None, None, Some(u)) => u.clone(),
        (None, None, None) => unreachable!("checked in launch"),
    };
    let base = url.trim_end_matches('/').to_string();
    // Idle connections are dropped before the servers' own keep-alive
    // timers close them (5 s at the gateway and the workers): a request
    // sent on a connection the server is closing fails before any byte.
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(opts.max_in_flight)
        .pool_idle_timeout(CLIENT_POOL_IDLE)
        .build()
        .map_err(Error::Client)?;
    let model = match &opts.model {
        Some(m) => m.clone(),
        None => first_model(&client, &base)
            .await
            .unwrap_or_else(|| "default".into()),
    };

    // What to watch.
    let mut watched: Vec<procs::Watched> = opts
        .pids
        .iter()
        .map(|&pid| procs::Watched {
            label: pid.to_string(),
            pid,
        })
        .collect();
    for p in &opts.proc_names {
        watched.extend(procs::by_name(p));
    }
    let mut kv_metrics = opts.kv_metrics.clone();
    let mut shm_root = opts.shm_root.clone();
    if let Some(s) = stack {
        watched.extend(procs::up_stack(s.pid));
        if kv_metrics.is_empty() {
            for (label, url) in [
                ("prefill", &s.info.prefill),
                ("decode", &s.info.decode),
                ("gateway", &s.info.gateway),
            ] {
                if let Some(u) = url {
                    kv_metrics.push(format!("{label}={u}"));
                }
            }
            for (label, u) in &s.info.more_workers {
                kv_metrics.push(format!("{label}={u}"));
            }
        }
        if shm_root.is_none() {
            shm_root.clone_from(&s.info.shm_root);
        }
    }
    if let Some(w) = solo {
        watched.push(procs::Watched {
            label: "worker".into(),
            pid: w.pid,
        });
        if kv_metrics.is_empty() {
            kv_metrics.push(format!("worker={}", w.url));
        }
    }
    let rss_mb_start = procs::sample(&watched);
    let mooncake = format == TraceFormat::Mooncake;
    let endpoint = format!("{base}/v1/completions");
    let timeout = Duration::from_secs_f64(opts.request_timeout_s);
    let history_errors =
        send_history(&client, &endpoint, &model, history, timeout, opts.json).await;
    let worker_start = if mooncake {
        metrics::scrape(&client, &base).await
    } else {
        None
    };

    if !opts.json {
        eprintln!(
            "replay: {} requests over {:.1} s (speedup {}) against {base}, model {model}",
            planned.len(),
            planned.last().map_or(0.0, |a| a.offset.as_secs_f64()),
            opts.speedup
        );
    }
    let slots = Arc::new(Semaphore::new(opts.max_in_flight));
    let mut tasks = tokio::task::JoinSet::new();
    let (mut dropped, mut prompt_sent, mut max_sent) = (0u64, 0u64, 0u64);
    let mut sent: Vec<&Planned> = Vec::with_capacity(planned.len());
    let energy_start = kpi::Energy::read(Path::new(kpi::POWERCAP));
    let start = tokio::time::Instant::now();
    let wall_start = Instant::now();
    // Faults and the gateway's prediction counters, while the requests run.
    let injector = Arc::new(chaos::Injector::default());
    let killed_url = stack.and_then(|s| worker_url(&s.info, &opts.kill_worker));
    let watching = stack.map(|s| {
        let every = opts.kill_every_s.map(Duration::from_secs_f64);
        tokio::spawn(injector.clone().run(
            client.clone(),
            base.clone(),
            s.pid,
            killed_url.clone(),
            every,
        ))
    });
    for (i, a) in planned.iter().enumerate() {
        tokio::time::sleep_until(start + a.offset).await;
        let Ok(permit) = slots.clone().try_acquire_owned() else {
            dropped += 1;
            continue;
        };
        sent.push(a);
        prompt_sent += u64::from(a.prompt_tokens);
        max_sent += u64::from(a.max_tokens);
        let req = a.request(&endpoint, &model);
        let client = client.clone();
        tasks.spawn(async move {
            let a = client::send(&client, &req, timeout).await;
            drop(permit);
            (Some(i), a)
        });
    }
    let mut outcomes = Vec::with_capacity(planned.len());
    let mut routes: BTreeMap<String, Vec<stats::Outcome>> = BTreeMap::new();
    let mut error_bodies = BTreeMap::new();
    let mut texts = Vec::with_capacity(planned.len());
    while let Some(r) = tasks.join_next().await {
        // A panicking request task is a bug here, not a server outcome.
        let (i, a) = r.unwrap_or_else(|e| {
            eprintln!("replay: request task failed: {e}");
            (
                None,
                client::Answer {
                    outcome: stats::Outcome::failed(stats::Status::Transport),
                    error: None,
                    route: None,
                    text: String::new(),
                },
            )
        });
        let o = a.outcome;
        if let Some(i) = i {
            texts.push(chaos::Text {
                i,
                ok: o.status == stats::Status::Ok,
                text: a.text,
            });
        }
        if let Some(b) = a.error {
            error_bodies.entry(error_key(o.status)).or_insert(b);
        }
        if let Some(route) = a.route {
            group_by_route(&mut routes, route, o);
        }
        outcomes.push(o);
    }
    let wall = wall_start.elapsed();
    if let Some(w) = watching {
        w.abort();
    }
    texts.sort_by_key(|t| t.i);
    let chaos = chaos_report(opts, &client, &base, &injector, &texts, stack.is_some()).await?;
    let energy_end = kpi::Energy::read(Path::new(kpi::POWERCAP));

    let leaked_kv = if kv_metrics.is_empty() && shm_root.is_none() {
        None
    } else {
        Some(
            kv::measure(
                &client,
                &kv_metrics,
                shm_root.as_deref(),
                Duration::from_secs_f64(opts.settle_s),
            )
            .await,
        )
    };
    let rss_mb_end = procs::sample(&watched);

    let summary = |outcomes: &[stats::Outcome]| {
        stats::summarize_with(
            outcomes,
            wall,
            Duration::from_secs_f64(opts.slo_tpot_ms / 1e3),
            opts.slo_ttft_ms.map(|t| Duration::from_secs_f64(t / 1e3)),
        )
    };
    let s = summary(&outcomes);
    let by_route = routes
        .iter()
        .map(|(route, o)| (route.clone(), stats::RouteStats::of(&summary(o))))
        .collect();
    let prefix = if mooncake {
        let worker_end = metrics::scrape(&client, &base).await;
        // The timed requests' reuse with the history's blocks sent first:
        // the whole sequence's counts less the history's own.
        let before: Vec<&Planned> = history.iter().collect();
        let all: Vec<&Planned> = before.iter().chain(sent.iter()).copied().collect();
        let h = mooncake::reuse(pairs(&before), opts.block_tokens);
        let w = mooncake::reuse(pairs(&all), opts.block_tokens);
        let r = mooncake::Reuse {
            prompt_tokens: w.prompt_tokens - h.prompt_tokens,
            reused_tokens: w.reused_tokens - h.reused_tokens,
            reused_tokens_capped: w.reused_tokens_capped - h.reused_tokens_capped,
            unique_blocks: w.unique_blocks,
        };
        Some(PrefixReplay {
            block_tokens: opts.block_tokens,
            history_requests: history.len() as u64,
            history_errors,
            history_prompt_tokens: history.iter().map(|p| u64::from(p.prompt_tokens)).sum(),
            trace_prompt_tokens: r.prompt_tokens,
            trace_reused_tokens: r.reused_tokens,
            trace_reuse_share: r.share(),
            trace_reuse_share_capped: r.share_capped(),
            trace_unique_blocks: r.unique_blocks,
            trace_reuse_share_lru: worker_end
                .and_then(|m| m.num_gpu_blocks)
                .filter(|_| r.prompt_tokens > 0)
                .map(|cap| {
                    let cap = usize::try_from(cap).unwrap_or(usize::MAX);
                    let reused = mooncake::reused_with_lru(pairs(&all), opts.block_tokens, cap)
                        - mooncake::reused_with_lru(pairs(&before), opts.block_tokens, cap);
                    reused as f64 / r.prompt_tokens as f64
                }),
            served_prompt_tokens: s.prompt_tokens_usage,
            served_cached_tokens: s.cached_tokens_usage,
            served_cached_share: (s.prompt_tokens_usage > 0)
                .then(|| s.cached_tokens_usage as f64 / s.prompt_tokens_usage as f64),
            served_usage_with_cached: s.cached_tokens_seen,
            worker_hit_share: worker_end
                .as_ref()
                .and_then(|e| e.hit_share_since(&worker_start.unwrap_or_default())),
            worker_start,
            worker_end,
        })
    } else {
        None
    };
    let kpis = kpi::Kpis::compute(
        kpi::Counts {
            prompt_tokens: s.prompt_tokens_usage,
            cached_tokens: s.cached_tokens_usage,
            output_tokens: s.output_tokens,
            wall_s: wall.as_secs_f64(),
        },
        &kpi::scrape_texts(&client, &kv_metrics).await,
        kpi::Peak::detect(),
        (energy_start, energy_end),
    );
    Ok(Report {
        requests: s.requests,
        scheduled: s.requests + dropped,
        client_dropped: dropped,
        ok: s.ok,
        errors: s.errors,
        http_429: s.http_429,
        http_5xx: s.http_5xx,
        http_other: s.http_other,
        stream_errors: s.stream_errors,
        timeouts: s.timeouts,
        transport: s.transport,
        usage_missing: s.usage_missing,
        ttft_p50_ms: s.ttft_ms.p50,
        ttft_p90_ms: s.ttft_ms.p90,
        ttft_p99_ms: s.ttft_ms.p99,
        tpot_p50_ms: s.tpot_ms.p50,
        tpot_p90_ms: s.tpot_ms.p90,
        tpot_p99_ms: s.tpot_ms.p99,
        max_gap_p50_ms: s.max_gap_ms.p50,
        max_gap_p99_ms: s.max_gap_ms.p99,
        slo_share: s.slo_share,
        goodput_rps: s.goodput_rps,
        tok_s: s.tok_s,
        output_tokens: s.output_tokens,
        prompt_tokens_sent: prompt_sent,
        max_tokens_sent: max_sent,
        prompt_tokens_usage: s.prompt_tokens_usage,
        error_bodies,
        rss_mb_start,
        rss_mb_end,
        leaked_kv,
        prefix,
        kpis,
        by_route,
        wall_s: wall.as_secs_f64(),
        chaos,
        settings: Settings {
            trace: std::fs::canonicalize(&opts.trace)
                .unwrap_or_else(|_| opts.trace.clone())
                .display()
                .to_string(),
            trace_format: format,
            block_tokens: mooncake.then_some(opts.block_tokens),
            url: base,
            model,
            speedup: opts.speedup,
            skip: opts.skip,
            max_requests: opts.max_requests,
            history: opts.history,
            duration_s: opts.duration_s,
            seq_len: opts.seq_len,
            margin: opts.margin,
            max_in_flight: opts.max_in_flight,
            request_timeout_s: opts.request_timeout_s,
            slo_tpot_ms: opts.slo_tpot_ms,
            slo_ttft_ms: opts.slo_ttft_ms,
            spawn_up: opts.spawn_up,
            spawn_worker: opts.spawn_worker,
        },
    })
}

/// `(full blocks, prompt tokens)` of each request, as [`mooncake::reuse`]
/// takes them.
fn pairs<'a>(ps: &'a [&'a Planned]) -> impl Iterator<Item = (&'a [u64], u32)> + 'a {
    ps.iter()
        .map(|p| (p.full_blocks.as_slice(), p.prompt_tokens))
}

/// Sends `history` in order, at most [`HISTORY_IN_FLIGHT`] open at once,
/// and waits for all of it; returns how many did not complete.
async fn send_history(
    client: &reqwest::Client,
    endpoint: &str,
    model: &str,
    history: &[Planned],
    timeout: Duration,
    quiet: bool,
) -> u64 {
    if history.is_empty() {
        return 0;
    }
    if !quiet {
        eprintln!(
            "replay: sending {} earlier turns first (untimed)",
            history.len()
        );
    }
    let slots = Arc::new(Semaphore::new(HISTORY_IN_FLIGHT));
    let mut tasks = tokio::task::JoinSet::new();
    for p in history {
        let Ok(permit) = slots.clone().acquire_owned().await else {
            break;
        };
        let req = p.request(endpoint, model);
        let client = client.clone();
        tasks.spawn(async move {
            let a = client::send(&client, &req, timeout).await;
            drop(permit);
            a.outcome.status == stats::Status::Ok
        });
    }
    let mut errors = 0;
    while let Some(r) = tasks.join_next().await {
        if !r.unwrap_or(false) {
            errors += 1;
        }
    }
    errors
}

/// The key of an error kind in [`Report::error_bodies`].
fn error_key(s: stats::Status) -> String {
    match s {
        stats::Status::Http429 => "429".into(),
        stats::Status::HttpOther(c) | stats::Status::Http5xx(c) => c.to_string(),
        stats::Status::StreamError => "stream".into(),
        other => format!("{other:?}").to_lowercase(),
    }
}

/// The first model id of `{base}/v1/models`.
pub async fn first_model(client: &reqwest::Client, base: &str) -> Option<String> {
    let r = client
        .get(format!("{base}/v1/models"))
        .timeout(Duration::from_secs(10))
        .send()
        .await
        .ok()?;
    let v: serde_json::Value = r.json().await.ok()?;
    v["data"][0]["id"].as_str().map(str::to_string)
}

/// The URL of the worker `rngd-pd up` printed as `name` (`prefill`,
/// `decode`, `decode-1`, …).
fn worker_url(info: &up::UpInfo, name: &str) -> Option<String> {
    match name {
        "prefill" => info.prefill.clone(),
        "decode" | "decode-0" => info.decode.clone(),
        other => info
            .more_workers
            .iter()
            .find(|(n, _)| n == other)
            .map(|(_, u)| u.clone()),
    }
}

/// The [`chaos::Chaos`] of a run: texts written and compared, the kills,
/// the gateway's prediction counters.
async fn chaos_report(
    opts: &Options,
    client: &reqwest::Client,
    base: &str,
    injector: &chaos::Injector,
    texts: &[chaos::Text],
    spawned: bool,
) -> Result<Option<chaos::Chaos>, Error> {
    if let Some(p) = &opts.texts_out {
        chaos::write_texts(p, texts)?;
    }
    let compared = match &opts.texts_against {
        Some(p) => Some(chaos::compare_texts(p, texts)?),
        None => None,
    };
    if !spawned && compared.is_none() {
        return Ok(None);
    }
    let end = match client.get(format!("{base}/metrics")).send().await {
        Ok(r) => r.text().await.ok().map(|t| {
            (
                chaos::counter(&t, "rngd_pd_router_predicted_cached_tokens_total"),
                chaos::counter(&t, "rngd_pd_router_served_cached_tokens_total"),
            )
        }),
        Err(_) => None,
    };
    let (kills, end, settled) = injector.summary(end).await;
    Ok(Some(chaos::Chaos {
        killed_worker: opts.kill_every_s.map(|_| opts.kill_worker.clone()),
        kills,
        texts_compared: compared.map(|c| c.0),
        texts_differ: compared.map(|c| c.1),
        texts_missing: compared.map(|c| c.2),
        predicted_cached_tokens: end.map(|e| e.0),
        served_cached_tokens: end.map(|e| e.1),
        predicted_over_served: end.filter(|e| e.1 > 0.0).map(|e| e.0 / e.1),
        predicted_over_served_settled: settled,
    }))
}
