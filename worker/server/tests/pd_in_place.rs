//! PD over the real `shm` transport with its slot arena (tiny model, two
//! in-process workers on 127.0.0.1:0): the prefill engine writes its cache
//! straight into a slot, the decode reads it in place, and the tokens equal
//! a single worker's; afterwards no slot is busy and no request file is
//! left. With every slot taken the prefill pushes a file of its own, with
//! the same tokens.

mod common;

use std::path::Path;
use std::sync::Arc;

use rngd_engine::Engine;
use rngd_kv_transport::shm::{ARENA_EXT, ShmTransport};
use rngd_kv_transport::{KvTransport, SinkShape, TransportConfig};
use rngd_worker::{Role, RunningWorker, Transports, WorkerConfig};
use serde_json::{Value, json};

const S: usize = 256;

async fn start(role: Role, t: &ShmTransport) -> RunningWorker {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let engine: Arc<dyn Engine> = rngd_engine::tiny::engine(S, 2).unwrap();
    let t: Arc<dyn KvTransport> = Arc::new(t.clone());
    let config = WorkerConfig::new(role).with_kv_secret(b"test-kv-secret-0123456789abcdef");
    rngd_worker::serve(listener, engine, Transports::fixed(vec![t]), config)
        .await
        .unwrap()
}

/// A completion that must succeed, as JSON.
async fn post(w: &RunningWorker, body: &Value) -> Value {
    let (status, _, text) = common::post(w, body, &[]).await;
    assert_eq!(status, 200, "{text}");
    serde_json::from_str(&text).unwrap()
}

fn request() -> Value {
    json!({
        "model": "tiny-llama",
        "prompt": "one copy from the prefill's cache to the decode's",
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": true,
    })
}

/// The generated token ids of a PD split between `p` and `d`.
async fn pd(p: &RunningWorker, d: &RunningWorker) -> Value {
    let mut body = request();
    body["kv_transfer_params"] = json!({"do_remote_decode": true});
    let first = post(p, &body).await;
    let mut body = request();
    body["kv_transfer_params"] = first["kv_transfer_params"].clone();
    post(d, &body).await["choices"][0]["token_ids"].clone()
}

fn arena_files(root: &Path) -> usize {
    std::fs::read_dir(root)
        .unwrap()
        .flatten()
        .filter(|e| e.path().extension().is_some_and(|x| x == ARENA_EXT))
        .count()
}

#[tokio::test]
async fn pd_through_a_slot_equals_a_single_worker() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("kv");
    let cfg = TransportConfig {
        shm_root: root.clone(),
        shm_slots: 1,
        ..TransportConfig::default()
    };
    let (tp, td) = (
        ShmTransport::new(&cfg).unwrap(),
        ShmTransport::new(&cfg).unwrap(),
    );
    let (p, d) = (
        start(Role::Prefill, &tp).await,
        start(Role::Decode, &td).await,
    );
    let solo = post(&d, &request()).await["choices"][0]["token_ids"].clone();
    assert_eq!(solo.as_array().unwrap().len(), 6);

    let tokens = pd(&p, &d).await;
    assert_eq!(tokens, solo, "PD through a slot equals a single worker");
    assert_eq!(arena_files(&root), 1, "the prefill wrote into its arena");
    assert_eq!(tp.busy_slots(), 0, "the decode let go of the slot");
    assert_eq!(tp.held_files().unwrap(), 0, "no request file left");
    let m = common::metrics(&p).await;
    let handoffs = |path: &str| {
        common::sample(
            &m,
            &format!("rngd_pd_worker_kv_handoffs_total{{path=\"{path}\"}}"),
        )
    };
    assert_eq!((handoffs("in_place"), handoffs("push")), (1.0, 0.0));

    // Every slot taken: the prefill pushes a file of its own instead.
    let layout = rngd_engine::tiny::engine(S, 1).unwrap().info().kv_layout;
    let shape = SinkShape {
        layout,
        tokens: 4,
        wire: rngd_kv_wire::WIRE_TRIMMED,
    };
    let held = tp
        .reserve("holding", shape)
        .await
        .unwrap()
        .expect("the free slot");
    assert_eq!(tp.busy_slots(), 1);
    let tokens = pd(&p, &d).await;
    assert_eq!(
        tokens, solo,
        "PD through a pushed file equals a single worker"
    );
    assert_eq!(tp.held_files().unwrap(), 0);
    let m = common::metrics(&p).await;
    assert_eq!(
        common::sample(&m, "rngd_pd_worker_kv_handoffs_total{path=\"push\"}"),
        1.0
    );
    drop(held);
    assert_eq!(tp.busy_slots(), 0);
}
