//! Runs the built guests (`policies/build.sh`) through the host: decisions,
//! sandbox faults, hot swaps under load, the file watcher, the admin API and
//! `check`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rngd_api::headers;
use rngd_policy_core::{Decision, Endpoint, Role, Vendor};
use rngd_policy_host::{
    PolicyError, PolicyRequest, PolicyRuntime, PolicySource, SandboxLimits, admin_router,
    built_module, check, sha256_hex,
};
use tower::ServiceExt;

const TARGETS: [&str; 2] = ["wasm32-unknown-unknown", "wasm32-wasip1"];

fn ep(address: &str, role: Role, node: &str, queue: u32, healthy: bool) -> Endpoint {
    Endpoint {
        address: address.into(),
        role,
        vendor: Vendor::Cpu,
        node: node.into(),
        seq_len: 512,
        queue_depth: queue,
        running: 0,
        kv_usage: 0.1,
        healthy,
        transports: vec![],
        weight_version: None,
    }
}

fn req(
    body: &str,
    endpoints: Option<Vec<Endpoint>>,
    prompt_tokens: Option<usize>,
) -> PolicyRequest {
    PolicyRequest {
        headers: vec![
            (":method".into(), "POST".into()),
            (":path".into(), "/v1/completions".into()),
            ("content-type".into(), "application/json".into()),
        ],
        body: body.as_bytes().to_vec(),
        endpoints: endpoints.map(Arc::from),
        prompt_tokens,
        ..PolicyRequest::default()
    }
}

fn runtime(name: &str, target: &str, config: &str) -> Result<Arc<PolicyRuntime>, PolicyError> {
    PolicyRuntime::new(
        PolicySource {
            module: built_module(name, target),
            config: config.as_bytes().to_vec(),
        },
        SandboxLimits {
            call_timeout: Duration::from_millis(250),
            // Over the call timeout: a spinning callback is a GuestTimeout
            // here (the budget across callbacks has its own tests).
            decision_budget: Duration::from_secs(1),
            memory_bytes: 32 << 20,
            ..SandboxLimits::default()
        },
    )
}

fn counter(rt: &PolicyRuntime, name: &str) -> u64 {
    rt.registry()
        .gather()
        .iter()
        .find(|m| m.name() == name)
        .map(|m| m.get_metric()[0].get_counter().get_value() as u64)
        .unwrap_or_else(|| panic!("metric {name} not registered"))
}

#[tokio::test]
async fn default_policy_decision_table() {
    let cluster = vec![
        ep("10.0.0.1:8000", Role::Decode, "n1", 4, true),
        ep("10.0.0.2:8000", Role::Decode, "n2", 1, true),
        ep("10.0.0.9:8000", Role::Decode, "n2", 0, false),
        ep("10.0.1.1:9000", Role::Prefill, "n2", 0, true),
        ep("10.0.1.2:9000", Role::Prefill, "n3", 3, true),
    ];
    let body = r#"{"model":"m","prompt":"hello","max_tokens":32}"#;
    // (name, request, expected: Ok((decode, prefill, transport)) or Err(status))
    type Expect = Result<(&'static str, Option<&'static str>, Option<&'static str>), u16>;
    let mut subset = req(body, Some(cluster.clone()), Some(100));
    subset.headers.push((
        headers::DESTINATION_ENDPOINT_SUBSET.into(),
        "10.0.0.1:8000,10.0.1.2:9000".into(),
    ));
    let mut subset_none = req(body, Some(cluster.clone()), Some(100));
    subset_none.headers.push((
        headers::DESTINATION_ENDPOINT_SUBSET.into(),
        "10.9.9.9:1".into(),
    ));
    let table: Vec<(&str, PolicyRequest, Expect)> = vec![
        (
            "long prompt: least-loaded healthy decode, same-node prefill over shm",
            req(body, Some(cluster.clone()), Some(100)),
            Ok(("10.0.0.2:8000", Some("10.0.1.1:9000"), Some("shm"))),
        ),
        (
            "short prompt prefills locally",
            req(body, Some(cluster.clone()), Some(10)),
            Ok(("10.0.0.2:8000", None, None)),
        ),
        (
            "subset hint: cross-node prefill over tcp",
            subset,
            Ok(("10.0.0.1:8000", Some("10.0.1.2:9000"), Some("tcp"))),
        ),
        ("subset with no match", subset_none, Err(503)),
        (
            "prompt + max_tokens over seq_len",
            req(body, Some(cluster.clone()), Some(490)),
            Err(400),
        ),
        (
            "no healthy decode",
            req(
                body,
                Some(vec![ep("a:1", Role::Decode, "", 0, false)]),
                Some(10),
            ),
            Err(503),
        ),
        (
            "invalid body",
            req("{not json", Some(cluster.clone()), Some(10)),
            Err(400),
        ),
        (
            "solo endpoint never gets a remote prefill",
            req(
                body,
                Some(vec![
                    ep("s:1", Role::Solo, "n", 0, true),
                    ep("p:1", Role::Prefill, "n", 0, true),
                ]),
                Some(300),
            ),
            Ok(("s:1", None, None)),
        ),
    ];
    for target in TARGETS {
        let rt = runtime("pd-default", target, r#"{"max_queue_depth": 8}"#).expect("loads");
        for (name, r, want) in &table {
            let got = rt
                .decide(r.clone())
                .await
                .unwrap_or_else(|e| panic!("{target} {name}: {e}"));
            match (want, got) {
                (Ok((d, p, t)), Decision::Route(route)) => {
                    assert_eq!(route.decode, *d, "{target} {name}");
                    assert_eq!(route.prefill.as_deref(), *p, "{target} {name}");
                    assert_eq!(route.kv_transport.as_deref(), *t, "{target} {name}");
                    assert!(
                        route
                            .headers
                            .contains(&(headers::DESTINATION_ENDPOINT.to_string(), d.to_string()))
                    );
                }
                (Err(status), Decision::Reject(local)) => {
                    assert_eq!(
                        local.status,
                        *status,
                        "{target} {name}: {:?}",
                        local.message()
                    );
                    let body: serde_json::Value =
                        serde_json::from_slice(&local.body).expect("JSON error body");
                    assert!(
                        body["error"]["message"]
                            .as_str()
                            .is_some_and(|m| !m.is_empty()),
                        "{target} {name}"
                    );
                }
                (want, got) => panic!("{target} {name}: wanted {want:?}, got {got:?}"),
            }
        }
        // The context-length rejection uses the shared wording and code.
        let d = rt
            .decide(req(body, Some(cluster.clone()), Some(490)))
            .await
            .unwrap();
        let l = d.rejection().unwrap();
        assert_eq!(
            l.message().unwrap(),
            rngd_api::openai::context_length_message(490, 32, 512)
        );
        let v: serde_json::Value = serde_json::from_slice(&l.body).unwrap();
        assert_eq!(v["error"]["code"], rngd_api::openai::CONTEXT_LENGTH_CODE);
    }
}

/// `routing` through the wasm guest: with `"load"` the cached endpoint is
/// ignored (the load order's first, the whole prompt prefilled remotely);
/// the default (`"cache"`) takes it.
#[tokio::test]
async fn routing_load_ignores_the_cache() {
    let cluster = vec![
        ep("10.0.0.1:8000", Role::Decode, "n1", 0, true),
        ep("10.0.0.2:8000", Role::Decode, "n1", 0, true),
        ep("10.0.1.1:9000", Role::Prefill, "n1", 0, true),
    ];
    let body = r#"{"model":"m","prompt":"hello","max_tokens":32}"#;
    let mut r = req(body, Some(cluster), Some(420));
    r.prefix_cache = Some("10.0.0.2:8000=400".into());
    // (config, decode, prefill)
    let rows = [
        ("{}", "10.0.0.2:8000", None),
        (
            r#"{"routing":"load"}"#,
            "10.0.0.1:8000",
            Some("10.0.1.1:9000"),
        ),
    ];
    for target in TARGETS {
        for (config, decode, prefill) in rows {
            let rt = runtime("pd-default", target, config).expect("loads");
            let route = rt
                .decide(r.clone())
                .await
                .expect("decides")
                .route()
                .cloned()
                .expect("a route");
            assert_eq!(route.decode, decode, "{target} {config}");
            assert_eq!(route.prefill.as_deref(), prefill, "{target} {config}");
        }
    }
}

/// One row of the cache-aware table: (what, queue of the two decode
/// endpoints, prefill queue, `rngd_pd.prefix_cache`, `x-llm-d-slo-ttft-ms`,
/// decode, prefill, reason).
type CacheRow = (
    &'static str,
    [u32; 2],
    u32,
    Option<&'static str>,
    Option<&'static str>,
    &'static str,
    Option<&'static str>,
    &'static str,
);

/// The cache-aware decision through both guests, as the core's tables have
/// it: the cached endpoint wins unless overloaded, and the PD decision's
/// rows (few non-cached tokens → local; a long cold prompt → PD; a TTFT goal
/// met or unmet locally; a busier prefill endpoint → local).
#[tokio::test]
async fn cache_aware_decision_table() {
    let body = r#"{"model":"m","prompt":"hello","max_tokens":32}"#;
    let (d1, d2, p) = ("10.0.0.1:8000", "10.0.0.2:8000", "10.0.1.1:9000");
    let rows: [CacheRow; 7] = [
        (
            "cached endpoint wins",
            [0, 0],
            0,
            Some("10.0.0.2:8000=288"),
            None,
            d2,
            None,
            "cached",
        ),
        (
            "an overloaded cached endpoint loses",
            [0, 9],
            0,
            Some("10.0.0.2:8000=288"),
            None,
            d1,
            Some(p),
            "disaggregated",
        ),
        (
            "long cold prompt",
            [0, 0],
            0,
            None,
            None,
            d1,
            Some(p),
            "disaggregated",
        ),
        (
            "TTFT goal met locally",
            [0, 0],
            0,
            None,
            Some("1000"),
            d1,
            None,
            "ttft_goal_met_locally",
        ),
        (
            "TTFT goal unmet locally",
            [0, 0],
            0,
            None,
            Some("100"),
            d1,
            Some(p),
            "disaggregated",
        ),
        (
            "prefill endpoint busier",
            [0, 0],
            5,
            None,
            None,
            d1,
            None,
            "faster_locally",
        ),
        (
            "no information (stream down) is load alone",
            [0, 0],
            0,
            Some("10.0.0.1:8000=?,10.0.0.2:8000=?"),
            None,
            d1,
            Some(p),
            "disaggregated",
        ),
    ];
    for target in TARGETS {
        let rt = runtime("pd-default", target, "{}").expect("loads");
        for (what, [q1, q2], pq, cache, goal, decode, prefill, reason) in rows {
            let cluster = vec![
                ep(d1, Role::Decode, "n1", q1, true),
                ep(d2, Role::Decode, "n1", q2, true),
                ep(p, Role::Prefill, "n1", pq, true),
            ];
            let mut r = req(body, Some(cluster), Some(300));
            r.prefix_cache = cache.map(String::from);
            if let Some(g) = goal {
                r.headers.push(("x-llm-d-slo-ttft-ms".into(), g.into()));
            }
            let route = rt
                .decide(r)
                .await
                .expect("decides")
                .route()
                .cloned()
                .expect("a route");
            assert_eq!(route.decode, decode, "{target} {what}");
            assert_eq!(route.prefill.as_deref(), prefill, "{target} {what}");
            let got = route
                .headers
                .iter()
                .find(|(k, _)| k == headers::ROUTE_REASON)
                .map(|(_, v)| v.as_str());
            assert_eq!(got, Some(reason), "{target} {what}");
        }
    }
}

#[tokio::test]
async fn static_pool_and_queue_limit() {
    let cfg = r#"{"static_endpoints":[{"address":"192.0.2.1:80","role":"decode","vendor":"cpu","seq_len":256,"queue_depth":9}],
                 "max_queue_depth": 4}"#;
    let rt = runtime("pd-default", "wasm32-unknown-unknown", cfg).expect("loads");
    // No snapshot property: the static pool, whose only endpoint is over the queue limit.
    let d = rt
        .decide(req(r#"{"prompt":"x"}"#, None, None))
        .await
        .unwrap();
    assert_eq!(d.rejection().map(|l| l.status), Some(429));
    let rt = runtime(
        "pd-default",
        "wasm32-unknown-unknown",
        &cfg.replace("\"queue_depth\":9", "\"queue_depth\":0"),
    )
    .unwrap();
    let d = rt.decide(req("", None, None)).await.unwrap();
    assert_eq!(d.route().map(|r| r.decode.as_str()), Some("192.0.2.1:80"));
    // Without a snapshot the policy decides on the headers (as in Envoy): the
    // prompt is estimated from content-length, 4000 bytes / 8 > 256 tokens.
    let body = format!(r#"{{"prompt":"{}"}}"#, "y".repeat(3990));
    let mut r = req(&body, None, None);
    r.headers
        .push(("content-length".into(), body.len().to_string()));
    let d = rt.decide(r).await.unwrap();
    assert_eq!(d.rejection().map(|l| l.status), Some(400));
}

#[tokio::test]
async fn a_bad_configuration_is_refused() {
    let e = runtime(
        "pd-default",
        "wasm32-unknown-unknown",
        r#"{"no_such_field": 1}"#,
    )
    .unwrap_err();
    assert!(matches!(e, PolicyError::Rejected { .. }), "{e}");
    assert!(e.to_string().contains("no_such_field"), "{e}");
}

fn fault(mode: &str) -> PolicyRequest {
    let mut r = req(r#"{"prompt":"x"}"#, None, Some(3));
    r.headers.push(("x-fault".into(), mode.into()));
    r
}

#[tokio::test]
async fn sandbox_faults_are_bounded_and_reported() {
    for target in TARGETS {
        let rt = runtime(
            "fault-guest",
            target,
            r#"{"fault":"none","destination":"127.0.0.7:7"}"#,
        )
        .expect("loads");
        let ok = |d: Decision| d.route().map(|r| r.decode.clone());
        assert_eq!(
            ok(rt.decide(fault("none")).await.unwrap()).as_deref(),
            Some("127.0.0.7:7")
        );

        let t = Instant::now();
        let e = rt.decide(fault("loop")).await.unwrap_err();
        assert!(
            matches!(e, PolicyError::GuestTimeout { .. }),
            "{target}: {e}"
        );
        assert!(
            t.elapsed() < Duration::from_secs(2),
            "{target}: loop stopped after {:?}",
            t.elapsed()
        );
        assert_eq!(e.http_status(), 500);

        let e = rt.decide(fault("memory_bomb")).await.unwrap_err();
        assert!(
            matches!(e, PolicyError::GuestMemory { .. }),
            "{target}: {e}"
        );

        let e = rt.decide(fault("panic")).await.unwrap_err();
        assert!(matches!(e, PolicyError::GuestTrap { .. }), "{target}: {e}");
        assert!(e.to_string().contains("deliberate panic"), "{target}: {e}");
        assert_eq!(counter(&rt, "policy_traps_total"), 3, "{target}");

        // Garbage pointers get InvalidMemoryAccess (6) / BadArgument (2); the request still routes.
        let d = rt.decide(fault("bad_pointer")).await.unwrap();
        let statuses = d
            .route()
            .unwrap()
            .headers
            .iter()
            .find(|(k, _)| k == "x-fault-statuses")
            .unwrap()
            .1
            .clone();
        assert_eq!(statuses, "6,6,6,6,2,6", "{target}");

        // A 4 MiB header value from the guest is refused with BadArgument.
        let d = rt.decide(fault("huge_header")).await.unwrap();
        let r = d.route().unwrap();
        assert!(
            r.headers
                .iter()
                .any(|(k, v)| k == "x-fault-statuses" && v == "2"),
            "{target}: {r:?}"
        );
        assert!(!r.headers.iter().any(|(k, _)| k == "x-huge"));

        // A huge header value from the client never reaches the guest.
        let mut big = fault("none");
        big.headers.push(("x-big".into(), "v".repeat(1 << 20)));
        assert!(matches!(
            rt.decide(big).await.unwrap_err(),
            PolicyError::InputTooLarge { .. }
        ));

        // The host keeps serving after every fault (fresh instances).
        for _ in 0..5 {
            assert_eq!(
                ok(rt.decide(fault("none")).await.unwrap()).as_deref(),
                Some("127.0.0.7:7")
            );
        }
        assert_eq!(counter(&rt, "policy_traps_total"), 3, "{target}");
    }
}

#[tokio::test]
async fn configuration_time_faults() {
    let t = Instant::now();
    let e = runtime(
        "fault-guest",
        "wasm32-unknown-unknown",
        r#"{"fault":"loop_on_configure"}"#,
    )
    .unwrap_err();
    assert!(matches!(e, PolicyError::GuestTimeout { .. }), "{e}");
    assert!(t.elapsed() < Duration::from_secs(5));
    let e = runtime(
        "fault-guest",
        "wasm32-unknown-unknown",
        r#"{"fault":"reject_configure"}"#,
    )
    .unwrap_err();
    assert!(
        matches!(
            e,
            PolicyError::Rejected {
                phase: "plugin configuration",
                ..
            }
        ),
        "{e}"
    );
    // The fault-guest without a mode panics on requests: the self-test catches it.
    let e = runtime("fault-guest", "wasm32-unknown-unknown", "{}").unwrap_err();
    assert!(matches!(e, PolicyError::SelfTest { .. }), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn swaps_under_concurrent_load_fail_no_request() {
    let rt = runtime("pd-default", "wasm32-unknown-unknown", "{}").unwrap();
    let a = std::fs::read(built_module("pd-default", "wasm32-unknown-unknown")).unwrap();
    let b = std::fs::read(built_module("pd-default", "wasm32-wasip1")).unwrap();
    assert_ne!(sha256_hex(&a), sha256_hex(&b));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let cluster = vec![
        ep("10.0.0.1:1", Role::Decode, "n", 0, true),
        ep("10.0.0.2:1", Role::Prefill, "n", 0, true),
    ];
    let mut load = Vec::new();
    for _ in 0..6 {
        let (rt, stop, cluster) = (rt.clone(), stop.clone(), cluster.clone());
        load.push(tokio::spawn(async move {
            let (mut ok, mut failed) = (0u64, Vec::new());
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                match rt
                    .decide(req(
                        r#"{"prompt":"hi","max_tokens":4}"#,
                        Some(cluster.clone()),
                        Some(100),
                    ))
                    .await
                {
                    Ok(Decision::Route(r)) if r.decode == "10.0.0.1:1" => ok += 1,
                    other => failed.push(format!("{other:?}")),
                }
            }
            (ok, failed)
        }));
    }
    let garbage = b"\0asm\x01\0\0\0garbage".to_vec();
    let fault = std::fs::read(built_module("fault-guest", "wasm32-unknown-unknown")).unwrap();
    for i in 0..8 {
        let (wasm, sha) = if i % 2 == 0 {
            (b.clone(), sha256_hex(&b))
        } else {
            (a.clone(), sha256_hex(&a))
        };
        let info = rt.swap(wasm).await.expect("good module swaps");
        assert_eq!(info.sha256, sha);
        assert_eq!(rt.active().sha256, sha);
        // A bad module never replaces the good one.
        let e = rt.swap(garbage.clone()).await.unwrap_err();
        assert!(matches!(e, PolicyError::Compile { .. }), "{e}");
        let e = rt.swap(fault.clone()).await.unwrap_err();
        assert!(matches!(e, PolicyError::SelfTest { .. }), "{e}");
        assert_eq!(rt.active().sha256, sha);
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut total = 0;
    for h in load {
        let (ok, failed) = h.await.unwrap();
        assert!(
            failed.is_empty(),
            "failed requests during swaps: {failed:?}"
        );
        total += ok;
    }
    assert!(total > 0);
    assert_eq!(counter(&rt, "policy_reloads_total"), 8);
    assert_eq!(counter(&rt, "policy_reload_failures_total"), 16);
}

#[tokio::test]
async fn watch_follows_a_configmap_symlink_swap() {
    let dir = tempfile::tempdir().unwrap();
    let v1 = dir.path().join("v1");
    let v2 = dir.path().join("v2");
    std::fs::create_dir_all(&v1).unwrap();
    std::fs::create_dir_all(&v2).unwrap();
    std::fs::copy(
        built_module("pd-default", "wasm32-unknown-unknown"),
        v1.join("policy.wasm"),
    )
    .unwrap();
    std::fs::copy(
        built_module("pd-default", "wasm32-wasip1"),
        v2.join("policy.wasm"),
    )
    .unwrap();
    std::fs::write(dir.path().join("bad.wasm"), b"not wasm").unwrap();
    // Kubernetes layout: policy.wasm -> ..data/policy.wasm, ..data -> v1.
    std::os::unix::fs::symlink("v1", dir.path().join("..data")).unwrap();
    let link = dir.path().join("policy.wasm");
    std::os::unix::fs::symlink("..data/policy.wasm", &link).unwrap();
    let rt = PolicyRuntime::new(
        PolicySource {
            module: link.clone(),
            config: b"{}".to_vec(),
        },
        SandboxLimits::default(),
    )
    .unwrap();
    let first = rt.active().sha256;
    let watcher = rt.watch(Duration::from_millis(20));
    let swap_data = |to: &str| {
        let tmp = dir.path().join("..data_tmp");
        std::os::unix::fs::symlink(to, &tmp).unwrap();
        std::fs::rename(&tmp, dir.path().join("..data")).unwrap();
    };
    swap_data("v2");
    let want = sha256_hex(&std::fs::read(v2.join("policy.wasm")).unwrap());
    let deadline = Instant::now() + Duration::from_secs(20);
    while rt.active().sha256 != want {
        assert!(
            Instant::now() < deadline,
            "watcher did not pick up the new module"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_ne!(first, want);
    assert_eq!(rt.active().path.as_deref(), Some(link.as_path()));
    // A bad file is reported and the good module stays.
    std::fs::copy(dir.path().join("bad.wasm"), v1.join("policy.wasm")).unwrap();
    swap_data("v1");
    let deadline = Instant::now() + Duration::from_secs(20);
    while counter(&rt, "policy_reload_failures_total") == 0 {
        assert!(
            Instant::now() < deadline,
            "watcher did not report the bad module"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(rt.active().sha256, want);
    watcher.abort();
}

async fn call(
    router: axum::Router,
    method: &str,
    token: Option<&str>,
    body: Vec<u8>,
) -> (u16, serde_json::Value) {
    use http_body_util::BodyExt;
    let mut b = axum::http::Request::builder()
        .method(method)
        .uri("/admin/policy");
    if let Some(t) = token {
        b = b.header("authorization", format!("Bearer {t}"));
    }
    let resp = router
        .oneshot(b.body(axum::body::Body::from(body)).unwrap())
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null),
    )
}

#[tokio::test]
async fn admin_api() {
    let rt = runtime("pd-default", "wasm32-unknown-unknown", "{}").unwrap();
    let (s, v) = call(admin_router(rt.clone(), None), "GET", None, vec![]).await;
    assert_eq!(s, 404);
    assert!(v["error"]["message"].as_str().unwrap().contains("off"));
    let router = admin_router(rt.clone(), Some("s3cret".into()));
    // GET needs the token too.
    let (s, v) = call(router.clone(), "GET", None, vec![]).await;
    assert_eq!(
        (s, v["error"]["type"].as_str()),
        (401, Some("authentication_error"))
    );
    let (s, _) = call(router.clone(), "GET", Some("wrong"), vec![]).await;
    assert_eq!(s, 401);
    let (s, v) = call(router.clone(), "GET", Some("s3cret"), vec![]).await;
    assert_eq!(s, 200);
    assert_eq!(v["sha256"], rt.active().sha256);
    assert!(v["previous"].is_null(), "{v}");
    let wasip1 = std::fs::read(built_module("pd-default", "wasm32-wasip1")).unwrap();
    let (s, v) = call(router.clone(), "PUT", Some("wrong"), wasip1.clone()).await;
    assert_eq!(
        (s, v["error"]["type"].as_str()),
        (401, Some("authentication_error"))
    );
    let (s, v) = call(router.clone(), "PUT", Some("s3cret"), b"junk".to_vec()).await;
    assert_eq!(s, 422);
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("module rejected"),
        "{v}"
    );
    let (s, v) = call(router.clone(), "PUT", Some("s3cret"), wasip1.clone()).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["sha256"], sha256_hex(&wasip1));
    let (_, v) = call(router, "GET", Some("s3cret"), vec![]).await;
    assert_eq!(v["sha256"], sha256_hex(&wasip1));
    assert!(v["path"].is_null());
    // The module it replaced is what a rollback would restore.
    assert_eq!(
        v["previous"]["sha256"],
        sha256_hex(&std::fs::read(built_module("pd-default", "wasm32-unknown-unknown")).unwrap())
    );
}

#[test]
fn check_reports_decisions() {
    let report = check(&built_module("pd-default", "wasm32-wasip1"), b"{}").unwrap();
    assert!(
        report.contains("route  decode=10.0.0.2:8001 prefill=10.0.0.3:8002 transport=shm"),
        "{report}"
    );
    assert!(report.contains("reject 400"), "{report}");
    let e = check(
        &built_module("fault-guest", "wasm32-unknown-unknown"),
        b"{}",
    )
    .unwrap_err();
    assert!(e.to_string().contains("deliberate panic"), "{e}");
}
