//! The three PD modes of a completion: prefill for a remote decode (push the
//! KV, answer with the handle), decode from a pulled KV (nothing
//! re-prefilled; a handle serves one decode, and a `release_only` request
//! releases it without one), and the llm-d sidecar's orchestration of a
//! prefill peer (the handoff itself is `rngd_api::pd`'s, shared with the
//! gateway).

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::response::{IntoResponse, Response};
use rngd_api::openai::{CompletionChoice, CompletionRequest, CompletionResponse, Timings, Usage};
use rngd_api::pd::{self, KvLoadFailurePolicy, KvReleaseAnswer, KvTransferParams};
use rngd_api::rules::{ms, unix_now};
use rngd_engine::{Engine, KvCache, Prefilled};
use rngd_kv_transport::{KvPayload, KvTransport, Reserved, SinkShape};
use rngd_kv_wire::{KvHandle, WIRE_TRIMMED};

use super::respond::{Api, Meta, Phases, respond};
use super::{check_vocab, client_seed, prompt_ids, sampling, token_params};
use crate::allow::PeerAddr;
use crate::error::ApiError;
use crate::handles::{
    CLOCK_SKEW_MS, Claims, HandleError, KvAuth, check_shape, new_kv_key, random_seed,
};
use crate::state::WorkerState;

/// Extra time the worker gives a transport's own pull timeout before giving up itself.
const PULL_GRACE: Duration = Duration::from_secs(2);

/// Prefill half of the PD protocol: prefill, push, answer with the first token and the handle.
pub(super) async fn prefill_for_remote(
    state: &WorkerState,
    engine: &Arc<dyn Engine>,
    req: &CompletionRequest,
    request_id: &str,
    transport_name: Option<&str>,
    started: Instant,
) -> Result<Response, ApiError> {
    if matches!(state.config().kv_auth, KvAuth::Off) {
        return Err(ApiError::PdRefused(
            "this worker has no KV secret (AIRM_KV_TCP_SECRET / AIRM_KV_TCP_SECRET_FILE): it serves no prefill for a remote decode".into(),
        ));
    }
    let prompt = prompt_ids(engine, &req.prompt).await?;
    // The decode continues this seed's stream: the client's, or a fresh one.
    let seed = client_seed(req).unwrap_or_else(random_seed);
    let sp = sampling(req, &prompt, engine.info(), seed)?;
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
    // The cache's name: 128 random bits, never the client's request id (two
    // requests with one id must not share, and nobody may guess it).
    let key = new_kv_key();
    tracing::debug!(kv_key = %key, "KV key");
    let push_err = |source| ApiError::KvPush {
        transport: transport.name().to_string(),
        request_id: request_id.to_string(),
        source: Box::new(source),
    };
    // Where the transport has room to write in place (shm's slot arena),
    // the engine writes its cache straight into it: one copy, checksummed
    // in the same pass. Otherwise it exports blobs, which are pushed.
    let shape = SinkShape {
        layout: engine.info().kv_layout,
        tokens: prompt.len(),
        wire: WIRE_TRIMMED,
    };
    let room = transport.reserve(&key, shape).await.map_err(push_err)?;
    let called = Instant::now();
    let (pre, slot) = match room {
        Some(Reserved { sink, slot }) => {
            (engine.prefill_into(&prompt, &sp, sink).await?, Some(slot))
        }
        None => (engine.prefill(&prompt, &sp).await?, None),
    };
    let phases = Phases::computed(called.elapsed(), pre.elapsed, Instant::now());
    let prefill_ms = ms(pre.elapsed);
    let m = state.metrics();
    m.prefills.inc();
    m.prefill_seconds.observe(pre.elapsed.as_secs_f64());
    let first = pre.first_token;
    let first_logprobs = pre.first_logprobs.clone();
    let t0 = Instant::now();
    let path = if slot.is_some() { "in_place" } else { "push" };
    let handle = match slot {
        Some(slot) => slot.publish().await,
        None => {
            transport
                .push(KvPayload {
                    request_id: key,
                    layout: pre.kv.layout,
                    tokens: pre.kv.tokens,
                    wire: pre.kv.wire,
                    blobs: pre.kv.blobs,
                })
                .await
        }
    }
    .map_err(push_err)?;
    m.kv_handoffs.with_label_values(&[path]).inc();
    let kv_save_ms = ms(t0.elapsed());
    m.kv_save_seconds.observe(kv_save_ms / 1e3);
    tracing::info!(
        transport = transport.name(),
        path,
        prompt_tokens = prompt.len(),
        prefill_ms,
        kv_save_ms,
        "KV handed over"
    );
    let text = engine.detokenize(&[first])?;
    let expires_ms = unix_ms().saturating_add(state.config().handle_ttl.as_millis() as u64);
    let cached_tokens = u32::try_from(pre.cached_tokens).unwrap_or(u32::MAX);
    let weight_version = engine.info().weight_version.clone();
    let claims = Claims {
        seed: Some(seed),
        first_token_logprobs: first_logprobs.as_ref(),
        cached_tokens: Some(cached_tokens),
        weight_version: Some(&weight_version),
    };
    let signature = match &state.config().kv_auth {
        KvAuth::Signed(s) => Some(s.sign_with(&handle, first, &prompt, expires_ms, &claims)),
        KvAuth::Insecure | KvAuth::Off => None,
    };
    let total = ms(started.elapsed());
    let prompt_tokens = prompt.len();
    // As vLLM's prefill instance counts it: a request of one generated
    // token, finished by length.
    m.finished(&crate::metrics::Finished {
        model: &engine.info().name,
        ttft: Some(started.elapsed()),
        e2e: started.elapsed(),
        queue: phases.queue,
        prefill: phases.prefill,
        decode: Duration::ZERO,
        tpot: None,
        prompt_tokens,
        generated: 1,
        reason: "length",
        max_tokens: 1,
        cached_tokens: pre.cached_tokens,
        loaded_tokens: 0,
    });
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
            stop_reason: None,
            token_ids: Some(vec![first]),
        }],
        usage: Some(Usage::new(prompt_tokens as u32, 1).with_cached(cached_tokens)),
        kv_transfer_params: Some(KvTransferParams {
            do_remote_prefill: true,
            kv_handle: Some(handle),
            kv_handle_signature: signature,
            kv_handle_expires_ms: Some(expires_ms),
            first_token: Some(first),
            prompt_token_ids: Some(prompt),
            seed: Some(seed),
            first_token_logprobs: first_logprobs,
            cached_tokens: Some(cached_tokens),
            weight_version: Some(weight_version),
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

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// One request's context for the modes that answer with a generation.
#[derive(Clone, Copy)]
pub(super) struct Call<'a> {
    /// The worker.
    pub(super) state: &'a WorkerState,
    /// Its engine.
    pub(super) engine: &'a Arc<dyn Engine>,
    /// The request id.
    pub(super) request_id: &'a str,
    /// The API it came in by (the answer's format).
    pub(super) api: Api,
    /// Arrival time.
    pub(super) started: Instant,
}

/// Decode half of the PD protocol: check the handle, refuse KV other weights
/// made (409, the KV released unpulled), take it (a handle serves
/// one decode: one already consumed or released is a 410 at once), pull
/// (nothing is re-prefilled), release, continue. With `release_only`: check
/// the handle, release its KV without pulling, answer [`KvReleaseAnswer`].
pub(super) async fn decode_remote(
    call: Call<'_>,
    req: &CompletionRequest,
    params: KvTransferParams,
) -> Result<Response, ApiError> {
    let Call {
        state,
        engine,
        request_id,
        api,
        started,
    } = call;
    let missing = |what: &str| {
        ApiError::BadRequest(format!("kv_transfer_params.do_remote_prefill needs {what}"))
    };
    let handle = params.kv_handle.ok_or_else(|| missing("kv_handle"))?;
    let first = params.first_token.ok_or_else(|| missing("first_token"))?;
    let prompt = match params.prompt_token_ids {
        Some(p) => p,
        None => prompt_ids(engine, &req.prompt).await?,
    };
    check_vocab(&prompt, engine.info().vocab_size)?;
    // Nothing is pulled (or deleted) before the handle is known to be ours
    // and to fit this model.
    check_shape(&handle, &engine.info().kv_layout, prompt.len())?;
    let now = unix_ms();
    // A lease that is over (verified first when handles are signed): its KV
    // is released, not waited for.
    let mut expired: Option<u64> = None;
    // How long the record of this handle's use must last: until the handle
    // itself is refused as expired.
    let used_until = match &state.config().kv_auth {
        KvAuth::Off => {
            return Err(ApiError::PdRefused(
                "this worker has no KV secret (AIRM_KV_TCP_SECRET / AIRM_KV_TCP_SECRET_FILE): it takes no remote prefill".into(),
            ));
        }
        KvAuth::Insecure => {
            if let Some(e) = params.kv_handle_expires_ms
                && now > e.saturating_add(CLOCK_SKEW_MS)
            {
                expired = Some(now - e);
            }
            now.saturating_add(state.config().handle_ttl.as_millis() as u64)
                .saturating_add(CLOCK_SKEW_MS)
        }
        KvAuth::Signed(signer) => {
            let sig = params
                .kv_handle_signature
                .as_deref()
                .ok_or(HandleError::Unsigned)?;
            let expires = params
                .kv_handle_expires_ms
                .ok_or(HandleError::BadSignature)?;
            let claims = Claims {
                seed: params.seed,
                first_token_logprobs: params.first_token_logprobs.as_ref(),
                cached_tokens: params.cached_tokens,
                weight_version: params.weight_version.as_deref(),
            };
            match signer.verify_with(&handle, first, &prompt, expires, &claims, sig, now) {
                Ok(()) => {}
                Err(HandleError::Expired { ago_ms }) => expired = Some(ago_ms),
                Err(e) => return Err(e.into()),
            }
            expires.saturating_add(CLOCK_SKEW_MS)
        }
    };
    let transport = state
        .transports()
        .get(Some(&handle.transport))
        .map_err(|source| ApiError::UnknownTransport {
            name: handle.transport.clone(),
            source: Box::new(source),
        })?;
    if params.release_only {
        return release_only(state, transport, handle, used_until, now).await;
    }
    if let Some(ago_ms) = expired {
        // Whatever the transport still holds of it is freed now.
        release_kv(&*transport, &handle).await;
        return Err(kv_unavailable(
            state,
            "expired",
            format!(
                "its lease ended {ago_ms} ms ago (kv_handle_expires_ms), transport `{}`, request {request_id}",
                handle.transport
            ),
        ));
    }
    // KV made by other weights would continue into wrong tokens: it is
    // released unpulled (no decode can use it anywhere it is not stale) and
    // the handle refused from now on.
    let ours = &engine.info().weight_version;
    if params.weight_version.as_ref() != Some(ours) {
        let used = state.used_handles();
        if used.release(&handle.request_id, used_until, now) != pd::HandleState::Unused {
            // A retry (or a handle released before): the 410 a spent handle gets.
            if let Err(u) = used.take(&handle.request_id, used_until, now) {
                return Err(ApiError::KvHandleUsed {
                    state: u.state,
                    ago_ms: u.ago_ms,
                });
            }
        }
        release_kv(&*transport, &handle).await;
        state.metrics().weight_version_refusals.inc();
        return Err(ApiError::WeightVersion {
            theirs: params.weight_version,
            ours: ours.clone(),
        });
    }
    // The prefill's seed (signed) continues its stream.
    let seed = params
        .seed
        .or_else(|| client_seed(req))
        .unwrap_or_else(random_seed);
    let sp = sampling(req, &prompt, engine.info(), seed)?;
    if sp.logprobs.is_some() && params.first_token_logprobs.is_none() {
        return Err(HandleError::NoFirstLogprobs.into());
    }
    // Taken before the pull: a second decode of this handle (a retry, an
    // orchestrator's re-send) is refused now instead of waiting the pull
    // timeout for a KV that is gone.
    state
        .used_handles()
        .take(&handle.request_id, used_until, now)
        .map_err(|u| ApiError::KvHandleUsed {
            state: u.state,
            ago_ms: u.ago_ms,
        })?;
    let timeout = state.config().kv_pull_timeout;
    let t0 = Instant::now();
    // Released after the pull, failed or not, and also if this request is
    // dropped while pulling (its client went away).
    let release = ReleaseOnDrop::new(transport.clone(), handle.clone());
    // The prefill answered after its push: KV that is not there now is
    // gone, refused at once (`pull_published`); `timeout` bounds the bytes.
    let pulled = tokio::time::timeout(
        timeout + PULL_GRACE,
        transport.pull_published(&handle, timeout),
    )
    .await;
    release.now().await;
    let blobs = match pulled {
        Ok(Err(rngd_kv_transport::KvError::NotFound { .. })) => {
            return Err(kv_unavailable(
                state,
                "not_found",
                format!(
                    "transport `{}` no longer holds it (released, expired or taken), request {request_id}",
                    handle.transport
                ),
            ));
        }
        Err(_) => {
            return Err(ApiError::KvPullTimeout {
                transport: handle.transport.clone(),
                request_id: request_id.to_string(),
                waited: t0.elapsed(),
            });
        }
        Ok(Err(source)) => {
            return Err(ApiError::KvPull {
                transport: handle.transport.clone(),
                request_id: request_id.to_string(),
                source: Box::new(source),
            });
        }
        Ok(Ok(b)) => b,
    };
    let kv_load_ms = ms(t0.elapsed());
    // The KV load is this worker's prefill phase; what came before it (an
    // orchestrated request's remote prefill too) is its queue.
    let phases = Phases {
        queue: t0.saturating_duration_since(started),
        prefill: t0.elapsed(),
        prefill_end: Instant::now(),
    };
    let m = state.metrics();
    m.kv_loads.inc();
    m.kv_load_seconds.observe(kv_load_ms / 1e3);
    tracing::info!(
        transport = transport.name(),
        bytes = handle.total_bytes(),
        kv_load_ms,
        "KV loaded and released"
    );
    let prefilled = Prefilled {
        first_token: first,
        first_logprobs: params.first_token_logprobs.clone(),
        kv: KvCache {
            // This engine's: a trimmed handle of another context length was
            // admitted by `check_shape` (its blobs are the same).
            layout: engine.info().kv_layout,
            tokens: handle.tokens,
            wire: handle.wire,
            blobs,
        },
        elapsed: Duration::ZERO,
        // The prefill worker's cache hit (signed with the handle), reported
        // in this answer's usage.
        cached_tokens: params.cached_tokens.map_or(0, |c| c as usize),
    };
    let rx = engine.decode(&prompt, prefilled, &sp).await?;
    let timings = Timings {
        prefill_ms: params.prefill_ms,
        kv_save_ms: params.kv_save_ms,
        kv_load_ms: Some(kv_load_ms),
        kv_transfer_ms: Some(params.kv_save_ms.unwrap_or(0.0) + kv_load_ms),
        ..Timings::default()
    };
    let meta = Meta::new(api, engine, req, &prompt, request_id, started, timings)?
        .with_phases(phases)
        .with_loaded_kv();
    respond(state.clone(), meta, rx, req.sampling.stream).await
}

/// The 410 of a handle whose KV cannot be loaded, counted.
fn kv_unavailable(state: &WorkerState, reason: &'static str, detail: String) -> ApiError {
    state
        .metrics()
        .kv_load_failures
        .with_label_values(&[reason])
        .inc();
    tracing::info!(reason, %detail, "KV unavailable: refused before any pull");
    ApiError::KvUnavailable { reason, detail }
}

/// `release_only`: the orchestrator gave the request up after the prefill.
/// The KV is released without a pull (again, if a decode had taken it: one
/// dropped mid-pull may not have), and the handle is refused from now on.
async fn release_only(
    state: &WorkerState,
    transport: Arc<dyn KvTransport>,
    handle: KvHandle,
    used_until: u64,
    now: u64,
) -> Result<Response, ApiError> {
    let previous = state
        .used_handles()
        .release(&handle.request_id, used_until, now);
    release_kv(&*transport, &handle).await;
    tracing::info!(
        transport = transport.name(),
        previous = previous.as_str(),
        "KV released without a decode"
    );
    let answer = KvReleaseAnswer {
        object: "kv_release".into(),
        kv_key: handle.request_id,
        previous_state: previous,
    };
    Ok(axum::Json(answer).into_response())
}

/// Releases a handle's KV now; a failure is only logged (the transport's
/// TTL frees what is left).
async fn release_kv(transport: &dyn KvTransport, handle: &KvHandle) {
    if let Err(e) = transport.release(handle).await {
        tracing::warn!(transport = transport.name(), error = %e, "KV release failed; the transport's TTL will free it");
    }
}

/// Releases a handle's KV: [`ReleaseOnDrop::now`], or in the background if
/// dropped first (the request was cancelled mid-pull).
struct ReleaseOnDrop {
    armed: Option<(Arc<dyn KvTransport>, KvHandle)>,
}

impl ReleaseOnDrop {
    fn new(transport: Arc<dyn KvTransport>, handle: KvHandle) -> Self {
        ReleaseOnDrop {
            armed: Some((transport, handle)),
        }
    }

    async fn now(mut self) {
        if let Some((t, h)) = self.armed.take() {
            release_kv(&*t, &h).await;
        }
    }
}

impl Drop for ReleaseOnDrop {
    fn drop(&mut self) {
        let Some((t, h)) = self.armed.take() else {
            return;
        };
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        rt.spawn(async move {
            if let Err(e) = t.release(&h).await {
                tracing::warn!(transport = t.name(), error = %e, "KV release after a cancelled pull failed; the transport's TTL will free it");
            }
        });
    }
}

/// llm-d routing-sidecar behaviour: prefill on `peer` (admitted by the
/// allowlist), then decode here. The prefill request and the verdict on the
/// answer are `rngd_api::pd`'s, the gateway's own.
pub(super) async fn orchestrate(
    call: Call<'_>,
    req: &CompletionRequest,
    peer: &PeerAddr,
    transport: Option<String>,
) -> Result<Response, ApiError> {
    let Call {
        state,
        engine,
        request_id,
        ..
    } = call;
    // Refused here, as a whole request would be, before the peer prefills.
    token_params(req, engine.info().vocab_size)?;
    // The peer prefills a completion (a chat arrives here already rendered).
    let pre = pd::prefill_request(req, transport);
    let answer = match state
        .peer()
        .prefill(peer, request_id, &pre, state.config().prefill_timeout)
        .await
    {
        // The peer holds less context than the router's last scrape said (a
        // variant switch since): this worker prefills the prompt itself, if
        // its own context holds it (else its own 400).
        Err(ApiError::PrefillPeerRejected {
            status: 400,
            code: Some(code),
            ..
        }) if code == rngd_api::openai::CONTEXT_LENGTH_CODE => {
            tracing::warn!(prefiller = %peer, "prefill peer refused the prompt as too long; prefilling it here");
            state.metrics().prefill_context_fallbacks.inc();
            return super::serve_local(call, req).await;
        }
        other => other?,
    };
    let handoff = pd::decode_request_from(req, &answer).map_err(|e| ApiError::PrefillPeer {
        peer: peer.to_string(),
        request_id: request_id.to_string(),
        stage: "parse",
        detail: e.to_string(),
        source: None,
    })?;
    match decode_remote(call, &handoff.request, handoff.params).await {
        // The KV could not be loaded (gone, expired, taken, other weights):
        // by this worker's policy, the request is served whole here with
        // the prefill's seed (the same tokens), or the refusal answered.
        Err(e)
            if state.config().kv_load_failure_policy == KvLoadFailurePolicy::Recompute
                && pd::kv_load_failed(e.status().as_u16(), e.body().error.code.as_deref()) =>
        {
            tracing::warn!(prefiller = %peer, error = %e.message(), "KV not loadable; recomputing the request here");
            state.metrics().kv_recomputes.inc();
            super::serve_local(call, &pd::recompute_request(&handoff.request)).await
        }
        other => other,
    }
}
