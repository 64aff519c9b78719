//! `rngd-pd bench policy`: policy decision cost in wasm against the same logic
//! compiled natively, in the same run.
//!
//! One decision = HTTP context create + request headers + body + done on a
//! warm instance (the host's per-request work included: header and body copy,
//! snapshot memo lookup); the same request on a fresh instance (instantiate +
//! configure + decide); and [`rngd_policy_core::PdPolicy::decide`] natively
//! with the same inputs. Decisions of both must agree.

use std::path::PathBuf;
use std::time::Instant;

use rngd_api::headers;
use rngd_policy_core::{Decision, Endpoint, PdPolicy, PolicyConfig, Role, Vendor};
use rngd_policy_host::{PolicyError, PolicyRequest, PolicyRuntime, PolicySource, SandboxLimits};
use serde::Serialize;

/// Arguments of `rngd-pd bench policy`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Endpoints in the snapshot.
    #[arg(long, default_value_t = 64)]
    pub endpoints: usize,
    /// Timed decisions per variant (warm wasm, native).
    #[arg(long, default_value_t = 20_000)]
    pub iterations: usize,
    /// Timed decisions on a fresh instance.
    #[arg(long, default_value_t = 300)]
    pub fresh_iterations: usize,
    /// Policy module; default: the built `pd_default.wasm` (wasm32-unknown-unknown).
    #[arg(long)]
    pub module: Option<PathBuf>,
    /// Print only the JSON line.
    #[arg(long)]
    pub json: bool,
}

impl Default for Args {
    fn default() -> Self {
        Args {
            endpoints: 64,
            iterations: 20_000,
            fresh_iterations: 300,
            module: None,
            json: false,
        }
    }
}

/// Errors of the benchmark.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The module was not built.
    #[error("policy module {0} not found: run policies/build.sh first")]
    MissingModule(PathBuf),
    /// The policy runtime failed.
    #[error("policy runtime: {0}")]
    Policy(#[from] PolicyError),
    /// Wasm and native decided differently.
    #[error("wasm and native decisions differ: wasm {wasm:?}, native {native:?}")]
    Mismatch {
        /// Wasm decision.
        wasm: Box<Option<Decision>>,
        /// Native decision.
        native: Box<Option<Decision>>,
    },
    /// A worker thread failed.
    #[error("benchmark thread: {0}")]
    Join(#[from] tokio::task::JoinError),
}

/// Results (µs per decision). Warm wasm and native decisions are timed
/// interleaved, one of each in turn.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Endpoints in the snapshot.
    pub endpoints: usize,
    /// Timed decisions per variant.
    pub iterations: usize,
    /// Warm instance, median.
    pub wasm_p50_us: f64,
    /// Warm instance, 99th percentile.
    pub wasm_p99_us: f64,
    /// Native, median.
    pub native_p50_us: f64,
    /// Native, 99th percentile.
    pub native_p99_us: f64,
    /// `wasm_p99_us / native_p99_us`.
    pub ratio_p99: f64,
    /// Fresh instance per decision, median.
    pub fresh_instance_p50_us: f64,
    /// Fresh instance per decision, 99th percentile.
    pub fresh_instance_p99_us: f64,
    /// SHA-256 of the module.
    pub module_sha256: String,
}

fn snapshot(n: usize) -> Vec<Endpoint> {
    (0..n)
        .map(|i| Endpoint {
            address: format!("10.1.{}.{}:8000", i / 250, i % 250 + 1),
            role: if i % 2 == 0 {
                Role::Decode
            } else {
                Role::Prefill
            },
            vendor: if i % 2 == 0 {
                Vendor::Atom
            } else {
                Vendor::Rngd
            },
            node: format!("node-{}", i / 4),
            seq_len: 4096,
            queue_depth: ((i * 7) % 5) as u32,
            running: ((i * 3) % 8) as u32,
            kv_usage: ((i * 13) % 100) as f64 / 100.0,
            healthy: i % 17 != 5,
            transports: vec!["shm".into(), "tcp".into()],
        })
        .collect()
}

fn request(endpoints: Vec<Endpoint>) -> PolicyRequest {
    let mut hdrs: Vec<(String, String)> = [
        (":method", "POST"),
        (":path", "/v1/chat/completions"),
        (":authority", "gateway.rngd-pd.svc"),
        (":scheme", "http"),
        ("content-type", "application/json"),
        ("accept", "text/event-stream"),
        ("user-agent", "OpenAI/Python 1.57.0"),
        ("authorization", "Bearer sk-bench"),
        (headers::REQUEST_ID, "9f1c1b8e-3a55-4d7e-9d43-2f0d3f5e6a10"),
        ("x-forwarded-for", "10.244.1.17"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    hdrs.truncate(10);
    let body = format!(
        r#"{{"model":"smollm2-135m","messages":[{{"role":"system","content":"You are a helpful assistant."}},{{"role":"user","content":"{}"}}],"max_tokens":128,"temperature":0,"stream":true}}"#,
        "Summarize the benefits of prefill/decode disaggregation for LLM serving. ".repeat(4)
    );
    PolicyRequest {
        headers: hdrs,
        body: body.into_bytes(),
        endpoints: Some(endpoints.into()),
        prompt_tokens: Some(210),
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn timed(
    n: usize,
    mut f: impl FnMut() -> Result<Decision, Error>,
) -> Result<(Vec<f64>, Decision), Error> {
    let mut last = f()?;
    let mut us = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        last = f()?;
        us.push(t.elapsed().as_secs_f64() * 1e6);
    }
    us.sort_by(f64::total_cmp);
    Ok((us, last))
}

/// Runs the benchmark (blocking work on a blocking thread) and prints a
/// summary (unless `--json`) followed by the JSON line.
pub async fn run(args: Args) -> Result<Report, Error> {
    let report =
        tokio::task::spawn_blocking(move || measure(&args).map(|r| (r, args.json))).await??;
    let (report, json) = report;
    if !json {
        println!(
            "policy decision, {} endpoints, {} iterations\n  wasm warm   p50 {:>8.2} us  p99 {:>8.2} us\n  native      p50 {:>8.2} us  p99 {:>8.2} us\n  wasm fresh  p50 {:>8.2} us  p99 {:>8.2} us\n  ratio p99 {:.2}",
            report.endpoints,
            report.iterations,
            report.wasm_p50_us,
            report.wasm_p99_us,
            report.native_p50_us,
            report.native_p99_us,
            report.fresh_instance_p50_us,
            report.fresh_instance_p99_us,
            report.ratio_p99
        );
    }
    println!("{}", serde_json::to_string(&report).unwrap_or_default());
    Ok(report)
}

fn measure(args: &Args) -> Result<Report, Error> {
    let module = match &args.module {
        Some(p) => p.clone(),
        None => rngd_policy_host::find_built_module("pd_default", "wasm32-unknown-unknown")
            .map_err(Error::MissingModule)?,
    };
    if !module.is_file() {
        return Err(Error::MissingModule(module));
    }
    let config = b"{}".to_vec();
    let runtime = PolicyRuntime::new(
        PolicySource {
            module,
            config: config.clone(),
        },
        SandboxLimits {
            instances: 1,
            ..SandboxLimits::default()
        },
    )?;
    let req = request(snapshot(args.endpoints));

    // Native: the same core logic with the same inputs and snapshot caching.
    let mut policy =
        PdPolicy::new(
            PolicyConfig::from_json(&config).map_err(|e| PolicyError::NoDecision {
                detail: e.to_string(),
            })?,
        );
    let json = serde_json::to_vec(req.endpoints.as_deref().unwrap_or_default()).unwrap_or_default();
    let version = b"1".to_vec();
    let mut native_once = || -> Decision {
        let subset = req
            .headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(headers::DESTINATION_ENDPOINT_SUBSET))
            .map(|(_, v)| v.as_str());
        let prompt = req.prompt_tokens.map(|n| n.to_string());
        policy.decide(
            subset,
            Some(&req.body),
            None,
            prompt.as_deref().map(str::as_bytes),
            Some(&version),
            || Some(json.clone()),
        )
    };

    // Warm-up of both (the first decision parses the snapshot).
    for _ in 0..1000 {
        runtime.decide_blocking(&req)?;
        native_once();
    }
    // Timed, interleaved: one wasm decision, one native decision, so both see
    // the same machine load (this host is shared and noisy).
    let mut wasm = Vec::with_capacity(args.iterations);
    let mut native = Vec::with_capacity(args.iterations);
    let mut wasm_decision = None;
    let mut native_decision = None;
    for _ in 0..args.iterations {
        let t = Instant::now();
        let d = runtime.decide_blocking(&req)?;
        wasm.push(t.elapsed().as_secs_f64() * 1e6);
        wasm_decision = Some(d);
        let t = Instant::now();
        let d = native_once();
        native.push(t.elapsed().as_secs_f64() * 1e6);
        native_decision = Some(d);
    }
    wasm.sort_by(f64::total_cmp);
    native.sort_by(f64::total_cmp);
    let (fresh, _) = timed(args.fresh_iterations, || Ok(runtime.decide_fresh(&req)?))?;
    if wasm_decision != native_decision {
        return Err(Error::Mismatch {
            wasm: Box::new(wasm_decision),
            native: Box::new(native_decision),
        });
    }
    let wasm_p99 = percentile(&wasm, 0.99);
    let native_p99 = percentile(&native, 0.99);
    Ok(Report {
        endpoints: args.endpoints,
        iterations: args.iterations,
        wasm_p50_us: percentile(&wasm, 0.5),
        wasm_p99_us: wasm_p99,
        native_p50_us: percentile(&native, 0.5),
        native_p99_us: native_p99,
        ratio_p99: if native_p99 > 0.0 {
            wasm_p99 / native_p99
        } else {
            0.0
        },
        fresh_instance_p50_us: percentile(&fresh, 0.5),
        fresh_instance_p99_us: percentile(&fresh, 0.99),
        module_sha256: runtime.active().sha256,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn runs_and_agrees_with_native() {
        let args = Args {
            endpoints: 8,
            iterations: 200,
            fresh_iterations: 5,
            json: true,
            module: None,
        };
        let r = run(args)
            .await
            .expect("bench runs (build the guests with policies/build.sh first)");
        assert_eq!(r.endpoints, 8);
        assert!(r.wasm_p50_us > 0.0 && r.native_p50_us > 0.0 && r.fresh_instance_p50_us > 0.0);
        assert!(r.wasm_p50_us <= r.wasm_p99_us);
    }
}
