//! Fault-suite rows of the listener limits, against a real server on the
//! edge bound on 127.0.0.1:0 (each row: what the client saw, what was left,
//! whether a normal request still works): silent sockets closed at the
//! header timeout, the connection cap, the idle keep-alive timeout, stalled
//! bodies refused by the in-flight body budget before they are buffered
//! (with the RSS growth bounded), a 413 that reaches a client still
//! sending as JSON, and a 415 for a body that is not JSON by its type.

mod common;

use std::time::{Duration, Instant};

use common::{Server, get_ok, json_of, read_to_end, rss_bytes, status_of};
use rngd_http_edge::{BodyLimits, Options};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const MIB: usize = 1 << 20;

/// The tests of this file run one at a time: two of them measure the
/// process's resident memory, which the others' buffers would inflate, and
/// the timing rows are read on a quieter machine.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn limits() -> BodyLimits {
    BodyLimits {
        max_bytes: MIB,
        deadline: Duration::from_secs(30),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_sockets_are_closed_at_the_header_timeout() {
    let _one = ONE_AT_A_TIME.lock().await;
    let header_timeout = Duration::from_millis(500);
    let server = Server::start(
        Options {
            header_timeout,
            max_connections: 1000,
            ..Options::default()
        },
        limits(),
    )
    .await;
    let before = rss_bytes();
    let started = Instant::now();
    let mut silent = Vec::new();
    for _ in 0..600 {
        silent.push(TcpStream::connect(server.addr()).await.unwrap());
    }
    // Once all are being served: what a connection costs (both ends are in
    // this process, so this over-counts the server's share). Measured here:
    // 11 KB per connection.
    let accepted = tokio::time::timeout(Duration::from_secs(5), async {
        while server.served.stats.accepted() < 600 {
            tokio::task::yield_now().await;
        }
    })
    .await;
    assert!(
        accepted.is_ok(),
        "{} accepted",
        server.served.stats.accepted()
    );
    let per_connection = rss_bytes().saturating_sub(before) / 600;
    eprintln!("resident memory per idle connection: {per_connection} bytes");
    assert!(per_connection < 64 * 1024, "{per_connection} bytes");
    // A normal request is served while 600 sockets say nothing.
    assert_eq!(get_ok(server.addr()).await, Some(200));
    // Every silent socket is closed by the server (EOF, no answer) within
    // the header timeout and a margin.
    let margin = Duration::from_secs(3);
    for s in &mut silent {
        let left = (header_timeout + margin).saturating_sub(started.elapsed());
        let text = read_to_end(s, left).await;
        assert_eq!(
            text.as_deref(),
            Some(""),
            "a silent socket was not closed within {:?}",
            header_timeout + margin
        );
    }
    assert!(started.elapsed() >= header_timeout);
    assert_eq!(server.served.stats.refused(), 0);
    // And the server still serves.
    assert_eq!(get_ok(server.addr()).await, Some(200));
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_over_the_cap_are_closed_at_once() {
    let _one = ONE_AT_A_TIME.lock().await;
    let server = Server::start(
        Options {
            max_connections: 5,
            ..Options::default()
        },
        limits(),
    )
    .await;
    // Four silent connections and one that serves keep-alive requests: the
    // cap is full (connections are accepted in order).
    let mut held = Vec::new();
    for _ in 0..4 {
        held.push(TcpStream::connect(server.addr()).await.unwrap());
    }
    let mut live = TcpStream::connect(server.addr()).await.unwrap();
    live.write_all(b"GET /ok HTTP/1.1\r\nhost: t\r\n\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 512];
    let n = live.read(&mut buf).await.unwrap();
    assert_eq!(status_of(&String::from_utf8_lossy(&buf[..n])), Some(200));
    // One more is accepted and closed at once: no answer, whatever it sends.
    let mut over = TcpStream::connect(server.addr()).await.unwrap();
    let _ = over.write_all(b"GET /ok HTTP/1.1\r\nhost: t\r\n\r\n").await;
    let text = read_to_end(&mut over, Duration::from_secs(2)).await;
    assert_eq!(text.as_deref(), Some(""), "over the cap: {text:?}");
    assert_eq!(server.served.stats.refused(), 1);
    // Under the cap, on the connection that holds a place, requests work.
    live.write_all(b"GET /ok HTTP/1.1\r\nhost: t\r\n\r\n")
        .await
        .unwrap();
    let n = live.read(&mut buf).await.unwrap();
    assert_eq!(status_of(&String::from_utf8_lossy(&buf[..n])), Some(200));
    drop(held);
    drop(live);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_kept_alive_connection_is_closed_at_the_idle_timeout() {
    let _one = ONE_AT_A_TIME.lock().await;
    let idle = Duration::from_millis(300);
    let server = Server::start(
        Options {
            idle_timeout: idle,
            ..Options::default()
        },
        limits(),
    )
    .await;
    let mut s = TcpStream::connect(server.addr()).await.unwrap();
    s.write_all(b"GET /ok HTTP/1.1\r\nhost: t\r\n\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 512];
    let n = s.read(&mut buf).await.unwrap();
    assert_eq!(status_of(&String::from_utf8_lossy(&buf[..n])), Some(200));
    let answered = Instant::now();
    // Kept alive, then closed once idle (EOF), neither early nor late.
    let text = read_to_end(&mut s, idle + Duration::from_secs(3)).await;
    assert_eq!(text.as_deref(), Some(""));
    let after = answered.elapsed();
    // The server's idle clock starts when it has sent the answer, a little
    // before this client has read it: a margin for that, not for the timer.
    let read_lag = Duration::from_millis(50);
    assert!(
        after + read_lag >= idle,
        "closed after {after:?}, before {idle:?}"
    );
    server.stop().await;
}

/// Sends headers declaring `len` bytes, then `sent` bytes of the body, then
/// stalls; returns the answer it reads within `within` (`None`: none yet).
async fn stalled_client(
    addr: std::net::SocketAddr,
    len: usize,
    sent: usize,
    within: Duration,
) -> (TcpStream, Option<String>) {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let head = format!("POST /echo HTTP/1.1\r\nhost: t\r\ncontent-length: {len}\r\n\r\n");
    s.write_all(head.as_bytes()).await.unwrap();
    static FILL: [u8; 64 * 1024] = [b'x'; 64 * 1024];
    let mut left = sent;
    while left > 0 {
        let n = left.min(FILL.len());
        if s.write_all(&FILL[..n]).await.is_err() {
            break;
        }
        left -= n;
    }
    let text = read_to_end(&mut s, within).await;
    (s, text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_bodies_past_the_budget_are_refused_before_buffering() {
    let _one = ONE_AT_A_TIME.lock().await;
    // 16 bodies of 1 MiB fit, with room for small ones beside them.
    let budget = 16 * MIB + 64 * 1024;
    let deadline = Duration::from_secs(4);
    let server = Server::start(
        Options {
            max_inflight_body_bytes: budget,
            ..Options::default()
        },
        BodyLimits {
            max_bytes: MIB,
            deadline,
        },
    )
    .await;
    let before = rss_bytes();
    // 200 clients declare 1 MiB, send all but its last byte and stall.
    let clients: Vec<_> = (0..200)
        .map(|_| {
            tokio::spawn(stalled_client(
                server.addr(),
                MIB,
                MIB - 1,
                Duration::from_millis(1500),
            ))
        })
        .collect();
    let mut refused = 0;
    let mut stalled = Vec::new();
    for c in clients {
        let (s, text) = c.await.unwrap();
        match text {
            Some(t) => {
                // Refused before buffering: a JSON 503 with Retry-After.
                assert_eq!(status_of(&t), Some(503), "{t}");
                assert!(t.to_ascii_lowercase().contains("retry-after: 1"), "{t}");
                assert_eq!(json_of(&t)["error"]["code"], "server_overloaded");
                refused += 1;
            }
            None => stalled.push(s),
        }
    }
    // Exactly what fits is being read; the rest were refused.
    assert_eq!(stalled.len(), 16, "{refused} refused");
    assert_eq!(refused, 184);
    assert_eq!(server.served.budget.in_use(), 16 * MIB);
    // Measured here: 30 MiB over the baseline (16 MiB of bodies buffered);
    // the same 200 bodies with a budget that holds them all: 297 MiB.
    let grown = rss_bytes().saturating_sub(before);
    eprintln!("RSS growth with 200 stalled bodies: {} KiB", grown / 1024);
    assert!(
        grown < 64 * MIB as u64,
        "RSS grew by {} MiB",
        grown / MIB as u64
    );
    // A small request still fits beside them.
    let mut s = TcpStream::connect(server.addr()).await.unwrap();
    s.write_all(
        b"POST /echo HTTP/1.1\r\nhost: t\r\ncontent-length: 5\r\nconnection: close\r\n\r\nhello",
    )
    .await
    .unwrap();
    let text = read_to_end(&mut s, Duration::from_secs(5)).await.unwrap();
    assert_eq!(status_of(&text), Some(200), "{text}");
    assert!(text.ends_with("\r\n\r\n5"), "{text}");
    // The stalled ones get their 408 at the deadline, and the budget is free.
    for mut s in stalled {
        let text = read_to_end(&mut s, deadline + Duration::from_secs(5))
            .await
            .unwrap();
        assert_eq!(status_of(&text), Some(408), "{text}");
        assert_eq!(json_of(&text)["error"]["code"], "request_timeout");
    }
    assert_eq!(server.served.budget.in_use(), 0);
    server.stop().await;
}

/// Sends `head` and then `body_len` bytes of body (in `chunked` encoding if
/// asked) while reading the answer; returns what it read and whether every
/// write went through.
async fn keep_sending(
    addr: std::net::SocketAddr,
    head: &str,
    body_len: usize,
    chunked: bool,
) -> (String, bool) {
    let s = TcpStream::connect(addr).await.unwrap();
    let (mut rd, mut wr) = s.into_split();
    let head = head.to_string();
    let writer = tokio::spawn(async move {
        wr.write_all(head.as_bytes()).await?;
        let chunk = vec![b'x'; 64 * 1024];
        let mut left = body_len;
        while left > 0 {
            let n = left.min(chunk.len());
            if chunked {
                wr.write_all(format!("{n:x}\r\n").as_bytes()).await?;
                wr.write_all(&chunk[..n]).await?;
                wr.write_all(b"\r\n").await?;
            } else {
                wr.write_all(&chunk[..n]).await?;
            }
            left -= n;
        }
        if chunked {
            wr.write_all(b"0\r\n\r\n").await?;
        }
        Ok::<_, std::io::Error>(())
    });
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match tokio::time::timeout(Duration::from_secs(10), rd.read(&mut buf)).await {
            Ok(Ok(0)) => break,
            Ok(Ok(n)) => out.extend_from_slice(&buf[..n]),
            Ok(Err(e)) => panic!("reading the answer failed: {e} after {out:?}"),
            Err(_) => panic!("no answer"),
        }
    }
    let wrote = writer.await.unwrap().is_ok();
    (String::from_utf8_lossy(&out).into_owned(), wrote)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_413_reaches_a_client_still_sending_as_json() {
    let _one = ONE_AT_A_TIME.lock().await;
    let server = Server::start(Options::default(), limits()).await;
    // Declared too large: answered at once, the 8 MiB still arriving drained.
    let head = format!(
        "POST /echo HTTP/1.1\r\nhost: t\r\ncontent-length: {}\r\n\r\n",
        8 * MIB
    );
    let (text, wrote) = keep_sending(server.addr(), &head, 8 * MIB, false).await;
    assert_eq!(status_of(&text), Some(413), "{text}");
    assert!(text.to_ascii_lowercase().contains("connection: close"));
    let body = json_of(&text);
    assert_eq!(body["error"]["code"], "request_too_large");
    assert_eq!(body["error"]["type"], "invalid_request_error");
    assert!(wrote, "the client's writes were cut off");
    // Chunked, no length: found too large while reading, same answer.
    let head = "POST /echo HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n";
    let (text, wrote) = keep_sending(server.addr(), head, 4 * MIB, true).await;
    assert_eq!(status_of(&text), Some(413), "{text}");
    assert_eq!(json_of(&text)["error"]["code"], "request_too_large");
    assert!(wrote, "the client's writes were cut off");
    // A normal request still works.
    assert_eq!(get_ok(server.addr()).await, Some(200));
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_linger_bound_the_connection_is_closed() {
    let _one = ONE_AT_A_TIME.lock().await;
    // The polite close is bounded: a client that sends far more than
    // linger_bytes is cut off rather than read forever.
    let server = Server::start(
        Options {
            linger_bytes: 256 * 1024,
            ..Options::default()
        },
        limits(),
    )
    .await;
    let head = format!(
        "POST /echo HTTP/1.1\r\nhost: t\r\ncontent-length: {}\r\n\r\n",
        64 * MIB
    );
    let s = TcpStream::connect(server.addr()).await.unwrap();
    let (_rd, mut wr) = s.into_split();
    wr.write_all(head.as_bytes()).await.unwrap();
    let chunk = vec![b'x'; 64 * 1024];
    let mut sent = 0usize;
    let cut = loop {
        match tokio::time::timeout(Duration::from_secs(10), wr.write_all(&chunk)).await {
            Ok(Ok(())) => sent += chunk.len(),
            Ok(Err(_)) => break true,
            Err(_) => break false,
        }
        if sent >= 64 * MIB {
            break false;
        }
    };
    assert!(cut, "the server read {sent} bytes of a refused body");
    assert!(sent < 32 * MIB, "{sent}");
    assert_eq!(get_ok(server.addr()).await, Some(200));
    server.stop().await;
}

/// A body that is not JSON by its `Content-Type` is a 415 before a byte of
/// it is read; JSON (with parameters, or a `+json` type) and a body sent
/// with no type at all are read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_is_not_json_by_its_type_is_a_415() {
    let _one = ONE_AT_A_TIME.lock().await;
    let server = Server::start(Options::default(), limits()).await;
    let addr = server.addr();
    let post = |ct: Option<&'static str>| async move {
        let mut s = TcpStream::connect(addr).await.unwrap();
        let ct = ct
            .map(|c| format!("content-type: {c}\r\n"))
            .unwrap_or_default();
        let req = format!(
            "POST /echo HTTP/1.1\r\nhost: t\r\nconnection: close\r\n{ct}content-length: 2\r\n\r\n{{}}"
        );
        s.write_all(req.as_bytes()).await.unwrap();
        read_to_end(&mut s, Duration::from_secs(10)).await.unwrap()
    };
    for ct in [
        "text/plain",
        "application/x-www-form-urlencoded",
        "text/json",
    ] {
        let text = post(Some(ct)).await;
        assert_eq!(status_of(&text), Some(415), "{ct}: {text}");
        let body = json_of(&text);
        assert_eq!(body["error"]["code"], "unsupported_media_type", "{ct}");
        assert!(
            body["error"]["message"].as_str().unwrap().contains(ct),
            "{text}"
        );
    }
    for ct in [
        Some("application/json"),
        Some("Application/JSON; charset=utf-8"),
        Some("application/merge-patch+json"),
        None,
    ] {
        let text = post(ct).await;
        assert_eq!(status_of(&text), Some(200), "{ct:?}: {text}");
        assert!(text.ends_with("\r\n\r\n2"), "{ct:?}: {text}");
    }
    server.stop().await;
}
