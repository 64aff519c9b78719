//! `rngd-pd-bench engine`: the CPU engine's prefill and decode timings (the llama.cpp comparison wraps it).
//!
//! For each prompt, `--runs` times: a prefill (wall time of
//! [`Engine::prefill`], which includes exporting the bf16 cache) and a greedy
//! decode of `--decode-tokens` tokens from that cache (time per token after
//! the first). Then the aggregate decode throughput of `--batch` streams
//! stepped together against one stream alone, on the same engine and cache.
//! Figures are medians over runs; the prefix cache is off, so every run's
//! prefill is cold (a run after the first would otherwise reuse the
//! prompt's blocks). The prefills' projections take `--prefill-projections`
//! (default the worker's, `auto`). Prompts are token ids: `--prompt-ids FILE`
//! (a JSON array of arrays, as `bench/engine_vs_llamacpp` writes it so that
//! llama.cpp gets exactly the same tokens), or built from a fixed English
//! text cut to `--prompt-tokens` lengths.
//!
//! [`stall`] is `rngd-pd-bench chunked`: the stall a long prefill causes the
//! streams decoding beside it, per chunked-prefill budget.

pub mod stall;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use rngd_engine::cpu::{CpuEngine, CpuEngineOptions, PrefillProjections};
use rngd_engine::{Engine, EngineError, GenEvent, Prefilled, SamplingParams};
use serde::Serialize;

/// What to run (the flags of `rngd-pd-bench engine`).
#[derive(Debug, Clone)]
pub struct Options {
    /// GGUF model. Default `None`: `$RNGD_PD_MODEL`, else the cached default model.
    pub model: Option<PathBuf>,
    /// Prompt lengths in tokens, cut from a fixed text (ignored with
    /// `prompt_ids`). Default 32, 197 and 470.
    pub prompt_tokens: Vec<usize>,
    /// JSON file with the prompts as token ids (`[[1, 2, …], …]`). Default `None`.
    pub prompt_ids: Option<PathBuf>,
    /// Tokens to decode per prompt. Default 32.
    pub decode_tokens: usize,
    /// Repetitions (medians are reported). Default 3.
    pub runs: usize,
    /// Streams decoded together for the batch measurement. Default 8.
    pub batch: usize,
    /// Threads of the decode matmul. Default `None`: all cores.
    pub threads: Option<usize>,
    /// Compiled context length S. Default 512.
    pub seq_len: usize,
    /// Kernel of the prefills' projections. Default `Auto` (the worker's).
    pub prefill_projections: PrefillProjections,
    /// Print a last line with the report as one JSON object. Default off.
    pub json: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            model: None,
            prompt_tokens: vec![32, 197, 470],
            prompt_ids: None,
            decode_tokens: 32,
            runs: 3,
            batch: 8,
            threads: None,
            seq_len: 512,
            prefill_projections: PrefillProjections::Auto,
            json: false,
        }
    }
}

/// Errors of the benchmark.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The engine failed.
    #[error("engine")]
    Engine(#[from] EngineError),
    /// A file could not be read.
    #[error("reading {path}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The prompt file is not a JSON array of token-id arrays.
    #[error("parsing {path}")]
    Json {
        /// The file.
        path: PathBuf,
        /// The parser's error.
        #[source]
        source: serde_json::Error,
    },
    /// Bad flags.
    #[error("{0}")]
    Args(String),
    /// A generation stream failed.
    #[error("generation failed: {0}")]
    Stream(String),
}

/// Timings of one prompt.
#[derive(Debug, Clone, Serialize)]
pub struct PromptReport {
    /// Prompt length.
    pub prompt_tokens: usize,
    /// Median prefill wall time, ms.
    pub prefill_ms: f64,
    /// Median decode time per token after the first, ms.
    pub decode_ms_per_token: f64,
    /// Tokens decoded per run.
    pub decode_tokens: usize,
    /// The greedy tokens (for comparisons).
    pub token_ids: Vec<u32>,
}

/// Result of a run (also the `--json` line).
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Model file.
    pub model: String,
    /// Compute threads (candle's pool size).
    pub threads: usize,
    /// Repetitions.
    pub runs: usize,
    /// Per prompt.
    pub prompts: Vec<PromptReport>,
    /// Streams in the batch measurement.
    pub batch: usize,
    /// Aggregate decode tokens/s of one stream alone.
    pub batch1_tok_s: f64,
    /// Aggregate decode tokens/s of `batch` streams together.
    pub batch_tok_s: f64,
    /// `batch_tok_s / batch1_tok_s`.
    pub batch_over_batch1_tok_s: f64,
}

pub(crate) fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return f64::NAN;
    }
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

pub(crate) const TEXT: &str = "The history of computing is a story of people, machines and ideas. Early mechanical \
    calculators gave way to electronic computers in the middle of the twentieth century, and the \
    invention of the transistor and the integrated circuit made them smaller, faster and cheaper every \
    year. Programming languages grew from machine code to assembly, then to high-level languages that \
    let people describe what they want instead of how the hardware should do it. ";

fn prompts(args: &Options, engine: &CpuEngine) -> Result<Vec<Vec<u32>>, Error> {
    if let Some(path) = &args.prompt_ids {
        let raw = std::fs::read(path).map_err(|source| Error::Io {
            path: path.clone(),
            source,
        })?;
        return serde_json::from_slice(&raw).map_err(|source| Error::Json {
            path: path.clone(),
            source,
        });
    }
    let ids = engine.tokenize(&TEXT.repeat(12))?;
    args.prompt_tokens
        .iter()
        .map(|n| {
            if *n == 0 || *n > ids.len() {
                return Err(Error::Args(format!(
                    "prompt length {n} is not in 1..={}",
                    ids.len()
                )));
            }
            Ok(ids[..*n].to_vec())
        })
        .collect()
}

/// Reads a stream; returns (token ids, time of the first token, time of the end).
async fn drain(
    mut rx: tokio::sync::mpsc::Receiver<GenEvent>,
) -> Result<(Vec<u32>, Instant, Instant), Error> {
    let mut ids = Vec::new();
    let mut first = None;
    while let Some(ev) = rx.recv().await {
        match ev {
            GenEvent::Token { id, .. } => {
                first.get_or_insert_with(Instant::now);
                ids.push(id);
            }
            GenEvent::Done { .. } => break,
            GenEvent::Error(e) => return Err(Error::Stream(e)),
        }
    }
    let end = Instant::now();
    Ok((ids, first.unwrap_or(end), end))
}

/// Runs the benchmark and prints the report (and the JSON line with `--json`).
pub async fn run(args: Options) -> Result<Report, Error> {
    if args.runs == 0 || args.batch == 0 || args.decode_tokens < 2 {
        return Err(Error::Args(
            "--runs and --batch must be ≥ 1 and --decode-tokens ≥ 2".into(),
        ));
    }
    let model = rngd_engine::model_fetch::resolve(args.model.as_deref())?;
    let mut opts = CpuEngineOptions::new(&model);
    opts.batch = args.batch;
    opts.seq_len = args.seq_len;
    opts.threads = args.threads;
    opts.prefill_projections = args.prefill_projections;
    opts.prefix_cache.enabled = false;
    let engine: Arc<CpuEngine> = tokio::task::spawn_blocking(move || CpuEngine::load(opts))
        .await
        .map_err(|e| Error::Stream(e.to_string()))??;
    let prompts = prompts(&args, &engine)?;
    let params = SamplingParams::greedy(args.decode_tokens);
    let mut reports = Vec::new();
    for p in &prompts {
        let mut prefill_ms = Vec::new();
        let mut decode_ms = Vec::new();
        let mut tokens = Vec::new();
        for _ in 0..args.runs {
            let t0 = Instant::now();
            let pre = engine.prefill(p, &params).await?;
            prefill_ms.push(t0.elapsed().as_secs_f64() * 1e3);
            let (ids, first, end) = drain(engine.decode(p, pre, &params).await?).await?;
            if ids.len() >= 2 {
                decode_ms.push((end - first).as_secs_f64() * 1e3 / (ids.len() - 1) as f64);
            }
            tokens = ids;
        }
        let r = PromptReport {
            prompt_tokens: p.len(),
            prefill_ms: median(&mut prefill_ms),
            decode_ms_per_token: median(&mut decode_ms),
            decode_tokens: tokens.len(),
            token_ids: tokens,
        };
        println!(
            "prompt {:>4} tokens: prefill {:>8.1} ms, decode {:>6.2} ms/token ({} tokens), median of {}",
            r.prompt_tokens, r.prefill_ms, r.decode_ms_per_token, r.decode_tokens, args.runs
        );
        reports.push(r);
    }

    // Batch throughput: the same cache decoded by 1 and by `batch` streams.
    let base = prompts
        .first()
        .ok_or_else(|| Error::Args("no prompts".into()))?;
    let pre: Prefilled = engine.prefill(base, &params).await?;
    let mut one = Vec::new();
    let mut many = Vec::new();
    for _ in 0..args.runs {
        for (streams, out) in [(1usize, &mut one), (args.batch, &mut many)] {
            let t0 = Instant::now();
            let mut rxs = Vec::new();
            for _ in 0..streams {
                rxs.push(engine.decode(base, pre.clone(), &params).await?);
            }
            let mut total = 0usize;
            for rx in rxs {
                // The first token comes from the prefill: count decoded tokens only.
                total += drain(rx).await?.0.len().saturating_sub(1);
            }
            out.push(total as f64 / t0.elapsed().as_secs_f64());
        }
    }
    let batch1_tok_s = median(&mut one);
    let batch_tok_s = median(&mut many);
    let report = Report {
        model: model.display().to_string(),
        threads: rngd_engine::cpu::compute_threads(),
        runs: args.runs,
        prompts: reports,
        batch: args.batch,
        batch1_tok_s,
        batch_tok_s,
        batch_over_batch1_tok_s: batch_tok_s / batch1_tok_s,
    };
    println!(
        "decode throughput: 1 stream {:.1} tok/s, {} streams {:.1} tok/s ({:.2}x)",
        report.batch1_tok_s, report.batch, report.batch_tok_s, report.batch_over_batch1_tok_s
    );
    if args.json {
        println!(
            "{}",
            serde_json::to_string(&report).expect("report serializes")
        );
    }
    Ok(report)
}
