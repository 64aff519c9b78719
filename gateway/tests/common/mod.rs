//! The gateway's test cluster: two real worker servers (`rngd_worker::serve`
//! on the `EchoEngine` test double, sharing one in-memory KV transport), each
//! behind a [`Tap`] that records what the gateway sent and can fail or hang on
//! demand, and the default policy's own logic run natively
//! ([`rngd_pool::pick::NativePolicy`]) with switchable faults ([`TestPolicy`]).
#![allow(dead_code)]

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures::{Stream, StreamExt};
use http_body_util::BodyExt;
use rngd_api::openai::{CompletionRequest, ErrorBody};
use rngd_engine::fake::EchoEngine;
use rngd_gateway::{BoxError, Gateway, GatewayConfig};
use rngd_kv_transport::fake::MemoryTransport;
use rngd_kv_transport::{KvError, KvTransport};
use rngd_policy_core::{Decision, LocalResponse, PolicyConfig, Role};
use rngd_policy_host::PolicyRequest;
use rngd_pool::pick::NativePolicy;
use rngd_pool::source::{self as endpoints, EndpointSource};
use rngd_pool::{HttpFetcher, Policy, PolicyFailure, ScrapedEndpoints, StaticEndpoints};
use rngd_worker::{RunningWorker, TransportFactory, Transports, WorkerConfig};
use serde_json::Value;

/// How a tapped worker misbehaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mode {
    /// Passes every request to the worker.
    #[default]
    Ok,
    /// Answers 500 itself.
    Fail,
    /// Never answers.
    Hang,
}

/// What the gateway sends one worker, recorded on the way through.
#[derive(Debug, Default)]
pub struct Tap {
    pub mode: Mutex<Mode>,
    /// The last completion request body.
    pub last_request: Mutex<Option<CompletionRequest>>,
    /// Whether any request carried `x-prefiller-host-port`.
    pub saw_prefiller_header: AtomicBool,
    /// The header names of every completion request, in order.
    pub header_names: Mutex<Vec<String>>,
    /// Streamed answers the gateway is reading now.
    pub active_streams: AtomicUsize,
    /// Streamed answers the gateway dropped before their end.
    pub cancelled_streams: AtomicUsize,
    upstream: String,
    client: reqwest::Client,
}

impl Tap {
    pub fn set_mode(&self, m: Mode) {
        *self.mode.lock().unwrap() = m;
    }
}

/// Counts a streamed answer while the gateway reads it.
struct Counted<S> {
    inner: S,
    tap: Arc<Tap>,
    ended: bool,
}

impl<S: Stream<Item = reqwest::Result<Bytes>> + Unpin> Stream for Counted<S> {
    type Item = reqwest::Result<Bytes>;
    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        let r = self.inner.poll_next_unpin(cx);
        if let std::task::Poll::Ready(None) = r {
            self.ended = true;
        }
        r
    }
}

impl<S> Drop for Counted<S> {
    fn drop(&mut self) {
        self.tap.active_streams.fetch_sub(1, Ordering::SeqCst);
        if !self.ended {
            self.tap.cancelled_streams.fetch_add(1, Ordering::SeqCst);
        }
    }
}

fn error(status: StatusCode, msg: &str) -> Response {
    (
        status,
        axum::Json(ErrorBody::new("server_error", msg).with_code("tap")),
    )
        .into_response()
}

async fn tap(State(t): State<Arc<Tap>>, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let bytes = body
        .collect()
        .await
        .map(|c| c.to_bytes())
        .unwrap_or_default();
    let path = parts.uri.path().to_string();
    if path == "/v1/completions" {
        if parts
            .headers
            .contains_key(rngd_api::headers::PREFILLER_HOST_PORT)
        {
            t.saw_prefiller_header.store(true, Ordering::SeqCst);
        }
        t.header_names
            .lock()
            .unwrap()
            .extend(parts.headers.keys().map(|k| k.as_str().to_string()));
        *t.last_request.lock().unwrap() = serde_json::from_slice(&bytes).ok();
        let mode = *t.mode.lock().unwrap();
        match mode {
            Mode::Ok => {}
            Mode::Fail => return error(StatusCode::INTERNAL_SERVER_ERROR, "injected failure"),
            Mode::Hang => futures::future::pending::<()>().await,
        }
    }
    let mut up = t
        .client
        .request(parts.method, format!("{}{}", t.upstream, path))
        .body(bytes);
    for (k, v) in &parts.headers {
        if k != axum::http::header::HOST && k != axum::http::header::CONTENT_LENGTH {
            up = up.header(k, v);
        }
    }
    let resp = match up.send().await {
        Ok(r) => r,
        Err(e) => return error(StatusCode::BAD_GATEWAY, &e.to_string()),
    };
    let mut out = Response::builder().status(resp.status().as_u16());
    for (k, v) in resp.headers() {
        out = out.header(k, v);
    }
    let streamed = resp
        .headers()
        .get(axum::http::header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
    let body = if streamed {
        t.active_streams.fetch_add(1, Ordering::SeqCst);
        Body::from_stream(Counted {
            inner: Box::pin(resp.bytes_stream()),
            tap: t.clone(),
            ended: false,
        })
    } else {
        Body::from(resp.bytes().await.unwrap_or_default())
    };
    out.body(body).unwrap()
}

/// Every transport name resolves to the one shared in-memory transport.
pub struct Shared(pub Arc<MemoryTransport>);

impl TransportFactory for Shared {
    fn create(&self, _name: &str) -> Result<Arc<dyn KvTransport>, KvError> {
        Ok(self.0.clone())
    }
}

/// A real worker on the echo engine, and its tap in front.
pub async fn spawn_worker(
    role: Role,
    kv: Arc<MemoryTransport>,
    token_delay: Duration,
) -> (RunningWorker, Arc<Tap>, String) {
    spawn_worker_serving(role, kv, token_delay, FAKE_TOKENIZER.model).await
}

/// [`spawn_worker`] serving `model` besides the echo engine's own name (the
/// gateway's tokenizer's name).
pub async fn spawn_worker_serving(
    role: Role,
    kv: Arc<MemoryTransport>,
    token_delay: Duration,
    model: &str,
) -> (RunningWorker, Arc<Tap>, String) {
    let model = model.to_string();
    spawn_worker_with(role, kv, token_delay, move |c| {
        c.model_aliases = vec![model]
    })
    .await
}

/// [`spawn_worker`] with its configuration changed by `tweak`.
pub async fn spawn_worker_with(
    role: Role,
    kv: Arc<MemoryTransport>,
    token_delay: Duration,
    tweak: impl FnOnce(&mut WorkerConfig),
) -> (RunningWorker, Arc<Tap>, String) {
    let engine = Arc::new(EchoEngine::new(512).with_token_delay(token_delay));
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut config = worker_config(role);
    tweak(&mut config);
    let worker = rngd_worker::serve(l, engine, Transports::new("memory", Shared(kv)), config)
        .await
        .unwrap();
    let t = Arc::new(Tap {
        upstream: worker.url(),
        client: reqwest::Client::new(),
        ..Tap::default()
    });
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let app = Router::new().fallback(tap).with_state(t.clone());
    tokio::spawn(async move { axum::serve(l, app).await.unwrap() });
    (worker, t, addr)
}

/// The echo engine's text for `n` tokens of `prompt`: its bytes, cyclically.
pub fn expected_text(prompt: &str, n: usize) -> String {
    prompt.bytes().cycle().take(n).map(char::from).collect()
}

/// A test worker's configuration: PD on (a test secret), and `fake-model`
/// served besides the echo engine's own name, as the gateway's
/// [`FAKE_TOKENIZER`] serves it (workers and doors serve the same names).
pub fn worker_config(role: Role) -> WorkerConfig {
    let mut config = WorkerConfig::new(role).with_kv_secret(b"test-kv-secret-0123456789abcdef");
    config.model_aliases = vec![FAKE_TOKENIZER.model.to_string()];
    config
}

/// Whitespace "tokenizer" with a ChatML-like template, serving `fake-model`.
pub const FAKE_TOKENIZER: rngd_pool::prompt::WordCounter = rngd_pool::prompt::WordCounter {
    model: "fake-model",
};

/// What the test policy does besides routing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PolicyMode {
    /// The default policy's decision.
    Normal,
    /// Fails as a trapped guest would.
    Trap,
    /// Everything over capacity: 429.
    Busy,
}

/// The default policy's logic (`rngd_policy_core::decide`, natively), with
/// faults injected on demand and every request it saw recorded.
pub struct TestPolicy {
    pub mode: Mutex<PolicyMode>,
    pub seen: Mutex<Vec<PolicyRequest>>,
    inner: NativePolicy,
}

impl TestPolicy {
    /// Prompts of fewer than `threshold` tokens prefill on the decode worker.
    pub fn new(threshold: u64) -> Arc<Self> {
        Arc::new(TestPolicy {
            mode: Mutex::new(PolicyMode::Normal),
            seen: Mutex::new(Vec::new()),
            inner: NativePolicy {
                config: PolicyConfig {
                    disaggregation_threshold_tokens: threshold,
                    same_node_transport: "memory".into(),
                    cross_node_transport: "memory".into(),
                    ..PolicyConfig::default()
                },
            },
        })
    }
}

#[async_trait::async_trait]
impl Policy for TestPolicy {
    async fn decide(&self, req: PolicyRequest) -> Result<Decision, PolicyFailure> {
        self.seen.lock().unwrap().push(req.clone());
        let mode = *self.mode.lock().unwrap();
        match mode {
            PolicyMode::Trap => Err(PolicyFailure {
                status: 500,
                source: BoxError::from("wasm trap: unreachable"),
            }),
            PolicyMode::Busy => Ok(Decision::Reject(LocalResponse {
                status: 429,
                body: serde_json::to_vec(&ErrorBody::new(
                    "rate_limit_error",
                    "all endpoints are over their queue limit",
                ))
                .unwrap(),
                headers: vec![],
            })),
            PolicyMode::Normal => self.inner.decide(req).await,
        }
    }
}

/// A gateway over two tapped workers.
pub struct Cluster {
    pub url: String,
    pub gw: Arc<Gateway>,
    pub prefill: Arc<Tap>,
    pub decode: Arc<Tap>,
    pub prefill_worker: RunningWorker,
    pub decode_worker: RunningWorker,
    pub kv: Arc<MemoryTransport>,
    pub policy: Arc<TestPolicy>,
}

impl Cluster {
    /// Prefills the prefill worker ran.
    pub fn prefills(&self) -> u64 {
        self.prefill_worker.state.metrics().prefills.get()
    }

    /// Decodes from a pulled KV the decode worker ran.
    pub fn decodes(&self) -> u64 {
        self.decode_worker.state.metrics().kv_loads.get()
    }

    /// Whole requests the decode worker prefilled itself.
    pub fn local_prefills(&self) -> u64 {
        self.decode_worker.state.metrics().prefills.get()
    }
}

/// An endpoint table over `eps`, scraped once, that can serve (a healthy
/// decode endpoint); panics otherwise.
pub async fn scraped_servable(eps: Vec<rngd_policy_core::Endpoint>) -> Arc<ScrapedEndpoints> {
    let table = ScrapedEndpoints::new(
        StaticEndpoints::new(eps),
        Arc::new(HttpFetcher::new(Duration::from_secs(2)).unwrap()),
        Duration::from_secs(30),
        None,
    );
    table.scrape_all().await;
    assert!(
        rngd_pool::can_serve(&table.snapshot()),
        "decode worker not scraped healthy"
    );
    table
}

pub async fn cluster(config: GatewayConfig, token_delay: Duration) -> Cluster {
    cluster_with(config, token_delay, |_| {}).await
}

/// [`cluster`] with both workers' configuration changed by `tweak`.
pub async fn cluster_with(
    config: GatewayConfig,
    token_delay: Duration,
    tweak: impl Fn(&mut WorkerConfig),
) -> Cluster {
    let kv = Arc::new(MemoryTransport::new());
    let (prefill_worker, prefill, pa) =
        spawn_worker_with(Role::Prefill, kv.clone(), token_delay, &tweak).await;
    let (decode_worker, decode, da) =
        spawn_worker_with(Role::Decode, kv.clone(), token_delay, &tweak).await;
    let transports = ["memory".to_string()];
    let eps = vec![
        endpoints::local_endpoint(pa, Role::Prefill, 64, &transports),
        endpoints::local_endpoint(da, Role::Decode, 64, &transports),
    ];
    let table = scraped_servable(eps).await;
    let policy = TestPolicy::new(4);
    let edge = config.edge.clone();
    let gw = Gateway::new(
        config,
        rngd_pool::Picker::new(policy.clone(), table),
        Arc::new(FAKE_TOKENIZER),
    )
    .unwrap();
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    let app = rngd_gateway::router(gw.clone());
    // Served as `rngd-pd gateway` serves it: under the listener limits.
    tokio::spawn(rngd_gateway::serve(l, app, edge, std::future::pending()));
    Cluster {
        url,
        gw,
        prefill,
        decode,
        prefill_worker,
        decode_worker,
        kv,
        policy,
    }
}

pub fn client() -> reqwest::Client {
    reqwest::Client::new()
}

pub const LONG: &str = "one two three four five six";

/// Asserts an OpenAI-style error body and returns its message.
pub async fn error_of(resp: reqwest::Response, status: u16) -> String {
    assert_eq!(resp.status().as_u16(), status, "unexpected status");
    let v: Value = resp.json().await.expect("error body is JSON");
    let e = &v["error"];
    assert!(
        e["message"].as_str().is_some_and(|m| !m.is_empty()),
        "no message: {v}"
    );
    assert!(e["type"].as_str().is_some(), "no type: {v}");
    e["message"].as_str().unwrap().to_string()
}

pub async fn sse_events(resp: reqwest::Response) -> Vec<String> {
    assert_eq!(resp.status(), 200);
    assert!(
        resp.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    let text = resp.text().await.unwrap();
    text.split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .map(str::to_string)
        .collect()
}

/// The gateway's `/metrics` page.
pub async fn metrics(url: &str) -> String {
    client()
        .get(format!("{url}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// The value of one sample (`name` with its label set, if any), if present.
pub fn sample(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(' ')))
        .map(|v| v.trim().parse().unwrap())
}
