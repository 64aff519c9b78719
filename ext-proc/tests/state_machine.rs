//! The ext_proc state machine driven over gRPC by an in-process tonic client,
//! with a fake policy (the real wasm policy is exercised by the Python suites).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::Mutex;

use async_trait::async_trait;
use rngd_ext_proc::envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, Metadata};
use rngd_ext_proc::envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use rngd_ext_proc::envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use rngd_ext_proc::envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpBody, HttpHeaders, HttpTrailers, ProcessingRequest, ProcessingResponse, ProtocolConfiguration, body_mutation,
    processing_request, processing_response,
};
use rngd_ext_proc::envoy_types::pb::google::protobuf::{ListValue, Struct, Value, value::Kind};
use rngd_ext_proc::metrics::EppMetrics;
use rngd_ext_proc::picker::Picker;
use rngd_ext_proc::server::{self, GrpcServing, RunningServer, ServerConfig};
use rngd_pool::prompt::WordCounter;
use rngd_pool::{Policy, PolicyFailure, StaticEndpoints};
use rngd_policy_core::{Decision, Endpoint, LocalResponse, Role, Route, Vendor};
use rngd_policy_host::PolicyRequest;
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;

fn ep(addr: &str, role: Role) -> Endpoint {
    Endpoint {
        address: addr.to_string(),
        role,
        vendor: Vendor::Cpu,
        node: "n1".to_string(),
        seq_len: 64,
        queue_depth: 0,
        running: 0,
        kv_usage: 0.0,
        healthy: true,
        transports: vec!["shm".to_string()],
    }
}

/// A fake policy: PD when the request asks for it (`x-want-pd`), reject when the
/// prompt does not fit, 429 when no healthy endpoint, else the first endpoint.
/// Records what it was given.
#[derive(Default)]
struct FakePolicy {
    seen: Mutex<Vec<PolicyRequest>>,
    fail: bool,
}

#[async_trait]
impl Policy for FakePolicy {
    async fn decide(&self, req: PolicyRequest) -> Result<Decision, PolicyFailure> {
        self.seen.lock().unwrap().push(req.clone());
        if self.fail {
            return Err(PolicyFailure {
                status: 500,
                source: "guest trapped (fake)".into(),
            });
        }
        let eps = req.endpoints.clone().unwrap_or_default();
        let decode: Vec<&Endpoint> = eps
            .iter()
            .filter(|e| e.healthy && e.role != Role::Prefill)
            .collect();
        let Some(d) = decode.first() else {
            return Ok(Decision::Reject(LocalResponse {
                status: 429,
                body: br#"{"error":{"message":"no capacity"}}"#.to_vec(),
                headers: vec![("content-type".into(), "application/json".into())],
            }));
        };
        if let Some(n) = req.prompt_tokens
            && n > d.seq_len as usize
        {
            return Ok(Decision::Reject(LocalResponse {
                status: 400,
                body: br#"{"error":{"code":"context_length_exceeded"}}"#.to_vec(),
                headers: vec![],
            }));
        }
        let want_pd = req.headers.iter().any(|(k, _)| k == "x-want-pd");
        let prefill = if want_pd {
            eps.iter()
                .find(|e| e.role == Role::Prefill)
                .map(|e| e.address.clone())
        } else {
            None
        };
        let kv = prefill.as_ref().map(|_| "shm".to_string());
        let mut headers = vec![(
            "x-gateway-destination-endpoint".to_string(),
            d.address.clone(),
        )];
        if let Some(p) = &prefill {
            headers.push(("x-prefiller-host-port".to_string(), p.clone()));
            headers.push(("x-rngd-pd-kv-transport".to_string(), "shm".to_string()));
        }
        Ok(Decision::Route(Route {
            decode: d.address.clone(),
            prefill,
            kv_transport: kv,
            headers,
        }))
    }
}

struct Harness {
    server: RunningServer,
    policy: Arc<FakePolicy>,
    metrics: EppMetrics,
}

async fn harness(endpoints: Vec<Endpoint>, fail: bool) -> Harness {
    let policy = Arc::new(FakePolicy {
        fail,
        ..Default::default()
    });
    let metrics = EppMetrics::new().expect("metrics");
    let picker = Picker::new(
        rngd_pool::Picker::new(policy.clone(), StaticEndpoints::new(endpoints)),
        Some(Arc::new(WordCounter { model: "m" })),
        metrics.clone(),
    );
    let server = server::start(
        Arc::new(picker),
        ServerConfig {
            metrics: Some(([127, 0, 0, 1], 0).into()),
            ..ServerConfig::loopback()
        },
    )
    .await
    .expect("start");
    Harness {
        server,
        policy,
        metrics,
    }
}

fn default_endpoints() -> Vec<Endpoint> {
    vec![
        ep("10.0.0.2:8000", Role::Decode),
        ep("10.0.0.1:8000", Role::Prefill),
        ep("10.0.0.3:8000", Role::Decode),
    ]
}

fn headers_msg(
    pairs: &[(&str, &str)],
    end_of_stream: bool,
    mode: BodySendMode,
) -> ProcessingRequest {
    let headers = pairs
        .iter()
        .map(|(k, v)| HeaderValue {
            key: k.to_string(),
            value: String::new(),
            raw_value: v.as_bytes().to_vec(),
        })
        .collect();
    ProcessingRequest {
        protocol_config: Some(ProtocolConfiguration {
            request_body_mode: mode as i32,
            response_body_mode: mode as i32,
            ..Default::default()
        }),
        request: Some(processing_request::Request::RequestHeaders(HttpHeaders {
            headers: Some(HeaderMap { headers }),
            end_of_stream,
            ..Default::default()
        })),
        ..Default::default()
    }
}

fn post_headers(mode: BodySendMode) -> ProcessingRequest {
    headers_msg(
        &[
            (":method", "POST"),
            (":path", "/v1/completions"),
            (":authority", "gw"),
            ("content-type", "application/json"),
        ],
        false,
        mode,
    )
}

fn body_msg(chunk: &[u8], end_of_stream: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(processing_request::Request::RequestBody(HttpBody {
            body: chunk.to_vec(),
            end_of_stream,
            ..Default::default()
        })),
        ..Default::default()
    }
}

/// Sends `msgs` on one stream, closes it, and collects every response until the server ends the stream.
async fn exchange(
    addr: std::net::SocketAddr,
    msgs: Vec<ProcessingRequest>,
) -> Vec<ProcessingResponse> {
    let mut client = ExternalProcessorClient::connect(format!("http://{addr}"))
        .await
        .expect("connect");
    let (tx, rx) = mpsc::channel(msgs.len() + 1);
    for m in msgs {
        tx.send(m).await.unwrap();
    }
    drop(tx);
    let mut stream = client
        .process(ReceiverStream::new(rx))
        .await
        .expect("process")
        .into_inner();
    let mut out = Vec::new();
    while let Some(r) = stream.next().await {
        out.push(r.expect("response"));
    }
    out
}

fn header_value(resp: &ProcessingResponse, name: &str) -> Option<String> {
    let common = match resp.response.as_ref()? {
        processing_response::Response::RequestHeaders(h) => h.response.as_ref()?,
        processing_response::Response::RequestBody(b) => b.response.as_ref()?,
        _ => return None,
    };
    common
        .header_mutation
        .as_ref()?
        .set_headers
        .iter()
        .find_map(|o| {
            let h = o.header.as_ref()?;
            (h.key == name).then(|| String::from_utf8(h.raw_value.clone()).unwrap())
        })
}

fn removed(resp: &ProcessingResponse) -> Vec<String> {
    match resp.response.as_ref() {
        Some(processing_response::Response::RequestHeaders(h)) => h
            .response
            .as_ref()
            .unwrap()
            .header_mutation
            .as_ref()
            .unwrap()
            .remove_headers
            .clone(),
        _ => vec![],
    }
}

fn lb_destination(resp: &ProcessingResponse) -> Option<String> {
    let md = resp.dynamic_metadata.as_ref()?;
    let Some(Kind::StructValue(lb)) = &md.fields.get("envoy.lb")?.kind else {
        return None;
    };
    match &lb.fields.get("x-gateway-destination-endpoint")?.kind {
        Some(Kind::StringValue(s)) => Some(s.clone()),
        _ => None,
    }
}

fn streamed_chunks(resps: &[ProcessingResponse]) -> Vec<(Vec<u8>, bool)> {
    resps
        .iter()
        .filter_map(|r| match r.response.as_ref()? {
            processing_response::Response::RequestBody(b) => {
                match b
                    .response
                    .as_ref()?
                    .body_mutation
                    .as_ref()?
                    .mutation
                    .as_ref()?
                {
                    body_mutation::Mutation::StreamedResponse(s) => {
                        Some((s.body.clone(), s.end_of_stream))
                    }
                    _ => None,
                }
            }
            _ => None,
        })
        .collect()
}

fn immediate_status(resps: &[ProcessingResponse]) -> Option<(i32, Vec<u8>)> {
    resps.iter().find_map(|r| match r.response.as_ref()? {
        processing_response::Response::ImmediateResponse(i) => {
            Some((i.status.as_ref()?.code, i.body.clone()))
        }
        _ => None,
    })
}

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
    assert!(removed(&resps[0]).is_empty());
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
    let body = format!(r#"{{"model":"m","prompt":"x","pad":"{filler}"}}"#).into_bytes();
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

fn subset_metadata(addrs: &[&str]) -> Metadata {
    let list = ListValue {
        values: addrs
            .iter()
            .map(|a| Value {
                kind: Some(Kind::StringValue(a.to_string())),
            })
            .collect(),
    };
    let mut fields = HashMap::new();
    fields.insert(
        "x-gateway-destination-endpoint-subset".to_string(),
        Value {
            kind: Some(Kind::ListValue(list)),
        },
    );
    let mut filter_metadata = HashMap::new();
    filter_metadata.insert("envoy.lb.subset_hint".to_string(), Struct { fields });
    Metadata {
        filter_metadata,
        ..Default::default()
    }
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

    // The header form of the hint.
    let hdrs = headers_msg(
        &[
            (":method", "POST"),
            (":path", "/v1/completions"),
            (
                "x-gateway-destination-endpoint-subset",
                "192.0.2.1:1, 192.0.2.2:2",
            ),
        ],
        false,
        BodySendMode::FullDuplexStreamed,
    );
    let resps = exchange(h.server.grpc_addr, vec![hdrs, body_msg(body, true)]).await;
    assert_eq!(immediate_status(&resps).map(|s| s.0), Some(503));
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
    let resp_body = |b: &[u8], eos: bool| ProcessingRequest {
        request: Some(processing_request::Request::ResponseBody(HttpBody {
            body: b.to_vec(),
            end_of_stream: eos,
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
            resp_body(b"data: {\"a\":1}\n\n", false),
            resp_body(b"data: [DONE]\n\n", true),
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
