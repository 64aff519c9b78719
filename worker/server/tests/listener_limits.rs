//! Fault-suite rows of the worker's listener limits (a real worker on
//! 127.0.0.1:0 on the echo engine): silent sockets closed at the header
//! timeout while completions are served; connections over the cap closed at
//! once; stalled bodies past the in-flight body budget refused with a JSON
//! 503 before they are buffered, the RSS growth bounded; a 413 that reaches
//! a client still sending as JSON.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rngd_engine::Engine;
use rngd_engine::fake::EchoEngine;
use rngd_kv_transport::KvTransport;
use rngd_kv_transport::fake::MemoryTransport;
use rngd_worker::{Role, RunningWorker, Transports, WorkerConfig};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const MIB: usize = 1 << 20;

/// Reads until EOF or `within`; `None` when nothing ended in time.
async fn read_to_end(s: &mut TcpStream, within: Duration) -> Option<String> {
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match tokio::time::timeout_at(deadline, s.read(&mut buf)).await {
            Err(_) => return None,
            Ok(Ok(0)) | Ok(Err(_)) => break,
            Ok(Ok(n)) => out.extend_from_slice(&buf[..n]),
        }
    }
    Some(String::from_utf8_lossy(&out).into_owned())
}

fn status_and_json(text: &str) -> (u16, Value) {
    let status = text
        .strip_prefix("HTTP/1.1 ")
        .and_then(|t| t.get(..3))
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("not an answer: {text:?}"));
    let body = text.split("\r\n\r\n").nth(1).unwrap_or_default();
    let json = serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"));
    (status, json)
}

fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .unwrap()
        * 1024
}

async fn start(tweak: impl FnOnce(&mut WorkerConfig)) -> RunningWorker {
    let mut config = WorkerConfig::new(Role::Solo);
    tweak(&mut config);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let engine: Arc<dyn Engine> = Arc::new(EchoEngine::new(64));
    let t: Arc<dyn KvTransport> = Arc::new(MemoryTransport::new());
    rngd_worker::serve(listener, engine, Transports::fixed(vec![t]), config)
        .await
        .unwrap()
}

async fn complete(url: &str) -> u16 {
    reqwest::Client::new()
        .post(format!("{url}/v1/completions"))
        .json(&json!({"model": "echo", "prompt": "a b", "max_tokens": 2}))
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_sockets_are_closed_at_the_header_timeout_while_requests_are_served() {
    let header_timeout = Duration::from_millis(500);
    let w = start(|c| c.edge.header_timeout = header_timeout).await;
    let addr = w.addr.to_string();
    let started = Instant::now();
    let mut silent = Vec::new();
    for _ in 0..600 {
        silent.push(TcpStream::connect(&addr).await.unwrap());
    }
    assert_eq!(complete(&w.url()).await, 200);
    let margin = Duration::from_secs(3);
    for s in &mut silent {
        let left = (header_timeout + margin).saturating_sub(started.elapsed());
        assert_eq!(read_to_end(s, left).await.as_deref(), Some(""));
    }
    assert_eq!(complete(&w.url()).await, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_bodies_past_the_budget_are_a_json_503_before_buffering() {
    // Eight 1 MiB bodies fit, with room for normal requests beside them.
    let w = start(|c| {
        c.body_timeout = Duration::from_secs(4);
        c.edge.max_inflight_body_bytes = 8 * MIB + 64 * 1024;
    })
    .await;
    let addr = w.addr.to_string();
    let before = rss_bytes();
    let mut tasks = Vec::new();
    for _ in 0..100 {
        let addr = addr.clone();
        tasks.push(tokio::spawn(async move {
            let mut s = TcpStream::connect(&addr).await.unwrap();
            let head = format!(
                "POST /v1/completions HTTP/1.1\r\nhost: w\r\ncontent-type: application/json\r\ncontent-length: {MIB}\r\n\r\n"
            );
            s.write_all(head.as_bytes()).await.unwrap();
            // All but the last byte, then a stall.
            let _ = s.write_all(&vec![b' '; MIB - 1]).await;
            let text = read_to_end(&mut s, Duration::from_millis(1500)).await;
            (s, text)
        }));
    }
    let mut stalled = Vec::new();
    let mut refused = 0;
    for t in tasks {
        let (s, text) = t.await.unwrap();
        match text {
            Some(text) => {
                let (status, body) = status_and_json(&text);
                assert_eq!(status, 503, "{text}");
                assert_eq!(body["error"]["code"], "server_overloaded");
                assert!(text.to_ascii_lowercase().contains("retry-after"), "{text}");
                refused += 1;
            }
            None => stalled.push(s),
        }
    }
    assert_eq!((stalled.len(), refused), (8, 92));
    // Measured: ~10-20 MiB over the baseline (8 MiB of bodies buffered);
    // 100 buffered bodies would be 100 MiB.
    let grown = rss_bytes().saturating_sub(before);
    assert!(
        grown < 48 * MIB as u64,
        "RSS grew {} MiB",
        grown / MIB as u64
    );
    // Normal requests are served meanwhile.
    assert_eq!(complete(&w.url()).await, 200);
    // The stalled ones get the 408 at the deadline.
    for mut s in stalled {
        let text = read_to_end(&mut s, Duration::from_secs(10)).await.unwrap();
        assert_eq!(status_and_json(&text).0, 408, "{text}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_413_reaches_a_client_still_sending_as_json() {
    let w = start(|_| {}).await;
    let addr = w.addr.to_string();
    let s = TcpStream::connect(&addr).await.unwrap();
    let (mut rd, mut wr) = s.into_split();
    let writer = tokio::spawn(async move {
        let len = 16 * MIB;
        let head = format!(
            "POST /v1/completions HTTP/1.1\r\nhost: w\r\ncontent-type: application/json\r\ncontent-length: {len}\r\n\r\n"
        );
        wr.write_all(head.as_bytes()).await?;
        let chunk = vec![b' '; 64 * 1024];
        for _ in 0..len / chunk.len() {
            wr.write_all(&chunk).await?;
        }
        Ok::<_, std::io::Error>(())
    });
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match tokio::time::timeout(Duration::from_secs(10), rd.read(&mut buf)).await {
            Ok(Ok(0)) => break,
            Ok(Ok(n)) => out.extend_from_slice(&buf[..n]),
            Ok(Err(e)) => panic!("the answer was cut: {e}"),
            Err(_) => panic!("no answer"),
        }
    }
    let text = String::from_utf8_lossy(&out);
    let (status, body) = status_and_json(&text);
    assert_eq!(status, 413, "{text}");
    assert_eq!(body["error"]["code"], "request_too_large");
    assert!(
        writer.await.unwrap().is_ok(),
        "the client's writes were reset"
    );
    assert_eq!(complete(&w.url()).await, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_over_the_cap_are_closed_at_once() {
    let w = start(|c| c.edge.max_connections = 3).await;
    let addr = w.addr.to_string();
    // Two silent connections and one that serves: the cap is full
    // (connections are accepted in order).
    let held = [
        TcpStream::connect(&addr).await.unwrap(),
        TcpStream::connect(&addr).await.unwrap(),
    ];
    let mut live = TcpStream::connect(&addr).await.unwrap();
    let req = b"GET /health HTTP/1.1\r\nhost: w\r\n\r\n";
    let mut buf = [0u8; 1024];
    live.write_all(req).await.unwrap();
    let n = live.read(&mut buf).await.unwrap();
    assert!(buf[..n].starts_with(b"HTTP/1.1 200"));
    // One more is closed before any answer.
    let mut over = TcpStream::connect(&addr).await.unwrap();
    let _ = over.write_all(req).await;
    assert_eq!(
        read_to_end(&mut over, Duration::from_secs(2))
            .await
            .as_deref(),
        Some("")
    );
    // The connection under the cap still serves.
    live.write_all(req).await.unwrap();
    let n = live.read(&mut buf).await.unwrap();
    assert!(buf[..n].starts_with(b"HTTP/1.1 200"));
    drop(held);
    drop(live);
    w.stop().await.unwrap();
}
