//! Real worker processes (`rngd-pd worker`, release build, real model) over
//! `nixl-ucx` (`UCX_TLS=tcp`) across two network namespaces joined by a veth
//! pair: namespace A runs the relay and the prefill worker (bound to A's veth
//! address), namespace B runs the decode worker. The test (root namespace)
//! reaches the decode worker over a second veth pair root <-> B only; A and
//! the root namespace are not connected, so the KV can only cross A <-> B.
//! Completions (`x-prefiller-host-port`) and a streaming request through the
//! decode worker equal a solo worker's greedy tokens; the decode worker
//! loaded the KV over nixl-ucx (the pushed and pulled SHA-256s match) and
//! never prefilled; afterwards nothing is in flight on the decode worker and
//! every prefill slot was freed by the decode side's READ notification (none
//! by TTL).
//!
//! Needs root and iproute2 (CI runs as root; `tests/setup.sh` installs
//! iproute2), the NIXL runtime and the model (`RNGD_PD_MODEL`, or the cache
//! filled by `rngd-pd model fetch`). Without namespaces the test FAILS, with
//! a message saying so. Namespaces and veths are removed on drop, also on
//! failure.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{SystemTime, UNIX_EPOCH};

use common::http::{complete, ids, metric, post, request, streamed_ids};
use common::{Proc, model};
use serde_json::json;

const TTL_S: &str = "5";
const KV_SECRET: &str = "worker-pd-netns-test-secret-0123456789";
const NIXL: &str = "nixl-ucx";

const PROMPTS: &[&str] = &[
    "The capital of France is",
    "Write a story about the sea.\n",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
];

/// Namespaces and root-side veths this test created; removed on drop (after
/// the processes inside, which are dropped first: declare this first).
struct Netns {
    namespaces: Vec<String>,
    links: Vec<String>,
}

impl Drop for Netns {
    fn drop(&mut self) {
        for l in &self.links {
            let _ = Command::new("ip")
                .args(["link", "del", l])
                .stderr(Stdio::null())
                .status();
        }
        for ns in &self.namespaces {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
    }
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("cannot run `ip` (iproute2): {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "`ip {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

fn must(r: Result<(), String>) {
    if let Err(e) = r {
        panic!("{e}");
    }
}

/// Creates namespace `ns` (lo up), recorded for removal.
fn add_netns(net: &mut Netns, ns: &str) {
    if let Err(e) = ip(&["netns", "add", ns]) {
        panic!(
            "network namespaces are unavailable, so the PD-across-namespaces test cannot \
             run (it needs root and iproute2): {e}"
        );
    }
    net.namespaces.push(ns.to_string());
    must(ip(&["-n", ns, "link", "set", "lo", "up"]));
}

/// Moves `dev` into `ns` (or leaves it in the root namespace for `None`),
/// gives it `cidr` and brings it up.
fn configure(ns: Option<&str>, dev: &str, cidr: &str) {
    let pre: Vec<&str> = match ns {
        Some(ns) => {
            must(ip(&["link", "set", dev, "netns", ns]));
            vec!["-n", ns]
        }
        None => vec![],
    };
    must(ip(
        &[pre.as_slice(), &["addr", "add", cidr, "dev", dev]].concat()
    ));
    must(ip(&[pre.as_slice(), &["link", "set", dev, "up"]].concat()));
}

fn base_envs(dir: &Path) -> Vec<(&'static str, String)> {
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

/// SHA-256s of the nixl-ucx KV blobs a worker logged in direction `dir`.
fn sums(log: &str, dir: &str) -> Vec<String> {
    let mut v: Vec<String> = log
        .lines()
        .filter(|l| {
            l.contains("nixl-ucx: KV blob")
                && (l.contains(&format!("dir=\"{dir}\"")) || l.contains(&format!("dir={dir} ")))
        })
        .filter_map(|l| l.split("sha256=").nth(1))
        .map(|s| s.split_whitespace().next().unwrap_or("").to_string())
        .collect();
    v.sort();
    v
}

#[tokio::test(flavor = "multi_thread")]
async fn pd_over_nixl_ucx_across_network_namespaces_matches_solo() {
    let nonce = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .subsec_nanos()
        ^ std::process::id();
    let tag = format!("w{:05x}", nonce & 0xfffff);
    let (na, nb) = (format!("{tag}a"), format!("{tag}b"));
    // Dropped last: the processes inside go first.
    let mut net = Netns {
        namespaces: Vec::new(),
        links: Vec::new(),
    };
    add_netns(&mut net, &na);
    add_netns(&mut net, &nb);
    // A <-> B: 10.231.9.1 (A), 10.231.9.2 (B), inside the namespaces only.
    let (ab, ba) = (format!("{tag}ab"), format!("{tag}ba"));
    must(ip(&[
        "link", "add", &ab, "type", "veth", "peer", "name", &ba,
    ]));
    net.links.push(ab.clone());
    configure(Some(&na), &ab, "10.231.9.1/24");
    configure(Some(&nb), &ba, "10.231.9.2/24");
    let (a_ip, b_ip) = ("10.231.9.1", "10.231.9.2");
    // root <-> B: a /30 unique to this run, for the test's HTTP client.
    let sub = (nonce >> 8) & 0xff;
    let (rb, br) = (format!("{tag}rb"), format!("{tag}br"));
    must(ip(&[
        "link", "add", &rb, "type", "veth", "peer", "name", &br,
    ]));
    net.links.push(rb.clone());
    configure(None, &rb, &format!("10.233.{sub}.1/30"));
    configure(Some(&nb), &br, &format!("10.233.{sub}.2/30"));
    let b_front = format!("10.233.{sub}.2");

    let dir = tempfile::tempdir().unwrap();
    let mut envs = base_envs(dir.path());
    // Reference tokens from a solo worker (root namespace, loopback).
    let solo = Proc::worker("solo", dir.path(), "solo", &envs);
    let mut want = Vec::new();
    for p in PROMPTS {
        let r = complete(&solo, &request(p), &[]).await;
        assert_eq!(r["choices"][0]["finish_reason"], "length", "{r}");
        want.push(ids(&r));
    }
    solo.kill();

    let relay = Proc::start_in_netns(
        &na,
        "relay",
        dir.path(),
        &["relay", "--listen", &format!("{a_ip}:0"), "--ttl-s", TTL_S],
        &[("AIRM_KV_TCP_SECRET", KV_SECRET.to_string())],
        "relay listening on ",
    );
    assert!(relay.addr.starts_with(a_ip), "relay at {}", relay.addr);
    envs.push(("AIRM_KV_TCP_ADDR", relay.addr.clone()));
    envs.push(("AIRM_KV_TRANSPORT", NIXL.to_string()));
    envs.push(("UCX_TLS", "tcp".to_string()));

    let mut penvs = envs.clone();
    penvs.push(("RNGD_PD_HOST", a_ip.to_string()));
    // The decode worker's prefill-only requests come from B's veth address.
    penvs.push(("RNGD_PD_FRONT_DOOR_ALLOW", format!("{b_ip}/32")));
    penvs.push(("UCX_NET_DEVICES", ab.clone()));
    // The slot frees are debug lines.
    penvs.push(("RUST_LOG", "info,rngd_kv_transport::nixl=debug".to_string()));
    let prefill = Proc::start_in_netns(
        &na,
        "prefill",
        dir.path(),
        &["worker", "--role", "prefill", "--port", "0"],
        &penvs,
        "rngd-pd worker listening on http://",
    );
    assert!(
        prefill.addr.starts_with(a_ip),
        "prefill at {}",
        prefill.addr
    );

    let mut denvs = envs.clone();
    denvs.push(("RNGD_PD_HOST", b_front.clone()));
    denvs.push(("RNGD_PD_PREFILL_ALLOW", prefill.addr.clone()));
    denvs.push(("UCX_NET_DEVICES", ba.clone()));
    let decode = Proc::start_in_netns(
        &nb,
        "decode",
        dir.path(),
        &["worker", "--role", "decode", "--port", "0"],
        &denvs,
        "rngd-pd worker listening on http://",
    );
    assert!(
        decode.addr.starts_with(&b_front),
        "decode at {}",
        decode.addr
    );

    for (i, p) in PROMPTS.iter().enumerate() {
        let rid = format!("netns-header-{i}");
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
            "nixl-ucx across namespaces: PD tokens differ from solo for prompt {i}"
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
    assert_eq!(
        streamed, want[0],
        "nixl-ucx across namespaces: streamed tokens differ"
    );

    let n = (PROMPTS.len() + 1) as f64;
    assert_eq!(metric(&decode, "rngd_pd_worker_kv_loads_total").await, n);
    assert_eq!(
        metric(&decode, "rngd_pd_worker_prefills_total").await,
        0.0,
        "the decode worker must not prefill"
    );
    assert_eq!(metric(&decode, "rngd_pd_worker_in_flight").await, 0.0);
    // The bytes went over NIXL: each blob logged on both sides with the same
    // SHA-256 (AIRM_KV_UCX_LOG=1).
    let pushed = sums(&prefill.log_text(), "push");
    let pulled = sums(&decode.log_text(), "pull");
    let requests = |log: &str| -> std::collections::BTreeSet<String> {
        log.lines()
            .filter(|l| l.contains("nixl-ucx: KV blob") && l.contains("dir=\"push\""))
            .filter_map(|l| l.split("nixl-ucx: KV blob").nth(1))
            .filter_map(|l| l.split("request_id=").nth(1))
            .filter_map(|r| r.split_whitespace().next())
            .map(str::to_string)
            .collect()
    };
    assert_eq!(
        requests(&prefill.log_text()).len(),
        PROMPTS.len() + 1,
        "the prefill worker pushed over nixl-ucx for each PD request"
    );
    assert!(
        !pushed.is_empty(),
        "the prefill worker logged no nixl-ucx blob"
    );
    assert_eq!(pushed, pulled, "what decode pulled is what prefill pushed");
    // No slot held afterwards: each READ's notification freed its prefill
    // slot (well before the 5 s TTL would have).
    let freed = |why: &str| {
        prefill
            .log_text()
            .lines()
            .filter(|l| l.contains("nixl-ucx: slot freed") && l.contains(&format!("why=\"{why}\"")))
            .count()
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(3);
    while freed("read") < PROMPTS.len() + 1 && std::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_eq!(
        freed("read"),
        PROMPTS.len() + 1,
        "every prefill slot is freed by the decode side's READ notification"
    );
    assert_eq!(freed("ttl"), 0, "no slot waited for its TTL");
    drop((decode, prefill, relay));
    drop(net);
}
