//! A generation stream as the answer: one JSON body, or server-sent events
//! (a chunk per token, the finish with timings, the optional usage chunk,
//! `[DONE]`), cancelled when the client goes away; in the completion format,
//! or in the chat format for a chat ([`Api::Chat`], through `rngd_api::chat`).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use rngd_api::chat::ChatChunker;
use rngd_api::openai::{
    ChatCompletionResponse, CompletionChoice, CompletionRequest, CompletionResponse, ErrorBody,
    Prompt, StreamOptions, Timings, Usage,
};
use rngd_api::rules::{ms, unix_now};
use rngd_engine::{Engine, FinishReason, GenEvent, StopReason};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tracing::Instrument;

use super::logprobs::{Builder, Format};
use crate::error::ApiError;
use crate::state::WorkerState;

/// The API a request came in by, and so the format of its answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Api {
    /// `/v1/completions`: `text_completion` bodies and chunks, ids `cmpl-…`.
    Completion,
    /// `/v1/chat/completions`: `chat.completion` bodies and
    /// `chat.completion.chunk` chunks, ids `chatcmpl-…`.
    Chat,
}

/// What every chunk or body of one response shares.
pub(super) struct Meta {
    api: Api,
    engine: Arc<dyn Engine>,
    /// The log-probabilities' format, when asked for.
    logprobs: Option<Format>,
    /// The prompt's text, with `echo`.
    echo: Option<String>,
    id: String,
    model: String,
    created: u64,
    prompt_tokens: usize,
    started: Instant,
    timings: Timings,
    phases: Phases,
    include_usage: bool,
    /// Every chunk carries the usage so far (`continuous_usage_stats`).
    continuous_usage: bool,
    /// The request's `max_tokens`.
    max_tokens: usize,
    /// The prompt's KV was loaded from a prefill worker.
    loaded_kv: bool,
}

impl Meta {
    /// The response's shared parts; `prompt`: the prompt's token ids.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        api: Api,
        engine: &Arc<dyn Engine>,
        req: &CompletionRequest,
        prompt: &[u32],
        request_id: &str,
        started: Instant,
        timings: Timings,
    ) -> Result<Self, ApiError> {
        let echo = match (req.echo, &req.prompt) {
            (Some(true), Prompt::Text(t)) => Some(t.clone()),
            (Some(true), Prompt::TextBatch(v)) if v.len() == 1 => Some(v[0].clone()),
            (Some(true), _) => Some(engine.detokenize(prompt)?),
            _ => None,
        };
        let logprobs = if req.chat_logprobs.is_some() {
            Some(Format::Chat)
        } else {
            req.logprobs.map(|_| Format::Completion)
        };
        let prompt_tokens = prompt.len();
        Ok(Meta {
            api,
            engine: Arc::clone(engine),
            logprobs,
            echo,
            id: match api {
                Api::Completion => format!("cmpl-{request_id}"),
                Api::Chat => format!("chatcmpl-{request_id}"),
            },
            model: engine.info().name.clone(),
            created: unix_now(),
            prompt_tokens,
            started,
            timings,
            phases: Phases::none(started),
            include_usage: req
                .sampling
                .stream_options
                .as_ref()
                .is_some_and(|o| o.include_usage),
            continuous_usage: req
                .sampling
                .stream_options
                .as_ref()
                .is_some_and(StreamOptions::continuous),
            max_tokens: rngd_api::rules::max_tokens_or_default(req.sampling.max_tokens) as usize,
            loaded_kv: false,
        })
    }

    /// The prompt's KV was loaded from a prefill worker (the decode of a
    /// PD request).
    pub(super) fn with_loaded_kv(mut self) -> Self {
        self.loaded_kv = true;
        self
    }

    /// The request's engine phases so far (see [`Phases`]).
    pub(super) fn with_phases(mut self, phases: Phases) -> Self {
        self.phases = phases;
        self
    }

    /// A log-probability builder, when the request asked for them.
    fn builder(&self) -> Option<Builder> {
        let offset = self.echo.as_ref().map_or(0, |e| e.chars().count());
        self.logprobs
            .map(|f| Builder::new(Arc::clone(&self.engine), f, offset))
    }

    /// The usage so far on a chunk, with `continuous_usage_stats`.
    fn running_usage(&self, chunk: &mut CompletionResponse, generated: usize) {
        if self.continuous_usage {
            chunk.usage = Some(Usage::new(self.prompt_tokens as u32, generated as u32));
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

/// A request's engine phases before its first token, for the `vllm:*`
/// request families (`docs/pd-protocol.md`, "Worker metrics"): the queue is the wait
/// before the first engine phase, the prefill that phase (a prefill computed
/// here, or the KV load of a remote prefill); the decode runs from its end
/// to the last token.
#[derive(Debug, Clone, Copy)]
pub(super) struct Phases {
    /// Waiting before the first engine phase.
    pub(super) queue: Duration,
    /// The phase that produced the first token.
    pub(super) prefill: Duration,
    /// When it ended.
    pub(super) prefill_end: Instant,
}

impl Phases {
    /// No phase measured: everything counts as decode from `started`.
    fn none(started: Instant) -> Self {
        Phases {
            queue: Duration::ZERO,
            prefill: Duration::ZERO,
            prefill_end: started,
        }
    }

    /// A prefill computed here: it took `compute` of the `wall` time the
    /// call took until `end`; the rest was its wait in the engine's queue.
    pub(super) fn computed(wall: Duration, compute: Duration, end: Instant) -> Self {
        Phases {
            queue: wall.saturating_sub(compute),
            prefill: compute,
            prefill_end: end,
        }
    }
}

/// The `vllm:*` request families of one response, recorded once: at its
/// finish, or as `abort` when it is dropped before that (its client went
/// away, the drain cut it, the engine failed).
struct Tally {
    state: WorkerState,
    model: String,
    started: Instant,
    prompt_tokens: usize,
    phases: Phases,
    first: Option<Instant>,
    last: Option<Instant>,
    n: usize,
    done: bool,
    max_tokens: usize,
    loaded_kv: bool,
    /// Prompt tokens the engine read from its prefix cache (known at the end).
    cached: usize,
}

impl Tally {
    fn new(state: &WorkerState, meta: &Meta) -> Self {
        Tally {
            state: state.clone(),
            model: meta.model.clone(),
            started: meta.started,
            prompt_tokens: meta.prompt_tokens,
            phases: meta.phases,
            first: None,
            last: None,
            n: 0,
            done: false,
            max_tokens: meta.max_tokens,
            loaded_kv: meta.loaded_kv,
            cached: 0,
        }
    }

    /// A token arrived at `now`.
    fn token(&mut self, now: Instant) {
        if let Some(l) = self.last {
            self.state.metrics().token_gap(&self.model, now - l);
        }
        self.first.get_or_insert(now);
        self.last = Some(now);
        self.n += 1;
    }

    /// The request ended with `reason`.
    fn finish(&mut self, reason: &str) {
        if std::mem::replace(&mut self.done, true) {
            return;
        }
        let tpot = match (self.first, self.last) {
            (Some(f), Some(l)) if self.n > 1 => Some((l - f) / (self.n as u32 - 1)),
            _ => None,
        };
        let end = self.last.unwrap_or_else(Instant::now);
        self.state.metrics().finished(&crate::metrics::Finished {
            model: &self.model,
            ttft: self.first.map(|t| t - self.started),
            e2e: self.started.elapsed(),
            queue: self.phases.queue,
            prefill: self.phases.prefill,
            decode: end.saturating_duration_since(self.phases.prefill_end),
            tpot,
            prompt_tokens: self.prompt_tokens,
            generated: self.n,
            reason,
            max_tokens: self.max_tokens,
            cached_tokens: if self.loaded_kv { 0 } else { self.cached },
            loaded_tokens: if self.loaded_kv {
                self.prompt_tokens
            } else {
                0
            },
        });
    }
}

impl Drop for Tally {
    fn drop(&mut self) {
        self.finish("abort");
    }
}

fn finish_str(f: FinishReason) -> String {
    match f {
        FinishReason::Stop => "stop".into(),
        FinishReason::Length => "length".into(),
    }
}

/// vLLM's `stop_reason`: the stop token id or the stop string.
fn stop_json(s: Option<StopReason>) -> Option<serde_json::Value> {
    match s? {
        StopReason::Token(id) => Some(id.into()),
        StopReason::Text(t) => Some(t.into()),
    }
}

/// Turns a generation stream into a JSON body or an SSE stream.
pub(super) async fn respond(
    state: WorkerState,
    meta: Meta,
    mut rx: mpsc::Receiver<GenEvent>,
    stream: bool,
) -> Result<Response, ApiError> {
    if !stream {
        let (mut text, mut ids) = (meta.echo.clone().unwrap_or_default(), Vec::new());
        let (mut first, mut last) = (None, None);
        let (mut finish, mut stop, mut cached) = (None, None, 0);
        let mut builder = meta.builder();
        let mut logprobs = builder.as_ref().map(Builder::empty);
        let mut tally = Tally::new(&state, &meta);
        while let Some(ev) = rx.recv().await {
            match ev {
                GenEvent::Token {
                    id,
                    text: t,
                    logprobs: lp,
                } => {
                    let now = Instant::now();
                    tally.token(now);
                    first.get_or_insert(now);
                    last = Some(now);
                    ids.push(id);
                    if let (Some(b), Some(out), Some(lp)) = (&mut builder, &mut logprobs, &lp) {
                        b.push(out, id, &t, lp);
                    }
                    text.push_str(&t);
                }
                GenEvent::Done {
                    finish_reason,
                    stop_reason,
                    cached_tokens,
                    ..
                } => {
                    finish = Some(finish_reason);
                    stop = stop_json(stop_reason);
                    cached = cached_tokens;
                    tally.cached = cached_tokens;
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
        tally.finish(&finish_str(finish));
        let n = ids.len() as u32;
        let mut body = meta.chunk(vec![CompletionChoice {
            index: 0,
            text,
            logprobs,
            finish_reason: Some(finish_str(finish)),
            stop_reason: stop,
            token_ids: Some(ids),
        }]);
        body.usage = Some(Usage::new(meta.prompt_tokens as u32, n).with_cached(cached as u32));
        body.timings = Some(timings);
        return Ok(match meta.api {
            Api::Completion => axum::Json(body).into_response(),
            Api::Chat => axum::Json(ChatCompletionResponse::from_completion(body)).into_response(),
        });
    }
    let (tx, out) = mpsc::channel::<Event>(32);
    let span = tracing::Span::current();
    tokio::spawn(
        async move {
            let send = |v: &dyn erased::Json| Event::default().data(v.to_json());
            let mut chat = (meta.api == Api::Chat).then(|| {
                ChatChunker::new(
                    meta.id.clone(),
                    meta.model.clone(),
                    meta.created,
                    meta.include_usage,
                )
            });
            // A completion chunk as the events the client gets (chat: none or several).
            let mut render = |c: &CompletionResponse| -> Vec<Event> {
                match chat.as_mut() {
                    Some(k) => k.push(c).iter().map(|c| send(c)).collect(),
                    None => vec![send(c)],
                }
            };
            let (mut first, mut last, mut n) = (None, None, 0usize);
            let mut tally = Tally::new(&state, &meta);
            let mut builder = meta.builder();
            if let Some(echo) = &meta.echo {
                // The prompt first, as its own chunk (no token ids: it is not generated).
                let mut c = meta.chunk(vec![CompletionChoice {
                    index: 0,
                    text: echo.clone(),
                    logprobs: None,
                    finish_reason: None,
                    stop_reason: None,
                    token_ids: None,
                }]);
                meta.running_usage(&mut c, 0);
                if tx.send(send(&c)).await.is_err() {
                    return;
                }
            }
            while let Some(ev) = rx.recv().await {
                let (events, end) = match ev {
                    GenEvent::Token {
                        id,
                        text,
                        logprobs: lp,
                    } => {
                        let now = Instant::now();
                        tally.token(now);
                        first.get_or_insert(now);
                        last = Some(now);
                        n += 1;
                        let logprobs = match (&mut builder, &lp) {
                            (Some(b), Some(lp)) => {
                                let mut out = b.empty();
                                b.push(&mut out, id, &text, lp);
                                Some(out)
                            }
                            _ => None,
                        };
                        let mut c = meta.chunk(vec![CompletionChoice {
                            index: 0,
                            text,
                            logprobs,
                            finish_reason: None,
                            stop_reason: None,
                            token_ids: Some(vec![id]),
                        }]);
                        meta.running_usage(&mut c, n);
                        (render(&c), false)
                    }
                    GenEvent::Done {
                        finish_reason,
                        stop_reason,
                        cached_tokens,
                        ..
                    } => {
                        tally.cached = cached_tokens;
                        let mut c = meta.chunk(vec![CompletionChoice {
                            index: 0,
                            text: String::new(),
                            logprobs: None,
                            finish_reason: Some(finish_str(finish_reason)),
                            stop_reason: stop_json(stop_reason),
                            token_ids: None,
                        }]);
                        c.timings = Some(meta.finish_timings(first, last, n, &state));
                        meta.running_usage(&mut c, n);
                        tally.finish(&finish_str(finish_reason));
                        let mut events = render(&c);
                        if meta.include_usage {
                            let mut u = meta.chunk(Vec::new());
                            u.usage = Some(
                                Usage::new(meta.prompt_tokens as u32, n as u32)
                                    .with_cached(cached_tokens as u32),
                            );
                            events.extend(render(&u));
                        }
                        (events, true)
                    }
                    GenEvent::Error(m) => {
                        tracing::warn!(error = %m, "generation failed mid-stream");
                        let e = ErrorBody::new("server_error", format!("generation failed: {m}"));
                        (vec![send(&e)], true)
                    }
                };
                for event in events {
                    if tx.send(event).await.is_err() {
                        tracing::info!("client went away; generation cancelled");
                        return;
                    }
                }
                if end {
                    break;
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
