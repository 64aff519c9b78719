//! The slot-holding response body: a response whose body keeps a guard (an
//! admission slot, an engine slot, a connection's in-flight mark) alive until
//! the body is sent or dropped.

use std::pin::Pin;
use std::task::{Context, Poll};

use axum::body::Body;
use axum::response::Response;
use bytes::Bytes;
use http_body::{Frame, SizeHint};

/// A body that holds `G` until it is dropped (sent to its end, or abandoned
/// by a client that went away). Its size hint is the inner body's, so a
/// whole (JSON) answer keeps its `Content-Length`.
#[derive(Debug)]
pub struct Held<G> {
    inner: Body,
    _guard: G,
}

impl<G> Held<G> {
    /// `inner`, holding `guard`.
    pub fn new(inner: Body, guard: G) -> Self {
        Held {
            inner,
            _guard: guard,
        }
    }
}

impl<G: Unpin> http_body::Body for Held<G> {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// `resp` with `guard` held until its body is sent or dropped.
pub fn hold_until_sent<G>(resp: Response, guard: G) -> Response
where
    G: Send + Unpin + 'static,
{
    resp.map(|body| Body::new(Held::new(body, guard)))
}
