//! The worker's PD edges against a hostile caller (rows of the fault suite):
//! forged, altered, oversized and foreign KV handles are refused with nothing
//! pulled and nothing deleted; request ids that collide or are predicted do
//! not share a cache; a prefill-only request from a client outside the
//! front-door allowlist is refused; a worker without a KV secret does no PD;
//! an oversized body is an OpenAI 413. In-process workers on 127.0.0.1:0 with
//! the echo engine and the in-memory transport.

mod common;

use std::sync::Arc;

use common::{metrics, sample};
use rngd_api::openai::{CompletionResponse, ErrorBody};
use rngd_api::pd::KvTransferParams;
use rngd_engine::Engine;
use rngd_engine::fake::EchoEngine;
use rngd_kv_transport::KvTransport;
use rngd_kv_transport::fake::MemoryTransport;
use rngd_worker::{KvAuth, Role, RunningWorker, Transports, WorkerConfig};
use serde_json::{Value, json};

const SECRET: &[u8] = b"test-kv-secret-0123456789abcdef";

async fn start_with(
    role: Role,
    mem: &Arc<MemoryTransport>,
    tweak: impl FnOnce(&mut WorkerConfig),
) -> RunningWorker {
    start_on(EchoEngine::new(64), role, mem, tweak).await
}

async fn start_on(
    engine: EchoEngine,
    role: Role,
    mem: &Arc<MemoryTransport>,
    tweak: impl FnOnce(&mut WorkerConfig),
) -> RunningWorker {
    let mut config = WorkerConfig::new(role).with_kv_secret(SECRET);
    tweak(&mut config);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let engine: Arc<dyn Engine> = Arc::new(engine);
    let t: Arc<dyn KvTransport> = mem.clone();
    rngd_worker::serve(listener, engine, Transports::fixed(vec![t]), config)
        .await
        .unwrap()
}

async fn post(w: &RunningWorker, body: &Value, id: &str) -> (u16, String) {
    let resp = reqwest::Client::new()
        .post(format!("{}/v1/completions", w.url()))
        .header("x-request-id", id)
        .json(body)
        .send()
        .await
        .unwrap();
    (resp.status().as_u16(), resp.text().await.unwrap())
}

fn request(prompt: &str) -> Value {
    json!({"model": "echo", "prompt": prompt, "max_tokens": 4, "temperature": 0})
}

async fn prefill(w: &RunningWorker, prompt: &str, id: &str) -> KvTransferParams {
    let mut body = request(prompt);
    body["kv_transfer_params"] = json!({"do_remote_decode": true});
    let (status, text) = post(w, &body, id).await;
    assert_eq!(status, 200, "{text}");
    let r: CompletionResponse = serde_json::from_str(&text).unwrap();
    r.kv_transfer_params.unwrap()
}

fn error(status: u16, text: &str) -> (u16, ErrorBody) {
    let body =
        serde_json::from_str(text).unwrap_or_else(|e| panic!("not an error body ({e}): {text}"));
    (status, body)
}

async fn decode(w: &RunningWorker, prompt: &str, params: &KvTransferParams) -> (u16, String) {
    let mut body = request(prompt);
    body["kv_transfer_params"] = serde_json::to_value(params).unwrap();
    post(w, &body, "decode").await
}

async fn kv_loads(w: &RunningWorker) -> f64 {
    sample(&metrics(w).await, "rngd_pd_worker_kv_loads_total")
}

#[tokio::test]
async fn forged_and_altered_handles_are_refused_before_any_pull() {
    let mem = Arc::new(MemoryTransport::new());
    let p = start_with(Role::Prefill, &mem, |_| {}).await;
    let d = start_with(Role::Decode, &mem, |_| {}).await;
    let good = prefill(&p, "Hello, PD world", "f-1").await;
    assert_eq!(mem.held(), 1);

    let mut cases: Vec<(&str, KvTransferParams, &str)> = Vec::new();
    let mut unsigned = good.clone();
    unsigned.kv_handle_signature = None;
    cases.push(("unsigned", unsigned, "missing"));
    let mut garbage = good.clone();
    garbage.kv_handle_signature = Some("00".repeat(32));
    cases.push(("garbage signature", garbage, "does not verify"));
    let mut other_key = good.clone();
    other_key.kv_handle.as_mut().unwrap().request_id = "f-1".into();
    cases.push((
        "key replaced by the client's id",
        other_key,
        "does not verify",
    ));
    let mut other_prompt = good.clone();
    other_prompt.prompt_token_ids.as_mut().unwrap()[0] ^= 1;
    cases.push(("prompt_token_ids altered", other_prompt, "does not verify"));
    let mut first = good.clone();
    first.first_token = Some(first.first_token.unwrap() ^ 1);
    cases.push(("first_token altered", first, "does not verify"));
    let mut other_weights = good.clone();
    other_weights.weight_version = Some("0123456789abcdef".into());
    cases.push(("weight_version altered", other_weights, "does not verify"));
    let mut no_weights = good.clone();
    no_weights.weight_version = None;
    cases.push(("weight_version removed", no_weights, "does not verify"));
    let mut later = good.clone();
    *later.kv_handle_expires_ms.as_mut().unwrap() += 3_600_000;
    cases.push(("expiry extended", later, "does not verify"));
    let mut fan_out = good.clone();
    let h = fan_out.kv_handle.as_mut().unwrap();
    // (100k would not fit the 2 MiB body limit: that is a 413 before any parse.)
    h.blobs = vec![h.blobs[0]; 5_000];
    cases.push(("5k blobs", fan_out, "5000 blobs"));
    let mut huge = good.clone();
    huge.kv_handle.as_mut().unwrap().blobs[0].len = 1 << 40;
    cases.push(("oversized blob", huge, "blob 0 has"));
    // A handle signed by another deployment.
    let mem2 = Arc::new(MemoryTransport::new());
    let foreign_p = start_with(Role::Prefill, &mem2, |c| {
        *c = WorkerConfig::new(Role::Prefill).with_kv_secret(b"another-deployment-secret-xyz");
    })
    .await;
    let foreign = prefill(&foreign_p, "Hello, PD world", "f-2").await;
    cases.push(("another deployment's", foreign, "does not verify"));

    let loads = kv_loads(&d).await;
    for (what, params, needle) in cases {
        let (status, body) = {
            let (s, t) = decode(&d, "Hello, PD world", &params).await;
            error(s, &t)
        };
        assert_eq!(status, 400, "{what}: {body:?}");
        assert_eq!(
            body.error.code.as_deref(),
            Some("invalid_kv_handle"),
            "{what}"
        );
        assert_eq!(
            body.error.param.as_deref(),
            Some("kv_transfer_params"),
            "{what}"
        );
        assert!(
            body.error.message.contains(needle),
            "{what}: {}",
            body.error.message
        );
        assert_eq!(
            body.error.message.matches(needle).count(),
            1,
            "{what}: the cause is said once: {}",
            body.error.message
        );
        assert_eq!(mem.held(), 1, "{what}: nothing deleted");
    }
    assert_eq!(kv_loads(&d).await, loads, "nothing pulled");

    // The genuine handle still works, once.
    let (status, text) = decode(&d, "Hello, PD world", &good).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(mem.held(), 0, "pulled and released");
    assert_eq!(kv_loads(&d).await, loads + 1.0);
}

#[tokio::test]
async fn kv_made_by_other_weights_is_a_409_naming_both_and_is_released_unpulled() {
    let mem = Arc::new(MemoryTransport::new());
    let p = start_with(Role::Prefill, &mem, |_| {}).await;
    let d = start_on(
        EchoEngine::new(64).with_weight_version("fedcba9876543210"),
        Role::Decode,
        &mem,
        |_| {},
    )
    .await;
    let params = prefill(&p, "Hello, PD world", "w-1").await;
    assert_eq!(
        params.weight_version.as_deref(),
        Some(rngd_engine::fake::ECHO_WEIGHT_VERSION)
    );
    assert_eq!(mem.held(), 1);
    let loads = kv_loads(&d).await;
    let (status, body) = {
        let (s, t) = decode(&d, "Hello, PD world", &params).await;
        error(s, &t)
    };
    assert_eq!(status, 409, "{body:?}");
    assert_eq!(
        body.error.code.as_deref(),
        Some(rngd_api::pd::WEIGHT_VERSION_MISMATCH_CODE)
    );
    assert_eq!(body.error.param.as_deref(), Some("kv_transfer_params"));
    let m = &body.error.message;
    assert!(
        m.contains(rngd_engine::fake::ECHO_WEIGHT_VERSION) && m.contains("fedcba9876543210"),
        "{m}"
    );
    assert_eq!(kv_loads(&d).await, loads, "nothing pulled");
    assert_eq!(mem.held(), 0, "the KV is released, not left to its TTL");
    assert_eq!(
        sample(
            &metrics(&d).await,
            "rngd_pd_worker_weight_version_refusals_total"
        ),
        1.0
    );
    // The handle is spent: a retry is a 410, not a second 409 or a pull.
    let (status, text) = decode(&d, "Hello, PD world", &params).await;
    assert_eq!(status, 410, "{text}");

    // A decode worker with the prefill worker's weights takes the next one.
    let same = start_with(Role::Decode, &mem, |_| {}).await;
    let params = prefill(&p, "Hello, PD world", "w-2").await;
    let (status, text) = decode(&same, "Hello, PD world", &params).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(mem.held(), 0);
}

#[tokio::test]
async fn a_prompt_other_than_the_signed_one_is_refused() {
    let mem = Arc::new(MemoryTransport::new());
    let p = start_with(Role::Prefill, &mem, |_| {}).await;
    let d = start_with(Role::Decode, &mem, |_| {}).await;
    let mut params = prefill(&p, "Hello, PD world", "p-1").await;
    // Without prompt_token_ids the decode worker tokenizes the request's
    // prompt, which must be the one the handle was made for.
    params.prompt_token_ids = None;
    let (s, t) = decode(&d, "Hello, PD WORLD", &params).await;
    let (status, body) = error(s, &t);
    assert_eq!(status, 400, "{body:?}");
    assert_eq!(body.error.code.as_deref(), Some("invalid_kv_handle"));
    assert_eq!(mem.held(), 1);
    let (status, text) = decode(&d, "Hello, PD world", &params).await;
    assert_eq!(status, 200, "{text}");
}

#[tokio::test]
async fn colliding_and_predicted_request_ids_do_not_share_a_cache() {
    let mem = Arc::new(MemoryTransport::new());
    let p = start_with(Role::Prefill, &mem, |_| {}).await;
    let d = start_with(Role::Decode, &mem, |_| {}).await;
    // Two requests with one id (and ids that sanitize alike) at once.
    let (a, b, c) = tokio::join!(
        prefill(&p, "first prompt here", "same-id"),
        prefill(&p, "second prompt, other", "same-id"),
        prefill(&p, "third prompt text", "same_id"),
    );
    let keys: Vec<String> = [&a, &b, &c]
        .iter()
        .map(|x| x.kv_handle.as_ref().unwrap().request_id.clone())
        .collect();
    assert_eq!(mem.held(), 3, "three caches, none overwritten");
    assert!(keys[0] != keys[1] && keys[1] != keys[2] && keys[0] != keys[2]);
    assert!(keys.iter().all(|k| !k.contains("same")), "{keys:?}");
    // Each decodes its own prompt.
    for (params, prompt) in [
        (&b, "second prompt, other"),
        (&a, "first prompt here"),
        (&c, "third prompt text"),
    ] {
        let (status, text) = decode(&d, prompt, params).await;
        assert_eq!(status, 200, "{text}");
        let r: CompletionResponse = serde_json::from_str(&text).unwrap();
        assert_eq!(r.choices[0].text, prompt[..4]);
    }
    assert_eq!(mem.held(), 0);
}

#[tokio::test]
async fn prefill_only_requests_come_only_from_the_front_doors() {
    let mem = Arc::new(MemoryTransport::new());
    // This worker's front doors are elsewhere (not loopback): the test client is a stranger.
    let p = start_with(Role::Prefill, &mem, |c| {
        c.front_door_allow = "10.0.0.0/8".parse().unwrap();
    })
    .await;
    let mut body = request("park my KV please");
    body["kv_transfer_params"] = json!({"do_remote_decode": true});
    let (s, t) = post(&p, &body, "stranger").await;
    let (status, err) = error(s, &t);
    assert_eq!(status, 403, "{err:?}");
    assert_eq!(err.error.code.as_deref(), Some("pd_not_allowed"));
    assert!(
        err.error.message.contains("127.0.0.1"),
        "{}",
        err.error.message
    );
    assert_eq!(mem.held(), 0, "no KV parked");
    assert_eq!(
        sample(&metrics(&p).await, "rngd_pd_worker_prefills_total"),
        0.0
    );
    // A solo worker too (it also answers prefill-only requests).
    let solo = start_with(Role::Solo, &mem, |c| {
        c.front_door_allow = "10.0.0.0/8".parse().unwrap();
    })
    .await;
    let (s, _) = post(&solo, &body, "stranger").await;
    assert_eq!(s, 403);
    assert_eq!(mem.held(), 0);
}

#[tokio::test]
async fn without_a_kv_secret_a_worker_does_no_pd() {
    let mem = Arc::new(MemoryTransport::new());
    let solo = start_with(Role::Solo, &mem, |c| c.kv_auth = KvAuth::Off).await;
    let mut body = request("hello");
    body["kv_transfer_params"] = json!({"do_remote_decode": true});
    let (s, t) = post(&solo, &body, "x").await;
    let (status, err) = error(s, &t);
    assert_eq!(status, 403, "{err:?}");
    assert!(
        err.error.message.contains("AIRM_KV_TCP_SECRET"),
        "{}",
        err.error.message
    );
    assert_eq!(mem.held(), 0);
    // Whole requests are served.
    let (s, t) = post(&solo, &request("hello"), "y").await;
    assert_eq!(s, 200, "{t}");
}

#[tokio::test]
async fn an_oversized_body_is_an_openai_413() {
    let mem = Arc::new(MemoryTransport::new());
    let w = start_with(Role::Solo, &mem, |c| c.body_limit = 1024).await;
    let (s, t) = post(&w, &request(&"x".repeat(4096)), "big").await;
    let (status, err) = error(s, &t);
    assert_eq!(status, 413);
    assert_eq!(err.error.code.as_deref(), Some("request_too_large"));
    assert!(err.error.message.contains("1024"), "{}", err.error.message);
    assert_eq!(
        sample(
            &metrics(&w).await,
            "rngd_pd_worker_requests_total{status=\"413\"}"
        ),
        1.0
    );
    let (s, t) = post(&w, &request("small"), "small").await;
    assert_eq!(s, 200, "{t}");
}
