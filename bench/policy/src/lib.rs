//! `rngd-pd-bench policy`: policy decision cost in wasm against the same logic
//! compiled natively, in the same run.
//!
//! One decision = HTTP context create + request headers + body + done +
//! delete, with the host's per-request work (lending the request, the
//! snapshot memo, reading the decision back). Timed interleaved, one
//! decision of each in turn with the order rotating, so all three share the
//! machine's conditions of the same microseconds (this host is shared and
//! noisy) and each starts on caches the other two used last, as a decision in
//! a serving process starts after other request work. `--block N` runs N
//! decisions of each in a row instead (warmer caches for all three).
//!
//! - **wasm**: the built `pd_default.wasm` on a warm instance of
//!   [`PolicyRuntime`] (sandbox, pool, wasmtime);
//! - **native**: the same module's code (crate `pd-default` and its SDK)
//!   compiled natively and run through the same lifecycle and host semantics
//!   in process ([`nullvm`], Envoy's "null VM" arrangement): the cost of the
//!   VM is the difference;
//! - **core**: [`rngd_policy_core::PdPolicy::decide`] alone, the policy logic
//!   without any ABI (a floor, not a plugin).
//!
//! Also a fresh instance per decision (instantiate + configure + decide).
//! All decisions must agree.

pub mod nullvm;

use std::path::PathBuf;
use std::time::Instant;

use rngd_api::headers;
use rngd_policy_core::{Decision, Endpoint, PdPolicy, PolicyConfig, Role, Vendor};
use rngd_policy_host::locate::{self, LocateError};
use rngd_policy_host::{PolicyError, PolicyRequest, PolicyRuntime, PolicySource, SandboxLimits};
use serde::Serialize;

/// What to run (the flags of `rngd-pd-bench policy`).
#[derive(Debug, Clone)]
pub struct Options {
    /// Endpoints in the snapshot. Default 64.
    pub endpoints: usize,
    /// Timed decisions per variant (warm wasm, native, core). Default 20,000.
    pub iterations: usize,
    /// Timed decisions on a fresh instance. Default 300.
    pub fresh_iterations: usize,
    /// Decisions a variant makes in a row before the next variant's turn
    /// (1: the three alternate decision by decision). Default 1.
    pub block: usize,
    /// Policy module. Default `None`: the default module as
    /// [`rngd_policy_host::locate::default_module`] finds it (`$RNGD_PD_POLICY`,
    /// beside the executable, the image path, `$CARGO_TARGET_DIR`).
    pub module: Option<PathBuf>,
    /// Print only the JSON line. Default off.
    pub json: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            endpoints: 64,
            iterations: 20_000,
            fresh_iterations: 300,
            block: 1,
            module: None,
            json: false,
        }
    }
}

/// Errors of the benchmark.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The module was not found (the error says where it looked).
    #[error(transparent)]
    MissingModule(#[from] LocateError),
    /// The policy runtime failed.
    #[error("policy runtime: {0}")]
    Policy(#[from] PolicyError),
    /// Two variants decided differently.
    #[error("wasm and {other} decisions differ: wasm {wasm:?}, {other} {native:?}")]
    Mismatch {
        /// Which variant differs from wasm (`native` or `core`).
        other: &'static str,
        /// Wasm decision.
        wasm: Box<Option<Decision>>,
        /// The other decision.
        native: Box<Option<Decision>>,
    },
    /// A worker thread failed.
    #[error("benchmark thread: {0}")]
    Join(#[from] tokio::task::JoinError),
}

/// Results (µs per decision). Warm wasm, native and core decisions are timed
/// interleaved: one decision (or `block` decisions) of each in turn.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Endpoints in the snapshot.
    pub endpoints: usize,
    /// Timed decisions per variant.
    pub iterations: usize,
    /// Decisions per variant in a row (see [`Options::block`]).
    pub block: usize,
    /// Warm instance, median.
    pub wasm_p50_us: f64,
    /// Warm instance, 99th percentile.
    pub wasm_p99_us: f64,
    /// The same module compiled natively, same lifecycle ([`nullvm`]), median.
    pub native_p50_us: f64,
    /// Native, 99th percentile.
    pub native_p99_us: f64,
    /// `wasm_p99_us / native_p99_us`: what running the policy in the VM costs.
    pub ratio_p99: f64,
    /// `wasm_p50_us / native_p50_us`.
    pub ratio_p50: f64,
    /// The core decision alone (no ABI, no lifecycle), median.
    pub core_p50_us: f64,
    /// The core decision alone, 99th percentile.
    pub core_p99_us: f64,
    /// `wasm_p99_us / core_p99_us`: the VM and the ABI lifecycle together.
    pub ratio_p99_core: f64,
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
            // One version everywhere, so the pairing check runs and passes.
            weight_version: Some("99dda3c02b151cb8".into()),
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
        ..PolicyRequest::default()
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// Runs `f` once, appending its time (µs) to `us`.
fn time_one<T>(us: &mut Vec<f64>, f: impl FnOnce() -> Result<T, Error>) -> Result<T, Error> {
    let t = Instant::now();
    let out = f()?;
    us.push(t.elapsed().as_secs_f64() * 1e6);
    Ok(out)
}

fn timed(
    n: usize,
    mut f: impl FnMut() -> Result<Decision, Error>,
) -> Result<(Vec<f64>, Decision), Error> {
    let mut last = f()?;
    let mut us = Vec::with_capacity(n);
    for _ in 0..n {
        last = time_one(&mut us, &mut f)?;
    }
    us.sort_by(f64::total_cmp);
    Ok((us, last))
}

/// Runs the benchmark (blocking work on a blocking thread) and prints a
/// summary (unless `--json`) followed by the JSON line.
pub async fn run(args: Options) -> Result<Report, Error> {
    let report =
        tokio::task::spawn_blocking(move || measure(&args).map(|r| (r, args.json))).await??;
    let (report, json) = report;
    if !json {
        println!(
            "policy decision, {} endpoints, {} iterations\n  wasm warm   p50 {:>8.2} us  p99 {:>8.2} us\n  native      p50 {:>8.2} us  p99 {:>8.2} us  (same module, same lifecycle)\n  core only   p50 {:>8.2} us  p99 {:>8.2} us\n  wasm fresh  p50 {:>8.2} us  p99 {:>8.2} us\n  ratio p99 wasm/native {:.2}, wasm/core {:.2}",
            report.endpoints,
            report.iterations,
            report.wasm_p50_us,
            report.wasm_p99_us,
            report.native_p50_us,
            report.native_p99_us,
            report.core_p50_us,
            report.core_p99_us,
            report.fresh_instance_p50_us,
            report.fresh_instance_p99_us,
            report.ratio_p99,
            report.ratio_p99_core
        );
    }
    println!("{}", serde_json::to_string(&report).unwrap_or_default());
    Ok(report)
}

fn measure(args: &Options) -> Result<Report, Error> {
    let module = locate::default_module(args.module.as_deref())?;
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

    // Native: the module's code run natively through the same lifecycle.
    let mut null_vm = nullvm::NullVm::new(&config)?;
    // Core: the same core logic with the same inputs and snapshot caching.
    let mut policy =
        PdPolicy::new(
            PolicyConfig::from_json(&config).map_err(|e| PolicyError::NoDecision {
                detail: e.to_string(),
            })?,
        );
    let json = serde_json::to_vec(req.endpoints.as_deref().unwrap_or_default()).unwrap_or_default();
    let version = b"1".to_vec();
    let mut core_once = || -> Decision {
        let subset = req
            .headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(headers::DESTINATION_ENDPOINT_SUBSET))
            .map(|(_, v)| v.as_str());
        let prompt = req.prompt_tokens.map(|n| n.to_string());
        let props = rngd_policy_core::RequestProps {
            subset,
            body: Some(&req.body),
            prompt_tokens: prompt.as_deref().map(str::as_bytes),
            ..Default::default()
        };
        policy.decide(&props, Some(&version), || Some(json.clone()))
    };

    // Warm-up of all three (the first decision parses the snapshot).
    let mut lent = req.clone();
    for _ in 0..1000 {
        runtime.decide_blocking(&mut lent)?;
        null_vm.decide(&mut lent)?;
        core_once();
    }
    // Timed, interleaved: one decision of each in turn, so all see the same
    // machine load (this host is shared and noisy).
    let mut wasm = Vec::with_capacity(args.iterations);
    let mut native = Vec::with_capacity(args.iterations);
    let mut core = Vec::with_capacity(args.iterations);
    let mut decisions = (None, None, None);
    let block = args.block.max(1);
    let mut round = 0;
    while wasm.len() < args.iterations {
        let n = block.min(args.iterations - wasm.len());
        // The order rotates, so each variant runs first, second and third
        // equally often: none always follows the one that warmed the
        // caches it shares (host code, the request's bytes) for it.
        for k in 0..3 {
            for _ in 0..n {
                match (round + k) % 3 {
                    0 => {
                        decisions.0 = Some(time_one(&mut wasm, || {
                            Ok(runtime.decide_blocking(&mut lent)?)
                        })?);
                    }
                    1 => {
                        decisions.1 =
                            Some(time_one(&mut native, || Ok(null_vm.decide(&mut lent)?))?);
                    }
                    _ => decisions.2 = Some(time_one(&mut core, || Ok(core_once()))?),
                }
            }
        }
        round += 1;
    }
    for v in [&mut wasm, &mut native, &mut core] {
        v.sort_by(f64::total_cmp);
    }
    let (fresh, _) = timed(args.fresh_iterations, || {
        Ok(runtime.decide_fresh(&mut lent)?)
    })?;
    let (wasm_decision, native_decision, core_decision) = decisions;
    for (other, d) in [("native", &native_decision), ("core", &core_decision)] {
        if &wasm_decision != d {
            return Err(Error::Mismatch {
                other,
                wasm: Box::new(wasm_decision),
                native: Box::new(d.clone()),
            });
        }
    }
    let wasm_p99 = percentile(&wasm, 0.99);
    let native_p99 = percentile(&native, 0.99);
    let core_p99 = percentile(&core, 0.99);
    let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
    Ok(Report {
        endpoints: args.endpoints,
        iterations: args.iterations,
        block,
        wasm_p50_us: percentile(&wasm, 0.5),
        wasm_p99_us: wasm_p99,
        native_p50_us: percentile(&native, 0.5),
        native_p99_us: native_p99,
        ratio_p99: ratio(wasm_p99, native_p99),
        ratio_p50: ratio(percentile(&wasm, 0.5), percentile(&native, 0.5)),
        core_p50_us: percentile(&core, 0.5),
        core_p99_us: core_p99,
        ratio_p99_core: ratio(wasm_p99, core_p99),
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
        let args = Options {
            endpoints: 8,
            iterations: 200,
            fresh_iterations: 5,
            block: 7,
            json: true,
            module: None,
        };
        let r = run(args)
            .await
            .expect("bench runs (build the guests with policies/build.sh first)");
        assert_eq!(r.endpoints, 8);
        assert!(r.wasm_p50_us > 0.0 && r.native_p50_us > 0.0 && r.fresh_instance_p50_us > 0.0);
        assert!(r.core_p50_us > 0.0);
        assert!(r.wasm_p50_us <= r.wasm_p99_us);
    }

    /// The native baseline runs the same module through the same lifecycle:
    /// it must decide exactly as the wasm module does, rejections included.
    #[test]
    fn null_vm_decides_as_the_wasm_module() {
        let module = locate::default_module(None)
            .unwrap_or_else(|e| panic!("{e} (build the guests with policies/build.sh first)"));
        // No queue cost in the TTFT prediction, so the long prompt is split
        // (its prefill endpoint is busier than its decode endpoint).
        let config = br#"{"disaggregation_threshold_tokens":16,"queue_ms_per_request":0}"#.to_vec();
        let runtime = PolicyRuntime::new(
            PolicySource {
                module,
                config: config.clone(),
            },
            SandboxLimits::default(),
        )
        .expect("module loads");
        let mut vm = nullvm::NullVm::new(&config).expect("null vm");
        let endpoints: std::sync::Arc<[Endpoint]> = snapshot(6).into();
        let with = |body: &str, eps: Option<std::sync::Arc<[Endpoint]>>, prompt: Option<usize>| {
            let mut r = request(Vec::new());
            r.body = body.as_bytes().to_vec();
            r.endpoints = eps;
            r.prompt_tokens = prompt;
            r
        };
        let short = r#"{"prompt":"hi","max_tokens":8}"#;
        let mut cases: Vec<PolicyRequest> = [
            (Some(endpoints.clone()), 4),
            (Some(endpoints.clone()), 400),
            (Some(endpoints.clone()), 4090),
            (Some(Vec::new().into()), 4),
        ]
        .into_iter()
        .map(|(eps, prompt)| with(short, eps, Some(prompt)))
        .collect();
        cases.extend([
            with(r#"{"prompt": nope}"#, Some(endpoints.clone()), Some(4)),
            with("", None, None),
        ]);
        let mut kinds = std::collections::BTreeSet::new();
        for mut req in cases {
            let before = (req.headers.clone(), req.body.clone());
            let wasm = runtime.decide_blocking(&mut req).expect("wasm decides");
            let native = vm.decide(&mut req).expect("native decides");
            assert_eq!(wasm, native);
            assert_eq!(
                (req.headers.clone(), req.body.clone()),
                before,
                "request handed back unchanged"
            );
            kinds.insert(match &wasm {
                Decision::Route(r) if r.prefill.is_some() => "split".to_string(),
                Decision::Route(_) => "local".to_string(),
                Decision::Reject(l) => l.status.to_string(),
            });
        }
        // Routes with and without a remote prefill, and rejections.
        for k in ["split", "local", "400", "503"] {
            assert!(kinds.contains(k), "no {k} decision among {kinds:?}");
        }
    }
}
