//! The drain on shutdown, against a real server on the edge bound on
//! 127.0.0.1:0: readiness turns 503 and new API requests are refused at
//! once; a stream in flight finishes when it can within the shutdown
//! timeout; past it, a stream ends with an error event and `[DONE]`, a
//! unary request gets a 503, and the handlers behind both are dropped.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::State;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures::StreamExt;
use rngd_http_edge::{Options, Served};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// What the test's handlers share: a gate that ends the stream and releases
/// the slow answer, and how many handlers were dropped unfinished.
#[derive(Clone, Default)]
struct Gate {
    open: Arc<Notify>,
    dropped: Arc<AtomicUsize>,
}

/// Counts one drop of an unfinished handler.
struct Unfinished(Arc<AtomicUsize>, bool);

impl Drop for Unfinished {
    fn drop(&mut self) {
        if !self.1 {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
}

/// One event, then another once the gate opens, then `[DONE]`.
async fn stream(State(g): State<Gate>) -> Response {
    let s = futures::stream::unfold(0u8, move |step| {
        let g = g.clone();
        async move {
            match step {
                0 => Some((Event::default().data("{\"n\":0}"), 1)),
                1 => {
                    let mut guard = Unfinished(g.dropped.clone(), false);
                    g.open.notified().await;
                    guard.1 = true;
                    Some((Event::default().data("{\"n\":1}"), 2))
                }
                2 => Some((Event::default().data("[DONE]"), 3)),
                _ => None,
            }
        }
    });
    Sse::new(s.map(Ok::<_, Infallible>)).into_response()
}

/// Answers once the gate opens.
async fn slow(State(g): State<Gate>) -> &'static str {
    let mut guard = Unfinished(g.dropped.clone(), false);
    g.open.notified().await;
    guard.1 = true;
    "done"
}

struct Server {
    served: Served,
    stop: CancellationToken,
    gate: Gate,
}

async fn start(shutdown_timeout: Duration) -> Server {
    let gate = Gate::default();
    let router = Router::new()
        .route("/ready", get(|| async { "ready" }))
        .route("/version", get(|| async { "v" }))
        .route("/v1/stream", post(stream))
        .route("/v1/slow", post(slow))
        .with_state(gate.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let stop = CancellationToken::new();
    let s = stop.clone();
    let served = rngd_http_edge::serve(
        listener,
        router,
        Options {
            shutdown_timeout,
            ..Options::default()
        },
        async move { s.cancelled().await },
    )
    .unwrap();
    Server { served, stop, gate }
}

fn url(s: &Server, path: &str) -> String {
    format!("http://{}{path}", s.served.addr)
}

/// Reads a streamed body to its end: its text.
async fn rest(mut resp: reqwest::Response, first: String) -> String {
    let mut text = first;
    while let Some(c) = resp.chunk().await.unwrap() {
        text.push_str(&String::from_utf8_lossy(&c));
    }
    text
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_refuses_new_requests_and_lets_a_stream_finish() {
    let server = start(Duration::from_secs(20)).await;
    let http = reqwest::Client::new();
    let mut resp = http.post(url(&server, "/v1/stream")).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    let first = String::from_utf8_lossy(&resp.chunk().await.unwrap().unwrap()).into_owned();
    assert!(first.contains("{\"n\":0}"), "{first}");

    server.stop.cancel();
    // Readiness turns 503 at once; the probes still answer; a new API
    // request is refused with the shutting_down body and a closed connection.
    let ready = loop {
        let r = http.get(url(&server, "/ready")).send().await.unwrap();
        if r.status() != 200 {
            break r;
        }
        tokio::task::yield_now().await;
    };
    assert_eq!(ready.status(), 503);
    let version = http.get(url(&server, "/version")).send().await.unwrap();
    assert_eq!(version.status(), 200);
    let refused = http.post(url(&server, "/v1/slow")).send().await.unwrap();
    assert_eq!(refused.status(), 503);
    assert_eq!(refused.headers()["connection"], "close");
    let body: serde_json::Value = refused.json().await.unwrap();
    assert_eq!(body["error"]["code"], rngd_http_edge::SHUTTING_DOWN);
    assert_eq!(body["error"]["type"], "server_error");

    // The stream in flight runs to its own end.
    server.gate.open.notify_waiters();
    let text = rest(resp, first).await;
    assert!(text.contains("{\"n\":1}"), "{text}");
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    assert!(!text.contains("shutting_down"), "{text}");
    tokio::time::timeout(Duration::from_secs(10), server.served.done)
        .await
        .expect("the listener stops once nothing is in flight")
        .unwrap();
    assert_eq!(server.gate.dropped.load(Ordering::SeqCst), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_shutdown_timeout_streams_end_with_an_error_event_and_unary_gets_503() {
    let timeout = Duration::from_millis(300);
    let server = start(timeout).await;
    let http = reqwest::Client::new();
    let mut resp = http.post(url(&server, "/v1/stream")).send().await.unwrap();
    let first = String::from_utf8_lossy(&resp.chunk().await.unwrap().unwrap()).into_owned();
    let unary = tokio::spawn({
        let http = http.clone();
        let u = url(&server, "/v1/slow");
        async move { http.post(u).send().await.unwrap() }
    });
    // The unary request is in its handler before the stop.
    let until = Instant::now() + Duration::from_secs(10);
    while server.served.stats.accepted() < 2 && Instant::now() < until {
        tokio::task::yield_now().await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;

    let stopped = Instant::now();
    server.stop.cancel();
    let text = rest(resp, first).await;
    let (error, done) = text
        .split_once("data: {\"error\"")
        .map(|(_, tail)| (tail.to_string(), tail.ends_with("data: [DONE]\n\n")))
        .unwrap_or_else(|| panic!("no error event: {text}"));
    assert!(error.contains("\"code\":\"shutting_down\""), "{text}");
    assert!(done, "{text}");
    assert!(!text.contains("{\"n\":1}"), "{text}");

    let unary = unary.await.unwrap();
    assert_eq!(unary.status(), 503);
    let body: serde_json::Value = unary.json().await.unwrap();
    assert_eq!(body["error"]["code"], rngd_http_edge::SHUTTING_DOWN);
    assert!(
        stopped.elapsed() >= timeout,
        "cut before the timeout: {:?}",
        stopped.elapsed()
    );
    tokio::time::timeout(Duration::from_secs(10), server.served.done)
        .await
        .expect("the listener stops after the cut")
        .unwrap();
    // Both handlers were dropped unfinished (their slots freed).
    assert_eq!(server.gate.dropped.load(Ordering::SeqCst), 2);
}
