//! One request's journey: policy → prefill (PD protocol) → decode, streamed
//! through as it arrives, with ids and model rewritten and timings added.
//!
//! Cancellation: the response stream owns the upstream decode stream, so a
//! client that goes away drops it and the decode worker sees its connection
//! close (and cancels). Between a successful prefill and the decode worker's
//! answer, a [`KvGuard`] is armed: if the request is abandoned there, it sends
//! the decode worker the handle with `max_tokens = 1` in the background so the
//! worker pulls and releases the KV instead of leaving it to the TTL.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures::{Stream, StreamExt};
use rngd_api::openai::{
    ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionResponse, ChatDelta,
    ChatResponseMessage, CompletionRequest, CompletionResponse, ErrorBody, Timings, Usage,
};
use rngd_api::pd::KvTransferParams;
use rngd_api::rules::ms;
use rngd_pool::{ApiKind, PickError, PickRequest};
use serde_json::Value;
use tracing::Instrument;

use crate::error::{ApiError, Stage};
use crate::metrics::RequestSample;
use crate::server::{Gateway, unix_now};
use crate::sse::{self, SseParser};

/// A validated request ([`rngd_pool::prepare`]) and where it arrived.
#[derive(Debug, Clone)]
pub struct Prepared {
    /// The request in the completion form the workers speak, and its count.
    pub request: rngd_pool::Prepared,
    /// Request path.
    pub path: String,
    /// Arrival time.
    pub started: Instant,
}

/// Runs one request end to end.
pub async fn run(gw: Arc<Gateway>, p: Prepared, headers: HeaderMap) -> Result<Response, ApiError> {
    let rid = gw.request_id(&headers);
    let span = tracing::info_span!("request", id = %rid, path = %p.path, prompt_tokens = p.request.prompt_tokens, stream = p.request.upstream.sampling.stream);
    let result = run_inner(gw, p, headers, rid.clone())
        .instrument(span)
        .await;
    let mut resp = match result {
        Ok(r) => r,
        Err(e) => e.into_response(),
    };
    if let Ok(v) = HeaderValue::from_str(&rid) {
        resp.headers_mut().insert(rngd_api::headers::REQUEST_ID, v);
    }
    Ok(resp)
}

fn policy_headers(p: &Prepared, headers: &HeaderMap) -> Vec<(String, String)> {
    let authority = headers
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let mut out = vec![
        (":method".to_string(), "POST".to_string()),
        (":path".to_string(), p.path.clone()),
        (":authority".to_string(), authority),
        (":scheme".to_string(), "http".to_string()),
    ];
    for (k, v) in headers {
        if k == header::HOST || k == header::CONTENT_LENGTH {
            continue;
        }
        if let Ok(v) = v.to_str() {
            out.push((k.as_str().to_string(), v.to_string()));
        }
    }
    out
}

async fn run_inner(
    gw: Arc<Gateway>,
    p: Prepared,
    headers: HeaderMap,
    rid: String,
) -> Result<Response, ApiError> {
    // Policy.
    let body =
        serde_json::to_vec(&p.request.upstream).map_err(|e| ApiError::Internal(e.to_string()))?;
    let pick = PickRequest {
        headers: policy_headers(&p, &headers),
        body,
        prompt_tokens: Some(p.request.prompt_tokens),
        subset: None,
    };
    let t = Instant::now();
    let picked = gw.picker.pick(pick).await;
    gw.metrics.observe_policy(t.elapsed());
    let route = match picked {
        Ok(r) => r,
        Err(PickError::Rejected(local)) => {
            tracing::info!(status = local.status, "policy rejected the request");
            return Err(ApiError::PolicyReject {
                status: local.status,
                body: local.body,
            });
        }
        Err(e) => return Err(ApiError::Policy(e)),
    };
    tracing::debug!(decode = %route.decode, prefill = ?route.prefill, kv_transport = ?route.kv_transport, "routed");

    // Prefill (PD), or none: the decode worker prefills itself.
    let mut decode_req = p.request.upstream.clone();
    let mut prefill_info: Option<(KvTransferParams, Instant)> = None;
    let mut guard = KvGuard::disarmed();
    if let Some(prefill) = &route.prefill {
        let mut req = p.request.upstream.clone();
        req.sampling.stream = false;
        req.sampling.stream_options = None;
        req.kv_transfer_params = Some(KvTransferParams {
            do_remote_decode: true,
            kv_transport: route.kv_transport.clone(),
            ..Default::default()
        });
        let resp: CompletionResponse = call_json(
            &gw,
            Stage::Prefill,
            prefill,
            &req,
            &rid,
            gw.config.prefill_timeout,
        )
        .await?;
        let Some(mut params) = resp.kv_transfer_params else {
            return Err(ApiError::Upstream {
                stage: Stage::Prefill,
                address: prefill.clone(),
                detail: "its response has no kv_transfer_params".into(),
                source: None,
            });
        };
        if params.kv_handle.is_none() {
            return Err(ApiError::Upstream {
                stage: Stage::Prefill,
                address: prefill.clone(),
                detail: "its kv_transfer_params have no kv_handle".into(),
                source: None,
            });
        }
        params.do_remote_decode = false;
        params.do_remote_prefill = true;
        decode_req.kv_transfer_params = Some(params.clone());
        guard = KvGuard::arm(&gw, &route.decode, &decode_req, &rid);
        prefill_info = Some((params, Instant::now()));
    }

    // Decode.
    let decode_sent = Instant::now();
    let resp = send(
        &gw,
        Stage::Decode,
        &route.decode,
        &decode_req,
        &rid,
        gw.config.decode_timeout,
    )
    .await;
    // The decode worker answered (or refused): the KV is its business now.
    if resp.is_ok() {
        guard.disarm();
    }
    let resp = resp?;
    let kv_transport = prefill_info.as_ref().map(|(params, _)| {
        route
            .kv_transport
            .clone()
            .or_else(|| params.kv_handle.as_ref().map(|h| h.transport.clone()))
            .unwrap_or_else(|| "unknown".to_string())
    });
    let ctx = Ctx {
        gw: gw.clone(),
        kind: p.request.kind,
        id: match p.request.kind {
            ApiKind::Completion => format!("cmpl-{rid}"),
            ApiKind::Chat => format!("chatcmpl-{rid}"),
        },
        model: p.request.client_model.clone(),
        created: unix_now(),
        started: p.started,
        decode_sent,
        prefill: prefill_info,
        kv_transport,
        address: route.decode.clone(),
    };
    if p.request.upstream.sampling.stream {
        Ok(stream_response(ctx, resp, p.request.include_usage))
    } else {
        let bytes =
            read_with_timeout(Stage::Decode, &route.decode, resp, gw.config.decode_timeout).await?;
        let body: CompletionResponse =
            serde_json::from_slice(&bytes).map_err(|e| ApiError::Upstream {
                stage: Stage::Decode,
                address: route.decode.clone(),
                detail: "its response is not a completion".into(),
                source: Some(Box::new(e)),
            })?;
        Ok(full_response(ctx, body))
    }
}

/// What the response builders need.
struct Ctx {
    gw: Arc<Gateway>,
    kind: ApiKind,
    id: String,
    model: String,
    created: u64,
    started: Instant,
    decode_sent: Instant,
    prefill: Option<(KvTransferParams, Instant)>,
    kv_transport: Option<String>,
    address: String,
}

impl Ctx {
    /// KV transfer = prefill's save + decode's load (or what the worker reports).
    fn kv_transfer_ms(&self, t: &Timings) -> Option<f64> {
        let (params, _) = self.prefill.as_ref()?;
        if let Some(x) = t.kv_transfer_ms {
            return Some(x);
        }
        match (params.kv_save_ms.or(t.kv_save_ms), t.kv_load_ms) {
            (None, None) => None,
            (a, b) => Some(a.unwrap_or(0.0) + b.unwrap_or(0.0)),
        }
    }

    fn record(&self, ttft: Option<Duration>, completion_tokens: u64, kv_ms: Option<f64>) {
        let finished = Instant::now();
        let total = finished.duration_since(self.started);
        let tpot = match ttft {
            Some(t) if completion_tokens > 1 => Some(
                total
                    .saturating_sub(t)
                    .div_f64((completion_tokens - 1) as f64),
            ),
            _ => None,
        };
        self.gw.metrics.observe_request(RequestSample {
            ttft,
            tpot,
            completion_tokens,
            started: self.started,
            finished,
            kv_transport: self.kv_transport.clone(),
            kv_transfer: kv_ms.map(|m| Duration::from_secs_f64(m.max(0.0) / 1e3)),
        });
    }

    fn merged_timings(
        &self,
        worker: Option<Timings>,
        ttft: Option<Duration>,
        tokens: u64,
    ) -> (Timings, Option<f64>) {
        let mut t = worker.unwrap_or_default();
        let kv = self.kv_transfer_ms(&t);
        let total = self.started.elapsed();
        if let Some((params, _)) = &self.prefill {
            t.prefill_ms = params.prefill_ms.or(t.prefill_ms);
            t.kv_save_ms = params.kv_save_ms.or(t.kv_save_ms);
        }
        t.kv_transfer_ms = kv;
        t.ttft_ms = ttft.map(ms);
        t.total_ms = Some(ms(total));
        t.tpot_ms = match ttft {
            Some(f) if tokens > 1 => Some(ms(total.saturating_sub(f)) / (tokens - 1) as f64),
            _ => t.tpot_ms,
        };
        (t, kv)
    }
}

fn full_response(ctx: Ctx, mut body: CompletionResponse) -> Response {
    let tokens = body
        .usage
        .map(|u| u64::from(u.completion_tokens))
        .or_else(|| {
            body.choices
                .first()
                .and_then(|c| c.token_ids.as_ref())
                .map(|t| t.len() as u64)
        })
        .unwrap_or(0);
    // TTFT: with remote prefill the first token exists when the prefill
    // answers; otherwise the worker's own TTFT offset by when we called it.
    let ttft = match &ctx.prefill {
        Some((_, at)) => Some(at.duration_since(ctx.started)),
        None => match body.timings.and_then(|t| t.ttft_ms) {
            Some(w) => Some(
                ctx.decode_sent.duration_since(ctx.started)
                    + Duration::from_secs_f64(w.max(0.0) / 1e3),
            ),
            None => Some(ctx.started.elapsed()),
        },
    };
    let (timings, kv) = ctx.merged_timings(body.timings, ttft, tokens);
    ctx.record(ttft, tokens, kv);
    body.id = ctx.id.clone();
    body.model = ctx.model.clone();
    body.created = ctx.created;
    body.kv_transfer_params = None;
    body.timings = Some(timings);
    match ctx.kind {
        ApiKind::Completion => {
            body.object = "text_completion".into();
            axum::Json(body).into_response()
        }
        ApiKind::Chat => {
            let choice = body.choices.into_iter().next();
            let chat = ChatCompletionResponse {
                id: ctx.id,
                object: "chat.completion".into(),
                created: ctx.created,
                model: ctx.model,
                choices: vec![ChatChoice {
                    index: 0,
                    message: ChatResponseMessage {
                        role: "assistant".into(),
                        content: choice.as_ref().map(|c| c.text.clone()).unwrap_or_default(),
                    },
                    finish_reason: choice.and_then(|c| c.finish_reason),
                }],
                usage: body.usage.unwrap_or_default(),
                timings: body.timings,
            };
            axum::Json(chat).into_response()
        }
    }
}

/// POSTs `req` to a worker; returns the response once its status is a success.
async fn send(
    gw: &Gateway,
    stage: Stage,
    address: &str,
    req: &CompletionRequest,
    rid: &str,
    timeout: Duration,
) -> Result<reqwest::Response, ApiError> {
    let url = format!("http://{address}/v1/completions");
    let fut = gw
        .client
        .post(url)
        .header(rngd_api::headers::REQUEST_ID, rid)
        .json(req)
        .send();
    let timeout_err = || ApiError::Timeout {
        stage,
        address: address.to_string(),
        after_ms: timeout.as_millis() as u64,
    };
    let resp = match tokio::time::timeout(timeout, fut).await {
        Err(_) => return Err(timeout_err()),
        Ok(Err(e)) if e.is_timeout() => return Err(timeout_err()),
        Ok(Err(e)) => {
            let detail = if e.is_connect() {
                "connection failed"
            } else {
                "request failed"
            };
            return Err(ApiError::Upstream {
                stage,
                address: address.to_string(),
                detail: detail.into(),
                source: Some(Box::new(e)),
            });
        }
        Ok(Ok(r)) => r,
    };
    if resp.status().is_success() {
        return Ok(resp);
    }
    let status = resp.status().as_u16();
    let bytes = tokio::time::timeout(Duration::from_secs(5), resp.bytes())
        .await
        .ok()
        .and_then(|r| r.ok())
        .unwrap_or_default();
    let (message, code) = match serde_json::from_slice::<ErrorBody>(&bytes) {
        Ok(b) => (b.error.message, b.error.code),
        Err(_) => (
            String::from_utf8_lossy(&bytes)
                .chars()
                .take(500)
                .collect::<String>(),
            None,
        ),
    };
    Err(ApiError::UpstreamStatus {
        stage,
        address: address.to_string(),
        status,
        message,
        code,
    })
}

async fn read_with_timeout(
    stage: Stage,
    address: &str,
    resp: reqwest::Response,
    timeout: Duration,
) -> Result<Bytes, ApiError> {
    match tokio::time::timeout(timeout, resp.bytes()).await {
        Err(_) => Err(ApiError::Timeout {
            stage,
            address: address.to_string(),
            after_ms: timeout.as_millis() as u64,
        }),
        Ok(Err(e)) => Err(ApiError::Upstream {
            stage,
            address: address.to_string(),
            detail: "its response broke off".into(),
            source: Some(Box::new(e)),
        }),
        Ok(Ok(b)) => Ok(b),
    }
}

async fn call_json<T: serde::de::DeserializeOwned>(
    gw: &Gateway,
    stage: Stage,
    address: &str,
    req: &CompletionRequest,
    rid: &str,
    timeout: Duration,
) -> Result<T, ApiError> {
    let started = Instant::now();
    let resp = send(gw, stage, address, req, rid, timeout).await?;
    let left = timeout.saturating_sub(started.elapsed());
    let bytes = read_with_timeout(stage, address, resp, left).await?;
    serde_json::from_slice(&bytes).map_err(|e| ApiError::Upstream {
        stage,
        address: address.to_string(),
        detail: "its response is not a completion".into(),
        source: Some(Box::new(e)),
    })
}

/// Releases an abandoned request's KV (see the module docs).
struct KvGuard {
    armed: Option<(reqwest::Client, String, CompletionRequest, String)>,
}

impl KvGuard {
    fn disarmed() -> Self {
        KvGuard { armed: None }
    }

    fn arm(gw: &Gateway, decode: &str, req: &CompletionRequest, rid: &str) -> Self {
        KvGuard {
            armed: Some((
                gw.client.clone(),
                decode.to_string(),
                req.clone(),
                rid.to_string(),
            )),
        }
    }

    fn disarm(&mut self) {
        self.armed = None;
    }
}

impl Drop for KvGuard {
    fn drop(&mut self) {
        let Some((client, address, mut req, rid)) = self.armed.take() else {
            return;
        };
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        req.sampling.max_tokens = Some(1);
        req.sampling.stream = false;
        req.sampling.stream_options = None;
        tracing::info!(request = %rid, decode = %address, "request abandoned after prefill: asking the decode worker to release its KV");
        rt.spawn(async move {
            let fut = client
                .post(format!("http://{address}/v1/completions"))
                .header(rngd_api::headers::REQUEST_ID, &rid)
                .json(&req)
                .send();
            match tokio::time::timeout(Duration::from_secs(30), fut).await {
                Ok(Ok(r)) => {
                    let _ = r.bytes().await;
                }
                Ok(Err(e)) => tracing::warn!(request = %rid, error = %e, "KV release call failed; the transport TTL will reclaim it"),
                Err(_) => tracing::warn!(request = %rid, "KV release call timed out; the transport TTL will reclaim it"),
            }
        });
    }
}

type Upstream = Pin<Box<dyn Stream<Item = reqwest::Result<Bytes>> + Send>>;

/// State of one streamed response.
struct StreamState {
    ctx: Ctx,
    upstream: Upstream,
    parser: SseParser,
    out: VecDeque<Bytes>,
    finished: bool,
    include_usage: bool,
    role_sent: bool,
    first_token: Option<Instant>,
    tokens: u64,
    usage: Option<Usage>,
    worker_timings: Option<Timings>,
    idle: Duration,
}

fn stream_response(ctx: Ctx, resp: reqwest::Response, include_usage: bool) -> Response {
    let idle = ctx.gw.config.stream_idle_timeout;
    let state = StreamState {
        ctx,
        upstream: Box::pin(resp.bytes_stream()),
        parser: SseParser::new(),
        out: VecDeque::new(),
        finished: false,
        include_usage,
        role_sent: false,
        first_token: None,
        tokens: 0,
        usage: None,
        worker_timings: None,
        idle,
    };
    let stream = futures::stream::unfold(state, |mut st| async move {
        loop {
            if let Some(b) = st.out.pop_front() {
                return Some((Ok::<Bytes, std::io::Error>(b), st));
            }
            if st.finished {
                return None;
            }
            match tokio::time::timeout(st.idle, st.upstream.next()).await {
                Err(_) => st.fail(format!(
                    "decode worker {} sent nothing for {} ms",
                    st.ctx.address,
                    st.idle.as_millis()
                )),
                Ok(None) => {
                    if let Some(data) = st.parser.finish() {
                        st.on_event(&data);
                    }
                    if !st.finished {
                        st.fail(format!(
                            "decode worker {} ended the stream early",
                            st.ctx.address
                        ));
                    }
                }
                Ok(Some(Err(e))) => {
                    tracing::warn!(error = %e, "decode stream broke");
                    st.fail(format!("decode worker {} broke the stream", st.ctx.address));
                }
                Ok(Some(Ok(chunk))) => match st.parser.push(&chunk) {
                    Ok(events) => {
                        for data in events {
                            st.on_event(&data);
                        }
                    }
                    Err(e) => st.fail(format!("decode worker {}: {e}", st.ctx.address)),
                },
            }
        }
    });
    let mut resp = Response::new(Body::from_stream(stream));
    *resp.status_mut() = StatusCode::OK;
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    resp
}

impl StreamState {
    fn push_json<T: serde::Serialize>(&mut self, v: &T) {
        if let Ok(s) = serde_json::to_string(v) {
            self.out.push_back(sse::encode(&s));
        }
    }

    fn fail(&mut self, message: String) {
        tracing::warn!(%message, "stream failed");
        let body = ErrorBody::new("server_error", message).with_code("decode_failed");
        self.push_json(&body);
        self.out.push_back(sse::encode("[DONE]"));
        self.finished = true;
    }

    fn complete(&mut self) {
        self.finished = true;
        let ttft = self.first_token.map(|t| t.duration_since(self.ctx.started));
        let tokens = self
            .usage
            .map(|u| u64::from(u.completion_tokens))
            .unwrap_or(self.tokens);
        let kv = self
            .worker_timings
            .as_ref()
            .and_then(|t| self.ctx.kv_transfer_ms(t))
            .or_else(|| self.ctx.prefill.as_ref().and_then(|(p, _)| p.kv_save_ms));
        self.ctx.record(ttft, tokens, kv);
        tracing::info!(tokens, ttft_ms = ?ttft.map(ms), "stream done");
    }

    fn on_event(&mut self, data: &str) {
        if self.finished {
            return;
        }
        if data.trim() == "[DONE]" {
            self.complete();
            self.out.push_back(sse::encode("[DONE]"));
            return;
        }
        let Ok(mut v) = serde_json::from_str::<Value>(data) else {
            self.fail(format!(
                "decode worker {} sent an unreadable chunk",
                self.ctx.address
            ));
            return;
        };
        if v.get("error").is_some() {
            // The worker's own mid-stream error: pass it on and end.
            self.out.push_back(sse::encode(data));
            self.out.push_back(sse::encode("[DONE]"));
            self.finished = true;
            return;
        }
        let choice = v.get("choices").and_then(|c| c.get(0)).cloned();
        let text = choice
            .as_ref()
            .and_then(|c| c.get("text"))
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        let ids = choice
            .as_ref()
            .and_then(|c| c.get("token_ids"))
            .and_then(Value::as_array)
            .map_or(0, |a| a.len() as u64);
        let finish = choice
            .as_ref()
            .and_then(|c| c.get("finish_reason"))
            .and_then(Value::as_str)
            .map(str::to_string);
        if let Some(u) = v
            .get("usage")
            .and_then(|u| serde_json::from_value::<Usage>(u.clone()).ok())
        {
            self.usage = Some(u);
        }
        if let Some(t) = v
            .get("timings")
            .and_then(|t| serde_json::from_value::<Timings>(t.clone()).ok())
        {
            self.worker_timings = Some(t);
        }
        self.tokens += ids;
        if self.first_token.is_none() && (ids > 0 || !text.is_empty()) {
            self.first_token = Some(Instant::now());
        }
        match self.ctx.kind {
            ApiKind::Completion => {
                if let Some(o) = v.as_object_mut() {
                    o.insert("id".into(), Value::String(self.ctx.id.clone()));
                    o.insert("model".into(), Value::String(self.ctx.model.clone()));
                    o.insert("created".into(), Value::from(self.ctx.created));
                    o.insert("object".into(), Value::String("text_completion".into()));
                    o.remove("kv_transfer_params");
                    if o.contains_key("timings") {
                        let ttft = self.first_token.map(|t| t.duration_since(self.ctx.started));
                        let (t, _) =
                            self.ctx
                                .merged_timings(self.worker_timings, ttft, self.tokens);
                        if let Ok(tv) = serde_json::to_value(t) {
                            o.insert("timings".into(), tv);
                        }
                    }
                    let no_choices = o
                        .get("choices")
                        .and_then(Value::as_array)
                        .is_none_or(|c| c.is_empty());
                    if o.contains_key("usage") && !self.include_usage {
                        if no_choices {
                            return;
                        }
                        o.remove("usage");
                    }
                }
                self.push_json(&v);
            }
            ApiKind::Chat => {
                let (id, model, created) = (
                    self.ctx.id.clone(),
                    self.ctx.model.clone(),
                    self.ctx.created,
                );
                let chunk =
                    |choices: Vec<ChatChunkChoice>, usage: Option<Usage>| ChatCompletionChunk {
                        id: id.clone(),
                        object: "chat.completion.chunk".into(),
                        created,
                        model: model.clone(),
                        choices,
                        usage,
                    };
                if choice.is_some() {
                    if !self.role_sent {
                        self.role_sent = true;
                        let c = chunk(
                            vec![ChatChunkChoice {
                                index: 0,
                                delta: ChatDelta {
                                    role: Some("assistant".into()),
                                    content: Some(String::new()),
                                },
                                finish_reason: None,
                            }],
                            None,
                        );
                        self.push_json(&c);
                    }
                    if !text.is_empty() || finish.is_some() {
                        let c = chunk(
                            vec![ChatChunkChoice {
                                index: 0,
                                delta: ChatDelta {
                                    role: None,
                                    content: (!text.is_empty()).then_some(text),
                                },
                                finish_reason: finish,
                            }],
                            None,
                        );
                        self.push_json(&c);
                    }
                }
                if self.include_usage
                    && let Some(u) = v
                        .get("usage")
                        .and_then(|u| serde_json::from_value::<Usage>(u.clone()).ok())
                {
                    let c = chunk(Vec::new(), Some(u));
                    self.push_json(&c);
                }
            }
        }
    }
}
