//! Rows of the fault suite at the worker: overload (500 concurrent requests on
//! one worker) is answered with 429 + `Retry-After` beyond `max_in_flight`,
//! never a 5xx or a hang, and leaves no slot or KV behind; a client that does
//! not send its body gets a 408 at the deadline. In-process workers on
//! 127.0.0.1:0, the echo engine slowed down so requests overlap.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{metrics, sample};
use rngd_engine::Engine;
use rngd_engine::fake::EchoEngine;
use rngd_kv_transport::KvTransport;
use rngd_kv_transport::fake::MemoryTransport;
use rngd_worker::{Role, RunningWorker, Transports, WorkerConfig};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

async fn start(
    role: Role,
    mem: &Arc<MemoryTransport>,
    delay: Duration,
    tweak: impl FnOnce(&mut WorkerConfig),
) -> RunningWorker {
    let mut config = WorkerConfig::new(role).with_kv_secret(b"test-kv-secret-0123456789abcdef");
    tweak(&mut config);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let engine: Arc<dyn Engine> = Arc::new(EchoEngine::new(64).with_token_delay(delay));
    let t: Arc<dyn KvTransport> = mem.clone();
    rngd_worker::serve(listener, engine, Transports::fixed(vec![t]), config)
        .await
        .unwrap()
}

fn body(prompt: &str, stream: bool) -> Value {
    json!({"model": "echo", "prompt": prompt, "max_tokens": 10, "temperature": 0, "stream": stream})
}

/// Sends `n` requests at once; returns (status, retry-after, body) each.
async fn flood(
    url: String,
    n: usize,
    body: Value,
    headers: Vec<(&'static str, String)>,
) -> Vec<(u16, Option<String>, String)> {
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    let mut tasks = Vec::new();
    for i in 0..n {
        let (client, url, body, headers) =
            (client.clone(), url.clone(), body.clone(), headers.clone());
        tasks.push(tokio::spawn(async move {
            let mut req = client
                .post(&url)
                .header("x-request-id", format!("flood-{i}"))
                .json(&body);
            for (k, v) in &headers {
                req = req.header(*k, v);
            }
            let resp = req.send().await.unwrap();
            let status = resp.status().as_u16();
            let retry = resp
                .headers()
                .get("retry-after")
                .map(|v| v.to_str().unwrap().to_string());
            (status, retry, resp.text().await.unwrap())
        }));
    }
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

fn check_only_ok_and_429(results: &[(u16, Option<String>, String)], at_least_ok: usize) -> usize {
    let mut rejected = 0;
    for (status, retry, text) in results {
        match status {
            200 => {}
            429 => {
                rejected += 1;
                assert_eq!(retry.as_deref(), Some("1"), "429 without Retry-After");
                let e: Value = serde_json::from_str(text).unwrap();
                assert_eq!(e["error"]["code"], "server_overloaded", "{text}");
                assert_eq!(e["error"]["type"], "rate_limit_error", "{text}");
            }
            other => panic!("a {other} under overload: {text}"),
        }
    }
    assert!(
        results.len() - rejected >= at_least_ok,
        "only {} served",
        results.len() - rejected
    );
    rejected
}

#[tokio::test]
async fn five_hundred_concurrent_requests_get_200_or_429_and_leave_nothing() {
    let mem = Arc::new(MemoryTransport::new());
    let w = start(Role::Solo, &mem, Duration::from_millis(20), |c| {
        c.max_in_flight = 8
    })
    .await;
    let t0 = Instant::now();
    let results = flood(
        format!("{}/v1/completions", w.url()),
        500,
        body("overload me", true),
        vec![],
    )
    .await;
    assert!(t0.elapsed() < Duration::from_secs(60), "the flood hung");
    let rejected = check_only_ok_and_429(&results, 8);
    assert!(rejected > 0, "500 at once on 8 slots must refuse some");
    let m = metrics(&w).await;
    assert_eq!(
        sample(&m, "rngd_pd_worker_overload_rejections_total"),
        rejected as f64
    );
    assert_eq!(
        sample(&m, "rngd_pd_worker_in_flight"),
        0.0,
        "every slot freed"
    );
    // Still serving.
    let (ok, _, text) = flood(
        format!("{}/v1/completions", w.url()),
        1,
        body("after", false),
        vec![],
    )
    .await
    .remove(0);
    assert_eq!(ok, 200, "{text}");
}

#[tokio::test]
async fn overloaded_pd_orchestration_strands_no_kv() {
    // The decode worker takes its slot before it asks the prefill peer: a
    // refused request has prefilled nothing and parked no KV.
    let mem = Arc::new(MemoryTransport::new());
    let p = start(Role::Prefill, &mem, Duration::ZERO, |_| {}).await;
    let peer = p.addr.to_string();
    let allow = peer.clone();
    let d = start(Role::Decode, &mem, Duration::from_millis(20), move |c| {
        c.max_in_flight = 4;
        c.prefill_allow = allow.parse().unwrap();
    })
    .await;
    let results = flood(
        format!("{}/v1/completions", d.url()),
        100,
        body("disaggregate me", true),
        vec![("x-prefiller-host-port", peer)],
    )
    .await;
    let rejected = check_only_ok_and_429(&results, 4);
    assert!(rejected > 0);
    let served = results.len() - rejected;
    assert_eq!(
        sample(&metrics(&p).await, "rngd_pd_worker_prefills_total"),
        served as f64,
        "refused requests were not prefilled"
    );
    assert_eq!(mem.held(), 0, "no KV left behind");
    assert_eq!(sample(&metrics(&d).await, "rngd_pd_worker_in_flight"), 0.0);
}

#[tokio::test]
async fn a_body_that_does_not_arrive_is_a_408() {
    let mem = Arc::new(MemoryTransport::new());
    let w = start(Role::Solo, &mem, Duration::ZERO, |c| {
        c.body_timeout = Duration::from_millis(300)
    })
    .await;
    let mut s = tokio::net::TcpStream::connect(w.addr).await.unwrap();
    s.write_all(
        b"POST /v1/completions HTTP/1.1\r\nhost: w\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"model\":",
    )
    .await
    .unwrap();
    let t0 = Instant::now();
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    // Until the error body has arrived (the connection may stay open).
    while !String::from_utf8_lossy(&buf).contains("request_timeout") {
        match tokio::time::timeout(Duration::from_secs(10), s.read(&mut chunk)).await {
            Ok(Ok(n)) if n > 0 => buf.extend_from_slice(&chunk[..n]),
            _ => break,
        }
    }
    let text = String::from_utf8_lossy(&buf);
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(text.contains("request_timeout"), "{text}");
    assert!(t0.elapsed() < Duration::from_secs(10));
    assert_eq!(sample(&metrics(&w).await, "rngd_pd_worker_in_flight"), 0.0);
}
