//! The admin API: `GET /admin/policy` (active module) and `PUT /admin/policy`
//! (body = wasm bytes, bearer token required) for hot swaps.

use std::sync::Arc;
use std::time::UNIX_EPOCH;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use rngd_api::openai::ErrorBody;

use crate::{ModuleInfo, PolicyRuntime};

/// Largest module `PUT /admin/policy` accepts.
const MAX_MODULE_BYTES: usize = 32 << 20;

#[derive(Clone)]
struct AdminState {
    runtime: Arc<PolicyRuntime>,
    token: Arc<str>,
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

/// Compares without an early exit on the first differing byte.
fn same_token(given: &[u8], expected: &[u8]) -> bool {
    given.len() == expected.len()
        && given
            .iter()
            .zip(expected)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
}

async fn get_policy(State(st): State<AdminState>) -> Response {
    axum::Json(info_json(&st.runtime.active())).into_response()
}

async fn put_policy(State(st): State<AdminState>, headers: HeaderMap, body: Bytes) -> Response {
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    if !same_token(given.as_bytes(), st.token.as_bytes()) {
        return error(
            StatusCode::UNAUTHORIZED,
            "a valid bearer token is required to replace the policy module",
        );
    }
    if body.is_empty() {
        return error(
            StatusCode::BAD_REQUEST,
            "the request body must be the wasm module",
        );
    }
    let span = tracing::info_span!("admin_policy_put", bytes = body.len());
    let _g = span.enter();
    drop(_g);
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

async fn admin_off() -> Response {
    error(
        StatusCode::NOT_FOUND,
        "the admin API is off (no admin token configured)",
    )
}

/// The admin router. With `token == None` the admin API is off and both
/// methods answer 404.
pub fn admin_router(runtime: Arc<PolicyRuntime>, token: Option<String>) -> Router {
    match token.filter(|t| !t.is_empty()) {
        None => Router::new().route("/admin/policy", get(admin_off).put(admin_off)),
        Some(token) => Router::new()
            .route("/admin/policy", get(get_policy).put(put_policy))
            .layer(DefaultBodyLimit::max(MAX_MODULE_BYTES))
            .with_state(AdminState {
                runtime,
                token: token.into(),
            }),
    }
}
