//! Real worker processes (`rngd-pd worker`, release build, real model):
//! prefill on one, decode on another, over `shm` and `tcp`; the tokens equal a
//! solo worker's; the decode worker loads KV and never prefills; the
//! `x-prefiller-host-port` path gives the same tokens; KV left behind by a
//! killed worker is gone once the TTL passes.
//!
//! Needs the model: `RNGD_PD_MODEL`, or the default cache filled by
//! `rngd-pd model fetch`.

mod common;

use std::process::Command;

use common::http::{complete, ids, metric, post, request, streamed_ids};
use common::{Proc, model};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

/// Serializes the tests of this file: each starts model-loading processes.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const TTL_S: &str = "1.5";

/// The test deployment's KV secret.
const KV_SECRET: &str = "worker-pd-test-secret-0123456789";

struct Env {
    dir: tempfile::TempDir,
    envs: Vec<(&'static str, String)>,
}

impl Env {
    fn new() -> Env {
        let dir = tempfile::tempdir().unwrap();
        let envs = vec![
            ("RNGD_PD_MODEL", model().display().to_string()),
            ("PD_SHM_ROOT", dir.path().join("shm").display().to_string()),
            ("AIRM_KV_SHM_TTL_S", TTL_S.to_string()),
            ("AIRM_KV_TCP_TTL_S", TTL_S.to_string()),
            ("RNGD_PD_KV_PULL_TIMEOUT_MS", "3000".to_string()),
            // The deployment's KV secret: the relay admits, and the decode
            // worker verifies handles, with it.
            ("AIRM_KV_TCP_SECRET", KV_SECRET.to_string()),
            // As the Helm chart runs cpu workers: the device lookup finds no card, which the cpu backend only logs.
            ("RNGD_PD_CHIP", "-1".to_string()),
            (
                "RNGD_PD_KUBELET_CHECKPOINT",
                dir.path().join("no-checkpoint").display().to_string(),
            ),
        ];
        Env { dir, envs }
    }

    /// Request files in the shm root (the prefill workers' arenas not counted).
    fn shm_files(&self) -> usize {
        common::shm::request_files(&self.dir.path().join("shm"))
    }

    /// Arena slots not free in the shm root.
    fn busy_slots(&self) -> usize {
        common::shm::busy_slots(&self.dir.path().join("shm"))
    }

    fn start_relay(&mut self) -> Proc {
        let relay = Proc::start(
            "relay",
            self.dir.path(),
            &["relay", "--listen", "127.0.0.1:0", "--ttl-s", TTL_S],
            &[("AIRM_KV_TCP_SECRET", KV_SECRET.to_string())],
            "relay listening on ",
        );
        self.envs.push(("AIRM_KV_TCP_ADDR", relay.addr.clone()));
        relay
    }

    fn worker(&self, name: &str, role: &str) -> Proc {
        Proc::worker(name, self.dir.path(), role, &self.envs)
    }
}

/// Prompts whose greedy answers run to `max_tokens` (checked: a comparison of
/// answers cut short by EOS would compare less).
const PROMPTS: &[&str] = &[
    "The capital of France is",
    "Write a story about the sea.\n",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
];

/// Reference tokens from a solo worker (stopped afterwards to save memory).
async fn solo_tokens(env: &Env) -> Vec<Vec<u64>> {
    let solo = env.worker("solo", "solo");
    let mut out = Vec::new();
    for p in PROMPTS {
        let r = complete(&solo, &request(p), &[]).await;
        assert_eq!(
            r["choices"][0]["finish_reason"], "length",
            "solo answer for {p:?}: {r}"
        );
        out.push(ids(&r));
    }
    solo.kill();
    out
}

/// Two-step PD through the worker API, as an orchestrator does it.
async fn two_step(
    prefill: &Proc,
    decode: &Proc,
    prompt: &str,
    transport: &str,
    rid: &str,
) -> Value {
    let mut pre = request(prompt);
    pre["kv_transfer_params"] = json!({"do_remote_decode": true, "kv_transport": transport});
    let answer = complete(prefill, &pre, &[("x-request-id", rid)]).await;
    let params = answer["kv_transfer_params"].clone();
    assert_eq!(params["do_remote_prefill"], true, "{answer}");
    assert_eq!(params["kv_handle"]["transport"], transport);
    let mut dec = request(prompt);
    dec["kv_transfer_params"] = params;
    complete(decode, &dec, &[]).await
}

async fn pd_matches_solo(transport: &str) {
    let _serial = SERIAL.lock().await;
    let mut env = Env::new();
    let want = solo_tokens(&env).await;
    let _relay = (transport == "tcp").then(|| env.start_relay());
    let prefill = env.worker("prefill", "prefill");
    // The decode worker may orchestrate (`x-prefiller-host-port`) on this prefill worker only.
    let mut envs = env.envs.clone();
    envs.push(("RNGD_PD_PREFILL_ALLOW", prefill.addr.clone()));
    let decode = Proc::worker("decode", env.dir.path(), "decode", &envs);

    for (i, p) in PROMPTS.iter().enumerate() {
        let got = two_step(
            &prefill,
            &decode,
            p,
            transport,
            &format!("{transport}-two-step-{i}"),
        )
        .await;
        assert_eq!(
            ids(&got),
            want[i],
            "{transport}: PD tokens differ from solo for prompt {i}"
        );
        let t = &got["timings"];
        assert!(
            t["kv_load_ms"].is_number() && t["prefill_ms"].is_number(),
            "{got}"
        );
    }
    for (i, p) in PROMPTS.iter().enumerate() {
        let rid = format!("{transport}-header-{i}");
        let got = complete(
            &decode,
            &request(p),
            &[
                ("x-prefiller-host-port", &prefill.addr),
                ("x-rngd-pd-kv-transport", transport),
                ("x-request-id", &rid),
            ],
        )
        .await;
        assert_eq!(
            ids(&got),
            want[i],
            "{transport}: x-prefiller-host-port tokens differ for prompt {i}"
        );
    }
    // Streaming through the header path gives the same tokens.
    let mut s = request(PROMPTS[0]);
    s["stream"] = json!(true);
    let (status, body) = post(
        &decode.url("/v1/completions"),
        &s,
        &[
            ("x-prefiller-host-port", &prefill.addr),
            ("x-rngd-pd-kv-transport", transport),
        ],
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let streamed = streamed_ids(&body);
    assert_eq!(streamed, want[0]);

    let n = (2 * PROMPTS.len() + 1) as f64;
    assert_eq!(metric(&decode, "rngd_pd_worker_kv_loads_total").await, n);
    assert_eq!(
        metric(&decode, "rngd_pd_worker_prefills_total").await,
        0.0,
        "the decode worker must not prefill"
    );
    assert_eq!(metric(&prefill, "rngd_pd_worker_prefills_total").await, n);
    assert_eq!(
        metric(&prefill, "rngd_pd_worker_kv_save_seconds_count").await,
        n
    );
    if transport == "shm" {
        assert_eq!(env.shm_files(), 0, "decode released every cache");
        assert_eq!(env.busy_slots(), 0, "and let go of every arena slot");
    }
}

#[tokio::test]
async fn pd_over_shm_matches_solo() {
    pd_matches_solo("shm").await;
}

#[tokio::test]
async fn pd_over_tcp_matches_solo() {
    pd_matches_solo("tcp").await;
}

/// Waits until `cond` holds, polling, or panics after `limit` (the TTL sweep is time-based).
/// Prompts of 1, S/2 and S-1 token ids (S = 512): the prefill hands each
/// over in the trimmed wire (only its valid positions, so the bytes grow
/// with the prompt), and the decode, which restores the S-wide cache,
/// answers exactly as a solo worker.
#[tokio::test]
async fn pd_in_the_trimmed_wire_matches_solo_at_the_edges_of_the_context() {
    let _serial = SERIAL.lock().await;
    let mut env = Env::new();
    let prompt =
        |n: usize| -> Vec<u64> { (0..n as u64).map(|i| 200 + (i * 37) % 40_000).collect() };
    let cases = [(1usize, 6u64), (256, 6), (511, 1)];
    let body = |n: usize, max: u64| json!({"model": common::SERVED_MODEL, "prompt": prompt(n), "max_tokens": max, "temperature": 0});
    let solo = env.worker("solo", "solo");
    let mut want = Vec::new();
    for (n, max) in cases {
        want.push(ids(&complete(&solo, &body(n, max), &[]).await));
    }
    solo.kill();
    let _relay = env.start_relay();
    let prefill = env.worker("prefill", "prefill");
    let decode = env.worker("decode", "decode");
    for (i, (n, max)) in cases.into_iter().enumerate() {
        let mut pre = body(n, max);
        pre["kv_transfer_params"] = json!({"do_remote_decode": true, "kv_transport": "tcp"});
        let answer = complete(&prefill, &pre, &[]).await;
        let params = answer["kv_transfer_params"].clone();
        let handle = &params["kv_handle"];
        assert_eq!(handle["wire"], 2, "{handle}");
        // SmolLM2: 3 KV heads × 64 dims × n tokens × 2 bytes per blob.
        let blobs = handle["blobs"].as_array().unwrap();
        assert!(
            blobs.iter().all(|b| b["len"] == json!(3 * 64 * n * 2)),
            "{n} tokens: {handle}"
        );
        let mut dec = body(n, max);
        dec["kv_transfer_params"] = params;
        let got = complete(&decode, &dec, &[]).await;
        assert_eq!(ids(&got), want[i], "{n}-token prompt: PD differs from solo");
    }
}

async fn eventually(limit: Duration, what: &str, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < limit, "{what}: not within {limit:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn push(
    rid: &'static str,
    transport: &'static str,
    w: &Proc,
) -> impl std::future::Future<Output = Value> + use<> {
    let mut pre = request(PROMPTS[0]);
    pre["kv_transfer_params"] = json!({"do_remote_decode": true, "kv_transport": transport});
    let url = w.url("/v1/completions");
    async move {
        let (status, text) = post(&url, &pre, &[("x-request-id", rid)]).await;
        assert_eq!(status, 200, "{text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        v["kv_transfer_params"].clone()
    }
}

/// A decode of an expired cache answers 410 `kv_unavailable` at once, naming
/// the transport and the request.
async fn assert_expired(decode: &Proc, params: Value, transport: &str, rid: &str) {
    let mut dec = request(PROMPTS[0]);
    dec["kv_transfer_params"] = params;
    // The error names the transport and the decode request's own id (the
    // cache's key is the prefill worker's random one).
    let (status, text) = post(
        &decode.url("/v1/completions"),
        &dec,
        &[("x-request-id", rid)],
    )
    .await;
    assert_eq!(status, 410, "{transport}: {text}");
    assert!(text.contains("kv_unavailable"), "{text}");
    assert!(text.contains(transport) && text.contains(rid), "{text}");
}

#[tokio::test]
async fn killed_workers_leave_nothing_behind_in_shm_after_the_ttl() {
    let _serial = SERIAL.lock().await;
    let env = Env::new();
    let prefill = env.worker("prefill-1", "prefill");
    let decode = env.worker("decode", "decode");

    // Prefill killed right after the push: its pointer file and its slot
    // arena are there, then the decode worker's sweeper removes both (the
    // arena is no longer touched by its owner).
    let stale = push("killed-after-push", "shm", &prefill).await;
    prefill.kill();
    assert_eq!(env.shm_files(), 1, "the pushed cache is in shm");
    assert_eq!(env.busy_slots(), 1, "in a slot of the prefill's arena");
    eventually(
        Duration::from_secs(20),
        "the shm cache of a killed prefill is swept, arena and all",
        || env.shm_files() == 0 && common::shm::arenas(&env.dir.path().join("shm")) == 0,
    )
    .await;
    assert_expired(&decode, stale, "shm", "killed-after-push").await;

    // Decode killed before it pulls: the prefill worker's sweeper removes the cache.
    let prefill = env.worker("prefill-2", "prefill");
    push("decode-killed", "shm", &prefill).await;
    decode.kill();
    assert_eq!(env.shm_files(), 1);
    eventually(
        Duration::from_secs(20),
        "the shm cache nobody pulled is swept, its slot freed",
        || env.shm_files() == 0 && env.busy_slots() == 0,
    )
    .await;
}

#[tokio::test]
async fn killed_prefill_leaves_nothing_in_the_relay_after_the_ttl() {
    let _serial = SERIAL.lock().await;
    let mut env = Env::new();
    let _relay = env.start_relay();
    let prefill = env.worker("prefill", "prefill");
    let decode = env.worker("decode", "decode");
    // Control: a fresh push can be decoded.
    let fresh = push("tcp-fresh", "tcp", &prefill).await;
    let mut dec = request(PROMPTS[0]);
    dec["kv_transfer_params"] = fresh;
    complete(&decode, &dec, &[]).await;
    // Killed after the push: once the relay's TTL has passed, the cache is gone.
    let stale = push("tcp-killed-after-push", "tcp", &prefill).await;
    prefill.kill();
    tokio::time::sleep(Duration::from_secs_f64(TTL_S.parse::<f64>().unwrap() * 2.0)).await;
    assert_expired(&decode, stale, "tcp", "tcp-killed-after-push").await;
}

#[test]
fn vendor_backends_refuse_to_start_without_their_runtime() {
    for (backend, vendor) in [("rngd", "FuriosaAI"), ("atom", "Rebellions")] {
        let out = Command::new(env!("CARGO_BIN_EXE_rngd-pd"))
            .args(["worker", "--backend", backend, "--port", "0"])
            .env("RNGD_PD_MODEL", "/nonexistent/model.gguf")
            .output()
            .unwrap();
        assert!(!out.status.success(), "{backend} must not start");
        let stderr = String::from_utf8_lossy(&out.stderr);
        let want = format!(
            "backend {backend} needs the {vendor} runtime, which this build does not include"
        );
        assert!(
            stderr.contains(&want),
            "stderr of --backend {backend}: {stderr}"
        );
        assert!(
            out.stdout.is_empty(),
            "nothing may claim to listen: {}",
            String::from_utf8_lossy(&out.stdout)
        );
    }
}
