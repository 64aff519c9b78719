//! A streamed answer: the decode worker's SSE chunks, read as typed
//! [`WorkerChunk`]s, rewritten for the client (ids, model, timings; chat
//! chunks for the chat API), with idle and early-end detection.

use std::collections::VecDeque;
use std::pin::Pin;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::Response;
use bytes::Bytes;
use futures::{Stream, StreamExt};
use rngd_api::chat::ChatChunker;
use rngd_api::openai::{CompletionResponse, ErrorBody, Timings, Usage};
use rngd_api::rules::ms;
use rngd_pool::ApiKind;
use serde::Deserialize;

use super::migrate::Resume;
use super::respond::Ctx;
use crate::sse::{self, SseParser};

/// One chunk of a worker's completion stream: an error, or a completion chunk
/// (a token, the finish, or the usage-only chunk with no choices).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum WorkerChunk {
    /// The worker's own mid-stream error.
    Error(ErrorBody),
    /// A completion chunk.
    Chunk(Box<CompletionResponse>),
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
    /// The chat form of the chunks (used for the chat API).
    chat: ChatChunker,
    first_token: Option<Instant>,
    tokens: u64,
    usage: Option<Usage>,
    worker_timings: Option<Timings>,
    idle: Duration,
    /// The token ids streamed so far (what a continuation resumes from).
    generated: Vec<u32>,
    /// How to move the stream when its worker fails (`None`: it cannot).
    resume: Option<Resume>,
    /// Tokens the current worker was given as already generated (its usage
    /// counts them as prompt; the client's as completion).
    resumed: u32,
}

pub(super) fn stream_response(
    ctx: Ctx,
    resp: reqwest::Response,
    include_usage: bool,
    resume: Option<Resume>,
) -> Response {
    let idle = ctx.gw.config.stream_idle_timeout;
    let chat = ChatChunker::new(
        ctx.id.clone(),
        ctx.model.clone(),
        ctx.created,
        include_usage,
    );
    let state = StreamState {
        ctx,
        upstream: Box::pin(resp.bytes_stream()),
        parser: SseParser::new(),
        out: VecDeque::new(),
        finished: false,
        include_usage,
        chat,
        first_token: None,
        tokens: 0,
        usage: None,
        worker_timings: None,
        idle,
        generated: Vec::new(),
        resume,
        resumed: 0,
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
                Err(_) => {
                    let m = format!(
                        "decode worker {} sent nothing for {} ms",
                        st.ctx.address,
                        st.idle.as_millis()
                    );
                    st.broken(m).await;
                }
                Ok(None) => {
                    if let Some(data) = st.parser.finish() {
                        st.on_event(&data);
                    }
                    if !st.finished {
                        let m = format!("decode worker {} ended the stream early", st.ctx.address);
                        st.broken(m).await;
                    }
                }
                Ok(Some(Err(e))) => {
                    tracing::warn!(error = %e, "decode stream broke");
                    let m = format!("decode worker {} broke the stream", st.ctx.address);
                    st.broken(m).await;
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

    /// The decode worker failed mid-stream: the stream moves to another
    /// worker (`super::migrate`) and goes on, or ends with the error.
    async fn broken(&mut self, message: String) {
        if let Some(resume) = self.resume.as_mut()
            && let Some(moved) = resume
                .move_off(&self.ctx.gw, &self.ctx.address, &self.generated, &message)
                .await
        {
            self.upstream = Box::pin(moved.response.bytes_stream());
            self.parser = SseParser::new();
            self.ctx.address = moved.address;
            self.ctx._held = moved.held;
            // The prediction was for the first worker's cache.
            self.ctx.expected = None;
            self.resumed = u32::try_from(self.generated.len()).unwrap_or(u32::MAX);
            return;
        }
        self.fail(message);
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
        let usage = self.usage;
        self.ctx.record(ttft, tokens, kv, usage.as_ref());
        tracing::info!(
            id = %self.ctx.id,
            worker = %self.ctx.address,
            disaggregated = self.ctx.prefill.is_some(),
            tokens,
            ttft_ms = ?ttft.map(ms),
            total_ms = ms(self.ctx.started.elapsed()),
            "stream done"
        );
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
        let mut chunk = match serde_json::from_str::<WorkerChunk>(data) {
            Ok(WorkerChunk::Chunk(c)) => c,
            Ok(WorkerChunk::Error(e)) => {
                // The worker's own mid-stream error: pass it on and end.
                tracing::warn!(worker = %self.ctx.address, message = %e.error.message, "decode worker failed mid-stream");
                self.out.push_back(sse::encode(data));
                self.out.push_back(sse::encode("[DONE]"));
                self.finished = true;
                return;
            }
            Err(_) => {
                self.fail(format!(
                    "decode worker {} sent an unreadable chunk",
                    self.ctx.address
                ));
                return;
            }
        };
        let choice = chunk.choices.first();
        let has_text = choice.is_some_and(|c| !c.text.is_empty());
        let ids = choice
            .and_then(|c| c.token_ids.as_ref())
            .map_or(0, |t| t.len() as u64);
        if let Some(t) = choice.and_then(|c| c.token_ids.as_ref()) {
            self.generated.extend_from_slice(t);
        }
        // A continued stream's worker counts the tokens it was given as
        // prompt: the client's usage counts them as generated.
        if let Some(u) = chunk.usage.as_mut() {
            resumed_usage(u, self.resumed);
        }
        if let Some(u) = chunk.usage {
            self.usage = Some(u);
        }
        if let Some(t) = chunk.timings {
            self.worker_timings = Some(t);
        }
        self.tokens += ids;
        if self.first_token.is_none() && (ids > 0 || has_text) {
            self.first_token = Some(Instant::now());
        }
        match self.ctx.kind {
            ApiKind::Completion => {
                chunk.id = self.ctx.id.clone();
                chunk.model = self.ctx.model.clone();
                chunk.created = self.ctx.created;
                chunk.object = "text_completion".into();
                chunk.kv_transfer_params = None;
                if chunk.timings.is_some() {
                    let ttft = self.first_token.map(|t| t.duration_since(self.ctx.started));
                    let (t, _) = self
                        .ctx
                        .merged_timings(self.worker_timings, ttft, self.tokens);
                    chunk.timings = Some(t);
                }
                if chunk.usage.is_some() && !self.include_usage {
                    if chunk.choices.is_empty() {
                        return;
                    }
                    chunk.usage = None;
                }
                self.push_json(&chunk);
            }
            ApiKind::Chat => {
                for c in self.chat.push(&chunk) {
                    self.push_json(&c);
                }
            }
        }
    }
}

/// `usage` of a worker that continued a stream after `resumed` tokens, as
/// the client's: those tokens move from the prompt to the completion.
pub(super) fn resumed_usage(usage: &mut Usage, resumed: u32) {
    if resumed == 0 {
        return;
    }
    usage.prompt_tokens = usage.prompt_tokens.saturating_sub(resumed);
    usage.completion_tokens = usage.completion_tokens.saturating_add(resumed);
    if let Some(d) = usage.prompt_tokens_details.as_mut() {
        d.cached_tokens = d.cached_tokens.min(usage.prompt_tokens);
    }
}
