//! The HTTP surface: the router and the handlers that validate a request
//! (through `rngd_pool::prepare`) and hand it to [`crate::flow`].

use std::sync::Arc;
use std::time::Instant;

use rngd_api::rules::unix_now;

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use http_body_util::BodyExt;
use rngd_api::openai::{Model, ModelList};
use rngd_pool::{ApiKind, PrepareError};

use crate::error::{ApiError, GatewayError};
use crate::flow::{self, Prepared};
use crate::metrics::GatewayMetrics;
use crate::state::Gateway;

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
    let snapshot = gw.endpoints().snapshot();
    let ok = rngd_pool::can_serve(&snapshot);
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

/// Reads, validates and counts a request of `kind` (the pool's rules, the
/// model's tokenizer), then hands it to [`flow::run`].
async fn handle(gw: Arc<Gateway>, kind: ApiKind, req: Request) -> Result<Response, ApiError> {
    let started = Instant::now();
    let (parts, body) = req.into_parts();
    // A client gets `body_timeout` to send its body (slow-loris), and no
    // slot while it sends it.
    let deadline = gw.config.body_timeout;
    let bytes = tokio::time::timeout(
        deadline,
        read_body(body, &parts.headers, gw.config.body_limit),
    )
    .await
    .map_err(|_| ApiError::BodyTimeout {
        after_ms: deadline.as_millis() as u64,
    })??;
    // A slot from here to the end of the response stream (or a 429 now).
    let slot = gw.admission.admit().await?;
    let counter = Arc::clone(&gw.tokenizer);
    let seq_len = gw.config.seq_len;
    // Tokenizing a long prompt is CPU work: off the async threads.
    let prepared = tokio::task::spawn_blocking(move || {
        rngd_pool::prepare(kind, &bytes, counter.as_ref(), Some(seq_len))
    })
    .await
    .map_err(|e| ApiError::Internal(format!("tokenizer task: {e}")))?
    .map_err(|e| match e {
        PrepareError::Rule(r) => ApiError::Rule(r),
        PrepareError::Tokenize(t) => ApiError::Tokenize(t),
    })?;
    gw.check_model(&prepared.client_model)?;
    let prepared = Prepared {
        request: prepared,
        path: parts.uri.path().to_string(),
        started,
    };
    let resp = flow::run(gw, prepared, parts.headers).await?;
    Ok(hold_until_sent(resp, slot))
}

/// The response with `slot` held until its body (a stream, perhaps) is sent
/// or dropped.
fn hold_until_sent(resp: Response, slot: crate::admission::Slot) -> Response {
    use axum::body::HttpBody as _;
    use futures::StreamExt;
    // A whole body (JSON) is done: the slot is freed with this return.
    if resp.body().size_hint().exact().is_some() {
        return resp;
    }
    let (parts, body) = resp.into_parts();
    let stream = body.into_data_stream().map(move |chunk| {
        let _held = &slot;
        chunk
    });
    Response::from_parts(parts, Body::from_stream(stream))
}

async fn completions(State(gw): State<Arc<Gateway>>, req: Request) -> Result<Response, ApiError> {
    handle(gw, ApiKind::Completion, req).await
}

async fn chat_completions(
    State(gw): State<Arc<Gateway>>,
    req: Request,
) -> Result<Response, ApiError> {
    handle(gw, ApiKind::Chat, req).await
}
