//! One streaming `/v1/completions` request and what it measured: the SSE
//! stream read chunk by chunk (first content chunk, last content chunk,
//! `usage` with `prompt_tokens_details.cached_tokens`, an in-band error,
//! `[DONE]`), the status classified, and the router's decision reason from
//! the response header (`x-rngd-pd-route-reason`, where a router of ours
//! answered). The prompt is text or token ids.

use std::time::{Duration, Instant};

use futures::StreamExt;
use serde_json::Value;

use crate::stats::{Outcome, Status};

/// The `prompt` of a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prompt {
    /// A text prompt (the server tokenizes it).
    Text(String),
    /// A prompt as token ids (sent as a JSON array; nothing is tokenized).
    Tokens(Vec<u32>),
}

impl Prompt {
    /// The JSON value of the `prompt` field.
    pub fn json(&self) -> Value {
        match self {
            Prompt::Text(t) => Value::from(t.as_str()),
            Prompt::Tokens(ids) => Value::from(ids.clone()),
        }
    }
}

/// What to send.
#[derive(Debug, Clone)]
pub struct Request {
    /// `{base}/v1/completions`.
    pub url: String,
    /// The `model` field.
    pub model: String,
    /// The prompt.
    pub prompt: Prompt,
    /// `max_tokens`.
    pub max_tokens: u32,
}

impl Request {
    /// The JSON body: streaming, with `stream_options.include_usage`, greedy.
    pub fn body(&self) -> Value {
        serde_json::json!({
            "model": self.model,
            "prompt": self.prompt.json(),
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "stream": true,
            "stream_options": {"include_usage": true},
        })
    }
}

/// What one request measured and said.
#[derive(Debug)]
pub struct Answer {
    /// What it measured.
    pub outcome: Outcome,
    /// The body of a non-2xx answer or the in-band error object (the first
    /// [`ERROR_BODY_MAX`] bytes), which says which component refused.
    pub error: Option<String>,
    /// The router's reason for its route (`cached`, `disaggregated`, …),
    /// when the answer carried one.
    pub route: Option<String>,
    /// The text streamed.
    pub text: String,
}

/// Longest route reason kept, characters.
const ROUTE_MAX_CHARS: usize = 64;

/// Longest error body kept, bytes.
const ERROR_BODY_MAX: usize = 300;

/// Sends `req` and reads its stream, all within `timeout`.
pub async fn send(client: &reqwest::Client, req: &Request, timeout: Duration) -> Answer {
    let start = Instant::now();
    let mut seen = Seen::default();
    let outcome = match tokio::time::timeout(timeout, exchange(client, req, start, &mut seen)).await
    {
        Ok(status) => seen.outcome(status),
        Err(_) => seen.outcome(Status::Timeout),
    };
    Answer {
        outcome,
        error: seen.error.take(),
        route: seen.route.take(),
        text: std::mem::take(&mut seen.text),
    }
}

fn truncated(s: &str) -> String {
    let mut end = s.len().min(ERROR_BODY_MAX);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_string()
}

/// What the stream showed so far (kept across a timeout).
#[derive(Debug, Default)]
struct Seen {
    ttft: Option<Duration>,
    last: Option<Duration>,
    max_gap: Option<Duration>,
    chunks: u64,
    usage_tokens: Option<u64>,
    usage_prompt: Option<u64>,
    usage_cached: Option<u64>,
    error: Option<String>,
    route: Option<String>,
    text: String,
}

impl Seen {
    fn outcome(&self, status: Status) -> Outcome {
        Outcome {
            status,
            ttft: self.ttft,
            decode: self.ttft.zip(self.last).map(|(f, l)| l.saturating_sub(f)),
            max_gap: self.max_gap,
            tokens: self.usage_tokens.unwrap_or(self.chunks),
            usage_seen: self.usage_tokens.is_some(),
            prompt_tokens: self.usage_prompt,
            cached_tokens: self.usage_cached,
        }
    }

    /// One `data:` payload; `Some(status)` when the stream is over.
    fn event(&mut self, data: &str, at: Duration) -> Option<Status> {
        let data = data.trim();
        if data == "[DONE]" {
            return Some(Status::Ok);
        }
        let Ok(v) = serde_json::from_str::<Value>(data) else {
            return None;
        };
        if v.get("error").is_some_and(|e| !e.is_null()) {
            self.error = Some(truncated(data));
            return Some(Status::StreamError);
        }
        if let Some(u) = v.get("usage") {
            if let Some(n) = u.get("completion_tokens").and_then(Value::as_u64) {
                self.usage_tokens = Some(n);
            }
            if let Some(n) = u.get("prompt_tokens").and_then(Value::as_u64) {
                self.usage_prompt = Some(n);
            }
            if let Some(n) = u
                .pointer("/prompt_tokens_details/cached_tokens")
                .and_then(Value::as_u64)
            {
                self.usage_cached = Some(n);
            }
        }
        if let Some(c) = v
            .get("choices")
            .and_then(Value::as_array)
            .and_then(|c| c.first())
        {
            let text = c.get("text").and_then(Value::as_str).unwrap_or("");
            self.text.push_str(text);
            let finished = c.get("finish_reason").is_some_and(|f| !f.is_null());
            if !text.is_empty() || !finished {
                self.ttft.get_or_insert(at);
                if let Some(prev) = self.last {
                    let gap = at.saturating_sub(prev);
                    self.max_gap = Some(self.max_gap.map_or(gap, |g| g.max(gap)));
                }
                self.last = Some(at);
                self.chunks += 1;
            }
        }
        None
    }
}

async fn exchange(
    client: &reqwest::Client,
    req: &Request,
    start: Instant,
    seen: &mut Seen,
) -> Status {
    let resp = match client.post(&req.url).json(&req.body()).send().await {
        Ok(r) => r,
        Err(_) => return Status::Transport,
    };
    let code = resp.status().as_u16();
    seen.route = resp
        .headers()
        .get(rngd_api::headers::ROUTE_REASON)
        .and_then(|v| v.to_str().ok())
        .map(|v| v.chars().take(ROUTE_MAX_CHARS).collect());
    if !resp.status().is_success() {
        seen.error = resp.text().await.ok().map(|b| truncated(&b));
        return match code {
            429 => Status::Http429,
            c @ 500..=599 => Status::Http5xx(c),
            c => Status::HttpOther(c),
        };
    }
    let mut stream = resp.bytes_stream();
    let mut buf: Vec<u8> = Vec::new();
    while let Some(chunk) = stream.next().await {
        let Ok(chunk) = chunk else {
            return Status::Transport;
        };
        let at = start.elapsed();
        buf.extend_from_slice(&chunk);
        // Complete lines only; a `data:` line is one event here (the servers
        // this talks to put each JSON object on one line).
        while let Some(nl) = buf.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = buf.drain(..=nl).collect();
            let line = String::from_utf8_lossy(&line);
            if let Some(data) = line.trim_end().strip_prefix("data:")
                && let Some(status) = seen.event(data, at)
            {
                return status;
            }
        }
    }
    Status::Transport
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_longest_gap_is_between_content_chunks_only() {
        let mut seen = Seen::default();
        let chunk = |t: &str| format!(r#"{{"choices":[{{"text":"{t}","finish_reason":null}}]}}"#);
        let ms = Duration::from_millis;
        assert_eq!(seen.event(&chunk("a"), ms(10)), None);
        assert_eq!(seen.outcome(Status::Ok).max_gap, None, "one chunk: no gap");
        seen.event(&chunk("b"), ms(30));
        seen.event(&chunk("c"), ms(100));
        seen.event(&chunk("d"), ms(120));
        // The usage-only chunk and [DONE] are not content.
        seen.event(r#"{"choices":[],"usage":{"completion_tokens":4}}"#, ms(400));
        assert_eq!(seen.event("[DONE]", ms(500)), Some(Status::Ok));
        let o = seen.outcome(Status::Ok);
        assert_eq!(o.max_gap, Some(ms(70)));
        assert_eq!(o.decode, Some(ms(110)));
    }
}
