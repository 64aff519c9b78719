//! The small routes every rngd-pd HTTP server answers the same way, as vLLM
//! does: `GET /version` (the build's version as JSON).

use axum::Json;

/// The version every server reports (the workspace's).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// `GET /version`: `{"version": "…"}`.
pub async fn version() -> Json<serde_json::Value> {
    Json(serde_json::json!({ "version": VERSION }))
}
