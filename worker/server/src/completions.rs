//! `POST /v1/completions`: whole requests, the two halves of the PD protocol,
//! and `x-prefiller-host-port` orchestration. See `docs/pd-protocol.md`.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use rngd_api::headers;
use rngd_api::openai::{
    CompletionChoice, CompletionRequest, CompletionResponse, ErrorBody, Prompt, SamplingFields,
    Timings, Usage,
};
use rngd_api::pd::KvTransferParams;
use rngd_api::rules::{self, ms, unix_now};
use rngd_engine::{Engine, FinishReason, GenEvent, KvCache, Prefilled, SamplingParams};
use rngd_kv_transport::KvPayload;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tracing::Instrument;

use crate::error::ApiError;
use crate::state::WorkerState;
use rngd_api::Role;

/// Extra time the worker gives a transport's own pull timeout before giving up itself.
const PULL_GRACE: Duration = Duration::from_secs(2);

/// The handler: request id, span, status counter, `x-request-id` echo.
pub(crate) async fn completions(
    State(state): State<WorkerState>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let request_id = crate::request_id(&headers);
    let span = tracing::info_span!("completion", request_id = %request_id, role = state.config().role.as_str());
    let result = handle(&state, &headers, &request_id, &body)
        .instrument(span)
        .await;
    let mut resp = result.unwrap_or_else(IntoResponse::into_response);
    state
        .metrics()
        .requests
        .with_label_values(&[resp.status().as_str()])
        .inc();
    if let Ok(v) = HeaderValue::from_str(&request_id) {
        resp.headers_mut().insert(headers::REQUEST_ID, v);
    }
    resp
}

async fn handle(
    state: &WorkerState,
    headers: &HeaderMap,
    request_id: &str,
    body: &[u8],
) -> Result<Response, ApiError> {
    let started = Instant::now();
    let engine = state.engine().ok_or(ApiError::NotReady)?.clone();
    let req: CompletionRequest = rules::parse_body(body)?;
    rules::check_completion(&req)?;
    let header = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
            .filter(|v| !v.is_empty())
    };
    let role = state.config().role;
    let params = req.kv_transfer_params.clone().unwrap_or_default();
    if params.do_remote_decode {
        if role == Role::Decode {
            return Err(ApiError::WrongRole(
                "this worker has role decode: it does not serve prefill-only requests (kv_transfer_params.do_remote_decode)".into(),
            ));
        }
        let transport = params
            .kv_transport
            .clone()
            .or_else(|| header(headers::KV_TRANSPORT).map(String::from));
        tracing::info!(
            mode = "prefill",
            transport = transport
                .as_deref()
                .unwrap_or(state.transports().default_name())
        );
        return prefill_for_remote(
            state,
            &engine,
            &req,
            request_id,
            transport.as_deref(),
            started,
        )
        .await;
    }
    if role == Role::Prefill {
        return Err(ApiError::WrongRole(
            "this worker has role prefill: it only prefills; send kv_transfer_params {\"do_remote_decode\": true}".into(),
        ));
    }
    if params.do_remote_prefill {
        tracing::info!(mode = "decode");
        return decode_remote(state, &engine, &req, request_id, params, started).await;
    }
    if let Some(peer) = header(headers::PREFILLER_HOST_PORT) {
        tracing::info!(mode = "orchestrate", prefiller = peer);
        let transport = header(headers::KV_TRANSPORT).map(String::from);
        return orchestrate(state, &engine, &req, request_id, peer, transport, started).await;
    }
    tracing::info!(mode = "local");
    let prompt = prompt_ids(&*engine, &req.prompt)?;
    let sp = sampling(&req.sampling, &prompt, engine.info().seq_len)?;
    let rx = engine.generate(&prompt, &sp).await?;
    state.metrics().prefills.inc();
    let meta = Meta::new(
        &*engine,
        &req,
        request_id,
        prompt.len(),
        started,
        Timings::default(),
    );
    respond(state.clone(), meta, rx, req.sampling.stream).await
}

/// Prefill half of the PD protocol: prefill, push, answer with the first token and the handle.
async fn prefill_for_remote(
    state: &WorkerState,
    engine: &Arc<dyn Engine>,
    req: &CompletionRequest,
    request_id: &str,
    transport_name: Option<&str>,
    started: Instant,
) -> Result<Response, ApiError> {
    let prompt = prompt_ids(&**engine, &req.prompt)?;
    let sp = sampling(&req.sampling, &prompt, engine.info().seq_len)?;
    let transport =
        state
            .transports()
            .get(transport_name)
            .map_err(|source| ApiError::UnknownTransport {
                name: transport_name
                    .unwrap_or(state.transports().default_name())
                    .to_string(),
                source: Box::new(source),
            })?;
    let pre = engine.prefill(&prompt, &sp).await?;
    let prefill_ms = ms(pre.elapsed);
    let m = state.metrics();
    m.prefills.inc();
    m.prefill_ms.observe(prefill_ms);
    let first = pre.first_token;
    let t0 = Instant::now();
    let handle = transport
        .push(KvPayload {
            request_id: request_id.to_string(),
            layout: pre.kv.layout,
            tokens: pre.kv.tokens,
            blobs: pre.kv.blobs,
        })
        .await
        .map_err(|source| ApiError::KvPush {
            transport: transport.name().to_string(),
            request_id: request_id.to_string(),
            source: Box::new(source),
        })?;
    let kv_save_ms = ms(t0.elapsed());
    m.kv_save_ms.observe(kv_save_ms);
    tracing::info!(
        transport = transport.name(),
        prompt_tokens = prompt.len(),
        prefill_ms,
        kv_save_ms,
        "KV pushed"
    );
    let text = engine.detokenize(&[first])?;
    let total = ms(started.elapsed());
    let prompt_tokens = prompt.len();
    let resp = CompletionResponse {
        id: format!("cmpl-{request_id}"),
        object: "text_completion".into(),
        created: unix_now(),
        model: engine.info().name.clone(),
        choices: vec![CompletionChoice {
            index: 0,
            text,
            logprobs: None,
            finish_reason: Some("length".into()),
            token_ids: Some(vec![first]),
        }],
        usage: Some(Usage::new(prompt_tokens as u32, 1)),
        kv_transfer_params: Some(KvTransferParams {
            do_remote_prefill: true,
            kv_handle: Some(handle),
            first_token: Some(first),
            prompt_token_ids: Some(prompt),
            prefill_ms: Some(prefill_ms),
            kv_save_ms: Some(kv_save_ms),
            remote_engine_id: state.config().node.clone(),
            ..KvTransferParams::default()
        }),
        timings: Some(Timings {
            ttft_ms: Some(total),
            prefill_ms: Some(prefill_ms),
            kv_save_ms: Some(kv_save_ms),
            total_ms: Some(total),
            ..Timings::default()
        }),
    };
    Ok(axum::Json(resp).into_response())
}

/// Decode half of the PD protocol: pull (nothing is re-prefilled), release, continue.
async fn decode_remote(
    state: &WorkerState,
    engine: &Arc<dyn Engine>,
    req: &CompletionRequest,
    request_id: &str,
    params: KvTransferParams,
    started: Instant,
) -> Result<Response, ApiError> {
    let missing = |what: &str| {
        ApiError::BadRequest(format!("kv_transfer_params.do_remote_prefill needs {what}"))
    };
    let handle = params.kv_handle.ok_or_else(|| missing("kv_handle"))?;
    let first = params.first_token.ok_or_else(|| missing("first_token"))?;
    let prompt = match params.prompt_token_ids {
        Some(p) => p,
        None => prompt_ids(&**engine, &req.prompt)?,
    };
    check_vocab(&prompt, engine.info().vocab_size)?;
    if handle.tokens != prompt.len() {
        return Err(ApiError::BadRequest(format!(
            "kv_handle covers {} tokens but the prompt has {}",
            handle.tokens,
            prompt.len()
        )));
    }
    let expected = engine.info().kv_layout;
    if handle.layout != expected {
        return Err(ApiError::BadRequest(format!(
            "KV layout mismatch: the prefill produced {:?}, this decode worker's model needs {expected:?}",
            handle.layout
        )));
    }
    let sp = sampling(&req.sampling, &prompt, engine.info().seq_len)?;
    let transport = state
        .transports()
        .get(Some(&handle.transport))
        .map_err(|source| ApiError::UnknownTransport {
            name: handle.transport.clone(),
            source: Box::new(source),
        })?;
    let timeout = state.config().kv_pull_timeout;
    let t0 = Instant::now();
    let pulled = tokio::time::timeout(timeout + PULL_GRACE, transport.pull(&handle, timeout)).await;
    if let Err(e) = transport.release(&handle).await {
        tracing::warn!(transport = transport.name(), error = %e, "KV release failed; the transport's TTL will free it");
    }
    let blobs = match pulled {
        Err(_) => {
            return Err(ApiError::KvPullTimeout {
                transport: handle.transport.clone(),
                request_id: handle.request_id.clone(),
                waited: t0.elapsed(),
            });
        }
        Ok(Err(source)) => {
            return Err(ApiError::KvPull {
                transport: handle.transport.clone(),
                request_id: handle.request_id.clone(),
                source: Box::new(source),
            });
        }
        Ok(Ok(b)) => b,
    };
    let kv_load_ms = ms(t0.elapsed());
    let m = state.metrics();
    m.kv_loads.inc();
    m.kv_load_ms.observe(kv_load_ms);
    tracing::info!(
        transport = transport.name(),
        bytes = handle.total_bytes(),
        kv_load_ms,
        "KV loaded and released"
    );
    let prefilled = Prefilled {
        first_token: first,
        kv: KvCache {
            layout: handle.layout,
            tokens: handle.tokens,
            blobs,
        },
        elapsed: Duration::ZERO,
    };
    let rx = engine.decode(&prompt, prefilled, &sp).await?;
    let timings = Timings {
        prefill_ms: params.prefill_ms,
        kv_save_ms: params.kv_save_ms,
        kv_load_ms: Some(kv_load_ms),
        kv_transfer_ms: Some(params.kv_save_ms.unwrap_or(0.0) + kv_load_ms),
        ..Timings::default()
    };
    let meta = Meta::new(&**engine, req, request_id, prompt.len(), started, timings);
    respond(state.clone(), meta, rx, req.sampling.stream).await
}

/// llm-d routing-sidecar behaviour: prefill on `peer`, then decode here.
async fn orchestrate(
    state: &WorkerState,
    engine: &Arc<dyn Engine>,
    req: &CompletionRequest,
    request_id: &str,
    peer: &str,
    transport: Option<String>,
    started: Instant,
) -> Result<Response, ApiError> {
    let mut pre = req.clone();
    pre.sampling.stream = false;
    pre.sampling.stream_options = None;
    pre.kv_transfer_params = Some(KvTransferParams {
        do_remote_decode: true,
        kv_transport: transport,
        ..KvTransferParams::default()
    });
    let answer = state
        .peer()
        .prefill(peer, request_id, &pre, state.config().prefill_timeout)
        .await?;
    let params = answer
        .kv_transfer_params
        .filter(|p| p.do_remote_prefill && p.kv_handle.is_some())
        .ok_or_else(|| ApiError::PrefillPeer {
            peer: peer.to_string(),
            request_id: request_id.to_string(),
            detail: "the answer carries no kv_transfer_params with do_remote_prefill and kv_handle"
                .into(),
            source: None,
        })?;
    decode_remote(state, engine, req, request_id, params, started).await
}

/// The prompt as token ids (one prompt per request).
fn prompt_ids(engine: &dyn Engine, prompt: &Prompt) -> Result<Vec<u32>, ApiError> {
    let ids = match prompt {
        Prompt::Text(t) => engine.tokenize(t)?,
        Prompt::TextBatch(v) if v.len() == 1 => engine.tokenize(&v[0])?,
        Prompt::Tokens(t) => t.clone(),
        Prompt::TokensBatch(v) if v.len() == 1 => v[0].clone(),
        _ => {
            return Err(ApiError::BadRequest(
                "only one prompt per request is served".into(),
            ));
        }
    };
    if ids.is_empty() {
        return Err(ApiError::BadRequest("the prompt is empty".into()));
    }
    check_vocab(&ids, engine.info().vocab_size)?;
    Ok(ids)
}

fn check_vocab(ids: &[u32], vocab: usize) -> Result<(), ApiError> {
    match ids.iter().find(|&&t| t as usize >= vocab) {
        Some(t) => Err(ApiError::BadRequest(format!(
            "token id {t} is outside the vocabulary (size {vocab})"
        ))),
        None => Ok(()),
    }
}

/// Sampling parameters of a request; the context-length check happens here,
/// before any work. Without `seed`, the seed is a hash of the prompt tokens, so
/// that a prefill worker, a decode worker and a solo worker agree on it.
fn sampling(
    f: &SamplingFields,
    prompt: &[u32],
    seq_len: usize,
) -> Result<SamplingParams, ApiError> {
    rules::check_sampling(f)?;
    let max_tokens = rules::max_tokens_or_default(f.max_tokens) as usize;
    rngd_engine::check_context(prompt.len(), max_tokens, seq_len)?;
    let temperature = f.temperature.unwrap_or(1.0);
    let top_p = f.top_p.unwrap_or(1.0);
    let seed = f.seed.unwrap_or_else(|| {
        prompt.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, t| {
            (h ^ u64::from(*t)).wrapping_mul(0x0100_0000_01b3)
        })
    });
    Ok(SamplingParams {
        max_tokens,
        temperature,
        top_k: f.top_k.unwrap_or(0) as usize,
        top_p,
        seed,
        stop: f.stop.as_ref().map(|s| s.to_vec()).unwrap_or_default(),
    })
}

/// What every chunk or body of one response shares.
struct Meta {
    id: String,
    model: String,
    created: u64,
    prompt_tokens: usize,
    started: Instant,
    timings: Timings,
    include_usage: bool,
}

impl Meta {
    fn new(
        engine: &dyn Engine,
        req: &CompletionRequest,
        request_id: &str,
        prompt_tokens: usize,
        started: Instant,
        timings: Timings,
    ) -> Self {
        Meta {
            id: format!("cmpl-{request_id}"),
            model: engine.info().name.clone(),
            created: unix_now(),
            prompt_tokens,
            started,
            timings,
            include_usage: req
                .sampling
                .stream_options
                .as_ref()
                .is_some_and(|o| o.include_usage),
        }
    }

    fn chunk(&self, choices: Vec<CompletionChoice>) -> CompletionResponse {
        CompletionResponse {
            id: self.id.clone(),
            object: "text_completion".into(),
            created: self.created,
            model: self.model.clone(),
            choices,
            usage: None,
            kv_transfer_params: None,
            timings: None,
        }
    }

    /// Final timings from the token times.
    fn finish_timings(
        &self,
        first: Option<Instant>,
        last: Option<Instant>,
        n: usize,
        state: &WorkerState,
    ) -> Timings {
        let mut t = self.timings;
        t.ttft_ms = first.map(|f| ms(f - self.started));
        if let (Some(f), Some(l)) = (first, last)
            && n > 1
        {
            let span = (l - f).as_secs_f64();
            t.tpot_ms = Some(span * 1000.0 / (n - 1) as f64);
            if span > 0.0 {
                state
                    .metrics()
                    .decode_tokens_per_s
                    .observe((n - 1) as f64 / span);
            }
        }
        t.total_ms = Some(ms(self.started.elapsed()));
        t
    }
}

fn finish_str(f: FinishReason) -> String {
    match f {
        FinishReason::Stop => "stop".into(),
        FinishReason::Length => "length".into(),
    }
}

/// Turns a generation stream into a JSON body or an SSE stream.
async fn respond(
    state: WorkerState,
    meta: Meta,
    mut rx: mpsc::Receiver<GenEvent>,
    stream: bool,
) -> Result<Response, ApiError> {
    if !stream {
        let (mut text, mut ids) = (String::new(), Vec::new());
        let (mut first, mut last) = (None, None);
        let mut finish = None;
        while let Some(ev) = rx.recv().await {
            match ev {
                GenEvent::Token { id, text: t } => {
                    let now = Instant::now();
                    first.get_or_insert(now);
                    last = Some(now);
                    ids.push(id);
                    text.push_str(&t);
                }
                GenEvent::Done { finish_reason, .. } => {
                    finish = Some(finish_reason);
                    break;
                }
                GenEvent::Error(m) => {
                    return Err(ApiError::Internal(format!("generation failed: {m}")));
                }
            }
        }
        let finish = finish.ok_or_else(|| {
            ApiError::Internal("the engine stream ended without finishing".into())
        })?;
        let timings = meta.finish_timings(first, last, ids.len(), &state);
        let n = ids.len() as u32;
        let mut body = meta.chunk(vec![CompletionChoice {
            index: 0,
            text,
            logprobs: None,
            finish_reason: Some(finish_str(finish)),
            token_ids: Some(ids),
        }]);
        body.usage = Some(Usage::new(meta.prompt_tokens as u32, n));
        body.timings = Some(timings);
        return Ok(axum::Json(body).into_response());
    }
    let (tx, out) = mpsc::channel::<Event>(32);
    let span = tracing::Span::current();
    tokio::spawn(
        async move {
            let send = |v: &dyn erased::Json| Event::default().data(v.to_json());
            let (mut first, mut last, mut n) = (None, None, 0usize);
            while let Some(ev) = rx.recv().await {
                let event = match ev {
                    GenEvent::Token { id, text } => {
                        let now = Instant::now();
                        first.get_or_insert(now);
                        last = Some(now);
                        n += 1;
                        send(&meta.chunk(vec![CompletionChoice {
                            index: 0,
                            text,
                            logprobs: None,
                            finish_reason: None,
                            token_ids: Some(vec![id]),
                        }]))
                    }
                    GenEvent::Done { finish_reason, .. } => {
                        let mut c = meta.chunk(vec![CompletionChoice {
                            index: 0,
                            text: String::new(),
                            logprobs: None,
                            finish_reason: Some(finish_str(finish_reason)),
                            token_ids: None,
                        }]);
                        c.timings = Some(meta.finish_timings(first, last, n, &state));
                        if tx.send(send(&c)).await.is_err() {
                            return;
                        }
                        if meta.include_usage {
                            let mut u = meta.chunk(Vec::new());
                            u.usage = Some(Usage::new(meta.prompt_tokens as u32, n as u32));
                            if tx.send(send(&u)).await.is_err() {
                                return;
                            }
                        }
                        break;
                    }
                    GenEvent::Error(m) => {
                        tracing::warn!(error = %m, "generation failed mid-stream");
                        let _ = tx
                            .send(send(&ErrorBody::new(
                                "server_error",
                                format!("generation failed: {m}"),
                            )))
                            .await;
                        break;
                    }
                };
                if tx.send(event).await.is_err() {
                    tracing::info!("client went away; generation cancelled");
                    return;
                }
            }
            let _ = tx.send(Event::default().data("[DONE]")).await;
        }
        .instrument(span),
    );
    Ok(Sse::new(ReceiverStream::new(out).map(Ok::<_, Infallible>)).into_response())
}

mod erased {
    //! Serializing the two chunk types through one closure.

    /// Something that renders as one JSON line.
    pub trait Json {
        /// The JSON text.
        fn to_json(&self) -> String;
    }

    impl<T: serde::Serialize> Json for T {
        fn to_json(&self) -> String {
            serde_json::to_string(self).unwrap_or_else(|e| {
                format!("{{\"error\":{{\"message\":\"serialization failed: {e}\"}}}}")
            })
        }
    }
}
