//! Errors: [`WorkerError`] (startup) and [`ApiError`] (one request), with the
//! single mapping from an [`ApiError`] to an HTTP status and OpenAI error body.

use std::time::Duration;

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use rngd_api::openai::{CONTEXT_LENGTH_CODE, ErrorBody};
use rngd_engine::EngineError;
use rngd_kv_transport::KvError;

/// Errors that stop a worker from starting or serving.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// A vendor backend this build does not include.
    #[error("backend {backend} needs the {vendor} runtime, which this build does not include")]
    BackendUnavailable {
        /// `rngd` or `atom`.
        backend: &'static str,
        /// `FuriosaAI` or `Rebellions`.
        vendor: &'static str,
    },
    /// The chip could not be chosen.
    #[error("device allocation failed")]
    Devices(#[source] Box<rngd_devices::DevicesError>),
    /// The model could not be found or loaded.
    #[error("loading the model failed")]
    Engine(#[source] Box<EngineError>),
    /// The default KV transport could not be created.
    #[error("KV transport `{name}` cannot be set up")]
    Transport {
        /// Transport name.
        name: String,
        /// Cause.
        #[source]
        source: Box<KvError>,
    },
    /// Metrics could not be registered.
    #[error("metrics setup failed")]
    Metrics(#[source] rngd_telemetry::TelemetryError),
    /// Binding or serving failed.
    #[error("{context}")]
    Io {
        /// What was being done.
        context: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A flag value that cannot work.
    #[error("invalid configuration: {0}")]
    Config(String),
}

/// Everything a request can fail with. [`ApiError::status`] is the one place
/// that decides the HTTP status.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// Malformed or unsupported input.
    #[error("{0}")]
    BadRequest(String),
    /// A request rule is broken (`rngd_api::rules`, the same at every door).
    #[error(transparent)]
    Rule(#[from] rngd_api::rules::RuleError),
    /// The request names a model this worker does not serve → 404
    /// `model_not_found`, naming the served ones.
    #[error(transparent)]
    ModelNotFound(#[from] rngd_api::models::ModelNotFound),
    /// No route for this path → 404 with a JSON body.
    #[error("no route for {0}")]
    NotFound(String),
    /// A route that exists, called with another method → 405.
    #[error("method {method} is not allowed on {path}")]
    MethodNotAllowed {
        /// The method as sent.
        method: String,
        /// The path, cut to 200 characters.
        path: String,
    },
    /// `prompt + max_tokens > S` (message from `context_length_message`).
    #[error("{0}")]
    ContextLength(String),
    /// The request asks this role for something it does not do.
    #[error("{0}")]
    WrongRole(String),
    /// The model is not loaded yet.
    #[error("the model is still loading; retry when GET /ready answers 200")]
    NotReady,
    /// A KV handle that cannot be verified or does not fit the model: nothing
    /// was pulled or deleted. The cause (the message's second part) says
    /// what is wrong.
    #[error("kv_transfer_params")]
    BadHandle(#[from] crate::handles::HandleError),
    /// A handle whose KV this worker already consumed (a decode pulled it)
    /// or released (`release_only`): refused at once, nothing pulled → 410.
    #[error("{}", handle_used(*.state, *.ago_ms))]
    KvHandleUsed {
        /// `Consumed` or `Released`.
        state: rngd_api::pd::HandleState,
        /// How long ago, ms.
        ago_ms: u64,
    },
    /// A verified handle whose KV cannot be loaded: its lease is over, or
    /// its transport no longer holds the KV. Refused before any wait or
    /// pull → 410, code `kv_unavailable` (the orchestrator recomputes or
    /// fails by its `kv_load_failure_policy`).
    #[error("the KV of this handle is not available: {detail}")]
    KvUnavailable {
        /// `expired` or `not_found` (the metric's label).
        reason: &'static str,
        /// What happened, for the message.
        detail: String,
    },
    /// A handle whose KV was made by other weights than this worker's (a
    /// verified handle: the prefill worker's own claim). The KV is released
    /// unpulled → 409.
    #[error(
        "the KV was computed by weight_version {}, this worker serves weight_version {ours}: prefill and decode must load the same weights",
        .theirs.as_deref().unwrap_or("(none)")
    )]
    WeightVersion {
        /// The prefill worker's version, as signed in the handle.
        theirs: Option<String>,
        /// This worker's version.
        ours: String,
    },
    /// A PD request this worker does not take from this client or without a
    /// KV secret.
    #[error("{0}")]
    PdRefused(String),
    /// Every engine slot is taken → 429 with `Retry-After`.
    #[error("this worker is at capacity ({limit} requests in flight); retry shortly")]
    Overloaded {
        /// `--max-in-flight`.
        limit: usize,
    },
    /// The body was not read (over the limit 413, too slow 408, past the
    /// listener's body budget 503, broken 400): `rngd_http_edge` decides
    /// its status, body and headers.
    #[error(transparent)]
    Body(#[from] rngd_http_edge::BodyError),
    /// A transport name this worker cannot create.
    #[error("KV transport `{name}` is not available on this worker")]
    UnknownTransport {
        /// The name asked for.
        name: String,
        /// Cause.
        #[source]
        source: Box<KvError>,
    },
    /// Pushing the KV cache failed (prefill side).
    #[error("KV push through transport `{transport}` failed for request {request_id}")]
    KvPush {
        /// Transport name.
        transport: String,
        /// Request id.
        request_id: String,
        /// Cause.
        #[source]
        source: Box<KvError>,
    },
    /// Pulling the KV cache failed (decode side).
    #[error("KV pull through transport `{transport}` failed for request {request_id}")]
    KvPull {
        /// Transport name.
        transport: String,
        /// Request id.
        request_id: String,
        /// Cause.
        #[source]
        source: Box<KvError>,
    },
    /// The KV cache did not arrive in time (decode side).
    #[error(
        "KV pull through transport `{transport}` timed out after {waited:?} for request {request_id}"
    )]
    KvPullTimeout {
        /// Transport name.
        transport: String,
        /// Request id.
        request_id: String,
        /// How long the decode waited.
        waited: Duration,
    },
    /// `x-prefiller-host-port` names no peer this worker may call (its
    /// `--prefill-allow` list): 403, or 400 for a malformed entry. Nothing
    /// is connected to.
    #[error("{}", prefill_refusal(.0))]
    PrefillRefused(crate::allow::PickError),
    /// The prefill peer could not be reached or answered garbage. The
    /// message names the peer and the stage, never the peer's body.
    #[error("prefill on {peer} failed for request {request_id} ({stage}): {detail}")]
    PrefillPeer {
        /// `host:port`.
        peer: String,
        /// Request id.
        request_id: String,
        /// Which step of the call: `connect`, `send`, `status`, `read`, `parse`.
        stage: &'static str,
        /// What happened (never the peer's body).
        detail: String,
        /// Cause, if any.
        #[source]
        source: Option<reqwest::Error>,
    },
    /// The prefill peer did not answer in time.
    #[error("prefill on {peer} did not answer within {after:?} for request {request_id}")]
    PrefillPeerTimeout {
        /// `host:port`.
        peer: String,
        /// Request id.
        request_id: String,
        /// The timeout.
        after: Duration,
    },
    /// The prefill peer refused the request with a 4xx and an OpenAI error
    /// body: its status and its `code` are passed through, its message is not.
    #[error("prefill on {peer} refused request {request_id}: prefill peer answered {status}{}", code.as_deref().map(|c| format!(" (code {c})")).unwrap_or_default())]
    PrefillPeerRejected {
        /// `host:port`.
        peer: String,
        /// Request id.
        request_id: String,
        /// Its status.
        status: u16,
        /// Its OpenAI error `code`, if it had a plausible one.
        code: Option<String>,
    },
    /// The engine failed.
    #[error("engine error")]
    Engine(#[source] Box<EngineError>),
    /// Anything else.
    #[error("{0}")]
    Internal(String),
}

/// `e`'s message with its causes appended (`: cause: cause`), as every
/// error body of the worker's listeners says it.
pub(crate) fn with_causes(e: &dyn std::error::Error) -> String {
    let mut msg = e.to_string();
    let mut src = e.source();
    while let Some(s) = src {
        msg.push_str(": ");
        msg.push_str(&s.to_string());
        src = s.source();
    }
    msg
}

/// Error code of a 403 for an `x-prefiller-host-port` outside `--prefill-allow`.
pub const PREFILLER_NOT_ALLOWED_CODE: &str = "prefiller_not_allowed";
/// Error code of a 400 for a malformed `x-prefiller-host-port` entry.
pub const PREFILLER_MALFORMED_CODE: &str = "invalid_prefiller_host_port";

fn handle_used(state: rngd_api::pd::HandleState, ago_ms: u64) -> String {
    match state {
        rngd_api::pd::HandleState::Released => format!(
            "the kv_handle's KV was released without a decode {ago_ms} ms ago (its orchestrator gave the request up); nothing was pulled"
        ),
        _ => format!(
            "the kv_handle's KV was already consumed by a decode on this worker {ago_ms} ms ago (a handle serves one decode); nothing was pulled"
        ),
    }
}

fn prefill_refusal(e: &crate::allow::PickError) -> String {
    use crate::allow::PickError;
    let h = rngd_api::headers::PREFILLER_HOST_PORT;
    match e {
        PickError::NoneAllowed => format!(
            "{h} is refused: this worker calls no prefill peer (its --prefill-allow list is empty)"
        ),
        PickError::Malformed { entry, reason } => {
            format!(
                "{h} entry `{entry}` is malformed ({reason}); expected HOST:PORT or [IPV6]:PORT"
            )
        }
        PickError::NotAllowed { first, count: 1 } => {
            format!("{h}: {first} is not in this worker's --prefill-allow list")
        }
        PickError::NotAllowed { first, count } => format!(
            "{h}: none of the {count} entries ({first}, ...) is in this worker's --prefill-allow list"
        ),
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> Self {
        match e {
            EngineError::ContextLength(m) => ApiError::ContextLength(m),
            EngineError::InvalidRequest(m) => ApiError::BadRequest(m),
            other => ApiError::Engine(Box::new(other)),
        }
    }
}

impl ApiError {
    /// The HTTP status of this error.
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::BadRequest(_)
            | ApiError::Rule(_)
            | ApiError::ContextLength(_)
            | ApiError::WrongRole(_) => StatusCode::BAD_REQUEST,
            ApiError::UnknownTransport { .. } => StatusCode::BAD_REQUEST,
            ApiError::NotReady => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::ModelNotFound(_) | ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::MethodNotAllowed { .. } => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::BadHandle(_) => StatusCode::BAD_REQUEST,
            ApiError::KvHandleUsed { .. } | ApiError::KvUnavailable { .. } => StatusCode::GONE,
            ApiError::WeightVersion { .. } => StatusCode::CONFLICT,
            ApiError::PdRefused(_) => StatusCode::FORBIDDEN,
            ApiError::Body(e) => e.status(),
            ApiError::Overloaded { .. } => StatusCode::TOO_MANY_REQUESTS,
            ApiError::KvPush { source, .. } | ApiError::KvPull { source, .. } => match **source {
                KvError::NotFound { .. } => StatusCode::GATEWAY_TIMEOUT,
                KvError::BadRequest { .. } => StatusCode::BAD_REQUEST,
                KvError::Capacity { .. } => StatusCode::SERVICE_UNAVAILABLE,
                KvError::Io { .. } | KvError::Config { .. } => StatusCode::INTERNAL_SERVER_ERROR,
                _ => StatusCode::BAD_GATEWAY,
            },
            ApiError::KvPullTimeout { .. } | ApiError::PrefillPeerTimeout { .. } => {
                StatusCode::GATEWAY_TIMEOUT
            }
            ApiError::PrefillRefused(crate::allow::PickError::Malformed { .. }) => {
                StatusCode::BAD_REQUEST
            }
            ApiError::PrefillRefused(_) => StatusCode::FORBIDDEN,
            ApiError::PrefillPeer { .. } => StatusCode::BAD_GATEWAY,
            ApiError::PrefillPeerRejected { status, .. } => {
                StatusCode::from_u16(*status).unwrap_or(StatusCode::BAD_GATEWAY)
            }
            ApiError::Engine(_) | ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The message, with the causes appended (`: cause: cause`).
    pub fn message(&self) -> String {
        with_causes(self)
    }

    /// The OpenAI error body.
    pub fn body(&self) -> ErrorBody {
        let status = self.status();
        let body = ErrorBody::new(ErrorBody::kind_for_status(status.as_u16()), self.message());
        match self {
            ApiError::ContextLength(_) => {
                body.with_code(CONTEXT_LENGTH_CODE).with_param("max_tokens")
            }
            ApiError::Rule(r) => ErrorBody::from(r),
            ApiError::ModelNotFound(m) => ErrorBody::from(m),
            ApiError::Body(e) => e.body(),
            ApiError::PrefillPeerRejected {
                code: Some(code), ..
            } => body.with_code(code),
            ApiError::PrefillRefused(crate::allow::PickError::Malformed { .. }) => {
                body.with_code(PREFILLER_MALFORMED_CODE)
            }
            ApiError::PrefillRefused(_) => body.with_code(PREFILLER_NOT_ALLOWED_CODE),
            ApiError::BadHandle(_) => body
                .with_code("invalid_kv_handle")
                .with_param("kv_transfer_params"),
            ApiError::KvHandleUsed { state, .. } => {
                ErrorBody::new("invalid_request_error", self.message())
                    .with_code(&format!("kv_handle_{}", state.as_str()))
                    .with_param("kv_transfer_params")
            }
            ApiError::KvUnavailable { .. } => body
                .with_code(rngd_api::pd::KV_UNAVAILABLE_CODE)
                .with_param("kv_transfer_params"),
            ApiError::WeightVersion { .. } => body
                .with_code(rngd_api::pd::WEIGHT_VERSION_MISMATCH_CODE)
                .with_param("kv_transfer_params"),
            ApiError::PdRefused(_) => body
                .with_code("pd_not_allowed")
                .with_param("kv_transfer_params"),
            ApiError::Overloaded { .. } => body.with_code("server_overloaded"),
            _ => body,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        if status.is_server_error() {
            tracing::warn!(status = status.as_u16(), error = %self.message(), "request failed");
        } else {
            tracing::debug!(status = status.as_u16(), error = %self.message(), "request refused");
        }
        let mut resp = (status, axum::Json(self.body())).into_response();
        if status == StatusCode::TOO_MANY_REQUESTS {
            resp.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from_static("1"),
            );
        }
        if let ApiError::Body(e) = &self {
            e.set_headers(resp.headers_mut());
        }
        resp
    }
}
