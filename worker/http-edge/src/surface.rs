//! The small routes every rngd-pd HTTP server answers the same way, as vLLM
//! does: `GET /version` (the build's version as JSON), and the request path
//! as a 404 or 405 message shows it ([`shown_path`]).

use axum::Json;

/// The version every server reports (the workspace's).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// `GET /version`: `{"version": "…"}`.
pub async fn version() -> Json<serde_json::Value> {
    Json(serde_json::json!({ "version": VERSION }))
}

/// Characters of a request path an error message repeats at most.
pub const SHOWN_PATH_CHARS: usize = 200;

/// A request's path as a 404 or 405 message shows it: at most
/// [`SHOWN_PATH_CHARS`] characters, so a huge path never makes a huge body.
pub fn shown_path(uri: &axum::http::Uri) -> String {
    uri.path().chars().take(SHOWN_PATH_CHARS).collect()
}

#[cfg(test)]
mod shown_path_tests {
    use super::*;

    #[test]
    fn a_long_path_is_cut_and_a_short_one_kept() {
        let long: axum::http::Uri = format!("/{}", "a".repeat(5000)).parse().unwrap();
        assert_eq!(shown_path(&long).chars().count(), SHOWN_PATH_CHARS);
        let short: axum::http::Uri = "/v1/nope?x=1".parse().unwrap();
        assert_eq!(shown_path(&short), "/v1/nope");
    }
}
