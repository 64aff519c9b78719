//! Fault rows: oversize prompts sent straight to a worker (the real
//! `rngd-pd worker --role solo` on the real model, its default context 512): the
//! worker refuses a prompt that cannot fit before tokenizing it whole
//! (issue 24, "length before tokens"). RSS is read from `/proc/<pid>/status`.
//!
//! | row | the client sees | what is left | a normal request |
//! |---|---|---|---|
//! | one 1 MB prompt (completion) | 400 `context_length_exceeded` within 1 s | RSS growth under 64 MB | served |
//! | one 1 MB chat | the same | the same | served |
//! | 32 parallel 1 MB prompts | each a 400 (or 429 past admission) | RSS growth under 256 MB | served |
//!
//! Before the change the worker tokenized the whole text (about 90 MB and
//! 0.45 s for 1 MB; a chat twice).

mod common;

use std::time::{Duration, Instant};

use common::Proc;
use serde_json::{Value, json};

fn rss(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = s.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    let kb: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kb * 1024
}

async fn post(url: String, body: String) -> (u16, Value) {
    let r = reqwest::Client::new()
        .post(url)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_refuses_oversize_prompts_before_tokenizing() {
    let dir = tempfile::tempdir().unwrap();
    let envs = [("RNGD_PD_MODEL", common::model().display().to_string())];
    // The worker's default context: 512.
    let w = Proc::worker("solo", dir.path(), "solo", &envs);
    let pid = w.child.id();
    let normal = || {
        post(
            w.url("/v1/completions"),
            json!({"model": common::SERVED_MODEL, "prompt": "Hello there", "max_tokens": 4})
                .to_string(),
        )
    };
    let (s, v) = normal().await;
    assert_eq!(s, 200, "{v}");
    let text = "word ".repeat(200_000);
    let bodies = [
        (
            "/v1/completions",
            json!({"model": common::SERVED_MODEL, "prompt": text, "max_tokens": 4}),
        ),
        (
            "/v1/chat/completions",
            json!({"model": common::SERVED_MODEL, "messages": [{"role": "user", "content": text}]}),
        ),
    ];
    for (path, body) in &bodies {
        let before = rss(pid);
        let started = Instant::now();
        let (s, v) = post(w.url(path), body.to_string()).await;
        let took = started.elapsed();
        assert_eq!(s, 400, "{path}: {v}");
        assert_eq!(
            v["error"]["code"],
            rngd_api::openai::CONTEXT_LENGTH_CODE,
            "{v}"
        );
        assert_eq!(v["error"]["param"], "max_tokens", "{v}");
        assert!(took < Duration::from_secs(1), "{path}: {took:?}");
        let grown = rss(pid).saturating_sub(before);
        assert!(grown < 64 << 20, "{path}: RSS grew {grown} bytes");
        eprintln!(
            "worker {path}: 1 MB refused in {took:?}, RSS +{} MB",
            grown >> 20
        );
    }
    let before = rss(pid);
    let body = bodies[0].1.to_string();
    let sends: Vec<_> = (0..32)
        .map(|_| tokio::spawn(post(w.url("/v1/completions"), body.clone())))
        .collect();
    for h in sends {
        let (s, v) = h.await.unwrap();
        assert!(s == 400 || s == 429, "{s} {v}");
        assert!(v["error"]["message"].is_string(), "{v}");
    }
    let grown = rss(pid).saturating_sub(before);
    assert!(grown < 256 << 20, "32 parallel: RSS grew {grown} bytes");
    eprintln!("worker: 32 parallel 1 MB prompts, RSS +{} MB", grown >> 20);
    let (s, v) = normal().await;
    assert_eq!(s, 200, "{v}");
}
