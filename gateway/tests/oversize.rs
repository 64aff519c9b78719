//! Fault rows: oversize prompts at the gateway (issue 24, "length before
//! tokens"), with the real SmolLM2 tokenizer (`rngd-pd model fetch` puts the
//! GGUF in the cache, as `tests/run` does) in front of two echo workers; and
//! the public `/health` without worker addresses.
//!
//! | row | the client sees | what is left | a normal request |
//! |---|---|---|---|
//! | one 1 MB prompt | 400 `context_length_exceeded` within 1 s | RSS growth under 64 MB | served |
//! | 32 parallel 1 MB prompts | each a 400 (or 429 past admission) | RSS growth under 256 MB | served |
//!
//! Before the change a 1 MB prompt was tokenized whole (about 90 MB and
//! 0.45 s), and 32 at once took the gateway from 52 MB to 3.1 GB. The test
//! also times tokenizing the same prompt whole and prints the ratio.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use rngd_gateway::{Gateway, GatewayConfig};
use rngd_kv_transport::fake::MemoryTransport;
use rngd_policy_core::Role;
use rngd_pool::source as endpoints;
use rngd_pool::{HttpFetcher, PromptCounter, ScrapedEndpoints, StaticEndpoints};
use serde_json::{Value, json};

/// The resident set of this process, in bytes (`VmRSS`).
fn rss() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = s.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    let kb: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kb * 1024
}

struct Door {
    url: String,
    counter: Arc<dyn PromptCounter>,
    _workers: Vec<rngd_worker::RunningWorker>,
}

/// A gateway counting with the real GGUF tokenizer, over two echo workers.
async fn door() -> Door {
    let model = rngd_engine::model_fetch::resolve(None)
        .expect("the default model is in the cache (`rngd-pd model fetch`)");
    let counter = tokio::task::spawn_blocking(move || rngd_pool::gguf_counter(&model))
        .await
        .unwrap()
        .unwrap();
    let kv = Arc::new(MemoryTransport::new());
    let name = counter.model_name().to_string();
    let (pw, _, pa) = spawn_worker_serving(Role::Prefill, kv.clone(), Duration::ZERO, &name).await;
    let (dw, _, da) = spawn_worker_serving(Role::Decode, kv.clone(), Duration::ZERO, &name).await;
    let transports = ["memory".to_string()];
    let eps = vec![
        endpoints::local_endpoint(pa, Role::Prefill, 512, &transports),
        endpoints::local_endpoint(da, Role::Decode, 512, &transports),
    ];
    let table = ScrapedEndpoints::new(
        StaticEndpoints::new(eps),
        Arc::new(HttpFetcher::new(Duration::from_secs(2)).unwrap()),
        Duration::from_secs(300),
        None,
    );
    table.scrape_all().await;
    let config = GatewayConfig::default();
    let edge = config.edge.clone();
    let gw = Gateway::new(
        config,
        rngd_pool::Picker::new(TestPolicy::new(1 << 20), table),
        counter.clone(),
    )
    .unwrap();
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    let app = rngd_gateway::router(gw);
    tokio::spawn(rngd_gateway::serve(l, app, edge, std::future::pending()));
    Door {
        url,
        counter,
        _workers: vec![pw, dw],
    }
}

async fn normal_request_works(d: &Door) {
    let r = client()
        .post(format!("{}/v1/completions", d.url))
        .json(&json!({"model": d.counter.model_name(), "prompt": "Hello there", "max_tokens": 4}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap_or_default());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn oversize_prompts_are_refused_before_tokenizing() {
    let d = door().await;
    normal_request_works(&d).await;
    // ~1 MB of ordinary words (the gateway's body limit is 1 MiB).
    let prompt = "word ".repeat(200_000);
    let body =
        json!({"model": d.counter.model_name(), "prompt": prompt, "max_tokens": 4}).to_string();
    let before = rss();
    let started = Instant::now();
    let r = client()
        .post(format!("{}/v1/completions", d.url))
        .header("content-type", "application/json")
        .body(body.clone())
        .send()
        .await
        .unwrap();
    let one = started.elapsed();
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], rngd_api::openai::CONTEXT_LENGTH_CODE);
    assert_eq!(v["error"]["param"], "max_tokens");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("exceeds the compiled context length of 512 tokens"),
        "{v}"
    );
    assert!(one < Duration::from_secs(1), "{one:?}");
    let grown = rss().saturating_sub(before);
    assert!(
        grown < 64 << 20,
        "one 1 MB prompt grew RSS by {grown} bytes"
    );

    // 32 at once.
    let before = rss();
    let sends = (0..32).map(|_| {
        let (url, body) = (format!("{}/v1/completions", d.url), body.clone());
        async move {
            let r = client()
                .post(url)
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await
                .unwrap();
            let status = r.status().as_u16();
            let v: Value = r.json().await.unwrap();
            (status, v)
        }
    });
    let started = Instant::now();
    for (status, v) in futures::future::join_all(sends).await {
        assert!(status == 400 || status == 429, "{status} {v}");
        assert!(v["error"]["message"].is_string(), "{v}");
    }
    let all = started.elapsed();
    let grown32 = rss().saturating_sub(before);
    assert!(
        grown32 < 256 << 20,
        "32 parallel 1 MB prompts grew RSS by {grown32} bytes"
    );
    normal_request_works(&d).await;

    // The baseline of the same run: tokenizing that prompt whole.
    let started = Instant::now();
    let n = d.counter.count(&prompt).unwrap();
    let whole = started.elapsed();
    eprintln!(
        "oversize: one 1 MB prompt refused in {one:?} (tokenizing it whole: {whole:?}, {n} tokens; \
         ratio {:.4}); 32 in parallel in {all:?}; RSS growth {} MB (one), {} MB (32)",
        one.as_secs_f64() / whole.as_secs_f64(),
        grown >> 20,
        grown32 >> 20
    );
}

#[tokio::test]
async fn health_lists_counts_not_addresses() {
    let c = cluster(GatewayConfig::default(), Duration::ZERO).await;
    let r = client()
        .get(format!("{}/health", c.url))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let text = r.text().await.unwrap();
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["status"], "ok");
    assert_eq!(v["endpoints"]["decode"], json!({"healthy": 1, "total": 1}));
    assert_eq!(v["endpoints"]["prefill"], json!({"healthy": 1, "total": 1}));
    assert!(!text.contains("127.0.0.1"), "{text}");
}
