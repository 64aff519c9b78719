//! TLS of the ext_proc gRPC listener (`rngd_ext_proc::tls`), driven by a
//! tonic/rustls client: a self-signed certificate the client trusts, a
//! certificate directory whose files are replaced (new connections get the
//! new certificate; a bad pair keeps the old one), and plaintext when TLS is
//! off. The policy is a fake that routes everything to one endpoint.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use rngd_ext_proc::envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use rngd_ext_proc::envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use rngd_ext_proc::envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpHeaders, ProcessingRequest, processing_request, processing_response,
};
use rngd_ext_proc::metrics::EppMetrics;
use rngd_ext_proc::picker::Picker;
use rngd_ext_proc::server::{self, EXT_PROC_SERVICE, GrpcServing, RunningServer, ServerConfig};
use rngd_ext_proc::tls::{CERT_FILE, KEY_FILE, ServerTls, TlsChoice};
use rngd_policy_core::{Decision, Endpoint, Role, Route, Vendor};
use rngd_policy_host::PolicyRequest;
use rngd_pool::{Policy, PolicyFailure, StaticEndpoints};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint as TonicEndpoint};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;

const DEST: &str = "10.0.0.2:8000";

/// Routes every request to [`DEST`].
struct ToOne;

#[async_trait]
impl Policy for ToOne {
    async fn decide(&self, _req: PolicyRequest) -> Result<Decision, PolicyFailure> {
        Ok(Decision::Route(Route {
            decode: DEST.into(),
            prefill: None,
            kv_transport: None,
            headers: vec![("x-gateway-destination-endpoint".into(), DEST.into())],
        }))
    }
}

fn endpoint() -> Endpoint {
    Endpoint {
        address: DEST.into(),
        role: Role::Decode,
        vendor: Vendor::Cpu,
        node: "n1".into(),
        seq_len: 512,
        queue_depth: 0,
        running: 0,
        kv_usage: 0.0,
        healthy: true,
        transports: vec!["shm".into()],
        weight_version: None,
    }
}

async fn start(tls: Option<Arc<ServerTls>>, serving: GrpcServing) -> RunningServer {
    let picker = Picker::new(
        rngd_pool::Picker::new(Arc::new(ToOne), StaticEndpoints::new(vec![endpoint()])),
        None,
        EppMetrics::new().expect("metrics"),
    );
    server::start_with(
        Arc::new(picker),
        ServerConfig {
            tls,
            ..ServerConfig::loopback()
        },
        serving,
    )
    .await
    .expect("start")
}

/// A channel over TLS that trusts only `ca_pem`, checking the name `localhost`.
async fn tls_channel(addr: SocketAddr, ca_pem: &str) -> Result<Channel, tonic::transport::Error> {
    TonicEndpoint::from_shared(format!("https://{addr}"))?
        .tls_config(
            ClientTlsConfig::new()
                .ca_certificate(Certificate::from_pem(ca_pem))
                .domain_name("localhost"),
        )?
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await
}

async fn plain_channel(addr: SocketAddr) -> Result<Channel, tonic::transport::Error> {
    TonicEndpoint::from_shared(format!("http://{addr}"))?
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await
}

/// Health of the ext_proc service, asked on `channel`.
async fn health(channel: Channel) -> Result<i32, tonic::Status> {
    let r = HealthClient::new(channel)
        .check(HealthCheckRequest {
            service: EXT_PROC_SERVICE.into(),
        })
        .await?;
    Ok(r.into_inner().status)
}

/// One ext_proc stream with a bodiless GET: the destination the picker set.
async fn pick(channel: Channel) -> Option<String> {
    let headers = HeaderMap {
        headers: [(":method", "GET"), (":path", "/v1/models")]
            .iter()
            .map(|(k, v)| HeaderValue {
                key: (*k).into(),
                raw_value: v.as_bytes().to_vec(),
                ..Default::default()
            })
            .collect(),
    };
    let msg = ProcessingRequest {
        request: Some(processing_request::Request::RequestHeaders(HttpHeaders {
            headers: Some(headers),
            end_of_stream: true,
            ..Default::default()
        })),
        ..Default::default()
    };
    let mut stream = ExternalProcessorClient::new(channel)
        .process(futures::stream::iter(vec![msg]))
        .await
        .expect("process")
        .into_inner();
    let resp = stream.message().await.expect("message")?;
    let Some(processing_response::Response::RequestHeaders(h)) = resp.response else {
        return None;
    };
    h.response?
        .header_mutation?
        .set_headers
        .iter()
        .find(|o| {
            o.header
                .as_ref()
                .is_some_and(|h| h.key == "x-gateway-destination-endpoint")
        })
        .and_then(|o| o.header.as_ref())
        .map(|h| String::from_utf8_lossy(&h.raw_value).into_owned())
}

/// A fresh self-signed pair for `localhost` (PEM certificate, PEM key).
fn pair() -> (String, String) {
    let c = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).expect("rcgen");
    (c.cert.pem(), c.signing_key.serialize_pem())
}

fn write_pair(dir: &Path, (crt, key): &(String, String)) {
    // As a Secret volume swaps them: write aside, then rename into place.
    for (name, text) in [(CERT_FILE, crt), (KEY_FILE, key)] {
        let tmp = dir.join(format!(".{name}.new"));
        std::fs::write(&tmp, text).expect("write");
        std::fs::rename(&tmp, dir.join(name)).expect("rename");
    }
}

#[tokio::test]
async fn self_signed_certificate_serves_ext_proc_and_health_over_tls() {
    for serving in [GrpcServing::PerConnection(2), GrpcServing::Shared] {
        let tls = TlsChoice::SelfSigned.start().expect("tls").expect("some");
        let ca = tls.certificate_pem();
        let s = start(Some(tls), serving).await;
        let ch = tls_channel(s.grpc_addr, &ca).await.expect("TLS connect");
        assert_eq!(health(ch.clone()).await.expect("health"), 1, "SERVING");
        assert_eq!(pick(ch).await.as_deref(), Some(DEST), "{serving:?}");
        // A plaintext client gets nothing from a TLS listener.
        let plain = match plain_channel(s.grpc_addr).await {
            Ok(ch) => health(ch).await.is_ok(),
            Err(_) => false,
        };
        assert!(!plain, "plaintext accepted on the TLS listener");
        // The health port stays plaintext (kubelet gRPC probes).
        let hch = plain_channel(s.health_addr).await.expect("health connect");
        assert_eq!(health(hch).await.expect("health"), 1);
    }
}

#[tokio::test]
async fn replaced_certificate_files_serve_new_connections() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (a, b) = (pair(), pair());
    write_pair(dir.path(), &a);
    let tls = TlsChoice::CertDir {
        dir: dir.path().to_path_buf(),
        poll: Duration::from_millis(20),
    }
    .start()
    .expect("tls")
    .expect("some");
    assert_eq!(tls.certificate_pem(), a.0);
    let s = start(Some(Arc::clone(&tls)), GrpcServing::default()).await;
    let old = tls_channel(s.grpc_addr, &a.0)
        .await
        .expect("connect with A");
    assert_eq!(pick(old.clone()).await.as_deref(), Some(DEST));
    assert!(
        tls_channel(s.grpc_addr, &b.0).await.is_err(),
        "B not served yet"
    );

    write_pair(dir.path(), &b);
    let deadline = Instant::now() + Duration::from_secs(10);
    while tls.certificate_pem() != b.0 {
        assert!(Instant::now() < deadline, "the new pair was not loaded");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let new = tls_channel(s.grpc_addr, &b.0)
        .await
        .expect("connect with B");
    assert_eq!(pick(new).await.as_deref(), Some(DEST));
    assert!(
        tls_channel(s.grpc_addr, &a.0).await.is_err(),
        "new connections no longer get A"
    );
    // The connection opened before the swap keeps working.
    assert_eq!(pick(old).await.as_deref(), Some(DEST));

    // A bad pair (B's certificate with another key) keeps B.
    let c = pair();
    write_pair(dir.path(), &(b.0.clone(), c.1));
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(tls.certificate_pem(), b.0);
    let still = tls_channel(s.grpc_addr, &b.0)
        .await
        .expect("B still served");
    assert_eq!(health(still).await.expect("health"), 1);
}

#[tokio::test]
async fn certificate_directory_must_load_at_start() {
    let dir = tempfile::tempdir().expect("tempdir");
    let err = TlsChoice::CertDir {
        dir: dir.path().to_path_buf(),
        poll: Duration::from_secs(1),
    }
    .start()
    .expect_err("no files");
    assert!(err.to_string().contains(CERT_FILE), "{err}");
    std::fs::write(dir.path().join(CERT_FILE), "not pem").unwrap();
    std::fs::write(dir.path().join(KEY_FILE), "not pem").unwrap();
    assert!(
        TlsChoice::CertDir {
            dir: dir.path().to_path_buf(),
            poll: Duration::from_secs(1),
        }
        .start()
        .is_err()
    );
}

#[tokio::test]
async fn plaintext_when_secure_serving_is_off() {
    let choice = TlsChoice::from_flags(false, None, Duration::from_secs(1));
    assert_eq!(choice, TlsChoice::Plaintext);
    let s = start(choice.start().expect("plaintext"), GrpcServing::default()).await;
    let ch = plain_channel(s.grpc_addr).await.expect("connect");
    assert_eq!(pick(ch).await.as_deref(), Some(DEST));
    let tls = ServerTls::self_signed().expect("cert");
    assert!(
        tls_channel(s.grpc_addr, &tls.certificate_pem())
            .await
            .is_err(),
        "no TLS on a plaintext listener"
    );
}
