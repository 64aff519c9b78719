//! The per-request outcomes and the summary maths: percentiles, the SLO
//! share, goodput and throughput.

use std::time::Duration;

use serde::Serialize;

/// How one request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// 2xx and a complete stream (`[DONE]`).
    Ok,
    /// Answered 429.
    Http429,
    /// Answered 5xx (the status).
    Http5xx(u16),
    /// Answered another non-2xx status.
    HttpOther(u16),
    /// An error object inside a 2xx stream (a generation failing mid-stream).
    StreamError,
    /// The per-request deadline passed first.
    Timeout,
    /// Connecting, sending or reading failed, or the stream ended without `[DONE]`.
    Transport,
}

/// What was measured of one request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Outcome {
    /// How it ended.
    pub status: Status,
    /// Send to the first content chunk (`None` without one).
    pub ttft: Option<Duration>,
    /// First to last content chunk (`None` without content).
    pub decode: Option<Duration>,
    /// The longest gap between two consecutive content chunks (`None` with
    /// fewer than two): the worst stall the stream saw, which a per-request
    /// mean (TPOT) spreads over its tokens.
    pub max_gap: Option<Duration>,
    /// Output tokens: the stream's `usage.completion_tokens`, else the
    /// content chunks counted.
    pub tokens: u64,
    /// Whether the stream carried a `usage` object.
    pub usage_seen: bool,
    /// The stream's `usage.prompt_tokens` (the server's count of the prompt).
    pub prompt_tokens: Option<u64>,
    /// The stream's `usage.prompt_tokens_details.cached_tokens` (prompt
    /// tokens the server took from its prefix cache).
    pub cached_tokens: Option<u64>,
}

impl Outcome {
    /// An outcome with no timings (an error before any content).
    pub fn failed(status: Status) -> Self {
        Outcome {
            status,
            ttft: None,
            decode: None,
            max_gap: None,
            tokens: 0,
            usage_seen: false,
            prompt_tokens: None,
            cached_tokens: None,
        }
    }

    /// Time per output token after the first: (last - first) / (tokens - 1);
    /// `None` with fewer than two tokens.
    pub fn tpot(&self) -> Option<Duration> {
        match (self.decode, self.tokens) {
            (Some(d), n) if n >= 2 => Some(d / (n - 1).min(u64::from(u32::MAX)) as u32),
            _ => None,
        }
    }
}

/// The `p`-th percentile (0 < p ≤ 100) by nearest rank: the smallest value
/// with at least `p`% of the values at or below it. `None` for no values.
pub fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

/// p50, p90 and p99 of some values (any order), milliseconds in, milliseconds out.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Percentiles {
    /// Median.
    pub p50: Option<f64>,
    /// 90th percentile.
    pub p90: Option<f64>,
    /// 99th percentile.
    pub p99: Option<f64>,
}

impl Percentiles {
    /// Of `values` (sorted here).
    pub fn of(mut values: Vec<f64>) -> Self {
        values.sort_by(f64::total_cmp);
        Percentiles {
            p50: percentile(&values, 50.0),
            p90: percentile(&values, 90.0),
            p99: percentile(&values, 99.0),
        }
    }
}

/// The summary of a run's outcomes.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Summary {
    /// Requests sent (every outcome).
    pub requests: u64,
    /// Requests that ended [`Status::Ok`].
    pub ok: u64,
    /// Requests that did not (the sum of the error counts below).
    pub errors: u64,
    /// Answered 429.
    pub http_429: u64,
    /// Answered 5xx.
    pub http_5xx: u64,
    /// Answered another non-2xx status.
    pub http_other: u64,
    /// An error inside a 2xx stream.
    pub stream_errors: u64,
    /// Past the per-request deadline.
    pub timeouts: u64,
    /// Connection-level failures.
    pub transport: u64,
    /// Successful requests whose stream carried no `usage` (tokens counted from chunks).
    pub usage_missing: u64,
    /// TTFT of successful requests, ms.
    pub ttft_ms: Percentiles,
    /// TPOT of successful requests with at least two tokens, ms.
    pub tpot_ms: Percentiles,
    /// The longest inter-chunk gap of each successful request with at least
    /// two content chunks, ms.
    pub max_gap_ms: Percentiles,
    /// Successful requests meeting the TPOT SLO (TPOT ≤ the SLO; a request
    /// of one token has no TPOT and meets it) and the TTFT SLO when one is
    /// given ([`summarize_with`]).
    pub slo_met: u64,
    /// `slo_met / ok` (`None` without successes).
    pub slo_share: Option<f64>,
    /// Output tokens of successful requests.
    pub output_tokens: u64,
    /// Prompt tokens of successful requests as the server counted them (`usage.prompt_tokens`).
    pub prompt_tokens_usage: u64,
    /// Of those, the tokens the server reported cached
    /// (`usage.prompt_tokens_details.cached_tokens`, 0 where absent).
    pub cached_tokens_usage: u64,
    /// Successful requests whose usage carried `cached_tokens`.
    pub cached_tokens_seen: u64,
    /// `slo_met` per second of `wall`.
    pub goodput_rps: f64,
    /// `output_tokens` per second of `wall`.
    pub tok_s: f64,
}

/// Summarizes `outcomes` over `wall` seconds of wall time with the TPOT SLO `slo`.
pub fn summarize(outcomes: &[Outcome], wall: Duration, slo: Duration) -> Summary {
    summarize_with(outcomes, wall, slo, None)
}

/// [`summarize`] with a TTFT SLO as well: a request meets the SLO when its
/// TPOT is within `slo` and, with `slo_ttft`, its TTFT within that.
pub fn summarize_with(
    outcomes: &[Outcome],
    wall: Duration,
    slo: Duration,
    slo_ttft: Option<Duration>,
) -> Summary {
    let mut s = Summary {
        requests: outcomes.len() as u64,
        ..Summary::default()
    };
    let (mut ttft, mut tpot, mut gaps) = (Vec::new(), Vec::new(), Vec::new());
    for o in outcomes {
        match o.status {
            Status::Ok => {
                s.ok += 1;
                s.output_tokens += o.tokens;
                s.prompt_tokens_usage += o.prompt_tokens.unwrap_or(0);
                if let Some(c) = o.cached_tokens {
                    s.cached_tokens_usage += c;
                    s.cached_tokens_seen += 1;
                }
                if !o.usage_seen {
                    s.usage_missing += 1;
                }
                if let Some(t) = o.ttft {
                    ttft.push(ms(t));
                }
                if let Some(g) = o.max_gap {
                    gaps.push(ms(g));
                }
                let ttft_met = slo_ttft.is_none_or(|b| o.ttft.is_some_and(|t| t <= b));
                let tpot_met = match o.tpot() {
                    Some(t) => {
                        tpot.push(ms(t));
                        t <= slo
                    }
                    None => true,
                };
                if ttft_met && tpot_met {
                    s.slo_met += 1;
                }
            }
            Status::Http429 => s.http_429 += 1,
            Status::Http5xx(_) => s.http_5xx += 1,
            Status::HttpOther(_) => s.http_other += 1,
            Status::StreamError => s.stream_errors += 1,
            Status::Timeout => s.timeouts += 1,
            Status::Transport => s.transport += 1,
        }
    }
    s.errors = s.requests - s.ok;
    s.ttft_ms = Percentiles::of(ttft);
    s.tpot_ms = Percentiles::of(tpot);
    s.max_gap_ms = Percentiles::of(gaps);
    s.slo_share = (s.ok > 0).then(|| s.slo_met as f64 / s.ok as f64);
    let secs = wall.as_secs_f64();
    if secs > 0.0 {
        s.goodput_rps = s.slo_met as f64 / secs;
        s.tok_s = s.output_tokens as f64 / secs;
    }
    s
}

/// The requests of one kind of route (the router's reason): how many, and
/// their latencies.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct RouteStats {
    /// Requests sent that the router routed so.
    pub requests: u64,
    /// Of those, the ones that completed.
    pub ok: u64,
    /// TTFT p50 of those, ms.
    pub ttft_p50_ms: Option<f64>,
    /// TTFT p90, ms.
    pub ttft_p90_ms: Option<f64>,
    /// TPOT p50 (requests of two tokens or more), ms.
    pub tpot_p50_ms: Option<f64>,
    /// TPOT p90, ms.
    pub tpot_p90_ms: Option<f64>,
    /// p99 of each request's longest gap between two content chunks, ms.
    pub max_gap_p99_ms: Option<f64>,
}

impl RouteStats {
    /// The figures of `s`, the summary of one route's requests.
    pub fn of(s: &Summary) -> RouteStats {
        RouteStats {
            requests: s.requests,
            ok: s.ok,
            ttft_p50_ms: s.ttft_ms.p50,
            ttft_p90_ms: s.ttft_ms.p90,
            tpot_p50_ms: s.tpot_ms.p50,
            tpot_p90_ms: s.tpot_ms.p90,
            max_gap_p99_ms: s.max_gap_ms.p99,
        }
    }
}

/// A duration in milliseconds.
pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}
