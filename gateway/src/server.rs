//! The HTTP surface: the router and the handlers that validate a request
//! (through `rngd_pool::prepare`) and hand it to [`crate::flow`].

use std::sync::Arc;
use std::time::Instant;

use rngd_api::rules::unix_now;

use axum::Router;
use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use rngd_api::openai::ModelList;
use rngd_pool::{ApiKind, PrepareError};

use crate::error::{ApiError, GatewayError};
use crate::flow::{self, Prepared};
use crate::metrics::GatewayMetrics;
use crate::state::Gateway;

/// The gateway's routes: OpenAI API, `/health`, `/metrics`. Merge the policy
/// admin routes in with [`Router::merge`].
pub fn router(gw: Arc<Gateway>) -> Router {
    let metrics = gw.metrics.clone();
    let key = gw.config.api_key.clone();
    let routes = Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/ready", get(health))
        .route("/ping", get(health).post(health))
        .route("/version", get(rngd_http_edge::surface::version))
        .route("/metrics", get(metrics_text))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed);
    rngd_http_edge::api_key::guard(routes, key)
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

/// Serves `router` on `listener` under the listener limits of `edge` until
/// `shutdown` resolves; returns once every connection is closed.
pub async fn serve(
    listener: tokio::net::TcpListener,
    router: Router,
    edge: rngd_http_edge::Options,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), GatewayError> {
    let addr = listener
        .local_addr()
        .map(|a| a.to_string())
        .unwrap_or_default();
    let served = rngd_http_edge::serve(listener, router, edge, shutdown)
        .map_err(|e| GatewayError::Config(format!("listener {addr}: {e}")))?;
    served.done.await.map_err(|e| GatewayError::Listen {
        addr,
        source: std::io::Error::other(e),
    })
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
    ApiError::NotFound(rngd_http_edge::surface::shown_path(req.uri()))
}

async fn method_not_allowed(req: Request) -> ApiError {
    ApiError::MethodNotAllowed {
        method: req.method().to_string(),
        path: rngd_http_edge::surface::shown_path(req.uri()),
    }
}

async fn metrics_text(State(gw): State<Arc<Gateway>>) -> impl IntoResponse {
    // The endpoints' tokenizer digests as last scraped, even before a pick.
    gw.picker.follow_tokenizers();
    (
        [(header::CONTENT_TYPE, rngd_telemetry::CONTENT_TYPE)],
        gw.metrics.render(),
    )
}

/// `/health` and `/ready` (the latter answered 503 by the edge from the
/// shutdown signal on, while the gateway drains): the status and, per role, how many endpoints are healthy of
/// how many; never their addresses (this route is public; the endpoint list
/// is the operator's, from the endpoints source).
async fn health(State(gw): State<Arc<Gateway>>) -> Response {
    let snapshot = gw.endpoints().snapshot();
    let ok = rngd_pool::can_serve(&snapshot);
    let mut roles = serde_json::Map::new();
    for e in snapshot.iter() {
        let c = roles
            .entry(e.role.as_str().to_string())
            .or_insert_with(|| serde_json::json!({"healthy": 0, "total": 0}));
        c["total"] = (c["total"].as_u64().unwrap_or(0) + 1).into();
        if e.healthy {
            c["healthy"] = (c["healthy"].as_u64().unwrap_or(0) + 1).into();
        }
    }
    let body =
        serde_json::json!({"status": if ok { "ok" } else { "unavailable" }, "endpoints": roles});
    let status = if ok {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, axum::Json(body)).into_response()
}

async fn models(State(gw): State<Arc<Gateway>>) -> axum::Json<ModelList> {
    let root = gw.config.model_root.as_deref().unwrap_or_default();
    axum::Json(gw.served.list(root, gw.config.seq_len, unix_now()))
}

impl rngd_http_edge::HasBodyLimits for Gateway {
    fn body_limits(&self) -> rngd_http_edge::BodyLimits {
        rngd_http_edge::BodyLimits {
            max_bytes: self.config.body_limit,
            deadline: self.config.body_timeout,
        }
    }
}

/// Reads, validates and counts a request of `kind` (the pool's rules, the
/// model's tokenizer), then hands it to [`flow::run`].
async fn handle(gw: Arc<Gateway>, kind: ApiKind, req: Request) -> Result<Response, ApiError> {
    let started = Instant::now();
    let (parts, body) = req.into_parts();
    // A client gets `body_timeout` to send its body (slow-loris), and no
    // slot while it sends it; the listener's body budget is reserved first.
    use rngd_http_edge::HasBodyLimits as _;
    let bytes =
        rngd_http_edge::read_body(&parts.headers, &parts.extensions, body, gw.body_limits())
            .await?;
    // A slot from here to the end of the response stream (or a 429 now).
    let slot = gw.admission.admit().await?;
    let split =
        rngd_api::fanout::split(&bytes, matches!(kind, ApiKind::Chat)).map_err(ApiError::Rule)?;
    let path = parts.uri.path().to_string();
    let Some(split) = split else {
        let prepared = Prepared {
            request: prepare(&gw, kind, bytes.bytes().clone()).await?,
            path,
            started,
            prefilled: None,
        };
        let resp = flow::run(gw, prepared, parts.headers).await?;
        // The slot is held to the last byte of the response.
        return Ok(rngd_http_edge::hold_until_sent(resp, slot));
    };
    let resp = fan_out(gw, kind, &split, path, started, parts.headers).await?;
    Ok(rngd_http_edge::hold_until_sent(resp, slot))
}

/// Validates and counts one request body (a long prompt is tokenized off the
/// async threads).
async fn prepare(
    gw: &Gateway,
    kind: ApiKind,
    bytes: bytes::Bytes,
) -> Result<rngd_pool::Prepared, ApiError> {
    let counter = Arc::clone(&gw.tokenizer);
    let served = Some(Arc::clone(&gw.served));
    rngd_pool::prepare_async(kind, bytes, counter, Some(gw.config.seq_len), served)
        .await
        .map_err(|e| match e {
            PrepareError::Rule(r) => ApiError::Rule(r),
            PrepareError::ModelNotFound(m) => ApiError::ModelNotFound(m),
            PrepareError::Tokenize(t) => ApiError::Tokenize(t),
            e @ PrepareError::Task { .. } => ApiError::Internal(e.to_string()),
        })
}

/// A request with several choices (`n > 1`, a prompt list), under the one
/// admission slot of the request: every part validated first (a bad prompt
/// refuses the request before any work), then each served as its own
/// request (routed, prefilled, decoded), and the answers merged. A prompt's
/// first choice starts at once and its other choices once it is prefilled,
/// so the prompt is computed once and they are routed to where it is
/// cached.
async fn fan_out(
    gw: Arc<Gateway>,
    kind: ApiKind,
    split: &rngd_api::fanout::Split,
    path: String,
    started: Instant,
    headers: axum::http::HeaderMap,
) -> Result<Response, ApiError> {
    // A prompt is validated and counted once, from its first choice; its
    // other choices differ from that one only in their seed.
    let mut prepared: Vec<rngd_pool::Prepared> = Vec::with_capacity(split.parts.len());
    for (g, part) in split.parts.iter().enumerate() {
        let p = if split.is_first_of_prompt(g) {
            prepare(&gw, kind, bytes::Bytes::from(part.clone())).await?
        } else {
            let mut p = prepared[g - g % split.n].clone();
            p.upstream.sampling.seed = split.seed_of(g);
            p
        };
        prepared.push(p);
    }
    let mut waits = Vec::with_capacity(prepared.len());
    let mut runs = Vec::with_capacity(prepared.len());
    let mut first: Option<tokio::sync::watch::Receiver<bool>> = None;
    let rid = gw.request_id(&headers);
    for (g, request) in prepared.into_iter().enumerate() {
        let tell = if split.is_first_of_prompt(g) {
            let (tx, rx) = tokio::sync::watch::channel(false);
            first = Some(rx);
            waits.push(None);
            Some(Arc::new(tx))
        } else {
            waits.push(first.clone());
            None
        };
        let p = Prepared {
            request,
            path: path.clone(),
            started,
            prefilled: tell,
        };
        // Each part has its own request id (the first the request's).
        let mut h = headers.clone();
        let id = if g == 0 {
            rid.clone()
        } else {
            format!("{rid}-{g}")
        };
        if let Ok(v) = axum::http::HeaderValue::from_str(&id) {
            h.insert(rngd_api::headers::REQUEST_ID, v);
        }
        runs.push((p, h));
    }
    let parts = runs.into_iter().zip(waits).map(|((p, h), wait)| {
        let gw = Arc::clone(&gw);
        async move {
            if let Some(mut rx) = wait {
                // Told, or the first choice is gone (failed): go on either way.
                let _ = rx.wait_for(|v| *v).await;
            }
            flow::run(gw, p, h)
                .await
                .unwrap_or_else(IntoResponse::into_response)
        }
    });
    let answers = futures::future::join_all(parts).await;
    Ok(rngd_http_edge::fanout::merge(split, answers).await)
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
