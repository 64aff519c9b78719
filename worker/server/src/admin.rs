//! The worker's admin API, on its own listener (`--admin-listen`, loopback
//! by default), never the public one: `POST /reset_prefix_cache` (vLLM's
//! endpoint) drops every prefix-cache block no running request uses and
//! publishes `AllBlocksCleared`; `POST /update_weights_from_disk` and
//! `GET /weight_info` (SGLang's endpoints) replace and report the weights
//! ([`crate::weights`]); `POST /switch_variant` and `GET /variants` switch
//! and list compiled variants ([`crate::variants`]). This module maps their
//! errors to statuses. Every
//! request needs the bearer token
//! (`RNGD_PD_ADMIN_TOKEN`), checked by the guard the policy admin API uses
//! too ([`rngd_http_edge::admin`]); without a token the listener is not
//! started at all.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;

use axum::Router;
use axum::extract::{RawQuery, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use rngd_api::openai::ErrorBody;
use rngd_http_edge::admin::{AdminGuard, AdminToken, LockoutOptions, Refusal};
use tokio::net::TcpListener;

use crate::weights::UpdateError;
use crate::{WorkerError, WorkerState};

/// Default of [`AdminListen::listen`]: loopback, port 9904.
pub const DEFAULT_WORKER_ADMIN_LISTEN: SocketAddr =
    SocketAddr::new(std::net::IpAddr::V4(Ipv4Addr::LOCALHOST), 9904);

/// The name of this API in refusals.
const API: &str = "worker admin API";

/// Where and how the worker's admin API is served.
#[derive(Debug, Clone)]
pub struct AdminListen {
    /// Address to bind (`--admin-listen`); default
    /// [`DEFAULT_WORKER_ADMIN_LISTEN`]; port 0 picks a free port (logged).
    pub listen: SocketAddr,
    /// The bearer token (`RNGD_PD_ADMIN_TOKEN`); `None`: no admin listener.
    pub token: Option<AdminToken>,
}

impl Default for AdminListen {
    fn default() -> Self {
        AdminListen {
            listen: DEFAULT_WORKER_ADMIN_LISTEN,
            token: None,
        }
    }
}

#[derive(Clone)]
struct AdminState {
    worker: WorkerState,
    guard: AdminGuard,
}

fn error(status: StatusCode, message: impl Into<String>, param: Option<&str>) -> Response {
    let mut body = ErrorBody::new(ErrorBody::kind_for_status(status.as_u16()), message);
    if let Some(p) = param {
        body = body.with_param(p);
    }
    (status, axum::Json(body)).into_response()
}

// === impl AdminState ===

impl AdminState {
    fn refusal(&self, headers: &HeaderMap) -> Option<Response> {
        let refusal = self.guard.check(headers).err()?;
        let reason = match refusal {
            Refusal::Throttled { .. } => "throttled",
            Refusal::Unauthorized { locked_out } => {
                if locked_out {
                    tracing::warn!(
                        "worker admin API: repeated failed attempts; answering 429 for a while"
                    );
                }
                "unauthorized"
            }
        };
        self.worker
            .metrics()
            .admin_refusals
            .with_label_values(&[reason])
            .inc();
        Some(refusal.into_response(API))
    }
}

/// `POST /reset_prefix_cache`: 200 with an empty body once every unused
/// block is dropped; 400 when this engine keeps no prefix cache; 503 before
/// the model is loaded. vLLM's query parameters (`reset_running_requests`,
/// `reset_external`) are refused by name: this engine has neither running
/// blocks to reset (a hit copies its blocks) nor an external cache.
async fn reset_prefix_cache(
    State(st): State<AdminState>,
    headers: HeaderMap,
    RawQuery(query): RawQuery,
) -> Response {
    if let Some(resp) = st.refusal(&headers) {
        return resp;
    }
    if let Some(q) = query.filter(|q| !q.is_empty()) {
        let name = q.split('&').next().unwrap_or(q.as_str());
        let name = name.split('=').next().unwrap_or(name).to_string();
        return error(
            StatusCode::BAD_REQUEST,
            format!("{name} is not supported by this worker's /reset_prefix_cache"),
            Some(&name),
        );
    }
    let Some(engine) = st.worker.engine() else {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "the model is still loading",
            None,
        );
    };
    if !engine.reset_prefix_cache() {
        return error(
            StatusCode::BAD_REQUEST,
            "this worker keeps no prefix cache (--no-enable-prefix-caching)",
            None,
        );
    }
    tracing::info!("prefix cache reset");
    StatusCode::OK.into_response()
}

/// The status and body of a refused weight update (the one place its
/// errors become HTTP).
fn update_error(e: &UpdateError) -> Response {
    let status = match e {
        UpdateError::BadRequest { .. }
        | UpdateError::Load(_)
        | UpdateError::Incompatible(_)
        | UpdateError::Variant(_) => StatusCode::BAD_REQUEST,
        UpdateError::Busy => StatusCode::CONFLICT,
        UpdateError::NotReady => StatusCode::SERVICE_UNAVAILABLE,
        UpdateError::Task(_) => StatusCode::INTERNAL_SERVER_ERROR,
    };
    let message = crate::error::with_causes(e);
    let param = match e {
        UpdateError::BadRequest { param, .. } => Some(param.as_str()),
        UpdateError::Load(_) | UpdateError::Incompatible(_) => Some("model_path"),
        _ => None,
    };
    error(status, message, param)
}

/// A change of the serving engine (`what`, for the log): refused without
/// the token; a 400 saying `cannot` on a worker whose engine cannot change;
/// otherwise `run`'s answer as JSON, or its refusal mapped to its status.
async fn engine_change<T, F, Fut>(
    st: &AdminState,
    headers: &HeaderMap,
    cannot: &'static str,
    what: &'static str,
    run: F,
) -> Response
where
    T: serde::Serialize,
    F: FnOnce(Arc<crate::weights::WeightUpdater>) -> Fut,
    Fut: Future<Output = Result<T, UpdateError>>,
{
    if let Some(resp) = st.refusal(headers) {
        return resp;
    }
    let Some(updater) = st.worker.weight_updater().cloned() else {
        return error(StatusCode::BAD_REQUEST, cannot, None);
    };
    match run(updater).await {
        Ok(answer) => axum::Json(answer).into_response(),
        Err(e) => {
            tracing::warn!(error = %e, what, "engine change refused");
            update_error(&e)
        }
    }
}

/// `POST /update_weights_from_disk {"model_path": …}`: 200 with
/// [`crate::weights::UpdateAnswer`] once the new weights serve; an error
/// body (the old weights still serving) otherwise; 400 on a worker that
/// cannot reload.
async fn update_weights(
    State(st): State<AdminState>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    let (worker, body) = (&st.worker, &body);
    let cannot = "this worker's engine cannot be reloaded";
    engine_change(&st, &headers, cannot, "weight update", |u| async move {
        crate::weights::update(worker, &u, body).await
    })
    .await
}

/// `POST /switch_variant {"seq_len", "max_batch"}`: 200 with
/// [`crate::variants::SwitchAnswer`] once the variant serves; an error body
/// (the current one still serving) otherwise.
async fn switch_variant(
    State(st): State<AdminState>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    let (worker, body) = (&st.worker, &body);
    engine_change(
        &st,
        &headers,
        NO_VARIANTS,
        "variant switch",
        |u| async move { crate::variants::switch(worker, &u, body).await },
    )
    .await
}

/// Why a worker cannot switch variants.
const NO_VARIANTS: &str = "this worker's engine has no variants";

/// `GET /variants`: the variant serving and those prepared, each with its
/// memory cost.
async fn variants(State(st): State<AdminState>, headers: HeaderMap) -> Response {
    if let Some(resp) = st.refusal(&headers) {
        return resp;
    }
    match (st.worker.engine(), st.worker.weight_updater()) {
        (Some(engine), Some(updater)) => axum::Json(serde_json::json!({
            "variants": crate::variants::list(&*engine, updater),
        }))
        .into_response(),
        (None, _) => error(
            StatusCode::SERVICE_UNAVAILABLE,
            "the model is still loading",
            None,
        ),
        (Some(_), None) => error(StatusCode::BAD_REQUEST, NO_VARIANTS, None),
    }
}

/// `GET /weight_info`: the served name, `weight_version` and model file.
async fn weight_info(State(st): State<AdminState>, headers: HeaderMap) -> Response {
    if let Some(resp) = st.refusal(&headers) {
        return resp;
    }
    match st.worker.engine() {
        Some(engine) => {
            let file = st.worker.model_root().unwrap_or_default();
            axum::Json(crate::weights::info(&*engine, file)).into_response()
        }
        None => error(
            StatusCode::SERVICE_UNAVAILABLE,
            "the model is still loading",
            None,
        ),
    }
}

/// Any other method on a known path: authenticated, then 405 naming the one
/// it answers.
fn other_method(
    allow: &'static str,
) -> impl Fn(State<AdminState>, HeaderMap) -> std::future::Ready<Response> + Clone {
    move |State(st): State<AdminState>, headers: HeaderMap| {
        if let Some(resp) = st.refusal(&headers) {
            return std::future::ready(resp);
        }
        let mut resp = error(
            StatusCode::METHOD_NOT_ALLOWED,
            format!("this path answers {allow}"),
            None,
        );
        resp.headers_mut()
            .insert(header::ALLOW, HeaderValue::from_static(allow));
        std::future::ready(resp)
    }
}

/// The admin routes over `worker`, guarded by `token`.
pub fn router(worker: WorkerState, token: AdminToken) -> Router {
    Router::new()
        .route(
            "/reset_prefix_cache",
            post(reset_prefix_cache).fallback(other_method("POST")),
        )
        .route(
            "/update_weights_from_disk",
            post(update_weights).fallback(other_method("POST")),
        )
        .route(
            "/weight_info",
            get(weight_info).fallback(other_method("GET")),
        )
        .route(
            "/switch_variant",
            post(switch_variant).fallback(other_method("POST")),
        )
        .route("/variants", get(variants).fallback(other_method("GET")))
        .with_state(AdminState {
            worker,
            guard: AdminGuard::new(token, LockoutOptions::default()),
        })
}

/// The admin API serving in the background.
#[derive(Debug)]
pub struct RunningAdmin {
    /// The bound address.
    pub addr: SocketAddr,
    stop: tokio_util::sync::CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

// === impl RunningAdmin ===

impl RunningAdmin {
    /// Stops accepting, finishes open requests, and waits.
    pub async fn stop(self) {
        self.stop.cancel();
        let _ = self.task.await;
    }
}

/// Binds `opts.listen` and serves the admin API there, under the listener
/// limits of `worker`'s configuration; `None` (nothing bound) without a
/// token.
pub async fn serve(
    opts: &AdminListen,
    worker: WorkerState,
) -> Result<Option<RunningAdmin>, WorkerError> {
    let Some(token) = opts.token.clone() else {
        tracing::info!("no admin token: the worker admin API (/reset_prefix_cache) is off");
        return Ok(None);
    };
    let listener = TcpListener::bind(opts.listen)
        .await
        .map_err(|source| WorkerError::Io {
            context: format!("binding the admin listener {}", opts.listen),
            source,
        })?;
    let edge = worker.config().edge.clone();
    let app = router(worker, token);
    let stop = tokio_util::sync::CancellationToken::new();
    let s = stop.clone();
    let served = rngd_http_edge::serve(listener, app, edge, async move { s.cancelled().await })
        .map_err(|e| WorkerError::Config(e.to_string()))?;
    if !served.addr.ip().is_loopback() {
        tracing::warn!(addr = %served.addr, "worker admin API listening beyond loopback");
    }
    tracing::info!(addr = %served.addr, "worker admin API listening");
    Ok(Some(RunningAdmin {
        addr: served.addr,
        stop,
        task: served.done,
    }))
}
