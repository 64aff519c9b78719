//! Errors of the gateway.
//!
//! - [`GatewayError`]: failures of the library outside a request (startup,
//!   configuration, binding).
//! - [`ApiError`]: everything a request can fail with. It is the ONE place that
//!   decides the HTTP status and the OpenAI-style message a client sees; causes
//!   are logged in full and never leak into the body beyond a curated message.

use std::fmt;

use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use rngd_api::openai::ErrorBody;

/// A boxed error cause (trait objects from pluggable edges: policy, tokenizer, scraper).
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Errors of the gateway library outside a request.
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    /// The configuration is unusable.
    #[error("configuration: {0}")]
    Config(String),
    /// A file could not be read.
    #[error("reading {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// The endpoint pool (endpoints, scraper, tokenizer) could not be set up.
    #[error(transparent)]
    Pool(#[from] rngd_pool::PoolError),
    /// Binding or serving a listener failed.
    #[error("listener {addr}: {source}")]
    Listen {
        /// Address.
        addr: String,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// The policy could not be loaded.
    #[error("policy: {0}")]
    Policy(#[source] BoxError),
    /// Metrics could not be registered.
    #[error("metrics: {0}")]
    Metrics(#[from] rngd_telemetry::TelemetryError),
    /// The HTTP client could not be built.
    #[error("http client: {0}")]
    Client(#[source] reqwest::Error),
}

/// The stage of the PD flow an upstream failure happened in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// The call to the prefill worker.
    Prefill,
    /// The call to the decode (or only) worker.
    Decode,
}

impl Stage {
    /// `prefill` or `decode`.
    pub fn as_str(self) -> &'static str {
        match self {
            Stage::Prefill => "prefill",
            Stage::Decode => "decode",
        }
    }
}

impl fmt::Display for Stage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Everything a request can fail with; [`IntoResponse`] maps each to a status
/// and an OpenAI-style error body, here and nowhere else.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// A request rule is broken (`rngd_api::rules`) → 400 with its param and code.
    #[error(transparent)]
    Rule(#[from] rngd_api::rules::RuleError),
    /// Malformed JSON, wrong types, unsupported values → 400.
    #[error("{message}")]
    BadRequest {
        /// Message for the client.
        message: String,
        /// Offending parameter.
        param: Option<String>,
    },
    /// The requested model is not served → 404.
    #[error(transparent)]
    ModelNotFound(rngd_api::models::ModelNotFound),
    /// A route that exists, called with another method → 405.
    #[error("method {method} is not allowed on {path}")]
    MethodNotAllowed {
        /// The method as sent.
        method: String,
        /// The path, cut to 200 characters.
        path: String,
    },
    /// No route → 404.
    #[error("no route for {0}")]
    NotFound(String),
    /// The body was not read (over the limit 413, too slow 408, past the
    /// listener's body budget 503, broken 400): `rngd_http_edge` decides
    /// its status, body and headers.
    #[error(transparent)]
    Body(#[from] rngd_http_edge::BodyError),
    /// The policy answered locally (reject): its status and body pass through.
    #[error("policy rejected the request with status {status}")]
    PolicyReject {
        /// HTTP status chosen by the policy.
        status: u16,
        /// Body (OpenAI-style JSON) chosen by the policy.
        body: Vec<u8>,
    },
    /// The pick failed: the policy failed (trap, timeout, memory cap, bad
    /// output → 500; no instance → 503), routed off the endpoint table (500),
    /// or a subset hint left no endpoint (503).
    #[error("routing failed: {0}")]
    Policy(#[source] rngd_pool::PickError),
    /// The tokenizer failed on the prompt → 400.
    #[error("tokenizing the prompt: {0}")]
    Tokenize(#[source] BoxError),
    /// A worker could not be reached or broke the protocol → 502.
    #[error("{stage} worker {address} failed: {detail}")]
    Upstream {
        /// Which call.
        stage: Stage,
        /// Worker `host:port`.
        address: String,
        /// What went wrong (curated, no internals).
        detail: String,
        /// Cause, logged.
        #[source]
        source: Option<BoxError>,
    },
    /// A worker answered with an error status.
    #[error("{stage} worker {address} answered {status}: {message}")]
    UpstreamStatus {
        /// Which call.
        stage: Stage,
        /// Worker `host:port`.
        address: String,
        /// Its status.
        status: u16,
        /// Its error message (from its OpenAI error body, if any).
        message: String,
        /// Its error code, if any.
        code: Option<String>,
        /// Its error's `param`, if any (passed on with a client error).
        param: Option<String>,
    },
    /// A worker did not answer in time → 504.
    #[error("{stage} worker {address} timed out after {after_ms} ms")]
    Timeout {
        /// Which call.
        stage: Stage,
        /// Worker `host:port`.
        address: String,
        /// The timeout.
        after_ms: u64,
    },
    /// Too many requests at once → 429 with `Retry-After`.
    #[error("overloaded ({}): {max_concurrent} requests are being served", reason.as_str())]
    Overloaded {
        /// Queue full or waited too long.
        reason: rngd_pool::admission::Overload,
        /// The concurrency limit.
        max_concurrent: usize,
        /// Seconds to wait before retrying (`Retry-After`).
        retry_after_s: u64,
    },
    /// A bug or an impossible state → 500.
    #[error("internal error: {0}")]
    Internal(String),
}

impl ApiError {
    /// A 400 with a message.
    pub fn bad_request(message: impl Into<String>) -> Self {
        ApiError::BadRequest {
            message: message.into(),
            param: None,
        }
    }

    /// A 400 naming the offending parameter.
    pub fn bad_param(param: &str, message: impl Into<String>) -> Self {
        ApiError::BadRequest {
            message: message.into(),
            param: Some(param.to_string()),
        }
    }

    /// The HTTP status this error maps to.
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::BadRequest { .. } | ApiError::Rule(_) | ApiError::Tokenize(_) => {
                StatusCode::BAD_REQUEST
            }
            ApiError::ModelNotFound(_) | ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::MethodNotAllowed { .. } => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::Body(e) => e.status(),
            ApiError::PolicyReject { status, .. } => {
                StatusCode::from_u16(*status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
            }
            ApiError::Policy(e) => {
                StatusCode::from_u16(e.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
            }
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
            ApiError::Overloaded { .. } => StatusCode::TOO_MANY_REQUESTS,
            ApiError::Upstream { .. } => StatusCode::BAD_GATEWAY,
            // A worker's client error (bad sampling value, over-length) is the
            // client's: pass it through. Anything else from a worker is a
            // failed stage.
            ApiError::UpstreamStatus { status, .. } => match *status {
                // A worker's 429 is load, as the gateway's own: passed on.
                // A decode worker's 409 is a weight_version conflict between
                // the pair the policy chose: the client sees it as it is.
                400 | 404 | 409 | 413 | 422 | 429 => {
                    StatusCode::from_u16(*status).unwrap_or(StatusCode::BAD_GATEWAY)
                }
                504 => StatusCode::GATEWAY_TIMEOUT,
                _ => StatusCode::BAD_GATEWAY,
            },
            ApiError::Timeout { .. } => StatusCode::GATEWAY_TIMEOUT,
        }
    }

    /// The OpenAI-style body the client sees.
    pub fn body(&self) -> ErrorBody {
        let status = self.status().as_u16();
        let kind = ErrorBody::kind_for_status(status);
        match self {
            ApiError::BadRequest { message, param } => {
                let b = ErrorBody::new(kind, message.clone());
                match param {
                    Some(p) => b.with_param(p),
                    None => b,
                }
            }
            ApiError::Rule(r) => ErrorBody::from(r),
            ApiError::ModelNotFound(m) => ErrorBody::from(m),
            ApiError::NotFound(p) => ErrorBody::new(kind, format!("no route for {p}")),
            ApiError::MethodNotAllowed { .. } => ErrorBody::new(kind, self.to_string()),
            ApiError::Body(e) => e.body(),
            ApiError::PolicyReject { status, body } => policy_body(*status, body),
            ApiError::Policy(rngd_pool::PickError::NoEndpointInSubset) => {
                ErrorBody::new(kind, "no endpoint is eligible under the subset hint")
                    .with_code("no_endpoint_in_subset")
            }
            ApiError::Policy(_) => {
                ErrorBody::new(kind, "the routing policy failed on this request")
                    .with_code("policy_error")
            }
            ApiError::Tokenize(_) => {
                ErrorBody::new(kind, "the prompt could not be tokenized").with_param("prompt")
            }
            ApiError::Upstream {
                stage,
                address,
                detail,
                ..
            } => ErrorBody::new(
                kind,
                format!("{stage} stage failed: worker {address}: {detail}"),
            )
            .with_code(&format!("{stage}_failed")),
            ApiError::UpstreamStatus {
                stage,
                address,
                status: up,
                message,
                code,
                param,
            } => {
                if self.status().is_client_error() {
                    let mut b = ErrorBody::new(kind, message.clone());
                    if let Some(c) = code {
                        b = b.with_code(c);
                    }
                    if let Some(p) = param {
                        b = b.with_param(p);
                    }
                    b
                } else {
                    ErrorBody::new(
                        kind,
                        format!("{stage} stage failed: worker {address} answered {up}: {message}"),
                    )
                    .with_code(&format!("{stage}_failed"))
                }
            }
            ApiError::Timeout {
                stage,
                address,
                after_ms,
            } => ErrorBody::new(
                kind,
                format!(
                    "{stage} stage timed out: worker {address} did not answer within {after_ms} ms"
                ),
            )
            .with_code(&format!("{stage}_timeout")),
            ApiError::Internal(_) => ErrorBody::new(kind, "internal error"),
            ApiError::Overloaded { retry_after_s, .. } => ErrorBody::new(
                kind,
                format!("the server is at capacity; retry after {retry_after_s} s"),
            )
            .with_code("server_overloaded"),
        }
    }
}

/// The policy's local response body as an OpenAI error: passed through when it
/// already is one, wrapped otherwise.
fn policy_body(status: u16, body: &[u8]) -> ErrorBody {
    if let Ok(b) = serde_json::from_slice::<ErrorBody>(body) {
        return b;
    }
    let text = String::from_utf8_lossy(body);
    let text = text.trim();
    let message = if text.is_empty() {
        format!("request rejected by the routing policy (status {status})")
    } else {
        text.chars().take(1000).collect()
    };
    ErrorBody::new(ErrorBody::kind_for_status(status), message)
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        if status.is_server_error() {
            tracing::warn!(status = status.as_u16(), error = %self, cause = ?std::error::Error::source(&self), "request failed");
        } else {
            tracing::debug!(status = status.as_u16(), error = %self, "request refused");
        }
        let body = serde_json::to_vec(&self.body()).unwrap_or_else(|_| b"{\"error\":{}}".to_vec());
        let mut resp = (status, body).into_response();
        resp.headers_mut().insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if status == StatusCode::TOO_MANY_REQUESTS {
            let after = match &self {
                ApiError::Overloaded { retry_after_s, .. } => *retry_after_s,
                _ => 1,
            };
            resp.headers_mut()
                .insert(http::header::RETRY_AFTER, HeaderValue::from(after));
        }
        if let ApiError::Body(e) = &self {
            e.set_headers(resp.headers_mut());
        }
        resp
    }
}

// === impl From<Overloaded> ===

impl From<rngd_pool::admission::Overloaded> for ApiError {
    fn from(o: rngd_pool::admission::Overloaded) -> Self {
        ApiError::Overloaded {
            reason: o.reason,
            max_concurrent: o.max_concurrent,
            retry_after_s: o.retry_after_s,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses() {
        assert_eq!(ApiError::bad_request("x").status(), 400);
        let unknown = rngd_api::models::ServedModels::new("m", [])
            .check("x")
            .unwrap_err();
        assert_eq!(ApiError::ModelNotFound(unknown).status(), 404);
        let too_large = ApiError::from(rngd_http_edge::BodyError::TooLarge { limit: 1 });
        assert_eq!(too_large.status(), 413);
        assert_eq!(
            too_large.body().error.code.as_deref(),
            Some("request_too_large")
        );
        let trap = rngd_pool::PolicyFailure {
            status: 500,
            source: "trap".into(),
        };
        assert_eq!(
            ApiError::Policy(rngd_pool::PickError::Policy(trap)).status(),
            500
        );
        let off = rngd_pool::PickError::OffTable {
            address: "10.1.1.1:22".into(),
        };
        assert_eq!(ApiError::Policy(off).status(), 500);
        assert_eq!(
            ApiError::Policy(rngd_pool::PickError::NoEndpointInSubset).status(),
            503
        );
        let up = ApiError::Upstream {
            stage: Stage::Prefill,
            address: "a:1".into(),
            detail: "connection refused".into(),
            source: None,
        };
        assert_eq!(up.status(), 502);
        assert!(up.body().error.message.contains("prefill"));
        let t = ApiError::Timeout {
            stage: Stage::Decode,
            address: "a:1".into(),
            after_ms: 5,
        };
        assert_eq!(t.status(), 504);
        assert!(t.body().error.message.contains("decode"));
    }

    #[test]
    fn policy_reject_passes_status_and_json_through() {
        let body =
            serde_json::to_vec(&ErrorBody::new("invalid_request_error", "too long").with_code("c"))
                .unwrap();
        let e = ApiError::PolicyReject { status: 429, body };
        assert_eq!(e.status(), 429);
        assert_eq!(e.body().error.message, "too long");
        let e = ApiError::PolicyReject {
            status: 503,
            body: b"no endpoint".to_vec(),
        };
        assert_eq!(e.body().error.message, "no endpoint");
        assert_eq!(e.body().error.kind, "server_error");
    }

    #[test]
    fn upstream_client_errors_pass_through() {
        let e = ApiError::UpstreamStatus {
            stage: Stage::Decode,
            address: "a:1".into(),
            status: 400,
            message: "bad temperature".into(),
            code: None,
            param: Some("temperature".into()),
        };
        assert_eq!(e.status(), 400);
        assert_eq!(e.body().error.message, "bad temperature");
        assert_eq!(e.body().error.param.as_deref(), Some("temperature"));
        // A decode worker refusing KV that other weights made.
        let e = ApiError::UpstreamStatus {
            stage: Stage::Decode,
            address: "a:1".into(),
            status: 409,
            message: "the KV was computed by weight_version a, this worker serves b".into(),
            code: Some(rngd_api::pd::WEIGHT_VERSION_MISMATCH_CODE.into()),
            param: Some("kv_transfer_params".into()),
        };
        assert_eq!(e.status(), 409);
        let b = e.body();
        assert_eq!(b.error.kind, "invalid_request_error");
        assert_eq!(
            b.error.code.as_deref(),
            Some(rngd_api::pd::WEIGHT_VERSION_MISMATCH_CODE)
        );
        assert!(b.error.message.contains("weight_version a"));
        let e = ApiError::UpstreamStatus {
            stage: Stage::Prefill,
            address: "a:1".into(),
            status: 500,
            message: "boom".into(),
            code: None,
            param: None,
        };
        assert_eq!(e.status(), 502);
        assert!(e.body().error.message.contains("prefill stage failed"));
    }
}
