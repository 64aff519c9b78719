//! `rngd-pd-bench prefix`: the prefix cache's TTFT figure. A prompt of
//! `prompt_tokens` token ids (480) is timed with 0%, 50% and 90% of it
//! already in the worker's prefix cache, against a cold prompt, in one run
//! of interleaved rounds, on one solo worker started here (or at `url`).
//!
//! - **A round**: one timed request per variant, in an order rotated each
//!   round. Every prompt is fresh random ids (`TOKEN_LO..TOKEN_HI`, none
//!   special), so nothing is cached by accident. `cachedP`: first a warm
//!   request of the prompt's first `P%` rounded down to whole blocks (its own
//!   request, `max_tokens` 1, not timed), then the whole prompt, timed.
//!   `cached0`: the warm request is fresh ids of the 90% prefix's length that
//!   share no block with the prompt (the same request pattern, nothing
//!   reusable). `cold`: the prompt alone.
//! - **TTFT**: streaming `/v1/completions`, `max_tokens` 1, greedy, from
//!   sending to the first content chunk; the final usage chunk's
//!   `prompt_tokens_details.cached_tokens` is recorded per request, so the
//!   JSON shows the cache hit each timing had.
//! - **After the run**: the worker's `vllm:prefix_cache_queries_total`,
//!   `vllm:prefix_cache_hits_total` and `vllm:cache_config_info` labels
//!   (`block_size`, `num_gpu_blocks`), and the memory of one block,
//!   `layers × 2 × kv_heads × head_dim × block_size × 2` bytes (bf16 K and
//!   V): the worker does not export the model's dimensions, so they are
//!   options (SmolLM2-135M's by default: 30 layers, 3 KV heads, head_dim
//!   64, 360 KiB at 16), checked against `num_gpu_blocks` and the budget.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rngd_bench_replay::client::{self, Prompt};
use rngd_bench_replay::metrics::{self, PrefixMetrics};
use rngd_bench_replay::stats::{self, Status};
use rngd_bench_replay::{up, worker};
use serde::Serialize;

/// Lowest token id of a prompt (SmolLM2's special tokens are below 20).
pub const TOKEN_LO: u32 = 1000;
/// One past the highest token id of a prompt (SmolLM2 has 49,152).
pub const TOKEN_HI: u32 = 40_000;
/// The target for `cached90_vs_cold`.
pub const TARGET_CACHED90_VS_COLD: f64 = 0.2;

/// Errors of the prefix benchmark.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The options do not make a run.
    #[error("options: {0}")]
    Options(String),
    /// Starting or stopping the worker, or finding its binary.
    #[error(transparent)]
    Worker(#[from] rngd_bench_replay::Error),
    /// Building the HTTP client failed.
    #[error("http client: {0}")]
    Client(#[source] reqwest::Error),
    /// A request did not complete (what it was, how it ended, the body).
    #[error("{what}: {status:?} {body}")]
    Request {
        /// Which request.
        what: String,
        /// How it ended.
        status: Status,
        /// The error body, if any.
        body: String,
    },
}

/// What to run (the flags of `rngd-pd-bench prefix`).
#[derive(Debug, Clone)]
pub struct Options {
    /// Base URL of a running worker (`http://host:port`). Default `None`:
    /// a solo worker is started here and stopped at the end.
    pub url: Option<String>,
    /// The `rngd-pd` binary to start. Default `None`: `$RNGD_PD_BIN`, else
    /// `$CARGO_TARGET_DIR/release/rngd-pd`, else beside this executable.
    pub rngd_pd: Option<PathBuf>,
    /// Extra arguments of the started `rngd-pd worker`. Default none.
    pub worker_args: Vec<String>,
    /// `--seq-len` of the started worker. Default 512.
    pub seq_len: u32,
    /// How long the started worker may take to load its model, seconds. Default 900.
    pub worker_timeout_s: f64,
    /// `model` of the requests. Default `None`: the first of `/v1/models`.
    pub model: Option<String>,
    /// Prompt length, tokens. Default 480.
    pub prompt_tokens: u32,
    /// Shares of the prompt cached, percent (0 is the no-shared-block
    /// variant). Default 0, 50, 90.
    pub cached_percents: Vec<u32>,
    /// Rounds (one timed request per variant each). Default 10.
    pub rounds: usize,
    /// Untimed requests of fresh prompts before the rounds. Default 2.
    pub warmup: usize,
    /// Positions per cache block (prefixes are rounded down to whole
    /// blocks). Default `None`: the worker's `vllm:cache_config_info`
    /// `block_size`, else 16.
    pub block_size: Option<u32>,
    /// Seed of the random prompts. Default `None`: from the clock (a rerun
    /// against the same worker must not find its prompts cached).
    pub seed: Option<u64>,
    /// Deadline of each request, seconds. Default 120.
    pub request_timeout_s: f64,
    /// Model layers, for the memory of a block. Default 30 (SmolLM2-135M).
    pub layers: u32,
    /// KV heads. Default 3 (SmolLM2-135M).
    pub kv_heads: u32,
    /// Head dimension. Default 64 (SmolLM2-135M).
    pub head_dim: u32,
    /// The worker's `--prefix-cache-bytes`, to check `num_gpu_blocks`
    /// against. Default 256 MiB (the worker's default).
    pub prefix_cache_bytes: u64,
    /// Print only the JSON line (no progress on stderr). Default off.
    pub json: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            url: None,
            rngd_pd: None,
            worker_args: Vec::new(),
            seq_len: 512,
            worker_timeout_s: 900.0,
            model: None,
            prompt_tokens: 480,
            cached_percents: vec![0, 50, 90],
            rounds: 10,
            warmup: 2,
            block_size: None,
            seed: None,
            request_timeout_s: 120.0,
            layers: 30,
            kv_heads: 3,
            head_dim: 64,
            prefix_cache_bytes: 256 << 20,
            json: false,
        }
    }
}

/// The timings of one variant.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Variant {
    /// Tokens of the prompt warmed before it (0 for `cold`; for `cached0`
    /// the unrelated warm request's length).
    pub warmed_tokens: u32,
    /// The tokens the server reported cached, per round.
    pub cached_tokens: Vec<Option<u64>>,
    /// TTFT per round, ms (round order).
    pub ttft_ms: Vec<f64>,
    /// Median TTFT, ms.
    pub ttft_p50_ms: Option<f64>,
    /// 90th percentile (nearest rank), ms.
    pub ttft_p90_ms: Option<f64>,
}

/// Memory of one cached block.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BlockMemory {
    /// `layers × 2 × kv_heads × head_dim × block_size × 2` bytes.
    pub bytes: u64,
    /// The formula, with the numbers used.
    pub formula: String,
    /// Where the dimensions come from.
    pub dims_from: String,
    /// `prefix_cache_bytes / bytes`: the blocks the budget holds by the formula.
    pub expected_num_gpu_blocks: u64,
    /// Whether that equals the worker's `num_gpu_blocks` (`null` if not exported).
    pub matches_worker: Option<bool>,
}

/// The JSON line.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Report {
    /// Prompt length, tokens.
    pub prompt_tokens: u32,
    /// Positions per block the prefixes were rounded to.
    pub block_size: u32,
    /// Rounds.
    pub rounds: usize,
    /// What TTFT is.
    pub ttft: &'static str,
    /// Per variant (`cached0`, `cached50`, `cached90`, `cold`).
    pub variants: BTreeMap<String, Variant>,
    /// Median TTFT of each cached variant over the cold one's
    /// (`cached90_vs_cold`, …).
    pub ratios: BTreeMap<String, Option<f64>>,
    /// p90 over p90, the same keys.
    pub ratios_p90: BTreeMap<String, Option<f64>>,
    /// The target for `cached90_vs_cold` (≤).
    pub target_cached90_vs_cold: f64,
    /// Whether the median ratio meets it (`null` without a 90% variant).
    pub meets_target: Option<bool>,
    /// The worker's prefix-cache figures after the run.
    pub worker: Option<PrefixMetrics>,
    /// The worker's figures before the run (a worker at `url` may have
    /// counted other traffic).
    pub worker_start: Option<PrefixMetrics>,
    /// Memory of one block.
    pub block_memory: BlockMemory,
    /// Base URL measured.
    pub url: String,
    /// `model` sent.
    pub model: String,
    /// Seed of the prompts.
    pub seed: u64,
    /// Whether the worker was started here.
    pub spawned_worker: bool,
    /// Wall time of the rounds, seconds.
    pub wall_s: f64,
}

impl Report {
    /// The one-line JSON text.
    pub fn json_line(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
    }
}

/// SplitMix64 random ids.
#[derive(Debug, Clone)]
pub struct Ids(u64);

impl Ids {
    /// A stream from `seed`.
    pub fn new(seed: u64) -> Self {
        Ids(seed)
    }

    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// `n` ids in `TOKEN_LO..TOKEN_HI`.
    pub fn prompt(&mut self, n: u32) -> Vec<u32> {
        (0..n)
            .map(|_| TOKEN_LO + (self.next_u64() % u64::from(TOKEN_HI - TOKEN_LO)) as u32)
            .collect()
    }
}

/// The prefix of `prompt_tokens` cached for `percent`: rounded down to whole
/// blocks of `block_size`.
pub fn prefix_len(prompt_tokens: u32, percent: u32, block_size: u32) -> u32 {
    let b = block_size.max(1);
    let raw = u64::from(prompt_tokens) * u64::from(percent.min(100)) / 100;
    (raw as u32) / b * b
}

/// Bytes of one block: `layers × 2 × kv_heads × head_dim × block_size × 2`.
pub fn block_bytes(layers: u32, kv_heads: u32, head_dim: u32, block_size: u32) -> u64 {
    u64::from(layers) * 2 * u64::from(kv_heads) * u64::from(head_dim) * u64::from(block_size) * 2
}

/// Runs the benchmark and prints the JSON line (the last line of stdout).
pub async fn run(opts: Options) -> Result<Report, Error> {
    let report = launch(opts).await?;
    println!("{}", report.json_line());
    Ok(report)
}

/// Runs the benchmark and returns its report without printing it.
pub async fn launch(opts: Options) -> Result<Report, Error> {
    if opts.rounds == 0 || opts.prompt_tokens < 2 {
        return Err(Error::Options(
            "--rounds must be ≥ 1 and --prompt-tokens ≥ 2".into(),
        ));
    }
    if opts.cached_percents.iter().any(|p| *p > 100) {
        return Err(Error::Options("--cached-percents are 0 to 100".into()));
    }
    let mut solo = None;
    if opts.url.is_none() {
        let bin = up::locate(opts.rngd_pd.as_deref())?;
        if !opts.json {
            eprintln!("prefix: starting {} worker", bin.display());
        }
        solo = Some(
            worker::start(
                &bin,
                opts.seq_len,
                &opts.worker_args,
                Duration::from_secs_f64(opts.worker_timeout_s),
            )
            .await?,
        );
    }
    let url = match (&solo, &opts.url) {
        (Some(w), _) => w.url.clone(),
        (None, Some(u)) => u.clone(),
        (None, None) => unreachable!("a worker was started"),
    };
    let result = measure(&opts, url.trim_end_matches('/'), solo.is_some()).await;
    if let Some(w) = solo
        && let Err(e) = w.stop(Duration::from_secs(30)).await
    {
        eprintln!("prefix: {e}");
    }
    result
}

/// One request; its TTFT and cached tokens, or the error.
async fn timed(
    client: &reqwest::Client,
    endpoint: &str,
    model: &str,
    prompt: Vec<u32>,
    timeout: Duration,
    what: &str,
) -> Result<(Duration, Option<u64>), Error> {
    let req = client::Request {
        url: endpoint.to_string(),
        model: model.to_string(),
        prompt: Prompt::Tokens(prompt),
        max_tokens: 1,
    };
    let client::Answer {
        outcome: o,
        error: body,
        ..
    } = client::send(client, &req, timeout).await;
    match (o.status, o.ttft) {
        (Status::Ok, Some(t)) => Ok((t, o.cached_tokens)),
        (status, _) => Err(Error::Request {
            what: what.to_string(),
            status,
            body: body.unwrap_or_else(|| "(no content chunk)".into()),
        }),
    }
}

async fn measure(opts: &Options, base: &str, spawned: bool) -> Result<Report, Error> {
    let client = reqwest::Client::builder().build().map_err(Error::Client)?;
    let model = match &opts.model {
        Some(m) => m.clone(),
        None => rngd_bench_replay::first_model(&client, base)
            .await
            .unwrap_or_else(|| "default".into()),
    };
    let worker_start = metrics::scrape(&client, base).await;
    let block_size = opts
        .block_size
        .or_else(|| {
            worker_start
                .and_then(|m| m.block_size)
                .and_then(|b| u32::try_from(b).ok())
        })
        .unwrap_or(16)
        .max(1);
    let seed = opts.seed.unwrap_or_else(|| {
        let t = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        t ^ u64::from(std::process::id()).rotate_left(32)
    });
    let mut ids = Ids::new(seed);
    let endpoint = format!("{base}/v1/completions");
    let timeout = Duration::from_secs_f64(opts.request_timeout_s);
    let n = opts.prompt_tokens;

    for i in 0..opts.warmup {
        timed(
            &client,
            &endpoint,
            &model,
            ids.prompt(n),
            timeout,
            &format!("warm-up {i}"),
        )
        .await?;
    }

    // The variants: (name, percent cached; None = cold).
    let mut names: Vec<(String, Option<u32>)> = opts
        .cached_percents
        .iter()
        .map(|p| (format!("cached{p}"), Some(*p)))
        .collect();
    names.push(("cold".into(), None));
    let unrelated_len = prefix_len(
        n,
        opts.cached_percents.iter().copied().max().unwrap_or(0),
        block_size,
    );
    let mut variants: BTreeMap<String, Variant> = names
        .iter()
        .map(|(name, p)| {
            let warmed = match p {
                Some(0) => unrelated_len,
                Some(p) => prefix_len(n, *p, block_size),
                None => 0,
            };
            (
                name.clone(),
                Variant {
                    warmed_tokens: warmed,
                    cached_tokens: Vec::new(),
                    ttft_ms: Vec::new(),
                    ttft_p50_ms: None,
                    ttft_p90_ms: None,
                },
            )
        })
        .collect();

    let wall = Instant::now();
    for round in 0..opts.rounds {
        for k in 0..names.len() {
            let (name, pct) = &names[(k + round) % names.len()];
            let prompt = ids.prompt(n);
            let warm = match pct {
                Some(0) if unrelated_len > 0 => Some(ids.prompt(unrelated_len)),
                Some(p) => {
                    let len = prefix_len(n, *p, block_size) as usize;
                    (len > 0).then(|| prompt[..len].to_vec())
                }
                None => None,
            };
            if let Some(w) = warm {
                timed(
                    &client,
                    &endpoint,
                    &model,
                    w,
                    timeout,
                    &format!("round {round} {name} warm"),
                )
                .await?;
            }
            let (t, cached) = timed(
                &client,
                &endpoint,
                &model,
                prompt,
                timeout,
                &format!("round {round} {name}"),
            )
            .await?;
            let v = variants.get_mut(name).expect("every variant is in the map");
            v.ttft_ms.push(stats::ms(t));
            v.cached_tokens.push(cached);
            if !opts.json {
                eprintln!(
                    "round {round}: {name} ttft {:.1} ms, cached_tokens {}",
                    stats::ms(t),
                    cached.map_or("-".into(), |c| c.to_string())
                );
            }
        }
    }
    let wall_s = wall.elapsed().as_secs_f64();

    for v in variants.values_mut() {
        let mut sorted = v.ttft_ms.clone();
        sorted.sort_by(f64::total_cmp);
        v.ttft_p50_ms = stats::percentile(&sorted, 50.0);
        v.ttft_p90_ms = stats::percentile(&sorted, 90.0);
    }
    let cold = variants.get("cold").cloned();
    let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => Some(a / b),
        _ => None,
    };
    let mut ratios = BTreeMap::new();
    let mut ratios_p90 = BTreeMap::new();
    for (name, v) in &variants {
        if name == "cold" {
            continue;
        }
        ratios.insert(
            format!("{name}_vs_cold"),
            ratio(v.ttft_p50_ms, cold.as_ref().and_then(|c| c.ttft_p50_ms)),
        );
        ratios_p90.insert(
            format!("{name}_vs_cold"),
            ratio(v.ttft_p90_ms, cold.as_ref().and_then(|c| c.ttft_p90_ms)),
        );
    }
    let meets_target = ratios
        .get("cached90_vs_cold")
        .copied()
        .flatten()
        .map(|r| r <= TARGET_CACHED90_VS_COLD);

    let worker_end = metrics::scrape(&client, base).await;
    let bytes = block_bytes(opts.layers, opts.kv_heads, opts.head_dim, block_size);
    let expected = opts.prefix_cache_bytes / bytes.max(1);
    Ok(Report {
        prompt_tokens: n,
        block_size,
        rounds: opts.rounds,
        ttft: "streaming /v1/completions, max_tokens 1: send to the first content chunk",
        variants,
        ratios,
        ratios_p90,
        target_cached90_vs_cold: TARGET_CACHED90_VS_COLD,
        meets_target,
        worker: worker_end,
        worker_start,
        block_memory: BlockMemory {
            bytes,
            formula: format!(
                "layers {} x 2 (K, V) x kv_heads {} x head_dim {} x block_size {block_size} x 2 bytes (bf16)",
                opts.layers, opts.kv_heads, opts.head_dim
            ),
            dims_from:
                "options (the worker exports no model dimensions); defaults are SmolLM2-135M's"
                    .into(),
            expected_num_gpu_blocks: expected,
            matches_worker: worker_end
                .and_then(|m| m.num_gpu_blocks)
                .map(|w| w == expected),
        },
        url: base.to_string(),
        model,
        seed,
        spawned_worker: spawned,
        wall_s,
    })
}
