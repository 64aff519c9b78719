//! One request's journey: policy → prefill (PD protocol) → decode, streamed
//! through as it arrives, with ids and model rewritten and timings added.
//!
//! The PD handoff (the prefill request, the verdict on its answer, the
//! decode request) is `rngd_api::pd`'s, the same a decode worker uses for
//! `x-prefiller-host-port`.
//!
//! Cancellation: the response stream owns the upstream decode stream, so a
//! client that goes away drops it and the decode worker sees its connection
//! close (and cancels). Between a successful prefill and the decode worker's
//! answer, a [`KvGuard`] is armed: if the request is abandoned there (or the
//! decode fails), it sends the decode worker a `release_only` request for the
//! handle in the background, so the worker releases the KV without pulling it
//! and refuses any later decode of it. No decode is ever sent for a cache
//! nobody will read.
//!
//! What reaches a worker is the request body and `x-request-id`, no header
//! of the client's: a client-sent `x-gateway-destination-endpoint*` or
//! `x-prefiller-host-port` reaches no worker (and `rngd_pool::pick` drops
//! them before the policy reads the request; the gateway gives it no subset
//! hint).
//!
//! - this module: the flow itself (policy → prefill → decode);
//! - [`upstream`]: calls to the workers (timeouts, status mapping, the [`KvGuard`]);
//! - [`respond`]: the non-streamed answer and the request's timings and metrics;
//! - [`stream`]: the streamed answer, chunk by chunk (typed worker chunks);
//! - [`migrate`]: an answer moved to another decode worker when its own
//!   dies (`--migration-limit`): a stream continues where it stopped, a
//!   whole answer is asked again.

mod migrate;
mod respond;
mod stream;
mod upstream;

use std::sync::Arc;
use std::time::Instant;

use axum::http::{HeaderMap, HeaderValue, header};
use axum::response::{IntoResponse, Response};
use rngd_api::openai::CompletionResponse;
use rngd_api::pd::{self, KvLoadFailurePolicy, KvTransferParams};
use rngd_api::rules::unix_now;
use rngd_pool::{ApiKind, PickError, PickRequest};
use tracing::Instrument;

use crate::error::{ApiError, Stage};
use crate::state::Gateway;
use respond::{Ctx, full_response};
use stream::stream_response;
use upstream::{KvGuard, call_bytes, read_with_timeout, send};

/// A worker's "not now" (503): not ready, draining, out of budget.
const UNAVAILABLE: u16 = 503;

/// A validated request ([`rngd_pool::prepare`]) and where it arrived.
#[derive(Debug, Clone)]
pub struct Prepared {
    /// The request in the completion form the workers speak, and its count.
    pub request: rngd_pool::Prepared,
    /// Request path.
    pub path: String,
    /// Arrival time.
    pub started: Instant,
    /// Told when this request's prompt is prefilled (a PD route: the prefill
    /// worker answered) or routed to a worker that prefills it itself: the
    /// other choices of the same prompt (`n > 1`) wait for it, so the
    /// prompt is computed once and they find it cached.
    pub prefilled: Option<Arc<tokio::sync::watch::Sender<bool>>>,
}

impl Prepared {
    fn tell_prefilled(&self) {
        if let Some(tx) = &self.prefilled {
            tx.send_replace(true);
        }
    }
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
        prompt_ids: p.request.prompt_ids.clone(),
        cache_salt: p.request.upstream.sampling.cache_salt.clone(),
    };
    let t = Instant::now();
    let picked = gw.picker.pick_held(pick).await;
    gw.metrics.observe_policy(t.elapsed());
    // `held` counts this request against its decode worker until the
    // answer ends (it moves into the answer's `Ctx`).
    let (route, held, expected) = match picked {
        Ok(p) => (p.route, p.held, p.expected),
        Err(PickError::Rejected(local)) => {
            tracing::info!(status = local.status, "policy rejected the request");
            return Err(ApiError::PolicyReject {
                status: local.status,
                body: local.body,
            });
        }
        Err(e) => return Err(ApiError::Policy(e)),
    };
    let mut reason =
        rngd_pool::pick::route_reason(&route).and_then(|r| HeaderValue::from_str(r).ok());
    tracing::debug!(decode = %route.decode, prefill = ?route.prefill, kv_transport = ?route.kv_transport, reason = ?reason, "routed");

    // Prefill (PD), or none: the decode worker prefills itself.
    let mut decode_req = p.request.upstream.clone();
    let mut prefill_info: Option<(KvTransferParams, Instant)> = None;
    let mut guard = KvGuard::disarmed();
    if let Some(prefill) = &route.prefill {
        let req = pd::prefill_request(&p.request.upstream, route.kv_transport.clone());
        let answer = match call_bytes(
            &gw,
            Stage::Prefill,
            prefill,
            &req,
            &rid,
            gw.config.prefill_timeout,
        )
        .await
        {
            // The prefill worker holds less context than the last scrape
            // said (a variant switch since): the decode worker, which the
            // policy found the prompt fits, prefills it itself.
            Err(ApiError::UpstreamStatus {
                status: 400,
                code: Some(code),
                message,
                ..
            }) if code == rngd_api::openai::CONTEXT_LENGTH_CODE => {
                tracing::warn!(%prefill, %message, "prefill worker refused the prompt as too long; the decode worker prefills it");
                gw.metrics.count_prefill_context_fallback();
                reason = Some(HeaderValue::from_static("prefill_context_fallback"));
                None
            }
            other => Some(other?),
        };
        if let Some(answer) = answer {
            let handoff = pd::decode_request_from(&p.request.upstream, &answer).map_err(|e| {
                ApiError::Upstream {
                    stage: Stage::Prefill,
                    address: prefill.clone(),
                    detail: e.to_string(),
                    source: None,
                }
            })?;
            guard = KvGuard::arm(&gw, &route.decode, &handoff.request, &rid);
            decode_req = handoff.request;
            prefill_info = Some((handoff.params, Instant::now()));
        }
    }
    p.tell_prefilled();
    // What is left of the prepared request; its body and ids move into the
    // resume (no copy per request).
    let Prepared {
        request:
            rngd_pool::Prepared {
                kind,
                upstream,
                prompt_ids,
                include_usage,
                ..
            },
        started,
        ..
    } = p;
    let stream = upstream.sampling.stream;

    // Decode.
    let decode_sent = Instant::now();
    let mut resume = migrate::Resume::new(&gw, upstream, prompt_ids, &rid);
    let resp = send(
        &gw,
        Stage::Decode,
        &route.decode,
        &decode_req,
        &rid,
        gw.config.decode_timeout,
    )
    .await;
    // The decode worker could not load the KV (the lease over, the KV gone
    // or taken, other weights): it pulled nothing and said so at once. By
    // the policy, the request is served whole there with the prefill's seed
    // (the same tokens), or the refusal is the answer.
    let mut recomputed = false;
    let resp = match resp {
        Err(ApiError::UpstreamStatus {
            status, ref code, ..
        }) if prefill_info.is_some() && pd::kv_load_failed(status, code.as_deref()) => {
            let policy = gw.config.kv_load_failure_policy;
            gw.metrics.count_kv_load_failure(policy.as_str());
            tracing::warn!(decode = %route.decode, status, code = ?code, %policy, "the decode worker could not load the KV");
            match policy {
                KvLoadFailurePolicy::Recompute => {
                    recomputed = true;
                    send(
                        &gw,
                        Stage::Decode,
                        &route.decode,
                        &pd::recompute_request(&decode_req),
                        &rid,
                        gw.config.decode_timeout,
                    )
                    .await
                }
                KvLoadFailurePolicy::Fail => resp,
            }
        }
        other => other,
    };
    // The decode worker answered: it pulled the KV (a streamed answer starts
    // after the pull, a whole one after the decode). A refusal or a failure
    // leaves the guard armed: the KV is released when this returns.
    if resp.is_ok() {
        guard.disarm();
    }
    // A decode worker that cannot be reached (dead, or its connection
    // broken before any byte twice), or that answers 503 (restarted and
    // still loading its model, draining, out of listener budget: nothing
    // was generated): the request is served whole by another.
    let (resp, mut decode_at, mut held) = match resp {
        Err(
            e @ (ApiError::Upstream { .. }
            | ApiError::UpstreamStatus {
                status: UNAVAILABLE,
                ..
            }),
        ) => {
            let moved = match resume.as_mut() {
                Some(r) => r.move_off(&gw, &route.decode, &[], &e.to_string()).await,
                None => None,
            };
            match moved {
                Some(m) => {
                    // The handoff's KV is released through the worker that
                    // answered (the first one may never).
                    guard.retarget(&m.address);
                    (m.response, m.address, m.held)
                }
                None => return Err(e),
            }
        }
        other => (other?, route.decode.clone(), held),
    };
    let kv_transport = prefill_info.as_ref().map(|(params, _)| {
        route
            .kv_transport
            .clone()
            .or_else(|| params.kv_handle.as_ref().map(|h| h.transport.clone()))
            .unwrap_or_else(|| "unknown".to_string())
    });
    // A whole answer whose worker breaks off before it is read: asked again
    // of another worker (`migrate`).
    let (whole, streamed) = if stream {
        (None, Some(resp))
    } else {
        let mut resp = resp;
        let bytes = loop {
            match read_with_timeout(Stage::Decode, &decode_at, resp, gw.config.decode_timeout).await
            {
                Ok(b) => break Some(b),
                Err(e @ ApiError::Upstream { .. }) => {
                    let moved = match resume.as_mut() {
                        Some(r) => r.move_off(&gw, &decode_at, &[], &e.to_string()).await,
                        None => None,
                    };
                    let Some(m) = moved else { return Err(e) };
                    (resp, decode_at, held) = (m.response, m.address, m.held);
                }
                Err(e) => return Err(e),
            }
        };
        (bytes, None)
    };
    let moved = decode_at != route.decode;
    let ctx = Ctx {
        gw: gw.clone(),
        kind,
        id: match kind {
            ApiKind::Completion => format!("cmpl-{rid}"),
            ApiKind::Chat => format!("chatcmpl-{rid}"),
        },
        // Answers carry the served name, whichever alias the client sent
        // (as the workers and vLLM answer).
        model: gw.served().primary().to_string(),
        created: unix_now(),
        started,
        decode_sent,
        prefill: prefill_info,
        kv_transport,
        address: decode_at.clone(),
        _held: held,
        // The prediction was for the worker the policy chose.
        // (A recompute prefilled on the decode worker, not the predicted one.)
        expected: expected.filter(|_| !moved && !recomputed),
    };
    let mut resp = match (whole, streamed) {
        (_, Some(resp)) => stream_response(ctx, resp, include_usage, resume),
        (Some(bytes), None) => {
            let body: CompletionResponse =
                serde_json::from_slice(&bytes).map_err(|e| ApiError::Upstream {
                    stage: Stage::Decode,
                    address: decode_at.clone(),
                    detail: "its response is not a completion".into(),
                    source: Some(Box::new(e)),
                })?;
            full_response(ctx, body)
        }
        (None, None) => return Err(ApiError::Internal("no decode answer".into())),
    };
    // Why the policy routed it so, for the client (as the picker's Envoy
    // path adds it to the response headers).
    if let Some(v) = reason {
        resp.headers_mut()
            .insert(rngd_api::headers::ROUTE_REASON, v);
    }
    Ok(resp)
}
