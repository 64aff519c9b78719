//! The ext_proc request path driven over gRPC by an in-process tonic client:
//! full duplex and buffered bodies, PD routes, bad bodies, large bodies,
//! subset hints, policy rejects and failures. Responses, trailers, listeners
//! and serving modes are in `serving.rs`.

mod common;

use common::*;

#[tokio::test]
async fn full_duplex_body_in_many_chunks_is_picked_and_resent() {
    let h = harness(default_endpoints(), false).await;
    let body = br#"{"model":"m","prompt":"one two three four","max_tokens":4}"#;
    let mut msgs = vec![post_headers(BodySendMode::FullDuplexStreamed)];
    let pieces: Vec<&[u8]> = body.chunks(5).collect();
    let n = pieces.len();
    for (i, c) in pieces.into_iter().enumerate() {
        msgs.push(body_msg(c, i + 1 == n));
    }
    let resps = exchange(h.server.grpc_addr, msgs).await;

    let first = &resps[0];
    assert!(
        matches!(
            first.response,
            Some(processing_response::Response::RequestHeaders(_))
        ),
        "headers response first, got {first:?}"
    );
    let common = match &first.response {
        Some(processing_response::Response::RequestHeaders(x)) => x.response.clone().unwrap(),
        _ => unreachable!(),
    };
    assert!(common.clear_route_cache);
    assert_eq!(
        header_value(first, "x-gateway-destination-endpoint").as_deref(),
        Some("10.0.0.2:8000")
    );
    assert_eq!(
        header_value(first, "content-length"),
        Some(body.len().to_string())
    );
    assert_eq!(lb_destination(first).as_deref(), Some("10.0.0.2:8000"));
    let rm = removed(first);
    assert!(
        rm.contains(&"x-prefiller-host-port".to_string()),
        "client-sent PD headers are stripped: {rm:?}"
    );

    let chunks = streamed_chunks(&resps);
    let joined: Vec<u8> = chunks.iter().flat_map(|(b, _)| b.clone()).collect();
    assert_eq!(joined, body.to_vec());
    assert!(chunks.last().unwrap().1, "last chunk carries end_of_stream");
    assert!(chunks[..chunks.len() - 1].iter().all(|(_, e)| !e));

    let seen = h.policy.seen.lock().unwrap();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].prompt_tokens, Some(4));
    assert_eq!(seen[0].body, body.to_vec());
    assert!(
        seen[0]
            .headers
            .iter()
            .any(|(k, v)| k == ":path" && v == "/v1/completions")
    );
    assert_eq!(h.metrics.picks.with_label_values(&["route"]).get(), 1);
}

#[tokio::test]
async fn pd_route_sets_prefiller_and_transport() {
    let h = harness(default_endpoints(), false).await;
    let body = br#"{"model":"m","prompt":"hi"}"#;
    let mut hdrs = post_headers(BodySendMode::FullDuplexStreamed);
    if let Some(processing_request::Request::RequestHeaders(x)) = hdrs.request.as_mut() {
        x.headers.as_mut().unwrap().headers.push(HeaderValue {
            key: "x-want-pd".into(),
            value: String::new(),
            raw_value: b"1".to_vec(),
        });
    }
    let resps = exchange(h.server.grpc_addr, vec![hdrs, body_msg(body, true)]).await;
    assert_eq!(
        header_value(&resps[0], "x-prefiller-host-port").as_deref(),
        Some("10.0.0.1:8000")
    );
    assert_eq!(
        header_value(&resps[0], "x-rngd-pd-kv-transport").as_deref(),
        Some("shm")
    );
    assert_eq!(
        header_value(&resps[0], "x-gateway-destination-endpoint").as_deref(),
        Some("10.0.0.2:8000")
    );
    // Only the steering header the route does not set is removed.
    assert_eq!(
        removed(&resps[0]),
        ["x-gateway-destination-endpoint-subset"]
    );
}

#[tokio::test]
async fn get_without_body_is_picked_at_once() {
    let h = harness(default_endpoints(), false).await;
    let get = headers_msg(
        &[(":method", "GET"), (":path", "/v1/models")],
        true,
        BodySendMode::FullDuplexStreamed,
    );
    let resps = exchange(h.server.grpc_addr, vec![get]).await;
    assert_eq!(resps.len(), 1);
    assert_eq!(
        header_value(&resps[0], "x-gateway-destination-endpoint").as_deref(),
        Some("10.0.0.2:8000")
    );
    assert_eq!(header_value(&resps[0], "content-length"), None);
    assert!(h.policy.seen.lock().unwrap()[0].body.is_empty());
}

#[tokio::test]
async fn bad_bodies_get_400_and_close_the_stream() {
    let h = harness(default_endpoints(), false).await;
    for body in [&b"{not json"[..], b"", b"[1,2]", br#"{"prompt":"x"}"#] {
        let resps = exchange(
            h.server.grpc_addr,
            vec![
                post_headers(BodySendMode::FullDuplexStreamed),
                body_msg(body, true),
            ],
        )
        .await;
        assert_eq!(resps.len(), 1, "only the immediate response for {body:?}");
        let (status, err) = immediate_status(&resps).expect("immediate response");
        assert_eq!(status, 400, "body {:?}", String::from_utf8_lossy(body));
        let v: serde_json::Value = serde_json::from_slice(&err).expect("JSON error body");
        assert_eq!(v["error"]["type"], "invalid_request_error");
    }
    assert!(
        h.policy.seen.lock().unwrap().is_empty(),
        "the policy never ran"
    );
}

#[tokio::test]
async fn one_megabyte_body_is_resent_in_chunks_of_at_most_62000() {
    let h = harness(default_endpoints(), false).await;
    let filler = "a ".repeat(500_000);
    // The filler rides in `user`, a field every door accepts and ignores by
    // design (an unknown field would be a 400).
    let body = format!(r#"{{"model":"m","prompt":"x","user":"{filler}"}}"#).into_bytes();
    assert!(body.len() > 1_000_000);
    let mut msgs = vec![post_headers(BodySendMode::FullDuplexStreamed)];
    let pieces: Vec<&[u8]> = body.chunks(16 * 1024).collect();
    let n = pieces.len();
    for (i, c) in pieces.into_iter().enumerate() {
        msgs.push(body_msg(c, i + 1 == n));
    }
    let resps = exchange(h.server.grpc_addr, msgs).await;
    let chunks = streamed_chunks(&resps);
    assert_eq!(chunks.len(), body.len().div_ceil(62_000));
    assert!(chunks.iter().all(|(b, _)| b.len() <= 62_000));
    let joined: Vec<u8> = chunks.iter().flat_map(|(b, _)| b.clone()).collect();
    assert_eq!(joined, body);
    assert_eq!(
        header_value(&resps[0], "content-length"),
        Some(body.len().to_string())
    );
}

#[tokio::test]
async fn subset_hint_restricts_endpoints_and_empty_subset_is_503() {
    let h = harness(default_endpoints(), false).await;
    let body = br#"{"model":"m","prompt":"hi"}"#;

    let mut hdrs = post_headers(BodySendMode::FullDuplexStreamed);
    hdrs.metadata_context = Some(subset_metadata(&["10.0.0.3:8000"]));
    let resps = exchange(h.server.grpc_addr, vec![hdrs, body_msg(body, true)]).await;
    assert_eq!(
        header_value(&resps[0], "x-gateway-destination-endpoint").as_deref(),
        Some("10.0.0.3:8000")
    );

    for subset in [&[][..], &["192.0.2.9:1"][..]] {
        let mut hdrs = post_headers(BodySendMode::FullDuplexStreamed);
        hdrs.metadata_context = Some(subset_metadata(subset));
        let resps = exchange(h.server.grpc_addr, vec![hdrs, body_msg(body, true)]).await;
        assert_eq!(
            immediate_status(&resps).map(|s| s.0),
            Some(503),
            "subset {subset:?}"
        );
    }

    // A client's header is not a hint: it neither narrows the pool (no 503
    // for endpoints that do not exist, no pin on 10.0.0.3) nor reaches the
    // policy, and it is removed from what Envoy forwards.
    for hint in ["192.0.2.1:1, 192.0.2.2:2", "10.0.0.3:8000"] {
        let before = h.policy.seen.lock().unwrap().len();
        let hdrs = headers_msg(
            &[
                (":method", "POST"),
                (":path", "/v1/completions"),
                ("x-gateway-destination-endpoint-subset", hint),
                ("x-gateway-destination-endpoint", "192.0.2.7:7"),
                ("x-gateway-destination-endpoint-served", "192.0.2.7:7"),
                ("x-prefiller-host-port", "192.0.2.8:8"),
            ],
            false,
            BodySendMode::FullDuplexStreamed,
        );
        let resps = exchange(h.server.grpc_addr, vec![hdrs, body_msg(body, true)]).await;
        assert_eq!(immediate_status(&resps), None, "{hint}: {resps:?}");
        assert_eq!(
            header_value(&resps[0], "x-gateway-destination-endpoint").as_deref(),
            Some("10.0.0.2:8000"),
            "{hint}"
        );
        let mut rm = removed(&resps[0]);
        rm.sort();
        assert_eq!(
            rm,
            [
                "x-gateway-destination-endpoint-served",
                "x-gateway-destination-endpoint-subset",
                "x-prefiller-host-port",
                "x-rngd-pd-kv-transport",
            ],
            "{hint}"
        );
        let seen = h.policy.seen.lock().unwrap();
        assert_eq!(seen.len(), before + 1);
        let last = seen.last().unwrap();
        assert!(
            last.headers
                .iter()
                .all(|(k, _)| !k.starts_with("x-gateway-destination-endpoint")
                    && k != "x-prefiller-host-port"),
            "{:?}",
            last.headers
        );
        assert_eq!(last.endpoints.as_deref().unwrap().len(), 3);
    }
}

#[tokio::test]
async fn policy_rejects_pass_through_and_failures_are_500() {
    let h = harness(default_endpoints(), false).await;
    let long = format!(r#"{{"model":"m","prompt":"{}"}}"#, "w ".repeat(100));
    let resps = exchange(
        h.server.grpc_addr,
        vec![
            post_headers(BodySendMode::FullDuplexStreamed),
            body_msg(long.as_bytes(), true),
        ],
    )
    .await;
    let (status, body) = immediate_status(&resps).expect("immediate");
    assert_eq!(status, 400);
    assert_eq!(
        body,
        br#"{"error":{"code":"context_length_exceeded"}}"#.to_vec()
    );

    let unhealthy: Vec<Endpoint> = default_endpoints()
        .into_iter()
        .map(|mut e| {
            e.healthy = false;
            e
        })
        .collect();
    let h2 = harness(unhealthy, false).await;
    let resps = exchange(
        h2.server.grpc_addr,
        vec![
            post_headers(BodySendMode::FullDuplexStreamed),
            body_msg(br#"{"model":"m","prompt":"x"}"#, true),
        ],
    )
    .await;
    assert_eq!(immediate_status(&resps).map(|s| s.0), Some(429));

    let h3 = harness(default_endpoints(), true).await;
    let resps = exchange(
        h3.server.grpc_addr,
        vec![
            post_headers(BodySendMode::FullDuplexStreamed),
            body_msg(br#"{"model":"m","prompt":"x"}"#, true),
        ],
    )
    .await;
    assert_eq!(immediate_status(&resps).map(|s| s.0), Some(500));
    assert_eq!(h3.metrics.picks.with_label_values(&["reject_500"]).get(), 1);
}

#[tokio::test]
async fn buffered_mode_continues_headers_and_routes_on_the_body_response() {
    let h = harness(default_endpoints(), false).await;
    // A completion body: the path of `post_headers` is /v1/completions, and
    // the picker applies that API's rules.
    let body = br#"{"model":"m","prompt":"hello there"}"#;
    let resps = exchange(
        h.server.grpc_addr,
        vec![post_headers(BodySendMode::Buffered), body_msg(body, true)],
    )
    .await;
    assert_eq!(resps.len(), 2);
    match &resps[0].response {
        Some(processing_response::Response::RequestHeaders(x)) => {
            let c = x.response.clone().unwrap_or_default();
            assert!(c.header_mutation.is_none() && !c.clear_route_cache);
        }
        other => panic!("expected a headers response, got {other:?}"),
    }
    match &resps[1].response {
        Some(processing_response::Response::RequestBody(b)) => {
            let c = b.response.clone().unwrap();
            assert!(c.clear_route_cache);
            assert!(c.body_mutation.is_none(), "buffered body goes on unchanged");
        }
        other => panic!("expected a body response, got {other:?}"),
    }
    assert_eq!(
        header_value(&resps[1], "x-gateway-destination-endpoint").as_deref(),
        Some("10.0.0.2:8000")
    );
    assert_eq!(lb_destination(&resps[1]).as_deref(), Some("10.0.0.2:8000"));
    let seen = h.policy.seen.lock().unwrap();
    assert!(seen[0].prompt_tokens.unwrap() >= 2, "chat prompt counted");
}

#[tokio::test]
async fn a_request_stream_that_stalls_is_ended_at_the_idle_deadline() {
    let picker = Arc::new(Picker::new(
        rngd_pool::Picker::new(
            Arc::new(FakePolicy::default()),
            StaticEndpoints::new(default_endpoints()),
        ),
        Some(Arc::new(WordCounter { model: "m" })),
        EppMetrics::new().unwrap(),
    ));
    let config = rngd_ext_proc::processor::ProcessorConfig {
        request_idle_timeout: std::time::Duration::from_millis(200),
        ..Default::default()
    };
    // Headers, then nothing: the body never comes.
    let inbound = futures::stream::iter(vec![Ok(post_headers(BodySendMode::FullDuplexStreamed))])
        .chain(futures::stream::pending());
    let mut out = rngd_ext_proc::processor::respond(Box::pin(inbound), picker, config);
    let t0 = std::time::Instant::now();
    let end = tokio::time::timeout(std::time::Duration::from_secs(10), async {
        loop {
            match out.next().await {
                Some(Ok(_)) => continue,
                other => return other,
            }
        }
    })
    .await
    .expect("the stalled stream was not ended");
    let status = end.expect("an error status").unwrap_err();
    assert_eq!(status.code(), tonic::Code::DeadlineExceeded, "{status}");
    assert!(t0.elapsed() >= std::time::Duration::from_millis(200));
    assert!(out.next().await.is_none(), "nothing after the end");
}
