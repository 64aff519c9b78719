//! A small server on the edge (an echo of the body's length behind
//! [`rngd_http_edge::LimitedBody`]) and raw-socket helpers for the limit tests.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::routing::{get, post};
use rngd_http_edge::{BodyLimits, HasBodyLimits, LimitedBody, Options, Served};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

/// The test server's state: its body limits.
#[derive(Debug, Clone, Copy)]
pub struct Limits(pub BodyLimits);

impl HasBodyLimits for Limits {
    fn body_limits(&self) -> BodyLimits {
        self.0
    }
}

async fn echo(State(_): State<Limits>, body: LimitedBody) -> String {
    body.0.len().to_string()
}

/// A server on 127.0.0.1:0: `POST /echo` answers the body's length, `GET /ok`
/// answers `ok`.
pub struct Server {
    /// The served listener.
    pub served: Served,
    stop: CancellationToken,
}

impl Server {
    /// Starts one with `options` and `limits`.
    pub async fn start(options: Options, limits: BodyLimits) -> Server {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let router = Router::new()
            .route("/echo", post(echo))
            .route("/ok", get(|| async { "ok" }))
            .with_state(Limits(limits));
        let stop = CancellationToken::new();
        let s = stop.clone();
        let served =
            rngd_http_edge::serve(
                listener,
                router,
                options,
                async move { s.cancelled().await },
            )
            .unwrap();
        Server { served, stop }
    }

    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.served.addr
    }

    /// Stops it and waits for every connection to close.
    pub async fn stop(self) {
        self.stop.cancel();
        self.served.done.await.unwrap();
    }
}

/// `GET /ok` on a new connection (`Connection: close`): the status line's code.
pub async fn get_ok(addr: SocketAddr) -> Option<u16> {
    let mut s = TcpStream::connect(addr).await.ok()?;
    s.write_all(b"GET /ok HTTP/1.1\r\nhost: t\r\nconnection: close\r\n\r\n")
        .await
        .ok()?;
    let text = read_to_end(&mut s, Duration::from_secs(5)).await?;
    status_of(&text)
}

/// Reads until EOF (or `within` passes: `None`); a reset after some bytes
/// keeps those bytes.
pub async fn read_to_end<S: tokio::io::AsyncRead + Unpin>(
    s: &mut S,
    within: Duration,
) -> Option<String> {
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match tokio::time::timeout_at(deadline, s.read(&mut buf)).await {
            Err(_) => return None,
            Ok(Ok(0)) => break,
            Ok(Ok(n)) => out.extend_from_slice(&buf[..n]),
            Ok(Err(_)) => break,
        }
    }
    Some(String::from_utf8_lossy(&out).into_owned())
}

/// The status code of an HTTP/1.1 answer.
pub fn status_of(text: &str) -> Option<u16> {
    text.strip_prefix("HTTP/1.1 ")?.get(..3)?.parse().ok()
}

/// The JSON body of an HTTP/1.1 answer with `Content-Length`.
pub fn json_of(text: &str) -> serde_json::Value {
    let body = text.split("\r\n\r\n").nth(1).unwrap_or_default();
    serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
}

/// This process's resident set, bytes (`VmRSS` of /proc/self/status).
pub fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kb * 1024
}
