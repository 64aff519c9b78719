//! The ext_proc response path and the listeners: responses and streamed
//! chunks pass through, trailers, health and metrics, answers sent before the
//! next message, per-connection and shared serving.

mod common;

use common::*;

#[tokio::test]
async fn responses_pass_through_and_stream_chunks_are_echoed() {
    let h = harness(default_endpoints(), false).await;
    let body = br#"{"model":"m","prompt":"hi","stream":true}"#;
    let resp_headers = ProcessingRequest {
        request: Some(processing_request::Request::ResponseHeaders(HttpHeaders {
            headers: Some(HeaderMap {
                headers: vec![HeaderValue {
                    key: "content-type".into(),
                    value: String::new(),
                    raw_value: b"text/event-stream".to_vec(),
                }],
            }),
            end_of_stream: false,
            ..Default::default()
        })),
        ..Default::default()
    };
    let trailers = ProcessingRequest {
        request: Some(processing_request::Request::ResponseTrailers(
            HttpTrailers::default(),
        )),
        ..Default::default()
    };
    let resps = exchange(
        h.server.grpc_addr,
        vec![
            post_headers(BodySendMode::FullDuplexStreamed),
            body_msg(body, true),
            resp_headers,
            resp_body_msg(b"data: {\"a\":1}\n\n", false),
            resp_body_msg(b"data: [DONE]\n\n", true),
            trailers,
        ],
    )
    .await;
    let kinds: Vec<&str> = resps
        .iter()
        .map(|r| match r.response.as_ref().unwrap() {
            processing_response::Response::RequestHeaders(_) => "req_headers",
            processing_response::Response::RequestBody(_) => "req_body",
            processing_response::Response::ResponseHeaders(_) => "resp_headers",
            processing_response::Response::ResponseBody(_) => "resp_body",
            processing_response::Response::ResponseTrailers(_) => "resp_trailers",
            _ => "other",
        })
        .collect();
    assert_eq!(
        kinds,
        [
            "req_headers",
            "req_body",
            "resp_headers",
            "resp_body",
            "resp_body",
            "resp_trailers"
        ]
    );
    let echoed: Vec<(Vec<u8>, bool)> = resps[3..5]
        .iter()
        .map(|r| match r.response.as_ref().unwrap() {
            processing_response::Response::ResponseBody(b) => {
                match b
                    .response
                    .as_ref()
                    .unwrap()
                    .body_mutation
                    .as_ref()
                    .unwrap()
                    .mutation
                    .as_ref()
                    .unwrap()
                {
                    body_mutation::Mutation::StreamedResponse(s) => {
                        (s.body.clone(), s.end_of_stream)
                    }
                    other => panic!("unexpected mutation {other:?}"),
                }
            }
            _ => unreachable!(),
        })
        .collect();
    assert_eq!(
        echoed,
        vec![
            (b"data: {\"a\":1}\n\n".to_vec(), false),
            (b"data: [DONE]\n\n".to_vec(), true)
        ]
    );
}

#[tokio::test]
async fn request_trailers_end_the_body() {
    let h = harness(default_endpoints(), false).await;
    let body = br#"{"model":"m","prompt":"hi"}"#;
    let trailers = ProcessingRequest {
        request: Some(processing_request::Request::RequestTrailers(
            HttpTrailers::default(),
        )),
        ..Default::default()
    };
    let resps = exchange(
        h.server.grpc_addr,
        vec![
            post_headers(BodySendMode::FullDuplexStreamed),
            body_msg(body, false),
            trailers,
        ],
    )
    .await;
    assert_eq!(
        header_value(&resps[0], "x-gateway-destination-endpoint").as_deref(),
        Some("10.0.0.2:8000")
    );
    let chunks = streamed_chunks(&resps);
    assert_eq!(chunks, vec![(body.to_vec(), false)]);
    assert!(matches!(
        resps.last().unwrap().response,
        Some(processing_response::Response::RequestTrailers(_))
    ));
}

#[tokio::test]
async fn health_and_metrics_listeners_answer() {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
    let h = harness(default_endpoints(), false).await;
    let channel =
        tonic::transport::Channel::from_shared(format!("http://{}", h.server.health_addr))
            .expect("uri")
            .connect()
            .await
            .expect("connect");
    let mut client = HealthClient::new(channel);
    for service in [
        "liveness",
        "readiness",
        "envoy.service.ext_proc.v3.ExternalProcessor",
    ] {
        let r = client
            .check(HealthCheckRequest {
                service: service.to_string(),
            })
            .await
            .expect("check")
            .into_inner();
        assert_eq!(r.status, ServingStatus::Serving as i32, "{service}");
    }
    let _ = exchange(
        h.server.grpc_addr,
        vec![
            post_headers(BodySendMode::FullDuplexStreamed),
            body_msg(br#"{"model":"m","prompt":"x"}"#, true),
        ],
    )
    .await;
    let addr = h.server.metrics_addr.expect("metrics addr");
    let text = reqwest::get(format!("http://{addr}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        text.contains("rngd_pd_epp_picks_total{result=\"route\"} 1"),
        "{text}"
    );
    assert!(text.contains("rngd_pd_epp_pick_seconds_count 1"));
}

/// A routed request counts on its decode endpoint (`rngd_pool::inflight`)
/// while Envoy's stream for it is open, so the next pick sees it before any
/// scrape; the count goes when the stream ends.
#[tokio::test]
async fn a_routed_request_counts_on_its_decode_endpoint_until_its_stream_ends() {
    let h = harness(default_endpoints(), false).await;
    let in_flight = || h.picker.pool().in_flight().count("10.0.0.2:8000");
    let mut s = OpenStream::open(h.server.grpc_addr).await;
    assert_eq!(in_flight(), 0);
    s.send(post_headers(BodySendMode::FullDuplexStreamed)).await;
    s.send(body_msg(br#"{"model":"m","prompt":"hi"}"#, true))
        .await;
    let within = std::time::Duration::from_secs(10);
    let routed = tokio::time::timeout(within, s.next())
        .await
        .expect("routed")
        .expect("stream open");
    assert_eq!(
        header_value(&routed, "x-gateway-destination-endpoint").as_deref(),
        Some("10.0.0.2:8000")
    );
    assert_eq!(in_flight(), 1, "the open request counts");
    // Envoy ends the stream: the request is over.
    let OpenStream { tx, mut rx } = s;
    drop(tx);
    while tokio::time::timeout(within, rx.next())
        .await
        .expect("the stream ends")
        .is_some()
    {}
    until("the count to go", || in_flight() == 0).await;
    assert_eq!(h.picker.pool().in_flight().tracked(), 0);
}

/// Full duplex: every message that can be answered is answered while the
/// stream stays open (Envoy never half-closes before the response is done).
#[tokio::test]
async fn each_answer_goes_out_before_the_next_message_arrives() {
    let h = harness(default_endpoints(), false).await;
    let mut client = ExternalProcessorClient::connect(format!("http://{}", h.server.grpc_addr))
        .await
        .expect("connect");
    let (tx, rx) = mpsc::channel(4);
    let mut stream = client
        .process(ReceiverStream::new(rx))
        .await
        .expect("process")
        .into_inner();
    let within = std::time::Duration::from_secs(10);
    let mut next = async || {
        tokio::time::timeout(within, stream.next())
            .await
            .expect("answer while the stream is open")
            .expect("stream open")
            .expect("response")
    };
    tx.send(post_headers(BodySendMode::FullDuplexStreamed))
        .await
        .unwrap();
    tx.send(body_msg(br#"{"model":"m","prompt":"hi"}"#, true))
        .await
        .unwrap();
    let headers = next().await;
    assert_eq!(
        header_value(&headers, "x-gateway-destination-endpoint").as_deref(),
        Some("10.0.0.2:8000")
    );
    assert!(matches!(
        next().await.response,
        Some(processing_response::Response::RequestBody(_))
    ));
    tx.send(ProcessingRequest {
        request: Some(processing_request::Request::ResponseHeaders(
            HttpHeaders::default(),
        )),
        ..Default::default()
    })
    .await
    .unwrap();
    assert!(matches!(
        next().await.response,
        Some(processing_response::Response::ResponseHeaders(_))
    ));
    tx.send(ProcessingRequest {
        request: Some(processing_request::Request::ResponseBody(HttpBody {
            body: b"data: 1\n\n".to_vec(),
            end_of_stream: false,
            ..Default::default()
        })),
        ..Default::default()
    })
    .await
    .unwrap();
    match next().await.response {
        Some(processing_response::Response::ResponseBody(b)) => {
            match b.response.unwrap().body_mutation.unwrap().mutation.unwrap() {
                body_mutation::Mutation::StreamedResponse(s) => {
                    assert_eq!(s.body, b"data: 1\n\n");
                    assert!(!s.end_of_stream);
                }
                other => panic!("unexpected mutation {other:?}"),
            }
        }
        other => panic!("unexpected response {other:?}"),
    }
    drop(tx);
    assert!(
        tokio::time::timeout(within, stream.next())
            .await
            .expect("stream ends")
            .is_none(),
        "the server ends the stream when Envoy half-closes"
    );
}

/// Both ways of serving the ext_proc listener pick the same way, over several
/// connections at once (spread over the per-connection threads), and stop
/// serving once the server is aborted.
#[tokio::test]
async fn per_connection_and_shared_serving_both_pick_and_stop_on_abort() {
    for serving in [GrpcServing::PerConnection(2), GrpcServing::Shared] {
        let policy = Arc::new(FakePolicy::default());
        let picker = Picker::new(
            rngd_pool::Picker::new(policy.clone(), StaticEndpoints::new(default_endpoints())),
            None,
            EppMetrics::new().expect("metrics"),
        );
        let server = server::start_with(Arc::new(picker), ServerConfig::loopback(), serving)
            .await
            .expect("start");
        let addr = server.grpc_addr;
        let body = br#"{"model":"m","prompt":"hi"}"#;
        let exchanges = (0..4).map(|_| {
            exchange(
                addr,
                vec![
                    post_headers(BodySendMode::FullDuplexStreamed),
                    body_msg(body, true),
                ],
            )
        });
        for resps in futures::future::join_all(exchanges).await {
            assert_eq!(
                header_value(&resps[0], "x-gateway-destination-endpoint").as_deref(),
                Some("10.0.0.2:8000"),
                "{serving:?}"
            );
            assert_eq!(streamed_chunks(&resps), vec![(body.to_vec(), true)]);
        }
        assert_eq!(policy.seen.lock().unwrap().len(), 4, "{serving:?}");
        server.abort();
        let refused = tokio::time::timeout(std::time::Duration::from_secs(10), async {
            loop {
                match ExternalProcessorClient::connect(format!("http://{addr}")).await {
                    Err(_) => break,
                    Ok(_) => tokio::task::yield_now().await,
                }
            }
        })
        .await;
        assert!(refused.is_ok(), "{serving:?}: still accepting after abort");
    }
}

/// A drain waits for an open ext_proc stream however the serving threads
/// end: with many per-connection threads, those without a stream end at
/// once on the stop, and that must not read as "every stream ended" (it once
/// did, at random, and the picker exited under a request Envoy was
/// processing).
#[tokio::test]
async fn a_drain_waits_for_an_open_stream_while_idle_threads_end() {
    let policy = Arc::new(FakePolicy::default());
    let picker = Arc::new(Picker::new(
        rngd_pool::Picker::new(policy, StaticEndpoints::new(default_endpoints())),
        None,
        EppMetrics::new().expect("metrics"),
    ));
    let server = server::start_with(
        Arc::clone(&picker),
        ServerConfig::loopback(),
        GrpcServing::PerConnection(8),
    )
    .await
    .expect("start");
    let s = OpenStream::open(server.grpc_addr).await;
    s.send(post_headers(BodySendMode::FullDuplexStreamed)).await;
    until("the stream admitted", || {
        picker
            .metrics()
            .render()
            .lines()
            .any(|l| l == "rngd_pd_epp_in_flight 1")
    })
    .await;
    // The stream stays open (no body is sent): the drain must wait for it
    // until its timeout.
    let drained = server.drain(std::time::Duration::from_millis(1500)).await;
    assert!(!drained, "the drain ended while a stream was open");
    drop(s);
}

/// The reference endpoint picker's metric families are exported with its
/// labels: per model (`inference_objective_*`, the answer's size and `usage`
/// read on the response path) and per pool (`inference_pool_*`, from the
/// snapshot), and the exposition passes `promtool check metrics`.
#[tokio::test]
async fn reference_epp_metric_families_pass_promtool() {
    let h = harness(default_endpoints(), false).await;
    let answer = br#"{"id":"x","choices":[],"usage":{"prompt_tokens":2,"completion_tokens":9,"total_tokens":11}}"#;
    let _ = exchange(
        h.server.grpc_addr,
        vec![
            post_headers(BodySendMode::FullDuplexStreamed),
            body_msg(br#"{"model":"m","prompt":"two words"}"#, true),
            resp_body_msg(answer, true),
        ],
    )
    .await;
    // A refused request counts as an error of its model.
    let _ = exchange(
        h.server.grpc_addr,
        vec![
            post_headers(BodySendMode::FullDuplexStreamed),
            body_msg(br#"{"model":"m","prompt":"x","temperature":9}"#, true),
        ],
    )
    .await;
    let addr = h.server.metrics_addr.expect("metrics addr");
    let text = reqwest::get(format!("http://{addr}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let labels = "model_name=\"m\",target_model_name=\"m\"";
    for want in [
        format!("inference_objective_request_total{{{labels}}} 2"),
        format!("inference_objective_request_error_total{{error_code=\"400\",{labels}}} 1"),
        format!("inference_objective_input_tokens_sum{{{labels}}} 2"),
        format!("inference_objective_output_tokens_sum{{{labels}}} 9"),
        format!(
            "inference_objective_response_sizes_sum{{{labels}}} {}",
            answer.len()
        ),
        format!("inference_objective_request_duration_seconds_count{{{labels}}} 1"),
        "inference_objective_running_requests{model_name=\"m\"} 0".to_string(),
        "inference_pool_ready_pods{name=\"rngd-pd\"} 3".to_string(),
        "inference_pool_average_queue_size{name=\"rngd-pd\"}".to_string(),
        "inference_pool_average_kv_cache_utilization{name=\"rngd-pd\"}".to_string(),
        "inference_pool_per_pod_queue_size{model_server_pod=\"10.0.0.2:8000\",name=\"rngd-pd\"}"
            .to_string(),
    ] {
        assert!(text.contains(&want), "missing {want}\n{text}");
    }
    let r = rngd_telemetry::promtool::check(&text);
    assert_eq!(
        r.code,
        Some(0),
        "promtool rejects the picker's /metrics: {:?}",
        r.findings
    );
}
