//! The worker's stranded-KV gauge over the real `shm` transport (tiny
//! model, in-process workers on 127.0.0.1:0): a prefill whose decode never
//! comes (the client left) shows its KV bytes in
//! `rngd_pd_worker_kv_stranded_bytes{transport="shm"}` once the claim window
//! has passed, a handoff the decode took never does, and the gauge drops to
//! 0 when the TTL sweep has freed the KV. Every wait polls with a deadline.

mod common;

use std::sync::Arc;
use std::time::Duration;

use rngd_engine::Engine;
use rngd_kv_transport::shm::ShmTransport;
use rngd_kv_transport::{KvTransport, TransportConfig};
use rngd_worker::{Role, RunningWorker, Transports, WorkerConfig};
use serde_json::{Value, json};

const S: usize = 256;
const GAUGE: &str = "rngd_pd_worker_kv_stranded_bytes{transport=\"shm\"}";
const WITHIN: Duration = Duration::from_secs(20);

async fn start(role: Role, t: &ShmTransport) -> RunningWorker {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let engine: Arc<dyn Engine> = rngd_engine::tiny::engine(S, 2).unwrap();
    let t: Arc<dyn KvTransport> = Arc::new(t.clone());
    let config = WorkerConfig::new(role).with_kv_secret(b"test-kv-secret-0123456789abcdef");
    rngd_worker::serve(listener, engine, Transports::fixed(vec![t]), config)
        .await
        .unwrap()
}

async fn post(w: &RunningWorker, body: &Value) -> Value {
    let (status, _, text) = common::post(w, body, &[]).await;
    assert_eq!(status, 200, "{text}");
    serde_json::from_str(&text).unwrap()
}

fn request(prompt: &str) -> Value {
    json!({
        "model": "tiny-llama",
        "prompt": prompt,
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": true,
    })
}

/// The prefill half of a PD request: its `kv_transfer_params`.
async fn prefill(p: &RunningWorker, prompt: &str) -> Value {
    let mut body = request(prompt);
    body["kv_transfer_params"] = json!({"do_remote_decode": true});
    post(p, &body).await["kv_transfer_params"].clone()
}

/// Scrapes `w` until the gauge satisfies `done`; its value.
async fn gauge_until(w: &RunningWorker, what: &str, done: impl Fn(f64) -> bool) -> f64 {
    let until = tokio::time::Instant::now() + WITHIN;
    loop {
        let m = common::metrics(w).await;
        let v = common::sample(&m, GAUGE);
        if done(v) {
            return v;
        }
        assert!(
            tokio::time::Instant::now() < until,
            "{what}: not within {WITHIN:?}, {GAUGE} = {v}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_no_decode_claimed_shows_in_the_gauge_until_the_ttl_frees_it() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = TransportConfig {
        shm_root: dir.path().join("kv"),
        shm_ttl: Duration::from_secs(3),
        claim_window: Duration::from_millis(500),
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
    // A handoff the decode takes: never stranded, however long one waits.
    let params = prefill(&p, "taken at once by its decode").await;
    let mut body = request("taken at once by its decode");
    body["kv_transfer_params"] = params;
    post(&d, &body).await;
    // A prefill whose client left before the decode.
    prefill(&p, "nobody comes for this one").await;
    assert_eq!(tp.held_files().unwrap(), 1, "only the unclaimed KV is held");
    let stranded = gauge_until(&p, "the unclaimed KV stranded", |v| v > 0.0).await;
    assert_eq!(
        stranded,
        tp.stranded_bytes() as f64,
        "the gauge is the transport's figure"
    );
    assert!(
        stranded > 4096.0,
        "the KV's bytes, not a pointer file's: {stranded}"
    );
    gauge_until(&p, "the TTL sweep freed it", |v| v == 0.0).await;
    assert_eq!((tp.held_files().unwrap(), tp.busy_slots()), (0, 0));
}
