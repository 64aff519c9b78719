//! Draining a listener when it is told to stop: the stages ([`Stage`]), the
//! count of API requests in flight, and what a request meets at each stage.
//!
//! - **Serving**: every request is served.
//! - **Draining** (from the shutdown signal on): `/ready` answers 503, every
//!   new API request (any path outside [`crate::api_key::OPEN_PATHS`]) gets a
//!   503 `shutting_down` with `Connection: close`, the probes and metrics
//!   still answer, and the requests already in flight run on.
//! - **Aborting** (once [`crate::Options::shutdown_timeout`] has passed with
//!   requests still in flight): a handler still working is dropped (as when
//!   its client goes away, so its slots are freed) and answered 503; an event
//!   stream being sent ends with one error event and `data: [DONE]`.
//!
//! The accept loop in `serve.rs` moves the stages; this module owns what
//! they mean for one request.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::{HeaderValue, StatusCode, header};
use http_body::{Frame, SizeHint};
use rngd_api::openai::ErrorBody;
use tokio::sync::watch;

/// Where a listener is in its shutdown.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Stage {
    /// Every request is served.
    Serving,
    /// New API requests are refused; those in flight run on.
    Draining,
    /// Those still in flight are cut.
    Aborting,
}

/// The `code` of every 503 a drain sends.
pub const SHUTTING_DOWN: &str = "shutting_down";

/// One listener's drain: its stage and its API requests in flight.
#[derive(Debug, Clone)]
pub(crate) struct Drain {
    stage: Arc<watch::Sender<Stage>>,
    inflight: Arc<watch::Sender<usize>>,
}

// === impl Drain ===

impl Drain {
    pub(crate) fn new() -> Self {
        Drain {
            stage: Arc::new(watch::Sender::new(Stage::Serving)),
            inflight: Arc::new(watch::Sender::new(0)),
        }
    }

    pub(crate) fn stage(&self) -> Stage {
        *self.stage.borrow()
    }

    /// Moves forward to `to` (never back).
    pub(crate) fn advance(&self, to: Stage) {
        self.stage.send_if_modified(|s| {
            let later = to > *s;
            if later {
                *s = to;
            }
            later
        });
    }

    /// Resolves once the stage is [`Stage::Aborting`]; owns what it needs.
    pub(crate) fn aborting(&self) -> impl Future<Output = ()> + Send + 'static {
        let mut rx = self.stage.subscribe();
        async move {
            // A closed channel cannot happen while `self` lives; treat it as
            // "never".
            if rx.wait_for(|s| *s == Stage::Aborting).await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    }

    /// Counts one API request in flight until the ticket is dropped.
    pub(crate) fn enter(&self) -> Ticket {
        self.inflight.send_modify(|n| *n += 1);
        Ticket(self.inflight.clone())
    }

    /// API requests in flight.
    pub(crate) fn inflight(&self) -> usize {
        *self.inflight.borrow()
    }

    /// Resolves once no API request is in flight.
    pub(crate) async fn idle(&self) {
        let mut rx = self.inflight.subscribe();
        let _ = rx.wait_for(|n| *n == 0).await;
    }
}

/// One API request in flight (see [`Drain::enter`]).
#[derive(Debug)]
pub(crate) struct Ticket(Arc<watch::Sender<usize>>);

impl Drop for Ticket {
    fn drop(&mut self) {
        self.0.send_modify(|n| *n = n.saturating_sub(1));
    }
}

// === what a request meets ===

/// The answer to a request that arrives while the listener drains, if it is
/// not served: `/ready` says 503, an API request gets the `shutting_down`
/// body. `None`: serve it (a probe, the metrics, the version).
pub(crate) fn refusal(path: &str) -> Option<Response> {
    if path == "/ready" {
        return Some((StatusCode::SERVICE_UNAVAILABLE, "draining").into_response());
    }
    if crate::api_key::OPEN_PATHS.contains(&path) {
        return None;
    }
    Some(unavailable(
        "the server is shutting down and takes no new request; send it to another replica",
    ))
}

/// The 503 of a request whose handler was still working when the shutdown
/// timeout passed.
pub(crate) fn cut_short() -> Response {
    unavailable("the server shut down before this request finished (--shutdown-timeout passed)")
}

fn unavailable(message: &str) -> Response {
    let body = ErrorBody::new(ErrorBody::kind_for_status(503), message).with_code(SHUTTING_DOWN);
    let mut resp = (StatusCode::SERVICE_UNAVAILABLE, axum::Json(body)).into_response();
    resp.headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    resp
}

/// Whether `resp` is a server-sent event stream (cut with an error event).
pub(crate) fn is_event_stream(resp: &Response) -> bool {
    resp.headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"))
}

/// The last frame of a stream cut by the shutdown timeout: an error event in
/// the shape every mid-stream error has, then `[DONE]`.
fn cut_events() -> Bytes {
    let body = ErrorBody::new(
        ErrorBody::kind_for_status(503),
        "the server shut down before this stream finished (--shutdown-timeout passed)",
    )
    .with_code(SHUTTING_DOWN);
    let json = serde_json::to_string(&body).unwrap_or_default();
    Bytes::from(format!("data: {json}\n\ndata: [DONE]\n\n"))
}

/// An event stream that, once the drain aborts, drops its source (which
/// cancels the generation behind it) and ends with [`cut_events`]. The
/// source's frames are whole events (axum's `Sse` and the gateway's relay
/// both send one event per frame), so the cut falls between two events.
pub(crate) struct CutOnAbort {
    inner: Option<Body>,
    abort: Pin<Box<dyn Future<Output = ()> + Send>>,
}

impl CutOnAbort {
    pub(crate) fn new(inner: Body, drain: &Drain) -> Self {
        CutOnAbort {
            inner: Some(inner),
            abort: Box::pin(drain.aborting()),
        }
    }
}

impl http_body::Body for CutOnAbort {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let this = &mut *self;
        if this.inner.is_none() {
            return Poll::Ready(None);
        }
        if this.abort.as_mut().poll(cx).is_ready() {
            this.inner = None;
            tracing::warn!("shutdown timeout: cutting a stream in flight");
            return Poll::Ready(Some(Ok(Frame::data(cut_events()))));
        }
        let Some(inner) = this.inner.as_mut() else {
            return Poll::Ready(None);
        };
        match Pin::new(inner).poll_frame(cx) {
            Poll::Ready(None) => {
                this.inner = None;
                Poll::Ready(None)
            }
            other => other,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.as_ref().is_none_or(|b| b.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    #[tokio::test]
    async fn the_stages_only_move_forward_and_tickets_count() {
        let d = Drain::new();
        assert_eq!(d.stage(), Stage::Serving);
        let a = d.enter();
        let b = d.enter();
        assert_eq!(d.inflight(), 2);
        d.advance(Stage::Aborting);
        d.advance(Stage::Draining);
        assert_eq!(d.stage(), Stage::Aborting);
        d.aborting().await;
        drop(a);
        assert_eq!(d.inflight(), 1);
        drop(b);
        d.idle().await;
    }

    #[test]
    fn probes_stay_open_ready_says_503_and_api_paths_are_refused() {
        assert!(refusal("/health").is_none());
        assert!(refusal("/metrics").is_none());
        let ready = refusal("/ready").expect("ready refused");
        assert_eq!(ready.status(), StatusCode::SERVICE_UNAVAILABLE);
        let api = refusal("/v1/completions").expect("api refused");
        assert_eq!(api.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(api.headers()[header::CONNECTION], "close");
    }

    #[tokio::test]
    async fn an_aborted_stream_ends_with_an_error_event_then_done() {
        let d = Drain::new();
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(4);
        tx.send(Ok(Bytes::from_static(b"data: {\"a\":1}\n\n")))
            .await
            .unwrap();
        let inner = Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx));
        let mut cut = CutOnAbort::new(inner, &d);
        let first = cut.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(&first[..], b"data: {\"a\":1}\n\n");
        d.advance(Stage::Aborting);
        let last = cut.frame().await.unwrap().unwrap().into_data().unwrap();
        let text = String::from_utf8(last.to_vec()).unwrap();
        assert!(text.contains("\"code\":\"shutting_down\""), "{text}");
        assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
        assert!(cut.frame().await.is_none());
        // The source was dropped: its sender sees the receiver gone.
        assert!(tx.is_closed());
    }
}
