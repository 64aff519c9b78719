//! The relay server: accepts connections, brings TLS up on each when
//! configured ([`super::tls`]), authenticates each with the
//! handshake of [`crate::frame`] (both in the pre-auth pool of
//! [`super::preauth`], under the handshake deadline; it counts against the
//! connection cap only once it passed), and speaks the protocol over it. Per connection, a reader task handles frames in order
//! and a writer task sends replies; GETs wait in their own tasks (under the
//! waiting-GET cap), so one connection carries many requests at once.
//! Replies carry the request's `seq`. Every frame must arrive within the
//! read deadline of its first byte, and every reply be taken within it; a
//! connection idle (no frame, no GET waiting) for the idle timeout is
//! closed. A malformed or oversize frame closes that connection only, with
//! the rest of its stream discarded unread.
//!
//! This file holds the accept loop, the connection (handshake and its
//! refusals, writer task, lingering close); `server/requests.rs` holds the request loop (PUT, GET,
//! DEL, STATS).

use std::future::Future;
use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::FutureExt;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::time::timeout;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::RelayConfig;
use super::preauth::{Admitted, Failure, Full, PREAUTH_CLOSED, Slot};
use super::store::{Gauge, Reject, Relay};
use super::tls::{BoxRead, BoxWrite, ServerTls, split_plain};
use crate::KvError;
use crate::frame::{
    self, ErrCode, HELLO_AUTH, Header, IO_BUF, MAC_LEN, NONCE_LEN, Op, read_request_head,
};

mod requests;

/// A connection's buffered read half (plain or TLS).
type Rd = BufReader<BoxRead>;

use requests::read_requests;

/// Serves the relay protocol on `listener` until `shutdown` completes; then
/// closes every connection and returns once they are all gone.
pub async fn serve(
    listener: TcpListener,
    cfg: RelayConfig,
    shutdown: impl Future<Output = ()>,
) -> Result<(), KvError> {
    serve_relay(listener, Arc::new(Relay::new(cfg)), shutdown).await
}

/// [`serve`] for a relay state the caller keeps (to read its figures).
pub(crate) async fn serve_relay(
    listener: TcpListener,
    relay: Arc<Relay>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), KvError> {
    if relay.cfg.secret.is_none() {
        tracing::warn!(
            "KV relay: connections are NOT authenticated (no shared secret; --insecure-no-auth)"
        );
    }
    if relay.cfg.tls.is_none() {
        tracing::info!("KV relay: connections are not encrypted (no TLS)");
    }
    let stop = CancellationToken::new();
    let tracker = TaskTracker::new();
    {
        let relay = relay.clone();
        let stop = stop.clone();
        let period = (relay.cfg.ttl / 4).clamp(Duration::from_millis(10), Duration::from_secs(5));
        tracker.spawn(async move {
            loop {
                tokio::select! {
                    _ = tokio::time::sleep(period) => relay.expire(),
                    _ = stop.cancelled() => return,
                }
            }
        });
    }
    {
        // The summary of the warnings held back at the end of a burst.
        let relay = relay.clone();
        let stop = stop.clone();
        let period = relay.cfg.warn_interval;
        tracker.spawn(async move {
            loop {
                tokio::select! {
                    _ = tokio::time::sleep(period) => relay.warnings.flush(),
                    _ = stop.cancelled() => return,
                }
            }
        });
    }
    tokio::pin!(shutdown);
    let result = loop {
        tokio::select! {
            _ = &mut shutdown => break Ok(()),
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => accept(&relay, &tracker, &stop, stream, peer),
                Err(e) => {
                    // Out of descriptors and the like: keep serving the others.
                    relay.warnings.warn("accept failed", None, &e.to_string());
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            },
        }
    };
    drop(listener);
    stop.cancel();
    tracker.close();
    tracker.wait().await;
    tracing::info!(epoch = relay.epoch, "KV relay stopped");
    result
}

/// Takes a new socket: refused at once while the authenticated connections
/// are at their cap; else into the pre-auth pool (evicting its oldest
/// silent socket when full, or refused when none is silent) and on a task
/// of its own.
fn accept(
    relay: &Arc<Relay>,
    tracker: &TaskTracker,
    stop: &CancellationToken,
    stream: TcpStream,
    peer: SocketAddr,
) {
    if relay.connections_full() {
        relay.reject(Reject::Connections);
        refuse_connection(relay, stream);
        tracing::debug!(%peer, "relay: connection cap reached, closed a new connection");
        return;
    }
    let _ = stream.set_nodelay(true);
    // A second handle on the socket, for the pool to look for bytes not
    // read yet (without it the socket counts as silent until it is read).
    let probe = stream
        .as_fd()
        .try_clone_to_owned()
        .ok()
        .map(std::net::TcpStream::from);
    let admitted = match relay.preauth.admit(peer, probe) {
        Ok(admitted) => admitted,
        Err(Full) => {
            relay.reject(Reject::Preauth);
            relay.warnings.warn(
                Failure::Evicted.warning(),
                Some(peer),
                &format!(
                    "{} sockets are in the handshake (the pre-auth cap), all of them \
                     answering; refused the new one",
                    relay.preauth.cap()
                ),
            );
            // A TLS client could not read a plaintext ERR: it sees the close.
            if relay.cfg.tls.is_none() {
                let r = preauth_full_reply(relay);
                let mut bytes = r.header.encode().to_vec();
                bytes.extend_from_slice(&r.body);
                let _ = stream.try_write(&bytes);
            }
            return;
        }
    };
    if let Some(old) = admitted.evicted {
        relay.reject(Reject::Preauth);
        relay.warnings.warn(
            Failure::Evicted.warning(),
            Some(old),
            &format!(
                "{} sockets are in the handshake (the pre-auth cap); closed the oldest silent one",
                relay.preauth.cap()
            ),
        );
    }
    let relay = relay.clone();
    let cancel = stop.child_token();
    let span = tracing::debug_span!("relay.connection", %peer);
    tracker.spawn(tracing::Instrument::instrument(
        async move {
            tracing::debug!(%peer, "relay: connection opened");
            connection(relay, stream, peer, admitted, cancel).await;
            tracing::debug!(%peer, "relay: connection closed");
        },
        span,
    ));
}

/// Closes a connection over the cap at once, with an ERR the client can
/// name (written only if the socket takes it without waiting, and only
/// without TLS: a TLS client sees the close).
fn refuse_connection(relay: &Relay, stream: TcpStream) {
    if relay.cfg.tls.is_some() {
        return;
    }
    let r = capacity_reply(relay, 0);
    let mut bytes = r.header.encode().to_vec();
    bytes.extend_from_slice(&r.body);
    let _ = stream.try_write(&bytes);
}

/// The ERR of a connection over the (authenticated) connection cap.
fn capacity_reply(relay: &Relay, seq: u32) -> Reply {
    err_reply(
        seq,
        relay.epoch,
        ErrCode::Capacity,
        format!(
            "the relay's connection cap of {} is reached",
            relay.cfg.max_connections
        ),
        true,
    )
}

/// A reply queued for the writer task.
struct Reply {
    header: Header,
    body: Bytes,
    /// Close the connection after sending this one.
    close: bool,
}

fn err_reply(seq: u32, epoch: u64, code: ErrCode, msg: String, close: bool) -> Reply {
    let body = Bytes::from(msg.into_bytes());
    let mut header = Header::new(Op::Err, seq);
    header.arg = code as u32;
    header.body_len = body.len() as u64;
    header.epoch = epoch;
    Reply {
        header,
        body,
        close,
    }
}

fn ok_reply(seq: u32, epoch: u64, index: u32, body: Bytes) -> Reply {
    let mut header = Header::new(Op::Ok, seq);
    header.index = index;
    header.body_len = body.len() as u64;
    header.epoch = epoch;
    Reply {
        header,
        body,
        close: false,
    }
}

/// Why [`handshake`] did not pass.
enum Refusal {
    /// The peer closed (or reset) without answering: a TCP probe, a scan.
    /// Neither a warning nor a rejection.
    Silent,
    /// A wrong or malformed answer (the reason is logged, never sent).
    Refused(String),
}

/// The fixed answer to a failed handshake (it tells nothing of why).
const AUTH_FAILED: &str = "authentication failed";

/// How a connection's request loop ended.
enum End {
    /// The client closed it (or the relay stops).
    Done,
    /// A fatal error, already answered: close (after discarding pending input
    /// for a bounded time when `linger`).
    Fatal { reason: String, linger: bool },
}

/// A socket from its accept to its close: the handshake (in the pre-auth
/// pool, under the handshake deadline), then, once it passed and got an
/// authenticated slot, the requests.
async fn connection(
    relay: Arc<Relay>,
    stream: TcpStream,
    peer: SocketAddr,
    admitted: Admitted,
    stop: CancellationToken,
) {
    let slot = Slot::adopt(&relay.preauth, admitted.id);
    let evict = admitted.evict;
    let deadline = relay.cfg.handshake_timeout;
    let started = tokio::time::Instant::now();
    let (rd, mut wr) = match &relay.cfg.tls {
        None => split_plain(stream),
        // TLS first, under the same deadline and in the same pool; a socket
        // closed before TLS is up gets no ERR (its client could not read one).
        Some(tls) => {
            let up = tokio::select! {
                r = timeout(deadline, tls_accept(tls, &slot, stream)) => r,
                _ = evict.cancelled() => return,
                _ = stop.cancelled() => return,
            };
            match up.map_err(Err).and_then(|r| r.map_err(Ok)) {
                Ok(halves) => halves,
                Err(why) => {
                    not_passed(&relay, &slot, peer, "TLS handshake", deadline, why);
                    return;
                }
            }
        }
    };
    let mut rd = BufReader::with_capacity(IO_BUF, rd);
    let left = deadline.saturating_sub(started.elapsed());
    let passed = tokio::select! {
        r = timeout(left, handshake(&relay, &slot, &mut rd, &mut wr)) => r,
        _ = evict.cancelled() => {
            refuse_evicted(&relay, &mut wr);
            return;
        }
        _ = stop.cancelled() => return,
    };
    let ok = match passed.map_err(Err).and_then(|r| r.map_err(Ok)) {
        Ok(ok) => ok,
        Err(why) => {
            if not_passed(&relay, &slot, peer, "handshake answer", deadline, why) {
                tokio::select! {
                    _ = refuse_unauthenticated(&relay, &mut rd, &mut wr) => {}
                    _ = evict.cancelled() => {}
                    _ = stop.cancelled() => {}
                }
            }
            return;
        }
    };
    // Passed: from now on it counts against the connection cap, not the
    // pre-auth one (unless it was evicted in the last instant).
    if !slot.promote() {
        refuse_evicted(&relay, &mut wr);
        return;
    }
    if !relay.admit_connection() {
        relay.reject(Reject::Connections);
        let r = capacity_reply(&relay, ok.header.seq);
        let _ = timeout(relay.cfg.read_timeout, async {
            wr.write_all(&r.header.encode()).await?;
            wr.write_all(&r.body).await?;
            wr.shutdown().await
        })
        .await;
        return;
    }
    let _authenticated = Gauge::adopt(&relay.connections);
    let sent = timeout(relay.cfg.read_timeout, async {
        wr.write_all(&ok.header.encode()).await?;
        wr.write_all(&ok.body).await?;
        wr.flush().await
    })
    .await;
    if !matches!(sent, Ok(Ok(()))) {
        return;
    }
    serve_requests(&relay, rd, wr, peer, &stop).await;
}

/// A handshake phase (`what`: the TLS handshake or the frame handshake's
/// answer) that did not pass within `deadline`: a silent socket is only
/// logged; a refusal or a timeout is counted and warned of, and `true`
/// says so (the frame handshake then answers it).
fn not_passed(
    relay: &Relay,
    slot: &Slot<'_>,
    peer: SocketAddr,
    what: &str,
    deadline: Duration,
    why: Result<Refusal, tokio::time::error::Elapsed>,
) -> bool {
    match why {
        Ok(Refusal::Silent) => {
            tracing::debug!(%peer, "relay: closed before the {what}");
            false
        }
        Ok(Refusal::Refused(reason)) => {
            handshake_failed(relay, slot, Failure::Refused, peer, &reason);
            true
        }
        Err(_) => {
            let reason = format!("no {what} within {deadline:?}");
            handshake_failed(relay, slot, Failure::Timeout, peer, &reason);
            true
        }
    }
}

/// Counts a failed handshake (STATS `handshake_failures` and `rejections`)
/// and warns of it under the rate limit.
fn handshake_failed(relay: &Relay, slot: &Slot<'_>, why: Failure, peer: SocketAddr, reason: &str) {
    slot.failed();
    relay.preauth.fail(why);
    relay.reject(Reject::Auth);
    relay.warnings.warn(why.warning(), Some(peer), reason);
}

/// The ERR of a socket closed over the pre-auth cap (evicted, or refused
/// as the new one).
fn preauth_full_reply(relay: &Relay) -> Reply {
    err_reply(
        0,
        relay.epoch,
        ErrCode::Capacity,
        format!(
            "{PREAUTH_CLOSED}: the relay's cap of {} connections in the handshake is reached",
            relay.preauth.cap()
        ),
        true,
    )
}

/// Tells a socket evicted from the pre-auth pool why (only if the socket
/// takes it without waiting); it is closed when dropped.
fn refuse_evicted(relay: &Relay, wr: &mut BoxWrite) {
    let r = preauth_full_reply(relay);
    let mut bytes = r.header.encode().to_vec();
    bytes.extend_from_slice(&r.body);
    let _ = async {
        wr.write_all(&bytes).await?;
        wr.flush().await
    }
    .now_or_never();
}

/// The TLS handshake of a new socket. Its first byte (the ClientHello),
/// seen without taking it, marks it as having spoken; a socket closed
/// before that is silent.
async fn tls_accept(
    tls: &ServerTls,
    slot: &Slot<'_>,
    stream: TcpStream,
) -> Result<(BoxRead, BoxWrite), Refusal> {
    match stream.peek(&mut [0u8; 1]).await {
        Ok(n) if n > 0 => slot.spoke(),
        _ => return Err(Refusal::Silent),
    }
    tls.accept(stream)
        .await
        .map_err(|e| Refusal::Refused(format!("TLS handshake: {e}")))
}

/// Answers a failed handshake with the fixed refusal and closes, after a
/// short lingering close (see [`serve_requests`]), smaller than for an
/// authenticated peer: the refusal must not be lost to a reset.
async fn refuse_unauthenticated(relay: &Relay, rd: &mut Rd, wr: &mut BoxWrite) {
    let r = err_reply(
        0,
        relay.epoch,
        ErrCode::Unauthorized,
        AUTH_FAILED.into(),
        true,
    );
    let _ = timeout(Duration::from_secs(1), async {
        wr.write_all(&r.header.encode()).await?;
        wr.write_all(&r.body).await?;
        wr.shutdown().await
    })
    .await;
    let mut input = rd.take(64 << 10);
    let _ = timeout(
        Duration::from_millis(500),
        tokio::io::copy(&mut input, &mut tokio::io::sink()),
    )
    .await;
}

/// An authenticated connection's requests, until it ends; then the queued
/// replies are sent and the connection closed (lingering after a fatal
/// error).
async fn serve_requests(
    relay: &Arc<Relay>,
    mut rd: Rd,
    wr: BoxWrite,
    peer: SocketAddr,
    stop: &CancellationToken,
) {
    let (tx, rx) = mpsc::channel::<Reply>(1024);
    let writer = tokio::spawn(write_replies(relay.clone(), wr, rx));
    // Waiting GETs of this connection end with it (or with the relay).
    let gets = stop.child_token();
    let end = tokio::select! {
        r = read_requests(relay, &mut rd, &tx, &gets) => r,
        _ = stop.cancelled() => {
            let _ = tx.try_send(err_reply(0, relay.epoch, ErrCode::ShuttingDown, "relay shutting down".into(), true));
            End::Done
        }
    };
    let linger = match end {
        End::Done => false,
        End::Fatal { reason, linger } => {
            tracing::warn!(%peer, %reason, "relay: closing connection");
            linger
        }
    };
    // Stop the waiting GETs (they drop their senders), then let the writer
    // send what is queued: it ends when every sender is gone or after a
    // `close` reply. A client that does not read gets a short grace.
    gets.cancel();
    drop(tx);
    let abort = writer.abort_handle();
    if timeout(Duration::from_secs(2), writer).await.is_err() {
        abort.abort();
    }
    if linger {
        // Lingering close: the client may still be sending the frame that was
        // refused. Closing with its bytes unread would make the kernel reset
        // the connection, and the client could lose the error reply it has
        // not read yet. The reply and our FIN are out; discard input for a
        // bounded time and size (never parsing it), then close.
        let mut input = (&mut rd).take(LINGER_MAX_BYTES);
        let mut sink = tokio::io::sink();
        let _ = timeout(LINGER, tokio::io::copy(&mut input, &mut sink)).await;
    }
}

/// The relay's side of the handshake: HELLO out, AUTH in (checked). On
/// success, the OK reply to send (with the relay's proof of the secret)
/// once the connection has an authenticated slot.
async fn handshake(
    relay: &Relay,
    slot: &Slot<'_>,
    rd: &mut Rd,
    wr: &mut BoxWrite,
) -> Result<Reply, Refusal> {
    let relay_nonce = frame::nonce();
    let mut hello = Header::new(Op::Hello, 0);
    hello.arg = if relay.cfg.secret.is_some() {
        HELLO_AUTH
    } else {
        0
    };
    hello.body_len = NONCE_LEN as u64;
    hello.epoch = relay.epoch;
    // A peer gone before it said anything (the HELLO cannot be written,
    // the socket is reset or closed) is silent, not a failed answer.
    let silent = |_| Refusal::Silent;
    wr.write_all(&hello.encode()).await.map_err(silent)?;
    wr.write_all(&relay_nonce).await.map_err(silent)?;
    wr.flush().await.map_err(silent)?;
    // The first bytes, buffered without taking them: from now on the
    // socket is not silent (the pool looks at the socket itself until
    // then, so no moment passes where its bytes count for nothing).
    match rd.fill_buf().await {
        Ok(buf) if !buf.is_empty() => slot.spoke(),
        _ => return Err(Refusal::Silent),
    }
    // Nothing but an AUTH of its fixed size is read before the handshake.
    let (h, _) = match read_request_head(rd, 0).await {
        Ok(Some(head)) => head,
        Ok(None) | Err(frame::FrameError::Io(_)) => return Err(Refusal::Silent),
        Err(e) => return Err(Refusal::Refused(format!("not a handshake answer: {e}"))),
    };
    if h.op != Op::Auth {
        return Err(Refusal::Refused(format!("{:?} before the handshake", h.op)));
    }
    let mut body = [0u8; NONCE_LEN + MAC_LEN];
    rd.read_exact(&mut body)
        .await
        .map_err(|e| Refusal::Refused(format!("handshake I/O: {e}")))?;
    let (client_nonce, client_mac) = body.split_at(NONCE_LEN);
    let proof = match &relay.cfg.secret {
        Some(secret) => {
            if !secret.verify_client(&relay_nonce, client_nonce, client_mac) {
                return Err(Refusal::Refused("wrong secret".into()));
            }
            Bytes::copy_from_slice(&secret.server_mac(&relay_nonce, client_nonce))
        }
        None => Bytes::new(),
    };
    Ok(ok_reply(h.seq, relay.epoch, 0, proof))
}

/// How long a connection closed for a protocol error keeps reading (and discarding) input.
const LINGER: Duration = Duration::from_secs(2);
/// How much input such a connection discards at most.
const LINGER_MAX_BYTES: u64 = 256 << 20;

async fn write_replies(relay: Arc<Relay>, wr: BoxWrite, mut rx: mpsc::Receiver<Reply>) {
    let mut wr = tokio::io::BufWriter::with_capacity(IO_BUF, wr);
    let deadline = relay.cfg.read_timeout;
    while let Some(reply) = rx.recv().await {
        let res = timeout(deadline, async {
            wr.write_all(&reply.header.encode()).await?;
            wr.write_all(&reply.body).await?;
            if rx.is_empty() || reply.close {
                wr.flush().await?;
            }
            std::io::Result::Ok(())
        })
        .await;
        match res {
            Ok(Ok(())) if !reply.close => {}
            Ok(_) => break,
            Err(_) => {
                // The client does not take its replies: drop it (and what is
                // queued for it) rather than hold blobs for it.
                relay.reject(Reject::WriteTimeout);
                tracing::warn!(
                    ?deadline,
                    "relay: a client did not read its reply in time; closing"
                );
                return;
            }
        }
    }
    let _ = timeout(deadline, async {
        let _ = wr.flush().await;
        let _ = wr.shutdown().await;
    })
    .await;
}
