//! A request body read under a byte limit and a deadline, against the
//! listener's in-flight body-byte budget, and the failures of that read as
//! OpenAI error responses.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{FromRequest, Request};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::{Bytes, BytesMut};
use http::Extensions;
use http_body_util::BodyExt;
use rngd_api::openai::ErrorBody;

/// How a server bounds one request body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BodyLimits {
    /// Largest body, bytes (larger: 413, whatever `Content-Length` says).
    pub max_bytes: usize,
    /// Time the client has to send the whole body (then 408).
    pub deadline: Duration,
}

/// A server state that knows its body limits (for [`LimitedBody`]).
pub trait HasBodyLimits {
    /// The limits of a request body.
    fn body_limits(&self) -> BodyLimits;
}

impl<T: HasBodyLimits> HasBodyLimits for Arc<T> {
    fn body_limits(&self) -> BodyLimits {
        (**self).body_limits()
    }
}

/// The bytes of request bodies being read at once on one listener, and the
/// most there may be. [`crate::serve`] puts one in every request's
/// extensions; [`read_body`] reserves from it before it buffers.
#[derive(Debug, Clone)]
pub struct BodyBudget(Arc<BudgetInner>);

#[derive(Debug)]
struct BudgetInner {
    max: usize,
    used: AtomicUsize,
}

impl BodyBudget {
    /// A budget of `max` bytes.
    pub fn new(max: usize) -> Self {
        BodyBudget(Arc::new(BudgetInner {
            max,
            used: AtomicUsize::new(0),
        }))
    }

    /// Bytes reserved now.
    pub fn in_use(&self) -> usize {
        self.0.used.load(Ordering::Relaxed)
    }

    /// The most there may be.
    pub fn max(&self) -> usize {
        self.0.max
    }

    fn try_take(&self, n: usize) -> bool {
        self.0
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(n).filter(|t| *t <= self.0.max)
            })
            .is_ok()
    }
}

/// Bytes reserved from a [`BodyBudget`], given back on drop.
#[derive(Debug)]
struct Reservation {
    budget: BodyBudget,
    bytes: usize,
}

impl Reservation {
    fn grow(&mut self, n: usize) -> bool {
        let ok = self.budget.try_take(n);
        if ok {
            self.bytes += n;
        }
        ok
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.budget.0.used.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

/// A whole request body; its bytes stay counted in the listener's budget
/// until this is dropped.
#[derive(Debug)]
pub struct Buffered {
    bytes: Bytes,
    _reserved: Option<Reservation>,
}

impl Buffered {
    /// The bytes.
    pub fn bytes(&self) -> &Bytes {
        &self.bytes
    }
}

impl AsRef<[u8]> for Buffered {
    fn as_ref(&self) -> &[u8] {
        &self.bytes
    }
}

impl std::ops::Deref for Buffered {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.bytes
    }
}

/// Why a body was not read.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    /// Larger than the limit → 413.
    #[error("request body exceeds the limit of {limit} bytes")]
    TooLarge {
        /// The limit, bytes.
        limit: usize,
    },
    /// Not received within the deadline → 408.
    #[error("the request body did not arrive within {} ms", .after.as_millis())]
    Timeout {
        /// The deadline.
        after: Duration,
    },
    /// The listener's in-flight body budget cannot hold it → 503 with
    /// `Retry-After`.
    #[error("the server is reading too many request bodies at once ({max} bytes); retry shortly")]
    Busy {
        /// The budget, bytes.
        max: usize,
    },
    /// The connection failed while the body was read → 400.
    #[error("the request body could not be read")]
    Read(#[source] axum::Error),
    /// `Content-Type` names something other than JSON → 415, before a byte
    /// of the body is read.
    #[error("the request body must be JSON (Content-Type: application/json), not {got}")]
    NotJson {
        /// The media type as sent, cut to 64 characters.
        got: String,
    },
}

impl BodyError {
    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        match self {
            BodyError::TooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            BodyError::Timeout { .. } => StatusCode::REQUEST_TIMEOUT,
            BodyError::Busy { .. } => StatusCode::SERVICE_UNAVAILABLE,
            BodyError::Read(_) => StatusCode::BAD_REQUEST,
            BodyError::NotJson { .. } => StatusCode::UNSUPPORTED_MEDIA_TYPE,
        }
    }

    /// The OpenAI error body.
    pub fn body(&self) -> ErrorBody {
        let body = ErrorBody::new(
            ErrorBody::kind_for_status(self.status().as_u16()),
            self.to_string(),
        );
        match self {
            BodyError::TooLarge { .. } => body.with_code("request_too_large"),
            BodyError::Timeout { .. } => body.with_code("request_timeout"),
            BodyError::Busy { .. } => body.with_code("server_overloaded"),
            BodyError::Read(_) => body,
            BodyError::NotJson { .. } => body.with_code("unsupported_media_type"),
        }
    }

    /// The headers the answer carries: `Connection: close` (the body was not
    /// read to its end, the connection cannot serve another request), and
    /// `Retry-After` on a 503.
    pub fn set_headers(&self, headers: &mut HeaderMap) {
        headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
        if matches!(self, BodyError::Busy { .. }) {
            headers.insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
    }
}

impl IntoResponse for BodyError {
    fn into_response(self) -> Response {
        let mut resp = (self.status(), axum::Json(self.body())).into_response();
        self.set_headers(resp.headers_mut());
        resp
    }
}

fn content_length(headers: &HeaderMap) -> Option<u64> {
    headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
}

/// `Ok` for a request whose `Content-Type` is JSON or absent
/// ([`rngd_api::rules::json_content_type`]); anything else (`text/plain`, a
/// form) is [`BodyError::NotJson`].
pub fn check_json_content_type(headers: &HeaderMap) -> Result<(), BodyError> {
    let Some(v) = headers.get(header::CONTENT_TYPE) else {
        return Ok(());
    };
    let raw = String::from_utf8_lossy(v.as_bytes());
    if rngd_api::rules::json_content_type(&raw) {
        return Ok(());
    }
    Err(BodyError::NotJson {
        got: raw.chars().take(64).collect(),
    })
}

/// Reads `body` whole under `limits`: over the limit is [`BodyError::TooLarge`]
/// (at once when `Content-Length` says so), past the deadline
/// [`BodyError::Timeout`]. When `extensions` hold the listener's
/// [`BodyBudget`], the declared length is reserved from it before anything is
/// read (a chunked body reserves chunk by chunk); what does not fit is
/// [`BodyError::Busy`], with nothing buffered. A body whose `Content-Type`
/// is not JSON is refused before anything is read
/// ([`check_json_content_type`]).
pub async fn read_body(
    headers: &HeaderMap,
    extensions: &Extensions,
    body: Body,
    limits: BodyLimits,
) -> Result<Buffered, BodyError> {
    check_json_content_type(headers)?;
    let limit = limits.max_bytes;
    let declared = content_length(headers);
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(BodyError::TooLarge { limit });
    }
    let declared = declared.unwrap_or(0) as usize;
    let mut reserved = match extensions.get::<BodyBudget>() {
        Some(budget) => {
            let mut r = Reservation {
                budget: budget.clone(),
                bytes: 0,
            };
            if !r.grow(declared) {
                return Err(BodyError::Busy { max: budget.max() });
            }
            Some(r)
        }
        None => None,
    };
    let read = async {
        let mut body = body;
        let mut buf = BytesMut::with_capacity(declared);
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(BodyError::Read)?;
            let Ok(data) = frame.into_data() else {
                continue;
            };
            let len = buf.len() + data.len();
            if len > limit {
                return Err(BodyError::TooLarge { limit });
            }
            if let Some(r) = reserved.as_mut()
                && len > r.bytes
                && !r.grow(len - r.bytes)
            {
                return Err(BodyError::Busy {
                    max: r.budget.max(),
                });
            }
            buf.extend_from_slice(&data);
        }
        Ok(buf.freeze())
    };
    match tokio::time::timeout(limits.deadline, read).await {
        Err(_) => Err(BodyError::Timeout {
            after: limits.deadline,
        }),
        Ok(Err(e)) => Err(e),
        Ok(Ok(bytes)) => Ok(Buffered {
            bytes,
            _reserved: reserved,
        }),
    }
}

/// The request body as an extractor: [`read_body`] under the state's
/// [`HasBodyLimits`]; the rejection is the [`BodyError`] (its OpenAI
/// answer). Take `Result<LimitedBody, BodyError>` to answer it yourself.
#[derive(Debug)]
pub struct LimitedBody(pub Buffered);

impl<S> FromRequest<S> for LimitedBody
where
    S: HasBodyLimits + Send + Sync,
{
    type Rejection = BodyError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let (parts, body) = req.into_parts();
        read_body(&parts.headers, &parts.extensions, body, state.body_limits())
            .await
            .map(LimitedBody)
    }
}
