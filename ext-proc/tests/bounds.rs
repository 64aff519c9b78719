//! The picker bounds its work before doing it: a body over the limit is
//! refused as soon as its declared or received size passes it; requests get
//! a slot (or wait in a bounded queue, or get 429 with `Retry-After`) and
//! reserve their body bytes from a global budget before anything is
//! buffered; a client's model string never becomes a metric label value.
//! Each test also checks that a normal request still works afterwards.

mod common;

use std::time::Duration;

use common::*;
use rngd_pool::admission::AdmissionOptions;

const BODY: &[u8] = br#"{"model":"m","prompt":"hi","max_tokens":2}"#;

fn limits(max_concurrent: usize, max_queued: usize, budget: usize) -> PickerLimits {
    PickerLimits {
        admission: AdmissionOptions {
            max_concurrent,
            max_queued,
            queue_timeout: Duration::from_millis(200),
            max_inflight_body_bytes: budget,
        },
        served_models: vec![],
    }
}

fn small_bodies(max_body_bytes: usize) -> ProcessorConfig {
    ProcessorConfig {
        max_body_bytes,
        ..ProcessorConfig::default()
    }
}

async fn a_normal_request_routes(h: &Harness) {
    let resps = exchange(
        h.server.grpc_addr,
        vec![
            post_headers_with_length(BodySendMode::FullDuplexStreamed, BODY.len()),
            body_msg(BODY, true),
        ],
    )
    .await;
    assert_eq!(immediate_status(&resps), None, "{resps:?}");
    assert_eq!(
        header_value(&resps[0], "x-gateway-destination-endpoint").as_deref(),
        Some("10.0.0.2:8000")
    );
}

fn error_code(body: &[u8]) -> String {
    let v: serde_json::Value = serde_json::from_slice(body).expect("JSON error body");
    v["error"]["code"].as_str().unwrap_or_default().to_string()
}

#[tokio::test]
async fn a_declared_over_limit_body_is_413_at_the_headers() {
    let h = harness_with(
        default_endpoints(),
        false,
        PickerLimits::default(),
        small_bodies(1000),
    )
    .await;
    for mode in [BodySendMode::FullDuplexStreamed, BodySendMode::Buffered] {
        // Only the headers are sent: the answer comes without any body byte.
        let mut s = OpenStream::open(h.server.grpc_addr).await;
        s.send(post_headers_with_length(mode, 8 << 20)).await;
        let r = s.next().await.expect("an answer to the headers alone");
        let (status, body) = immediate_status(&[r]).expect("immediate response");
        assert_eq!(status, 413);
        assert_eq!(error_code(&body), "request_too_large");
        assert!(s.next().await.is_none(), "the stream is closed");
    }
    assert!(h.policy.seen.lock().unwrap().is_empty(), "no pick ran");
    assert_eq!(h.metrics.picks.with_label_values(&["reject_413"]).get(), 2);
    assert_eq!(h.picker.admission().body_bytes_in_flight(), 0);
    a_normal_request_routes(&h).await;
}

#[tokio::test]
async fn an_undeclared_body_is_413_once_it_passes_the_limit() {
    let h = harness_with(
        default_endpoints(),
        false,
        PickerLimits::default(),
        small_bodies(1000),
    )
    .await;
    let mut s = OpenStream::open(h.server.grpc_addr).await;
    s.send(post_headers(BodySendMode::FullDuplexStreamed)).await;
    s.send(body_msg(&[b' '; 600], false)).await;
    // 600 bytes are under the limit: held, reserved, unanswered.
    until("600 bytes reserved", || {
        h.picker.admission().body_bytes_in_flight() == 600
    })
    .await;
    s.send(body_msg(&[b' '; 600], false)).await;
    let r = s.next().await.expect("answer");
    assert_eq!(immediate_status(&[r]).map(|x| x.0), Some(413));
    assert!(s.next().await.is_none());
    until("the reservation returned", || {
        h.picker.admission().body_bytes_in_flight() == 0
    })
    .await;
    a_normal_request_routes(&h).await;
}

#[tokio::test]
async fn beyond_the_slots_and_the_queue_a_request_gets_429_with_retry_after() {
    let h = harness_with(
        default_endpoints(),
        false,
        limits(1, 1, usize::MAX),
        ProcessorConfig::default(),
    )
    .await;
    let has = |line: &str| h.metrics.render().lines().any(|l| l == line);
    // A holds the only slot (its body is not complete).
    let a = OpenStream::open(h.server.grpc_addr).await;
    a.send(post_headers(BodySendMode::FullDuplexStreamed)).await;
    until("A holds the slot", || has("rngd_pd_epp_in_flight 1")).await;
    // B waits in the one queue place.
    let mut b = OpenStream::open(h.server.grpc_addr).await;
    b.send(post_headers(BodySendMode::FullDuplexStreamed)).await;
    until("B waits", || has("rngd_pd_epp_queued 1")).await;
    // C finds the queue full: 429 at once, with Retry-After and a JSON body.
    let resps = exchange(
        h.server.grpc_addr,
        vec![
            post_headers(BodySendMode::FullDuplexStreamed),
            body_msg(BODY, true),
        ],
    )
    .await;
    let (status, body) = immediate_status(&resps).expect("immediate");
    assert_eq!(status, 429);
    assert_eq!(error_code(&body), "server_overloaded");
    let hdrs = immediate_headers(&resps);
    assert!(
        hdrs.iter().any(|(k, v)| k == "retry-after" && v == "1"),
        "{hdrs:?}"
    );
    // B's wait runs out (200 ms): 429 too.
    let r = b.next().await.expect("B answered");
    assert_eq!(immediate_status(&[r]).map(|x| x.0), Some(429));
    // A completes normally, and frees its slot at its pick.
    a.send(body_msg(BODY, true)).await;
    let mut a = a;
    let r = a.next().await.expect("A answered");
    assert_eq!(
        header_value(&r, "x-gateway-destination-endpoint").as_deref(),
        Some("10.0.0.2:8000")
    );
    let text = h.metrics.render();
    for want in [
        "rngd_pd_epp_overload_rejections_total{reason=\"queue_full\"} 1",
        "rngd_pd_epp_overload_rejections_total{reason=\"queue_timeout\"} 1",
        "rngd_pd_epp_picks_total{result=\"reject_429\"} 2",
        "rngd_pd_epp_in_flight 0",
    ] {
        assert!(text.contains(want), "{want}\n{text}");
    }
    a_normal_request_routes(&h).await;
}

#[tokio::test]
async fn the_body_budget_refuses_before_buffering() {
    let h = harness_with(
        default_endpoints(),
        false,
        limits(64, 64, 1000),
        ProcessorConfig::default(),
    )
    .await;
    // A declares 800 bytes: reserved up front, though none arrived yet.
    let a = OpenStream::open(h.server.grpc_addr).await;
    a.send(post_headers_with_length(
        BodySendMode::FullDuplexStreamed,
        800,
    ))
    .await;
    until("A's 800 bytes reserved", || {
        h.picker.admission().body_bytes_in_flight() == 800
    })
    .await;
    // B declares 300: past the budget, refused at its headers.
    let mut b = OpenStream::open(h.server.grpc_addr).await;
    b.send(post_headers_with_length(
        BodySendMode::FullDuplexStreamed,
        300,
    ))
    .await;
    let r = b.next().await.expect("B answered");
    let (status, body) = immediate_status(&[r]).expect("immediate");
    assert_eq!(status, 429);
    assert_eq!(error_code(&body), "server_overloaded");
    // C declares nothing: its chunks grow its reservation until one does not fit.
    let mut c = OpenStream::open(h.server.grpc_addr).await;
    c.send(post_headers(BodySendMode::FullDuplexStreamed)).await;
    c.send(body_msg(&[b' '; 150], false)).await;
    until("C's 150 bytes reserved", || {
        h.picker.admission().body_bytes_in_flight() == 950
    })
    .await;
    c.send(body_msg(&[b' '; 100], false)).await;
    let r = c.next().await.expect("C answered");
    assert_eq!(immediate_status(&[r]).map(|x| x.0), Some(429));
    until("C's bytes returned", || {
        h.picker.admission().body_bytes_in_flight() == 800
    })
    .await;
    // A's client goes away: its reservation goes back with the stream.
    drop(a);
    until("A's bytes returned", || {
        h.picker.admission().body_bytes_in_flight() == 0
    })
    .await;
    assert!(
        h.metrics
            .render()
            .contains("rngd_pd_epp_overload_rejections_total{reason=\"body_budget\"} 2")
    );
    a_normal_request_routes(&h).await;
}

#[tokio::test]
async fn random_model_names_never_become_label_values() {
    let h = harness(default_endpoints(), false).await;
    a_normal_request_routes(&h).await;
    let before = h.metrics.render();
    for i in 0..300 {
        let model = format!("client-model-{i:04}-{}", "z".repeat(40));
        // Half refused as unknown models (404), half by a request rule
        // first (bad temperature: 400).
        let body = if i % 2 == 0 {
            format!(r#"{{"model":"{model}","prompt":"hi"}}"#)
        } else {
            format!(r#"{{"model":"{model}","prompt":"hi","temperature":-1}}"#)
        };
        let resps = exchange(
            h.server.grpc_addr,
            vec![
                post_headers(BodySendMode::FullDuplexStreamed),
                body_msg(body.as_bytes(), true),
            ],
        )
        .await;
        assert_eq!(
            immediate_status(&resps).map(|s| s.0),
            Some(if i % 2 == 1 { 400 } else { 404 })
        );
    }
    let after = h.metrics.render();
    assert!(!after.contains("client-model"), "{after}");
    // The served model ("m", the tokenizer's) and `other`: a bounded page
    // (before the fix every model added ~50 lines of histogram buckets).
    assert!(
        after.len() < before.len() + 20_000,
        "/metrics grew from {} to {} bytes",
        before.len(),
        after.len()
    );
    assert!(after.contains(
        "inference_objective_request_total{model_name=\"other\",target_model_name=\"other\"} 300"
    ));
    for code in [400, 404] {
        assert!(after.contains(&format!(
            "inference_objective_request_error_total{{error_code=\"{code}\",model_name=\"other\",target_model_name=\"other\"}} 150"
        )));
    }
    assert!(
        after.contains(
            "inference_objective_request_total{model_name=\"m\",target_model_name=\"m\"} 1"
        )
    );
    let r = rngd_telemetry::promtool::check(&after);
    assert_eq!(r.code, Some(0), "promtool: {:?}", r.findings);
}

#[tokio::test]
async fn an_unknown_model_is_a_404_naming_the_served_ones_before_the_policy() {
    let mut l = limits(8, 8, 1 << 20);
    l.served_models = vec!["alias".into()];
    let h = harness_with(default_endpoints(), false, l, ProcessorConfig::default()).await;
    for (model, status) in [("gpt-4o", Some(404)), ("alias", None), ("m", None)] {
        let body = format!(r#"{{"model":"{model}","prompt":"hi","max_tokens":2}}"#);
        let resps = exchange(
            h.server.grpc_addr,
            vec![
                post_headers(BodySendMode::FullDuplexStreamed),
                body_msg(body.as_bytes(), true),
            ],
        )
        .await;
        let got = immediate_status(&resps);
        assert_eq!(got.as_ref().map(|s| s.0), status, "{model}");
        if let Some((_, body)) = got {
            assert_eq!(error_code(&body), "model_not_found");
            let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
            assert_eq!(v["error"]["param"], "model");
            let msg = v["error"]["message"].as_str().unwrap();
            assert!(
                msg.contains("'gpt-4o'") && msg.ends_with("m, alias"),
                "{msg}"
            );
        }
    }
    // Only the two served requests reached the policy.
    assert_eq!(h.policy.seen.lock().unwrap().len(), 2);
}
