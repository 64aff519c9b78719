//! `x-prefiller-host-port` is never the caller's choice: a decode worker (the
//! `EchoEngine` test double, the in-memory transport, everything on
//! 127.0.0.1:0) connects only to peers its `--prefill-allow` list admits
//! (ports included), refuses malformed entries without connecting, follows no
//! redirect, never repeats a peer's body, and stops reading an oversized
//! answer at the cap. Plus the allowlist's parsing (CIDR, IPv6, names).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use rngd_api::openai::ErrorBody;
use rngd_engine::Engine;
use rngd_engine::fake::EchoEngine;
use rngd_kv_transport::KvTransport;
use rngd_kv_transport::fake::MemoryTransport;
use rngd_worker::allow::PickError;
use rngd_worker::{AllowEntry, PeerAddr, PrefillAllow, Role, RunningWorker, Transports};
use rngd_worker::{WorkerConfig, peer::MAX_PEER_ANSWER};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

const SEQ_LEN: usize = 64;

async fn start(role: Role, mem: &Arc<MemoryTransport>, allow: &str) -> RunningWorker {
    let mut config = WorkerConfig::new(role).with_kv_secret(b"test-kv-secret-0123456789abcdef");
    config.prefill_allow = allow.parse().unwrap();
    config.prefill_timeout = Duration::from_secs(20);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let engine: Arc<dyn Engine> = Arc::new(EchoEngine::new(SEQ_LEN));
    let t: Arc<dyn KvTransport> = mem.clone();
    rngd_worker::serve(listener, engine, Transports::fixed(vec![t]), config)
        .await
        .unwrap()
}

fn request() -> Value {
    json!({"model": "echo", "prompt": "hello", "max_tokens": 3, "temperature": 0})
}

/// POSTs a completion with `x-prefiller-host-port: peer`; status and body text.
async fn post(w: &RunningWorker, peer: &str) -> (u16, String) {
    let resp = reqwest::Client::new()
        .post(format!("{}/v1/completions", w.url()))
        .header("x-prefiller-host-port", peer)
        .header("x-rngd-pd-kv-transport", "memory")
        .json(&request())
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    (status, resp.text().await.unwrap())
}

async fn refused(w: &RunningWorker, peer: &str) -> (u16, ErrorBody) {
    let (status, text) = post(w, peer).await;
    let body: ErrorBody =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("not an error body ({e}): {text}"));
    (status, body)
}

/// A listener that counts the connections it accepts (and answers nothing).
async fn counter() -> (String, Arc<AtomicUsize>) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let n = Arc::new(AtomicUsize::new(0));
    let c = n.clone();
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            c.fetch_add(1, Ordering::SeqCst);
            drop(s);
        }
    });
    (addr, n)
}

/// Reads one HTTP request (headers and a `content-length` body).
async fn read_request(s: &mut tokio::net::TcpStream) {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let n = s.read(&mut chunk).await.unwrap_or(0);
        if n == 0 {
            return;
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
            let len: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0);
            while buf.len() < end + 4 + len {
                let n = s.read(&mut chunk).await.unwrap_or(0);
                if n == 0 {
                    return;
                }
                buf.extend_from_slice(&chunk[..n]);
            }
            return;
        }
    }
}

/// A fake peer answering every request with `answer` (raw HTTP), then closing.
async fn fake_peer(answer: String) -> String {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            let answer = answer.clone();
            tokio::spawn(async move {
                read_request(&mut s).await;
                let _ = s.write_all(answer.as_bytes()).await;
                let _ = s.shutdown().await;
            });
        }
    });
    addr
}

/// A fake peer answering 200 with a chunked body that never ends.
async fn endless_peer() -> (String, Arc<AtomicUsize>) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let sent = Arc::new(AtomicUsize::new(0));
    let total = sent.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            let total = total.clone();
            tokio::spawn(async move {
                read_request(&mut s).await;
                let head = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n";
                if s.write_all(head.as_bytes()).await.is_err() {
                    return;
                }
                let data = vec![b' '; 64 * 1024];
                loop {
                    let mut frame = format!("{:x}\r\n", data.len()).into_bytes();
                    frame.extend_from_slice(&data);
                    frame.extend_from_slice(b"\r\n");
                    if s.write_all(&frame).await.is_err() {
                        return;
                    }
                    total.fetch_add(data.len(), Ordering::SeqCst);
                }
            });
        }
    });
    (addr, sent)
}

fn response(status: &str, content_type: &str, body: &str) -> String {
    format!(
        "HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
}

#[tokio::test]
async fn without_an_allowlist_the_header_is_refused_and_nothing_is_connected() {
    let mem = Arc::new(MemoryTransport::new());
    let (target, accepts) = counter().await;
    let decode = start(Role::Decode, &mem, "").await;
    let (status, body) = refused(&decode, &target).await;
    assert_eq!(status, 403, "{body:?}");
    assert_eq!(body.error.code.as_deref(), Some("prefiller_not_allowed"));
    assert!(
        body.error.message.contains("x-prefiller-host-port")
            && body.error.message.contains("--prefill-allow"),
        "{}",
        body.error.message
    );
    // A solo worker orchestrates too, under the same rule.
    let solo = start(Role::Solo, &mem, "").await;
    assert_eq!(refused(&solo, &target).await.0, 403);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(accepts.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn addresses_and_ports_outside_the_allowlist_are_refused_without_a_connection() {
    let mem = Arc::new(MemoryTransport::new());
    let prefill = start(Role::Prefill, &mem, "").await;
    let (target, accepts) = counter().await;
    let port = prefill.addr.port();
    // The allowed IP, another port; a CIDR holding the IP, another port.
    for allow in [format!("127.0.0.1:{port}"), format!("127.0.0.0/8:{port}")] {
        let decode = start(Role::Decode, &mem, &allow).await;
        let (status, body) = refused(&decode, &target).await;
        assert_eq!(status, 403, "{allow}: {body:?}");
        assert_eq!(body.error.code.as_deref(), Some("prefiller_not_allowed"));
        assert!(
            body.error.message.contains(&target),
            "{}",
            body.error.message
        );
        // A name is never admitted by an IP or CIDR entry (no DNS lookup).
        let (status, _) = refused(&decode, &format!("localhost:{port}")).await;
        assert_eq!(status, 403, "{allow}");
        // Another address, the allowed port.
        let (status, _) = refused(&decode, &format!("127.0.0.2:{port}")).await;
        assert_eq!(
            status,
            if allow.contains('/') { 502 } else { 403 },
            "{allow}"
        );
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(accepts.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn injected_paths_queries_userinfo_and_schemes_are_malformed() {
    let mem = Arc::new(MemoryTransport::new());
    let (target, accepts) = counter().await;
    let port = target.rsplit_once(':').unwrap().1.to_string();
    let decode = start(
        Role::Decode,
        &mem,
        &format!("127.0.0.1:{port},localhost:{port}"),
    )
    .await;
    for bad in [
        format!("127.0.0.1:{port}/evil?x=1"),
        format!("127.0.0.1:{port}?x=1"),
        format!("127.0.0.1:{port}#frag"),
        format!("user@127.0.0.1:{port}"),
        format!("user:pw@localhost:{port}"),
        format!("http://127.0.0.1:{port}"),
        format!("http://127.0.0.1:{port}/v1/completions"),
        format!("127.0.0.1 :{port}"),
        format!("127.1:{port}"),
        format!("0x7f000001:{port}"),
        format!("[::1]:{port}/x"),
        "127.0.0.1".to_string(),
        format!("127.0.0.1:+{port}"),
    ] {
        let (status, body) = refused(&decode, &bad).await;
        assert_eq!(status, 400, "{bad}: {body:?}");
        assert_eq!(
            body.error.code.as_deref(),
            Some("invalid_prefiller_host_port"),
            "{bad}"
        );
        assert!(
            body.error.message.contains("x-prefiller-host-port")
                && body.error.message.contains("malformed"),
            "{bad}: {}",
            body.error.message
        );
    }
    // Bytes that are not visible ASCII: malformed, not ignored.
    let resp = reqwest::Client::new()
        .post(format!("{}/v1/completions", decode.url()))
        .header(
            "x-prefiller-host-port",
            reqwest::header::HeaderValue::from_bytes(
                &[format!("127.0.0.1:{port}").as_bytes(), &[0xff]].concat(),
            )
            .unwrap(),
        )
        .json(&request())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 400);
    let body: ErrorBody = resp.json().await.unwrap();
    assert_eq!(
        body.error.code.as_deref(),
        Some("invalid_prefiller_host_port")
    );
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(accepts.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn the_first_allowed_entry_of_a_list_is_used() {
    let mem = Arc::new(MemoryTransport::new());
    let prefill = start(Role::Prefill, &mem, "").await;
    let (other, accepts) = counter().await;
    let decode = start(Role::Decode, &mem, &prefill.addr.to_string()).await;
    let p = prefill.addr.to_string();
    for list in [
        format!("{other},{p}"),
        format!("{other}, {p}, 127.0.0.1:9"),
        format!("{other}/evil?x=1 , {p}"),
    ] {
        let (status, text) = post(&decode, &list).await;
        assert_eq!(status, 200, "{list}: {text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["choices"][0]["text"], "hel", "{list}");
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(accepts.load(Ordering::SeqCst), 0);
    assert_eq!(mem.held(), 0);
}

#[tokio::test]
async fn a_redirect_is_not_followed() {
    let mem = Arc::new(MemoryTransport::new());
    let (second, accepts) = counter().await;
    let redirecting = fake_peer(format!(
        "HTTP/1.1 302 Found\r\nlocation: http://{second}/v1/completions\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
    ))
    .await;
    // Even with the redirect's target in the allowlist.
    let decode = start(Role::Decode, &mem, &format!("{redirecting},{second}")).await;
    let (status, body) = refused(&decode, &redirecting).await;
    assert_eq!(status, 502, "{body:?}");
    let m = &body.error.message;
    assert!(
        m.contains("prefill") && m.contains(&redirecting) && m.contains("302"),
        "{m}"
    );
    assert!(!m.contains(&second), "{m}");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(accepts.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn a_peers_body_is_never_repeated() {
    let mem = Arc::new(MemoryTransport::new());
    let secret = "SECRET-UPSTREAM-BODY-7f3a";
    let plain = fake_peer(response("500 Internal Server Error", "text/plain", secret)).await;
    let json_500 = fake_peer(response(
        "500 Internal Server Error",
        "application/json",
        &json!({"error": {"message": secret, "type": "server_error", "code": "engine_overheated"}})
            .to_string(),
    ))
    .await;
    let json_400 = fake_peer(response(
        "400 Bad Request",
        "application/json",
        &json!({"error": {"message": secret, "type": "invalid_request_error", "code": "invalid_value"}})
            .to_string(),
    ))
    .await;
    let bad_code = fake_peer(response(
        "503 Service Unavailable",
        "application/json",
        &json!({"error": {"message": "x", "type": "server_error", "code": secret}}).to_string(),
    ))
    .await;
    let not_completion = fake_peer(response(
        "200 OK",
        "application/json",
        &json!({"id": 1, "choices": secret}).to_string(),
    ))
    .await;
    let allow = [&plain, &json_500, &json_400, &bad_code, &not_completion]
        .map(|s| s.as_str())
        .join(",");
    let decode = start(Role::Decode, &mem, &allow).await;

    let (status, text) = post(&decode, &plain).await;
    assert_eq!(status, 502, "{text}");
    assert!(!text.contains(secret), "{text}");
    assert!(text.contains("prefill peer answered 500"), "{text}");

    let (status, body) = refused(&decode, &json_500).await;
    assert_eq!(status, 502);
    assert!(!body.error.message.contains(secret), "{body:?}");
    assert!(
        body.error.message.contains("500") && body.error.message.contains("engine_overheated"),
        "{}",
        body.error.message
    );

    // A 4xx keeps its status and its code, not its message (but for a
    // refusal for length, after which this worker prefills itself).
    let (status, body) = refused(&decode, &json_400).await;
    assert_eq!(status, 400);
    assert_eq!(body.error.code.as_deref(), Some("invalid_value"));
    assert!(!body.error.message.contains(secret), "{body:?}");

    // A code that is not a plausible code is dropped.
    let (status, text) = post(&decode, &bad_code).await;
    assert_eq!(status, 502);
    assert!(!text.contains(secret), "{text}");

    // An answer that is not a completion: the parse error does not quote it.
    let (status, text) = post(&decode, &not_completion).await;
    assert_eq!(status, 502);
    assert!(!text.contains(secret), "{text}");
    assert!(text.contains("not a completion response"), "{text}");
}

#[tokio::test]
async fn an_oversized_answer_is_cut_at_the_cap() {
    let mem = Arc::new(MemoryTransport::new());
    let (endless, sent) = endless_peer().await;
    let declared = fake_peer(format!(
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{{",
        4 * MAX_PEER_ANSWER
    ))
    .await;
    let decode = start(Role::Decode, &mem, &format!("{endless},{declared}")).await;
    for peer in [&endless, &declared] {
        let t0 = Instant::now();
        let (status, body) = refused(&decode, peer).await;
        let took = t0.elapsed();
        assert_eq!(status, 502, "{peer}: {body:?}");
        assert!(
            body.error.message.contains("more than") && body.error.message.contains(peer.as_str()),
            "{}",
            body.error.message
        );
        // Well before the 20 s prefill timeout: the cap, not the clock, ended it.
        assert!(took < Duration::from_secs(10), "{peer}: {took:?}");
    }
    let read = sent.load(Ordering::SeqCst);
    assert!(read >= MAX_PEER_ANSWER / 2, "{read}");
    // The peer is not read much past the cap (socket buffers aside).
    tokio::time::sleep(Duration::from_millis(200)).await;
    let later = sent.load(Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        sent.load(Ordering::SeqCst),
        later,
        "still reading the endless answer"
    );
}

fn entry(s: &str) -> AllowEntry {
    s.parse().unwrap_or_else(|e| panic!("{s}: {e}"))
}

fn peer(s: &str) -> PeerAddr {
    PeerAddr::parse(s).unwrap_or_else(|e| panic!("{s}: {e}"))
}

#[test]
fn cidr_entries_admit_their_block_on_their_port() {
    let e = entry("10.0.0.0/8:8000");
    assert!(e.admits(&peer("10.255.1.2:8000")));
    assert!(e.admits(&peer("10.0.0.0:8000")));
    assert!(!e.admits(&peer("10.0.0.1:8001")));
    assert!(!e.admits(&peer("11.0.0.1:8000")));
    assert!(
        !e.admits(&peer("[::ffff:10.0.0.1]:8000")),
        "no family crossing"
    );
    // Host bits are cleared.
    assert_eq!(entry("10.1.2.3/8:1").to_string(), "10.0.0.0/8:1");
    assert_eq!(entry("192.168.7.9/24:1").to_string(), "192.168.7.0/24:1");
    // /0 is every IPv4 address, on that port only.
    let any = entry("0.0.0.0/0:80");
    assert!(any.admits(&peer("1.2.3.4:80")) && !any.admits(&peer("1.2.3.4:81")));
    assert!(!any.admits(&peer("[::1]:80")));
    // /32 is exact.
    let one = entry("10.0.0.7/32:80");
    assert!(one.admits(&peer("10.0.0.7:80")) && !one.admits(&peer("10.0.0.6:80")));
    assert_eq!(one, entry("10.0.0.7:80"));
}

#[test]
fn ipv6_entries_parse_in_brackets() {
    let e = entry("[fd00::]/8:80");
    assert!(e.admits(&peer("[fd12:3456::1]:80")));
    assert!(!e.admits(&peer("[fe00::1]:80")));
    assert!(!e.admits(&peer("[fd00::1]:81")));
    assert_eq!(e.to_string(), "[fd00::]/8:80");
    let exact = entry("[::1]:8000");
    assert!(exact.admits(&peer("[::1]:8000")));
    assert!(exact.admits(&peer("[0:0:0:0:0:0:0:1]:8000")));
    assert!(!exact.admits(&peer("127.0.0.1:8000")));
    assert_eq!(exact.to_string(), "[::1]:8000");
    assert_eq!(entry("[2001:db8::1]/32:1").to_string(), "[2001:db8::]/32:1");
    assert!(entry("[::]/0:9").admits(&peer("[2001:db8::5]:9")));
    assert!(PeerAddr::parse("::1:80").is_err());
    assert!(PeerAddr::parse("[fe80::1%eth0]:80").is_err());
}

#[test]
fn names_are_exact_and_case_insensitive() {
    let e = entry("Prefill-0.Pool.NS.svc:8000");
    assert!(e.admits(&peer("prefill-0.pool.ns.svc:8000")));
    assert!(e.admits(&peer("PREFILL-0.pool.ns.svc:8000")));
    assert!(!e.admits(&peer("prefill-0.pool.ns.svc:8001")));
    assert!(!e.admits(&peer("prefill-1.pool.ns.svc:8000")));
    assert!(!e.admits(&peer("evil.prefill-0.pool.ns.svc:8000")));
    assert!(!e.admits(&peer("10.0.0.1:8000")));
    assert!(!entry("127.0.0.1:80").admits(&peer("localhost:80")));
}

#[test]
fn bad_entries_are_startup_errors_naming_the_entry() {
    for bad in [
        "10.0.0.0/33:1",
        "[::]/129:1",
        "::1:80",
        "10.0.0.1",
        "10.0.0.1:0",
        "10.0.0.1:65536",
        "10.0.0.1:*",
        "10.0.0.0/8:*",
        "*",
        "*:80",
        "http://a:1",
        "a/b:1",
        "[::1:80",
        "[::1]x:80",
        "a b:1",
        "exa_mple:1",
        "-a:1",
        "a..b:1",
        "127.1:80",
        "user@host:1",
        "10.0.0.0/x:1",
        "",
    ] {
        let err = bad.parse::<AllowEntry>().unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains(&format!("`{bad}`")), "{bad}: {msg}");
        assert!(msg.contains("--prefill-allow"), "{msg}");
    }
    // A list: the error names the bad entry, not the list.
    let err = "10.0.0.1:80,10.0.0.0/40:80"
        .parse::<PrefillAllow>()
        .unwrap_err();
    assert_eq!(err.entry, "10.0.0.0/40:80");
    assert!("".parse::<PrefillAllow>().unwrap().is_empty());
}

#[test]
fn pick_takes_the_first_admitted_entry() {
    let allow: PrefillAllow = "10.0.0.0/24:8000,prefill.ns.svc:8000,[fd00::]/16:8000"
        .parse()
        .unwrap();
    assert_eq!(allow.entries().len(), 3);
    assert_eq!(
        allow.pick("10.0.1.1:8000, bad/x, 10.0.0.9:8000, 10.0.0.8:8000"),
        Ok(peer("10.0.0.9:8000"))
    );
    assert_eq!(
        allow.pick("prefill.ns.svc:8000"),
        Ok(peer("prefill.ns.svc:8000"))
    );
    assert_eq!(allow.pick("[fd00::2]:8000"), Ok(peer("[fd00::2]:8000")));
    assert!(matches!(
        allow.pick("10.0.1.1:8000,11.0.0.1:8000"),
        Err(PickError::NotAllowed { count: 2, .. })
    ));
    assert!(matches!(
        allow.pick("10.0.1.1:8000,10.0.0.1:8000/x"),
        Err(PickError::Malformed { .. })
    ));
    assert!(matches!(
        allow.pick(" , "),
        Err(PickError::Malformed { .. })
    ));
    // The error repeats a bounded part of the client's entry.
    let long = format!("{}/x", "a".repeat(5000));
    match allow.pick(&long) {
        Err(PickError::Malformed { entry, .. }) => {
            assert!(entry.len() <= rngd_worker::allow::ECHO_MAX)
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        PrefillAllow::default().pick("10.0.0.9:8000"),
        Err(PickError::NoneAllowed)
    );
    // The canonical form is what the client connects to.
    assert_eq!(peer("[0:0::1]:80").to_string(), "[::1]:80");
}
