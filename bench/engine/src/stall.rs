//! `rngd-pd-bench chunked`: how long a long prefill stalls the decode
//! streams running beside it, per per-iteration token budget
//! (`--max-num-batched-tokens`), against unchunked prefill in the same run.
//!
//! For each budget (`off` = unchunked) an engine is loaded with `--running`
//! decode slots; that many greedy streams start on a short prompt and run
//! to the end of the context. Once they run, `--prefills` prefills of a
//! `--prompt-tokens` prompt are made one after the other. Reported per
//! budget: the prefill's wall time (the TTFT of a request prefilled on a
//! busy decode worker), the longest gap between two tokens of any running
//! stream that overlaps a prefill (the stall), the time per output token
//! (p50, p99) over the window of the prefills, and the same TPOT before the
//! first prefill (quiet decode). Ratios are against the unchunked engine,
//! measured in the same run.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rngd_engine::cpu::{CpuEngine, CpuEngineOptions};
use rngd_engine::{Engine, GenEvent, SamplingParams};
use serde::Serialize;

use crate::{Error, TEXT, median};

/// What to run (the flags of `rngd-pd-bench chunked`).
#[derive(Debug, Clone)]
pub struct StallOptions {
    /// GGUF model. Default `None`: `$RNGD_PD_MODEL`, else the cached default model.
    pub model: Option<PathBuf>,
    /// Budgets to measure; `None` = unchunked (always measured, first, as
    /// the baseline). Default off, 64, 128, 256.
    pub budgets: Vec<Option<usize>>,
    /// Decode streams running during the prefills. Default 4.
    pub running: usize,
    /// Tokens of the long prompt. Default 470.
    pub prompt_tokens: usize,
    /// Long prefills per budget (medians are reported). Default 5.
    pub prefills: usize,
    /// Compiled context length S. Default 512.
    pub seq_len: usize,
    /// Threads of the decode matmul. Default `None`: all cores.
    pub threads: Option<usize>,
    /// Print a last line with the report as one JSON object. Default off.
    pub json: bool,
}

impl Default for StallOptions {
    fn default() -> Self {
        StallOptions {
            model: None,
            budgets: vec![None, Some(64), Some(128), Some(256)],
            running: 4,
            prompt_tokens: 470,
            prefills: 5,
            seq_len: 512,
            threads: None,
            json: false,
        }
    }
}

/// One budget's figures.
#[derive(Debug, Clone, Serialize)]
pub struct BudgetReport {
    /// The per-iteration budget; `None` = unchunked.
    pub max_num_batched_tokens: Option<usize>,
    /// Median prefill wall time of the long prompt, ms.
    pub prefill_ms: f64,
    /// Median over prefills of the longest token gap of a running stream
    /// overlapping the prefill, ms.
    pub stall_ms: f64,
    /// Time per output token of the running streams during the prefills, ms.
    pub tpot_p50_ms: f64,
    /// Its 99th percentile, ms.
    pub tpot_p99_ms: f64,
    /// Time per output token before the first prefill (decode alone), ms.
    pub quiet_tpot_p50_ms: f64,
    /// `prefill_ms` over the unchunked engine's.
    pub prefill_ratio: f64,
    /// `stall_ms` over the unchunked engine's.
    pub stall_ratio: f64,
    /// `tpot_p99_ms / tpot_p50_ms`.
    pub tpot_p99_over_p50: f64,
}

/// The report (also the `--json` line).
#[derive(Debug, Clone, Serialize)]
pub struct StallReport {
    /// Model file.
    pub model: String,
    /// Decode streams running.
    pub running: usize,
    /// Tokens of the long prompt.
    pub prompt_tokens: usize,
    /// Prefills per budget.
    pub prefills: usize,
    /// Per budget, unchunked first.
    pub budgets: Vec<BudgetReport>,
}

/// The `q` quantile (nearest rank) of `v`.
fn quantile(v: &mut [f64], q: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return f64::NAN;
    }
    let i = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1;
    v[i]
}

/// Runs the benchmark and prints the report (and the JSON line with `--json`).
pub async fn run(args: StallOptions) -> Result<StallReport, Error> {
    if args.running == 0 || args.prefills == 0 || args.prompt_tokens == 0 {
        return Err(Error::Args(
            "--running, --prefills and --prompt-tokens must be ≥ 1".into(),
        ));
    }
    let model = rngd_engine::model_fetch::resolve(args.model.as_deref())?;
    let mut budgets = vec![None];
    budgets.extend(args.budgets.iter().copied().filter(Option::is_some));
    let mut out: Vec<BudgetReport> = Vec::new();
    for budget in budgets {
        let mut r = one(&args, &model, budget).await?;
        if let Some(base) = out.first() {
            r.prefill_ratio = r.prefill_ms / base.prefill_ms;
            r.stall_ratio = r.stall_ms / base.stall_ms;
        }
        let name = budget.map_or("off".to_string(), |b| b.to_string());
        println!(
            "budget {name:>4}: prefill {:>7.1} ms ({:.2}×), stall {:>6.1} ms ({:.2}×), TPOT p50 {:>5.1} ms p99 {:>6.1} ms (quiet p50 {:.1} ms)",
            r.prefill_ms,
            r.prefill_ratio,
            r.stall_ms,
            r.stall_ratio,
            r.tpot_p50_ms,
            r.tpot_p99_ms,
            r.quiet_tpot_p50_ms
        );
        out.push(r);
    }
    let report = StallReport {
        model: model.display().to_string(),
        running: args.running,
        prompt_tokens: args.prompt_tokens,
        prefills: args.prefills,
        budgets: out,
    };
    if args.json {
        println!(
            "{}",
            serde_json::to_string(&report).map_err(|e| Error::Stream(e.to_string()))?
        );
    }
    Ok(report)
}

/// One engine with this budget.
async fn one(
    args: &StallOptions,
    model: &std::path::Path,
    budget: Option<usize>,
) -> Result<BudgetReport, Error> {
    let mut opts = CpuEngineOptions::new(model);
    opts.batch = args.running;
    opts.seq_len = args.seq_len;
    opts.threads = args.threads;
    opts.max_num_batched_tokens = budget;
    // Every long prefill computes its whole prompt.
    opts.prefix_cache.enabled = false;
    let engine: Arc<CpuEngine> = tokio::task::spawn_blocking(move || CpuEngine::load(opts))
        .await
        .map_err(|e| Error::Stream(e.to_string()))??;
    let text = engine.tokenize(&TEXT.repeat(12))?;
    if args.prompt_tokens >= args.seq_len || args.prompt_tokens > text.len() {
        return Err(Error::Args(format!(
            "--prompt-tokens {} is not below S = {} (and at most {})",
            args.prompt_tokens,
            args.seq_len,
            text.len()
        )));
    }
    let long = text[..args.prompt_tokens].to_vec();
    let short = text[..16.min(text.len())].to_vec();
    let params = SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(args.seq_len - short.len())
    };
    // The running streams, each token's arrival time recorded.
    let mut tasks = Vec::new();
    for _ in 0..args.running {
        let mut rx = engine.generate(&short, &params).await?;
        tasks.push(tokio::spawn(async move {
            let mut times = Vec::new();
            while let Some(ev) = rx.recv().await {
                match ev {
                    GenEvent::Token { .. } => times.push(Instant::now()),
                    GenEvent::Done { .. } => break,
                    GenEvent::Error(e) => return Err(Error::Stream(e)),
                }
            }
            Ok(times)
        }));
    }
    // Quiet decode first, then the prefills a few steps apart.
    let quiet_from = Instant::now();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let quiet_to = Instant::now();
    let one_token = SamplingParams::greedy(1);
    let mut windows = Vec::new();
    let mut prefill_ms = Vec::new();
    for _ in 0..args.prefills {
        let t0 = Instant::now();
        engine.prefill(&long, &one_token).await?;
        let t1 = Instant::now();
        prefill_ms.push((t1 - t0).as_secs_f64() * 1e3);
        windows.push((t0, t1));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let end = Instant::now();
    // Dropping the engine's last reference ends the streams (Stopped).
    drop(engine);
    let mut streams = Vec::new();
    for t in tasks {
        let times = t.await.map_err(|e| Error::Stream(e.to_string()))?;
        streams.push(times.unwrap_or_default());
    }
    let gaps: Vec<(Instant, Instant)> = streams
        .iter()
        .flat_map(|t| t.windows(2).map(|w| (w[0], w[1])))
        .collect();
    let ms = |(a, b): &(Instant, Instant)| (*b - *a).as_secs_f64() * 1e3;
    let mut quiet: Vec<f64> = gaps
        .iter()
        .filter(|(a, b)| *a >= quiet_from && *b <= quiet_to)
        .map(ms)
        .collect();
    let first = windows.first().map_or(end, |w| w.0);
    let mut busy: Vec<f64> = gaps
        .iter()
        .filter(|(a, b)| *b >= first && *a <= end)
        .map(ms)
        .collect();
    let mut stalls: Vec<f64> = windows
        .iter()
        .map(|(t0, t1)| {
            gaps.iter()
                .filter(|(a, b)| b >= t0 && a <= t1)
                .map(ms)
                .fold(0.0, f64::max)
        })
        .collect();
    if busy.is_empty() {
        return Err(Error::Stream(
            "the running streams ended before the prefills (raise --seq-len)".into(),
        ));
    }
    let (p50, p99) = (quantile(&mut busy, 0.5), quantile(&mut busy, 0.99));
    Ok(BudgetReport {
        max_num_batched_tokens: budget,
        prefill_ms: median(&mut prefill_ms),
        stall_ms: median(&mut stalls),
        tpot_p50_ms: p50,
        tpot_p99_ms: p99,
        quiet_tpot_p50_ms: quantile(&mut quiet, 0.5),
        prefill_ratio: 1.0,
        stall_ratio: 1.0,
        tpot_p99_over_p50: p99 / p50,
    })
}

#[cfg(test)]
mod tests {
    use super::quantile;

    #[test]
    fn quantiles_are_nearest_rank() {
        let mut v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(quantile(&mut v, 0.5), 50.0);
        assert_eq!(quantile(&mut v, 0.99), 99.0);
        assert_eq!(quantile(&mut [3.0], 0.99), 3.0);
        assert!(quantile(&mut [], 0.5).is_nan());
    }
}
