//! `rngd-pd-bench gateway`: the latency the gateway adds (policy + proxying)
//! over calling the decode worker directly.
//!
//! Both paths run in the same process and the same run, against the same
//! in-process decode worker serving a **fake instant engine**
//! (`rngd_engine::fake::EchoEngine`), so the model does not dominate. The
//! gateway runs the real wasm policy module (`pd_default`). Requests are
//! short prompts (under the policy's disaggregation threshold), so both paths
//! do the same worker work: the difference is the gateway alone. Direct and
//! gateway requests alternate, one at a time, after a warm-up.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use rngd_gateway::GatewayConfig;
use rngd_gateway::launch::{
    LaunchOptions, PolicyChoice, ScrapeOptions, SourceChoice, TokenizerChoice,
};
use rngd_policy_core::Role;
use rngd_pool::source as endpoints;
use serde::Serialize;

/// Errors of the benchmark.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The policy module was not found (the error says where it looked).
    #[error(transparent)]
    PolicyMissing(#[from] rngd_policy_host::locate::LocateError),
    /// The in-process worker failed to start.
    #[error("worker: {0}")]
    Worker(String),
    /// The gateway failed to start.
    #[error("gateway: {0}")]
    Gateway(#[from] rngd_gateway::GatewayError),
    /// Binding a listener failed.
    #[error("binding: {0}")]
    Bind(#[source] std::io::Error),
    /// A request failed.
    #[error("{path} request: {source}")]
    Request {
        /// `direct` or `gateway`.
        path: &'static str,
        /// Cause.
        #[source]
        source: reqwest::Error,
    },
    /// A request answered with an error status.
    #[error("{path} request answered {status}: {body}")]
    Status {
        /// `direct` or `gateway`.
        path: &'static str,
        /// Status.
        status: u16,
        /// Body.
        body: String,
    },
    /// The two paths answered differently.
    #[error("gateway and direct answers differ: {0}")]
    Mismatch(String),
}

/// What to run (the flags of `rngd-pd-bench gateway`).
#[derive(Debug, Clone)]
pub struct Options {
    /// Measured requests per path. Default 2000.
    pub requests: usize,
    /// Warm-up requests per path (not measured). Default 200.
    pub warmup: usize,
    /// Tokens generated per request. Default 8.
    pub max_tokens: u32,
    /// Stream the responses (SSE) instead of one JSON body. Default off.
    pub stream: bool,
    /// Policy module. Default `None`: the default module as
    /// [`rngd_policy_host::locate::default_module`] finds it (`$RNGD_PD_POLICY`,
    /// beside the executable, the image path, `$CARGO_TARGET_DIR`).
    pub policy: Option<PathBuf>,
    /// Print only the JSON line. Default off.
    pub json: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            requests: 2000,
            warmup: 200,
            max_tokens: 8,
            stream: false,
            policy: None,
            json: false,
        }
    }
}

/// The result.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// What served the requests (a fake instant engine).
    pub engine: String,
    /// Policy module used by the gateway.
    pub policy: String,
    /// Measured requests per path.
    pub requests: usize,
    /// Tokens generated per request.
    pub max_tokens: u32,
    /// Whether responses were streamed.
    pub stream: bool,
    /// Direct to the decode worker, p50 ms.
    pub direct_p50_ms: f64,
    /// Direct, p99 ms.
    pub direct_p99_ms: f64,
    /// Through the gateway, p50 ms.
    pub gateway_p50_ms: f64,
    /// Through the gateway, p99 ms.
    pub gateway_p99_ms: f64,
    /// gateway_p50 − direct_p50, ms.
    pub added_p50_ms: f64,
    /// gateway_p99 − direct_p99, ms.
    pub added_p99_ms: f64,
    /// The same difference for the time to the first body chunk (with
    /// `--stream`, the first token's chunk: the TTFT the gateway adds), p50 ms.
    pub added_first_chunk_p50_ms: f64,
    /// The same at p99, ms.
    pub added_first_chunk_p99_ms: f64,
    /// The target for `added_p99_ms` (and, streamed, for
    /// `added_first_chunk_p99_ms`): 1 ms whole, 0.5 ms streamed.
    pub target_added_p99_ms: f64,
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn text_of(stream: bool, bytes: &[u8]) -> String {
    if !stream {
        let v: serde_json::Value = serde_json::from_slice(bytes).unwrap_or_default();
        return v["choices"][0]["text"].as_str().unwrap_or("").to_string();
    }
    let mut out = String::new();
    for line in String::from_utf8_lossy(bytes).lines() {
        if let Some(d) = line.strip_prefix("data: ")
            && let Ok(v) = serde_json::from_str::<serde_json::Value>(d)
            && let Some(t) = v["choices"][0]["text"].as_str()
        {
            out.push_str(t);
        }
    }
    out
}

/// One request: its whole time, the time to its first body chunk, its body.
async fn one(
    client: &reqwest::Client,
    path: &'static str,
    url: &str,
    body: &serde_json::Value,
) -> Result<Sample, Error> {
    let t = Instant::now();
    let resp = client
        .post(url)
        .json(body)
        .send()
        .await
        .map_err(|source| Error::Request { path, source })?;
    let status = resp.status().as_u16();
    let mut first = None;
    let mut bytes = Vec::new();
    let mut chunks = resp.bytes_stream();
    while let Some(c) = chunks.next().await {
        let c = c.map_err(|source| Error::Request { path, source })?;
        if first.is_none() && !c.is_empty() {
            first = Some(t.elapsed());
        }
        bytes.extend_from_slice(&c);
    }
    let took = t.elapsed();
    if status != 200 {
        return Err(Error::Status {
            path,
            status,
            body: String::from_utf8_lossy(&bytes).into_owned(),
        });
    }
    Ok(Sample {
        total_ms: took.as_secs_f64() * 1e3,
        first_chunk_ms: first.unwrap_or(took).as_secs_f64() * 1e3,
        body: bytes,
    })
}

/// What one request gave.
struct Sample {
    total_ms: f64,
    first_chunk_ms: f64,
    body: Vec<u8>,
}

/// The samples of one path.
#[derive(Default)]
struct Path {
    total: Vec<f64>,
    first: Vec<f64>,
}

impl Path {
    fn push(&mut self, s: Sample) {
        self.total.push(s.total_ms);
        self.first.push(s.first_chunk_ms);
    }

    fn sort(&mut self) {
        self.total.sort_by(f64::total_cmp);
        self.first.sort_by(f64::total_cmp);
    }
}

/// Runs the benchmark.
pub async fn run(args: Options) -> Result<Report, Error> {
    let policy = rngd_policy_host::locate::default_module(args.policy.as_deref())?;
    // The decode worker, on the fake instant engine.
    let engine = Arc::new(rngd_engine::fake::EchoEngine::new(512));
    let transports =
        rngd_worker::Transports::from_env("shm").map_err(|e| Error::Worker(e.to_string()))?;
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(Error::Bind)?;
    let worker = rngd_worker::serve(
        l,
        engine,
        transports,
        rngd_worker::WorkerConfig::new(rngd_worker::Role::Decode)
            .with_kv_secret(b"test-kv-secret-0123456789abcdef"),
    )
    .await
    .map_err(|e| Error::Worker(e.to_string()))?;
    let worker_addr = worker.addr.to_string();

    let launched = rngd_gateway::launch::launch(LaunchOptions {
        listen: "127.0.0.1:0".into(),
        kpi_listen: None,
        endpoints: SourceChoice::Static(vec![endpoints::local_endpoint(
            worker_addr.clone(),
            Role::Decode,
            512,
            &["shm".into()],
        )]),
        policy: PolicyChoice::Wasm {
            module: policy.clone(),
            config: Vec::new(),
            limits: Default::default(),
            watch_every: None,
        },
        admin_token: None,
        admin_listen: "127.0.0.1:0".parse().unwrap(),
        tokenizer: TokenizerChoice::Custom(Arc::new(rngd_pool::prompt::ByteCounter)),
        config: GatewayConfig::default(),
        scrape: ScrapeOptions {
            every: Some(Duration::from_millis(50)),
            stale_after: Duration::from_secs(2),
            ..ScrapeOptions::default()
        },
        cache: None,
    })
    .await?;
    // Ready once the first scrape has marked the worker healthy.
    if !launched.wait_ready(Duration::from_secs(10)).await {
        return Err(Error::Worker(
            "the gateway never saw the worker healthy (10 s)".into(),
        ));
    }

    let client = reqwest::Client::builder()
        .tcp_nodelay(true)
        .build()
        .map_err(|source| Error::Request {
            path: "client",
            source,
        })?;
    let direct_url = format!("http://{worker_addr}/v1/completions");
    let gateway_url = format!("http://{}/v1/completions", launched.addr);
    let body = serde_json::json!({
        "model": "echo", "prompt": "tiny prompt", "max_tokens": args.max_tokens,
        "temperature": 0, "stream": args.stream,
    });
    // Same answer both ways, or the comparison means nothing.
    let a = one(&client, "direct", &direct_url, &body).await?.body;
    let b = one(&client, "gateway", &gateway_url, &body).await?.body;
    let (ta, tb) = (text_of(args.stream, &a), text_of(args.stream, &b));
    if ta != tb || ta.is_empty() {
        return Err(Error::Mismatch(format!("direct {ta:?} vs gateway {tb:?}")));
    }
    for _ in 0..args.warmup {
        one(&client, "direct", &direct_url, &body).await?;
        one(&client, "gateway", &gateway_url, &body).await?;
    }
    let mut direct = Path::default();
    let mut gateway = Path::default();
    for i in 0..args.requests {
        // Alternate which path goes first so neither gets a systematic edge.
        if i % 2 == 0 {
            direct.push(one(&client, "direct", &direct_url, &body).await?);
            gateway.push(one(&client, "gateway", &gateway_url, &body).await?);
        } else {
            gateway.push(one(&client, "gateway", &gateway_url, &body).await?);
            direct.push(one(&client, "direct", &direct_url, &body).await?);
        }
    }
    direct.sort();
    gateway.sort();
    launched.shutdown();
    let _ = launched.join().await;
    let _ = worker.stop().await;
    let r = |x: f64| (x * 1000.0).round() / 1000.0;
    let report = Report {
        engine: "EchoEngine (fake instant engine: measures the gateway, not a model)".into(),
        policy: policy.display().to_string(),
        requests: args.requests,
        max_tokens: args.max_tokens,
        stream: args.stream,
        direct_p50_ms: r(pct(&direct.total, 50.0)),
        direct_p99_ms: r(pct(&direct.total, 99.0)),
        gateway_p50_ms: r(pct(&gateway.total, 50.0)),
        gateway_p99_ms: r(pct(&gateway.total, 99.0)),
        added_p50_ms: r(pct(&gateway.total, 50.0) - pct(&direct.total, 50.0)),
        added_p99_ms: r(pct(&gateway.total, 99.0) - pct(&direct.total, 99.0)),
        added_first_chunk_p50_ms: r(pct(&gateway.first, 50.0) - pct(&direct.first, 50.0)),
        added_first_chunk_p99_ms: r(pct(&gateway.first, 99.0) - pct(&direct.first, 99.0)),
        target_added_p99_ms: if args.stream { 0.5 } else { 1.0 },
    };
    if !args.json {
        println!("gateway overhead benchmark — engine: {}", report.engine);
        println!("policy module: {}", report.policy);
        println!(
            "{} requests per path, max_tokens {}, stream {}",
            report.requests, report.max_tokens, report.stream
        );
        println!(
            "direct : p50 {:.3} ms  p99 {:.3} ms",
            report.direct_p50_ms, report.direct_p99_ms
        );
        println!(
            "gateway: p50 {:.3} ms  p99 {:.3} ms",
            report.gateway_p50_ms, report.gateway_p99_ms
        );
        println!(
            "added  : p50 {:.3} ms  p99 {:.3} ms (target ≤ {} ms at p99)",
            report.added_p50_ms, report.added_p99_ms, report.target_added_p99_ms
        );
        println!(
            "added to the first chunk: p50 {:.3} ms  p99 {:.3} ms",
            report.added_first_chunk_p50_ms, report.added_first_chunk_p99_ms
        );
    }
    println!("{}", serde_json::to_string(&report).unwrap_or_default());
    Ok(report)
}
