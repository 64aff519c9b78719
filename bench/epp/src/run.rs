//! The measured run: the trivial backend and the picker on runtimes of
//! their own, Envoy started on the rendered config, requests alternating
//! between the two listeners, and the report.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;

use rngd_ext_proc::metrics::EppMetrics;
use rngd_ext_proc::picker::Picker;
use rngd_ext_proc::server::{self, GrpcServing, ServerConfig};
use rngd_ext_proc::tls::TlsChoice;
use rngd_policy_core::{Endpoint, Role, Vendor};
use rngd_policy_host::{PolicyRuntime, PolicySource, SandboxLimits};
use rngd_pool::{Policy, StaticEndpoints};

use crate::envoy::{
    Child, Variant, apply_variant, bench_config, envoy_counters, epp_tls_handshakes, find_envoy,
};
use crate::profile::{TimedPolicy, percentile, read_profile, round3, spread};
use crate::{BenchError, Options, Report, io};

const COMPLETION: &str = r#"{"id":"cmpl-bench","object":"text_completion","created":0,"model":"bench","choices":[{"index":0,"text":" ok","logprobs":null,"finish_reason":"length"}],"usage":{"prompt_tokens":4,"completion_tokens":1,"total_tokens":5}}"#;

/// Starts the trivial backend on `rt` (its own threads, as a separate model
/// server process would have).
async fn start_backend(rt: &tokio::runtime::Handle) -> Result<SocketAddr, BenchError> {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(io("bind backend"))?;
    let addr = l.local_addr().map_err(io("backend address"))?;
    let app = axum::Router::new()
        .route("/v1/completions", axum::routing::post(completion))
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
        // Like every listener of ours (and vLLM's uvicorn): without
        // TCP_NODELAY a stream's later small chunks wait for Envoy's delayed ACK
        // of the first (~40 ms each).
        use axum::serve::ListenerExt;
        let l = l.tap_io(|tcp| {
            if let Err(e) = tcp.set_nodelay(true) {
                tracing::warn!(error = %e, "bench backend TCP_NODELAY");
            }
        });
        if let Err(e) = axum::serve(l, app).await {
            tracing::error!(error = %e, "bench backend stopped");
        }
    });
    Ok(addr)
}

/// The backend's answer: [`COMPLETION`], or a completion stream when the
/// request asks for one (the first token's chunk at once, three more 1 ms
/// apart, as a fast decode would send them, then `[DONE]`).
async fn completion(body: String) -> axum::response::Response {
    use axum::response::IntoResponse;
    if !body.contains(r#""stream":true"#) {
        return ([("content-type", "application/json")], COMPLETION).into_response();
    }
    let chunks = futures::stream::unfold(0u32, |i| async move {
        if i > 4 {
            return None;
        }
        if i > 0 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let data = if i == 4 {
            "data: [DONE]\n\n".to_string()
        } else {
            format!(
                "data: {{\"id\":\"cmpl-bench\",\"object\":\"text_completion\",\"created\":0,\"model\":\"bench\",\"choices\":[{{\"index\":0,\"text\":\" t{i}\",\"finish_reason\":null}}]}}\n\n"
            )
        };
        Some((Ok::<_, std::convert::Infallible>(data), i + 1))
    });
    (
        [("content-type", "text/event-stream")],
        axum::body::Body::from_stream(chunks),
    )
        .into_response()
}

fn free_port() -> Result<u16, BenchError> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(io("pick a free port"))?;
    Ok(l.local_addr().map_err(io("free port address"))?.port())
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

/// Runs the benchmark and prints progress lines and the JSON report (last line).
pub async fn run(args: Options) -> Result<Report, BenchError> {
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

    let policy = rngd_policy_host::locate::default_module(args.policy.as_deref())?;

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
        let tls_choice = if args.plaintext {
            TlsChoice::Plaintext
        } else {
            TlsChoice::SelfSigned
        };
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
                    weight_version: None,
                }]);
                let metrics = EppMetrics::new().map_err(|source| BenchError::Epp { source })?;
                let policy: Arc<dyn Policy> = if profile {
                    Arc::new(TimedPolicy {
                        inner: runtime,
                        us: decide_us,
                    })
                } else {
                    runtime
                };
                let picker = Picker::new(rngd_pool::Picker::new(policy, endpoints), None, metrics);
                let config = ServerConfig {
                    tls: tls_choice
                        .start()
                        .map_err(|source| BenchError::Epp { source })?,
                    ..ServerConfig::loopback()
                };
                server::start_with(Arc::new(picker), config, serving)
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
            &bench_config(
                epp_listen,
                direct_listen,
                admin,
                epp.grpc_addr,
                backend,
                !args.plaintext,
            ),
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

    let body = if args.stream {
        r#"{"model":"bench","prompt":"Say hello to the benchmark","max_tokens":4,"stream":true}"#
    } else {
        r#"{"model":"bench","prompt":"Say hello to the benchmark","max_tokens":1}"#
    };
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
        "bench epp: envoy {envoy_version} (--concurrency {concurrency}), trivial backend at {backend}, picker at {} ({} ext_proc threads, {}), {} warm-up + {} requests per path{}{}{}",
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
        if args.stream {
            ", streamed (timed to the first chunk)"
        } else {
            ""
        },
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
            // Timed to the first body chunk when streamed, else to the end.
            let mut first = None;
            let mut bytes = Vec::new();
            let mut chunks = r.bytes_stream();
            while let Some(c) = chunks.next().await {
                let c = c.map_err(|source| BenchError::Http {
                    url: url.clone(),
                    source,
                })?;
                if first.is_none() && !c.is_empty() {
                    first = Some(t.elapsed());
                }
                bytes.extend_from_slice(&c);
            }
            let took = if args.stream {
                first.unwrap_or_else(|| t.elapsed())
            } else {
                t.elapsed()
            };
            let ms = took.as_secs_f64() * 1e3;
            let text = String::from_utf8_lossy(&bytes).into_owned();
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
    let tls_handshakes = epp_tls_handshakes(&client, admin).await;
    if !args.plaintext && tls_handshakes.unwrap_or(0) == 0 {
        return Err(BenchError::Missing(format!(
            "TLS to the picker was asked for, but Envoy counts {tls_handshakes:?} \
             handshakes with it (cluster.epp.ssl.handshake)"
        )));
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
        epp_tls: !args.plaintext,
        epp_tls_handshakes: tls_handshakes,
        measured: if args.stream {
            "first_chunk"
        } else {
            "whole_response"
        },
        loadavg_1m_start: load_start,
        loadavg_1m_end: loadavg(),
        direct_p50_ms: round3(d50),
        direct_p99_ms: round3(d99),
        epp_p50_ms: round3(e50),
        epp_p99_ms: round3(e99),
        added_p50_ms: round3(e50 - d50),
        added_p99_ms: round3(e99 - d99),
        target_added_p99_ms: 1.0,
        profile,
    };
    println!("{}", serde_json::to_string(&report).unwrap_or_default());
    Ok(report)
}
