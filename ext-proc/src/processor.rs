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

use std::collections::{HashMap, VecDeque};
use std::pin::Pin;
use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3::header_value_option::HeaderAppendAction;
use envoy_types::pb::envoy::config::core::v3::{HeaderValue, HeaderValueOption, Metadata};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessor;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, HttpBody,
    HttpHeaders, ImmediateResponse, ProcessingRequest, ProcessingResponse, StreamedBodyResponse,
    TrailersResponse, body_mutation, processing_request, processing_response,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::google::protobuf::{Struct, Value, value::Kind};
use futures::{Stream, StreamExt};
use rngd_api::headers;
use rngd_policy_core::{Decision, LocalResponse, Route};
use tracing::Instrument;

use crate::picker::{PickInput, Picker, error_response, route_headers};

/// Largest body chunk re-sent to Envoy (GIE's limit, below Envoy's 64 KiB buffers).
pub const MAX_CHUNK: usize = 62_000;
/// Filter-metadata namespace of the subset hint.
pub const SUBSET_HINT_NAMESPACE: &str = "envoy.lb.subset_hint";
/// Default largest request body buffered for a pick.
pub const DEFAULT_MAX_BODY: usize = 32 * 1024 * 1024;

/// Limits of the state machine.
#[derive(Debug, Clone, Copy)]
pub struct ProcessorConfig {
    /// Largest request body buffered (larger → 413).
    pub max_body_bytes: usize,
    /// Size of the re-sent body chunks (at most [`MAX_CHUNK`]).
    pub chunk_size: usize,
}

impl Default for ProcessorConfig {
    fn default() -> Self {
        ProcessorConfig {
            max_body_bytes: DEFAULT_MAX_BODY,
            chunk_size: MAX_CHUNK,
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
}

fn header_pairs(h: &HttpHeaders) -> Vec<(String, String)> {
    h.headers
        .as_ref()
        .map(|m| {
            m.headers
                .iter()
                .map(|hv| {
                    let v = if hv.raw_value.is_empty() {
                        hv.value.clone()
                    } else {
                        String::from_utf8_lossy(&hv.raw_value).into_owned()
                    };
                    (hv.key.to_ascii_lowercase(), v)
                })
                .collect()
        })
        .unwrap_or_default()
}

fn subset_from_metadata(md: &Metadata) -> Option<Vec<String>> {
    let ns = md.filter_metadata.get(SUBSET_HINT_NAMESPACE)?;
    let v = ns.fields.get(headers::ENVOY_LB_SUBSET_HINT)?;
    Some(match &v.kind {
        Some(Kind::ListValue(list)) => list
            .values
            .iter()
            .filter_map(|v| match &v.kind {
                Some(Kind::StringValue(s)) => Some(s.trim().to_string()),
                _ => None,
            })
            .filter(|s| !s.is_empty())
            .collect(),
        Some(Kind::StringValue(s)) => split_list(s),
        _ => Vec::new(),
    })
}

fn split_list(s: &str) -> Vec<String> {
    s.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect()
}

fn set_header(key: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: key.to_string(),
            value: String::new(),
            raw_value: value.as_bytes().to_vec(),
        }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..Default::default()
    }
}

fn lb_metadata(destination: &str) -> Struct {
    let mut inner = HashMap::new();
    inner.insert(
        headers::DESTINATION_ENDPOINT.to_string(),
        Value {
            kind: Some(Kind::StringValue(destination.to_string())),
        },
    );
    let mut outer = HashMap::new();
    outer.insert(
        headers::ENVOY_LB_NAMESPACE.to_string(),
        Value {
            kind: Some(Kind::StructValue(Struct { fields: inner })),
        },
    );
    Struct { fields: outer }
}

/// The immediate response for a local answer.
pub fn immediate(local: &LocalResponse) -> ProcessingResponse {
    let set_headers = local
        .headers
        .iter()
        .map(|(k, v)| set_header(k, v))
        .collect();
    ProcessingResponse {
        response: Some(processing_response::Response::ImmediateResponse(
            ImmediateResponse {
                status: Some(HttpStatus {
                    code: i32::from(local.status),
                }),
                headers: Some(HeaderMutation {
                    set_headers,
                    remove_headers: vec![],
                }),
                body: local.body.clone(),
                grpc_status: None,
                details: format!("rngd_pd_epp_{}", local.status),
            },
        )),
        ..Default::default()
    }
}

fn route_mutation(route: &Route, content_length: Option<usize>) -> HeaderMutation {
    let hdrs = route_headers(route);
    let mut set_headers: Vec<HeaderValueOption> =
        hdrs.iter().map(|(k, v)| set_header(k, v)).collect();
    if let Some(n) = content_length {
        set_headers.push(set_header("content-length", &n.to_string()));
    }
    let mut remove_headers = Vec::new();
    for name in [headers::PREFILLER_HOST_PORT, headers::KV_TRANSPORT] {
        if !hdrs.iter().any(|(k, _)| k == name) {
            remove_headers.push(name.to_string());
        }
    }
    HeaderMutation {
        set_headers,
        remove_headers,
    }
}

fn routed_common(route: &Route, content_length: Option<usize>) -> CommonResponse {
    CommonResponse {
        header_mutation: Some(route_mutation(route, content_length)),
        clear_route_cache: true,
        ..Default::default()
    }
}

fn request_headers_response(common: CommonResponse) -> processing_response::Response {
    processing_response::Response::RequestHeaders(HeadersResponse {
        response: Some(common),
    })
}

fn streamed_body(body: Vec<u8>, end_of_stream: bool, request: bool) -> ProcessingResponse {
    let br = BodyResponse {
        response: Some(CommonResponse {
            body_mutation: Some(BodyMutation {
                mutation: Some(body_mutation::Mutation::StreamedResponse(
                    StreamedBodyResponse {
                        body,
                        end_of_stream,
                        ..Default::default()
                    },
                )),
            }),
            ..Default::default()
        }),
    };
    ProcessingResponse {
        response: Some(if request {
            processing_response::Response::RequestBody(br)
        } else {
            processing_response::Response::ResponseBody(br)
        }),
        ..Default::default()
    }
}

fn mode_of(v: i32) -> BodySendMode {
    BodySendMode::try_from(v).unwrap_or(BodySendMode::FullDuplexStreamed)
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
            processing_request::Request::ResponseHeaders(_) => Step {
                responses: vec![ProcessingResponse {
                    response: Some(processing_response::Response::ResponseHeaders(
                        HeadersResponse::default(),
                    )),
                    ..Default::default()
                }],
                close: false,
            },
            processing_request::Request::ResponseBody(b) => Step {
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
            },
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
        if self.subset.is_none()
            && let Some(v) = self.header(headers::DESTINATION_ENDPOINT_SUBSET)
        {
            self.subset = Some(split_list(v));
        }
        let no_body_visible = h.end_of_stream || self.request_mode == BodySendMode::None;
        if no_body_visible {
            let pick = self.pick(picker, None).await;
            return match pick {
                Decision::Route(route) => {
                    self.phase = Phase::Routed;
                    let dest = route.decode.clone();
                    Step {
                        responses: vec![ProcessingResponse {
                            response: Some(request_headers_response(routed_common(&route, None))),
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
        if self.body.len() + b.body.len() > self.config.max_body_bytes {
            let local = error_response(
                413,
                "invalid_request_error",
                "body_too_large",
                format!("request body exceeds {} bytes", self.config.max_body_bytes),
            );
            return Step {
                responses: vec![immediate(&local)],
                close: true,
            };
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
                                        response: Some(routed_common(&route, None)),
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
                    response: Some(request_headers_response(routed_common(&route, Some(len)))),
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
        let pick = picker.pick(input).await;
        match &pick {
            Decision::Route(r) => {
                self.destination = Some(r.decode.clone());
                tracing::info!(decode = %r.decode, prefill = ?r.prefill, kv_transport = ?r.kv_transport, "picked");
            }
            Decision::Reject(l) => tracing::info!(status = l.status, "rejected"),
        }
        pick
    }
}

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
fn message_kind(msg: &ProcessingRequest) -> &'static str {
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
            let msg = match d.inbound.next().await {
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
