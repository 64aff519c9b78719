//! Prometheus metrics of the endpoint picker (names from `rngd_telemetry::names`):
//! its own `rngd_pd_epp_*` families, and the reference endpoint picker's
//! `inference_objective_*` (per request) and `inference_pool_*` (from the
//! endpoint snapshot, refreshed at every scrape of `/metrics`) families with
//! the reference's labels (`docs/epp.md`, "Metrics").
//!
//! Label values come only from closed sets: a request's `model_name` is one
//! of the served model names ([`EppMetrics::set_models`]: the tokenizer's
//! model name and the configured ones) or [`OTHER_MODEL`]; a client's model
//! string never creates a series.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use prometheus::{Gauge, GaugeVec, Histogram, HistogramVec, IntCounter, IntCounterVec, Registry};
use rngd_pool::EndpointSource;
use rngd_pool::admission::{AdmissionMetrics, AdmissionNames};
use rngd_telemetry::names;

use crate::ExtProcError;

/// The labels of the one plugin a pick runs: the wasm routing policy (with
/// the prefix-index lookup that feeds it), at GIE's picker extension point.
const POLICY_PLUGIN: [&str; 3] = ["Picker", "wasm-policy", "policy"];

/// The `commit` label of `inference_extension_info`: `RNGD_PD_COMMIT` at
/// build time, or `unknown` (release builds set it; a plain `cargo build`
/// does not).
const BUILD_COMMIT: &str = match option_env!("RNGD_PD_COMMIT") {
    Some(c) => c,
    None => "unknown",
};

/// Pool name of the `inference_pool_*` families when none is configured.
pub const DEFAULT_POOL_NAME: &str = "rngd-pd";

/// The `model_name` label of every request whose model is not a served one.
pub const OTHER_MODEL: &str = "other";

/// Byte-size buckets (64 B … 64 MiB) of the request and response size histograms.
const SIZE_BUCKETS: &[f64] = &[
    64.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0, 262144.0, 1048576.0, 4194304.0, 16777216.0,
    67108864.0,
];

/// Token-count buckets (1 … 128k) of the token histograms.
const TOKEN_BUCKETS: &[f64] = &[
    1.0, 8.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 32768.0, 131072.0,
];

/// The endpoint source the pool gauges are read from, and the pool's name.
#[derive(Default)]
struct PoolWatch(Option<(String, Arc<dyn EndpointSource>)>);

impl std::fmt::Debug for PoolWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("PoolWatch")
            .field(&self.0.as_ref().map(|(n, _)| n))
            .finish()
    }
}

/// The picker's metrics, registered in their own registry (served on the metrics port).
#[derive(Clone, Debug)]
pub struct EppMetrics {
    /// The registry the metrics live in.
    pub registry: Registry,
    /// Picks by result (`route`, `reject_<status>`).
    pub picks: IntCounterVec,
    /// Pick latency (body complete → decision), seconds.
    pub pick_seconds: Histogram,
    /// Failed `/metrics` scrapes.
    pub scrape_failures: IntCounter,
    /// `inference_objective_request_total`.
    pub objective_requests: IntCounterVec,
    /// `inference_objective_request_error_total`.
    pub objective_errors: IntCounterVec,
    /// `inference_objective_request_duration_seconds`.
    pub objective_duration: HistogramVec,
    /// `inference_objective_request_sizes`.
    pub objective_request_sizes: HistogramVec,
    /// `inference_objective_response_sizes`.
    pub objective_response_sizes: HistogramVec,
    /// `inference_objective_input_tokens`.
    pub objective_input_tokens: HistogramVec,
    /// `inference_objective_output_tokens`.
    pub objective_output_tokens: HistogramVec,
    /// `inference_objective_running_requests`.
    pub objective_running: GaugeVec,
    /// `inference_objective_normalized_time_per_output_token_seconds`.
    pub objective_normalized_tpot: HistogramVec,
    /// `inference_extension_scheduler_e2e_duration_seconds`: the pick.
    pub scheduler_e2e: Histogram,
    /// `inference_extension_plugin_duration_seconds`: the policy step (the
    /// prefix-index lookup and the wasm policy's decision).
    pub plugin_duration: HistogramVec,
    pool_kv: GaugeVec,
    pool_queue: GaugeVec,
    pool_per_pod_queue: GaugeVec,
    pool_ready: GaugeVec,
    pool: Arc<Mutex<PoolWatch>>,
    /// The picker's admission metrics (`rngd_pd_epp_in_flight`, `_queued`,
    /// `_overload_rejections_total`, `_body_bytes_in_flight`).
    pub admission: AdmissionMetrics,
    /// The model names that label a series of their own.
    models: Arc<RwLock<BTreeSet<String>>>,
}

/// What the response path reports about one routed request.
#[derive(Debug, Clone, Default)]
pub struct Answered {
    /// Response body bytes seen.
    pub response_bytes: u64,
    /// `usage.completion_tokens` of the answer, if it carried one.
    pub output_tokens: Option<u64>,
}

impl EppMetrics {
    /// Creates the metrics in a fresh registry.
    pub fn new() -> Result<Self, ExtProcError> {
        let err = |source| ExtProcError::Metrics { source };
        let registry = rngd_telemetry::registry().map_err(err)?;
        let r = &registry;
        let model = &["model_name", "target_model_name"];
        let hist = |name: &str, help: &str, buckets: &[f64]| {
            rngd_telemetry::histogram_vec(r, name, help, model, buckets).map_err(err)
        };
        let pool_gauge = |name: &str, help: &str| {
            rngd_telemetry::gauge_vec(r, name, help, &["name"]).map_err(err)
        };
        EppMetrics {
            picks: rngd_telemetry::counter_vec(
                r,
                names::EPP_PICKS_TOTAL,
                "Endpoint picks by result",
                &["result"],
            )
            .map_err(err)?,
            pick_seconds: rngd_telemetry::histogram(
                r,
                names::EPP_PICK_SECONDS,
                "Endpoint pick latency (body complete to decision), seconds",
                &rngd_telemetry::seconds_buckets(rngd_telemetry::US_BUCKETS, 1e6),
            )
            .map_err(err)?,
            scrape_failures: rngd_telemetry::counter(
                r,
                names::EPP_SCRAPE_FAILURES_TOTAL,
                "Failed endpoint /metrics scrapes",
            )
            .map_err(err)?,
            objective_requests: rngd_telemetry::counter_vec(
                r,
                names::GIE_OBJECTIVE_REQUEST_TOTAL,
                "Requests per model",
                model,
            )
            .map_err(err)?,
            objective_errors: rngd_telemetry::counter_vec(
                r,
                names::GIE_OBJECTIVE_REQUEST_ERROR_TOTAL,
                "Refused or failed requests per model",
                &["model_name", "target_model_name", "error_code"],
            )
            .map_err(err)?,
            objective_duration: hist(
                names::GIE_OBJECTIVE_REQUEST_DURATION_SECONDS,
                "Request to end of response, seconds",
                &rngd_telemetry::seconds_buckets(rngd_telemetry::MS_BUCKETS, 1e3),
            )?,
            objective_request_sizes: hist(
                names::GIE_OBJECTIVE_REQUEST_SIZES,
                "Request body size, bytes",
                SIZE_BUCKETS,
            )?,
            objective_response_sizes: hist(
                names::GIE_OBJECTIVE_RESPONSE_SIZES,
                "Response body size, bytes",
                SIZE_BUCKETS,
            )?,
            objective_input_tokens: hist(
                names::GIE_OBJECTIVE_INPUT_TOKENS,
                "Prompt tokens",
                TOKEN_BUCKETS,
            )?,
            objective_output_tokens: hist(
                names::GIE_OBJECTIVE_OUTPUT_TOKENS,
                "Generated tokens",
                TOKEN_BUCKETS,
            )?,
            objective_running: rngd_telemetry::gauge_vec(
                r,
                names::GIE_OBJECTIVE_RUNNING_REQUESTS,
                "Requests routed and not yet answered",
                &["model_name"],
            )
            .map_err(err)?,
            objective_normalized_tpot: hist(
                names::GIE_OBJECTIVE_NORMALIZED_TPOT_SECONDS,
                "Request duration over generated tokens, seconds",
                &rngd_telemetry::seconds_buckets(rngd_telemetry::MS_BUCKETS, 1e3),
            )?,
            scheduler_e2e: rngd_telemetry::histogram(
                r,
                names::GIE_SCHEDULER_E2E_DURATION_SECONDS,
                "The whole pick of one request (body complete to decision), seconds",
                &rngd_telemetry::seconds_buckets(rngd_telemetry::US_BUCKETS, 1e6),
            )
            .map_err(err)?,
            plugin_duration: rngd_telemetry::histogram_vec(
                r,
                names::GIE_PLUGIN_DURATION_SECONDS,
                "One plugin's part of a pick, seconds",
                &["extension_point", "plugin_type", "plugin_name"],
                &rngd_telemetry::seconds_buckets(rngd_telemetry::US_BUCKETS, 1e6),
            )
            .map_err(err)?,
            pool_kv: pool_gauge(
                names::GIE_POOL_AVERAGE_KV_CACHE_UTILIZATION,
                "Mean KV cache utilization of the pool's healthy endpoints",
            )?,
            pool_queue: pool_gauge(
                names::GIE_POOL_AVERAGE_QUEUE_SIZE,
                "Mean queue depth of the pool's healthy endpoints",
            )?,
            pool_per_pod_queue: rngd_telemetry::gauge_vec(
                r,
                names::GIE_POOL_PER_POD_QUEUE_SIZE,
                "Queue depth of each endpoint of the pool",
                &["name", "model_server_pod"],
            )
            .map_err(err)?,
            pool_ready: pool_gauge(names::GIE_POOL_READY_PODS, "Healthy endpoints of the pool")?,
            pool: Arc::new(Mutex::new(PoolWatch::default())),
            admission: AdmissionMetrics::register(AdmissionNames::PICKER, r).map_err(err)?,
            models: Arc::new(RwLock::new(BTreeSet::new())),
            registry,
        }
        .with_info()
        .map_err(err)
    }

    /// `inference_extension_info` at 1, and the label-free series present
    /// from the start.
    fn with_info(self) -> Result<Self, rngd_telemetry::TelemetryError> {
        let info = rngd_telemetry::gauge_vec(
            &self.registry,
            names::GIE_INFO,
            "The picker's build: 1",
            &["commit", "build_ref"],
        )?;
        info.with_label_values(&[BUILD_COMMIT, env!("CARGO_PKG_VERSION")])
            .set(1.0);
        self.plugin_duration.with_label_values(&POLICY_PLUGIN);
        Ok(self)
    }

    /// Adds served model names: each labels its own series; every other
    /// model is counted as [`OTHER_MODEL`].
    pub fn set_models<I, S>(&self, names: I)
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let mut m = self.models.write().unwrap_or_else(|e| e.into_inner());
        m.extend(names.into_iter().map(Into::into).filter(|n| !n.is_empty()));
        // Every per-model series of a served model is on the page from the
        // start, at zero.
        for model in m.iter() {
            let l = [model.as_str(), model.as_str()];
            for h in [
                &self.objective_duration,
                &self.objective_request_sizes,
                &self.objective_response_sizes,
                &self.objective_input_tokens,
                &self.objective_output_tokens,
                &self.objective_normalized_tpot,
            ] {
                h.with_label_values(&l);
            }
            self.objective_requests.with_label_values(&l);
            self.objective_running.with_label_values(&[model.as_str()]);
        }
    }

    /// Records the policy step of a pick (`inference_extension_plugin_duration_seconds`).
    pub fn policy_step(&self, took: Duration) {
        self.plugin_duration
            .with_label_values(&POLICY_PLUGIN)
            .observe(took.as_secs_f64());
    }

    /// The `model_name` label of a request for `model`: the name when it is
    /// a served one, else [`OTHER_MODEL`].
    pub fn model_label(&self, model: &str) -> String {
        let m = self.models.read().unwrap_or_else(|e| e.into_inner());
        if m.contains(model) {
            model.to_string()
        } else {
            OTHER_MODEL.to_string()
        }
    }

    /// Reads the `inference_pool_*` gauges from `source` under the pool name `name`.
    pub fn watch_pool(&self, name: &str, source: Arc<dyn EndpointSource>) {
        *self.pool.lock().unwrap_or_else(|e| e.into_inner()) =
            PoolWatch(Some((name.to_string(), source)));
    }

    /// Sets the pool gauges from the current snapshot.
    fn refresh_pool(&self) {
        let watch = self.pool.lock().unwrap_or_else(|e| e.into_inner());
        let Some((name, source)) = &watch.0 else {
            return;
        };
        let snapshot = source.snapshot();
        let healthy: Vec<_> = snapshot.iter().filter(|e| e.healthy).collect();
        let n = healthy.len();
        let mean = |f: &dyn Fn(&rngd_policy_core::Endpoint) -> f64| {
            if n == 0 {
                0.0
            } else {
                healthy.iter().map(|e| f(e)).sum::<f64>() / n as f64
            }
        };
        set(&self.pool_kv, name, mean(&|e| e.kv_usage));
        set(&self.pool_queue, name, mean(&|e| f64::from(e.queue_depth)));
        set(&self.pool_ready, name, n as f64);
        self.pool_per_pod_queue.reset();
        for e in snapshot.iter() {
            self.pool_per_pod_queue
                .with_label_values(&[name, &e.address])
                .set(f64::from(e.queue_depth));
        }
    }

    /// Counts a routed request of `model`: total, size, prompt tokens, running.
    pub fn routed(&self, model: &str, request_bytes: usize, prompt_tokens: Option<usize>) {
        let model = &self.model_label(model);
        let l = [model, model];
        self.objective_requests.with_label_values(&l).inc();
        self.objective_request_sizes
            .with_label_values(&l)
            .observe(request_bytes as f64);
        if let Some(t) = prompt_tokens {
            self.objective_input_tokens
                .with_label_values(&l)
                .observe(t as f64);
        }
        self.objective_running.with_label_values(&[model]).inc();
    }

    /// Counts a refused request of `model` (`error_code`: the HTTP status).
    pub fn refused(&self, model: &str, status: u16) {
        let model = &self.model_label(model);
        let l = [model, model];
        self.objective_requests.with_label_values(&l).inc();
        self.objective_errors
            .with_label_values(&[model, model, &status.to_string()])
            .inc();
    }

    /// Records the end of a routed request of `model` (stream closed).
    pub fn answered(&self, model: &str, took: Duration, a: &Answered) {
        let model = &self.model_label(model);
        let l = [model, model];
        self.objective_running.with_label_values(&[model]).dec();
        self.objective_duration
            .with_label_values(&l)
            .observe(took.as_secs_f64());
        self.objective_response_sizes
            .with_label_values(&l)
            .observe(a.response_bytes as f64);
        if let Some(t) = a.output_tokens {
            self.objective_output_tokens
                .with_label_values(&l)
                .observe(t as f64);
            if t > 0 {
                self.objective_normalized_tpot
                    .with_label_values(&l)
                    .observe(took.as_secs_f64() / t as f64);
            }
        }
    }

    /// The metrics in the Prometheus text format (pool gauges refreshed first).
    pub fn render(&self) -> String {
        self.refresh_pool();
        rngd_telemetry::render(&self.registry)
    }
}

fn set(g: &GaugeVec, name: &str, v: f64) {
    let g: Gauge = g.with_label_values(&[name]);
    g.set(v);
}

/// `usage.completion_tokens` in the tail of a response body (JSON or SSE).
pub fn completion_tokens(tail: &[u8]) -> Option<u64> {
    usage_count(tail, b"\"completion_tokens\":")
}

/// `usage.prompt_tokens_details.cached_tokens` in the tail of a response
/// body (JSON or SSE); `None` when the usage has no such detail.
pub fn cached_tokens(tail: &[u8]) -> Option<u64> {
    usage_count(tail, b"\"cached_tokens\":")
}

/// The number after the last `key` (`"name":`) in `tail`.
fn usage_count(tail: &[u8], key: &[u8]) -> Option<u64> {
    let at = tail.windows(key.len()).rposition(|w| w == key)? + key.len();
    let digits: Vec<u8> = tail[at..]
        .iter()
        .skip_while(|b| **b == b' ')
        .take_while(|b| b.is_ascii_digit())
        .copied()
        .collect();
    std::str::from_utf8(&digits).ok()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use rngd_policy_core::Role;
    use rngd_pool::StaticEndpoints;
    use rngd_pool::source::local_endpoint;

    #[test]
    fn pool_gauges_follow_the_snapshot() {
        let m = EppMetrics::new().unwrap();
        let mut a = local_endpoint("10.0.0.1:8000".into(), Role::Decode, 512, &[]);
        a.queue_depth = 4;
        a.kv_usage = 0.5;
        let mut b = local_endpoint("10.0.0.2:8000".into(), Role::Prefill, 512, &[]);
        b.queue_depth = 2;
        let mut c = local_endpoint("10.0.0.3:8000".into(), Role::Decode, 512, &[]);
        c.healthy = false;
        c.queue_depth = 100;
        let src = StaticEndpoints::new(vec![a, b, c]);
        m.watch_pool("p", src.clone());
        let text = m.render();
        assert!(
            text.contains("inference_pool_ready_pods{name=\"p\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("inference_pool_average_queue_size{name=\"p\"} 3"),
            "{text}"
        );
        assert!(
            text.contains("inference_pool_average_kv_cache_utilization{name=\"p\"} 0.25"),
            "{text}"
        );
        assert!(
            text.contains(
                "inference_pool_per_pod_queue_size{model_server_pod=\"10.0.0.3:8000\",name=\"p\"} 100"
            ),
            "{text}"
        );
        // A pod that leaves the snapshot leaves the per-pod gauge.
        src.set(vec![local_endpoint(
            "10.0.0.9:1".into(),
            Role::Solo,
            512,
            &[],
        )]);
        let text = m.render();
        assert!(!text.contains("10.0.0.3:8000"), "{text}");
        assert!(
            text.contains("inference_pool_ready_pods{name=\"p\"} 1"),
            "{text}"
        );
    }

    #[test]
    fn unknown_models_are_counted_as_other() {
        let m = EppMetrics::new().unwrap();
        m.set_models(["served"]);
        for i in 0..300 {
            let name = format!("random-model-{i}");
            m.refused(&name, 400);
            m.routed(&name, 10, Some(1));
            m.answered(&name, Duration::from_millis(1), &Answered::default());
        }
        m.routed("served", 10, Some(1));
        let text = m.render();
        assert!(!text.contains("random-model"), "{text}");
        assert!(
            text.contains(
                "inference_objective_request_total{model_name=\"other\",target_model_name=\"other\"} 600"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "inference_objective_request_total{model_name=\"served\",target_model_name=\"served\"} 1"
            ),
            "{text}"
        );
        assert!(text.contains("inference_objective_running_requests{model_name=\"other\"} 0"));
    }

    #[test]
    fn objective_families() {
        let m = EppMetrics::new().unwrap();
        m.set_models(["m1"]);
        m.routed("m1", 100, Some(7));
        m.refused("m1", 429);
        m.answered(
            "m1",
            Duration::from_millis(20),
            &Answered {
                response_bytes: 300,
                output_tokens: Some(5),
            },
        );
        let text = m.render();
        for want in [
            "inference_objective_request_total{model_name=\"m1\",target_model_name=\"m1\"} 2",
            "inference_objective_request_error_total{error_code=\"429\",model_name=\"m1\",target_model_name=\"m1\"} 1",
            "inference_objective_input_tokens_sum{model_name=\"m1\",target_model_name=\"m1\"} 7",
            "inference_objective_output_tokens_sum{model_name=\"m1\",target_model_name=\"m1\"} 5",
            "inference_objective_response_sizes_sum{model_name=\"m1\",target_model_name=\"m1\"} 300",
            "inference_objective_running_requests{model_name=\"m1\"} 0",
        ] {
            assert!(text.contains(want), "{want}\n{text}");
        }
    }

    #[test]
    fn usage_is_read_from_the_tail() {
        assert_eq!(
            completion_tokens(
                br#"{"usage":{"prompt_tokens":3,"completion_tokens": 12,"total_tokens":15}}"#
            ),
            Some(12)
        );
        assert_eq!(
            completion_tokens(b"data: {\"usage\":{\"completion_tokens\":4}}\n\ndata: [DONE]\n\n"),
            Some(4)
        );
        assert_eq!(completion_tokens(b"data: [DONE]"), None);
        let tail = br#"data: {"usage":{"prompt_tokens":40,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens": 32}}}"#;
        assert_eq!(cached_tokens(tail), Some(32));
        assert_eq!(cached_tokens(br#"{"usage":{"completion_tokens":2}}"#), None);
    }
}
