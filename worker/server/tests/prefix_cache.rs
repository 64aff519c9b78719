//! The prefix cache through the worker's HTTP API (tiny model): a second
//! identical request reports `usage.prompt_tokens_details.cached_tokens`,
//! whole and streamed, completions and chat, with the same tokens; a
//! different `cache_salt` does not hit; the `vllm:prefix_cache_*` and
//! `vllm:cache_config_info` families count it.

mod common;

use std::sync::Arc;

use common::{metrics, sample, sse_events};
use rngd_engine::Engine;
use rngd_kv_transport::KvTransport;
use rngd_kv_transport::fake::MemoryTransport;
use rngd_worker::{Role, RunningWorker, Transports, WorkerConfig};
use serde_json::{Value, json};

async fn start() -> RunningWorker {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let engine: Arc<dyn Engine> = rngd_engine::tiny::engine(256, 2).unwrap();
    let t: Arc<dyn KvTransport> = Arc::new(MemoryTransport::new());
    rngd_worker::serve(
        listener,
        engine,
        Transports::fixed(vec![t]),
        WorkerConfig::new(Role::Solo),
    )
    .await
    .unwrap()
}

async fn post(w: &RunningWorker, path: &str, body: &Value) -> String {
    let resp = reqwest::Client::new()
        .post(format!("{}{path}", w.url()))
        .json(body)
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let text = resp.text().await.unwrap();
    assert_eq!(status, 200, "{text}");
    text
}

/// (token ids or text, usage) of a whole answer.
async fn whole(w: &RunningWorker, path: &str, body: &Value) -> (Value, Value) {
    let v: Value = serde_json::from_str(&post(w, path, body).await).unwrap();
    let out = match path {
        "/v1/completions" => v["choices"][0]["token_ids"].clone(),
        _ => v["choices"][0]["message"]["content"].clone(),
    };
    (out, v["usage"].clone())
}

/// (token ids, the final usage chunk's usage) of a streamed completion.
async fn streamed(w: &RunningWorker, body: &Value) -> (Vec<u64>, Value) {
    let text = post(w, "/v1/completions", body).await;
    let mut ids = Vec::new();
    let mut usage = Value::Null;
    for e in sse_events(&text) {
        if e == "[DONE]" {
            continue;
        }
        let v: Value = serde_json::from_str(&e).unwrap();
        if let Some(t) = v["choices"][0]["token_ids"].as_array() {
            ids.extend(t.iter().map(|x| x.as_u64().unwrap()));
        }
        if !v["usage"].is_null() {
            usage = v["usage"].clone();
        }
    }
    (ids, usage)
}

/// The served model name.
async fn model(w: &RunningWorker) -> String {
    let v: Value = reqwest::get(format!("{}/v1/models", w.url()))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    v["data"][0]["id"].as_str().unwrap().to_string()
}

/// The positions a warm prefill of `n` tokens reuses (blocks of 16): all
/// full blocks below the last token, one fewer when only one token is left.
fn reusable(n: u64) -> u64 {
    let m = (n - 1) / 16;
    16 * if m > 0 && n - 16 * m == 1 { m - 1 } else { m }
}

fn cached(usage: &Value) -> u64 {
    usage["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or_else(|| panic!("no cached_tokens in {usage}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_identical_request_reports_its_cached_tokens() {
    let w = start().await;
    let name = model(&w).await;
    let prompt: Vec<u32> = (0..70u32).map(|i| (i * 37 + 5) % 256).collect();
    let body = json!({"model": name, "prompt": prompt, "max_tokens": 8,
        "temperature": 0, "ignore_eos": true});
    let (ids1, u1) = whole(&w, "/v1/completions", &body).await;
    assert_eq!(cached(&u1), 0);
    assert_eq!(u1["prompt_tokens"], 70);
    let (ids2, u2) = whole(&w, "/v1/completions", &body).await;
    // 70 tokens: 3 full blocks of 16 (a 4th would leave 6 to compute).
    assert_eq!(cached(&u2), 48);
    assert_eq!(ids2, ids1);
    // Streamed, with the usage chunk.
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    sbody["stream_options"] = json!({"include_usage": true});
    let (sids, su) = streamed(&w, &sbody).await;
    assert_eq!(cached(&su), 48);
    assert_eq!(Value::from(sids), ids1);
    // Another tenant's salt: no hit, then its own hit.
    let mut salted = body.clone();
    salted["cache_salt"] = json!("tenant-b");
    let (sid, u) = whole(&w, "/v1/completions", &salted).await;
    assert_eq!(cached(&u), 0);
    assert_eq!(sid, ids1);
    let (_, u) = whole(&w, "/v1/completions", &salted).await;
    assert_eq!(cached(&u), 48);

    let m = metrics(&w).await;
    let model = format!("{{model_name=\"{name}\"}}");
    assert_eq!(
        sample(&m, &format!("vllm:prefix_cache_queries_total{model}")),
        5.0 * 70.0
    );
    assert_eq!(
        sample(&m, &format!("vllm:prefix_cache_hits_total{model}")),
        3.0 * 48.0
    );
    assert!(
        m.lines().any(|l| l.starts_with("vllm:cache_config_info{")
            && l.contains("block_size=\"16\"")
            && l.contains("num_gpu_blocks=\"")
            && l.ends_with(" 1")),
        "{m}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chat_reports_cached_tokens_whole_and_streamed() {
    let w = start().await;
    let name = model(&w).await;
    let long = "the quick brown fox jumps over the lazy dog ".repeat(4);
    let body = json!({"model": name, "messages": [{"role": "user", "content": long}],
        "max_tokens": 6, "temperature": 0, "ignore_eos": true});
    let (t1, u1) = whole(&w, "/v1/chat/completions", &body).await;
    assert_eq!(cached(&u1), 0);
    let prompt_tokens = u1["prompt_tokens"].as_u64().unwrap();
    assert!(prompt_tokens > 32, "{u1}");
    let (t2, u2) = whole(&w, "/v1/chat/completions", &body).await;
    assert_eq!(cached(&u2), reusable(prompt_tokens));
    assert_eq!(t2, t1);
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    sbody["stream_options"] = json!({"include_usage": true});
    let text = post(&w, "/v1/chat/completions", &sbody).await;
    let usage = sse_events(&text)
        .into_iter()
        .filter(|e| e != "[DONE]")
        .map(|e| serde_json::from_str::<Value>(&e).unwrap())
        .find(|v| !v["usage"].is_null())
        .map(|v| v["usage"].clone())
        .expect("a usage chunk");
    assert_eq!(cached(&usage), reusable(prompt_tokens));
}

/// A tiny-model worker of `role` sharing `mem`, admitting `peers` as
/// prefill workers, with the test KV secret.
async fn start_pd(
    role: rngd_worker::Role,
    mem: &Arc<MemoryTransport>,
    peers: &[String],
) -> RunningWorker {
    let mut config = WorkerConfig::new(role).with_kv_secret(b"test-kv-secret-0123456789abcdef");
    if !peers.is_empty() {
        config.prefill_allow = peers.join(",").parse().unwrap();
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let engine: Arc<dyn Engine> = rngd_engine::tiny::engine(256, 2).unwrap();
    let t: Arc<dyn KvTransport> = mem.clone();
    rngd_worker::serve(listener, engine, Transports::fixed(vec![t]), config)
        .await
        .unwrap()
}

/// (token ids, usage) of a completion sent with `headers`.
async fn whole_with(
    w: &RunningWorker,
    body: &Value,
    headers: &[(&str, String)],
) -> (Vec<u32>, Value) {
    let mut req = reqwest::Client::new()
        .post(format!("{}/v1/completions", w.url()))
        .json(body);
    for (k, v) in headers {
        req = req.header(*k, v);
    }
    let resp = req.send().await.unwrap();
    let status = resp.status().as_u16();
    let v: Value = resp.json().await.unwrap();
    assert_eq!(status, 200, "{v}");
    let ids = v["choices"][0]["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect();
    (ids, v["usage"].clone())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pd_reports_the_prefill_hit_and_the_decode_worker_keeps_its_turn() {
    let mem = Arc::new(MemoryTransport::new());
    let solo = start().await;
    let prefill = start_pd(Role::Prefill, &mem, &[]).await;
    let decode = start_pd(Role::Decode, &mem, &[prefill.addr.to_string()]).await;
    let name = model(&solo).await;
    let peer = [("x-prefiller-host-port", prefill.addr.to_string())];
    let prompt: Vec<u32> = (0..70u32).map(|i| (i * 29 + 3) % 256).collect();
    let body = json!({"model": name, "prompt": prompt, "max_tokens": 20,
        "temperature": 0, "ignore_eos": true});
    let (want, _) = whole_with(&solo, &body, &[]).await;

    // Cold prefill worker, then warm: the same tokens as solo, and the
    // decode worker's answer reports the prefill worker's hit.
    let (cold, u) = whole_with(&decode, &body, &peer).await;
    assert_eq!(cold, want);
    assert_eq!(cached(&u), 0);
    let (warm, u) = whole_with(&decode, &body, &peer).await;
    assert_eq!(warm, want, "a prefill-side hit changed the tokens");
    assert_eq!(cached(&u), 48);
    assert_eq!(mem.held(), 0);

    // The next turn, prefilled on the decode worker itself: the blocks of
    // the conversation it decoded (prompt and generated tokens) are reused.
    let mut turn: Vec<u32> = prompt.clone();
    turn.extend(&want);
    turn.extend((0..30u32).map(|i| (i * 7 + 1) % 256));
    let body2 = json!({"model": name, "prompt": turn, "max_tokens": 12,
        "temperature": 0, "ignore_eos": true});
    let (want2, _) = whole_with(&solo, &body2, &[]).await;
    let (got2, u) = whole_with(&decode, &body2, &[]).await;
    assert_eq!(got2, want2);
    // 70 prompt + 20 generated = 90 positions decoded there; the KV of the
    // last generated token is never written, so 89 are kept: 5 full blocks.
    assert_eq!(cached(&u), 80, "{u}");
    let m = metrics(&decode).await;
    assert_eq!(sample(&m, "rngd_pd_worker_prefills_total"), 1.0);
}
