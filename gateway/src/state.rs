//! The gateway's state ([`Gateway`]) and settings ([`GatewayConfig`]): what
//! both the handlers ([`crate::server`]) and the request flow
//! ([`crate::flow`]) read, so neither depends on the other for it.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::http::HeaderMap;
use rngd_api::models::ServedModels;
use rngd_pool::{EndpointSource, Picker, PromptCounter};

use crate::error::GatewayError;
use crate::metrics::GatewayMetrics;

/// Gateway settings.
#[derive(Debug, Clone)]
pub struct GatewayConfig {
    /// Model names accepted besides the tokenizer's: the extra
    /// `--served-model-name` values, else the model file's stem
    /// ([`rngd_api::models::aliases`], as the workers derive them).
    pub model_aliases: Vec<String>,
    /// The model file's name, shown as `root` in `/v1/models`; `None`: the
    /// tokenizer's file when it has one ([`crate::launch`] sets it).
    pub model_root: Option<String>,
    /// The API key every route but the probes and metrics wants
    /// (`--api-key`), also sent to the workers (they serve under the same
    /// key); `None`: open.
    pub api_key: Option<rngd_http_edge::api_key::ApiKey>,
    /// Compiled context length the workers run with (for `/v1/models` and the
    /// default `max_tokens` of a chat).
    pub seq_len: u32,
    /// Largest request body accepted, bytes.
    pub body_limit: usize,
    /// Time allowed for the prefill call (whole response).
    pub prefill_timeout: Duration,
    /// Time allowed for the decode call: to its response headers when
    /// streaming, to the whole response otherwise.
    pub decode_timeout: Duration,
    /// Longest gap between two chunks of a streamed decode.
    pub stream_idle_timeout: Duration,
    /// How many times one answer may move to another decode-capable worker
    /// when its worker dies or its stream breaks (`--migration-limit`,
    /// Dynamo's name; 0 = never): a stream continues with the prompt plus
    /// the tokens already streamed, a whole answer is asked again.
    pub migration_limit: u32,
    /// What a handoff whose decode worker cannot load the KV (the lease
    /// over, the KV gone or taken: a 410 from the
    /// worker, nothing pulled) becomes (`--kv-load-failure-policy`, vLLM's
    /// name): `recompute` serves the request whole on that worker with the
    /// prefill's seed (the same tokens), `fail` answers the refusal.
    pub kv_load_failure_policy: rngd_api::pd::KvLoadFailurePolicy,
    /// TCP connect timeout towards workers.
    pub connect_timeout: Duration,
    /// Requests served at once (policy call to the end of the response).
    pub max_concurrent: usize,
    /// Requests that may wait for a slot beyond those; more are a 429.
    pub max_queued: usize,
    /// Longest wait for a slot; then a 429.
    pub queue_timeout: Duration,
    /// Time a client has to send its whole body; then a 408.
    pub body_timeout: Duration,
    /// The limits of the gateway's listeners (header and idle timeouts,
    /// connection cap, in-flight body bytes; `docs/gateway.md`, "Listener
    /// limits").
    pub edge: rngd_http_edge::Options,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        GatewayConfig {
            model_aliases: Vec::new(),
            model_root: None,
            api_key: None,
            seq_len: 512,
            body_limit: 1 << 20,
            prefill_timeout: Duration::from_secs(120),
            decode_timeout: Duration::from_secs(600),
            stream_idle_timeout: Duration::from_secs(60),
            migration_limit: DEFAULT_MIGRATION_LIMIT,
            kv_load_failure_policy: rngd_api::pd::KvLoadFailurePolicy::Recompute,
            connect_timeout: Duration::from_secs(2),
            max_concurrent: 256,
            max_queued: 1024,
            queue_timeout: Duration::from_secs(5),
            body_timeout: Duration::from_secs(30),
            edge: rngd_http_edge::Options::default(),
        }
    }
}

/// Everything a request handler needs.
pub struct Gateway {
    pub(crate) config: GatewayConfig,
    pub(crate) picker: Picker,
    pub(crate) tokenizer: Arc<dyn PromptCounter>,
    pub(crate) served: Arc<ServedModels>,
    pub(crate) client: reqwest::Client,
    /// A client that keeps no idle connection: every call on it opens a
    /// fresh one (the one retry of a call whose pooled connection broke
    /// before any response byte).
    pub(crate) fresh_client: reqwest::Client,
    pub(crate) metrics: Arc<GatewayMetrics>,
    pub(crate) admission: crate::admission::Admission,
    next_id: AtomicU64,
    id_prefix: String,
}

impl std::fmt::Debug for Gateway {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gateway")
            .field("config", &self.config)
            .field("model", &self.tokenizer.model_name())
            .finish_non_exhaustive()
    }
}

/// Default of [`GatewayConfig::migration_limit`].
pub const DEFAULT_MIGRATION_LIMIT: u32 = 3;

/// How long an idle pooled connection to a worker is kept: 1 s less than
/// the workers' idle keep-alive timeout
/// ([`rngd_http_edge::DEFAULT_IDLE_TIMEOUT`], 5 s).
pub const UPSTREAM_POOL_IDLE: Duration =
    rngd_http_edge::DEFAULT_IDLE_TIMEOUT.saturating_sub(Duration::from_secs(1));

impl Gateway {
    /// Builds the gateway state over a picker (the pool's endpoint source and
    /// policy) and the prompt counter.
    pub fn new(
        config: GatewayConfig,
        picker: Picker,
        tokenizer: Arc<dyn PromptCounter>,
    ) -> Result<Arc<Self>, GatewayError> {
        let mut upstream_headers = reqwest::header::HeaderMap::new();
        if let Some(k) = &config.api_key {
            upstream_headers.insert(reqwest::header::AUTHORIZATION, k.authorization());
        }
        let builder = || {
            reqwest::Client::builder()
                .default_headers(upstream_headers.clone())
                .connect_timeout(config.connect_timeout)
                .tcp_nodelay(true)
        };
        let client = builder()
            // A pooled connection is dropped before the worker's own idle
            // timer closes it: a request is never written into a connection
            // the worker is closing.
            .pool_idle_timeout(UPSTREAM_POOL_IDLE)
            .build()
            .map_err(GatewayError::Client)?;
        let fresh_client = builder()
            .pool_max_idle_per_host(0)
            .build()
            .map_err(GatewayError::Client)?;
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let metrics = Arc::new(GatewayMetrics::new()?);
        let admission = crate::admission::Admission::new(
            config.max_concurrent,
            config.max_queued,
            config.queue_timeout,
            metrics.registry(),
        )?;
        let served = Arc::new(ServedModels::new(
            tokenizer.model_name(),
            config.model_aliases.clone(),
        ));
        Ok(Arc::new(Gateway {
            config,
            picker,
            tokenizer,
            served,
            client,
            fresh_client,
            metrics,
            admission,
            next_id: AtomicU64::new(0),
            id_prefix: format!("{:x}", (nanos as u64) ^ u64::from(std::process::id())),
        }))
    }

    /// The pick (its endpoints, policy and the requests it holds in flight).
    pub fn picker(&self) -> &Picker {
        &self.picker
    }

    /// The metrics (for the KPI listener and extra registrations).
    pub fn metrics(&self) -> &Arc<GatewayMetrics> {
        &self.metrics
    }

    /// The endpoint source the picker routes over.
    pub fn endpoints(&self) -> &Arc<dyn EndpointSource> {
        self.picker.endpoints()
    }

    /// The served model name.
    pub fn model_name(&self) -> &str {
        self.tokenizer.model_name()
    }

    pub(crate) fn request_id(&self, headers: &HeaderMap) -> String {
        if let Some(v) = headers
            .get(rngd_api::headers::REQUEST_ID)
            .and_then(|v| v.to_str().ok())
            .and_then(rngd_api::rules::sanitize_request_id)
        {
            return v;
        }
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        format!("{}-{n}", self.id_prefix)
    }

    /// The names this gateway serves the model under.
    pub fn served(&self) -> &ServedModels {
        &self.served
    }
}
