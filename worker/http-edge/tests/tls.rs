//! TLS on a listener (`Options::tls`, the gateway's `--ssl-certfile` /
//! `--ssl-keyfile`): a client trusting the certificate gets its answer over
//! TLS (ALPN `http/1.1`), a plain-HTTP client gets no HTTP answer, a client
//! that never finishes the handshake is closed at the header timeout, and
//! files that are not a certificate and key are refused naming the file.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{Server, read_to_end, status_of};
use rngd_http_edge::tls::ServerTls;
use rngd_http_edge::{BodyLimits, EdgeError, Options};
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

struct Pki {
    _dir: tempfile::TempDir,
    cert: std::path::PathBuf,
    key: std::path::PathBuf,
    der: CertificateDer<'static>,
}

fn pki() -> Pki {
    let c = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cert = dir.path().join("tls.crt");
    let key = dir.path().join("tls.key");
    std::fs::write(&cert, c.cert.pem()).unwrap();
    std::fs::write(&key, c.signing_key.serialize_pem()).unwrap();
    Pki {
        _dir: dir,
        cert,
        key,
        der: c.cert.der().clone(),
    }
}

async fn tls_server(p: &Pki, header_timeout: Duration) -> Server {
    let tls = ServerTls::from_pem_files(&p.cert, &p.key).unwrap();
    Server::start(
        Options {
            header_timeout,
            tls: Some(tls),
            ..Options::default()
        },
        BodyLimits {
            max_bytes: 1 << 20,
            deadline: Duration::from_secs(30),
        },
    )
    .await
}

fn connector(trusted: CertificateDer<'static>) -> tokio_rustls::TlsConnector {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(trusted).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    tokio_rustls::TlsConnector::from(Arc::new(config))
}

#[tokio::test]
async fn a_trusting_client_is_answered_over_tls() {
    let p = pki();
    let server = tls_server(&p, Duration::from_secs(2)).await;
    let tcp = TcpStream::connect(server.addr()).await.unwrap();
    let mut tls = connector(p.der.clone())
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await
        .unwrap();
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"http/1.1"[..]));
    tls.write_all(b"GET /ok HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n\r\n")
        .await
        .unwrap();
    let text = read_to_end(&mut tls, Duration::from_secs(5)).await.unwrap();
    assert_eq!(status_of(&text), Some(200), "{text}");
    assert!(text.ends_with("ok"), "{text}");

    // Plain HTTP on the TLS port: no HTTP answer.
    let mut plain = TcpStream::connect(server.addr()).await.unwrap();
    plain
        .write_all(b"GET /ok HTTP/1.1\r\nhost: t\r\nconnection: close\r\n\r\n")
        .await
        .unwrap();
    let text = read_to_end(&mut plain, Duration::from_secs(4))
        .await
        .unwrap_or_default();
    assert_eq!(status_of(&text), None, "{text}");

    // A client that does not trust the certificate refuses the handshake.
    let other = pki();
    let tcp = TcpStream::connect(server.addr()).await.unwrap();
    assert!(
        connector(other.der.clone())
            .connect(ServerName::try_from("localhost").unwrap(), tcp)
            .await
            .is_err()
    );
    server.stop().await;
}

#[tokio::test]
async fn a_handshake_that_never_ends_is_closed_at_the_header_timeout() {
    let p = pki();
    let timeout = Duration::from_millis(400);
    let server = tls_server(&p, timeout).await;
    let started = Instant::now();
    let mut silent = TcpStream::connect(server.addr()).await.unwrap();
    let text = read_to_end(&mut silent, Duration::from_secs(10)).await;
    let waited = started.elapsed();
    assert_eq!(text.as_deref(), Some(""), "closed without a byte");
    assert!(
        waited >= timeout && waited < Duration::from_secs(8),
        "{waited:?}"
    );
    server.stop().await;
}

#[test]
fn files_that_are_not_a_certificate_and_key_are_named() {
    let p = pki();
    let missing = p.cert.with_file_name("nope.crt");
    for (cert, key, named) in [
        (&missing, &p.key, &missing),
        (&p.key, &p.key, &p.key),
        (&p.cert, &p.cert, &p.cert),
    ] {
        let e = ServerTls::from_pem_files(cert, key).unwrap_err();
        assert!(matches!(e, EdgeError::Tls { .. }), "{e}");
        let shown = format!("{e}");
        assert!(shown.contains(&named.display().to_string()), "{shown}");
    }
    // A key that is not the certificate's.
    let other = pki();
    let e = ServerTls::from_pem_files(&p.cert, &other.key).unwrap_err();
    assert!(matches!(e, EdgeError::Tls { .. }), "{e}");
}
