//! Real worker processes (`rngd-pd worker`, release build, real model) over
//! `nixl-ucx` (NIXL over UCX against the `nixl-cu12` wheel `tests/setup.sh`
//! installs; the descriptors through a real relay): prefill on one worker,
//! decode on another; completions (two-step and `x-prefiller-host-port`)
//! and streaming equal a solo worker's tokens; the decode worker loads KV
//! and never prefills. A worker told to use `nixl-ucx` where the runtime is
//! not refuses to start, naming what is missing.
//!
//! Needs the model: `RNGD_PD_MODEL`, or the default cache filled by
//! `rngd-pd model fetch`. Without the NIXL runtime these tests fail.

mod common;

use std::process::Command;

use common::http::{complete, ids, metric, post, request, streamed_ids};
use common::{Proc, model};
use serde_json::json;

const TTL_S: &str = "5";
const KV_SECRET: &str = "worker-pd-nixl-test-secret-0123456789";
const NIXL: &str = "nixl-ucx";

const PROMPTS: &[&str] = &[
    "The capital of France is",
    "Write a story about the sea.\n",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
];

fn base_envs(dir: &std::path::Path) -> Vec<(&'static str, String)> {
    vec![
        ("RNGD_PD_MODEL", model().display().to_string()),
        ("PD_SHM_ROOT", dir.join("shm").display().to_string()),
        ("AIRM_KV_TCP_TTL_S", TTL_S.to_string()),
        ("AIRM_KV_TCP_SECRET", KV_SECRET.to_string()),
        ("AIRM_KV_UCX_POOL_MB", "128".to_string()),
        ("AIRM_KV_UCX_LOG", "1".to_string()),
        ("RNGD_PD_KV_PULL_TIMEOUT_MS", "10000".to_string()),
        ("RNGD_PD_CHIP", "-1".to_string()),
        (
            "RNGD_PD_KUBELET_CHECKPOINT",
            dir.join("no-checkpoint").display().to_string(),
        ),
    ]
}

#[tokio::test]
async fn pd_over_nixl_ucx_matches_solo() {
    let dir = tempfile::tempdir().unwrap();
    let mut envs = base_envs(dir.path());
    // Reference tokens from a solo worker.
    let solo = Proc::worker("solo", dir.path(), "solo", &envs);
    let mut want = Vec::new();
    for p in PROMPTS {
        let r = complete(&solo, &request(p), &[]).await;
        assert_eq!(r["choices"][0]["finish_reason"], "length", "{r}");
        want.push(ids(&r));
    }
    solo.kill();

    let _relay = Proc::start(
        "relay",
        dir.path(),
        &["relay", "--listen", "127.0.0.1:0", "--ttl-s", TTL_S],
        &[("AIRM_KV_TCP_SECRET", KV_SECRET.to_string())],
        "relay listening on ",
    );
    envs.push(("AIRM_KV_TCP_ADDR", _relay.addr.clone()));
    // Both workers default to nixl-ucx: each starts its NIXL agent at startup.
    envs.push(("AIRM_KV_TRANSPORT", NIXL.to_string()));
    let prefill = Proc::worker("prefill", dir.path(), "prefill", &envs);
    let mut denvs = envs.clone();
    denvs.push(("RNGD_PD_PREFILL_ALLOW", prefill.addr.clone()));
    let decode = Proc::worker("decode", dir.path(), "decode", &denvs);

    for (i, p) in PROMPTS.iter().enumerate() {
        let mut pre = request(p);
        pre["kv_transfer_params"] = json!({"do_remote_decode": true, "kv_transport": NIXL});
        let rid = format!("nixl-two-step-{i}");
        let answer = complete(&prefill, &pre, &[("x-request-id", &rid)]).await;
        let params = answer["kv_transfer_params"].clone();
        assert_eq!(params["kv_handle"]["transport"], NIXL, "{answer}");
        let mut dec = request(p);
        dec["kv_transfer_params"] = params;
        let got = complete(&decode, &dec, &[]).await;
        assert_eq!(
            ids(&got),
            want[i],
            "nixl-ucx: PD tokens differ from solo for prompt {i}"
        );
        assert!(got["timings"]["kv_load_ms"].is_number(), "{got}");
    }
    for (i, p) in PROMPTS.iter().enumerate() {
        let rid = format!("nixl-header-{i}");
        let got = complete(
            &decode,
            &request(p),
            &[
                ("x-prefiller-host-port", &prefill.addr),
                ("x-rngd-pd-kv-transport", NIXL),
                ("x-request-id", &rid),
            ],
        )
        .await;
        assert_eq!(
            ids(&got),
            want[i],
            "nixl-ucx: header-path tokens differ for prompt {i}"
        );
    }
    let mut s = request(PROMPTS[0]);
    s["stream"] = json!(true);
    let (status, body) = post(
        &decode.url("/v1/completions"),
        &s,
        &[
            ("x-prefiller-host-port", &prefill.addr),
            ("x-rngd-pd-kv-transport", NIXL),
        ],
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let streamed = streamed_ids(&body);
    assert_eq!(streamed, want[0], "nixl-ucx: streamed tokens differ");

    let n = (2 * PROMPTS.len() + 1) as f64;
    assert_eq!(metric(&decode, "rngd_pd_worker_kv_loads_total").await, n);
    assert_eq!(
        metric(&decode, "rngd_pd_worker_prefills_total").await,
        0.0,
        "the decode worker must not prefill"
    );
    assert_eq!(metric(&prefill, "rngd_pd_worker_prefills_total").await, n);
    // The bytes went over NIXL: both sides logged them (AIRM_KV_UCX_LOG=1),
    // the same SHA-256 on each side.
    let sums = |log: String, dir: &str| -> Vec<String> {
        log.lines()
            .filter(|l| {
                l.contains("nixl-ucx: KV blob")
                    && (l.contains(&format!("dir=\"{dir}\"")) || l.contains(&format!("dir={dir} ")))
            })
            .filter_map(|l| l.split("sha256=").nth(1))
            .map(|s| s.split_whitespace().next().unwrap_or("").to_string())
            .collect()
    };
    let pushed = sums(prefill.log_text(), "push");
    let mut pulled = sums(decode.log_text(), "pull");
    assert!(
        !pushed.is_empty(),
        "the prefill worker logged no nixl-ucx blob"
    );
    let mut pushed_sorted = pushed.clone();
    pushed_sorted.sort();
    pulled.sort();
    assert_eq!(
        pushed_sorted, pulled,
        "what decode pulled is what prefill pushed"
    );
}

#[test]
fn a_worker_without_the_nixl_runtime_refuses_to_start() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_rngd-pd"))
        .args(["worker", "--role", "decode", "--port", "0"])
        .envs(base_envs(dir.path()))
        .env("AIRM_KV_TRANSPORT", NIXL)
        .env("AIRM_KV_TCP_ADDR", "127.0.0.1:9")
        .env("AIRM_KV_NIXL_LIB_DIR", dir.path().join("no-nixl"))
        .output()
        .unwrap();
    assert!(!out.status.success(), "must not start without the runtime");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("nixl-ucx")
            && stderr.contains("libnixl_capi.so")
            && stderr.contains("no-nixl"),
        "stderr: {stderr}"
    );
    assert!(out.stdout.is_empty(), "nothing may claim to listen");
}
