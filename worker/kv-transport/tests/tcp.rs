//! The `tcp` transport against an in-process relay on 127.0.0.1 (with a
//! shared secret): the conformance suite, plus the relay's own guarantees
//! (frame limits, memory cap, CRC on PUT, restart during a push, connection
//! pooling). The hardening (authentication, deadlines, caps) is in
//! `relay_hardening.rs`.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{TestRelay, busy, client_cfg, raw_frame, read_frame, ttl_cfg};
use rngd_kv_transport::conformance::{self, Harness};
use rngd_kv_transport::frame::{ErrCode, FLAG_CRC, HEADER_LEN, Header, Op};
use rngd_kv_transport::relay::{self, RelayConfig, RelayStats};
use rngd_kv_transport::tcp::TcpTransport;
use rngd_kv_transport::{KvError, KvHandle, KvTransport, TransportConfig, sanitize_key};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

struct TcpHarness {
    relay: Arc<TestRelay>,
    probe: TcpTransport,
}

#[async_trait::async_trait]
impl Harness for TcpHarness {
    fn make(&self) -> Arc<dyn KvTransport> {
        Arc::new(self.relay.authed())
    }

    async fn held(&self) -> Result<usize, KvError> {
        Ok(busy(&self.probe.stats().await?))
    }

    /// Replaces a stored blob by a copy with one byte flipped, PUT with the
    /// CRC of the corrupt bytes, so the relay accepts it and only the
    /// receiver's check against the handle can catch it.
    async fn corrupt(&self, handle: &KvHandle, index: usize) -> Result<(), KvError> {
        let key = sanitize_key("tcp", &handle.request_id)?;
        let mut s = self.relay.raw().await;
        let mut get = Header::new(Op::Get, 1);
        get.key_len = key.len() as u16;
        get.index = index as u32;
        get.arg = 1000;
        raw_frame(&mut s, get, &key, b"").await;
        let (h, mut blob) = read_frame(&mut s).await.unwrap();
        assert_eq!(h.op, Op::Ok, "{}", String::from_utf8_lossy(&blob));
        let mid = blob.len() / 2;
        blob[mid] ^= 0x40;
        let mut put = Header::new(Op::Put, 2);
        put.key_len = key.len() as u16;
        put.index = index as u32;
        put.body_len = blob.len() as u64;
        put.crc32 = rngd_kv_wire::crc32(&blob);
        put.flags = FLAG_CRC;
        raw_frame(&mut s, put, &key, &blob).await;
        let (h, msg) = read_frame(&mut s).await.unwrap();
        assert_eq!(h.op, Op::Ok, "{}", String::from_utf8_lossy(&msg));
        Ok(())
    }

    fn ttl(&self) -> Duration {
        self.relay.cfg.ttl
    }

    async fn restart(&self) -> Result<bool, KvError> {
        self.relay.restart().await;
        Ok(true)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_passes_the_conformance_suite() {
    let relay = TestRelay::start(ttl_cfg(Duration::from_millis(400))).await;
    let h = TcpHarness {
        probe: relay.authed(),
        relay,
    };
    let report = conformance::run_all(&h)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    for (check, note) in &report.passed {
        eprintln!("tcp conformance: {check}: {note}");
    }
    assert_eq!(report.passed.len(), 9, "{report:?}");
    assert!(report.not_applicable.is_empty());
    h.relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversize_and_malformed_frames_close_only_their_connection() {
    let relay = TestRelay::start(RelayConfig {
        max_frame: 1 << 20,
        ..ttl_cfg(Duration::from_secs(30))
    })
    .await;
    let t = relay.authed();
    // Oversize: the relay answers TooLarge and closes.
    let mut s = relay.raw().await;
    let mut h = Header::new(Op::Put, 9);
    h.key_len = 1;
    h.body_len = 2 << 20;
    raw_frame(&mut s, h, "k", b"").await;
    let (reply, msg) = read_frame(&mut s).await.unwrap();
    assert_eq!(reply.op, Op::Err);
    assert_eq!(ErrCode::from_u32(reply.arg), ErrCode::TooLarge);
    assert!(String::from_utf8_lossy(&msg).contains("exceeds"));
    let mut rest = Vec::new();
    assert_eq!(
        s.read_to_end(&mut rest).await.unwrap(),
        0,
        "connection closed"
    );
    // Malformed: garbage instead of a header.
    let mut s = relay.raw().await;
    s.write_all(&[0xAB; HEADER_LEN]).await.unwrap();
    let (reply, _) = read_frame(&mut s).await.unwrap();
    assert_eq!(ErrCode::from_u32(reply.arg), ErrCode::Malformed);
    assert_eq!(
        s.read_to_end(&mut rest).await.unwrap(),
        0,
        "connection closed"
    );
    // The relay still serves everyone else.
    let p = conformance::payload("after-bad-frames", 5, 4, 1 << 19);
    let want = p.blobs.clone();
    let handle = t.push(p).await.unwrap();
    assert_eq!(
        t.pull(&handle, Duration::from_secs(10)).await.unwrap(),
        want
    );
    t.release(&handle).await.unwrap();
    // A client blob over the limit is a clear bad request.
    let err = t
        .push(conformance::payload("too-big", 6, 1, 2 << 20))
        .await
        .unwrap_err();
    assert!(matches!(err, KvError::BadRequest { .. }), "{err}");
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_rejects_a_bad_crc_and_keeps_the_connection() {
    let relay = TestRelay::start(ttl_cfg(Duration::from_secs(30))).await;
    let mut s = relay.raw().await;
    let body = vec![5u8; 1000];
    let mut h = Header::new(Op::Put, 1);
    h.key_len = 3;
    h.body_len = body.len() as u64;
    h.crc32 = rngd_kv_wire::crc32(&body) ^ 1;
    h.flags = FLAG_CRC;
    raw_frame(&mut s, h, "key", &body).await;
    let (reply, msg) = read_frame(&mut s).await.unwrap();
    assert_eq!(ErrCode::from_u32(reply.arg), ErrCode::Crc);
    assert!(String::from_utf8_lossy(&msg).contains("CRC-32"));
    raw_frame(&mut s, Header::new(Op::Stats, 2), "", b"").await;
    let (reply, stats) = read_frame(&mut s).await.unwrap();
    assert_eq!(reply.op, Op::Ok);
    let stats: RelayStats = serde_json::from_slice(&stats).unwrap();
    assert_eq!((stats.blobs, stats.bytes), (0, 0), "nothing stored");
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_cap_is_a_capacity_error_and_leaves_nothing() {
    let relay = TestRelay::start(RelayConfig {
        max_bytes: 4 << 20,
        ..ttl_cfg(Duration::from_secs(30))
    })
    .await;
    let t = relay.authed();
    let err = t
        .push(conformance::payload("big", 1, 8, 1 << 20))
        .await
        .unwrap_err();
    assert!(matches!(err, KvError::Capacity { .. }), "{err}");
    let s = t.stats().await.unwrap();
    assert_eq!((s.keys, s.bytes), (0, 0), "partial request removed: {s:?}");
    // Within the cap it works.
    let p = conformance::payload("fits", 2, 3, 1 << 20);
    let want = p.blobs.clone();
    let handle = t.push(p).await.unwrap();
    assert_eq!(
        t.pull(&handle, Duration::from_secs(10)).await.unwrap(),
        want
    );
    t.release(&handle).await.unwrap();
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crc_off_still_moves_bytes_exactly() {
    let relay = TestRelay::start(ttl_cfg(Duration::from_secs(30))).await;
    let cfg = TransportConfig {
        tcp_crc: false,
        tcp_log: true,
        ..client_cfg()
    };
    let t = relay.client(&cfg);
    let p = conformance::payload("nocrc", 3, 4, 4096);
    let want = p.blobs.clone();
    let handle = t.push(p).await.unwrap();
    assert!(handle.blobs.iter().all(|b| b.crc32 == 0));
    assert_eq!(
        t.pull(&handle, Duration::from_secs(10)).await.unwrap(),
        want
    );
    t.release(&handle).await.unwrap();
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_are_pooled() {
    let relay = TestRelay::start(ttl_cfg(Duration::from_secs(30))).await;
    let t = relay.authed();
    for i in 0..20 {
        let p = conformance::payload(&format!("pool-{i}"), i, 2, 1000);
        let handle = t.push(p).await.unwrap();
        t.pull(&handle, Duration::from_secs(5)).await.unwrap();
        t.release(&handle).await.unwrap();
    }
    let s = t.stats().await.unwrap();
    assert_eq!(
        s.connections, 1,
        "sequential requests share one connection: {s:?}"
    );
    assert_eq!(t.idle_connections(), 1);
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_stopping_mid_push_is_a_clear_error_for_the_pusher() {
    let relay = TestRelay::start(ttl_cfg(Duration::from_secs(30))).await;
    let t = relay.authed();
    let big = conformance::full_request("mid-push", 1);
    let blobs: Vec<Bytes> = big.blobs.clone();
    let mut caught = None;
    for attempt in 0..20 {
        let mut p = big.clone();
        p.request_id = format!("mid-push-{attempt}");
        p.blobs = blobs.clone();
        let t2 = t.clone();
        let push = tokio::spawn(async move { t2.push(p).await });
        // Wait until the relay is receiving a PUT body of this push.
        let probe = relay.authed();
        let mut in_body = false;
        while !push.is_finished() {
            if probe
                .stats()
                .await
                .map(|s| s.puts_in_progress > 0)
                .unwrap_or(false)
            {
                in_body = true;
                break;
            }
        }
        if !in_body {
            let h = push.await.unwrap().unwrap();
            t.release(&h).await.unwrap();
            continue;
        }
        let started = Instant::now();
        relay.restart().await;
        let res = push.await.unwrap();
        caught = Some((res, started.elapsed()));
        break;
    }
    let (res, took) = caught.expect("never caught a push in flight in 20 attempts");
    match res {
        Err(e @ KvError::ConnectionLost { .. }) => {
            assert!(took < Duration::from_secs(10), "error came after {took:?}");
            assert!(e.to_string().contains(&relay.addr.to_string()), "{e}");
        }
        Err(e) => panic!("expected ConnectionLost, got {e}"),
        // The push finished against the old relay just before it stopped:
        // then its handle must not pull from the new one.
        Ok(h) => {
            let err = t.pull(&h, Duration::from_secs(5)).await.unwrap_err();
            assert!(matches!(err, KvError::ConnectionLost { .. }), "{err}");
        }
    }
    // The pusher recovers on the restarted relay.
    let h = t
        .push(conformance::payload("after", 2, 2, 100))
        .await
        .unwrap();
    t.release(&h).await.unwrap();
    relay.stop().await;
}

/// The flags themselves are parsed in `rngd-pd relay` (`worker/cli/relay.rs`,
/// which has the flag-parsing half of this test); here the options they give.
#[test]
fn relay_options_give_the_config() {
    let opts = relay::RelayOptions {
        listen: "127.0.0.1:9999".into(),
        ttl_s: 2.5,
        max_bytes: 1000,
        max_frame: 100,
        secret: Some(common::secret()),
        ..relay::RelayOptions::default()
    };
    let cfg = opts.config().unwrap();
    assert_eq!(cfg.listen, "127.0.0.1:9999");
    assert_eq!(cfg.ttl, Duration::from_millis(2500));
    assert_eq!((cfg.max_bytes, cfg.max_frame), (1000, 100));
    let opts = relay::RelayOptions {
        ttl_s: 0.0,
        ..relay::RelayOptions::default()
    };
    assert!(opts.config().is_err(), "a zero TTL is rejected");
}

#[tokio::test]
async fn launched_relay_serves_until_shut_down() {
    let launched = relay::launch(relay::RelayOptions {
        listen: "127.0.0.1:0".into(),
        secret: Some(common::secret()),
        ..relay::RelayOptions::default()
    })
    .await
    .unwrap();
    assert_ne!(launched.addr.port(), 0, "the bound port is reported");
    // With a secret the launched relay speaks TLS keyed by it (the default).
    let tls_cfg = TransportConfig {
        tcp_tls: Some(relay::ClientTls::from_secret(&common::secret()).unwrap()),
        ..client_cfg()
    };
    let plain = TcpTransport::connect_to(launched.addr.to_string(), &client_cfg());
    let plain = tokio::time::timeout(Duration::from_secs(10), plain.stats()).await;
    assert!(matches!(plain, Ok(Err(_))), "a plaintext client is refused");
    let t = TcpTransport::connect_to(launched.addr.to_string(), &tls_cfg);
    let p = conformance::payload("launched", 5, 3, 1000);
    let h = t.push(p.clone()).await.unwrap();
    assert_eq!(t.pull(&h, Duration::from_secs(5)).await.unwrap(), p.blobs);
    t.release(&h).await.unwrap();
    assert_eq!(t.stats().await.unwrap().keys, 0);
    launched.shutdown();
    launched.join().await.unwrap();
    let gone = TcpTransport::connect_to(h.location.split('#').next().unwrap(), &tls_cfg);
    assert!(gone.stats().await.is_err(), "the relay stopped listening");
    let bad = relay::launch(relay::RelayOptions {
        listen: "127.0.0.1:0".into(),
        max_bytes: 0,
        secret: Some(common::secret()),
        ..relay::RelayOptions::default()
    })
    .await
    .unwrap_err();
    assert!(matches!(bad, KvError::Config { .. }), "{bad}");
    // Without a secret the relay does not start, unless told to run without.
    let no_secret = relay::launch(relay::RelayOptions {
        listen: "127.0.0.1:0".into(),
        ..relay::RelayOptions::default()
    })
    .await
    .unwrap_err();
    assert!(
        no_secret.to_string().contains("--insecure-no-auth"),
        "{no_secret}"
    );
    let insecure = relay::launch(relay::RelayOptions {
        listen: "127.0.0.1:0".into(),
        insecure_no_auth: true,
        ..relay::RelayOptions::default()
    })
    .await
    .unwrap();
    let open = TcpTransport::connect_to(insecure.addr.to_string(), &TransportConfig::default());
    assert_eq!(
        open.stats().await.unwrap().keys,
        0,
        "serves without a secret"
    );
    insecure.shutdown();
    insecure.join().await.unwrap();
}
