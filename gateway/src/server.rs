//! The HTTP surface: state, router, and the handlers that validate a request
//! and hand it to [`crate::flow`].

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use http_body_util::BodyExt;
use rngd_api::openai::{
    ChatCompletionRequest, CompletionRequest, Model, ModelList, Prompt, SamplingFields,
    StreamOptions,
};
use serde::de::DeserializeOwned;

use crate::endpoints::EndpointTable;
use crate::error::{ApiError, GatewayError};
use crate::flow::{self, ApiKind, Prepared};
use crate::metrics::GatewayMetrics;
use crate::policy::Policy;
use crate::tokens::PromptTokenizer;

/// Gateway settings.
#[derive(Debug, Clone)]
pub struct GatewayConfig {
    /// Extra model names accepted besides the tokenizer's (aliases, e.g. the file stem).
    pub model_aliases: Vec<String>,
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
    /// TCP connect timeout towards workers.
    pub connect_timeout: Duration,
    /// `max_tokens` of a completion that sets none (OpenAI's default is 16).
    pub default_max_tokens: u32,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        GatewayConfig {
            model_aliases: Vec::new(),
            seq_len: 512,
            body_limit: 1 << 20,
            prefill_timeout: Duration::from_secs(120),
            decode_timeout: Duration::from_secs(600),
            stream_idle_timeout: Duration::from_secs(60),
            connect_timeout: Duration::from_secs(2),
            default_max_tokens: 16,
        }
    }
}

/// Everything a request handler needs.
pub struct Gateway {
    pub(crate) config: GatewayConfig,
    pub(crate) policy: Arc<dyn Policy>,
    pub(crate) tokenizer: Arc<dyn PromptTokenizer>,
    pub(crate) endpoints: Arc<EndpointTable>,
    pub(crate) client: reqwest::Client,
    pub(crate) metrics: Arc<GatewayMetrics>,
    next_id: AtomicU64,
    id_prefix: String,
}

impl std::fmt::Debug for Gateway {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gateway")
            .field("config", &self.config)
            .field("model", &self.tokenizer.model_name())
            .field("endpoints", &self.endpoints)
            .finish_non_exhaustive()
    }
}

impl Gateway {
    /// Builds the gateway state. The endpoint table is used as is: start its
    /// scraper ([`EndpointTable::spawn_scraper`]) to keep it live.
    pub fn new(
        config: GatewayConfig,
        policy: Arc<dyn Policy>,
        tokenizer: Arc<dyn PromptTokenizer>,
        endpoints: Arc<EndpointTable>,
    ) -> Result<Arc<Self>, GatewayError> {
        let client = reqwest::Client::builder()
            .connect_timeout(config.connect_timeout)
            .tcp_nodelay(true)
            .pool_idle_timeout(Duration::from_secs(60))
            .build()
            .map_err(GatewayError::Client)?;
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        Ok(Arc::new(Gateway {
            config,
            policy,
            tokenizer,
            endpoints,
            client,
            metrics: Arc::new(GatewayMetrics::new()?),
            next_id: AtomicU64::new(0),
            id_prefix: format!("{:x}", (nanos as u64) ^ u64::from(std::process::id())),
        }))
    }

    /// The metrics (for the KPI listener and extra registrations).
    pub fn metrics(&self) -> &Arc<GatewayMetrics> {
        &self.metrics
    }

    /// The endpoint table.
    pub fn endpoints(&self) -> &Arc<EndpointTable> {
        &self.endpoints
    }

    /// The served model name.
    pub fn model_name(&self) -> &str {
        self.tokenizer.model_name()
    }

    pub(crate) fn request_id(&self, headers: &HeaderMap) -> String {
        if let Some(v) = headers
            .get(rngd_api::headers::REQUEST_ID)
            .and_then(|v| v.to_str().ok())
        {
            let v: String = v
                .chars()
                .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
                .take(64)
                .collect();
            if !v.is_empty() {
                return v;
            }
        }
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        format!("{}-{n}", self.id_prefix)
    }

    fn check_model(&self, model: &str) -> Result<(), ApiError> {
        if model == self.tokenizer.model_name()
            || self.config.model_aliases.iter().any(|a| a == model)
        {
            Ok(())
        } else {
            Err(ApiError::ModelNotFound(model.chars().take(200).collect()))
        }
    }
}

/// The gateway's routes: OpenAI API, `/health`, `/metrics`. Merge the policy
/// admin routes in with [`Router::merge`].
pub fn router(gw: Arc<Gateway>) -> Router {
    let metrics = gw.metrics.clone();
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .fallback(not_found)
        .with_state(gw)
        .layer(middleware::from_fn_with_state(metrics, count_responses))
}

/// The KPI listener's routes (`/metrics` with the `airm_*` gauges).
pub fn kpi_router(metrics: Arc<GatewayMetrics>) -> Router {
    Router::new().route(
        "/metrics",
        get(move || {
            let m = metrics.clone();
            async move {
                (
                    [(header::CONTENT_TYPE, rngd_telemetry::CONTENT_TYPE)],
                    m.render_kpis(),
                )
            }
        }),
    )
}

/// Serves `router` on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    router: Router,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), GatewayError> {
    let addr = listener
        .local_addr()
        .map(|a| a.to_string())
        .unwrap_or_default();
    axum::serve(listener, router)
        .with_graceful_shutdown(shutdown)
        .await
        .map_err(|source| GatewayError::Listen { addr, source })
}

async fn count_responses(
    State(metrics): State<Arc<GatewayMetrics>>,
    req: Request,
    next: Next,
) -> Response {
    let api = req.uri().path().starts_with("/v1/");
    let resp = next.run(req).await;
    if api {
        metrics.count_response(resp.status().as_u16());
    }
    resp
}

async fn not_found(req: Request) -> ApiError {
    ApiError::NotFound(req.uri().path().chars().take(200).collect())
}

async fn metrics_text(State(gw): State<Arc<Gateway>>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, rngd_telemetry::CONTENT_TYPE)],
        gw.metrics.render(),
    )
}

async fn health(State(gw): State<Arc<Gateway>>) -> Response {
    let snapshot = gw.endpoints.snapshot();
    let ok = gw.endpoints.can_serve();
    let eps: Vec<serde_json::Value> = snapshot
        .iter()
        .map(|e| serde_json::json!({"address": e.address, "role": e.role, "healthy": e.healthy}))
        .collect();
    let body =
        serde_json::json!({"status": if ok { "ok" } else { "unavailable" }, "endpoints": eps});
    let status = if ok {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, axum::Json(body)).into_response()
}

async fn models(State(gw): State<Arc<Gateway>>) -> axum::Json<ModelList> {
    axum::Json(ModelList {
        object: "list".into(),
        data: vec![Model {
            id: gw.model_name().to_string(),
            object: "model".into(),
            created: unix_now(),
            owned_by: "rngd-pd".into(),
            max_model_len: Some(gw.config.seq_len),
        }],
    })
}

pub(crate) fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Reads the body under the limit (413 past it, whatever Content-Length says).
async fn read_body(
    body: Body,
    headers: &HeaderMap,
    limit: usize,
) -> Result<bytes::Bytes, ApiError> {
    if let Some(len) = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        && len > limit as u64
    {
        return Err(ApiError::PayloadTooLarge { limit });
    }
    match http_body_util::Limited::new(body, limit).collect().await {
        Ok(c) => Ok(c.to_bytes()),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => {
            Err(ApiError::PayloadTooLarge { limit })
        }
        Err(e) => Err(ApiError::BodyRead(e)),
    }
}

fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    if bytes.is_empty() {
        return Err(ApiError::bad_request(
            "the request body is empty; expected a JSON object",
        ));
    }
    serde_json::from_slice(bytes).map_err(|e| {
        let what = match e.classify() {
            serde_json::error::Category::Data => "invalid request",
            _ => "malformed JSON body",
        };
        ApiError::bad_request(format!("{what}: {e}"))
    })
}

fn validate_sampling(s: &SamplingFields) -> Result<(), ApiError> {
    if let Some(n) = s.n
        && n != 1
    {
        return Err(ApiError::bad_param(
            "n",
            format!("n = {n} is not supported; only n = 1 is served"),
        ));
    }
    if s.max_tokens == Some(0) {
        return Err(ApiError::bad_param(
            "max_tokens",
            "max_tokens must be at least 1",
        ));
    }
    if let Some(t) = s.temperature
        && !(0.0..=2.0).contains(&t)
    {
        return Err(ApiError::bad_param(
            "temperature",
            format!("temperature {t} is outside [0, 2]"),
        ));
    }
    if let Some(p) = s.top_p
        && !(p > 0.0 && p <= 1.0)
    {
        return Err(ApiError::bad_param(
            "top_p",
            format!("top_p {p} is outside (0, 1]"),
        ));
    }
    Ok(())
}

/// Asks the upstream for usage on streams (the gateway needs token counts);
/// returns whether the client asked for it.
fn force_stream_usage(s: &mut SamplingFields) -> bool {
    let asked = s.stream_options.as_ref().is_some_and(|o| o.include_usage);
    if s.stream {
        s.stream_options = Some(StreamOptions {
            include_usage: true,
        });
    }
    asked
}

async fn completions(State(gw): State<Arc<Gateway>>, req: Request) -> Result<Response, ApiError> {
    let started = Instant::now();
    let (parts, body) = req.into_parts();
    let bytes = read_body(body, &parts.headers, gw.config.body_limit).await?;
    let mut req: CompletionRequest = parse_json(&bytes)?;
    gw.check_model(&req.model)?;
    validate_sampling(&req.sampling)?;
    req.prompt = match req.prompt {
        Prompt::TextBatch(mut v) if v.len() == 1 => Prompt::Text(v.remove(0)),
        Prompt::TokensBatch(mut v) if v.len() == 1 => Prompt::Tokens(v.remove(0)),
        Prompt::TextBatch(_) | Prompt::TokensBatch(_) => {
            return Err(ApiError::bad_param(
                "prompt",
                "only one prompt per request is served",
            ));
        }
        p => p,
    };
    let prompt_tokens = match &req.prompt {
        Prompt::Text(t) if t.is_empty() => {
            return Err(ApiError::bad_param("prompt", "prompt must not be empty"));
        }
        Prompt::Text(t) => gw.tokenizer.count(t).map_err(ApiError::Tokenize)?,
        Prompt::Tokens(t) if t.is_empty() => {
            return Err(ApiError::bad_param("prompt", "prompt must not be empty"));
        }
        Prompt::Tokens(t) => t.len(),
        Prompt::TextBatch(_) | Prompt::TokensBatch(_) => unreachable!("unwrapped above"),
    };
    if req.kv_transfer_params.is_some() {
        return Err(ApiError::bad_param(
            "kv_transfer_params",
            "kv_transfer_params is set by the gateway, not by clients",
        ));
    }
    req.sampling.max_tokens = Some(
        req.sampling
            .max_tokens
            .unwrap_or(gw.config.default_max_tokens),
    );
    let include_usage = force_stream_usage(&mut req.sampling);
    let prepared = Prepared {
        kind: ApiKind::Completion,
        client_model: req.model.clone(),
        upstream: req,
        prompt_tokens,
        include_usage,
        path: parts.uri.path().to_string(),
        started,
    };
    flow::run(gw, prepared, parts.headers).await
}

async fn chat_completions(
    State(gw): State<Arc<Gateway>>,
    req: Request,
) -> Result<Response, ApiError> {
    let started = Instant::now();
    let (parts, body) = req.into_parts();
    let bytes = read_body(body, &parts.headers, gw.config.body_limit).await?;
    let chat: ChatCompletionRequest = parse_json(&bytes)?;
    gw.check_model(&chat.model)?;
    validate_sampling(&chat.sampling)?;
    if chat.messages.is_empty() {
        return Err(ApiError::bad_param(
            "messages",
            "messages must not be empty",
        ));
    }
    let mut messages = Vec::with_capacity(chat.messages.len());
    for m in &chat.messages {
        let text = m
            .content
            .text()
            .map_err(|e| ApiError::bad_param("messages", e))?;
        messages.push((m.role.clone(), text));
    }
    let prompt = gw
        .tokenizer
        .chat_prompt(&messages)
        .map_err(ApiError::Tokenize)?;
    let prompt_tokens = gw.tokenizer.count(&prompt).map_err(ApiError::Tokenize)?;
    let mut sampling = chat.sampling.clone();
    let max_tokens = match chat.max_completion_tokens.or(sampling.max_tokens) {
        Some(0) => {
            return Err(ApiError::bad_param(
                "max_completion_tokens",
                "must be at least 1",
            ));
        }
        Some(m) => m,
        // OpenAI's chat default is "until the context is full".
        None => (gw.config.seq_len as usize)
            .saturating_sub(prompt_tokens)
            .max(1) as u32,
    };
    sampling.max_tokens = Some(max_tokens);
    let include_usage = force_stream_usage(&mut sampling);
    let upstream = CompletionRequest {
        model: chat.model.clone(),
        prompt: Prompt::Text(prompt),
        sampling,
        kv_transfer_params: None,
    };
    let prepared = Prepared {
        kind: ApiKind::Chat,
        client_model: chat.model,
        upstream,
        prompt_tokens,
        include_usage,
        path: parts.uri.path().to_string(),
        started,
    };
    flow::run(gw, prepared, parts.headers).await
}
