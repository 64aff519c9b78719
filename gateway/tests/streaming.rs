//! A streamed answer leaves the worker and the gateway chunk by chunk.
//!
//! The decode worker runs the echo engine with a gate: each token after the
//! first is made only when the test releases it. The test reads each token
//! chunk before releasing the next token, so a listener or a proxy that held
//! chunks back (until the answer's end, or until more bytes came) would leave
//! the client waiting for a token that does not exist yet. This checks
//! ordering, not wall time; the time a chunk takes is measured by
//! `rngd-pd-bench gateway --stream`.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{FAKE_TOKENIZER, TestPolicy, client};
use futures::StreamExt;
use rngd_engine::fake::EchoEngine;
use rngd_gateway::{Gateway, GatewayConfig};
use rngd_kv_transport::fake::MemoryTransport;
use rngd_policy_core::Role;
use rngd_pool::source as endpoints;
use rngd_worker::Transports;
use serde_json::{Value, json};
use tokio::sync::Semaphore;

/// How long the test waits for one chunk before calling it held back.
const CHUNK_WAIT: Duration = Duration::from_secs(20);

struct Stack {
    /// The first decode worker's URL.
    worker_url: String,
    gateway_url: String,
    gate: Arc<Semaphore>,
    gw: Arc<Gateway>,
    workers: Vec<rngd_worker::RunningWorker>,
}

async fn stack() -> Stack {
    stack_of(1).await
}

/// `n` decode workers running the echo engine behind one gate, and a
/// gateway over them whose table was scraped once: every pick reads that
/// idle scrape.
async fn stack_of(n: usize) -> Stack {
    let gate = Arc::new(Semaphore::new(0));
    let kv = Arc::new(MemoryTransport::new());
    let mut workers = Vec::new();
    for _ in 0..n {
        let engine = Arc::new(EchoEngine::new(512).with_gate(gate.clone()));
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let worker = rngd_worker::serve(
            l,
            engine,
            Transports::new("memory", common::Shared(kv.clone())),
            common::worker_config(Role::Decode),
        )
        .await
        .unwrap();
        workers.push(worker);
    }
    let table = common::scraped_servable(
        workers
            .iter()
            .map(|w| {
                endpoints::local_endpoint(
                    w.addr.to_string(),
                    Role::Decode,
                    512,
                    &["memory".to_string()],
                )
            })
            .collect(),
    )
    .await;
    let config = GatewayConfig::default();
    let edge = config.edge.clone();
    // A threshold no test prompt reaches: every request is served by the
    // decode worker alone.
    let gw = Gateway::new(
        config,
        rngd_pool::Picker::new(TestPolicy::new(10_000), table),
        Arc::new(FAKE_TOKENIZER),
    )
    .unwrap();
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let gateway_url = format!("http://{}", l.local_addr().unwrap());
    // Served as `rngd-pd gateway` serves it (the listener of `rngd-http-edge`).
    tokio::spawn(rngd_gateway::serve(
        l,
        rngd_gateway::router(gw.clone()),
        edge,
        std::future::pending(),
    ));
    Stack {
        worker_url: workers[0].url(),
        gateway_url,
        gate,
        gw,
        workers,
    }
}

/// The token texts of the complete SSE events in `text` (a completion's
/// `text` or a chat chunk's `delta.content`; the role-only chat chunk and
/// `[DONE]` carry none).
fn tokens(text: &str) -> Vec<String> {
    let mut events: Vec<&str> = text.split("\n\n").collect();
    events.pop(); // not terminated yet
    events
        .into_iter()
        .filter_map(|e| e.trim().strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .filter_map(|d| {
            let v: Value = serde_json::from_str(d).unwrap();
            let c = &v["choices"][0];
            c["text"]
                .as_str()
                .or_else(|| c["delta"]["content"].as_str())
                .filter(|t| !t.is_empty())
                .map(str::to_string)
        })
        .collect()
}

/// Streams `body` to `url` and reads it token by token, releasing the next
/// token only once the previous one has reached the client.
///
/// `echoed`: the text the echo engine repeats (the prompt it sees), when the
/// test knows it.
async fn read_token_by_token(
    url: &str,
    path: &str,
    body: Value,
    echoed: Option<&str>,
    gate: &Semaphore,
) {
    let n = body["max_tokens"].as_u64().unwrap() as usize;
    let resp = client()
        .post(format!("{url}{path}"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200, "{url}{path}");
    let mut chunks = resp.bytes_stream();
    let mut text = String::new();
    for i in 0..n {
        while tokens(&text).len() <= i {
            let chunk = tokio::time::timeout(CHUNK_WAIT, chunks.next())
                .await
                .unwrap_or_else(|_| {
                    panic!(
                        "{url}{path}: token {i} held back (the next is not released); got {text:?}"
                    )
                })
                .expect("stream ended early")
                .unwrap();
            text.push_str(std::str::from_utf8(&chunk).unwrap());
        }
        let got = tokens(&text);
        assert_eq!(got.len(), i + 1, "{url}{path}: {text:?}");
        // The echo engine repeats the prompt's bytes ("abcdef" → a, b, c, …).
        if let Some(p) = echoed {
            let want: Vec<String> = p.chars().take(i + 1).map(String::from).collect();
            assert_eq!(got, want, "{url}{path}");
        }
        if i + 1 < n {
            assert_eq!(gate.available_permits(), 0);
            gate.add_permits(1);
        }
    }
    while let Some(chunk) = tokio::time::timeout(CHUNK_WAIT, chunks.next())
        .await
        .expect("the stream's end held back")
    {
        text.push_str(std::str::from_utf8(&chunk.unwrap()).unwrap());
    }
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_token_chunk_leaves_before_the_next_token_exists() {
    let s = stack().await;
    for url in [&s.worker_url, &s.gateway_url] {
        read_token_by_token(
            url,
            "/v1/completions",
            json!({"model": "fake-model", "prompt": "abcdef", "max_tokens": 4, "stream": true}),
            Some("abcdef"),
            &s.gate,
        )
        .await;
    }
    // Chat through the gateway: the role chunk, then one content chunk per token.
    read_token_by_token(
        &s.gateway_url,
        "/v1/chat/completions",
        json!({"model": "fake-model", "messages": [{"role": "user", "content": "abcdef"}],
               "max_tokens": 3, "stream": true}),
        None,
        &s.gate,
    )
    .await;
}

/// Two streams opened before any new scrape go to the two idle decode
/// workers: the first one's open answer counts on its worker
/// (`rngd_pool::inflight`) and the second pick sees it; once both answers
/// ended nothing is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_stream_counts_on_its_decode_worker_until_it_ends() {
    let s = stack_of(2).await;
    let (gw, gate) = (&s.gw, &s.gate);
    let addrs: Vec<String> = s.workers.iter().map(|w| w.addr.to_string()).collect();
    let url = format!("{}/v1/completions", s.gateway_url);
    let counts = || -> Vec<u32> {
        addrs
            .iter()
            .map(|a| gw.picker().in_flight().count(a))
            .collect()
    };
    let body = json!({"model": "fake-model", "prompt": "abc", "max_tokens": 2, "stream": true});
    let mut open = Vec::new();
    for want in [1, 2] {
        let resp = client().post(&url).json(&body).send().await.unwrap();
        assert_eq!(resp.status(), 200);
        let mut chunks = resp.bytes_stream();
        // The first token: the answer is open, its second token gated.
        let mut text = String::new();
        while tokens(&text).is_empty() {
            let chunk = tokio::time::timeout(CHUNK_WAIT, chunks.next())
                .await
                .expect("first token")
                .expect("stream ended early")
                .unwrap();
            text.push_str(std::str::from_utf8(&chunk).unwrap());
        }
        open.push(chunks);
        let c = counts();
        assert_eq!(c.iter().sum::<u32>(), want, "{c:?}");
        assert!(c.iter().all(|&n| n <= 1), "both on one worker: {c:?}");
    }
    gate.add_permits(2);
    for mut chunks in open {
        let mut text = String::new();
        while let Some(chunk) = tokio::time::timeout(CHUNK_WAIT, chunks.next())
            .await
            .expect("the stream's end held back")
        {
            text.push_str(std::str::from_utf8(&chunk.unwrap()).unwrap());
        }
        assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    }
    // The gateway drops each answer's state once its last chunk is out.
    let deadline = tokio::time::Instant::now() + CHUNK_WAIT;
    while gw.picker().in_flight().tracked() > 0 {
        assert!(tokio::time::Instant::now() < deadline, "{:?}", counts());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
