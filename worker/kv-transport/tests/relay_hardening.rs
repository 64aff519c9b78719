//! The relay under hostile or broken peers, on loopback: authentication
//! (no secret, wrong secret, no handshake), slow-loris PUTs against the read
//! deadline, the idle timeout, floods of connections, waiting GETs and empty
//! PUTs against their caps, bad frames, and a black-holed relay against the
//! client's deadlines, replies nobody reads against the write deadline. Each test ends with the relay holding nothing (from
//! STATS) and a normal push / pull working.

mod common;

use std::time::{Duration, Instant};

use common::freezer::Freezer;
use common::{
    TestRelay, assert_clean_and_working, client_cfg, eventually, put_header, raw_frame, read_frame,
    rejected, rss_bytes, secret, ttl_cfg, wrong_secret,
};
use rngd_kv_transport::conformance::payload;
use rngd_kv_transport::frame::{ErrCode, HEADER_LEN, Header, Op};
use rngd_kv_transport::relay::{self, RelayConfig};
use rngd_kv_transport::tcp::TcpTransport;
use rngd_kv_transport::{KvError, KvTransport, TransportConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Bound on every wait in these tests.
const WITHIN: Duration = Duration::from_secs(20);

fn cfg() -> RelayConfig {
    ttl_cfg(Duration::from_secs(60))
}

/// Reads until EOF; panics if the relay keeps the connection open past `WITHIN`.
async fn assert_closed(s: &mut TcpStream) {
    let mut rest = Vec::new();
    let n = tokio::time::timeout(WITHIN, s.read_to_end(&mut rest))
        .await
        .expect("the relay closes the connection")
        .unwrap_or(0);
    assert!(n < 1 << 20, "{n} bytes after the error");
}

/// Expects an ERR with `code` as the next frame, then the connection closed.
async fn expect_err_and_close(s: &mut TcpStream, code: ErrCode) -> String {
    let (h, msg) = tokio::time::timeout(WITHIN, read_frame(s))
        .await
        .expect("a reply in time")
        .expect("an error reply before the close");
    assert_eq!(h.op, Op::Err);
    let msg = String::from_utf8_lossy(&msg).into_owned();
    assert_eq!(ErrCode::from_u32(h.arg), code, "{msg}");
    assert_closed(s).await;
    msg
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_or_wrong_secret_is_refused_and_sees_nothing() {
    let relay = TestRelay::start(RelayConfig {
        read_timeout: Duration::from_millis(500),
        ..cfg()
    })
    .await;
    let good = relay.authed();
    let p = payload("kept", 1, 2, 4096);
    let want = p.blobs.clone();
    let kept = good.push(p).await.unwrap();

    let none = relay.client(&TransportConfig::default());
    let wrong = relay.client(&TransportConfig {
        tcp_secret: Some(wrong_secret()),
        ..TransportConfig::default()
    });
    for (who, t) in [("no secret", &none), ("wrong secret", &wrong)] {
        let err = t.push(payload("intruder", 2, 1, 100)).await.unwrap_err();
        assert!(
            matches!(err, KvError::Unauthorized { .. }) && err.to_string().contains("tcp"),
            "{who}: {err}"
        );
        let err = t.pull(&kept, Duration::from_secs(2)).await.unwrap_err();
        assert!(matches!(err, KvError::Unauthorized { .. }), "{who}: {err}");
        let err = t.release(&kept).await.unwrap_err();
        assert!(matches!(err, KvError::Unauthorized { .. }), "{who}: {err}");
        assert!(t.stats().await.is_err(), "{who}: STATS refused too");
    }
    let msg = none
        .push(payload("x", 3, 1, 1))
        .await
        .unwrap_err()
        .to_string();
    assert!(msg.contains("has none"), "{msg}");
    let msg = wrong
        .push(payload("x", 3, 1, 1))
        .await
        .unwrap_err()
        .to_string();
    assert!(msg.contains("different secrets"), "{msg}");

    // A raw peer that skips the handshake and sends a PUT: a fixed refusal,
    // the connection closed, nothing stored.
    let mut s = TcpStream::connect(relay.addr).await.unwrap();
    let body = vec![7u8; 1000];
    raw_frame(
        &mut s,
        put_header(1, "raw", 0, body.len() as u64),
        "raw",
        &body,
    )
    .await;
    let mut hello = [0u8; HEADER_LEN + 32];
    s.read_exact(&mut hello).await.unwrap();
    let msg = expect_err_and_close(&mut s, ErrCode::Unauthorized).await;
    assert_eq!(msg, "authentication failed", "says nothing of why");
    // One that never answers the HELLO: closed after the handshake deadline.
    let mut s = TcpStream::connect(relay.addr).await.unwrap();
    s.read_exact(&mut hello).await.unwrap();
    expect_err_and_close(&mut s, ErrCode::Unauthorized).await;

    // A client with a secret refuses a relay that checks none.
    let open = TestRelay::start(RelayConfig {
        secret: None,
        ..cfg()
    })
    .await;
    let err = open.authed().push(payload("y", 4, 1, 1)).await.unwrap_err();
    assert!(matches!(err, KvError::Unauthorized { .. }), "{err}");
    assert!(err.to_string().contains("--insecure-no-auth"), "{err}");
    open.stop().await;

    let s = relay.stats().await;
    assert_eq!(
        (s.keys, s.blobs),
        (1, 2),
        "only the good push is held: {s:?}"
    );
    let refused = rejected(&s, "auth");
    assert!(refused >= 10, "{s:?}");
    // A TCP probe (connect, close) is not a failed authentication.
    let mut probes = Vec::new();
    for _ in 0..3 {
        probes.push(TcpStream::connect(relay.addr).await.unwrap());
    }
    drop(probes);
    let s = eventually(&relay, WITHIN, "probes gone", |s| s.handshakes == 0).await;
    assert_eq!(rejected(&s, "auth"), refused, "{s:?}");
    assert_eq!(good.pull(&kept, WITHIN).await.unwrap(), want);
    good.release(&kept).await.unwrap();
    assert_clean_and_working(&relay, "auth").await;
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_loris_puts_do_not_block_a_push_and_are_closed_after_the_read_deadline() {
    const STALLED: usize = 70;
    let relay = TestRelay::start(RelayConfig {
        // Room for one 16 MiB blob: reserved up front, 70 announced ones
        // would have filled it 70 times over.
        max_bytes: 16 << 20,
        max_frame: 16 << 20,
        read_timeout: Duration::from_secs(3),
        ..cfg()
    })
    .await;
    let mut stalled = Vec::new();
    for i in 0..STALLED {
        let mut s = relay.raw().await;
        let key = format!("loris-{i}");
        // The header of a 16 MiB PUT, and 1 KiB of its body.
        raw_frame(&mut s, put_header(1, &key, 0, 16 << 20), &key, &[1u8; 1024]).await;
        stalled.push(s);
    }
    let s = eventually(&relay, WITHIN, "every stalled PUT in its body", |s| {
        s.puts_in_progress == STALLED
    })
    .await;
    assert!(
        s.bytes < 1 << 20,
        "only the bytes that arrived count: {s:?}"
    );
    // A normal 1 MiB push goes through meanwhile.
    let t = relay.authed();
    let p = payload("normal", 5, 1, 1 << 20);
    let want = p.blobs.clone();
    let h = t.push(p).await.unwrap();
    assert_eq!(t.pull(&h, WITHIN).await.unwrap(), want);
    t.release(&h).await.unwrap();
    // The stalled ones are told and closed once their deadline passed.
    let started = Instant::now();
    for s in &mut stalled {
        let msg = expect_err_and_close(s, ErrCode::Timeout).await;
        assert!(msg.contains("did not arrive within"), "{msg}");
    }
    assert!(started.elapsed() < WITHIN);
    let s = eventually(&relay, WITHIN, "stalled PUTs gone", |s| {
        s.puts_in_progress == 0
    })
    .await;
    assert!(rejected(&s, "read_timeout") >= STALLED as u64, "{s:?}");
    assert_clean_and_working(&relay, "loris").await;
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_are_closed_but_not_while_a_get_waits() {
    let relay = TestRelay::start(RelayConfig {
        idle_timeout: Duration::from_millis(300),
        ..cfg()
    })
    .await;
    // A GET waiting longer than the idle timeout keeps its connection.
    let mut s = relay.raw().await;
    let mut get = Header::new(Op::Get, 4);
    get.key_len = 6;
    get.arg = 1200;
    raw_frame(&mut s, get, "absent", b"").await;
    let (h, msg) = read_frame(&mut s).await.unwrap();
    assert_eq!(
        ErrCode::from_u32(h.arg),
        ErrCode::NotFound,
        "{}",
        String::from_utf8_lossy(&msg)
    );
    // Then, with nothing left to do, it is closed as idle.
    let msg = expect_err_and_close(&mut s, ErrCode::Timeout).await;
    assert!(msg.contains("idle"), "{msg}");
    // A pooled client whose connection the relay closed just reconnects.
    let t = relay.authed();
    let h = t.push(payload("before-idle", 6, 1, 100)).await.unwrap();
    eventually(
        &relay,
        WITHIN,
        "the pooled connection closed as idle",
        |s| s.connections == 1,
    )
    .await;
    assert_eq!(t.pull(&h, WITHIN).await.unwrap().len(), 1);
    t.release(&h).await.unwrap();
    let s = relay.stats().await;
    assert!(rejected(&s, "idle_timeout") >= 2, "{s:?}");
    assert_clean_and_working(&relay, "idle").await;
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_flood_over_the_cap_is_refused_and_existing_ones_keep_working() {
    const CAP: usize = 8;
    let relay = TestRelay::start(RelayConfig {
        max_connections: CAP,
        ..cfg()
    })
    .await;
    let t = relay.authed();
    let h = t.push(payload("early", 7, 2, 1000)).await.unwrap();
    assert_eq!(t.idle_connections(), 1);
    let mut held = Vec::new();
    for _ in 0..CAP - 1 {
        held.push(relay.raw().await);
    }
    // Over the cap: an ERR naming the cap instead of the HELLO, then closed.
    for _ in 0..20 {
        let mut s = TcpStream::connect(relay.addr).await.unwrap();
        let msg = expect_err_and_close(&mut s, ErrCode::Capacity).await;
        assert!(msg.contains("connection cap"), "{msg}");
    }
    let err = relay
        .authed()
        .push(payload("late", 8, 1, 10))
        .await
        .unwrap_err();
    assert!(
        matches!(err, KvError::Capacity { .. }) && err.to_string().contains("connection cap"),
        "{err}"
    );
    // The connections already in keep working.
    assert_eq!(t.pull(&h, WITHIN).await.unwrap().len(), 2);
    let mut s = held.pop().unwrap();
    raw_frame(&mut s, Header::new(Op::Stats, 9), "", b"").await;
    let (reply, body) = read_frame(&mut s).await.unwrap();
    assert_eq!(reply.op, Op::Ok);
    let stats: relay::RelayStats = serde_json::from_slice(&body).unwrap();
    assert_eq!(stats.connections, CAP, "{stats:?}");
    assert!(rejected(&stats, "connections") >= 21, "{stats:?}");
    t.release(&h).await.unwrap();
    // After the flood, room again.
    drop((s, held));
    eventually(&relay, WITHIN, "held connections closed", |s| {
        s.connections <= 2
    })
    .await;
    assert_clean_and_working(&relay, "connections").await;
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_get_flood_beyond_the_waiter_cap_gets_errors() {
    const CAP: usize = 16;
    const SENT: usize = 40;
    let relay = TestRelay::start(RelayConfig {
        max_waiters: CAP,
        ..cfg()
    })
    .await;
    let mut s = relay.raw().await;
    for i in 0..SENT {
        let key = format!("absent-{i}");
        let mut get = Header::new(Op::Get, i as u32);
        get.key_len = key.len() as u16;
        get.arg = 60_000;
        raw_frame(&mut s, get, &key, b"").await;
    }
    for _ in 0..SENT - CAP {
        let (h, msg) = tokio::time::timeout(WITHIN, read_frame(&mut s))
            .await
            .unwrap()
            .unwrap();
        let msg = String::from_utf8_lossy(&msg);
        assert_eq!(ErrCode::from_u32(h.arg), ErrCode::Capacity, "{msg}");
        assert!(msg.contains("waiting GETs"), "{msg}");
    }
    let stats = relay.stats().await;
    assert_eq!(stats.waiters, CAP, "{stats:?}");
    assert_eq!(rejected(&stats, "waiters"), (SENT - CAP) as u64);
    // A pull meanwhile is a clear capacity error, not another waiter.
    let t = relay.authed();
    let h = t.push(payload("present", 9, 1, 100)).await.unwrap();
    let mut absent = h.clone();
    absent.request_id = "absent-too".into();
    let err = t.pull(&absent, Duration::from_secs(30)).await.unwrap_err();
    assert!(matches!(err, KvError::Capacity { .. }), "{err}");
    t.release(&h).await.unwrap();
    drop(s);
    assert_clean_and_working(&relay, "waiters").await;
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_put_flood_hits_the_entry_cap_and_the_per_blob_overhead() {
    // The entry cap.
    let relay = TestRelay::start(RelayConfig {
        max_entries: 100,
        ..cfg()
    })
    .await;
    let mut s = relay.raw().await;
    for i in 0..150u32 {
        raw_frame(&mut s, put_header(i, "empties", i, 0), "empties", b"").await;
    }
    let mut codes = Vec::new();
    for _ in 0..150 {
        let (h, _) = read_frame(&mut s).await.unwrap();
        codes.push((h.op == Op::Ok, h.seq));
    }
    assert_eq!(codes.iter().filter(|c| c.0).count(), 100, "{codes:?}");
    let stats = relay.stats().await;
    assert_eq!(stats.blobs, 100);
    assert_eq!(stats.bytes, 100 * relay::ENTRY_OVERHEAD, "{stats:?}");
    assert_eq!(rejected(&stats, "entries"), 50);
    let mut del = Header::new(Op::Del, 999);
    del.key_len = 7;
    raw_frame(&mut s, del, "empties", b"").await;
    assert_eq!(read_frame(&mut s).await.unwrap().0.op, Op::Ok);
    drop(s);
    assert_clean_and_working(&relay, "entries").await;
    relay.stop().await;

    // The memory cap counts the overhead: empty blobs fill it too.
    let relay = TestRelay::start(RelayConfig {
        max_bytes: 10 * relay::ENTRY_OVERHEAD,
        ..cfg()
    })
    .await;
    let mut s = relay.raw().await;
    for i in 0..20u32 {
        raw_frame(&mut s, put_header(i, "zeros", i, 0), "zeros", b"").await;
    }
    let mut ok = 0;
    for _ in 0..20 {
        let (h, msg) = read_frame(&mut s).await.unwrap();
        if h.op == Op::Ok {
            ok += 1;
        } else {
            assert_eq!(ErrCode::from_u32(h.arg), ErrCode::Capacity);
            assert!(String::from_utf8_lossy(&msg).contains("memory cap"));
        }
    }
    assert_eq!(ok, 10);
    let stats = relay.stats().await;
    assert_eq!(rejected(&stats, "memory"), 10, "{stats:?}");
    let mut del = Header::new(Op::Del, 999);
    del.key_len = 5;
    raw_frame(&mut s, del, "zeros", b"").await;
    assert_eq!(read_frame(&mut s).await.unwrap().0.op, Op::Ok);
    drop(s);
    // No room for a 1 MiB push under this tiny cap: a small one still works.
    let s = eventually(&relay, WITHIN, "empty", |s| s.blobs == 0).await;
    assert_eq!(s.bytes, 0);
    let t = relay.authed();
    let p = payload("small", 15, 2, 100);
    let want = p.blobs.clone();
    let h = t.push(p).await.unwrap();
    assert_eq!(t.pull(&h, WITHIN).await.unwrap(), want);
    t.release(&h).await.unwrap();
    let s = relay.stats().await;
    assert_eq!((s.blobs, s.bytes), (0, 0), "{s:?}");
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_key_or_oversize_frame_closes_only_its_connection() {
    let relay = TestRelay::start(RelayConfig {
        max_frame: 1 << 20,
        ..cfg()
    })
    .await;
    let t = relay.authed();
    let h = t.push(payload("bystander", 10, 2, 1000)).await.unwrap();
    // A key sanitize_key never makes; its body is never parsed as frames.
    let mut s = relay.raw().await;
    let mut sneaky = put_header(1, "../etc", 0, HEADER_LEN as u64);
    sneaky.key_len = 6;
    let inner = Header::new(Op::Stats, 2).encode();
    raw_frame(&mut s, sneaky, "../etc", &inner).await;
    let msg = expect_err_and_close(&mut s, ErrCode::Malformed).await;
    assert!(msg.contains("invalid key"), "{msg}");
    // An oversize body: refused from the header alone (none of it is sent).
    let mut s = relay.raw().await;
    raw_frame(&mut s, put_header(3, "big", 0, 2 << 20), "big", b"").await;
    let msg = expect_err_and_close(&mut s, ErrCode::TooLarge).await;
    assert!(msg.contains("exceeds"), "{msg}");
    // A body on an op that takes none, and a key on one that takes none.
    let mut s = relay.raw().await;
    let mut get = Header::new(Op::Get, 4);
    get.key_len = 1;
    get.body_len = 10;
    raw_frame(&mut s, get, "k", &[0; 10]).await;
    expect_err_and_close(&mut s, ErrCode::Malformed).await;
    let mut s = relay.raw().await;
    let mut stats = Header::new(Op::Stats, 5);
    stats.key_len = 1;
    raw_frame(&mut s, stats, "k", b"").await;
    expect_err_and_close(&mut s, ErrCode::Malformed).await;
    // A second handshake after the first.
    let mut s = relay.raw().await;
    let mut auth = Header::new(Op::Auth, 6);
    auth.body_len = 64;
    raw_frame(&mut s, auth, "", &[0; 64]).await;
    expect_err_and_close(&mut s, ErrCode::Malformed).await;
    // Everyone else is unaffected.
    assert_eq!(t.pull(&h, WITHIN).await.unwrap().len(), 2);
    t.release(&h).await.unwrap();
    let s = relay.stats().await;
    assert!(rejected(&s, "malformed") >= 4, "{s:?}");
    assert_eq!(rejected(&s, "too_large"), 1, "{s:?}");
    assert_eq!(s.keys, 0, "the refused PUTs stored nothing: {s:?}");
    assert_clean_and_working(&relay, "frames").await;
    relay.stop().await;
}

fn quick(addr: impl ToString) -> TcpTransport {
    TcpTransport::connect_to(
        addr.to_string(),
        &TransportConfig {
            tcp_timeout: Duration::from_secs(1),
            ..client_cfg()
        },
    )
}

fn assert_timeout(err: &KvError, op: &str, took: Duration, bound: Duration) {
    assert!(
        matches!(err, KvError::Timeout { .. }),
        "{op}: expected a timeout, got {err}"
    );
    let msg = err.to_string();
    assert!(msg.contains("transport `tcp`"), "{op}: {msg}");
    assert!(took < bound, "{op}: the error came after {took:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_black_holed_relay_is_a_clear_error_within_the_deadline() {
    // A listener that accepts and never answers: no HELLO ever comes.
    let silent = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent_addr = silent.local_addr().unwrap();
    let _keep = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = silent.accept().await {
            held.push(s);
        }
    });
    let t = quick(silent_addr);
    let started = Instant::now();
    let err = t
        .push(payload("into-the-void", 11, 1, 100))
        .await
        .unwrap_err();
    assert_timeout(&err, "push", started.elapsed(), Duration::from_secs(5));
    assert!(err.to_string().contains(&silent_addr.to_string()), "{err}");
    let handle = {
        let relay = TestRelay::start(cfg()).await;
        let h = relay.authed().push(payload("h", 12, 1, 10)).await.unwrap();
        relay.stop().await;
        h
    };
    let started = Instant::now();
    let err = t
        .pull(&handle, Duration::from_millis(500))
        .await
        .unwrap_err();
    assert_timeout(&err, "pull", started.elapsed(), Duration::from_secs(8));
    let started = Instant::now();
    let err = t.release(&handle).await.unwrap_err();
    assert_timeout(&err, "release", started.elapsed(), Duration::from_secs(5));

    // A relay that stops answering on an authenticated, pooled connection.
    let relay = TestRelay::start(RelayConfig {
        read_timeout: Duration::from_secs(1),
        ..cfg()
    })
    .await;
    let proxy = Freezer::start(relay.addr).await;
    let t = quick(proxy.addr);
    let h = t.push(payload("warm", 13, 2, 1 << 16)).await.unwrap();
    assert_eq!(t.idle_connections(), 1);
    proxy.freeze.send(true).unwrap();
    let started = Instant::now();
    let err = t.push(payload("frozen", 14, 4, 1 << 20)).await.unwrap_err();
    assert_timeout(&err, "push", started.elapsed(), Duration::from_secs(5));
    let started = Instant::now();
    let err = t.pull(&h, Duration::from_millis(500)).await.unwrap_err();
    assert_timeout(&err, "pull", started.elapsed(), Duration::from_secs(8));
    let started = Instant::now();
    let err = t.release(&h).await.unwrap_err();
    assert_timeout(&err, "release", started.elapsed(), Duration::from_secs(5));
    // The relay itself is fine: the cache pushed before the freeze is there.
    let direct = relay.authed();
    assert_eq!(direct.pull(&h, WITHIN).await.unwrap().len(), 2);
    direct.release(&h).await.unwrap();
    // Whatever of the frozen push reached the relay is dropped at the read deadline.
    let s = eventually(&relay, WITHIN, "partial PUTs dropped", |s| {
        s.puts_in_progress == 0 && s.keys == 0
    })
    .await;
    assert_eq!(s.bytes, 0, "{s:?}");
    assert_clean_and_working(&relay, "black-hole").await;
    relay.stop().await;
}

#[tokio::test]
async fn secrets_do_not_show_in_debug_output() {
    let cfg = cfg();
    let shown = format!("{cfg:?} {:?} {:?}", client_cfg(), secret());
    assert!(!shown.contains("test-relay-secret"), "{shown}");
    let relay = TestRelay::start(cfg).await;
    let shown = format!("{:?}", relay.authed());
    assert!(!shown.contains("test-relay-secret"), "{shown}");
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unread_replies_are_cut_at_the_write_deadline_with_memory_bounded() {
    let relay = TestRelay::start(RelayConfig {
        read_timeout: Duration::from_millis(300),
        ..cfg()
    })
    .await;
    // An 8 MiB blob, then 200 GETs of it on one connection whose replies are
    // never read: 1.6 GiB of replies if the relay buffered them.
    let t = relay.authed();
    let h = t.push(payload("unread-big", 7, 1, 8 << 20)).await.unwrap();
    let before = rss_bytes();
    let mut s = relay.raw().await;
    let key = h.request_id.clone();
    for i in 0..200u32 {
        let mut get = Header::new(Op::Get, i);
        get.key_len = key.len() as u16;
        get.index = 0;
        get.arg = 100;
        if s.write_all(&get.encode()).await.is_err() || s.write_all(key.as_bytes()).await.is_err() {
            break; // already cut off
        }
    }
    eventually(
        &relay,
        WITHIN,
        "the unread connection cut at the write deadline",
        |st| rejected(st, "write_timeout") >= 1,
    )
    .await;
    let grown = rss_bytes().saturating_sub(before);
    assert!(
        grown < 128 << 20,
        "RSS grew by {} MiB while replies went unread",
        grown >> 20
    );
    drop(s);
    // The blob is still there for a reader that reads.
    assert_eq!(t.pull(&h, WITHIN).await.unwrap()[0].len(), 8 << 20);
    t.release(&h).await.unwrap();
    assert_clean_and_working(&relay, "unread").await;
    relay.stop().await;
}
