//! The worker's admin listener: off without a token; `POST
//! /reset_prefix_cache` with the bearer token empties the prefix cache (and
//! a KV-event sink hears `AllCleared`); a missing or wrong token is 401, ten
//! of them lock the API (429 with `Retry-After`, even for the right token);
//! other methods 405; vLLM's query parameters refused by name; an engine
//! without a prefix cache answers 400.

mod common;

use std::sync::{Arc, Mutex};

use rngd_engine::Engine;
use rngd_engine::prefix::{PrefixCacheOptions, PrefixEvent, PrefixEventSink};
use rngd_http_edge::admin::AdminToken;
use rngd_kv_transport::KvTransport;
use rngd_kv_transport::fake::MemoryTransport;
use rngd_worker::admin::{AdminListen, RunningAdmin};
use rngd_worker::{Role, RunningWorker, Transports, WorkerConfig};
use serde_json::{Value, json};

const TOKEN: &str = "worker-admin-test-token";

#[derive(Default)]
struct Heard(Mutex<Vec<PrefixEvent>>);

impl PrefixEventSink for Heard {
    fn publish(&self, event: PrefixEvent) {
        self.0.lock().unwrap().push(event);
    }
}

async fn start(prefix: PrefixCacheOptions) -> (RunningWorker, Arc<dyn Engine>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let engine: Arc<dyn Engine> = rngd_engine::tiny::engine_with_prefix(
        &rngd_engine::tiny::TinyConfig::default(),
        256,
        2,
        &prefix,
    )
    .unwrap();
    let t: Arc<dyn KvTransport> = Arc::new(MemoryTransport::new());
    let w = rngd_worker::serve(
        listener,
        engine.clone(),
        Transports::fixed(vec![t]),
        WorkerConfig::new(Role::Solo),
    )
    .await
    .unwrap();
    (w, engine)
}

async fn admin(w: &RunningWorker) -> RunningAdmin {
    let opts = AdminListen {
        listen: "127.0.0.1:0".parse().unwrap(),
        token: AdminToken::new(TOKEN),
    };
    rngd_worker::admin::serve(&opts, w.state.clone())
        .await
        .unwrap()
        .expect("a token starts the admin listener")
}

async fn call(
    method: reqwest::Method,
    url: &str,
    token: Option<&str>,
) -> (u16, reqwest::header::HeaderMap, String) {
    let mut req = reqwest::Client::new().request(method, url);
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    let resp = req.send().await.unwrap();
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    (status, headers, resp.text().await.unwrap())
}

async fn fill(w: &RunningWorker) {
    let models: Value = reqwest::get(format!("{}/v1/models", w.url()))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let model = models["data"][0]["id"].clone();
    let body = json!({"model": model, "prompt": (0..80).collect::<Vec<u32>>(), "max_tokens": 2});
    let resp = reqwest::Client::new()
        .post(format!("{}/v1/completions", w.url()))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200, "{}", resp.text().await.unwrap());
}

#[tokio::test]
async fn no_token_no_listener() {
    let (w, _) = start(PrefixCacheOptions::default()).await;
    let off = rngd_worker::admin::serve(&AdminListen::default(), w.state.clone())
        .await
        .unwrap();
    assert!(off.is_none());
    // And the public listener has no such route.
    let (status, _, _) = call(
        reqwest::Method::POST,
        &format!("{}/reset_prefix_cache", w.url()),
        Some(TOKEN),
    )
    .await;
    assert_eq!(status, 404);
}

#[tokio::test]
async fn reset_needs_the_token_and_empties_the_cache() {
    let (w, engine) = start(PrefixCacheOptions::default()).await;
    let heard = Arc::new(Heard::default());
    assert!(engine.set_prefix_events(Some(heard.clone())));
    let a = admin(&w).await;
    let url = format!("http://{}/reset_prefix_cache", a.addr);
    fill(&w).await;
    let blocks = engine.prefix_cache_stats().unwrap().blocks;
    assert!(blocks > 0);

    for token in [None, Some("wrong"), Some("")] {
        let (status, headers, body) = call(reqwest::Method::POST, &url, token).await;
        assert_eq!(status, 401, "{body}");
        assert_eq!(headers["www-authenticate"], "Bearer");
        let v: Value = serde_json::from_str(&body).unwrap();
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap()
                .contains("worker admin API")
        );
    }
    assert_eq!(engine.prefix_cache_stats().unwrap().blocks, blocks);

    let (status, headers, _) = call(reqwest::Method::GET, &url, Some(TOKEN)).await;
    assert_eq!(status, 405);
    assert_eq!(headers["allow"], "POST");
    let (status, _, body) = call(
        reqwest::Method::POST,
        &format!("{url}?reset_running_requests=true"),
        Some(TOKEN),
    )
    .await;
    assert_eq!(status, 400, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["error"]["param"], "reset_running_requests");
    assert_eq!(engine.prefix_cache_stats().unwrap().blocks, blocks);

    let (status, _, body) = call(reqwest::Method::POST, &url, Some(TOKEN)).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(engine.prefix_cache_stats().unwrap().blocks, 0);
    assert_eq!(
        heard.0.lock().unwrap().last(),
        Some(&PrefixEvent::AllCleared)
    );
    let m = common::metrics(&w).await;
    assert!(
        m.contains("rngd_pd_worker_admin_refusals_total{reason=\"unauthorized\"} 3"),
        "{m}"
    );
    a.stop().await;
}

#[tokio::test]
async fn ten_failures_lock_the_api() {
    let (w, _) = start(PrefixCacheOptions::default()).await;
    let a = admin(&w).await;
    let url = format!("http://{}/reset_prefix_cache", a.addr);
    for _ in 0..10 {
        let (status, _, _) = call(reqwest::Method::POST, &url, Some("guess")).await;
        assert_eq!(status, 401);
    }
    let (status, headers, _) = call(reqwest::Method::POST, &url, Some(TOKEN)).await;
    assert_eq!(status, 429);
    let retry: u64 = headers["retry-after"].to_str().unwrap().parse().unwrap();
    assert!((1..=30).contains(&retry), "{retry}");
}

#[tokio::test]
async fn an_engine_without_a_prefix_cache_says_so() {
    let (w, _) = start(PrefixCacheOptions {
        enabled: false,
        ..PrefixCacheOptions::default()
    })
    .await;
    let a = admin(&w).await;
    let (status, _, body) = call(
        reqwest::Method::POST,
        &format!("http://{}/reset_prefix_cache", a.addr),
        Some(TOKEN),
    )
    .await;
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("no prefix cache"), "{body}");
}
