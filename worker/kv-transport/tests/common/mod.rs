//! Helpers the relay's integration tests share: an in-process relay with a
//! shared secret (restartable on the same port), clients configured with
//! that secret, and raw, authenticated connections that speak frames; in
//! `freezer`, a proxy that can be frozen (a black-holed relay); and in
//! `tmpfs`, a tiny tmpfs mounted for a real ENOSPC.

#![allow(dead_code)]

pub mod freezer;
pub mod tmpfs;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rngd_kv_transport::frame::{HEADER_LEN, Header, Op};
use rngd_kv_transport::relay::{self, RelayConfig, RelayStats, Secret};
use rngd_kv_transport::tcp::TcpTransport;
use rngd_kv_transport::{KvError, TransportConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// The secret the test relays and their clients share.
pub fn secret() -> Secret {
    Secret::parse("test-relay-secret-0123456789abcdef").unwrap()
}

/// A secret the relays do not know.
pub fn wrong_secret() -> Secret {
    Secret::parse("not-the-relay-secret-0123456789").unwrap()
}

/// A relay config with the test secret and the given TTL.
pub fn ttl_cfg(ttl: Duration) -> RelayConfig {
    RelayConfig {
        listen: "127.0.0.1:0".into(),
        ttl,
        secret: Some(secret()),
        ..RelayConfig::default()
    }
}

/// Client settings with the test secret.
pub fn client_cfg() -> TransportConfig {
    TransportConfig {
        tcp_secret: Some(secret()),
        ..TransportConfig::default()
    }
}

/// The stop signal and task of a running relay.
type Running = (oneshot::Sender<()>, JoinHandle<Result<(), KvError>>);

/// A relay running in this process; restartable on the same port.
pub struct TestRelay {
    pub addr: SocketAddr,
    pub cfg: RelayConfig,
    running: Mutex<Option<Running>>,
}

impl TestRelay {
    pub async fn start(cfg: RelayConfig) -> Arc<TestRelay> {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let r = Arc::new(TestRelay {
            addr,
            cfg,
            running: Mutex::new(None),
        });
        r.spawn(listener);
        r
    }

    fn spawn(&self, listener: TcpListener) {
        let (tx, rx) = oneshot::channel();
        let task = tokio::spawn(relay::serve(listener, self.cfg.clone(), async {
            let _ = rx.await;
        }));
        *self.running.lock().unwrap() = Some((tx, task));
    }

    pub async fn stop(&self) {
        let running = self.running.lock().unwrap().take();
        if let Some((tx, task)) = running {
            let _ = tx.send(());
            task.await.unwrap().unwrap();
        }
    }

    pub async fn restart(&self) {
        self.stop().await;
        let listener = TcpListener::bind(self.addr).await.unwrap();
        self.spawn(listener);
    }

    /// A client with `cfg`.
    pub fn client(&self, cfg: &TransportConfig) -> TcpTransport {
        TcpTransport::connect_to(self.addr.to_string(), cfg)
    }

    /// A client with the test secret.
    pub fn authed(&self) -> TcpTransport {
        self.client(&client_cfg())
    }

    /// A raw connection that has passed the handshake with the test secret.
    pub async fn raw(&self) -> TcpStream {
        let mut s = TcpStream::connect(self.addr).await.unwrap();
        relay::authenticate(&mut s, Some(&secret())).await.unwrap();
        s
    }

    /// The relay's counters, on a fresh connection (not the pools under test).
    pub async fn stats(&self) -> RelayStats {
        self.authed().stats().await.unwrap()
    }
}

/// What a relay holds: requests, waiting GETs and PUTs being received.
pub fn busy(s: &RelayStats) -> usize {
    s.keys + s.waiters + s.puts_in_progress
}

/// How often the relay refused for `reason` so far.
pub fn rejected(s: &RelayStats, reason: &str) -> u64 {
    s.rejections.get(reason).copied().unwrap_or(0)
}

/// Reads one reply frame (header and body) from a raw connection.
pub async fn read_frame(s: &mut TcpStream) -> std::io::Result<(Header, Vec<u8>)> {
    let mut hb = [0u8; HEADER_LEN];
    s.read_exact(&mut hb).await?;
    let h = Header::decode(&hb).expect("relay speaks the protocol");
    let mut body = vec![0u8; h.body_len as usize];
    s.read_exact(&mut body).await?;
    Ok((h, body))
}

/// Writes one frame on a raw connection.
pub async fn raw_frame(s: &mut TcpStream, h: Header, key: &str, body: &[u8]) {
    s.write_all(&h.encode()).await.unwrap();
    s.write_all(key.as_bytes()).await.unwrap();
    s.write_all(body).await.unwrap();
}

/// A PUT header for blob `index` of `key` with `body_len` bytes.
pub fn put_header(seq: u32, key: &str, index: u32, body_len: u64) -> Header {
    let mut h = Header::new(Op::Put, seq);
    h.key_len = key.len() as u16;
    h.index = index;
    h.body_len = body_len;
    h
}

/// Waits (polling STATS, bounded by `within`) until `done` holds; panics
/// with the last counters otherwise.
pub async fn eventually(
    relay: &TestRelay,
    within: Duration,
    what: &str,
    done: impl Fn(&RelayStats) -> bool,
) -> RelayStats {
    let until = tokio::time::Instant::now() + within;
    loop {
        // A fresh client each time: the relay may be refusing connections
        // (at its cap) for a while.
        let s = relay.authed().stats().await;
        if let Ok(s) = &s
            && done(s)
        {
            return s.clone();
        }
        if tokio::time::Instant::now() > until {
            panic!("{what}: not within {within:?}: {s:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// After a test: the relay holds nothing (its own STATS connection aside)
/// and a normal push / pull / release still works.
pub async fn assert_clean_and_working(relay: &TestRelay, tag: &str) {
    let s = eventually(relay, Duration::from_secs(10), "relay back to empty", |s| {
        busy(s) == 0 && s.blobs == 0 && s.bytes == 0
    })
    .await;
    assert_eq!((s.keys, s.blobs, s.bytes), (0, 0, 0), "{s:?}");
    let t = relay.authed();
    let p = rngd_kv_transport::conformance::payload(&format!("after-{tag}"), 99, 2, 1 << 20);
    let want = p.blobs.clone();
    use rngd_kv_transport::KvTransport;
    let h = t.push(p).await.unwrap();
    assert_eq!(t.pull(&h, Duration::from_secs(10)).await.unwrap(), want);
    t.release(&h).await.unwrap();
    let s = relay.stats().await;
    assert_eq!((s.keys, s.blobs, s.bytes), (0, 0, 0), "{s:?}");
}

/// This process's resident set, bytes (`VmRSS`).
pub fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kb * 1024
}
