//! The `envoy.service.ext_proc.v3.ExternalProcessor` gRPC service: one
//! [`super::StreamState`] per stream, driven by the inbound messages and
//! polled by the gRPC stream's own task.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::Arc;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessor;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    ProcessingRequest, ProcessingResponse, processing_request,
};
use futures::{Stream, StreamExt};
use rngd_api::headers;
use tracing::Instrument;

use crate::picker::Picker;

use super::{ProcessorConfig, StreamState};

/// The `envoy.service.ext_proc.v3.ExternalProcessor` gRPC service.
#[derive(Debug, Clone)]
pub struct ExtProcService {
    picker: Arc<Picker>,
    config: ProcessorConfig,
}

impl ExtProcService {
    /// A service picking with `picker`.
    pub fn new(picker: Arc<Picker>, config: ProcessorConfig) -> Self {
        ExtProcService { picker, config }
    }
}

/// Name and end-of-stream flag of a message, for logs.
pub(super) fn message_kind(msg: &ProcessingRequest) -> &'static str {
    use processing_request::Request as R;
    match &msg.request {
        Some(R::RequestHeaders(h)) if h.end_of_stream => "request_headers(eos)",
        Some(R::RequestHeaders(_)) => "request_headers",
        Some(R::RequestBody(b)) if b.end_of_stream => "request_body(eos)",
        Some(R::RequestBody(_)) => "request_body",
        Some(R::RequestTrailers(_)) => "request_trailers",
        Some(R::ResponseHeaders(h)) if h.end_of_stream => "response_headers(eos)",
        Some(R::ResponseHeaders(_)) => "response_headers",
        Some(R::ResponseBody(b)) if b.end_of_stream => "response_body(eos)",
        Some(R::ResponseBody(_)) => "response_body",
        Some(R::ResponseTrailers(_)) => "response_trailers",
        None => "empty",
    }
}

/// The response stream of one `ext_proc` call: the state machine driven by the
/// inbound messages, polled by the gRPC stream's own task (no extra task or
/// channel between Envoy's message and our answer).
pub type ResponseStream =
    Pin<Box<dyn Stream<Item = Result<ProcessingResponse, tonic::Status>> + Send + 'static>>;

/// What the response stream carries between polls.
struct Driver<S> {
    inbound: S,
    state: StreamState,
    picker: Arc<Picker>,
    /// Answers produced but not yet handed to the transport.
    pending: VecDeque<ProcessingResponse>,
    /// An immediate response went out: end after `pending`.
    closing: bool,
    span: tracing::Span,
}

/// Runs the state machine over `inbound`: every answer a message allows is
/// yielded before the next message is read (full duplex never waits for more
/// input to answer what it can), and the stream ends after an immediate
/// response or when Envoy half-closes.
pub fn respond<S>(inbound: S, picker: Arc<Picker>, config: ProcessorConfig) -> ResponseStream
where
    S: Stream<Item = Result<ProcessingRequest, tonic::Status>> + Send + Unpin + 'static,
{
    let driver = Driver {
        inbound,
        state: StreamState::new(config),
        picker,
        pending: VecDeque::new(),
        closing: false,
        span: tracing::info_span!("ext_proc", request_id = tracing::field::Empty),
    };
    Box::pin(futures::stream::unfold(driver, |mut d| async move {
        loop {
            if let Some(r) = d.pending.pop_front() {
                return Some((Ok(r), d));
            }
            if d.closing {
                return None;
            }
            let idle = d.state.idle_timeout();
            let next = match tokio::time::timeout(idle, d.inbound.next()).await {
                Ok(n) => n,
                Err(_) => {
                    // A stalled stream holds buffered state: end it; Envoy
                    // fails the request (closed).
                    tracing::warn!(parent: &d.span, idle_ms = idle.as_millis() as u64, "ext_proc stream idle too long; ended");
                    d.closing = true;
                    let status = tonic::Status::deadline_exceeded(format!(
                        "no ext_proc message for {} ms",
                        idle.as_millis()
                    ));
                    return Some((Err(status), d));
                }
            };
            let msg = match next {
                Some(Ok(m)) => m,
                None => return None,
                Some(Err(status)) => {
                    let _g = d.span.enter();
                    tracing::debug!(%status, "ext_proc stream ended by the client");
                    return None;
                }
            };
            let first = matches!(
                msg.request,
                Some(processing_request::Request::RequestHeaders(_))
            );
            tracing::trace!(parent: &d.span, message = message_kind(&msg), "ext_proc message");
            let step = d
                .state
                .handle(msg, &d.picker)
                .instrument(d.span.clone())
                .await;
            if first && let Some(id) = d.state.header(headers::REQUEST_ID) {
                d.span.record("request_id", id);
            }
            d.pending.extend(step.responses);
            d.closing = step.close;
        }
    }))
}

#[tonic::async_trait]
impl ExternalProcessor for ExtProcService {
    type ProcessStream = ResponseStream;

    async fn process(
        &self,
        request: tonic::Request<tonic::Streaming<ProcessingRequest>>,
    ) -> Result<tonic::Response<Self::ProcessStream>, tonic::Status> {
        Ok(tonic::Response::new(respond(
            request.into_inner(),
            Arc::clone(&self.picker),
            self.config,
        )))
    }
}
