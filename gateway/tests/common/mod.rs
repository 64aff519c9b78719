//! Test fakes for the gateway: a worker that speaks the PD protocol with an
//! in-memory KV store, a native policy and a whitespace tokenizer.
#![allow(dead_code)]

use std::collections::HashSet;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use rngd_api::openai::{
    CompletionChoice, CompletionRequest, CompletionResponse, ErrorBody, Prompt, Timings, Usage,
};
use rngd_api::pd::KvTransferParams;
use rngd_gateway::{BoxError, Gateway, GatewayConfig};
use rngd_kv_wire::{Dtype, KvHandle, KvLayout};
use rngd_policy_core::{Decision, LocalResponse, Role, Route};
use rngd_policy_host::PolicyRequest;
use rngd_pool::source::{self as endpoints, EndpointSource};
use rngd_pool::{HttpFetcher, Policy, PolicyFailure, ScrapedEndpoints, StaticEndpoints};

/// How a fake worker misbehaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mode {
    /// Works.
    #[default]
    Ok,
    /// Answers 500.
    Fail,
    /// Never answers.
    Hang,
}

/// Shared state of the fake cluster's KV store (what a transport would hold).
#[derive(Debug, Default)]
pub struct KvStore {
    pub handles: Mutex<HashSet<String>>,
    pub next: AtomicU64,
}

/// A fake worker.
pub struct FakeWorker {
    pub role: Role,
    pub kv: Arc<KvStore>,
    pub mode: Mutex<Mode>,
    /// Delay between streamed tokens.
    pub token_delay: Duration,
    pub prefills: AtomicUsize,
    pub decodes: AtomicUsize,
    pub local_prefills: AtomicUsize,
    pub active_streams: AtomicUsize,
    pub cancelled_streams: AtomicUsize,
    pub last_request: Mutex<Option<CompletionRequest>>,
    pub saw_prefiller_header: AtomicBool,
}

impl FakeWorker {
    pub fn new(role: Role, kv: Arc<KvStore>, token_delay: Duration) -> Arc<Self> {
        Arc::new(FakeWorker {
            role,
            kv,
            mode: Mutex::new(Mode::Ok),
            token_delay,
            prefills: AtomicUsize::new(0),
            decodes: AtomicUsize::new(0),
            local_prefills: AtomicUsize::new(0),
            active_streams: AtomicUsize::new(0),
            cancelled_streams: AtomicUsize::new(0),
            last_request: Mutex::new(None),
            saw_prefiller_header: AtomicBool::new(false),
        })
    }

    pub fn set_mode(&self, m: Mode) {
        *self.mode.lock().unwrap() = m;
    }
}

/// Deterministic "model": token i of a prompt is `(len(prompt words) * 7 + i) % 50 + 100`,
/// its text `t{id} `.
pub fn fake_tokens(prompt: &Prompt, n: usize) -> Vec<u32> {
    let words = match prompt {
        Prompt::Text(t) => t.split_whitespace().count(),
        Prompt::Tokens(t) => t.len(),
        _ => 1,
    } as u32;
    (0..n as u32).map(|i| (words * 7 + i) % 50 + 100).collect()
}

pub fn token_text(id: u32) -> String {
    format!("t{id} ")
}

fn error(status: StatusCode, msg: &str) -> Response {
    (
        status,
        axum::Json(ErrorBody::new(
            ErrorBody::kind_for_status(status.as_u16()),
            msg,
        )),
    )
        .into_response()
}

fn metrics_text(w: &FakeWorker) -> String {
    format!(
        "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 0\n# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running {}\n# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc 0.0\n",
        w.active_streams.load(Ordering::SeqCst)
    )
}

struct StreamGuard(Arc<FakeWorker>, bool);
impl Drop for StreamGuard {
    fn drop(&mut self) {
        self.0.active_streams.fetch_sub(1, Ordering::SeqCst);
        if !self.1 {
            self.0.cancelled_streams.fetch_add(1, Ordering::SeqCst);
        }
    }
}

async fn completions(
    State(w): State<Arc<FakeWorker>>,
    headers: axum::http::HeaderMap,
    axum::Json(req): axum::Json<CompletionRequest>,
) -> Response {
    if headers.contains_key(rngd_api::headers::PREFILLER_HOST_PORT) {
        w.saw_prefiller_header.store(true, Ordering::SeqCst);
    }
    *w.last_request.lock().unwrap() = Some(req.clone());
    let mode = *w.mode.lock().unwrap();
    match mode {
        Mode::Fail => return error(StatusCode::INTERNAL_SERVER_ERROR, "engine exploded"),
        Mode::Hang => {
            tokio::time::sleep(Duration::from_secs(3600)).await;
        }
        Mode::Ok => {}
    }
    let max = req.sampling.max_tokens.unwrap_or(16) as usize;
    let tokens = fake_tokens(&req.prompt, max);
    let prompt_len = match &req.prompt {
        Prompt::Text(t) => t.split_whitespace().count(),
        Prompt::Tokens(t) => t.len(),
        _ => 0,
    } as u32;
    let params = req.kv_transfer_params.clone().unwrap_or_default();
    if params.do_remote_decode {
        if w.role != Role::Prefill {
            return error(StatusCode::BAD_REQUEST, "not a prefill worker");
        }
        w.prefills.fetch_add(1, Ordering::SeqCst);
        let id = format!("kv{}", w.kv.next.fetch_add(1, Ordering::SeqCst));
        w.kv.handles.lock().unwrap().insert(id.clone());
        let handle = KvHandle {
            request_id: id,
            transport: params.kv_transport.clone().unwrap_or_else(|| "shm".into()),
            location: "/fake".into(),
            layout: KvLayout {
                layers: 1,
                kv_heads: 1,
                head_dim: 2,
                seq_len: 8,
                dtype: Dtype::Bf16,
            },
            tokens: prompt_len as usize,
            blobs: vec![],
        };
        let resp = CompletionResponse {
            id: "prefill-x".into(),
            object: "text_completion".into(),
            created: 0,
            model: req.model.clone(),
            choices: vec![CompletionChoice {
                index: 0,
                text: token_text(tokens[0]),
                logprobs: None,
                finish_reason: Some("length".into()),
                token_ids: Some(vec![tokens[0]]),
            }],
            usage: Some(Usage::new(prompt_len, 1)),
            kv_transfer_params: Some(KvTransferParams {
                do_remote_prefill: true,
                kv_handle: Some(handle),
                first_token: Some(tokens[0]),
                prompt_token_ids: Some((0..prompt_len).collect()),
                prefill_ms: Some(3.0),
                kv_save_ms: Some(1.5),
                ..Default::default()
            }),
            timings: None,
        };
        return axum::Json(resp).into_response();
    }
    if w.role == Role::Prefill {
        return error(StatusCode::BAD_REQUEST, "a prefill worker only prefills");
    }
    let mut kv_load = None;
    if params.do_remote_prefill {
        let Some(h) = params.kv_handle.as_ref() else {
            return error(StatusCode::BAD_REQUEST, "no kv_handle");
        };
        if !w.kv.handles.lock().unwrap().remove(&h.request_id) {
            return error(StatusCode::BAD_GATEWAY, "KV pull failed: no such handle");
        }
        if params.first_token != Some(tokens[0]) {
            return error(StatusCode::BAD_REQUEST, "first token mismatch");
        }
        w.decodes.fetch_add(1, Ordering::SeqCst);
        kv_load = Some(0.5);
    } else {
        w.local_prefills.fetch_add(1, Ordering::SeqCst);
    }
    let usage = Usage::new(prompt_len, tokens.len() as u32);
    let timings = Timings {
        ttft_ms: Some(2.0),
        kv_load_ms: kv_load,
        ..Default::default()
    };
    if !req.sampling.stream {
        let text: String = tokens.iter().map(|t| token_text(*t)).collect();
        let resp = CompletionResponse {
            id: "worker-id".into(),
            object: "text_completion".into(),
            created: 0,
            model: "worker-model".into(),
            choices: vec![CompletionChoice {
                index: 0,
                text,
                logprobs: None,
                finish_reason: Some("length".into()),
                token_ids: Some(tokens),
            }],
            usage: Some(usage),
            kv_transfer_params: None,
            timings: Some(timings),
        };
        return axum::Json(resp).into_response();
    }
    let include_usage = req
        .sampling
        .stream_options
        .as_ref()
        .is_some_and(|o| o.include_usage);
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, Infallible>>(1);
    w.active_streams.fetch_add(1, Ordering::SeqCst);
    let w2 = w.clone();
    let delay = w.token_delay;
    tokio::spawn(async move {
        let mut guard = StreamGuard(w2, false);
        let n = tokens.len();
        for (i, t) in tokens.iter().enumerate() {
            let last = i + 1 == n;
            let chunk = serde_json::json!({
                "id": "worker-id", "object": "text_completion", "created": 0, "model": "worker-model",
                "choices": [{"index": 0, "text": token_text(*t), "logprobs": null,
                    "finish_reason": if last { Some("length") } else { None }, "token_ids": [t]}],
                "timings": if last { Some(timings) } else { None },
            });
            if tx
                .send(Ok(Bytes::from(format!("data: {chunk}\n\n"))))
                .await
                .is_err()
            {
                return;
            }
            if !last {
                tokio::time::sleep(delay).await;
            }
        }
        if include_usage {
            let chunk = serde_json::json!({"id": "worker-id", "object": "text_completion", "created": 0,
                "model": "worker-model", "choices": [], "usage": usage});
            if tx
                .send(Ok(Bytes::from(format!("data: {chunk}\n\n"))))
                .await
                .is_err()
            {
                return;
            }
        }
        if tx
            .send(Ok(Bytes::from_static(b"data: [DONE]\n\n")))
            .await
            .is_ok()
        {
            guard.1 = true;
        }
        // The receiver (the HTTP body) may still be flushing: wait until it is gone.
        tx.closed().await;
        guard.1 = true;
    });
    let body = Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx));
    let mut resp = Response::new(body);
    resp.headers_mut()
        .insert("content-type", "text/event-stream".parse().unwrap());
    resp
}

/// Starts a fake worker on 127.0.0.1:0.
pub async fn spawn_worker(w: Arc<FakeWorker>) -> SocketAddr {
    let app = Router::new()
        .route("/v1/completions", post(completions))
        .route(
            "/metrics",
            get(|State(w): State<Arc<FakeWorker>>| async move { metrics_text(&w) }),
        )
        .with_state(w);
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(l, app).await.unwrap() });
    addr
}

/// Whitespace "tokenizer" with a ChatML-like template, serving `fake-model`.
pub const FAKE_TOKENIZER: rngd_pool::prompt::WordCounter = rngd_pool::prompt::WordCounter {
    model: "fake-model",
};

/// What the fake policy does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PolicyMode {
    /// Routes like the default policy (simplified).
    Normal,
    /// Fails as a trapped guest would.
    Trap,
    /// Everything over capacity: 429.
    Busy,
}

/// A native stand-in for the wasm default policy.
pub struct FakePolicy {
    pub mode: Mutex<PolicyMode>,
    /// Prompts shorter than this prefill on the decode worker.
    pub threshold: usize,
    pub seen: Mutex<Vec<PolicyRequest>>,
}

impl FakePolicy {
    pub fn new(threshold: usize) -> Arc<Self> {
        Arc::new(FakePolicy {
            mode: Mutex::new(PolicyMode::Normal),
            threshold,
            seen: Mutex::new(Vec::new()),
        })
    }
}

fn reject(status: u16, body: ErrorBody) -> Decision {
    Decision::Reject(LocalResponse {
        status,
        body: serde_json::to_vec(&body).unwrap(),
        headers: vec![],
    })
}

#[async_trait::async_trait]
impl Policy for FakePolicy {
    async fn decide(&self, req: PolicyRequest) -> Result<Decision, PolicyFailure> {
        self.decide_inner(req).map_err(|source| PolicyFailure {
            status: 500,
            source,
        })
    }
}

impl FakePolicy {
    fn decide_inner(&self, req: PolicyRequest) -> Result<Decision, BoxError> {
        self.seen.lock().unwrap().push(req.clone());
        let mode = *self.mode.lock().unwrap();
        match mode {
            PolicyMode::Trap => return Err("wasm trap: unreachable".into()),
            PolicyMode::Busy => {
                return Ok(reject(
                    429,
                    ErrorBody::new(
                        "rate_limit_error",
                        "all endpoints are over their queue limit",
                    ),
                ));
            }
            PolicyMode::Normal => {}
        }
        let body: serde_json::Value = serde_json::from_slice(&req.body)?;
        let max_tokens = body["max_tokens"].as_u64().unwrap_or(16) as usize;
        let prompt = req.prompt_tokens.ok_or("no prompt_tokens")?;
        let eps = req.endpoints.unwrap_or_default();
        let decode = eps
            .iter()
            .find(|e| e.healthy && matches!(e.role, Role::Decode | Role::Solo));
        let Some(decode) = decode else {
            return Ok(reject(
                503,
                ErrorBody::new("server_error", "no healthy decode endpoint"),
            ));
        };
        if prompt + max_tokens > decode.seq_len as usize {
            let msg = rngd_api::openai::context_length_message(
                prompt,
                max_tokens,
                decode.seq_len as usize,
            );
            return Ok(reject(
                400,
                ErrorBody::new("invalid_request_error", msg)
                    .with_code(rngd_api::openai::CONTEXT_LENGTH_CODE),
            ));
        }
        let prefill = if prompt >= self.threshold {
            eps.iter()
                .find(|e| e.healthy && e.role == Role::Prefill)
                .map(|e| e.address.clone())
        } else {
            None
        };
        let kv_transport = prefill.as_ref().map(|_| "shm".to_string());
        Ok(Decision::Route(Route {
            decode: decode.address.clone(),
            prefill,
            kv_transport,
            headers: vec![],
        }))
    }
}

/// A gateway over fake workers.
pub struct Cluster {
    pub url: String,
    pub gw: Arc<Gateway>,
    pub prefill: Arc<FakeWorker>,
    pub decode: Arc<FakeWorker>,
    pub kv: Arc<KvStore>,
    pub policy: Arc<FakePolicy>,
}

pub async fn cluster(config: GatewayConfig, token_delay: Duration) -> Cluster {
    let kv = Arc::new(KvStore::default());
    let prefill = FakeWorker::new(Role::Prefill, kv.clone(), token_delay);
    let decode = FakeWorker::new(Role::Decode, kv.clone(), token_delay);
    let pa = spawn_worker(prefill.clone()).await;
    let da = spawn_worker(decode.clone()).await;
    let eps = vec![
        endpoints::local_endpoint(pa.to_string(), Role::Prefill, 64, &["shm".to_string()]),
        endpoints::local_endpoint(da.to_string(), Role::Decode, 64, &["shm".to_string()]),
    ];
    let table = ScrapedEndpoints::new(
        StaticEndpoints::new(eps),
        Arc::new(HttpFetcher::new(Duration::from_secs(2)).unwrap()),
        Duration::from_secs(30),
        None,
    );
    table.scrape_all().await;
    assert!(
        rngd_pool::can_serve(&table.snapshot()),
        "fake decode worker not scraped healthy"
    );
    let policy = FakePolicy::new(4);
    let gw = Gateway::new(
        config,
        rngd_pool::Picker::new(policy.clone(), table),
        Arc::new(FAKE_TOKENIZER),
    )
    .unwrap();
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    let app = rngd_gateway::router(gw.clone());
    tokio::spawn(async move { axum::serve(l, app).await.unwrap() });
    Cluster {
        url,
        gw,
        prefill,
        decode,
        kv,
        policy,
    }
}
