//! The `ext_proc` stream state machine, as GIE's endpoint picker runs it.
//!
//! Request path, `FULL_DUPLEX_STREAMED` (primary): headers are held; body chunks
//! are buffered until `end_of_stream` (or the trailers); then the pick runs and
//! the server sends the request-headers response (destination header,
//! `content-length`, `clear_route_cache`, `envoy.lb` dynamic metadata) followed
//! by the body as streamed body mutations of at most [`MAX_CHUNK`] bytes, the
//! last one with `end_of_stream`. Headers with `end_of_stream` (a GET) are
//! answered at once.
//!
//! Request path, `BUFFERED`: the headers are answered with CONTINUE; the single
//! body message is answered with a body response carrying the header mutation,
//! `clear_route_cache` and the dynamic metadata.
//!
//! Response path: headers pass through; body chunks are echoed (full duplex)
//! or continued (other modes); trailers pass through. A rejection is an
//! `ImmediateResponse`, after which the stream is closed.
//!
//! Bounds, before anything is buffered: a declared `content-length` over
//! [`ProcessorConfig::max_body_bytes`] is a 413 at the headers; then the
//! request takes an admission slot (429 with `Retry-After` when the queue is
//! full or its wait runs out) and reserves its declared body bytes from the
//! global budget (429 past it); a body without a declared length grows its
//! reservation chunk by chunk and is refused (413 or 429) as soon as it
//! passes either bound. Slot and reservation are released at the pick.
//! The subset hint is read only from Envoy's filter metadata, never from a
//! request header.
//!
//! - this module: the per-stream state machine ([`StreamState`]);
//! - [`wire`]: the Envoy messages it reads and writes (header mutations,
//!   `envoy.lb` metadata, immediate responses, streamed body chunks);
//! - [`service`]: the gRPC service that drives one state machine per stream.

mod service;
mod wire;

use std::time::Instant;

use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyResponse, CommonResponse, HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse,
    TrailersResponse, processing_request, processing_response,
};
use rngd_policy_core::{Decision, LocalResponse};
use rngd_pool::admission::{BodyReservation, Slot};

use crate::metrics::{Answered, EppMetrics, cached_tokens, completion_tokens};
use crate::picker::{PickInput, Picker, overloaded_response, too_large_response};
pub use service::{ExtProcService, ResponseStream, respond};
pub use wire::immediate;
use wire::{
    header_pairs, lb_metadata, mode_of, request_headers_response, response_headers, routed_common,
    streamed_body, subset_from_metadata,
};

/// Largest body chunk re-sent to Envoy (GIE's limit, below Envoy's 64 KiB buffers).
pub const MAX_CHUNK: usize = 62_000;
/// Filter-metadata namespace of the subset hint.
pub const SUBSET_HINT_NAMESPACE: &str = "envoy.lb.subset_hint";
/// Default largest request body buffered for a pick: the one default of
/// both doors ([`rngd_pool::admission::DEFAULT_MAX_BODY_BYTES`], 1 MiB).
pub const DEFAULT_MAX_BODY: usize = rngd_pool::admission::DEFAULT_MAX_BODY_BYTES;

/// Limits of the state machine.
#[derive(Debug, Clone, Copy)]
pub struct ProcessorConfig {
    /// Largest request body buffered (larger, declared or received → 413
    /// before it is buffered whole).
    pub max_body_bytes: usize,
    /// Size of the re-sent body chunks (at most [`MAX_CHUNK`]).
    pub chunk_size: usize,
    /// Longest wait for Envoy's next message before the pick (headers to the
    /// end of the request body): a stalled request stream is ended with
    /// `DEADLINE_EXCEEDED` (Envoy then fails the request, closed).
    pub request_idle_timeout: std::time::Duration,
    /// Longest wait for Envoy's next message after the pick (the response
    /// path: as long as the slowest gap between two streamed tokens may be).
    pub response_idle_timeout: std::time::Duration,
}

/// Default of [`ProcessorConfig::request_idle_timeout`].
pub const DEFAULT_REQUEST_IDLE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);
/// Default of [`ProcessorConfig::response_idle_timeout`].
pub const DEFAULT_RESPONSE_IDLE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(600);

impl Default for ProcessorConfig {
    fn default() -> Self {
        ProcessorConfig {
            max_body_bytes: DEFAULT_MAX_BODY,
            chunk_size: MAX_CHUNK,
            request_idle_timeout: DEFAULT_REQUEST_IDLE_TIMEOUT,
            response_idle_timeout: DEFAULT_RESPONSE_IDLE_TIMEOUT,
        }
    }
}

/// What the stream does after a message.
#[derive(Debug, Default)]
pub struct Step {
    /// Responses to send, in order.
    pub responses: Vec<ProcessingResponse>,
    /// Close the stream after sending (an immediate response went out).
    pub close: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Waiting for request headers.
    Start,
    /// Headers held, body being buffered (full duplex) or awaited (buffered).
    Body,
    /// Pick done; request forwarded.
    Routed,
}

/// The state of one `ext_proc` stream (one HTTP request/response).
#[derive(Debug)]
pub struct StreamState {
    config: ProcessorConfig,
    request_mode: BodySendMode,
    response_mode: BodySendMode,
    phase: Phase,
    headers: Vec<(String, String)>,
    subset: Option<Vec<String>>,
    body: Vec<u8>,
    /// Destination picked (for logs).
    pub destination: Option<String>,
    /// The policy's reason for the route, added to the response headers
    /// (`x-rngd-pd-route-reason`).
    reason: Option<String>,
    /// A routed request not answered yet (for the per-model metrics).
    open: Option<OpenRequest>,
    /// The admission slot, held from the headers to the pick.
    slot: Option<Slot>,
    /// Body bytes reserved from the global budget, held to the pick.
    reserved: Option<BodyReservation>,
}

/// Longest response tail kept to read its `usage`.
const USAGE_TAIL: usize = 4096;

/// A routed request whose response is still passing through; dropped (with
/// the stream, or at the response's end) it records the answer's metrics.
#[derive(Debug)]
struct OpenRequest {
    metrics: EppMetrics,
    model: String,
    since: Instant,
    answered: Answered,
    tail: Vec<u8>,
    /// The request's count on its decode endpoint (`rngd_pool::inflight`),
    /// given back with this.
    _held: Option<rngd_pool::Held>,
    /// The router's cache prediction where the request is prefilled,
    /// held against the answer's `cached_tokens` when its usage passed
    /// (`rngd_pool::predicted`).
    expected: Option<rngd_pool::Expected>,
}

impl OpenRequest {
    fn body(&mut self, chunk: &[u8]) {
        self.answered.response_bytes += chunk.len() as u64;
        self.tail.extend_from_slice(chunk);
        if self.tail.len() > USAGE_TAIL {
            let cut = self.tail.len() - USAGE_TAIL;
            self.tail.drain(..cut);
        }
    }
}

impl Drop for OpenRequest {
    fn drop(&mut self) {
        self.answered.output_tokens = completion_tokens(&self.tail);
        // Only an answer whose usage passed says what the engine served.
        if let (Some(e), Some(_)) = (self.expected.take(), self.answered.output_tokens) {
            e.served(cached_tokens(&self.tail).unwrap_or(0) as usize);
        }
        self.metrics
            .answered(&self.model, self.since.elapsed(), &self.answered);
    }
}

impl StreamState {
    /// A fresh stream.
    pub fn new(config: ProcessorConfig) -> Self {
        StreamState {
            config,
            request_mode: BodySendMode::FullDuplexStreamed,
            response_mode: BodySendMode::FullDuplexStreamed,
            phase: Phase::Start,
            headers: Vec::new(),
            subset: None,
            body: Vec::new(),
            destination: None,
            reason: None,
            open: None,
            slot: None,
            reserved: None,
        }
    }

    /// An immediate answer that ends the stream, counted as a pick result.
    fn refuse(&mut self, picker: &Picker, local: LocalResponse) -> Step {
        self.slot = None;
        self.reserved = None;
        self.body = Vec::new();
        picker.count_refusal(&local);
        tracing::info!(status = local.status, "refused before the pick");
        Step {
            responses: vec![immediate(&local)],
            close: true,
        }
    }

    /// The admission of a request that comes with a body: its declared
    /// length checked, a slot taken, its declared bytes reserved.
    async fn admit(&mut self, picker: &Picker) -> Result<(), LocalResponse> {
        let max = self.config.max_body_bytes;
        // Envoy refuses a malformed content-length itself; one that does not
        // parse here counts as undeclared (the received bytes are bounded).
        let declared = self
            .header("content-length")
            .and_then(|v| v.trim().parse::<u64>().ok());
        if let Some(n) = declared
            && n > max as u64
        {
            return Err(too_large_response(max));
        }
        let slot = picker
            .admission()
            .admit()
            .await
            .map_err(|o| overloaded_response(&o))?;
        let reserved = picker
            .admission()
            .reserve_body(declared.unwrap_or(0) as usize)
            .map_err(|o| overloaded_response(&o))?;
        self.slot = Some(slot);
        self.reserved = Some(reserved);
        Ok(())
    }

    /// How long the next message may take (before or after the pick).
    pub fn idle_timeout(&self) -> std::time::Duration {
        if self.phase == Phase::Routed {
            self.config.response_idle_timeout
        } else {
            self.config.request_idle_timeout
        }
    }

    /// Value of a request header (lower-case name).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// Handles one message from Envoy.
    pub async fn handle(&mut self, msg: ProcessingRequest, picker: &Picker) -> Step {
        if let Some(pc) = &msg.protocol_config {
            self.request_mode = mode_of(pc.request_body_mode);
            self.response_mode = mode_of(pc.response_body_mode);
        }
        if let Some(md) = &msg.metadata_context
            && let Some(s) = subset_from_metadata(md)
        {
            self.subset = Some(s);
        }
        let Some(req) = msg.request else {
            return Step::default();
        };
        match req {
            processing_request::Request::RequestHeaders(h) => {
                self.on_request_headers(h, picker).await
            }
            processing_request::Request::RequestBody(b) => self.on_request_body(b, picker).await,
            processing_request::Request::RequestTrailers(_) => {
                let mut step = Step::default();
                if self.phase == Phase::Body
                    && self.request_mode == BodySendMode::FullDuplexStreamed
                {
                    // Trailers end the body: pick now; the body's last chunk stays open.
                    step = self.finish_full_duplex(picker, false).await;
                    if step.close {
                        return step;
                    }
                }
                step.responses.push(ProcessingResponse {
                    response: Some(processing_response::Response::RequestTrailers(
                        TrailersResponse::default(),
                    )),
                    ..Default::default()
                });
                step
            }
            processing_request::Request::ResponseHeaders(h) => {
                if h.end_of_stream {
                    self.open = None;
                }
                Step {
                    responses: vec![ProcessingResponse {
                        response: Some(processing_response::Response::ResponseHeaders(
                            response_headers(self.reason.take().as_deref()),
                        )),
                        ..Default::default()
                    }],
                    close: false,
                }
            }
            processing_request::Request::ResponseBody(b) => {
                if let Some(o) = &mut self.open {
                    o.body(&b.body);
                }
                if b.end_of_stream {
                    self.open = None;
                }
                Step {
                    responses: vec![if self.response_mode == BodySendMode::FullDuplexStreamed {
                        streamed_body(b.body, b.end_of_stream, false)
                    } else {
                        ProcessingResponse {
                            response: Some(processing_response::Response::ResponseBody(
                                BodyResponse::default(),
                            )),
                            ..Default::default()
                        }
                    }],
                    close: false,
                }
            }
            processing_request::Request::ResponseTrailers(_) => Step {
                responses: vec![ProcessingResponse {
                    response: Some(processing_response::Response::ResponseTrailers(
                        TrailersResponse::default(),
                    )),
                    ..Default::default()
                }],
                close: false,
            },
        }
    }

    async fn on_request_headers(&mut self, h: HttpHeaders, picker: &Picker) -> Step {
        self.headers = header_pairs(&h);
        let no_body_visible = h.end_of_stream || self.request_mode == BodySendMode::None;
        if no_body_visible {
            let pick = self.pick(picker, None).await;
            return match pick {
                Decision::Route(route) => {
                    self.phase = Phase::Routed;
                    let dest = route.decode.clone();
                    Step {
                        responses: vec![ProcessingResponse {
                            response: Some(request_headers_response(routed_common(
                                &route,
                                None,
                                &self.headers,
                            ))),
                            dynamic_metadata: Some(lb_metadata(&dest)),
                            ..Default::default()
                        }],
                        close: false,
                    }
                }
                Decision::Reject(local) => Step {
                    responses: vec![immediate(&local)],
                    close: true,
                },
            };
        }
        if let Err(local) = self.admit(picker).await {
            return self.refuse(picker, local);
        }
        self.phase = Phase::Body;
        if self.request_mode == BodySendMode::FullDuplexStreamed {
            // Hold the headers response until the body is complete.
            return Step::default();
        }
        // BUFFERED (and the other one-response-per-message modes): continue now,
        // mutate headers with the body response.
        Step {
            responses: vec![ProcessingResponse {
                response: Some(request_headers_response(CommonResponse::default())),
                ..Default::default()
            }],
            close: false,
        }
    }

    async fn on_request_body(&mut self, b: HttpBody, picker: &Picker) -> Step {
        if self.phase == Phase::Routed {
            // Should not happen; pass the chunk on unchanged.
            return Step {
                responses: vec![if self.request_mode == BodySendMode::FullDuplexStreamed {
                    streamed_body(b.body, b.end_of_stream, true)
                } else {
                    ProcessingResponse {
                        response: Some(processing_response::Response::RequestBody(
                            BodyResponse::default(),
                        )),
                        ..Default::default()
                    }
                }],
                close: false,
            };
        }
        let total = self.body.len() + b.body.len();
        if total > self.config.max_body_bytes {
            return self.refuse(picker, too_large_response(self.config.max_body_bytes));
        }
        // Reserve the bytes before keeping them (a body past its declared
        // length, or without one, grows its reservation).
        let grown = match &mut self.reserved {
            Some(r) => r.grow_to(total),
            None => match picker.admission().reserve_body(total) {
                Ok(r) => {
                    self.reserved = Some(r);
                    true
                }
                Err(o) => return self.refuse(picker, overloaded_response(&o)),
            },
        };
        if !grown {
            let o = picker.admission().over_budget();
            return self.refuse(picker, overloaded_response(&o));
        }
        if self.body.is_empty() {
            // The usual case, one chunk: keep Envoy's buffer instead of copying it.
            self.body = b.body;
        } else {
            self.body.extend_from_slice(&b.body);
        }
        match self.request_mode {
            BodySendMode::FullDuplexStreamed => {
                if b.end_of_stream {
                    self.finish_full_duplex(picker, true).await
                } else {
                    Step::default()
                }
            }
            BodySendMode::Streamed if !b.end_of_stream => Step {
                // Headers already went upstream; nothing to route on in this mode.
                responses: vec![ProcessingResponse {
                    response: Some(processing_response::Response::RequestBody(
                        BodyResponse::default(),
                    )),
                    ..Default::default()
                }],
                close: false,
            },
            _ => {
                let body = std::mem::take(&mut self.body);
                match self.pick(picker, Some(body)).await {
                    Decision::Route(route) => {
                        self.phase = Phase::Routed;
                        let dest = route.decode.clone();
                        Step {
                            responses: vec![ProcessingResponse {
                                response: Some(processing_response::Response::RequestBody(
                                    BodyResponse {
                                        response: Some(routed_common(&route, None, &self.headers)),
                                    },
                                )),
                                dynamic_metadata: Some(lb_metadata(&dest)),
                                ..Default::default()
                            }],
                            close: false,
                        }
                    }
                    Decision::Reject(local) => Step {
                        responses: vec![immediate(&local)],
                        close: true,
                    },
                }
            }
        }
    }

    async fn finish_full_duplex(&mut self, picker: &Picker, end_of_stream: bool) -> Step {
        let body = std::mem::take(&mut self.body);
        let len = body.len();
        // Cut the chunks to re-send before the body moves into the policy
        // request: one copy of the body in all, not two.
        let size = self.config.chunk_size.clamp(1, MAX_CHUNK);
        let mut chunks: Vec<Vec<u8>> = body.chunks(size).map(<[u8]>::to_vec).collect();
        if chunks.is_empty() {
            chunks.push(Vec::new());
        }
        match self.pick(picker, Some(body)).await {
            Decision::Route(route) => {
                self.phase = Phase::Routed;
                let dest = route.decode.clone();
                let mut responses = Vec::with_capacity(chunks.len() + 1);
                responses.push(ProcessingResponse {
                    response: Some(request_headers_response(routed_common(
                        &route,
                        Some(len),
                        &self.headers,
                    ))),
                    dynamic_metadata: Some(lb_metadata(&dest)),
                    ..Default::default()
                });
                let n = chunks.len();
                for (i, c) in chunks.into_iter().enumerate() {
                    responses.push(streamed_body(c, end_of_stream && i + 1 == n, true));
                }
                Step {
                    responses,
                    close: false,
                }
            }
            Decision::Reject(local) => Step {
                responses: vec![immediate(&local)],
                close: true,
            },
        }
    }

    async fn pick(&mut self, picker: &Picker, body: Option<Vec<u8>>) -> Decision {
        let input = PickInput {
            headers: self.headers.clone(),
            body,
            subset: self.subset.clone(),
        };
        let (pick, model, picked) = picker.pick_held_for(input).await;
        let (held, expected) = picked.map_or((None, None), |(h, e)| (Some(h), e));
        // The request phase is over: its slot and body bytes go back.
        self.slot = None;
        self.reserved = None;
        match &pick {
            Decision::Route(r) => {
                self.destination = Some(r.decode.clone());
                self.reason = rngd_pool::pick::route_reason(r).map(String::from);
                self.open = Some(OpenRequest {
                    metrics: picker.metrics().clone(),
                    model: model.unwrap_or_default(),
                    since: Instant::now(),
                    answered: Answered::default(),
                    tail: Vec::new(),
                    _held: held,
                    expected,
                });
                tracing::info!(decode = %r.decode, prefill = ?r.prefill, kv_transport = ?r.kv_transport, "picked");
            }
            Decision::Reject(l) => tracing::info!(status = l.status, "rejected"),
        }
        pick
    }
}
