//! Weight updates on a running worker (`POST /update_weights_from_disk`,
//! `GET /weight_info` on the admin listener), with the echo engine standing
//! in for weights: a loader maps each file of a temporary weights directory
//! to an engine of its own `weight_version` (or to a load failure).
//!
//! - A stream admitted before the swap finishes on the old engine (its gate,
//!   which only the old engine has, holds its tokens until the test opens
//!   it), while a request after the swap is served by the new one at once:
//!   no request fails, none mixes engines; the KV-event sink hears
//!   `AllCleared` (the new engine's prefix cache starts empty).
//! - Refusals leave the serving weights alone: a file that does not load,
//!   another model (another KV layout), a path outside the directory or not
//!   a `.gguf`, a missing file, `abort_all_requests: true`, an unknown field,
//!   and a second update while one loads (409).

mod common;

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Condvar, Mutex};

use rngd_engine::fake::EchoEngine;
use rngd_engine::prefix::{PrefixEvent, PrefixEventSink};
use rngd_engine::{Engine, EngineError};
use rngd_http_edge::admin::AdminToken;
use rngd_kv_transport::KvTransport;
use rngd_kv_transport::fake::MemoryTransport;
use rngd_worker::admin::{AdminListen, RunningAdmin};
use rngd_worker::weights::{EngineLoader, WeightUpdater};
use rngd_worker::{Role, RunningWorker, Transports, WorkerConfig};
use serde_json::{Value, json};

const TOKEN: &str = "worker-weights-test-token";

#[derive(Default)]
struct Heard(Mutex<Vec<PrefixEvent>>);

impl PrefixEventSink for Heard {
    fn publish(&self, event: PrefixEvent) {
        self.0.lock().unwrap().push(event);
    }
}

/// A gate a loader waits at, and a flag saying it got there.
#[derive(Default)]
struct Door {
    state: Mutex<(bool, bool)>,
    cv: Condvar,
}

impl Door {
    fn wait_open(&self) {
        let mut g = self.state.lock().unwrap();
        g.0 = true;
        self.cv.notify_all();
        while !g.1 {
            g = self.cv.wait(g).unwrap();
        }
    }
    fn open(&self) {
        self.state.lock().unwrap().1 = true;
        self.cv.notify_all();
    }
    fn reached(&self) -> bool {
        self.state.lock().unwrap().0
    }
}

/// File name → what loading it gives.
struct MapLoader {
    versions: HashMap<&'static str, &'static str>,
    slow: Arc<Door>,
}

impl EngineLoader for MapLoader {
    fn load(&self, model: &Path) -> Result<Arc<dyn Engine>, EngineError> {
        let name = model.file_name().unwrap().to_str().unwrap();
        match name {
            "broken.gguf" => Err(EngineError::InvalidModel {
                path: model.to_path_buf(),
                reason: "tensor `blk.0.attn_q.weight` is truncated".into(),
                source: None,
            }),
            // Another model: another context length, so another KV layout.
            "other.gguf" => Ok(Arc::new(EchoEngine::new(32))),
            "slow.gguf" => {
                self.slow.wait_open();
                Ok(Arc::new(
                    EchoEngine::new(64).with_weight_version("5105105105105105"),
                ))
            }
            n => Ok(Arc::new(
                EchoEngine::new(64).with_weight_version(self.versions[n]),
            )),
        }
    }
}

struct Setup {
    w: RunningWorker,
    admin: RunningAdmin,
    dir: tempfile::TempDir,
    old_gate: Arc<tokio::sync::Semaphore>,
    slow: Arc<Door>,
}

async fn setup() -> Setup {
    let dir = tempfile::tempdir().unwrap();
    for f in [
        "a.gguf",
        "b.gguf",
        "broken.gguf",
        "other.gguf",
        "slow.gguf",
        "notes.txt",
    ] {
        std::fs::write(dir.path().join(f), b"GGUF").unwrap();
    }
    let old_gate = Arc::new(tokio::sync::Semaphore::new(0));
    let engine: Arc<dyn Engine> = Arc::new(
        EchoEngine::new(64)
            .with_weight_version("aaaaaaaaaaaaaaaa")
            .with_gate(old_gate.clone()),
    );
    let t: Arc<dyn KvTransport> = Arc::new(MemoryTransport::new());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let w = rngd_worker::serve(
        listener,
        engine,
        Transports::fixed(vec![t]),
        WorkerConfig::new(Role::Solo),
    )
    .await
    .unwrap();
    let slow = Arc::new(Door::default());
    let loader = MapLoader {
        versions: HashMap::from([
            ("a.gguf", "aaaaaaaaaaaaaaaa"),
            ("b.gguf", "bbbbbbbbbbbbbbbb"),
        ]),
        slow: slow.clone(),
    };
    assert!(w.state.set_weight_updater(
        WeightUpdater::new(Arc::new(loader), &dir.path().join("a.gguf"), None).unwrap()
    ));
    let opts = AdminListen {
        listen: "127.0.0.1:0".parse().unwrap(),
        token: AdminToken::new(TOKEN),
    };
    let admin = rngd_worker::admin::serve(&opts, w.state.clone())
        .await
        .unwrap()
        .unwrap();
    Setup {
        w,
        admin,
        dir,
        old_gate,
        slow,
    }
}

async fn update(s: &Setup, body: Value) -> (u16, Value) {
    let r = reqwest::Client::new()
        .post(format!("http://{}/update_weights_from_disk", s.admin.addr))
        .bearer_auth(TOKEN)
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap())
}

/// The worker's `GET /v1/models`.
async fn models(s: &Setup) -> Value {
    reqwest::get(format!("{}/v1/models", s.w.url()))
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

async fn served_version(s: &Setup) -> (String, String) {
    let v = models(s).await;
    (
        v["data"][0]["weight_version"].as_str().unwrap().to_string(),
        v["data"][0]["root"].as_str().unwrap().to_string(),
    )
}

fn completion(stream: bool) -> Value {
    json!({"model": "echo", "prompt": "abcdef", "max_tokens": 4, "temperature": 0, "stream": stream})
}

#[tokio::test]
async fn requests_in_flight_finish_on_the_old_weights_and_new_ones_get_the_new() {
    let s = setup().await;
    assert_eq!(
        served_version(&s).await,
        ("aaaaaaaaaaaaaaaa".into(), "a.gguf".into())
    );
    // A stream on the old engine: its first token is out, the rest wait at
    // the old engine's gate.
    let mut stream = reqwest::Client::new()
        .post(format!("{}/v1/completions", s.w.url()))
        .json(&completion(true))
        .send()
        .await
        .unwrap();
    assert_eq!(stream.status(), 200);
    let first = stream.chunk().await.unwrap().unwrap();
    assert!(String::from_utf8_lossy(&first).contains("data: "));

    let heard = Arc::new(Heard::default());
    s.w.state.set_prefix_sink(Some(heard.clone()));
    let (status, answer) = update(&s, json!({"model_path": "b.gguf"})).await;
    assert_eq!(status, 200, "{answer}");
    // Routers are told the old engine's blocks are gone.
    assert_eq!(*heard.0.lock().unwrap(), [PrefixEvent::AllCleared]);
    assert_eq!(answer["success"], true);
    assert_eq!(answer["weight_version"], "bbbbbbbbbbbbbbbb");
    assert_eq!(answer["previous_weight_version"], "aaaaaaaaaaaaaaaa");
    assert_eq!(answer["bytes_read"], 4);
    assert_eq!(
        served_version(&s).await,
        ("bbbbbbbbbbbbbbbb".into(), "b.gguf".into())
    );
    let info: Value = reqwest::Client::new()
        .get(format!("http://{}/weight_info", s.admin.addr))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        info,
        json!({"model_name": "echo", "weight_version": "bbbbbbbbbbbbbbbb", "model_file": "b.gguf"})
    );

    // A request after the swap: the new engine has no gate, so it answers
    // while the old stream is still held.
    let r: Value = reqwest::Client::new()
        .post(format!("{}/v1/completions", s.w.url()))
        .json(&completion(false))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(r["usage"]["completion_tokens"], 4, "{r}");

    // The old stream resumes on the old engine's gate and ends whole.
    s.old_gate.add_permits(16);
    let mut rest = String::from_utf8_lossy(&first).into_owned();
    while let Some(c) = stream.chunk().await.unwrap() {
        rest.push_str(&String::from_utf8_lossy(&c));
    }
    assert!(rest.contains("data: [DONE]"), "{rest}");
    assert!(!rest.contains("\"error\""), "{rest}");
    let text: String = rest
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str::<Value>(d).unwrap())
        .filter_map(|v| v["choices"][0]["text"].as_str().map(String::from))
        .collect();
    assert_eq!(text, "abcd");

    let m = common::metrics(&s.w).await;
    let info: Vec<&str> = m
        .lines()
        .filter(|l| l.starts_with("rngd_pd_worker_weight_info{"))
        .collect();
    assert_eq!(
        info,
        ["rngd_pd_worker_weight_info{model_name=\"echo\",weight_version=\"bbbbbbbbbbbbbbbb\"} 1"]
    );
    s.admin.stop().await;
}

#[tokio::test]
async fn a_refused_update_leaves_the_serving_weights_alone() {
    let s = setup().await;
    let outside = tempfile::tempdir().unwrap();
    std::fs::write(outside.path().join("x.gguf"), b"GGUF").unwrap();
    let escape = format!(
        "../{}/x.gguf",
        outside.path().file_name().unwrap().to_str().unwrap()
    );
    #[cfg(unix)]
    std::os::unix::fs::symlink(
        outside.path().join("x.gguf"),
        s.dir.path().join("link.gguf"),
    )
    .unwrap();
    let absolute_outside = outside.path().join("x.gguf").display().to_string();
    for (body, param, needle) in [
        (
            json!({"model_path": "broken.gguf"}),
            "model_path",
            "truncated",
        ),
        (
            json!({"model_path": "other.gguf"}),
            "model_path",
            "KV layout",
        ),
        (
            json!({"model_path": escape}),
            "model_path",
            "weights directory",
        ),
        (
            json!({"model_path": absolute_outside}),
            "model_path",
            "weights directory",
        ),
        (
            json!({"model_path": "link.gguf"}),
            "model_path",
            "weights directory",
        ),
        (
            json!({"model_path": "notes.txt"}),
            "model_path",
            "weights directory",
        ),
        (
            json!({"model_path": "missing.gguf"}),
            "model_path",
            "does not exist",
        ),
        (
            json!({"model_path": "b.gguf", "abort_all_requests": true}),
            "abort_all_requests",
            "not supported",
        ),
        (
            json!({"model_path": "b.gguf", "flush_cache": true}),
            "flush_cache",
            "not a field",
        ),
    ] {
        let (status, v) = update(&s, body.clone()).await;
        assert_eq!(status, 400, "{body}: {v}");
        assert_eq!(v["error"]["param"], param, "{body}: {v}");
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(msg.contains(needle), "{body}: {msg}");
        assert_eq!(
            served_version(&s).await,
            ("aaaaaaaaaaaaaaaa".into(), "a.gguf".into()),
            "{body}"
        );
    }

    // One update at a time: a second one while the first loads is a 409.
    let first = {
        let addr = s.admin.addr;
        tokio::spawn(async move {
            reqwest::Client::new()
                .post(format!("http://{addr}/update_weights_from_disk"))
                .bearer_auth(TOKEN)
                .json(&json!({"model_path": "slow.gguf"}))
                .send()
                .await
                .unwrap()
                .status()
                .as_u16()
        })
    };
    while !s.slow.reached() {
        tokio::task::yield_now().await;
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    let (status, v) = update(&s, json!({"model_path": "b.gguf"})).await;
    assert_eq!(status, 409, "{v}");
    assert_eq!(
        served_version(&s).await.0,
        "aaaaaaaaaaaaaaaa",
        "nothing changes while the first loads"
    );
    s.slow.open();
    assert_eq!(first.await.unwrap(), 200);
    assert_eq!(served_version(&s).await.0, "5105105105105105");

    // Without the token: 401, nothing loaded.
    let r = reqwest::Client::new()
        .post(format!("http://{}/update_weights_from_disk", s.admin.addr))
        .json(&json!({"model_path": "b.gguf"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    assert_eq!(served_version(&s).await.0, "5105105105105105");
    s.admin.stop().await;
}

async fn admin(s: &Setup, path: &str, body: Option<Value>) -> (u16, Value) {
    let c = reqwest::Client::new();
    let url = format!("http://{}{path}", s.admin.addr);
    let req = match body {
        Some(b) => c.post(url).json(&b),
        None => c.get(url),
    };
    let r = req.bearer_auth(TOKEN).send().await.unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap())
}

/// `POST /switch_variant` with `body` on the admin listener.
async fn switch(s: &Setup, body: Value) -> (u16, Value) {
    admin(s, "/switch_variant", Some(body)).await
}

async fn max_model_len(s: &Setup) -> u64 {
    models(s).await["data"][0]["max_model_len"]
        .as_u64()
        .unwrap()
}

async fn complete(s: &Setup, prompt: &str) -> (u16, Value) {
    let r = reqwest::Client::new()
        .post(format!("{}/v1/completions", s.w.url()))
        .json(&json!({"model": "echo", "prompt": prompt, "max_tokens": 4, "temperature": 0}))
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap())
}

#[tokio::test]
async fn a_variant_switch_moves_admission_and_keeps_the_old_variant_prepared() {
    let s = setup().await;
    s.old_gate.add_permits(1 << 16);
    let long = "x".repeat(40);
    assert_eq!(complete(&s, &long).await.0, 200);
    assert_eq!(max_model_len(&s).await, 64);

    let (status, a) = switch(&s, json!({"seq_len": 32, "max_batch": 2})).await;
    assert_eq!(status, 200, "{a}");
    assert_eq!(
        (a["seq_len"].as_u64(), a["max_batch"].as_u64()),
        (Some(32), Some(2))
    );
    assert_eq!(a["was_prepared"], false);
    // The variant serving, then the one it replaced, each with its KV memory:
    // layers 2 × kv_heads 1 × head_dim 8 × S × K and V × bf16, per slot and
    // for the prefill cache.
    assert_eq!(
        a["variants"],
        json!([
            {"seq_len": 32, "max_batch": 2, "kv_cache_bytes": 2 * 8 * 32 * 4 * 3, "active": true},
            {"seq_len": 64, "max_batch": 8, "kv_cache_bytes": 2 * 8 * 64 * 4 * 9, "active": false},
        ])
    );
    // Admission follows at once: the worker's own and what it tells routers.
    assert_eq!(max_model_len(&s).await, 32);
    let (status, e) = complete(&s, &long).await;
    assert_eq!(status, 400, "{e}");
    assert_eq!(e["error"]["code"], "context_length_exceeded", "{e}");
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("context length of 32"),
        "{e}"
    );
    assert_eq!(complete(&s, "abc").await.0, 200);
    let page = common::metrics(&s.w).await;
    assert!(
        page.contains(
            "rngd_pd_worker_variant_info{max_batch=\"2\",model_name=\"echo\",seq_len=\"32\"} 1"
        ),
        "{page}"
    );
    assert!(!page.contains("seq_len=\"64\""), "one series: {page}");
    // The weights did not change.
    assert_eq!(served_version(&s).await.0, "aaaaaaaaaaaaaaaa");

    // Back: a swap to the prepared variant.
    let (status, a) = switch(&s, json!({"seq_len": 64, "max_batch": 8})).await;
    assert_eq!(status, 200, "{a}");
    assert_eq!(a["was_prepared"], true);
    assert_eq!(a["variants"].as_array().unwrap().len(), 2);
    assert_eq!(complete(&s, &long).await.0, 200);
    // The same variant again: nothing to do.
    let (status, a) = switch(&s, json!({})).await;
    assert_eq!((status, a["was_prepared"].clone()), (200, json!(true)));

    // Refusals name the field; the serving variant stays.
    for (body, param) in [
        (json!({"seq_len": 0}), "seq_len"),
        (json!({"max_batch": 100000}), "max_batch"),
        (json!({"seq": 12}), "seq"),
    ] {
        let (status, e) = switch(&s, body).await;
        assert_eq!(status, 400, "{e}");
        assert_eq!(e["error"]["param"], param, "{e}");
    }
    assert_eq!(max_model_len(&s).await, 64);

    // New weights drop the variants prepared on the old ones.
    assert_eq!(update(&s, json!({"model_path": "b.gguf"})).await.0, 200);
    let (status, v) = admin(&s, "/variants", None).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["variants"].as_array().unwrap().len(), 1, "{v}");
    assert_eq!(v["variants"][0]["active"], true);
}

#[tokio::test]
async fn at_most_four_variants_are_kept_prepared() {
    let s = setup().await;
    for n in [10, 11, 12, 13, 14, 15] {
        let (status, a) = switch(&s, json!({"seq_len": n})).await;
        assert_eq!(status, 200, "{a}");
    }
    let (_, v) = admin(&s, "/variants", None).await;
    let lens: Vec<u64> = v["variants"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["seq_len"].as_u64().unwrap())
        .collect();
    // The serving one, then the four most recent it replaced.
    assert_eq!(lens, [15, 11, 12, 13, 14]);
}
