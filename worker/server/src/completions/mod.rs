//! `POST /v1/completions` and `POST /v1/chat/completions`: whole requests,
//! the two halves of the PD protocol, and `x-prefiller-host-port`
//! orchestration. See `docs/pd-protocol.md`.
//!
//! - this module: the handlers, dispatch to the mode, the prompt and the
//!   sampling parameters;
//! - [`chat`]: a chat rendered with the engine's template into the completion
//!   request every mode serves;
//! - [`pd`]: the three PD modes (prefill for a remote decode, decode from a
//!   pulled KV, orchestration of a prefill peer);
//! - [`respond`]: a generation stream as a JSON body or as SSE, in the
//!   completion or the chat format;
//! - [`logprobs`]: the engine's log-probabilities in either API's format.

mod chat;
mod logprobs;
mod pd;
mod respond;

use std::sync::Arc;
use std::time::Instant;

use std::net::SocketAddr;

use axum::body::Body;
use axum::extract::{ConnectInfo, State};
use axum::http::{Extensions, HeaderMap, HeaderValue};
use axum::response::{IntoResponse, Response};
use rngd_api::Role;
use rngd_api::headers;
use rngd_api::openai::{CompletionRequest, Prompt, Timings};
use rngd_api::rules::{self, RuleError};
use rngd_engine::{Engine, ModelInfo, SamplingParams};
use tracing::Instrument;

use crate::error::ApiError;
use crate::handles::random_seed;
use crate::state::WorkerState;
use pd::{Call, decode_remote, orchestrate, prefill_for_remote};
use respond::{Api, Meta, Phases, respond};
use rngd_http_edge::Buffered;

/// The `/v1/completions` handler.
pub(crate) async fn completions(
    State(state): State<WorkerState>,
    ext: Extensions,
    headers: HeaderMap,
    body: Body,
) -> Response {
    serve(state, ext, headers, body, Api::Completion).await
}

/// The `/v1/chat/completions` handler: the chat is rendered into a completion
/// request and served as one, the answer given in the chat format.
pub(crate) async fn chat_completions(
    State(state): State<WorkerState>,
    ext: Extensions,
    headers: HeaderMap,
    body: Body,
) -> Response {
    serve(state, ext, headers, body, Api::Chat).await
}

/// The IP of the connection (none when served without connect info, as in
/// router-level tests: such a caller is no front door).
fn client_ip(ext: &Extensions) -> Option<std::net::IpAddr> {
    ext.get::<ConnectInfo<SocketAddr>>().map(|c| c.0.ip())
}

/// Both handlers: request id, span, status counter, `x-request-id` echo.
async fn serve(
    state: WorkerState,
    ext: Extensions,
    headers: HeaderMap,
    body: Body,
    api: Api,
) -> Response {
    let client = client_ip(&ext);
    let request_id = crate::request_id(&headers);
    let name = match api {
        Api::Completion => "completion",
        Api::Chat => "chat",
    };
    let span = tracing::info_span!("request", api = name, request_id = %request_id, role = state.config().role.as_str());
    let result = async {
        // Under the size and time limits, within the listener's body budget,
        // and holding no slot while it arrives.
        let body = read_body(&state, &headers, &ext, body).await?;
        if let Some(split) = rngd_api::fanout::split(&body, api == Api::Chat)? {
            return Ok(fan_out(&state, client, &headers, &request_id, &split, api).await);
        }
        // An engine slot from here to the end of the response, or a 429 now.
        let slot = admit(&state)?;
        let resp = handle(
            &state,
            client,
            &headers,
            &request_id,
            body.bytes().clone(),
            api,
        )
        .await?;
        // The slot is held to the last byte of the response.
        Ok::<_, ApiError>(rngd_http_edge::hold_until_sent(resp, slot))
    }
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

/// An engine slot, or the 429 (counted).
fn admit(state: &WorkerState) -> Result<crate::state::Slot, ApiError> {
    state.try_admit().ok_or_else(|| {
        state.metrics().overload_rejections.inc();
        ApiError::Overloaded {
            limit: state.config().max_in_flight,
        }
    })
}

/// A request with several choices (`n > 1`, a prompt list): every part
/// served as its own request (each with its engine slot, taken at once or
/// the whole request is the 429), at once, and the answers merged. The
/// engine prefills one prompt at a time and caches it as it goes, so the
/// choices of one prompt compute it once (here, or at the prefill peer of
/// `x-prefiller-host-port`).
async fn fan_out(
    state: &WorkerState,
    client: Option<std::net::IpAddr>,
    headers: &HeaderMap,
    request_id: &str,
    split: &rngd_api::fanout::Split,
    api: Api,
) -> Response {
    let mut slots = Vec::with_capacity(split.parts.len());
    for _ in &split.parts {
        match admit(state) {
            Ok(s) => slots.push(s),
            Err(e) => return e.into_response(),
        }
    }
    let parts = split.parts.iter().enumerate().map(|(g, part)| {
        let id = if g == 0 {
            request_id.to_string()
        } else {
            format!("{request_id}-{g}")
        };
        let body = bytes::Bytes::from(part.clone());
        async move {
            handle(state, client, headers, &id, body, api)
                .await
                .unwrap_or_else(IntoResponse::into_response)
        }
    });
    let answers: Vec<Response> = futures::future::join_all(parts)
        .await
        .into_iter()
        .zip(slots)
        .map(|(r, slot)| rngd_http_edge::hold_until_sent(r, slot))
        .collect();
    rngd_http_edge::fanout::merge(split, answers).await
}

/// The body within the worker's size (413) and time (408) limits and the
/// listener's in-flight body budget (503): `rngd_http_edge::read_body`. Its
/// bytes stay counted in the budget until the [`Buffered`] is dropped.
pub(crate) async fn read_body(
    state: &WorkerState,
    headers: &HeaderMap,
    ext: &Extensions,
    body: Body,
) -> Result<Buffered, ApiError> {
    use rngd_http_edge::HasBodyLimits as _;
    Ok(rngd_http_edge::read_body(headers, ext, body, state.body_limits()).await?)
}

async fn handle(
    state: &WorkerState,
    client: Option<std::net::IpAddr>,
    headers: &HeaderMap,
    request_id: &str,
    body: bytes::Bytes,
    api: Api,
) -> Result<Response, ApiError> {
    let started = Instant::now();
    let engine = state.engine().ok_or(ApiError::NotReady)?;
    let served = state.served().ok_or(ApiError::NotReady)?.clone();
    // Parsing a body of up to `body_limit` bytes and rendering a chat (its
    // template, its token count) is CPU work: off the async threads.
    let e = Arc::clone(&engine);
    let req = tokio::task::spawn_blocking(move || match api {
        Api::Completion => {
            let req: CompletionRequest = rules::parse_body(&body)?;
            rules::check_completion(&req)?;
            served.check(&req.model)?;
            Ok(req)
        }
        // A chat has no kv_transfer_params: it is served whole or orchestrated.
        Api::Chat => chat::render(&*e, &served, &body),
    })
    .await
    .map_err(|e| ApiError::Internal(format!("request parsing task: {e}")))??;
    let header = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
            .filter(|v| !v.is_empty())
    };
    let role = state.config().role;
    let mut req = req;
    let params = req.kv_transfer_params.clone().unwrap_or_default();
    // A decode from a remote prefill serves the prefill's ids (handed over
    // in kv_transfer_params), never the door's.
    if !params.do_remote_prefill {
        take_door_ids(state, &*engine, &mut req);
    }
    // `release_only` releases a handle's KV: without the decode half of the
    // protocol (and so a handle) there is nothing to release, and serving
    // the request as a completion would answer what was not asked.
    if params.release_only && !params.do_remote_prefill {
        return Err(ApiError::Rule(RuleError::param(
            "kv_transfer_params",
            "kv_transfer_params.release_only needs do_remote_prefill and the kv_handle whose KV it releases",
        )));
    }
    // A continuation is served whole, from its token ids.
    if params.resumed_tokens > 0
        && (params.do_remote_decode
            || params.do_remote_prefill
            || !matches!(req.prompt, Prompt::Tokens(_)))
    {
        return Err(ApiError::Rule(RuleError::param(
            "kv_transfer_params",
            "kv_transfer_params.resumed_tokens is for a request served whole whose prompt is token ids",
        )));
    }
    if params.do_remote_decode {
        if role == Role::Decode {
            return Err(ApiError::WrongRole(
                "this worker has role decode: it does not serve prefill-only requests (kv_transfer_params.do_remote_decode)".into(),
            ));
        }
        // Only a front door or a decode worker asks for a prefill whose KV
        // nobody else would read.
        if !client.is_some_and(|ip| state.config().front_door_allow.admits(ip)) {
            return Err(ApiError::PdRefused(format!(
                "prefill-only requests (kv_transfer_params.do_remote_decode) are taken only from the front doors and decode workers (--front-door-allow), not from {}",
                client
                    .map(|ip| ip.to_string())
                    .unwrap_or_else(|| "an unknown client".into())
            )));
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
    let call = Call {
        state,
        engine: &engine,
        request_id,
        api,
        started,
    };
    if role == Role::Prefill {
        return Err(ApiError::WrongRole(match api {
            Api::Completion => "this worker has role prefill: it only prefills; send kv_transfer_params {\"do_remote_decode\": true}".into(),
            Api::Chat => "this worker has role prefill: it only prefills, and a chat is served whole by a decode or solo worker (which may send its prefill here)".into(),
        }));
    }
    if params.do_remote_prefill {
        tracing::info!(mode = "decode");
        return decode_remote(call, &req, params).await;
    }
    if headers
        .get(headers::PREFILLER_HOST_PORT)
        .is_some_and(|v| v.to_str().is_err())
    {
        return Err(ApiError::PrefillRefused(
            crate::allow::PickError::Malformed {
                entry: String::new(),
                reason: "not visible ASCII",
            },
        ));
    }
    if let Some(raw) = header(headers::PREFILLER_HOST_PORT) {
        // Only an entry the allowlist admits is ever connected to.
        let peer = state
            .config()
            .prefill_allow
            .pick(raw)
            .map_err(ApiError::PrefillRefused)?;
        tracing::info!(mode = "orchestrate", prefiller = %peer);
        let transport = header(headers::KV_TRANSPORT).map(String::from);
        return orchestrate(call, &req, &peer, transport).await;
    }
    tracing::info!(mode = "local");
    serve_local(call, &req).await
}

/// How often a tokenizer mismatch is logged: the first, then every this many.
const MISMATCH_LOG_EVERY: u64 = 1000;

/// A front door's token ids (`tokenized_prompt`) made the prompt when the
/// tokenizer that made them is this engine's (the same digest): the text
/// prompt becomes those ids (counted), so it is not tokenized again. Under
/// another digest they are ignored (counted, a warning the first time and
/// every [`MISMATCH_LOG_EVERY`]th) and the text is tokenized here; they stay
/// on the request for an orchestrated prefill peer, which judges them by its
/// own digest. A request that echoes its prompt keeps its text (the echo is
/// the text as sent); ids the engine would refuse (empty, past the
/// vocabulary, no room for a generated token) leave the text to be
/// tokenized and refused as it would be without them.
fn take_door_ids(state: &WorkerState, engine: &dyn Engine, req: &mut CompletionRequest) {
    let Some(door) = req.tokenized_prompt.take() else {
        return;
    };
    let text = match &req.prompt {
        Prompt::Text(_) => true,
        Prompt::TextBatch(v) => v.len() == 1,
        Prompt::Tokens(_) | Prompt::TokensBatch(_) => false,
    };
    let Some(ours) = engine.tokenizer_digest() else {
        return;
    };
    if !text {
        return;
    }
    if door.digest != ours {
        let m = &state.metrics().tokenizer_mismatches;
        m.inc();
        let n = m.get();
        if n == 1 || n.is_multiple_of(MISMATCH_LOG_EVERY) {
            tracing::warn!(
                door_digest = %door.digest.chars().take(64).collect::<String>(),
                worker_digest = ours,
                mismatches = n,
                "a front door tokenized this prompt with another tokenizer (its digest is not this worker's): its ids are ignored and the text is tokenized here; give the door the workers' model file"
            );
        }
        req.tokenized_prompt = Some(door);
        return;
    }
    if req.echo == Some(true) {
        return;
    }
    let info = engine.info();
    let usable = !door.ids.is_empty()
        && door.ids.len() < info.seq_len
        && door.ids.iter().all(|id| (*id as usize) < info.vocab_size);
    if usable {
        req.prompt = Prompt::Tokens(door.ids);
        state.metrics().prompt_ids_reused.inc();
    }
}

/// Prefills and decodes `req` on this worker's engine (the local mode, and
/// the fallback of an orchestrated request whose peer refused it for its
/// length): the engine's own context length decides whether it fits.
async fn serve_local(call: Call<'_>, req: &CompletionRequest) -> Result<Response, ApiError> {
    let Call {
        state,
        engine,
        request_id,
        api,
        started,
    } = call;
    let prompt = prompt_ids(engine, &req.prompt).await?;
    let seed = client_seed(req).unwrap_or_else(random_seed);
    let sp = sampling(req, &prompt, engine.info(), seed)?;
    // `Engine::generate` is exactly this prefill and decode; called apart,
    // the prefill's queue wait and compute are measured.
    let called = Instant::now();
    let pre = engine.prefill(&prompt, &sp).await?;
    let phases = Phases::computed(called.elapsed(), pre.elapsed, Instant::now());
    let m = state.metrics();
    m.prefills.inc();
    m.prefill_seconds.observe(pre.elapsed.as_secs_f64());
    let rx = engine.decode(&prompt, pre, &sp).await?;
    let meta = Meta::new(
        api,
        engine,
        req,
        &prompt,
        request_id,
        started,
        Timings::default(),
    )?
    .with_phases(phases);
    respond(state.clone(), meta, rx, req.sampling.stream).await
}

/// The prompt as token ids (one prompt per request); text is tokenized off
/// the async threads, and never past the context: a text that cannot fit
/// with one generated token (its bytes prove it, or a bounded prefix does:
/// `Engine::tokenize_within`) is the context-length 400 before it is
/// tokenized whole.
pub(super) async fn prompt_ids(
    engine: &Arc<dyn Engine>,
    prompt: &Prompt,
) -> Result<Vec<u32>, ApiError> {
    let tokenize = |text: &str| {
        let (e, t) = (Arc::clone(engine), text.to_string());
        async move {
            tokio::task::spawn_blocking(move || text_ids(&*e, &t))
                .await
                .map_err(|e| ApiError::Internal(format!("tokenizer task: {e}")))?
                .map_err(ApiError::from)?
                .map_err(ApiError::from)
        }
    };
    let ids = match prompt {
        Prompt::Text(t) => tokenize(t).await?,
        Prompt::TextBatch(v) if v.len() == 1 => tokenize(&v[0]).await?,
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

/// A text's token ids when at least one generated token fits after them in
/// the compiled context; otherwise the context-length refusal, found without
/// tokenizing more of the text than needed (blocking). The outer error is
/// the tokenizer's.
pub(super) fn text_ids(
    engine: &dyn Engine,
    text: &str,
) -> Result<Result<Vec<u32>, RuleError>, rngd_engine::EngineError> {
    let seq_len = engine.info().seq_len;
    Ok(
        match engine.tokenize_within(text, seq_len.saturating_sub(1))? {
            rngd_engine::tokenizer::Within::Ids(ids) => Ok(ids),
            rngd_engine::tokenizer::Within::TooLong { at_least, .. } => {
                Err(rules::prompt_too_long(at_least, None, seq_len))
            }
        },
    )
}

pub(super) fn check_vocab(ids: &[u32], vocab: usize) -> Result<(), ApiError> {
    Ok(rules::check_token_ids(ids, vocab)?)
}

/// The client's seed as the engine's `u64` (negative: two's complement).
pub(super) fn client_seed(req: &CompletionRequest) -> Option<u64> {
    req.sampling.seed.map(rules::seed_bits)
}

/// The parameters that name token ids, checked against the vocabulary:
/// `logit_bias` (returned as pairs) and `stop_token_ids`.
pub(super) fn token_params(
    req: &CompletionRequest,
    vocab: usize,
) -> Result<Vec<(u32, f32)>, ApiError> {
    let f = &req.sampling;
    let logit_bias = rules::logit_bias(f)?;
    if let Some((id, _)) = logit_bias.iter().find(|(id, _)| *id as usize >= vocab) {
        return Err(RuleError::param(
            "logit_bias",
            format!("logit_bias token id {id} is outside the vocabulary (size {vocab})"),
        )
        .into());
    }
    let stops = f.stop_token_ids.as_deref().unwrap_or_default();
    if let Some(id) = stops.iter().find(|id| **id as usize >= vocab) {
        return Err(RuleError::param(
            "stop_token_ids",
            format!("stop_token_ids: {id} is outside the vocabulary (size {vocab})"),
        )
        .into());
    }
    Ok(logit_bias)
}

/// Sampling parameters of a request with its `seed` resolved (the client's,
/// the prefill's, or a fresh random one: `docs/pd-protocol.md`); the
/// context-length check and the vocabulary checks of `logit_bias` and
/// `stop_token_ids` happen here, before any work.
pub(super) fn sampling(
    req: &CompletionRequest,
    prompt: &[u32],
    info: &ModelInfo,
    seed: u64,
) -> Result<SamplingParams, ApiError> {
    let f = &req.sampling;
    rules::check_sampling(f)?;
    let max_tokens = rules::max_tokens_or_default(f.max_tokens) as usize;
    // A continued stream: the prompt ends with its own output so far.
    let resumed = req
        .kv_transfer_params
        .as_ref()
        .map_or(0, |p| p.resumed_tokens as usize);
    if resumed > 0 && (resumed >= prompt.len() || resumed > max_tokens) {
        return Err(RuleError::param(
            "kv_transfer_params",
            format!(
                "kv_transfer_params.resumed_tokens {resumed} must be fewer than the prompt's {} tokens and at most max_tokens {max_tokens}",
                prompt.len()
            ),
        )
        .into());
    }
    rngd_engine::check_context(prompt.len() - resumed, max_tokens, info.seq_len)?;
    let logit_bias = token_params(req, info.vocab_size)?;
    let stop_token_ids = f.stop_token_ids.clone().unwrap_or_default();
    let min_tokens = f.min_tokens.unwrap_or(0) as usize;
    if min_tokens > max_tokens {
        return Err(RuleError::param(
            "min_tokens",
            format!("min_tokens {min_tokens} is more than max_tokens {max_tokens}"),
        )
        .into());
    }
    Ok(SamplingParams {
        max_tokens,
        temperature: f.temperature.unwrap_or(1.0),
        top_k: rules::top_k(f),
        top_p: f.top_p.unwrap_or(1.0),
        min_p: f.min_p.unwrap_or(0.0),
        seed,
        stop: f.stop.as_ref().map(|s| s.to_vec()).unwrap_or_default(),
        presence_penalty: f.presence_penalty.unwrap_or(0.0),
        frequency_penalty: f.frequency_penalty.unwrap_or(0.0),
        repetition_penalty: f.repetition_penalty.unwrap_or(1.0),
        logit_bias,
        min_tokens,
        ignore_eos: f.ignore_eos.unwrap_or(false),
        stop_token_ids,
        logprobs: req.chat_logprobs.or(req.logprobs).map(|n| n as usize),
        cache_salt: f.cache_salt.clone(),
        skip_special_tokens: f.skip_special_tokens.unwrap_or(true),
        resumed,
    })
}
