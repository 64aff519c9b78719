//! The answer of a request that is not streamed, and what every answer
//! records: merged timings (prefill, KV transfer, TTFT, TPOT) and the
//! gateway's request metrics.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::response::{IntoResponse, Response};
use rngd_api::openai::{ChatCompletionResponse, CompletionResponse, Timings, Usage};
use rngd_api::pd::KvTransferParams;
use rngd_api::rules::ms;
use rngd_pool::ApiKind;

use crate::metrics::RequestSample;
use crate::state::Gateway;

/// What the response builders need.
pub(super) struct Ctx {
    pub(super) gw: Arc<Gateway>,
    pub(super) kind: ApiKind,
    pub(super) id: String,
    pub(super) model: String,
    pub(super) created: u64,
    pub(super) started: Instant,
    pub(super) decode_sent: Instant,
    pub(super) prefill: Option<(KvTransferParams, Instant)>,
    pub(super) kv_transport: Option<String>,
    pub(super) address: String,
    /// This request's count on its decode worker (`rngd_pool::inflight`),
    /// given back when the answer (its stream or body) is done with.
    pub(super) _held: rngd_pool::Held,
    /// The cached tokens the router's index predicted where this request
    /// is prefilled, held against the answer's `cached_tokens` when it
    /// ends (`rngd_pool::predicted`).
    pub(super) expected: Option<rngd_pool::Expected>,
}

impl Ctx {
    /// KV transfer = prefill's save + decode's load (or what the worker reports).
    pub(super) fn kv_transfer_ms(&self, t: &Timings) -> Option<f64> {
        let (params, _) = self.prefill.as_ref()?;
        if let Some(x) = t.kv_transfer_ms {
            return Some(x);
        }
        match (params.kv_save_ms.or(t.kv_save_ms), t.kv_load_ms) {
            (None, None) => None,
            (a, b) => Some(a.unwrap_or(0.0) + b.unwrap_or(0.0)),
        }
    }

    /// Records the answer's metrics and hands the router's cache
    /// prediction back with the `cached_tokens` the engine reported (an
    /// answer without usage leaves the prediction unchecked).
    pub(super) fn record(
        &mut self,
        ttft: Option<Duration>,
        completion_tokens: u64,
        kv_ms: Option<f64>,
        usage: Option<&Usage>,
    ) {
        if let (Some(e), Some(u)) = (self.expected.take(), usage) {
            e.served(
                u.prompt_tokens_details
                    .map_or(0, |d| d.cached_tokens as usize),
            );
        }
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

    pub(super) fn merged_timings(
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

pub(super) fn full_response(mut ctx: Ctx, mut body: CompletionResponse) -> Response {
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
    ctx.record(ttft, tokens, kv, body.usage.as_ref());
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
        ApiKind::Chat => axum::Json(ChatCompletionResponse::from_completion(body)).into_response(),
    }
}
