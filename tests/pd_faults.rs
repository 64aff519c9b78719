//! PD handoff faults against the real binaries (`rngd-pd worker`, `rngd-pd
//! gateway`, release build, real model, `shm`), rows of the fault suite —
//! what the client saw, what was left, whether a normal request still works:
//!
//! - a decode re-sent for a handle the decode worker consumed is refused at
//!   once (410 `kv_handle_consumed`, well under the 30 s pull timeout), with
//!   nothing loaded and no slot held;
//! - a `release_only` request frees the shm cache without a pull, and a
//!   decode that comes after it is refused at once (410 `kv_handle_released`);
//! - non-streamed PD requests abandoned through the gateway while their
//!   decode runs leave no decode slot taken and no cache in shm, and a normal
//!   request afterwards is served (the decode worker has 4 slots: before, each
//!   abandon left one held for the pull timeout).
//!
//! Needs the model: `RNGD_PD_MODEL`, or the default cache filled by
//! `rngd-pd model fetch`.

mod common;

use std::time::{Duration, Instant};

use common::http::{client, complete, metric, post, request};
use common::{Proc, model};
use serde_json::{Value, json};

/// Serializes the tests of this file: each starts model-loading processes.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const KV_SECRET: &str = "pd-faults-test-secret-0123456789";

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
            ("AIRM_KV_SHM_TTL_S", "60".to_string()),
            // The default pull timeout: a refusal "at once" is far under it.
            ("RNGD_PD_KV_PULL_TIMEOUT_MS", "30000".to_string()),
            ("AIRM_KV_TCP_SECRET", KV_SECRET.to_string()),
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

    fn worker(&self, name: &str, role: &str, extra: &[&str]) -> Proc {
        let mut args = vec!["worker", "--role", role, "--port", "0"];
        args.extend_from_slice(extra);
        let mut p = Proc::start(
            name,
            self.dir.path(),
            &args,
            &self.envs,
            "rngd-pd worker listening on http://",
        );
        p.addr = p.addr.trim_start_matches("http://").to_string();
        p
    }
}

const PROMPT: &str = "The capital of France is";

async fn prefill(p: &Proc) -> Value {
    let mut pre = request(PROMPT);
    pre["kv_transfer_params"] = json!({"do_remote_decode": true, "kv_transport": "shm"});
    complete(p, &pre, &[]).await["kv_transfer_params"].clone()
}

fn decode_body(params: &Value) -> Value {
    let mut d = request(PROMPT);
    d["kv_transfer_params"] = params.clone();
    d
}

/// A decode of `params` is refused at once with 410 naming `state`.
async fn assert_refused_at_once(d: &Proc, params: &Value, state: &str) {
    let t = Instant::now();
    let (status, text) = post(&d.url("/v1/completions"), &decode_body(params), &[]).await;
    let took = t.elapsed();
    assert_eq!(status, 410, "{text}");
    assert!(took < Duration::from_secs(3), "refused after {took:?}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["error"]["code"], format!("kv_handle_{state}"), "{v}");
    assert_eq!(v["error"]["param"], "kv_transfer_params", "{v}");
}

#[tokio::test]
async fn used_handles_are_refused_at_once_and_a_release_frees_shm_unpulled() {
    let _serial = SERIAL.lock().await;
    let env = Env::new();
    let p = env.worker("prefill", "prefill", &[]);
    let d = env.worker("decode", "decode", &[]);

    // Consumed, then re-sent.
    let params = prefill(&p).await;
    complete(&d, &decode_body(&params), &[]).await;
    assert_eq!(env.shm_files(), 0, "the decode released its cache");
    assert_eq!(env.busy_slots(), 0, "and its arena slot");
    assert_refused_at_once(&d, &params, "consumed").await;
    assert_eq!(metric(&d, "rngd_pd_worker_kv_loads_total").await, 1.0);
    assert_eq!(metric(&d, "rngd_pd_worker_in_flight").await, 0.0);

    // Released without a decode: the shm file goes, nothing is loaded.
    let params = prefill(&p).await;
    assert_eq!((env.shm_files(), env.busy_slots()), (1, 1));
    let mut release = decode_body(&params);
    release["kv_transfer_params"]["release_only"] = json!(true);
    let (status, text) = post(&d.url("/v1/completions"), &release, &[]).await;
    assert_eq!(status, 200, "{text}");
    let a: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(a["previous_state"], "unused", "{a}");
    assert_eq!(env.shm_files(), 0, "released");
    assert_eq!(env.busy_slots(), 0, "its slot freed");
    assert_refused_at_once(&d, &params, "released").await;
    assert_eq!(metric(&d, "rngd_pd_worker_kv_loads_total").await, 1.0);

    // A normal PD request still works.
    let params = prefill(&p).await;
    let r = complete(&d, &decode_body(&params), &[]).await;
    assert_eq!(r["choices"][0]["finish_reason"], "length", "{r}");
    assert_eq!(metric(&d, "rngd_pd_worker_kv_loads_total").await, 2.0);
}

/// Well over the default policy's 32 tokens: disaggregated.
const LONG: &str = "Write a long story about a lighthouse keeper who finds a message in a \
    bottle washed up on the rocks one stormy night, and what he decides to do about \
    it over the following weeks, as the storms return, the supply boat fails to \
    arrive, and the villagers on the mainland begin to wonder why his lamp burns \
    a different colour every third night.";

#[tokio::test]
async fn abandoned_pd_requests_through_the_gateway_leave_no_slot_taken() {
    let _serial = SERIAL.lock().await;
    let env = Env::new();
    let p = env.worker("prefill", "prefill", &[]);
    let d = env.worker("decode", "decode", &["--max-in-flight", "4"]);
    let module = rngd_policy_host::built_module("pd_default", "wasm32-unknown-unknown");
    let gw = Proc::start(
        "gateway",
        env.dir.path(),
        &[
            "gateway",
            "--listen",
            "127.0.0.1:0",
            "--prefill",
            &format!("http://{}", p.addr),
            "--decode",
            &format!("http://{}", d.addr),
            "--policy",
            &module.display().to_string(),
        ],
        &env.envs,
        "rngd-pd gateway listening on ",
    );
    let url = gw.addr.clone();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !client()
        .get(format!("{url}/health"))
        .send()
        .await
        .is_ok_and(|r| r.status() == 200)
    {
        assert!(Instant::now() < deadline, "gateway never healthy");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let models: Value = client()
        .get(format!("{url}/v1/models"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let name = models["data"][0]["id"].as_str().unwrap().to_string();
    // Control: the prompt is disaggregated.
    let body = json!({"model": name, "prompt": LONG, "max_tokens": 2, "temperature": 0});
    let (status, text) = post(&format!("{url}/v1/completions"), &body, &[]).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(metric(&d, "rngd_pd_worker_kv_loads_total").await, 1.0);

    // Eight requests abandoned while their 400-token decode runs, each once
    // its KV was loaded.
    let impatient = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(20))
        .build()
        .unwrap();
    let long = json!({"model": name, "prompt": LONG, "max_tokens": 400, "temperature": 0, "ignore_eos": true});
    for i in 0..8 {
        let loads = metric(&d, "rngd_pd_worker_kv_loads_total").await;
        let call = impatient
            .post(format!("{url}/v1/completions"))
            .json(&long)
            .send();
        let watch = async {
            let deadline = Instant::now() + Duration::from_secs(15);
            while metric(&d, "rngd_pd_worker_kv_loads_total").await <= loads {
                assert!(Instant::now() < deadline, "abandon {i}: no KV loaded");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        tokio::select! {
            r = call => panic!("abandon {i}: answered before its decode ran: {r:?}"),
            () = watch => {}
        }
    }
    // What was left: no decode slot held, no cache in shm.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let in_flight = metric(&d, "rngd_pd_worker_in_flight").await;
        if in_flight == 0.0 && env.shm_files() == 0 && env.busy_slots() == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "after the abandons: {in_flight} decode slots taken, {} caches in shm, {} arena slots busy",
            env.shm_files(),
            env.busy_slots()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A normal request is served, not refused for load.
    let (status, text) = post(&format!("{url}/v1/completions"), &body, &[]).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(
        metric(&d, "rngd_pd_worker_overload_rejections_total").await,
        0.0
    );
    assert_eq!(metric(&d, "rngd_pd_worker_kv_loads_total").await, 10.0);
}
