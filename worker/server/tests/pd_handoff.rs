//! A KV handle serves one decode (rows of the fault suite): a second decode
//! of a handle the decode worker consumed, or of one released without a
//! decode (`release_only`, what an orchestrator sends when its client went
//! away), is refused at once with a 410 naming the handle's state — nothing
//! pulled, no slot held for the pull timeout — and a normal request still
//! works. A release needs the signed handle. In-process workers on
//! 127.0.0.1:0 with the echo engine over a transport that counts its pulls.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{metrics, sample};
use rngd_api::openai::{CompletionResponse, ErrorBody};
use rngd_api::pd::{HandleState, KvReleaseAnswer, KvTransferParams};
use rngd_engine::Engine;
use rngd_engine::fake::EchoEngine;
use rngd_kv_transport::fake::MemoryTransport;
use rngd_kv_transport::{KvError, KvPayload, KvTransport};
use rngd_kv_wire::KvHandle;
use rngd_worker::{Role, RunningWorker, Transports, WorkerConfig};
use serde_json::{Value, json};

/// The in-memory transport, counting pulls.
#[derive(Default)]
struct Counting {
    mem: MemoryTransport,
    pulls: AtomicUsize,
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
        self.mem.pull_published(handle, timeout).await
    }
    async fn release(&self, handle: &KvHandle) -> Result<(), KvError> {
        self.mem.release(handle).await
    }
}

async fn start(role: Role, kv: &Arc<Counting>) -> RunningWorker {
    // The default 30 s pull timeout: a refusal "at once" is far under it.
    let config = WorkerConfig::new(role).with_kv_secret(b"test-kv-secret-0123456789abcdef");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let engine: Arc<dyn Engine> = Arc::new(EchoEngine::new(64));
    let t: Arc<dyn KvTransport> = kv.clone();
    rngd_worker::serve(listener, engine, Transports::fixed(vec![t]), config)
        .await
        .unwrap()
}

async fn post(w: &RunningWorker, body: &Value) -> (u16, String) {
    let resp = reqwest::Client::new()
        .post(format!("{}/v1/completions", w.url()))
        .json(body)
        .send()
        .await
        .unwrap();
    (resp.status().as_u16(), resp.text().await.unwrap())
}

fn request() -> Value {
    json!({"model": "echo", "prompt": "a handle for one decode", "max_tokens": 4, "temperature": 0})
}

async fn prefill(w: &RunningWorker) -> KvTransferParams {
    let mut body = request();
    body["kv_transfer_params"] = json!({"do_remote_decode": true});
    let (status, text) = post(w, &body).await;
    assert_eq!(status, 200, "{text}");
    let r: CompletionResponse = serde_json::from_str(&text).unwrap();
    r.kv_transfer_params.unwrap()
}

async fn decode(w: &RunningWorker, params: &KvTransferParams) -> (u16, String) {
    let mut body = request();
    body["kv_transfer_params"] = serde_json::to_value(params).unwrap();
    post(w, &body).await
}

fn releasing(params: &KvTransferParams) -> KvTransferParams {
    KvTransferParams {
        release_only: true,
        ..params.clone()
    }
}

/// A 410 at once (the pull timeout is 30 s): the OpenAI body with `code`,
/// `param` `kv_transfer_params` and a message holding every one of `says`.
async fn assert_gone_at_once(
    w: &RunningWorker,
    params: &KvTransferParams,
    code: &str,
    says: &[&str],
) {
    let t = Instant::now();
    let (status, text) = decode(w, params).await;
    let took = t.elapsed();
    assert_eq!(status, 410, "{text}");
    assert!(took < Duration::from_secs(2), "took {took:?}");
    let body: ErrorBody = serde_json::from_str(&text).unwrap();
    assert_eq!(body.error.code.as_deref(), Some(code));
    assert_eq!(body.error.param.as_deref(), Some("kv_transfer_params"));
    assert_eq!(body.error.kind, "invalid_request_error");
    for s in says {
        assert!(body.error.message.contains(s), "{}", body.error.message);
    }
}

/// A refusal of a used handle: 410 at once, the OpenAI body naming the state.
async fn assert_refused_at_once(w: &RunningWorker, params: &KvTransferParams, state: &str) {
    let code = format!("kv_handle_{state}");
    assert_gone_at_once(w, params, &code, &[state, "nothing was pulled"]).await;
}

#[tokio::test]
async fn a_consumed_handle_is_refused_at_once_without_a_pull() {
    let kv = Arc::new(Counting::default());
    let p = start(Role::Prefill, &kv).await;
    let d = start(Role::Decode, &kv).await;
    let params = prefill(&p).await;
    let (status, text) = decode(&d, &params).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(kv.pulls.load(Ordering::SeqCst), 1);
    assert_eq!(kv.mem.held(), 0, "the decode released its KV");

    // Sent again (a retry, an orchestrator's re-send): the KV is gone.
    assert_refused_at_once(&d, &params, "consumed").await;
    assert_eq!(kv.pulls.load(Ordering::SeqCst), 1, "nothing pulled");
    let m = metrics(&d).await;
    assert_eq!(sample(&m, "rngd_pd_worker_in_flight"), 0.0, "no slot held");
    assert_eq!(
        sample(&m, "rngd_pd_worker_requests_total{status=\"410\"}"),
        1.0
    );

    // Releasing it afterwards is harmless and says it was consumed.
    let (status, text) = decode(&d, &releasing(&params)).await;
    assert_eq!(status, 200, "{text}");
    let a: KvReleaseAnswer = serde_json::from_str(&text).unwrap();
    assert_eq!(a.previous_state, HandleState::Consumed);
    assert_eq!(a.object, "kv_release");

    // A normal PD request still works.
    let fresh = prefill(&p).await;
    let (status, text) = decode(&d, &fresh).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(kv.pulls.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn a_released_handle_frees_the_kv_unpulled_and_is_refused_after() {
    let kv = Arc::new(Counting::default());
    let p = start(Role::Prefill, &kv).await;
    let d = start(Role::Decode, &kv).await;
    let params = prefill(&p).await;
    assert_eq!(kv.mem.held(), 1);

    // A release needs the handle as signed: a forged one releases nothing.
    let mut forged = releasing(&params);
    forged.kv_handle_signature = Some("00".repeat(32));
    let (status, text) = decode(&d, &forged).await;
    assert_eq!(status, 400, "{text}");
    assert_eq!(kv.mem.held(), 1, "a forged release left the KV alone");

    let (status, text) = decode(&d, &releasing(&params)).await;
    assert_eq!(status, 200, "{text}");
    let a: KvReleaseAnswer = serde_json::from_str(&text).unwrap();
    assert_eq!(a.previous_state, HandleState::Unused);
    assert_eq!(
        a.kv_key,
        params.kv_handle.as_ref().unwrap().request_id,
        "names the handle's key"
    );
    assert_eq!(kv.mem.held(), 0, "released");
    assert_eq!(kv.pulls.load(Ordering::SeqCst), 0, "without a pull");

    // The decode that comes too late: refused at once, nothing pulled.
    assert_refused_at_once(&d, &params, "released").await;
    assert_eq!(kv.pulls.load(Ordering::SeqCst), 0);
    // A second release: it was released already.
    let (_, text) = decode(&d, &releasing(&params)).await;
    let a: KvReleaseAnswer = serde_json::from_str(&text).unwrap();
    assert_eq!(a.previous_state, HandleState::Released);
    let m = metrics(&d).await;
    assert_eq!(sample(&m, "rngd_pd_worker_in_flight"), 0.0);
    assert_eq!(sample(&m, "rngd_pd_worker_kv_loads_total"), 0.0);
}

#[tokio::test]
async fn concurrent_decodes_of_one_handle_pull_once() {
    let kv = Arc::new(Counting::default());
    let p = start(Role::Prefill, &kv).await;
    let d = start(Role::Decode, &kv).await;
    let params = prefill(&p).await;
    let (a, b) = tokio::join!(decode(&d, &params), decode(&d, &params));
    let mut statuses = [a.0, b.0];
    statuses.sort();
    assert_eq!(statuses, [200, 410], "{a:?} {b:?}");
    assert_eq!(kv.pulls.load(Ordering::SeqCst), 1);
    assert_eq!(kv.mem.held(), 0);
}

/// A 410 `kv_unavailable` at once whose message says `why`.
async fn assert_unavailable_at_once(w: &RunningWorker, params: &KvTransferParams, why: &str) {
    assert_gone_at_once(w, params, rngd_api::pd::KV_UNAVAILABLE_CODE, &[why]).await;
}

#[tokio::test]
async fn kv_the_transport_no_longer_holds_is_refused_at_once() {
    let kv = Arc::new(Counting::default());
    let p = start(Role::Prefill, &kv).await;
    let d = start(Role::Decode, &kv).await;
    let params = prefill(&p).await;
    // The transport lost it (its TTL, a restart): nothing to wait for.
    kv.mem
        .release(params.kv_handle.as_ref().unwrap())
        .await
        .unwrap();
    assert_unavailable_at_once(&d, &params, "no longer holds it").await;
    let m = metrics(&d).await;
    assert_eq!(
        sample(
            &m,
            "rngd_pd_worker_kv_load_failures_total{reason=\"not_found\"}"
        ),
        1.0
    );
    // The next handoff is served.
    let params = prefill(&p).await;
    let (status, text) = decode(&d, &params).await;
    assert_eq!(status, 200, "{text}");
}

#[tokio::test]
async fn an_expired_lease_is_refused_unpulled_and_its_kv_freed() {
    let kv = Arc::new(Counting::default());
    let p = start(Role::Prefill, &kv).await;
    let d = start(Role::Decode, &kv).await;
    let mut params = prefill(&p).await;
    // The same claims under a lease that ended a minute ago, signed with
    // the deployment's key (as a slow orchestrator would present it).
    let signer = rngd_worker::HandleSigner::new(b"test-kv-secret-0123456789abcdef");
    let expires = params.kv_handle_expires_ms.unwrap() - 120_000;
    let claims = rngd_worker::handles::Claims {
        seed: params.seed,
        first_token_logprobs: params.first_token_logprobs.as_ref(),
        cached_tokens: params.cached_tokens,
        weight_version: params.weight_version.as_deref(),
    };
    let signature = signer.sign_with(
        params.kv_handle.as_ref().unwrap(),
        params.first_token.unwrap(),
        params.prompt_token_ids.as_deref().unwrap(),
        expires,
        &claims,
    );
    params.kv_handle_expires_ms = Some(expires);
    params.kv_handle_signature = Some(signature);
    assert_eq!(kv.mem.held(), 1);
    assert_unavailable_at_once(&d, &params, "lease ended").await;
    assert_eq!(kv.pulls.load(Ordering::SeqCst), 0, "nothing pulled");
    assert_eq!(kv.mem.held(), 0, "the expired lease's KV is freed");
    let m = metrics(&d).await;
    assert_eq!(
        sample(
            &m,
            "rngd_pd_worker_kv_load_failures_total{reason=\"expired\"}"
        ),
        1.0
    );
}
