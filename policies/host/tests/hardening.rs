//! The policy host at runtime against modules that pass the self-test and
//! misbehave later (built here, `guest/`): one time budget across a
//! decision's callbacks, caps on host memory a guest can grow, rollback of a
//! hot-swapped module after runtime traps, and the admin API under abuse.

mod guest;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rngd_policy_core::Decision;
use rngd_policy_host::{
    AdminOptions, AdminToken, PolicyError, PolicyRequest, PolicyRuntime, PolicySource,
    SandboxLimits, admin, admin_router_with, sha256_hex,
};
use tower::ServiceExt;

use guest::Spec;

fn counter(rt: &PolicyRuntime, name: &str) -> u64 {
    rt.registry()
        .gather()
        .iter()
        .find(|m| m.name() == name)
        .map(|m| m.get_metric()[0].get_counter().get_value() as u64)
        .unwrap_or_else(|| panic!("metric {name} not registered"))
}

fn cap_hits(rt: &PolicyRuntime, cap: &str) -> u64 {
    rt.registry()
        .gather()
        .iter()
        .filter(|m| m.name() == "policy_host_cap_hits_total")
        .flat_map(|m| m.get_metric().iter())
        .find(|m| m.get_label().iter().any(|l| l.value() == cap))
        .map_or(0, |m| m.get_counter().get_value() as u64)
}

/// Writes `wasm` to `path` as a new file (rename over the old one, as a
/// deployment does), so a watcher sees a change even for equal bytes.
fn install(path: &Path, wasm: &[u8]) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, wasm).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

fn runtime_of(dir: &Path, spec: &Spec, limits: SandboxLimits) -> Arc<PolicyRuntime> {
    let path = dir.join("policy.wasm");
    install(&path, &guest::module(spec));
    PolicyRuntime::new(
        PolicySource {
            module: path,
            config: b"{}".to_vec(),
        },
        limits,
    )
    .unwrap_or_else(|e| panic!("{spec:?} loads: {e}"))
}

/// Default limits with a decision budget no descheduled test thread spends
/// (for the tests that are not about the budget).
fn generous() -> SandboxLimits {
    SandboxLimits {
        decision_budget: Duration::from_secs(2),
        ..SandboxLimits::default()
    }
}

fn request(headers: &[&str], body: &str) -> PolicyRequest {
    let mut h = vec![
        (":method".to_string(), "POST".to_string()),
        (":path".to_string(), "/v1/completions".to_string()),
    ];
    h.extend(headers.iter().map(|n| (n.to_string(), "1".to_string())));
    PolicyRequest {
        headers: h,
        body: body.as_bytes().to_vec(),
        endpoints: None,
        prompt_tokens: None,
        ..PolicyRequest::default()
    }
}

fn decode_of(d: &Decision) -> &str {
    d.route().map(|r| r.decode.as_str()).unwrap_or("(rejected)")
}

async fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !done() {
        assert!(Instant::now() < deadline, "within 20 s: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn one_budget_covers_all_callbacks_of_a_decision() {
    let dir = tempfile::tempdir().unwrap();
    // 60 ms in the headers callback and 60 ms in the body callback: each is
    // well within the per-call timeout (1 s) and within the budget
    // (100 ms), both together are not.
    let slow = Spec {
        slow_headers_ms: 60,
        slow_body_ms: 60,
        ..Spec::default()
    };
    let limits = SandboxLimits {
        call_timeout: Duration::from_secs(1),
        decision_budget: Duration::from_millis(100),
        ..SandboxLimits::default()
    };
    let rt = runtime_of(dir.path(), &slow, limits.clone());
    let t = Instant::now();
    let e = rt
        .decide(request(&["x-slow"], r#"{"prompt":"x"}"#))
        .await
        .unwrap_err();
    let took = t.elapsed();
    match &e {
        PolicyError::DecisionBudget {
            budget, callback, ..
        } => {
            assert_eq!(*budget, Duration::from_millis(100));
            assert_eq!(*callback, "proxy_on_request_body");
        }
        other => panic!("wanted DecisionBudget, got {other}"),
    }
    assert!(e.is_guest_fault());
    assert_eq!(e.http_status(), 500);
    assert!(e.to_string().contains("budget"), "{e}");
    // Stopped by the budget, not by the 1 s call timeout.
    assert!(took < Duration::from_millis(900), "stopped after {took:?}");
    assert_eq!(counter(&rt, "policy_traps_total"), 1);
    // One slow callback alone is within the budget.
    let d = rt.decide(request(&["x-slow"], "")).await.unwrap();
    assert_eq!(decode_of(&d), "10.0.0.1:1");
    // A fresh instance serves the next decision; the budget starts anew.
    let d = rt.decide(request(&[], r#"{"prompt":"x"}"#)).await.unwrap();
    assert_eq!(decode_of(&d), "10.0.0.1:1");

    // Under a larger budget the same slow decision is fine.
    let dir = tempfile::tempdir().unwrap();
    let rt = runtime_of(
        dir.path(),
        &slow,
        SandboxLimits {
            decision_budget: Duration::from_millis(600),
            ..limits
        },
    );
    let d = rt
        .decide(request(&["x-slow"], r#"{"prompt":"x"}"#))
        .await
        .unwrap();
    assert_eq!(decode_of(&d), "10.0.0.1:1");
    assert_eq!(counter(&rt, "policy_traps_total"), 0);
}

#[tokio::test]
async fn a_module_over_the_budget_fails_its_self_test() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("policy.wasm");
    install(
        &path,
        &guest::module(&Spec {
            slow_headers_ms: 30,
            slow_always: true,
            ..Spec::default()
        }),
    );
    let e = PolicyRuntime::new(
        PolicySource {
            module: path,
            config: b"{}".to_vec(),
        },
        SandboxLimits {
            decision_budget: Duration::from_millis(20),
            ..SandboxLimits::default()
        },
    )
    .unwrap_err();
    match e {
        PolicyError::SelfTest { source, .. } => {
            assert!(
                matches!(*source, PolicyError::DecisionBudget { .. }),
                "{source}"
            )
        }
        other => panic!("wanted a self-test failure, got {other}"),
    }
}

#[tokio::test]
async fn a_single_slow_callback_is_still_the_call_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let spec = Spec {
        slow_headers_ms: 2_000,
        ..Spec::default()
    };
    let rt = runtime_of(
        dir.path(),
        &spec,
        SandboxLimits {
            call_timeout: Duration::from_millis(100),
            decision_budget: Duration::from_secs(5),
            ..SandboxLimits::default()
        },
    );
    let e = rt.decide(request(&["x-slow"], "")).await.unwrap_err();
    assert!(matches!(e, PolicyError::GuestTimeout { .. }), "{e}");
}

fn report(d: &Decision, name: &str) -> u32 {
    let r = d.route().expect("the greedy guest still routes");
    let v = r
        .headers
        .iter()
        .find(|(k, _)| k == name)
        .unwrap_or_else(|| panic!("no {name} in {:?}", r.headers));
    guest::number(&v.1)
}

#[tokio::test]
async fn host_memory_a_guest_grows_is_capped() {
    const BAD_ARGUMENT: u32 = 2;
    let greedy = Spec {
        greedy: true,
        ..Spec::default()
    };
    // Entry and count caps.
    let dir = tempfile::tempdir().unwrap();
    let rt = runtime_of(
        dir.path(),
        &greedy,
        SandboxLimits {
            instances: 1,
            decision_budget: Duration::from_secs(2),
            max_shared_entries: 50,
            log_lines_per_second: 20,
            ..SandboxLimits::default()
        },
    );
    let d = rt.decide(request(&["x-greedy"], "")).await.unwrap();
    assert_eq!(report(&d, "x-shared-ok"), 50);
    assert_eq!(report(&d, "x-shared-status"), BAD_ARGUMENT);
    // Destination and the 7 report headers, then new names up to 64.
    let headers = &d.route().unwrap().headers;
    assert_eq!(headers.len(), 64, "{headers:?}");
    assert_eq!(report(&d, "x-headers-ok"), 64 - 8);
    assert_eq!(report(&d, "x-headers-status"), BAD_ARGUMENT);
    // A 1 MiB log line is refused (cap 4 KiB); the line rate stops the rest.
    assert_eq!(report(&d, "x-log-big-status"), BAD_ARGUMENT);
    let logged = report(&d, "x-log-ok");
    assert!((1..=21).contains(&logged), "{logged} lines logged");
    assert_eq!(report(&d, "x-log-status"), BAD_ARGUMENT);
    for cap in ["shared_data", "headers", "log_size", "log_rate"] {
        assert_eq!(cap_hits(&rt, cap), 1, "{cap}");
    }
    // The same instance again: its 50 keys can be overwritten, the first
    // new key is refused (nothing more is kept); headers are per decision,
    // so they start over (and are capped again).
    let d = rt.decide(request(&["x-greedy"], "")).await.unwrap();
    assert_eq!(report(&d, "x-shared-ok"), 50);
    assert_eq!(report(&d, "x-shared-status"), BAD_ARGUMENT);
    assert_eq!(report(&d, "x-headers-ok"), 64 - 8);
    assert_eq!(cap_hits(&rt, "shared_data"), 2);
    assert_eq!(counter(&rt, "policy_traps_total"), 0);

    // Byte caps.
    let dir = tempfile::tempdir().unwrap();
    let rt = runtime_of(
        dir.path(),
        &greedy,
        SandboxLimits {
            decision_budget: Duration::from_secs(2),
            max_shared_bytes: 10_000,
            max_set_header_bytes: 2_000,
            ..SandboxLimits::default()
        },
    );
    let d = rt.decide(request(&["x-greedy"], "")).await.unwrap();
    // Key 11 bytes + value 1024 per entry.
    assert_eq!(report(&d, "x-shared-ok"), 10_000 / 1035);
    assert_eq!(report(&d, "x-shared-status"), BAD_ARGUMENT);
    let bytes: usize = d
        .route()
        .unwrap()
        .headers
        .iter()
        .map(|(k, v)| k.len() + v.len())
        .sum();
    assert!(bytes <= 2_000, "{bytes} bytes of headers kept");
    assert!(bytes + 111 > 2_000, "refused with room left: {bytes}");
    assert_eq!(report(&d, "x-headers-status"), BAD_ARGUMENT);
}

#[tokio::test]
async fn runtime_traps_roll_a_swapped_module_back() {
    let dir = tempfile::tempdir().unwrap();
    let good = guest::module(&Spec::default());
    let bad = guest::module(&Spec {
        destination: "10.0.0.2:1",
        trap_on: Some("x-trap"),
        ..Spec::default()
    });
    let rt = runtime_of(dir.path(), &Spec::default(), generous());
    let path = dir.path().join("policy.wasm");
    let watcher = rt.watch(Duration::from_millis(20));
    // The bad module passes the self-test and is swapped in from its file.
    install(&path, &bad);
    wait_for("the bad module swapped in", || {
        rt.active().sha256 == sha256_hex(&bad)
    })
    .await;
    assert_eq!(
        rt.previous().map(|p| p.sha256),
        Some(sha256_hex(&good)),
        "the module a rollback restores"
    );
    let d = rt.decide(request(&[], "")).await.unwrap();
    assert_eq!(decode_of(&d), "10.0.0.2:1");
    // Four traps: still active.
    for _ in 0..4 {
        let e = rt.decide(request(&["x-trap"], "")).await.unwrap_err();
        assert!(matches!(e, PolicyError::GuestTrap { .. }), "{e}");
    }
    assert_eq!(rt.active().sha256, sha256_hex(&bad));
    assert_eq!(counter(&rt, "policy_rollbacks_total"), 0);
    // The fifth within the window rolls it back.
    let e = rt.decide(request(&["x-trap"], "")).await.unwrap_err();
    assert!(matches!(e, PolicyError::GuestTrap { .. }), "{e}");
    assert_eq!(rt.active().sha256, sha256_hex(&good));
    assert_eq!(counter(&rt, "policy_rollbacks_total"), 1);
    assert_eq!(counter(&rt, "policy_traps_total"), 5);
    assert!(rt.previous().is_none(), "a restored module has no fallback");
    // The next decisions run the previous module (which has no trap).
    let d = rt.decide(request(&[], "")).await.unwrap();
    assert_eq!(decode_of(&d), "10.0.0.1:1");
    let d = rt.decide(request(&["x-trap"], "")).await.unwrap();
    assert_eq!(decode_of(&d), "10.0.0.1:1");

    // The bad module's file, even rewritten with the same bytes, is not
    // loaded again; observed for 1 s (50 watch periods).
    install(&path, &bad);
    let until = Instant::now() + Duration::from_secs(1);
    while Instant::now() < until {
        assert_eq!(rt.active().sha256, sha256_hex(&good));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(counter(&rt, "policy_reloads_total"), 1);
    // A changed file is loaded.
    let next = guest::module(&Spec {
        destination: "10.0.0.3:1",
        ..Spec::default()
    });
    install(&path, &next);
    wait_for("the next module swapped in", || {
        rt.active().sha256 == sha256_hex(&next)
    })
    .await;
    let d = rt.decide(request(&[], "")).await.unwrap();
    assert_eq!(decode_of(&d), "10.0.0.3:1");
    assert_eq!(counter(&rt, "policy_reloads_total"), 2);
    watcher.abort();
}

#[tokio::test]
async fn the_first_module_is_kept_and_its_traps_counted() {
    let dir = tempfile::tempdir().unwrap();
    let rt = runtime_of(
        dir.path(),
        &Spec {
            trap_on: Some("x-trap"),
            ..Spec::default()
        },
        generous(),
    );
    let first = rt.active().sha256;
    for _ in 0..12 {
        rt.decide(request(&["x-trap"], "")).await.unwrap_err();
    }
    assert_eq!(rt.active().sha256, first);
    assert_eq!(counter(&rt, "policy_traps_total"), 12);
    assert_eq!(counter(&rt, "policy_rollbacks_total"), 0);
    let d = rt.decide(request(&[], "")).await.unwrap();
    assert_eq!(decode_of(&d), "10.0.0.1:1");
}

#[tokio::test]
async fn traps_spread_beyond_the_window_do_not_roll_back() {
    let dir = tempfile::tempdir().unwrap();
    let rt = runtime_of(
        dir.path(),
        &Spec::default(),
        SandboxLimits {
            rollback_after: 2,
            rollback_window: Duration::from_millis(100),
            ..generous()
        },
    );
    let bad = guest::module(&Spec {
        destination: "10.0.0.2:1",
        trap_on: Some("x-trap"),
        ..Spec::default()
    });
    rt.swap(bad.clone()).await.unwrap();
    for _ in 0..3 {
        rt.decide(request(&["x-trap"], "")).await.unwrap_err();
        // Past the window before the next fault.
        let t = Instant::now();
        while t.elapsed() <= Duration::from_millis(150) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    assert_eq!(rt.active().sha256, sha256_hex(&bad));
    assert_eq!(counter(&rt, "policy_rollbacks_total"), 0);
    // Two in a row are.
    rt.decide(request(&["x-trap"], "")).await.unwrap_err();
    rt.decide(request(&["x-trap"], "")).await.unwrap_err();
    assert_eq!(counter(&rt, "policy_rollbacks_total"), 1);
    assert_ne!(rt.active().sha256, sha256_hex(&bad));
}

async fn call(
    router: &axum::Router,
    method: &str,
    token: Option<&str>,
    body: Vec<u8>,
) -> axum::http::Response<axum::body::Body> {
    let mut b = axum::http::Request::builder()
        .method(method)
        .uri("/admin/policy");
    if let Some(t) = token {
        b = b.header("authorization", format!("Bearer {t}"));
    }
    router
        .clone()
        .oneshot(b.body(axum::body::Body::from(body)).unwrap())
        .await
        .unwrap()
}

#[tokio::test]
async fn admin_api_under_abuse() {
    let dir = tempfile::tempdir().unwrap();
    let rt = runtime_of(dir.path(), &Spec::default(), generous());
    let token = "the-right-token-0123456789";
    let options = AdminOptions {
        token: AdminToken::new(token),
        max_failures: 10,
        failure_window: Duration::from_secs(60),
        lockout: Duration::from_millis(300),
        ..AdminOptions::default()
    };
    let shown = format!("{options:?}");
    assert!(!shown.contains(token), "{shown}");
    let router = admin_router_with(rt.clone(), options.clone());
    let next = guest::module(&Spec {
        destination: "10.0.0.5:1",
        ..Spec::default()
    });
    let started = Instant::now();
    let (mut unauthorized, mut throttled) = (0u64, 0u64);
    for i in 0..10_000usize {
        // Wrong tokens of every length around the right one, near misses,
        // no token at all; GET and PUT.
        let wrong = match i % 4 {
            0 => format!("{}x", &token[..i % token.len()]),
            1 => token.replace('0', "1"),
            2 => format!("{token}{i}"),
            _ => String::new(),
        };
        let method = if i % 2 == 0 { "GET" } else { "PUT" };
        let t = (i % 4 != 3).then_some(wrong.as_str());
        let resp = call(&router, method, t, next.clone()).await;
        match resp.status().as_u16() {
            401 => unauthorized += 1,
            429 => {
                assert!(resp.headers().contains_key("retry-after"));
                throttled += 1;
            }
            other => panic!("attempt {i}: {other}"),
        }
        if i < 10 {
            assert_eq!(resp.status(), 401, "attempt {i} before the lockout");
        }
    }
    assert!(
        throttled > 0 && unauthorized >= 10,
        "{unauthorized} / {throttled}"
    );
    assert_eq!(
        counter(&rt, "policy_admin_auth_failures_total"),
        unauthorized
    );
    assert_eq!(counter(&rt, "policy_admin_throttled_total"), throttled);
    assert_eq!(counter(&rt, "policy_reloads_total"), 0);
    // The right token swaps once the lockout is over.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let resp = call(&router, "PUT", Some(token), next.clone()).await;
        if resp.status() == 200 {
            break;
        }
        assert_eq!(resp.status(), 429);
        assert!(Instant::now() < deadline, "the right token within 10 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(rt.active().sha256, sha256_hex(&next));
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "{:?}",
        started.elapsed()
    );
}

/// One HTTP/1.1 request on a fresh connection; the status code.
async fn raw_status(addr: std::net::SocketAddr, request: &str) -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(request.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).await.unwrap();
    let text = String::from_utf8_lossy(&out);
    text.split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status in {text:?}"))
}

#[tokio::test]
async fn admin_listener_of_its_own() {
    let dir = tempfile::tempdir().unwrap();
    let rt = runtime_of(dir.path(), &Spec::default(), generous());
    let server = admin::serve(
        rt.clone(),
        AdminOptions {
            listen: "127.0.0.1:0".parse().unwrap(),
            token: AdminToken::new("tok"),
            ..AdminOptions::default()
        },
    )
    .await
    .unwrap();
    let addr = server.local_addr();
    assert!(addr.ip().is_loopback());
    assert_eq!(admin::DEFAULT_ADMIN_LISTEN.ip().to_string(), "127.0.0.1");
    let get = |auth: &str| {
        format!("GET /admin/policy HTTP/1.1\r\nhost: x\r\n{auth}connection: close\r\n\r\n")
    };
    assert_eq!(raw_status(addr, &get("")).await, 401);
    assert_eq!(
        raw_status(addr, &get("authorization: Bearer nope\r\n")).await,
        401
    );
    assert_eq!(
        raw_status(addr, &get("authorization: Bearer tok\r\n")).await,
        200
    );
    // Every method is authenticated first.
    let delete = |auth: &str| {
        format!("DELETE /admin/policy HTTP/1.1\r\nhost: x\r\n{auth}connection: close\r\n\r\n")
    };
    assert_eq!(raw_status(addr, &delete("")).await, 401);
    assert_eq!(
        raw_status(addr, &delete("authorization: Bearer tok\r\n")).await,
        405
    );
    assert_eq!(
        raw_status(
            addr,
            "GET /v1/models HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
        )
        .await,
        404,
        "only the admin API is served there"
    );
    server.shutdown().await;
    assert!(tokio::net::TcpStream::connect(addr).await.is_err());
}
