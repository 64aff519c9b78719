//! TLS on the relay's connections: KV bytes cross a TLS relay byte-exact
//! and never in plaintext on the wire (a recording proxy sits in between;
//! the same check on a plaintext relay finds them, so it can fail); a
//! client trusts only the key derived from its own secret, or a mounted
//! certificate for the right name; a mismatch of TLS and plaintext ends is
//! named; pooled TLS connections survive a relay restart.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{TestRelay, client_cfg, secret, ttl_cfg, wrong_secret};
use rngd_kv_transport::conformance::payload;
use rngd_kv_transport::relay::{ClientTls, RelayConfig, ServerTls};
use rngd_kv_transport::{KvError, KvTransport, TransportConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A relay keyed by the test secret.
fn tls_relay_cfg() -> RelayConfig {
    RelayConfig {
        tls: Some(ServerTls::from_secret(&secret()).unwrap()),
        ..ttl_cfg(Duration::from_secs(30))
    }
}

/// A client of the test secret that trusts the key derived from it.
fn tls_client_cfg() -> TransportConfig {
    TransportConfig {
        tcp_tls: Some(ClientTls::from_secret(&secret()).unwrap()),
        tcp_timeout: Duration::from_secs(5),
        ..client_cfg()
    }
}

/// A TLS relay's counters, on a fresh TLS client.
async fn tls_stats(relay: &TestRelay) -> rngd_kv_transport::relay::RelayStats {
    relay.client(&tls_client_cfg()).stats().await.unwrap()
}

/// A TCP proxy to `upstream` that keeps every byte it forwards (both ways).
async fn recording_proxy(upstream: std::net::SocketAddr) -> (String, Arc<Mutex<Vec<u8>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let keep = seen.clone();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let server = TcpStream::connect(upstream).await.unwrap();
            let (cr, cw) = client.into_split();
            let (sr, sw) = server.into_split();
            tokio::spawn(copy_keeping(cr, sw, keep.clone()));
            tokio::spawn(copy_keeping(sr, cw, keep.clone()));
        }
    });
    (addr, seen)
}

/// Copies `from` to `to`, keeping a copy of every byte in `keep`.
async fn copy_keeping(
    mut from: impl tokio::io::AsyncRead + Unpin,
    mut to: impl tokio::io::AsyncWrite + Unpin,
    keep: Arc<Mutex<Vec<u8>>>,
) {
    let mut buf = vec![0u8; 64 << 10];
    while let Ok(n) = from.read(&mut buf).await {
        if n == 0 {
            break;
        }
        keep.lock().unwrap().extend_from_slice(&buf[..n]);
        if to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}

/// Pushes a payload through the proxy, pulls it back through it, checks it
/// byte-exact; what the wire showed.
async fn through_proxy(relay: &TestRelay, cfg: &TransportConfig, id: &str) -> (Vec<u8>, Vec<u8>) {
    let (addr, seen) = recording_proxy(relay.addr).await;
    let sender = rngd_kv_transport::tcp::TcpTransport::connect_to(addr.clone(), cfg);
    let receiver = rngd_kv_transport::tcp::TcpTransport::connect_to(addr, cfg);
    let p = payload(id, 41, 3, 64 << 10);
    let blobs = p.blobs.clone();
    let handle = sender.push(p).await.unwrap();
    let got = receiver
        .pull(&handle, Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(got, blobs, "byte-exact through the relay");
    receiver.release(&handle).await.unwrap();
    let wire = seen.lock().unwrap().clone();
    (wire, blobs[1][..64].to_vec())
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_crosses_a_tls_relay_byte_exact_and_never_in_plaintext() {
    let relay = TestRelay::start(tls_relay_cfg()).await;
    let (wire, sample) = through_proxy(&relay, &tls_client_cfg(), "tls-secret-request-7").await;
    assert!(
        wire.len() > 3 * (64 << 10),
        "the blobs went through the proxy"
    );
    assert!(!contains(&wire, &sample), "a blob's bytes are on the wire");
    assert!(
        !contains(&wire, b"tls-secret-request-7"),
        "the request key is on the wire"
    );
    relay.stop().await;

    // The same check on a plaintext relay finds both.
    let plain = TestRelay::start(ttl_cfg(Duration::from_secs(30))).await;
    let (wire, sample) = through_proxy(&plain, &client_cfg(), "tls-secret-request-8").await;
    assert!(contains(&wire, &sample) && contains(&wire, b"tls-secret-request-8"));
    plain.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_trusts_only_the_key_of_its_own_secret() {
    let relay = TestRelay::start(tls_relay_cfg()).await;
    let other = TransportConfig {
        tcp_secret: Some(wrong_secret()),
        tcp_tls: Some(ClientTls::from_secret(&wrong_secret()).unwrap()),
        tcp_timeout: Duration::from_secs(5),
        ..TransportConfig::default()
    };
    let err = relay
        .client(&other)
        .push(payload("tls-wrong-key", 1, 1, 1024))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, KvError::Unauthorized { detail, .. } if detail.contains("TLS key")),
        "{err}"
    );
    // Nothing was stored, and the relay counted a refused handshake.
    let stats = tls_stats(&relay).await;
    assert_eq!(stats.keys, 0);
    assert_eq!(
        stats.handshake_failures.get("refused"),
        Some(&1),
        "{stats:?}"
    );
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_and_plaintext_ends_name_the_mismatch() {
    // A TLS client, a plaintext relay: named at once.
    let plain = TestRelay::start(ttl_cfg(Duration::from_secs(30))).await;
    let err = plain
        .client(&tls_client_cfg())
        .push(payload("tls-vs-plain", 1, 1, 1024))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, KvError::Protocol { detail, .. } if detail.contains("--tls off")),
        "{err}"
    );
    plain.stop().await;

    // A plaintext client, a TLS relay: the relay waits for a ClientHello,
    // closes at its handshake deadline and counts it; the client fails.
    let relay = TestRelay::start(RelayConfig {
        handshake_timeout: Duration::from_millis(300),
        ..tls_relay_cfg()
    })
    .await;
    let plain_client = TransportConfig {
        tcp_timeout: Duration::from_secs(3),
        ..client_cfg()
    };
    let err = relay
        .client(&plain_client)
        .push(payload("plain-vs-tls", 1, 1, 1024))
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            KvError::ConnectionLost { .. } | KvError::Timeout { .. }
        ),
        "{err}"
    );
    let stats = tls_stats(&relay).await;
    assert_eq!(stats.keys, 0);
    assert!(
        stats
            .handshake_failures
            .get("timeout")
            .copied()
            .unwrap_or(0)
            >= 1,
        "{stats:?}"
    );
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pooled_tls_connections_survive_a_relay_restart() {
    let relay = TestRelay::start(tls_relay_cfg()).await;
    let t = relay.client(&tls_client_cfg());
    let h = t.push(payload("tls-pool-1", 2, 2, 4096)).await.unwrap();
    t.release(&h).await.unwrap();
    assert!(
        t.idle_connections() >= 1,
        "the connection went back to the pool"
    );
    relay.restart().await;
    // The pooled connection is dead: the next push takes a fresh one.
    let p = payload("tls-pool-2", 3, 2, 4096);
    let blobs = p.blobs.clone();
    let h = t.push(p).await.unwrap();
    assert_eq!(t.pull(&h, Duration::from_secs(5)).await.unwrap(), blobs);
    t.release(&h).await.unwrap();
    relay.stop().await;
}

/// A self-signed certificate for `names` and its key, as PEM files in `dir`.
fn cert_files(
    dir: &std::path::Path,
    tag: &str,
    names: &[&str],
) -> (std::path::PathBuf, std::path::PathBuf) {
    let c =
        rcgen::generate_simple_self_signed(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
            .unwrap();
    let (cert, key) = (
        dir.join(format!("{tag}.crt")),
        dir.join(format!("{tag}.key")),
    );
    std::fs::write(&cert, c.cert.pem()).unwrap();
    std::fs::write(&key, c.signing_key.serialize_pem()).unwrap();
    (cert, key)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mounted_certificate_is_verified_by_name_and_root() {
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = cert_files(dir.path(), "relay", &["relay.test"]);
    let (other_ca, _) = cert_files(dir.path(), "other", &["relay.test"]);
    let relay = TestRelay::start(RelayConfig {
        tls: Some(ServerTls::from_pem_files(&cert, &key).unwrap()),
        ..ttl_cfg(Duration::from_secs(30))
    })
    .await;
    let with = |ca: &std::path::Path, name: &str| TransportConfig {
        tcp_tls: Some(ClientTls::from_ca_file(ca, Some(name)).unwrap()),
        tcp_timeout: Duration::from_secs(5),
        ..client_cfg()
    };
    let t = relay.client(&with(&cert, "relay.test"));
    let p = payload("tls-cert-ok", 4, 2, 4096);
    let blobs = p.blobs.clone();
    let h = t.push(p).await.unwrap();
    assert_eq!(t.pull(&h, Duration::from_secs(5)).await.unwrap(), blobs);
    t.release(&h).await.unwrap();
    for (ca, name) in [(&cert, "not-the-relay.test"), (&other_ca, "relay.test")] {
        let err = relay
            .client(&with(ca, name))
            .push(payload("tls-cert-bad", 5, 1, 1024))
            .await
            .unwrap_err();
        assert!(matches!(err, KvError::Unauthorized { .. }), "{name}: {err}");
    }
    let stats = relay
        .client(&with(&cert, "relay.test"))
        .stats()
        .await
        .unwrap();
    assert_eq!(stats.keys, 0, "nothing stored by the refused clients");
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_flood_of_a_tls_relay_is_closed_without_a_byte_and_never_refuses_a_worker() {
    const SILENT: usize = 200;
    let cfg = RelayConfig {
        max_handshakes: 16,
        handshake_timeout: Duration::from_millis(500),
        ..tls_relay_cfg()
    };
    let relay = TestRelay::start(cfg.clone()).await;
    let addr = relay.addr;
    let flood = tokio::spawn(async move {
        let mut held = Vec::with_capacity(SILENT);
        for _ in 0..SILENT {
            held.push(TcpStream::connect(addr).await.unwrap());
        }
        held
    });
    // Workers (a fresh TLS client each round: a fresh handshake) while the
    // flood opens and after: every round passes.
    let mut rounds = 0;
    while !flood.is_finished() || rounds < 5 {
        let t = relay.client(&tls_client_cfg());
        let p = payload(&format!("tls-flood-{rounds}"), rounds, 2, 8 << 10);
        let want = p.blobs.clone();
        let h = t.push(p).await.expect("a worker's push during the flood");
        assert_eq!(t.pull(&h, Duration::from_secs(5)).await.unwrap(), want);
        t.release(&h).await.unwrap();
        rounds += 1;
    }
    // Each silent socket is closed by the eviction or the deadline, and
    // sent nothing (a TLS client could not read a plaintext ERR).
    let silent = flood.await.unwrap();
    let closed = futures::future::join_all(silent.into_iter().map(|mut s| async move {
        let mut got = Vec::new();
        let _ = s.read_to_end(&mut got).await;
        got.len()
    }));
    let sent = tokio::time::timeout(cfg.handshake_timeout + Duration::from_secs(5), closed)
        .await
        .expect("every silent socket closed by the handshake deadline");
    assert!(sent.iter().all(|&n| n == 0), "bytes sent to silent sockets");
    let mut stats = tls_stats(&relay).await;
    for _ in 0..100 {
        if stats.handshakes == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        stats = tls_stats(&relay).await;
    }
    assert_eq!(stats.handshakes, 0, "{stats:?}");
    let failed = |r: &str| stats.handshake_failures.get(r).copied().unwrap_or(0);
    assert!(
        failed("evicted") + failed("timeout") >= SILENT as u64,
        "{stats:?}"
    );
    assert_eq!(failed("refused"), 0, "{stats:?}");
    assert_eq!(stats.keys, 0, "{stats:?}");
    relay.stop().await;
}
