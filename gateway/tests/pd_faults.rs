//! PD faults at the gateway (rows of the fault suite: what the client saw,
//! what was left, whether a normal request still works):
//!
//! - non-streamed PD requests abandoned after their prefill, over and over,
//!   against a decode worker with 4 slots: no slot stays taken, no KV stays
//!   in the transport, no decode is re-sent (nothing pulled twice), and a
//!   normal request afterwards is served (not 429);
//! - a bad prefill answer gets one verdict (`rngd_api::pd::decode_request_from`)
//!   through the gateway's two-step flow and through a decode worker's
//!   `x-prefiller-host-port` path alike;
//! - client-sent steering headers reach neither a worker nor the policy;
//! - KV gone before the decode's pull: refused at once, and the request is
//!   recomputed on the decode worker with the same tokens (or, with
//!   `kv_load_failure_policy` `fail`, answered with an error, never other
//!   tokens).
//!
//! Real worker servers (`rngd_worker::serve`, echo engine) over an in-memory
//! transport that counts its pulls, on 127.0.0.1:0.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::State;
use axum::response::IntoResponse;
use bytes::Bytes;
use common::{FAKE_TOKENIZER, LONG, TestPolicy, client, cluster};
use rngd_engine::fake::EchoEngine;
use rngd_gateway::{Gateway, GatewayConfig};
use rngd_kv_transport::fake::MemoryTransport;
use rngd_kv_transport::{KvError, KvPayload, KvTransport};
use rngd_kv_wire::KvHandle;
use rngd_policy_core::Role;
use rngd_pool::StaticEndpoints;
use rngd_pool::source as endpoints;
use rngd_worker::{RunningWorker, Transports, WorkerConfig};
use serde_json::{Value, json};

/// The in-memory transport, counting pulls; while `lose` is set, the KV of
/// a decode's pull is gone (its TTL passed, the holder restarted).
#[derive(Default)]
struct Counting {
    mem: MemoryTransport,
    pulls: AtomicUsize,
    lose: std::sync::atomic::AtomicBool,
}

#[async_trait::async_trait]
impl KvTransport for Counting {
    fn name(&self) -> &'static str {
        self.mem.name()
    }
    async fn push(&self, payload: KvPayload) -> Result<KvHandle, KvError> {
        self.mem.push(payload).await
    }
    async fn pull(&self, handle: &KvHandle, timeout: Duration) -> Result<Vec<Bytes>, KvError> {
        self.pulls.fetch_add(1, Ordering::SeqCst);
        self.mem.pull(handle, timeout).await
    }
    async fn pull_published(
        &self,
        handle: &KvHandle,
        timeout: Duration,
    ) -> Result<Vec<Bytes>, KvError> {
        self.pulls.fetch_add(1, Ordering::SeqCst);
        if self.lose.load(Ordering::SeqCst) {
            self.mem.release(handle).await?;
        }
        self.mem.pull_published(handle, timeout).await
    }
    async fn release(&self, handle: &KvHandle) -> Result<(), KvError> {
        self.mem.release(handle).await
    }
}

async fn worker(
    role: Role,
    kv: &Arc<Counting>,
    token_delay: Duration,
    tweak: impl FnOnce(&mut WorkerConfig),
) -> RunningWorker {
    let mut config = common::worker_config(role);
    tweak(&mut config);
    let engine = Arc::new(EchoEngine::new(512).with_token_delay(token_delay));
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let t: Arc<dyn KvTransport> = kv.clone();
    rngd_worker::serve(l, engine, Transports::fixed(vec![t]), config)
        .await
        .unwrap()
}

/// A gateway routing over `prefill` and `decode` (addresses) with the
/// default policy's logic (prompts of 4+ words are disaggregated).
async fn gateway(prefill: String, decode: String) -> String {
    gateway_with(prefill, decode, GatewayConfig::default()).await
}

/// [`gateway`] with `config`.
async fn gateway_with(prefill: String, decode: String, config: GatewayConfig) -> String {
    let transports = ["memory".to_string()];
    let eps = vec![
        endpoints::local_endpoint(prefill, Role::Prefill, 512, &transports),
        endpoints::local_endpoint(decode, Role::Decode, 512, &transports),
    ];
    let gw = Gateway::new(
        config,
        rngd_pool::Picker::new(TestPolicy::new(4), StaticEndpoints::new(eps)),
        Arc::new(FAKE_TOKENIZER),
    )
    .unwrap();
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    let app = rngd_gateway::router(gw);
    tokio::spawn(async move { axum::serve(l, app).await.unwrap() });
    url
}

async fn wait_for(limit: Duration, what: &str, mut done: impl AsyncFnMut() -> bool) {
    let start = Instant::now();
    while !done().await {
        assert!(start.elapsed() < limit, "{what}: not within {limit:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `POST {url}/v1/completions` with `body`.
async fn complete(url: &str, body: &Value) -> reqwest::Response {
    client()
        .post(format!("{url}/v1/completions"))
        .json(body)
        .send()
        .await
        .unwrap()
}

#[tokio::test]
async fn abandoned_pd_requests_leave_no_slot_taken() {
    let kv = Arc::new(Counting::default());
    let p = worker(Role::Prefill, &kv, Duration::ZERO, |_| {}).await;
    // Few slots, the default 30 s pull timeout, decodes of 200 tokens that
    // take 4 s: every request below is abandoned while its decode runs.
    let d = worker(Role::Decode, &kv, Duration::from_millis(20), |c| {
        c.max_in_flight = 4
    })
    .await;
    let url = gateway(p.addr.to_string(), d.addr.to_string()).await;
    let impatient = reqwest::Client::builder()
        .timeout(Duration::from_millis(250))
        .build()
        .unwrap();
    let body = json!({"model": "fake-model", "prompt": LONG, "max_tokens": 200});
    // 20 abandons, two at a time.
    for _ in 0..10 {
        let send = || {
            impatient
                .post(format!("{url}/v1/completions"))
                .json(&body)
                .send()
        };
        let (a, b) = tokio::join!(send(), send());
        for r in [a, b] {
            let e = r.expect_err("the client gives up before the answer");
            assert!(e.is_timeout(), "{e}");
        }
    }
    // What was left: no slot taken (a re-sent decode would hold one for the
    // 30 s pull timeout), no KV.
    let s = d.state.clone();
    wait_for(Duration::from_secs(5), "slots and KV freed", async || {
        s.metrics().in_flight.get() == 0.0 && kv.mem.held() == 0
    })
    .await;
    assert_eq!(p.state.metrics().prefills.get(), 20);
    assert_eq!(
        kv.pulls.load(Ordering::SeqCst),
        20,
        "one pull per request: no decode was re-sent"
    );
    // A normal request is served.
    let r = complete(
        &url,
        &json!({"model": "fake-model", "prompt": LONG, "max_tokens": 3}),
    )
    .await;
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    let m = common::metrics(&d.url()).await;
    assert_eq!(
        common::sample(&m, "rngd_pd_worker_overload_rejections_total"),
        Some(0.0)
    );
    assert_eq!(
        common::sample(&m, "rngd_pd_worker_requests_total{status=\"410\"}"),
        None,
        "no decode of a used handle was sent"
    );
    assert_eq!(kv.mem.held(), 0);
}

/// A prefill worker that answers whatever the test sets.
async fn fake_prefill(answer: Arc<Mutex<Vec<u8>>>) -> String {
    async fn reply(State(a): State<Arc<Mutex<Vec<u8>>>>) -> axum::response::Response {
        let body = a.lock().unwrap().clone();
        ([("content-type", "application/json")], body).into_response()
    }
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let app = Router::new().fallback(reply).with_state(answer);
    tokio::spawn(async move { axum::serve(l, app).await.unwrap() });
    addr
}

fn answer(params: Value) -> Vec<u8> {
    let mut a = json!({
        "id": "cmpl-x", "object": "text_completion", "created": 1, "model": "echo",
        "choices": [{"index": 0, "text": "o", "token_ids": [111], "finish_reason": "length", "logprobs": null}],
    });
    if !params.is_null() {
        a["kv_transfer_params"] = params;
    }
    serde_json::to_vec(&a).unwrap()
}

#[tokio::test]
async fn a_bad_prefill_answer_has_one_verdict_at_both_orchestrators() {
    let kv = Arc::new(Counting::default());
    let body = Arc::new(Mutex::new(Vec::new()));
    let fake = fake_prefill(body.clone()).await;
    let allow = fake.clone();
    let d = worker(Role::Decode, &kv, Duration::ZERO, move |c| {
        c.prefill_allow = allow.parse().unwrap()
    })
    .await;
    let url = gateway(fake.clone(), d.addr.to_string()).await;
    let handle = json!({
        "request_id": "0123456789abcdef0123456789abcdef", "transport": "memory",
        "location": "memory", "tokens": 3, "blobs": [],
        "layout": {"layers": 1, "kv_heads": 1, "head_dim": 4, "seq_len": 8, "dtype": "bf16"}
    });
    let rows: Vec<(&str, Vec<u8>)> = vec![
        ("not JSON", b"<html>oops</html>".to_vec()),
        ("no kv_transfer_params", answer(Value::Null)),
        (
            "missing flag",
            answer(json!({"kv_handle": handle, "first_token": 111})),
        ),
        (
            "missing handle",
            answer(json!({"do_remote_prefill": true, "first_token": 111})),
        ),
        (
            "flag of the wrong type",
            answer(json!({"do_remote_prefill": "yes", "kv_handle": handle, "first_token": 111})),
        ),
        (
            "handle of the wrong type",
            answer(json!({"do_remote_prefill": true, "kv_handle": [1, 2], "first_token": 111})),
        ),
    ];
    let original: rngd_api::openai::CompletionRequest =
        serde_json::from_value(json!({"model": "echo", "prompt": LONG})).unwrap();
    for (what, bad) in rows {
        let verdict = rngd_api::pd::decode_request_from(&original, &bad)
            .expect_err(what)
            .to_string();
        *body.lock().unwrap() = bad;
        let req = json!({"model": "fake-model", "prompt": LONG, "max_tokens": 3});
        // Through the gateway's two-step flow.
        let r = complete(&url, &req).await;
        let gw_msg = common::error_of(r, 502).await;
        // Through the decode worker's x-prefiller-host-port path.
        let r = client()
            .post(format!("{}/v1/completions", d.url()))
            .header("x-prefiller-host-port", &fake)
            .json(&json!({"model": "echo", "prompt": LONG, "max_tokens": 3}))
            .send()
            .await
            .unwrap();
        let worker_msg = common::error_of(r, 502).await;
        for (door, msg) in [("gateway", &gw_msg), ("worker", &worker_msg)] {
            assert!(
                msg.contains(&verdict),
                "{what} at the {door}: {msg:?} lacks {verdict:?}"
            );
        }
    }
    // Nothing was pulled, and the decode worker still serves.
    assert_eq!(kv.pulls.load(Ordering::SeqCst), 0);
    let r = client()
        .post(format!("{}/v1/completions", d.url()))
        .json(&json!({"model": "echo", "prompt": LONG, "max_tokens": 3}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
}

#[tokio::test]
async fn client_steering_headers_reach_no_worker_and_no_policy() {
    let c = cluster(GatewayConfig::default(), Duration::ZERO).await;
    let steering = [
        ("x-gateway-destination-endpoint", "127.0.0.1:9"),
        ("x-gateway-destination-endpoint-subset", "127.0.0.1:9"),
        ("x-prefiller-host-port", "127.0.0.1:9"),
        ("x-rngd-pd-kv-transport", "carrier-pigeon"),
    ];
    for (prompt, stream) in [(LONG, false), (LONG, true), ("hi", false)] {
        let mut r = client().post(format!("{}/v1/completions", c.url)).json(
            &json!({"model": "fake-model", "prompt": prompt, "max_tokens": 3, "stream": stream}),
        );
        for (k, v) in steering {
            r = r.header(k, v);
        }
        let resp = r.send().await.unwrap();
        assert_eq!(resp.status(), 200, "{prompt:?}");
        resp.bytes().await.unwrap();
    }
    // Routed as without the headers: the long prompts prefilled remotely,
    // the short one on the decode worker.
    assert_eq!(c.prefills(), 2);
    assert_eq!(c.decodes(), 2);
    assert_eq!(c.local_prefills(), 1);
    for (name, tap) in [("prefill", &c.prefill), ("decode", &c.decode)] {
        let seen = tap.header_names.lock().unwrap().clone();
        assert!(!seen.is_empty(), "{name} saw no request");
        for (k, _) in steering {
            assert!(!seen.iter().any(|h| h == k), "{name} worker got {k}");
        }
    }
    for req in c.policy.seen.lock().unwrap().iter() {
        for (k, _) in steering {
            assert!(
                !req.headers.iter().any(|(h, _)| h.eq_ignore_ascii_case(k)),
                "the policy saw {k}"
            );
        }
    }
}

/// A prefill worker switched to a shorter variant since the gateway last
/// looked (its endpoint still says 512) refuses a prompt as too long: the
/// gateway lets the decode worker, which the policy found it fits, prefill
/// it, says so in the route reason and a counter, and nothing is pulled.
#[tokio::test]
async fn a_prefill_refused_for_its_length_falls_back_to_the_decode_worker() {
    let kv = Arc::new(Counting::default());
    let p = worker(Role::Prefill, &kv, Duration::ZERO, |_| {}).await;
    let allow = p.addr.to_string();
    let d = worker(Role::Decode, &kv, Duration::ZERO, move |c| {
        c.prefill_allow = allow.parse().unwrap()
    })
    .await;
    let url = gateway(p.addr.to_string(), d.addr.to_string()).await;
    let body = json!({"model": "fake-model", "prompt": LONG, "max_tokens": 5, "temperature": 0});
    let r = complete(&url, &body).await;
    assert_eq!(r.status(), 200);
    assert_eq!(kv.pulls.load(Ordering::SeqCst), 1, "disaggregated first");

    p.state
        .replace_variant(Arc::new(EchoEngine::new(16)))
        .unwrap();
    assert!(LONG.len() + 5 > 16);
    let r = complete(&url, &body).await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.headers()[rngd_api::headers::ROUTE_REASON],
        "prefill_context_fallback"
    );
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["choices"][0]["text"], common::expected_text(LONG, 5));
    assert_eq!(kv.pulls.load(Ordering::SeqCst), 1, "nothing more pulled");
    let m = common::metrics(&url).await;
    assert_eq!(
        common::sample(&m, "rngd_pd_gateway_prefill_context_fallbacks_total"),
        Some(1.0),
        "{m}"
    );

    // The header path (x-prefiller-host-port to the decode worker) falls
    // back the same way: the decode worker prefills, nothing is pulled.
    let direct = |prompt: String| {
        client()
            .post(format!("{}/v1/completions", d.url()))
            .header("x-prefiller-host-port", p.addr.to_string())
            .json(&json!({"model": "echo", "prompt": prompt, "max_tokens": 5, "temperature": 0}))
            .send()
    };
    let r = direct(LONG.to_string()).await.unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["choices"][0]["text"], common::expected_text(LONG, 5));
    assert_eq!(kv.pulls.load(Ordering::SeqCst), 1, "nothing more pulled");
    let m = common::metrics(&d.url()).await;
    assert_eq!(
        common::sample(&m, "rngd_pd_worker_prefill_context_fallbacks_total"),
        Some(1.0),
        "{m}"
    );
    // A prompt the decode worker cannot hold either: its own refusal.
    let e = common::error_of(direct("x".repeat(600)).await.unwrap(), 400).await;
    assert!(e.contains("context length of 512"), "{e}");
    // A prompt the peer holds is still prefilled there.
    p.state
        .replace_variant(Arc::new(EchoEngine::new(512)))
        .unwrap();
    let r = direct(LONG.to_string()).await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(kv.pulls.load(Ordering::SeqCst), 2, "disaggregated again");
}

#[tokio::test]
async fn kv_gone_before_the_pull_is_recomputed_with_the_same_tokens_or_failed() {
    let kv = Arc::new(Counting::default());
    let p = worker(Role::Prefill, &kv, Duration::ZERO, |_| {}).await;
    let d = worker(Role::Decode, &kv, Duration::ZERO, |_| {}).await;
    let url = gateway(p.addr.to_string(), d.addr.to_string()).await;
    let body = json!({"model": "fake-model", "prompt": LONG, "max_tokens": 8, "temperature": 0.9});
    let text = |v: &Value| v["choices"][0]["text"].as_str().unwrap().to_string();
    // Seeded and unseeded: the recompute continues the prefill's stream.
    for seed in [Some(7), None] {
        let mut body = body.clone();
        if let Some(s) = seed {
            body["seed"] = json!(s);
        }
        kv.lose.store(false, Ordering::SeqCst);
        let r = complete(&url, &body).await;
        assert_eq!(r.status(), 200);
        let want: Value = r.json().await.unwrap();
        kv.lose.store(true, Ordering::SeqCst);
        let t = Instant::now();
        let r = complete(&url, &body).await;
        assert_eq!(r.status(), 200);
        let got: Value = r.json().await.unwrap();
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
        if seed.is_some() {
            assert_eq!(
                text(&got),
                text(&want),
                "a seeded recompute equals the PD answer"
            );
        }
        assert_eq!(got["usage"]["completion_tokens"], 8);
    }
    let m = common::metrics(&url).await;
    assert_eq!(
        common::sample(
            &m,
            "rngd_pd_gateway_kv_load_failures_total{policy=\"recompute\"}"
        ),
        Some(2.0),
        "{m}"
    );
    let dm = common::metrics(&d.url()).await;
    assert_eq!(
        common::sample(
            &dm,
            "rngd_pd_worker_kv_load_failures_total{reason=\"not_found\"}"
        ),
        Some(2.0)
    );
    assert_eq!(kv.mem.held(), 0);

    // `fail`: an error naming the cause, never another answer.
    let config = GatewayConfig {
        kv_load_failure_policy: rngd_api::pd::KvLoadFailurePolicy::Fail,
        ..GatewayConfig::default()
    };
    let url = gateway_with(p.addr.to_string(), d.addr.to_string(), config).await;
    let r = complete(&url, &body).await;
    let status = r.status().as_u16();
    let text = r.text().await.unwrap();
    assert!(status >= 500, "{status} {text}");
    assert!(
        text.contains("kv_unavailable") || text.contains("not available"),
        "{text}"
    );
    let m = common::metrics(&url).await;
    assert_eq!(
        common::sample(
            &m,
            "rngd_pd_gateway_kv_load_failures_total{policy=\"fail\"}"
        ),
        Some(1.0)
    );
    kv.lose.store(false, Ordering::SeqCst);
    assert_eq!(kv.mem.held(), 0);
}

/// A decode worker that answers every request 503 (restarted and still
/// loading its model), counting them, on an address that sorts before
/// `before` (the policy breaks a tie between idle workers by address, so
/// it is picked first).
async fn unavailable_decode(hits: Arc<AtomicUsize>, before: &str) -> String {
    async fn reply(State(h): State<Arc<AtomicUsize>>) -> axum::response::Response {
        h.fetch_add(1, Ordering::SeqCst);
        let body = json!({"error": {"message": "the model is still loading", "type": "server_error", "param": null, "code": null}});
        (
            axum::http::StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(body),
        )
            .into_response()
    }
    let (l, addr) = loop {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        if addr.as_str() < before {
            break (l, addr);
        }
    };
    let app = Router::new().fallback(reply).with_state(hits);
    tokio::spawn(async move { axum::serve(l, app).await.unwrap() });
    addr
}

#[tokio::test]
async fn a_decode_worker_answering_503_has_its_requests_served_by_another() {
    let kv = Arc::new(Counting::default());
    let p = worker(Role::Prefill, &kv, Duration::ZERO, |_| {}).await;
    let d = worker(Role::Decode, &kv, Duration::ZERO, |_| {}).await;
    let hits = Arc::new(AtomicUsize::new(0));
    let loading = unavailable_decode(hits.clone(), &d.addr.to_string()).await;
    let transports = ["memory".to_string()];
    let eps = vec![
        endpoints::local_endpoint(p.addr.to_string(), Role::Prefill, 512, &transports),
        endpoints::local_endpoint(loading.clone(), Role::Decode, 512, &transports),
        endpoints::local_endpoint(d.addr.to_string(), Role::Decode, 512, &transports),
    ];
    let gw = Gateway::new(
        GatewayConfig::default(),
        rngd_pool::Picker::new(TestPolicy::new(4), StaticEndpoints::new(eps)),
        Arc::new(FAKE_TOKENIZER),
    )
    .unwrap();
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(l, rngd_gateway::router(gw)).await.unwrap() });
    // Short prompts (served whole) and long ones (a PD route).
    for prompt in ["hi there", LONG, "hi there", LONG, "hi there", LONG] {
        let r = complete(
            &url,
            &json!({"model": "fake-model", "prompt": prompt, "max_tokens": 3}),
        )
        .await;
        assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    }
    assert!(
        hits.load(Ordering::SeqCst) >= 1,
        "the policy never picked the loading worker"
    );
    let m = common::metrics(&url).await;
    let moved = common::sample(
        &m,
        "rngd_pd_gateway_migrations_total{outcome=\"continued\"}",
    );
    assert!(moved.is_some_and(|n| n >= 1.0), "{m}");
    // The KV of a PD route the loading worker never read is released.
    wait_for(Duration::from_secs(5), "KV released", async || {
        kv.mem.held() == 0
    })
    .await;
}
