//! Helpers the worker's test files share: reading a worker's `/metrics` page
//! and one sample of it; and the in-process workers of `server.rs` (echo
//! engine, in-memory transport) with their request helpers.
#![allow(dead_code)]

use std::sync::Arc;

use rngd_api::openai::{CompletionResponse, ErrorBody};
use rngd_engine::Engine;
use rngd_engine::fake::EchoEngine;
use rngd_kv_transport::KvTransport;
use rngd_kv_transport::fake::MemoryTransport;
use rngd_worker::{Role, RunningWorker, Transports, WorkerConfig};
use serde_json::{Value, json};

/// The worker's `/metrics` page.
pub async fn metrics(w: &RunningWorker) -> String {
    reqwest::get(format!("{}/metrics", w.url()))
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// The value of one sample (`name` with its label set, if any) in Prometheus text.
pub fn sample(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(' ')))
        .unwrap_or_else(|| panic!("{name} missing from metrics:\n{text}"))
        .trim()
        .parse()
        .unwrap()
}

/// The echo engine's sequence length (the model's `max_model_len`).
pub const SEQ_LEN: usize = 64;

/// A worker of `role` on 127.0.0.1:0 with the echo engine, `transport` and
/// the test KV secret, its config changed by `tweak`.
pub async fn start_with(
    role: Role,
    transport: &Arc<MemoryTransport>,
    tweak: impl FnOnce(&mut WorkerConfig),
) -> RunningWorker {
    let mut config = WorkerConfig::new(role).with_kv_secret(b"test-kv-secret-0123456789abcdef");
    tweak(&mut config);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let engine: Arc<dyn Engine> = Arc::new(EchoEngine::new(SEQ_LEN));
    let t: Arc<dyn KvTransport> = transport.clone();
    rngd_worker::serve(listener, engine, Transports::fixed(vec![t]), config)
        .await
        .unwrap()
}

/// A config tweak admitting these prefill peers (`--prefill-allow`).
pub fn allow(peers: &[&str]) -> impl FnOnce(&mut WorkerConfig) + use<> {
    let list = peers.join(",");
    move |c: &mut WorkerConfig| c.prefill_allow = list.parse().unwrap()
}

/// [`start_with`] without a tweak.
pub async fn start(role: Role, transport: &Arc<MemoryTransport>) -> RunningWorker {
    start_with(role, transport, |_| {}).await
}

/// POSTs `body` (with `headers`) to `/v1/completions`: status, headers, body.
pub async fn post(
    w: &RunningWorker,
    body: &Value,
    headers: &[(&str, &str)],
) -> (u16, reqwest::header::HeaderMap, String) {
    let mut req = reqwest::Client::new()
        .post(format!("{}/v1/completions", w.url()))
        .json(body);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = req.send().await.unwrap();
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    (status, headers, resp.text().await.unwrap())
}

/// A completion that must succeed (200).
pub async fn completion(
    w: &RunningWorker,
    body: &Value,
    headers: &[(&str, &str)],
) -> CompletionResponse {
    let (status, _, text) = post(w, body, headers).await;
    assert_eq!(status, 200, "{text}");
    serde_json::from_str(&text).unwrap()
}

/// A request that must fail: its status and OpenAI error body.
pub async fn error(w: &RunningWorker, body: &Value, headers: &[(&str, &str)]) -> (u16, ErrorBody) {
    let (status, _, text) = post(w, body, headers).await;
    let body: ErrorBody =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("not an error body ({e}): {text}"));
    (status, body)
}

/// The token ids of the first choice.
pub fn token_ids(r: &CompletionResponse) -> Vec<u32> {
    r.choices[0].token_ids.clone().unwrap()
}

/// A greedy completion request for the echo model.
pub fn request(prompt: &str, max_tokens: u32) -> Value {
    json!({"model": "echo", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
}

/// Parses an SSE body into its `data:` payloads, checking the framing.
pub fn sse_events(body: &str) -> Vec<String> {
    assert!(
        body.ends_with("\n\n"),
        "SSE body must end with a blank line: {body:?}"
    );
    body.split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| {
            e.strip_prefix("data: ")
                .unwrap_or_else(|| panic!("event is not a data line: {e:?}"))
                .to_string()
        })
        .collect()
}
