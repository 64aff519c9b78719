//! The worker's Prometheus metrics (names from [`rngd_telemetry::names`]):
//! its own `rngd_pd_worker_*` families and vLLM's `vllm:*` model-server
//! families with vLLM's `model_name` label (the gauges the endpoint pickers
//! scrape, the latency histograms and token counters dashboards read).

use std::time::Duration;

use prometheus::{GaugeVec, Histogram, HistogramVec, IntCounter, IntCounterVec, Registry};
use rngd_engine::{Engine, IterationObserver};
use rngd_telemetry::{MS_BUCKETS, TelemetryError, names};

/// Tokens/s buckets for decode speed.
const TPS_BUCKETS: &[f64] = &[
    1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 50.0, 75.0, 100.0, 200.0, 500.0, 1000.0, 5000.0,
];

/// Token-count buckets of the per-request token histograms.
const TOKEN_BUCKETS: &[f64] = &[
    1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0, 10000.0, 20000.0,
    50000.0, 100000.0,
];

/// vLLM's buckets of `vllm:iteration_tokens_total`.
const ITERATION_BUCKETS: &[f64] = &[
    1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0,
];

/// vLLM's label of the model-server families.
const MODEL: &[&str] = &["model_name"];

/// The `finished_reason` values, each present from the model's load on.
const FINISHED_REASONS: [&str; 3] = ["stop", "length", "abort"];

/// One finished (or aborted) request, as the `vllm:*` request families
/// record it.
#[derive(Debug, Clone, Copy)]
pub struct Finished<'a> {
    /// The served model (`model_name`).
    pub model: &'a str,
    /// Arrival to first token, if one came.
    pub ttft: Option<Duration>,
    /// Arrival to the end.
    pub e2e: Duration,
    /// Waiting before the first engine phase.
    pub queue: Duration,
    /// The phase that produced the first token (a prefill computed here, or
    /// the KV load of a remote prefill).
    pub prefill: Duration,
    /// From the end of that phase to the last token.
    pub decode: Duration,
    /// Mean time per output token after the first (two tokens or more).
    pub tpot: Option<Duration>,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Tokens generated.
    pub generated: usize,
    /// `stop`, `length` or `abort` (the client went away, the drain cut it,
    /// or the engine failed).
    pub reason: &'a str,
    /// The request's `max_tokens` (its one sequence's bound).
    pub max_tokens: usize,
    /// Prompt tokens read from this worker's prefix cache.
    pub cached_tokens: usize,
    /// Prompt tokens whose KV was loaded from a prefill worker.
    pub loaded_tokens: usize,
}

/// `n`: one sequence per request.
const N_BUCKETS: &[f64] = &[1.0, 2.0, 5.0, 10.0, 20.0];

/// Every metric a worker exports, in its own registry.
#[derive(Debug, Clone)]
pub struct WorkerMetrics {
    registry: Registry,
    waiting: GaugeVec,
    running: GaugeVec,
    kv_usage: GaugeVec,
    ttft: HistogramVec,
    e2e: HistogramVec,
    prompt_tokens: IntCounterVec,
    generation_tokens: IntCounterVec,
    success: IntCounterVec,
    itl: HistogramVec,
    tpot_legacy: HistogramVec,
    request_tpot: HistogramVec,
    queue_time: HistogramVec,
    prefill_time: HistogramVec,
    decode_time: HistogramVec,
    inference_time: HistogramVec,
    request_prompt_tokens: HistogramVec,
    request_generation_tokens: HistogramVec,
    params_max_tokens: HistogramVec,
    params_n: HistogramVec,
    max_num_generation_tokens: HistogramVec,
    prefill_kv_computed: HistogramVec,
    prompt_tokens_cached: IntCounterVec,
    external_queries: IntCounterVec,
    external_hits: IntCounterVec,
    preemptions: IntCounterVec,
    iteration_tokens: HistogramVec,
    prefix_queries: IntCounterVec,
    prefix_hits: IntCounterVec,
    cache_config: GaugeVec,
    weight_info: GaugeVec,
    tokenizer_info: GaugeVec,
    variant_info: GaugeVec,
    device_info: GaugeVec,
    flops_per_token: GaugeVec,
    /// PD decodes refused because other weights made the KV.
    pub weight_version_refusals: IntCounter,
    /// PD decodes refused because their KV could not be loaded, by `reason`.
    pub kv_load_failures: IntCounterVec,
    /// Orchestrated requests recomputed here after a KV load failure.
    pub kv_recomputes: IntCounter,
    /// Prompts served from a front door's ids (`tokenized_prompt`).
    pub prompt_ids_reused: IntCounter,
    /// Prompts whose door ids came under another tokenizer digest.
    pub tokenizer_mismatches: IntCounter,
    /// Orchestrated requests prefilled here after the peer refused them for
    /// their length.
    pub prefill_context_fallbacks: IntCounter,
    /// KV handoffs by `path` (`in_place`, `push`).
    pub kv_handoffs: IntCounterVec,
    /// Stranded KV bytes by `transport` ([`WorkerMetrics::set_kv_stranded`]).
    kv_stranded: GaugeVec,
    /// KV push time, seconds.
    pub kv_save_seconds: Histogram,
    /// KV pull time, seconds.
    pub kv_load_seconds: Histogram,
    /// Prefill compute time, seconds.
    pub prefill_seconds: Histogram,
    /// Decode speed per request, tokens/s.
    pub decode_tokens_per_s: Histogram,
    /// Prefills run here (PD prefills and local prefills of whole requests).
    pub prefills: IntCounter,
    /// KV caches loaded from a transport.
    pub kv_loads: IntCounter,
    /// Requests by HTTP status.
    pub requests: IntCounterVec,
    /// Requests refused with 429 because every engine slot was taken.
    pub overload_rejections: IntCounter,
    /// Requests holding an engine slot now.
    pub in_flight: prometheus::Gauge,
    /// Requests the admin API refused, by `reason`.
    pub admin_refusals: IntCounterVec,
}

impl WorkerMetrics {
    /// Creates and registers the metrics in a fresh registry.
    pub fn new() -> Result<Self, TelemetryError> {
        let r = rngd_telemetry::registry()?;
        Ok(WorkerMetrics {
            waiting: rngd_telemetry::gauge_vec(
                &r,
                names::VLLM_NUM_REQUESTS_WAITING,
                "Requests waiting for a decode slot",
                MODEL,
            )?,
            running: rngd_telemetry::gauge_vec(
                &r,
                names::VLLM_NUM_REQUESTS_RUNNING,
                "Requests running",
                MODEL,
            )?,
            kv_usage: rngd_telemetry::gauge_vec(
                &r,
                names::VLLM_KV_CACHE_USAGE_PERC,
                "KV cache usage, 0..1",
                MODEL,
            )?,
            ttft: rngd_telemetry::histogram_vec(
                &r,
                names::VLLM_TIME_TO_FIRST_TOKEN_SECONDS,
                "Time to first token, seconds",
                MODEL,
                &rngd_telemetry::seconds_buckets(MS_BUCKETS, 1e3),
            )?,
            e2e: rngd_telemetry::histogram_vec(
                &r,
                names::VLLM_E2E_REQUEST_LATENCY_SECONDS,
                "Arrival to last token, seconds",
                MODEL,
                &rngd_telemetry::seconds_buckets(MS_BUCKETS, 1e3),
            )?,
            prompt_tokens: rngd_telemetry::counter_vec(
                &r,
                names::VLLM_PROMPT_TOKENS_TOTAL,
                "Prompt tokens of finished requests",
                MODEL,
            )?,
            generation_tokens: rngd_telemetry::counter_vec(
                &r,
                names::VLLM_GENERATION_TOKENS_TOTAL,
                "Generated tokens of finished requests",
                MODEL,
            )?,
            success: rngd_telemetry::counter_vec(
                &r,
                names::VLLM_REQUEST_SUCCESS_TOTAL,
                "Finished requests by finish reason",
                &["model_name", "finished_reason"],
            )?,
            itl: seconds_histogram(
                &r,
                names::VLLM_INTER_TOKEN_LATENCY_SECONDS,
                "Gap between two tokens of one stream, seconds",
            )?,
            tpot_legacy: seconds_histogram(
                &r,
                names::VLLM_TIME_PER_OUTPUT_TOKEN_SECONDS,
                "Gap between two tokens of one stream, seconds (older name of vllm:inter_token_latency_seconds)",
            )?,
            request_tpot: seconds_histogram(
                &r,
                names::VLLM_REQUEST_TIME_PER_OUTPUT_TOKEN_SECONDS,
                "A request's mean time per output token after the first, seconds",
            )?,
            queue_time: seconds_histogram(
                &r,
                names::VLLM_REQUEST_QUEUE_TIME_SECONDS,
                "Time a request waited before its first engine phase, seconds",
            )?,
            prefill_time: seconds_histogram(
                &r,
                names::VLLM_REQUEST_PREFILL_TIME_SECONDS,
                "A request's prefill phase (computed here, or its KV loaded), seconds",
            )?,
            decode_time: seconds_histogram(
                &r,
                names::VLLM_REQUEST_DECODE_TIME_SECONDS,
                "A request's decode phase, seconds",
            )?,
            inference_time: seconds_histogram(
                &r,
                names::VLLM_REQUEST_INFERENCE_TIME_SECONDS,
                "A request's prefill and decode phases, seconds",
            )?,
            request_prompt_tokens: rngd_telemetry::histogram_vec(
                &r,
                names::VLLM_REQUEST_PROMPT_TOKENS,
                "Prompt tokens per request",
                MODEL,
                TOKEN_BUCKETS,
            )?,
            request_generation_tokens: rngd_telemetry::histogram_vec(
                &r,
                names::VLLM_REQUEST_GENERATION_TOKENS,
                "Generated tokens per request",
                MODEL,
                TOKEN_BUCKETS,
            )?,
            params_max_tokens: rngd_telemetry::histogram_vec(
                &r,
                names::VLLM_REQUEST_PARAMS_MAX_TOKENS,
                "The max_tokens of each request",
                MODEL,
                TOKEN_BUCKETS,
            )?,
            params_n: rngd_telemetry::histogram_vec(
                &r,
                names::VLLM_REQUEST_PARAMS_N,
                "The n of each request (one sequence)",
                MODEL,
                N_BUCKETS,
            )?,
            max_num_generation_tokens: rngd_telemetry::histogram_vec(
                &r,
                names::VLLM_REQUEST_MAX_NUM_GENERATION_TOKENS,
                "The most tokens each request may generate",
                MODEL,
                TOKEN_BUCKETS,
            )?,
            prefill_kv_computed: rngd_telemetry::histogram_vec(
                &r,
                names::VLLM_REQUEST_PREFILL_KV_COMPUTED_TOKENS,
                "Prompt tokens whose KV each request's prefill computed here",
                MODEL,
                TOKEN_BUCKETS,
            )?,
            prompt_tokens_cached: rngd_telemetry::counter_vec(
                &r,
                names::VLLM_PROMPT_TOKENS_CACHED_TOTAL,
                "Prompt tokens whose KV was not computed here (prefix cache or a prefill worker)",
                MODEL,
            )?,
            external_queries: rngd_telemetry::counter_vec(
                &r,
                names::VLLM_EXTERNAL_PREFIX_CACHE_QUERIES_TOTAL,
                "Prompt tokens of requests whose KV was loaded from a prefill worker",
                MODEL,
            )?,
            external_hits: rngd_telemetry::counter_vec(
                &r,
                names::VLLM_EXTERNAL_PREFIX_CACHE_HITS_TOTAL,
                "Prompt tokens whose KV was loaded from a prefill worker",
                MODEL,
            )?,
            preemptions: rngd_telemetry::counter_vec(
                &r,
                names::VLLM_NUM_PREEMPTIONS_TOTAL,
                "Preemptions (the CPU engine never preempts a running request)",
                MODEL,
            )?,
            iteration_tokens: rngd_telemetry::histogram_vec(
                &r,
                names::VLLM_ITERATION_TOKENS_TOTAL,
                "Tokens each engine iteration computed (prompt tokens prefilled plus one per decoding stream)",
                MODEL,
                ITERATION_BUCKETS,
            )?,
            prefix_queries: rngd_telemetry::counter_vec(
                &r,
                names::VLLM_PREFIX_CACHE_QUERIES_TOTAL,
                "Prompt tokens looked up in the prefix cache",
                MODEL,
            )?,
            prefix_hits: rngd_telemetry::counter_vec(
                &r,
                names::VLLM_PREFIX_CACHE_HITS_TOTAL,
                "Prompt tokens found in the prefix cache (not computed)",
                MODEL,
            )?,
            cache_config: rngd_telemetry::gauge_vec(
                &r,
                names::VLLM_CACHE_CONFIG_INFO,
                "Cache configuration: positions per block, blocks the prefix cache holds",
                &["model_name", "block_size", "num_gpu_blocks"],
            )?,
            weight_info: rngd_telemetry::gauge_vec(
                &r,
                names::WORKER_WEIGHT_INFO,
                "The weights served: model_name and weight_version",
                &["model_name", "weight_version"],
            )?,
            tokenizer_info: rngd_telemetry::gauge_vec(
                &r,
                names::WORKER_TOKENIZER_INFO,
                "The tokenizer and chat template served: model_name and their digest",
                &["model_name", "digest"],
            )?,
            variant_info: rngd_telemetry::gauge_vec(
                &r,
                names::WORKER_VARIANT_INFO,
                "The compiled variant served: model_name, seq_len and max_batch",
                &["model_name", "seq_len", "max_batch"],
            )?,
            device_info: rngd_telemetry::gauge_vec(
                &r,
                names::WORKER_DEVICE_INFO,
                "The device served on: role, backend, vendor and device",
                &["role", "backend", "vendor", "device"],
            )?,
            flops_per_token: rngd_telemetry::gauge_vec(
                &r,
                names::WORKER_MODEL_FLOPS_PER_TOKEN,
                "Model FLOPs per token: 2 x the weights each token is multiplied by (attention left out)",
                MODEL,
            )?,
            weight_version_refusals: rngd_telemetry::counter(
                &r,
                names::WORKER_WEIGHT_VERSION_REFUSALS_TOTAL,
                "PD decodes refused because another weight_version computed the KV",
            )?,
            kv_load_failures: rngd_telemetry::counter_vec(
                &r,
                names::WORKER_KV_LOAD_FAILURES_TOTAL,
                "PD decodes refused with 410 kv_unavailable, nothing waited for or pulled (reason: expired, not_found)",
                &["reason"],
            )?,
            kv_recomputes: rngd_telemetry::counter(
                &r,
                names::WORKER_KV_RECOMPUTES_TOTAL,
                "x-prefiller-host-port requests served whole here because their KV could not be loaded (--kv-load-failure-policy recompute)",
            )?,
            prompt_ids_reused: rngd_telemetry::counter(
                &r,
                names::WORKER_PROMPT_IDS_REUSED_TOTAL,
                "Prompts served from a front door's token ids (tokenized_prompt under this worker's tokenizer digest)",
            )?,
            tokenizer_mismatches: rngd_telemetry::counter(
                &r,
                names::WORKER_TOKENIZER_MISMATCH_TOTAL,
                "Prompts whose front door's token ids came under another tokenizer digest (ignored; the text was tokenized here)",
            )?,
            prefill_context_fallbacks: rngd_telemetry::counter(
                &r,
                names::WORKER_PREFILL_CONTEXT_FALLBACKS_TOTAL,
                "Orchestrated requests the prefill peer refused for their length, prefilled here",
            )?,
            kv_handoffs: rngd_telemetry::counter_vec(
                &r,
                names::WORKER_KV_HANDOFFS_TOTAL,
                "KV handoffs of prefills for a remote decode, by path: in_place (written into the transport's room) or push",
                &["path"],
            )?,
            kv_stranded: rngd_telemetry::gauge_vec(
                &r,
                names::WORKER_KV_STRANDED_BYTES,
                "KV bytes a transport holds that no decode claimed (pulled or released) within the claim window, by transport; freed by the TTL",
                &["transport"],
            )?,
            kv_save_seconds: rngd_telemetry::histogram(
                &r,
                names::WORKER_KV_SAVE_SECONDS,
                "KV push on the prefill side, seconds",
                &rngd_telemetry::seconds_buckets(MS_BUCKETS, 1e3),
            )?,
            kv_load_seconds: rngd_telemetry::histogram(
                &r,
                names::WORKER_KV_LOAD_SECONDS,
                "KV pull on the decode side, seconds",
                &rngd_telemetry::seconds_buckets(MS_BUCKETS, 1e3),
            )?,
            prefill_seconds: rngd_telemetry::histogram(
                &r,
                names::WORKER_PREFILL_SECONDS,
                "Prefill compute, seconds",
                &rngd_telemetry::seconds_buckets(MS_BUCKETS, 1e3),
            )?,
            decode_tokens_per_s: rngd_telemetry::histogram(
                &r,
                names::WORKER_DECODE_TOKENS_PER_SECOND,
                "Decode speed per request, tokens/s",
                TPS_BUCKETS,
            )?,
            prefills: rngd_telemetry::counter(&r, names::WORKER_PREFILLS_TOTAL, "Prefills run")?,
            kv_loads: rngd_telemetry::counter(
                &r,
                names::WORKER_KV_LOADS_TOTAL,
                "KV caches loaded from a transport",
            )?,
            requests: rngd_telemetry::counter_vec(
                &r,
                names::WORKER_REQUESTS_TOTAL,
                "Requests by HTTP status",
                &["status"],
            )?,
            overload_rejections: rngd_telemetry::counter(
                &r,
                names::WORKER_OVERLOAD_REJECTIONS_TOTAL,
                "Requests refused with 429: every engine slot (--max-in-flight) was taken",
            )?,
            in_flight: rngd_telemetry::gauge(
                &r,
                names::WORKER_IN_FLIGHT,
                "Requests holding an engine slot (queued or running in the engine)",
            )?,
            admin_refusals: rngd_telemetry::counter_vec(
                &r,
                names::WORKER_ADMIN_REFUSALS_TOTAL,
                "Requests the worker admin API refused (unauthorized, throttled)",
                &["reason"],
            )?,
            registry: r,
        }
        .with_zeroes())
    }

    /// Shows the labelled families whose values are known up front at 0.
    fn with_zeroes(self) -> Self {
        for path in ["in_place", "push"] {
            self.kv_handoffs.with_label_values(&[path]);
        }
        self
    }

    /// Sets the stranded KV bytes of `transport` (on each scrape, from the
    /// transport's last sweep).
    pub fn set_kv_stranded(&self, transport: &str, bytes: u64) {
        self.kv_stranded
            .with_label_values(&[transport])
            .set(bytes as f64);
    }

    /// Records a finished (or aborted) request in the `vllm:*` request
    /// families.
    pub fn finished(&self, f: &Finished<'_>) {
        let m = [f.model];
        if let Some(t) = f.ttft {
            self.ttft.with_label_values(&m).observe(t.as_secs_f64());
        }
        if let Some(t) = f.tpot {
            self.request_tpot
                .with_label_values(&m)
                .observe(t.as_secs_f64());
        }
        self.e2e.with_label_values(&m).observe(f.e2e.as_secs_f64());
        for (h, d) in [
            (&self.queue_time, f.queue),
            (&self.prefill_time, f.prefill),
            (&self.decode_time, f.decode),
            (&self.inference_time, f.prefill + f.decode),
        ] {
            h.with_label_values(&m).observe(d.as_secs_f64());
        }
        self.request_prompt_tokens
            .with_label_values(&m)
            .observe(f.prompt_tokens as f64);
        self.request_generation_tokens
            .with_label_values(&m)
            .observe(f.generated as f64);
        self.success.with_label_values(&[f.model, f.reason]).inc();
        for (h, v) in [
            (&self.params_max_tokens, f.max_tokens),
            (&self.max_num_generation_tokens, f.max_tokens),
            (&self.params_n, 1),
            (
                &self.prefill_kv_computed,
                f.prompt_tokens
                    .saturating_sub(f.cached_tokens + f.loaded_tokens),
            ),
        ] {
            h.with_label_values(&m).observe(v as f64);
        }
        let not_computed = (f.cached_tokens + f.loaded_tokens).min(f.prompt_tokens);
        // The external-cache pair counts only requests that loaded KV.
        let (queried, hit) = if f.loaded_tokens > 0 {
            (f.prompt_tokens, f.loaded_tokens)
        } else {
            (0, 0)
        };
        for (c, v) in [
            (&self.prompt_tokens, f.prompt_tokens),
            (&self.generation_tokens, f.generated),
            (&self.prompt_tokens_cached, not_computed),
            (&self.external_queries, queried),
            (&self.external_hits, hit),
        ] {
            c.with_label_values(&m).inc_by(v as u64);
        }
    }

    /// Records the gap between two tokens of one stream of `model`.
    pub fn token_gap(&self, model: &str, gap: Duration) {
        let m = [model];
        self.itl.with_label_values(&m).observe(gap.as_secs_f64());
        self.tpot_legacy
            .with_label_values(&m)
            .observe(gap.as_secs_f64());
    }

    /// The observer the engine of `model` reports its iterations to.
    pub fn iteration_observer(&self, model: &str) -> std::sync::Arc<dyn IterationObserver> {
        std::sync::Arc::new(Iterations(
            self.iteration_tokens.with_label_values(&[model]),
        ))
    }

    /// Every `vllm:*` series of `model` at zero until it has a value, so a
    /// dashboard, an HPA or a scraper finds each family from the model's
    /// load on, on every role.
    fn present(&self, model: &str) {
        let m = [model];
        for h in [
            &self.ttft,
            &self.e2e,
            &self.itl,
            &self.tpot_legacy,
            &self.request_tpot,
            &self.queue_time,
            &self.prefill_time,
            &self.decode_time,
            &self.inference_time,
            &self.request_prompt_tokens,
            &self.request_generation_tokens,
            &self.iteration_tokens,
            &self.params_max_tokens,
            &self.params_n,
            &self.max_num_generation_tokens,
            &self.prefill_kv_computed,
        ] {
            h.with_label_values(&m);
        }
        for c in [
            &self.prompt_tokens,
            &self.generation_tokens,
            &self.preemptions,
            &self.prompt_tokens_cached,
            &self.external_queries,
            &self.external_hits,
        ] {
            c.with_label_values(&m);
        }
        for r in FINISHED_REASONS {
            self.success.with_label_values(&[model, r]);
        }
    }

    /// Records the device this worker serves on
    /// ([`names::WORKER_DEVICE_INFO`]): one series, set once at launch.
    pub fn set_device(&self, role: &str, backend: &str, vendor: &str, device: &str) {
        self.device_info.reset();
        self.device_info
            .with_label_values(&[role, backend, vendor, device])
            .set(1.0);
    }

    /// Refreshes the engine gauges (if an engine is loaded; before that the
    /// `vllm:*` families have no sample, so a scraper does not take the
    /// worker for a model server yet; after, every one has its series) and
    /// renders the text format.
    pub fn render(&self, engine: Option<&dyn Engine>) -> String {
        if let Some(e) = engine {
            let m = [e.info().name.as_str()];
            self.present(m[0]);
            self.waiting.with_label_values(&m).set(e.waiting() as f64);
            self.running.with_label_values(&m).set(e.running() as f64);
            self.kv_usage.with_label_values(&m).set(e.kv_usage());
            // One series: the weights serving now.
            let version = e.info().weight_version.as_str();
            if self
                .weight_info
                .get_metric_with_label_values(&[m[0], version])
                .map_or(true, |g| g.get() != 1.0)
            {
                self.weight_info.reset();
                self.weight_info
                    .with_label_values(&[m[0], version])
                    .set(1.0);
            }
            if let Some(digest) = e.tokenizer_digest()
                && self
                    .tokenizer_info
                    .get_metric_with_label_values(&[m[0], digest])
                    .map_or(true, |g| g.get() != 1.0)
            {
                self.tokenizer_info.reset();
                self.tokenizer_info
                    .with_label_values(&[m[0], digest])
                    .set(1.0);
            }
            let (s, b) = (
                e.info().seq_len.to_string(),
                e.max_batch().map(|b| b.to_string()).unwrap_or_default(),
            );
            let variant = [m[0], s.as_str(), b.as_str()];
            if self
                .variant_info
                .get_metric_with_label_values(&variant)
                .map_or(true, |g| g.get() != 1.0)
            {
                self.variant_info.reset();
                self.variant_info.with_label_values(&variant).set(1.0);
            }
            if let Some(f) = e.model_flops_per_token() {
                self.flops_per_token.reset();
                self.flops_per_token.with_label_values(&m).set(f as f64);
            }
            if let Some(p) = e.prefix_cache_stats() {
                // The engine counts; the counters follow its totals.
                for (c, total) in [
                    (&self.prefix_queries, p.queries),
                    (&self.prefix_hits, p.hits),
                ] {
                    let c = c.with_label_values(&m);
                    c.inc_by(total.saturating_sub(c.get()));
                }
                let (b, n) = (p.block_size.to_string(), p.capacity_blocks.to_string());
                self.cache_config
                    .with_label_values(&[m[0], b.as_str(), n.as_str()])
                    .set(1.0);
            }
        }
        rngd_telemetry::render(&self.registry)
    }
}

/// A `vllm:*` time histogram with the `model_name` label, seconds.
fn seconds_histogram(r: &Registry, name: &str, help: &str) -> Result<HistogramVec, TelemetryError> {
    rngd_telemetry::histogram_vec(
        r,
        name,
        help,
        MODEL,
        &rngd_telemetry::seconds_buckets(MS_BUCKETS, 1e3),
    )
}

/// `vllm:iteration_tokens_total` of one model, as the engine's observer.
struct Iterations(Histogram);

impl IterationObserver for Iterations {
    fn iteration(&self, tokens: usize) {
        self.0.observe(tokens as f64);
    }
}
