//! Gateway metrics.
//!
//! - The main `/metrics`: histograms of TTFT, TPOT, KV transfer (label
//!   `kv_transport`) and policy decision time, in seconds, and the request
//!   counter by status code.
//! - The KPI endpoint (with `AIRM_METRICS_PORT`): the seed's gauges computed
//!   over the most recent [`KPI_WINDOW`] completed requests.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use prometheus::{Histogram, HistogramVec, IntCounter, IntCounterVec, Registry};
use rngd_telemetry::{MS_BUCKETS, US_BUCKETS, names};

use crate::error::GatewayError;

/// Requests the KPI gauges are computed over.
pub const KPI_WINDOW: usize = 512;

/// One completed request, as the KPIs see it.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestSample {
    /// Time to first token.
    pub ttft: Option<Duration>,
    /// Mean time per output token after the first.
    pub tpot: Option<Duration>,
    /// Tokens generated.
    pub completion_tokens: u64,
    /// When the request arrived.
    pub started: Instant,
    /// When it finished.
    pub finished: Instant,
    /// KV transport used, when the prefill was remote.
    pub kv_transport: Option<String>,
    /// KV transfer time (save + load), when known.
    pub kv_transfer: Option<Duration>,
}

/// The gateway's metrics.
pub struct GatewayMetrics {
    registry: Registry,
    ttft: Histogram,
    tpot: Histogram,
    kv_transfer: HistogramVec,
    policy_decision: Histogram,
    requests: IntCounterVec,
    prefill_context_fallbacks: IntCounter,
    upstream_retries: IntCounterVec,
    migrations: IntCounterVec,
    kv_load_failures: IntCounterVec,
    window: Mutex<VecDeque<RequestSample>>,
}

impl std::fmt::Debug for GatewayMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GatewayMetrics").finish_non_exhaustive()
    }
}

impl GatewayMetrics {
    /// Creates and registers every metric in a fresh registry.
    pub fn new() -> Result<Self, GatewayError> {
        let registry = rngd_telemetry::registry()?;
        let ms = rngd_telemetry::seconds_buckets(MS_BUCKETS, 1e3);
        let us = rngd_telemetry::seconds_buckets(US_BUCKETS, 1e6);
        let ttft = rngd_telemetry::histogram(
            &registry,
            names::GATEWAY_TTFT_SECONDS,
            "Time to first token as seen by the gateway, seconds.",
            &ms,
        )?;
        let tpot = rngd_telemetry::histogram(
            &registry,
            names::GATEWAY_TPOT_SECONDS,
            "Mean time per output token after the first, seconds.",
            &ms,
        )?;
        let kv_transfer = rngd_telemetry::histogram_vec(
            &registry,
            names::GATEWAY_KV_TRANSFER_SECONDS,
            "KV cache transfer (prefill save + decode load), seconds.",
            &["kv_transport"],
            &ms,
        )?;
        let policy_decision = rngd_telemetry::histogram(
            &registry,
            names::GATEWAY_POLICY_DECISION_SECONDS,
            "Routing policy decision time, seconds.",
            &us,
        )?;
        let requests = rngd_telemetry::counter_vec(
            &registry,
            names::GATEWAY_REQUESTS_TOTAL,
            "Requests answered, by HTTP status code.",
            &["code"],
        )?;
        let prefill_context_fallbacks = rngd_telemetry::counter(
            &registry,
            names::GATEWAY_PREFILL_CONTEXT_FALLBACKS_TOTAL,
            "PD routes whose prefill worker refused the prompt as too long; the decode worker prefilled it.",
        )?;
        let upstream_retries = rngd_telemetry::counter_vec(
            &registry,
            names::GATEWAY_UPSTREAM_RETRIES_TOTAL,
            "Worker calls that failed before any response byte and were sent again once on a fresh connection, by stage.",
            &["stage"],
        )?;
        let migrations = rngd_telemetry::counter_vec(
            &registry,
            names::GATEWAY_MIGRATIONS_TOTAL,
            "Answers moved to another decode worker after theirs died or their stream broke, by outcome.",
            &["outcome"],
        )?;
        let kv_load_failures = rngd_telemetry::counter_vec(
            &registry,
            names::GATEWAY_KV_LOAD_FAILURES_TOTAL,
            "Handoffs whose decode worker could not load the KV (nothing pulled), by the policy applied: recompute or fail.",
            &["policy"],
        )?;
        Ok(GatewayMetrics {
            registry,
            prefill_context_fallbacks,
            upstream_retries,
            migrations,
            kv_load_failures,
            ttft,
            tpot,
            kv_transfer,
            policy_decision,
            requests,
            window: Mutex::new(VecDeque::with_capacity(KPI_WINDOW)),
        })
    }

    /// The registry behind the main `/metrics` (others may register into it).
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// Counts a response by status code.
    pub fn count_response(&self, code: u16) {
        self.requests.with_label_values(&[&code.to_string()]).inc();
    }

    /// Counts a prefill refused for its length and served by the decode worker.
    pub fn count_prefill_context_fallback(&self) {
        self.prefill_context_fallbacks.inc();
    }

    /// Counts an answer moved (`continued`) or not (`failed`).
    pub fn count_migration(&self, outcome: &str) {
        self.migrations.with_label_values(&[outcome]).inc();
    }

    /// Counts a handoff whose decode worker could not load the KV, by the
    /// policy applied (`recompute`, `fail`).
    pub fn count_kv_load_failure(&self, policy: &str) {
        self.kv_load_failures.with_label_values(&[policy]).inc();
    }

    /// Counts a worker call sent again on a fresh connection.
    pub fn count_upstream_retry(&self, stage: &str) {
        self.upstream_retries.with_label_values(&[stage]).inc();
    }

    /// Records one policy decision.
    pub fn observe_policy(&self, took: Duration) {
        self.policy_decision.observe(took.as_secs_f64());
    }

    /// Records one completed request.
    pub fn observe_request(&self, s: RequestSample) {
        if let Some(t) = s.ttft {
            self.ttft.observe(t.as_secs_f64());
        }
        if let Some(t) = s.tpot {
            self.tpot.observe(t.as_secs_f64());
        }
        if let (Some(tr), Some(t)) = (&s.kv_transport, s.kv_transfer) {
            self.kv_transfer
                .with_label_values(&[tr.as_str()])
                .observe(t.as_secs_f64());
        }
        let mut w = self.window.lock().unwrap_or_else(|e| e.into_inner());
        if w.len() == KPI_WINDOW {
            w.pop_front();
        }
        w.push_back(s);
    }

    /// The main `/metrics` text.
    pub fn render(&self) -> String {
        rngd_telemetry::render(&self.registry)
    }

    /// The KPIs over the window.
    pub fn kpis(&self) -> Kpis {
        let w = self.window.lock().unwrap_or_else(|e| e.into_inner());
        Kpis::over(w.iter())
    }

    /// The KPI endpoint's `/metrics` text.
    pub fn render_kpis(&self) -> String {
        self.kpis().render()
    }
}

/// The seed's KPIs over a window of requests.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Kpis {
    /// Requests in the window.
    pub requests: usize,
    /// p90 TTFT, ms (0 with no data).
    pub ttft_p90_ms: f64,
    /// p90 TPOT, ms (0 with no data).
    pub tpot_p90_ms: f64,
    /// Output tokens per second: tokens generated in the window over the wall
    /// time from the first request's arrival to the last one's end.
    pub tok_s: f64,
    /// Mean KV transfer ms by transport.
    pub kv_transfer_ms: BTreeMap<String, f64>,
}

/// Nearest-rank percentile of unsorted values (0 when empty).
pub fn percentile(values: &mut [f64], p: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    values.sort_by(|a, b| a.total_cmp(b));
    let rank = ((p / 100.0) * values.len() as f64).ceil() as usize;
    values[rank.clamp(1, values.len()) - 1]
}

impl Kpis {
    /// Computes the KPIs of `samples`.
    pub fn over<'a>(samples: impl Iterator<Item = &'a RequestSample>) -> Kpis {
        let mut ttft = Vec::new();
        let mut tpot = Vec::new();
        let mut tokens = 0u64;
        let mut first: Option<Instant> = None;
        let mut last: Option<Instant> = None;
        let mut kv: BTreeMap<String, (f64, usize)> = BTreeMap::new();
        let mut n = 0;
        for s in samples {
            n += 1;
            if let Some(t) = s.ttft {
                ttft.push(t.as_secs_f64() * 1e3);
            }
            if let Some(t) = s.tpot {
                tpot.push(t.as_secs_f64() * 1e3);
            }
            tokens += s.completion_tokens;
            first = Some(first.map_or(s.started, |f| f.min(s.started)));
            last = Some(last.map_or(s.finished, |l| l.max(s.finished)));
            if let (Some(tr), Some(t)) = (&s.kv_transport, s.kv_transfer) {
                let e = kv.entry(tr.clone()).or_default();
                e.0 += t.as_secs_f64() * 1e3;
                e.1 += 1;
            }
        }
        let span = match (first, last) {
            (Some(f), Some(l)) => l.saturating_duration_since(f).as_secs_f64(),
            _ => 0.0,
        };
        Kpis {
            requests: n,
            ttft_p90_ms: percentile(&mut ttft, 90.0),
            tpot_p90_ms: percentile(&mut tpot, 90.0),
            tok_s: if span > 0.0 {
                tokens as f64 / span
            } else {
                0.0
            },
            kv_transfer_ms: kv
                .into_iter()
                .map(|(k, (sum, c))| (k, sum / c as f64))
                .collect(),
        }
    }

    /// Prometheus text exposition of the KPI gauges.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let mut gauge = |name: &str, help: &str, samples: &[(Option<&str>, f64)]| {
            out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} gauge\n"));
            for (label, v) in samples {
                match label {
                    Some(tr) => out.push_str(&format!(
                        "{name}{{kv_transport=\"{}\"}} {v}\n",
                        escape_label(tr)
                    )),
                    None => out.push_str(&format!("{name} {v}\n")),
                }
            }
        };
        let window = format!("over the most recent {KPI_WINDOW} requests");
        gauge(
            names::AIRM_TTFT_P90_MS,
            &format!("p90 time to first token, ms, {window}."),
            &[(None, self.ttft_p90_ms)],
        );
        gauge(
            names::AIRM_TPOT_P90_MS,
            &format!("p90 time per output token, ms, {window}."),
            &[(None, self.tpot_p90_ms)],
        );
        gauge(
            names::AIRM_TOK_S,
            &format!("Output tokens per second, {window}."),
            &[(None, self.tok_s)],
        );
        let kv: Vec<(Option<&str>, f64)> = self
            .kv_transfer_ms
            .iter()
            .map(|(k, v)| (Some(k.as_str()), *v))
            .collect();
        gauge(
            names::AIRM_KV_TRANSFER_MS,
            &format!("Mean KV transfer time, ms, by transport, {window}."),
            &kv,
        );
        out
    }
}

fn escape_label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(ttft_ms: u64, tokens: u64, tr: Option<&str>, kv_ms: u64) -> RequestSample {
        let started = Instant::now();
        RequestSample {
            ttft: Some(Duration::from_millis(ttft_ms)),
            tpot: Some(Duration::from_millis(ttft_ms / 10)),
            completion_tokens: tokens,
            started,
            finished: started + Duration::from_secs(1),
            kv_transport: tr.map(str::to_string),
            kv_transfer: Some(Duration::from_millis(kv_ms)),
        }
    }

    #[test]
    fn percentiles() {
        let mut v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&mut v, 90.0), 90.0);
        assert_eq!(percentile(&mut [5.0], 90.0), 5.0);
        assert_eq!(percentile(&mut [], 90.0), 0.0);
    }

    #[test]
    fn window_keeps_the_most_recent_512() {
        let m = GatewayMetrics::new().unwrap();
        for i in 0..600 {
            m.observe_request(sample(i, 1, Some("shm"), 2));
        }
        let k = m.kpis();
        assert_eq!(k.requests, KPI_WINDOW);
        // The oldest 88 samples (ttft 0..87 ms) left the window.
        assert_eq!(k.ttft_p90_ms, 88.0 + (0.9f64 * 512.0).ceil() - 1.0);
        assert_eq!(k.kv_transfer_ms["shm"], 2.0);
        assert!(k.tok_s > 0.0);
    }

    #[test]
    fn kpi_text_has_every_gauge() {
        let m = GatewayMetrics::new().unwrap();
        m.observe_request(sample(100, 10, Some("tcp"), 7));
        m.observe_request(sample(50, 10, None, 0));
        let text = m.render_kpis();
        for n in [
            names::AIRM_TTFT_P90_MS,
            names::AIRM_TPOT_P90_MS,
            names::AIRM_TOK_S,
        ] {
            assert!(text.contains(&format!("\n{n} ")), "{n} missing:\n{text}");
        }
        assert!(
            text.contains("airm_kv_transfer_ms{kv_transport=\"tcp\"} 7"),
            "{text}"
        );
        // 20 tokens over the ~1 s the two requests span.
        let tok_s: f64 = text
            .lines()
            .find_map(|l| l.strip_prefix("airm_tok_s "))
            .and_then(|v| v.parse().ok())
            .unwrap();
        assert!((19.0..=20.0).contains(&tok_s), "{text}");
    }
}
