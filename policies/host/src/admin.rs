//! The admin API: `GET /admin/policy` (active module, and the one a rollback
//! would restore) and `PUT /admin/policy` (body = wasm bytes) for hot swaps.
//! Every method needs the bearer token, checked by the guard every admin
//! listener shares (`rngd_http_edge::admin`: SHA-256 digests compared in
//! constant time); after
//! [`AdminOptions::max_failures`] failed attempts within
//! [`AdminOptions::failure_window`] every request is answered 429 for
//! [`AdminOptions::lockout`]. [`serve`] runs it on its own listener
//! (loopback by default); [`admin_router`] / [`admin_router_with`] give the
//! router for a caller that binds it. The token never appears in logs or in
//! `Debug` output ([`AdminToken`]).

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use rngd_api::openai::ErrorBody;
pub use rngd_http_edge::admin::AdminToken;
use rngd_http_edge::admin::{AdminGuard, LockoutOptions, Refusal};

use crate::{ModuleInfo, PolicyError, PolicyRuntime};

/// Largest module `PUT /admin/policy` accepts.
const MAX_MODULE_BYTES: usize = 32 << 20;

/// Where [`serve`] listens by default: loopback only.
pub const DEFAULT_ADMIN_LISTEN: SocketAddr =
    SocketAddr::new(std::net::IpAddr::V4(Ipv4Addr::LOCALHOST), 9903);

/// How the admin API is served and guarded.
#[derive(Clone, Debug)]
pub struct AdminOptions {
    /// Address [`serve`] binds. Default [`DEFAULT_ADMIN_LISTEN`]
    /// (`127.0.0.1:9903`); port 0 picks a free port.
    pub listen: SocketAddr,
    /// The bearer token every request must carry (`Authorization: Bearer
    /// TOKEN`); `None` (the default) turns the admin API off: every request
    /// is answered 404.
    pub token: Option<AdminToken>,
    /// Failed attempts (missing or wrong token) within `failure_window`
    /// after which every request is answered 429 for `lockout`. Default 10.
    pub max_failures: u32,
    /// The window of `max_failures`. Default 60 s.
    pub failure_window: Duration,
    /// How long requests are answered 429 once `max_failures` is reached
    /// (the token is not even checked then). Default 30 s.
    pub lockout: Duration,
}

impl Default for AdminOptions {
    fn default() -> Self {
        AdminOptions {
            listen: DEFAULT_ADMIN_LISTEN,
            token: None,
            max_failures: 10,
            failure_window: Duration::from_secs(60),
            lockout: Duration::from_secs(30),
        }
    }
}

#[derive(Clone)]
struct AdminState {
    runtime: Arc<PolicyRuntime>,
    guard: AdminGuard,
}

fn error(status: StatusCode, message: impl Into<String>) -> Response {
    let body = ErrorBody::new(ErrorBody::kind_for_status(status.as_u16()), message);
    (status, axum::Json(body)).into_response()
}

fn info_json(info: &ModuleInfo) -> serde_json::Value {
    serde_json::json!({
        "sha256": info.sha256,
        "loaded_at_unix_ms": info.loaded_at.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64),
        "path": info.path.as_ref().map(|p| p.display().to_string()),
    })
}

// === impl AdminState ===

impl AdminState {
    /// Checks the bearer token with the shared guard, counting refusals in
    /// the policy metrics: `Some` is the refusal to send, `None` lets the
    /// request in.
    fn refusal(&self, headers: &HeaderMap) -> Option<Response> {
        let refusal = self.guard.check(headers).err()?;
        match refusal {
            Refusal::Throttled { .. } => self.runtime.metrics.admin_throttled.inc(),
            Refusal::Unauthorized { locked_out } => {
                self.runtime.metrics.admin_auth_failures.inc();
                if locked_out {
                    tracing::warn!(
                        "policy admin API: repeated failed attempts; answering 429 for a while"
                    );
                }
            }
        }
        Some(refusal.into_response("policy admin API"))
    }
}

async fn get_policy(State(st): State<AdminState>, headers: HeaderMap) -> Response {
    if let Some(resp) = st.refusal(&headers) {
        return resp;
    }
    let mut v = info_json(&st.runtime.active());
    v["previous"] = st
        .runtime
        .previous()
        .map_or(serde_json::Value::Null, |p| info_json(&p));
    axum::Json(v).into_response()
}

async fn put_policy(State(st): State<AdminState>, headers: HeaderMap, body: Bytes) -> Response {
    if let Some(resp) = st.refusal(&headers) {
        return resp;
    }
    if body.is_empty() {
        return error(
            StatusCode::BAD_REQUEST,
            "the request body must be the wasm module",
        );
    }
    tracing::info!(bytes = body.len(), "policy admin API: module upload");
    match st.runtime.swap(body.to_vec()).await {
        Ok(info) => axum::Json(info_json(&info)).into_response(),
        Err(e) => {
            let status =
                StatusCode::from_u16(e.http_status()).unwrap_or(StatusCode::UNPROCESSABLE_ENTITY);
            error(
                status,
                format!(
                    "module rejected, the active module ({}) stays: {e}",
                    st.runtime.active().sha256
                ),
            )
        }
    }
}

/// Any other method: authenticated like the others, then 405.
async fn other_method(State(st): State<AdminState>, headers: HeaderMap) -> Response {
    if let Some(resp) = st.refusal(&headers) {
        return resp;
    }
    let mut resp = error(
        StatusCode::METHOD_NOT_ALLOWED,
        "the policy admin API answers GET and PUT",
    );
    resp.headers_mut()
        .insert(header::ALLOW, HeaderValue::from_static("GET, PUT"));
    resp
}

async fn admin_off() -> Response {
    error(
        StatusCode::NOT_FOUND,
        "the admin API is off (no admin token configured)",
    )
}

/// The admin router with the default guard ([`AdminOptions::default`]:
/// 10 failures within 60 s lock it for 30 s). With `token == None` (or
/// empty) the admin API is off and both methods answer 404. Every method,
/// `GET` too, needs the token.
pub fn admin_router(runtime: Arc<PolicyRuntime>, token: Option<String>) -> Router {
    admin_router_with(
        runtime,
        AdminOptions {
            token: token.as_deref().and_then(AdminToken::new),
            ..AdminOptions::default()
        },
    )
}

/// The admin router guarded as `options` say (`listen` is not used: the
/// caller binds the router).
pub fn admin_router_with(runtime: Arc<PolicyRuntime>, options: AdminOptions) -> Router {
    match options.token.clone() {
        None => Router::new().route("/admin/policy", get(admin_off).put(admin_off)),
        Some(token) => Router::new()
            .route(
                "/admin/policy",
                get(get_policy).put(put_policy).fallback(other_method),
            )
            .layer(DefaultBodyLimit::max(MAX_MODULE_BYTES))
            .with_state(AdminState {
                runtime,
                guard: AdminGuard::new(
                    token,
                    LockoutOptions {
                        max_failures: options.max_failures,
                        failure_window: options.failure_window,
                        lockout: options.lockout,
                    },
                ),
            }),
    }
}

/// The admin API on its own listener ([`serve`]).
#[derive(Debug)]
pub struct AdminServer {
    addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

// === impl AdminServer ===

impl AdminServer {
    /// The address it listens on (the bound port when `listen` had port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting, lets requests in flight finish, and waits for that.
    pub async fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let _ = (&mut self.task).await;
    }
}

impl Drop for AdminServer {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// Binds `options.listen` and serves the admin API there (as
/// [`admin_router_with`]) until the returned server is shut down or dropped.
pub async fn serve(
    runtime: Arc<PolicyRuntime>,
    options: AdminOptions,
) -> Result<AdminServer, PolicyError> {
    let listen = options.listen;
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|source| PolicyError::Listen {
            addr: listen,
            source,
        })?;
    let addr = listener
        .local_addr()
        .map_err(|source| PolicyError::Listen {
            addr: listen,
            source,
        })?;
    if !addr.ip().is_loopback() {
        tracing::warn!(%addr, "policy admin API listening beyond loopback");
    }
    let app = admin_router_with(runtime, options);
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    // Under the listener limits every rngd-pd HTTP listener has
    // (`rngd_http_edge`, defaults).
    let served = rngd_http_edge::serve(
        listener,
        app,
        rngd_http_edge::Options::default(),
        async move {
            let _ = rx.await;
        },
    );
    let task = tokio::spawn(async move {
        match served {
            Ok(s) => {
                let _ = s.done.await;
            }
            Err(e) => tracing::error!(error = %e, "policy admin API listener failed"),
        }
    });
    tracing::info!(%addr, "policy admin API listening");
    Ok(AdminServer {
        addr,
        stop: Some(tx),
        task,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_debug_shows_no_token() {
        let shown = format!(
            "{:?}",
            AdminOptions {
                token: AdminToken::new("s3cret"),
                ..AdminOptions::default()
            }
        );
        assert!(!shown.contains("s3cret"), "{shown}");
        assert!(shown.contains("redacted"), "{shown}");
    }
}
