//! The picker's test harness: a fake policy that records what it is given,
//! the server on loopback, and helpers that build ext_proc messages and read
//! the answers. The real wasm policy is exercised by the Python suites.
#![allow(dead_code, unused_imports)]

pub use std::collections::HashMap;
pub use std::sync::Arc;
pub use std::sync::Mutex;

pub use async_trait::async_trait;
pub use rngd_ext_proc::envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, Metadata};
pub use rngd_ext_proc::envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
pub use rngd_ext_proc::envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
pub use rngd_ext_proc::envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpBody, HttpHeaders, HttpTrailers, ProcessingRequest, ProcessingResponse, ProtocolConfiguration, body_mutation,
    processing_request, processing_response,
};
pub use rngd_ext_proc::envoy_types::pb::google::protobuf::{ListValue, Struct, Value, value::Kind};
pub use rngd_ext_proc::metrics::EppMetrics;
pub use rngd_ext_proc::picker::{Picker, PickerLimits};
pub use rngd_ext_proc::processor::ProcessorConfig;
pub use rngd_ext_proc::server::{self, GrpcServing, RunningServer, ServerConfig};
pub use rngd_pool::prompt::WordCounter;
pub use rngd_pool::{Policy, PolicyFailure, StaticEndpoints};
pub use rngd_policy_core::{Decision, Endpoint, LocalResponse, Role, Route, Vendor};
pub use rngd_policy_host::PolicyRequest;
pub use tokio::sync::mpsc;
pub use tokio_stream::StreamExt;
pub use tokio_stream::wrappers::ReceiverStream;

pub fn ep(addr: &str, role: Role) -> Endpoint {
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
        weight_version: None,
    }
}

/// A fake policy: PD when the request asks for it (`x-want-pd`), reject when the
/// prompt does not fit, 429 when no healthy endpoint, else the first endpoint.
/// Records what it was given.
#[derive(Default)]
pub struct FakePolicy {
    pub seen: Mutex<Vec<PolicyRequest>>,
    pub fail: bool,
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

pub struct Harness {
    pub server: RunningServer,
    pub policy: Arc<FakePolicy>,
    pub metrics: EppMetrics,
    pub picker: Arc<Picker>,
}

pub async fn harness(endpoints: Vec<Endpoint>, fail: bool) -> Harness {
    harness_with(
        endpoints,
        fail,
        PickerLimits::default(),
        ProcessorConfig::default(),
    )
    .await
}

/// A harness whose picker has `limits` and whose streams run with `processor`.
pub async fn harness_with(
    endpoints: Vec<Endpoint>,
    fail: bool,
    limits: PickerLimits,
    processor: ProcessorConfig,
) -> Harness {
    let policy = Arc::new(FakePolicy {
        fail,
        ..Default::default()
    });
    let metrics = EppMetrics::new().expect("metrics");
    let picker = Arc::new(Picker::with_limits(
        rngd_pool::Picker::new(policy.clone(), StaticEndpoints::new(endpoints)),
        Some(Arc::new(WordCounter { model: "m" })),
        metrics.clone(),
        limits,
    ));
    let server = server::start(
        Arc::clone(&picker),
        ServerConfig {
            metrics: Some(([127, 0, 0, 1], 0).into()),
            processor,
            ..ServerConfig::loopback()
        },
    )
    .await
    .expect("start");
    Harness {
        server,
        policy,
        metrics,
        picker,
    }
}

pub fn default_endpoints() -> Vec<Endpoint> {
    vec![
        ep("10.0.0.2:8000", Role::Decode),
        ep("10.0.0.1:8000", Role::Prefill),
        ep("10.0.0.3:8000", Role::Decode),
    ]
}

pub fn headers_msg(
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

/// A stream kept open: messages are sent one by one, responses read as they come.
pub struct OpenStream {
    pub tx: mpsc::Sender<ProcessingRequest>,
    pub rx: tonic::Streaming<ProcessingResponse>,
}

impl OpenStream {
    pub async fn open(addr: std::net::SocketAddr) -> Self {
        let mut client = ExternalProcessorClient::connect(format!("http://{addr}"))
            .await
            .expect("connect");
        let (tx, rx) = mpsc::channel(16);
        let rx = client
            .process(ReceiverStream::new(rx))
            .await
            .expect("process")
            .into_inner();
        OpenStream { tx, rx }
    }

    pub async fn send(&self, m: ProcessingRequest) {
        self.tx.send(m).await.expect("send");
    }

    /// The next response, or `None` when the server ended the stream.
    pub async fn next(&mut self) -> Option<ProcessingResponse> {
        self.rx.next().await.map(|r| r.expect("response"))
    }
}

/// Waits (bounded) until `cond` holds, checking every millisecond.
pub async fn until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !cond() {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
}

/// The headers of a completion POST declaring `content-length: len`.
pub fn post_headers_with_length(mode: BodySendMode, len: usize) -> ProcessingRequest {
    let len = len.to_string();
    headers_msg(
        &[
            (":method", "POST"),
            (":path", "/v1/completions"),
            (":authority", "gw"),
            ("content-type", "application/json"),
            ("content-length", &len),
        ],
        false,
        mode,
    )
}

/// The headers an immediate response sets.
pub fn immediate_headers(resps: &[ProcessingResponse]) -> Vec<(String, String)> {
    resps
        .iter()
        .find_map(|r| match r.response.as_ref()? {
            processing_response::Response::ImmediateResponse(i) => Some(
                i.headers
                    .as_ref()?
                    .set_headers
                    .iter()
                    .filter_map(|o| o.header.as_ref())
                    .map(|h| {
                        (
                            h.key.clone(),
                            String::from_utf8_lossy(&h.raw_value).into_owned(),
                        )
                    })
                    .collect(),
            ),
            _ => None,
        })
        .unwrap_or_default()
}

pub fn post_headers(mode: BodySendMode) -> ProcessingRequest {
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

/// A response-body message of the ext_proc stream.
pub fn resp_body_msg(chunk: &[u8], end_of_stream: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(processing_request::Request::ResponseBody(HttpBody {
            body: chunk.to_vec(),
            end_of_stream,
            ..Default::default()
        })),
        ..Default::default()
    }
}

pub fn body_msg(chunk: &[u8], end_of_stream: bool) -> ProcessingRequest {
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
pub async fn exchange(
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

pub fn header_value(resp: &ProcessingResponse, name: &str) -> Option<String> {
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

pub fn removed(resp: &ProcessingResponse) -> Vec<String> {
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

pub fn lb_destination(resp: &ProcessingResponse) -> Option<String> {
    let md = resp.dynamic_metadata.as_ref()?;
    let Some(Kind::StructValue(lb)) = &md.fields.get("envoy.lb")?.kind else {
        return None;
    };
    match &lb.fields.get("x-gateway-destination-endpoint")?.kind {
        Some(Kind::StringValue(s)) => Some(s.clone()),
        _ => None,
    }
}

pub fn streamed_chunks(resps: &[ProcessingResponse]) -> Vec<(Vec<u8>, bool)> {
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

pub fn immediate_status(resps: &[ProcessingResponse]) -> Option<(i32, Vec<u8>)> {
    resps.iter().find_map(|r| match r.response.as_ref()? {
        processing_response::Response::ImmediateResponse(i) => {
            Some((i.status.as_ref()?.code, i.body.clone()))
        }
        _ => None,
    })
}

pub fn subset_metadata(addrs: &[&str]) -> Metadata {
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
