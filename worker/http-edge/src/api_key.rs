//! The API key of the public listeners (`--api-key` / `VLLM_API_KEY`, as
//! vLLM's): every route but the probes and the metrics wants
//! `Authorization: Bearer KEY`, else a 401 with `WWW-Authenticate: Bearer`.
//!
//! Stricter than vLLM, which guards only `/v1/*`: the tokenizer routes
//! (`/tokenize`, `/detokenize`) cost CPU, so they are guarded too. No lockout
//! after failures (unlike the admin guard): on a public API that would let
//! any client lock every other out. The key is compared by its SHA-256
//! digest in constant time; `Debug` never shows it.

use axum::Router;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use rngd_api::openai::ErrorBody;

use crate::admin::AdminToken;

/// Paths open without the key: the probes, the metrics, the version.
pub const OPEN_PATHS: [&str; 5] = ["/health", "/ready", "/ping", "/metrics", "/version"];

/// An API key: its digest to check clients with, and the header a server
/// sends when it calls another that wants the same key (a front door to its
/// workers, a decode worker to its prefill peer).
#[derive(Clone)]
pub struct ApiKey {
    token: AdminToken,
    header: HeaderValue,
}

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ApiKey(<redacted>)")
    }
}

// === impl ApiKey ===

impl ApiKey {
    /// The key `key`; `None` when it is empty (no key: every route open).
    /// A key that cannot be a header value (control characters) is `None`
    /// too, so [`ApiKey::parse`] is the way to tell the user.
    pub fn new(key: &str) -> Option<ApiKey> {
        Self::parse(key).ok().flatten()
    }

    /// [`ApiKey::new`] with the reason a non-empty key is unusable.
    pub fn parse(key: &str) -> Result<Option<ApiKey>, &'static str> {
        let Some(token) = AdminToken::new(key) else {
            return Ok(None);
        };
        let mut header = HeaderValue::from_str(&format!("Bearer {key}"))
            .map_err(|_| "the API key must be visible ASCII (it is sent as a header)")?;
        header.set_sensitive(true);
        Ok(Some(ApiKey { token, header }))
    }

    /// `Authorization: Bearer KEY`, marked sensitive (never logged by hyper).
    pub fn authorization(&self) -> HeaderValue {
        self.header.clone()
    }

    /// Whether the request's `Authorization` carries this key.
    pub fn admits(&self, headers: &axum::http::HeaderMap) -> bool {
        headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.as_bytes().strip_prefix(b"Bearer "))
            .is_some_and(|given| self.token.matches(given))
    }
}

/// `router` with every route but [`OPEN_PATHS`] behind `key`; unchanged
/// without one.
pub fn guard<S>(router: Router<S>, key: Option<ApiKey>) -> Router<S>
where
    S: Clone + Send + Sync + 'static,
{
    match key {
        Some(k) => router.layer(axum::middleware::from_fn_with_state(k, check)),
        None => router,
    }
}

async fn check(State(key): State<ApiKey>, req: Request, next: Next) -> Response {
    if OPEN_PATHS.contains(&req.uri().path()) || key.admits(req.headers()) {
        return next.run(req).await;
    }
    let body = ErrorBody::new(
        ErrorBody::kind_for_status(401),
        "a valid API key is required: Authorization: Bearer KEY",
    )
    .with_code("invalid_api_key");
    let mut resp = (StatusCode::UNAUTHORIZED, axum::Json(body)).into_response();
    resp.headers_mut()
        .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_redacted_and_checked_exactly() {
        let k = ApiKey::new("k3y").unwrap();
        assert_eq!(format!("{k:?}"), "ApiKey(<redacted>)");
        assert!(k.authorization().is_sensitive());
        let mut h = axum::http::HeaderMap::new();
        assert!(!k.admits(&h));
        for (given, ok) in [
            ("Bearer k3y", true),
            ("Bearer k3y ", false),
            ("k3y", false),
            ("Bearer K3y", false),
        ] {
            h.insert(header::AUTHORIZATION, HeaderValue::from_static(given));
            assert_eq!(k.admits(&h), ok, "{given}");
        }
        assert!(ApiKey::new("").is_none());
        assert!(ApiKey::parse("bad\nkey").is_err());
    }
}
