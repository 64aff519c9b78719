//! The relay server: accepts connections (under the connection cap),
//! authenticates each with the handshake of [`crate::frame`], and speaks the
//! protocol over it. Per connection, a reader task handles frames in order
//! and a writer task sends replies; GETs wait in their own tasks (under the
//! waiting-GET cap), so one connection carries many requests at once.
//! Replies carry the request's `seq`. Every frame must arrive within the
//! read deadline of its first byte, and every reply be taken within it; a
//! connection idle (no frame, no GET waiting) for the idle timeout is
//! closed. A malformed or oversize frame closes that connection only, with
//! the rest of its stream discarded unread.
//!
//! This file holds the accept loop, the connection (handshake, writer task,
//! lingering close); `server/requests.rs` holds the request loop (PUT, GET,
//! DEL, STATS).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::time::timeout;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::RelayConfig;
use super::store::{Gauge, Reject, Relay};
use crate::KvError;
use crate::frame::{
    self, ErrCode, HELLO_AUTH, Header, IO_BUF, MAC_LEN, NONCE_LEN, Op, read_request_head,
};

mod requests;

use requests::read_requests;

/// Serves the relay protocol on `listener` until `shutdown` completes; then
/// closes every connection and returns once they are all gone.
pub async fn serve(
    listener: TcpListener,
    cfg: RelayConfig,
    shutdown: impl Future<Output = ()>,
) -> Result<(), KvError> {
    if cfg.secret.is_none() {
        tracing::warn!(
            "KV relay: connections are NOT authenticated (no shared secret; --insecure-no-auth)"
        );
    }
    let relay = Arc::new(Relay::new(cfg));
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
    tokio::pin!(shutdown);
    let result = loop {
        tokio::select! {
            _ = &mut shutdown => break Ok(()),
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    if !relay.admit_connection() {
                        relay.reject(Reject::Connections);
                        refuse_connection(&relay, stream);
                        tracing::debug!(%peer, "relay: connection cap reached, closed a new connection");
                        continue;
                    }
                    let _ = stream.set_nodelay(true);
                    let relay = relay.clone();
                    let cancel = stop.child_token();
                    let span = tracing::debug_span!("relay.connection", %peer);
                    tracker.spawn(tracing::Instrument::instrument(async move {
                        let _g = Gauge::adopt(&relay.connections);
                        tracing::debug!(%peer, "relay: connection opened");
                        connection(relay.clone(), stream, peer.to_string(), cancel).await;
                        tracing::debug!(%peer, "relay: connection closed");
                    }, span));
                }
                Err(e) => {
                    // Out of descriptors and the like: keep serving the others.
                    tracing::warn!(error = %e, "relay: accept failed");
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

/// Closes a connection over the cap at once, with an ERR the client can
/// name (written only if the socket takes it without waiting).
fn refuse_connection(relay: &Relay, stream: TcpStream) {
    let r = err_reply(
        0,
        relay.epoch,
        ErrCode::Capacity,
        format!(
            "the relay's connection cap of {} is reached",
            relay.cfg.max_connections
        ),
        true,
    );
    let mut bytes = r.header.encode().to_vec();
    bytes.extend_from_slice(&r.body);
    let _ = stream.try_write(&bytes);
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

/// Why [`handshake`] failed when the peer closed without sending a byte.
const SILENT: &str = "closed before answering";

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

async fn connection(relay: Arc<Relay>, stream: TcpStream, peer: String, stop: CancellationToken) {
    let (rd, mut wr) = stream.into_split();
    let mut rd = BufReader::with_capacity(IO_BUF, rd);
    let authed = tokio::select! {
        r = timeout(relay.cfg.read_timeout, handshake(&relay, &mut rd, &mut wr)) => match r {
            Ok(Ok(())) => true,
            // A TCP probe or a scan: connected and closed (or reset)
            // without an answer. Neither a warning nor a rejection.
            Ok(Err(reason)) if reason == SILENT => {
                tracing::debug!(%peer, "relay: closed before the handshake");
                return;
            }
            Ok(Err(reason)) => {
                tracing::warn!(%peer, %reason, "relay: handshake refused");
                false
            }
            Err(_) => {
                tracing::warn!(%peer, timeout = ?relay.cfg.read_timeout, "relay: no handshake answer in time");
                false
            }
        },
        _ = stop.cancelled() => return,
    };
    if !authed {
        relay.reject(Reject::Auth);
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
        // A short lingering close (see below), smaller than for an
        // authenticated peer: the refusal must not be lost to a reset.
        let mut input = (&mut rd).take(64 << 10);
        let _ = timeout(
            Duration::from_millis(500),
            tokio::io::copy(&mut input, &mut tokio::io::sink()),
        )
        .await;
        return;
    }
    let (tx, rx) = mpsc::channel::<Reply>(1024);
    let writer = tokio::spawn(write_replies(relay.clone(), wr, rx));
    // Waiting GETs of this connection end with it (or with the relay).
    let gets = stop.child_token();
    let end = tokio::select! {
        r = read_requests(&relay, &mut rd, &tx, &gets) => r,
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

/// The relay's side of the handshake: HELLO out, AUTH in (checked), OK out.
/// An error is the (logged, never sent) reason for refusing.
async fn handshake(
    relay: &Relay,
    rd: &mut BufReader<OwnedReadHalf>,
    wr: &mut OwnedWriteHalf,
) -> Result<(), String> {
    let relay_nonce = frame::nonce();
    let mut hello = Header::new(Op::Hello, 0);
    hello.arg = if relay.cfg.secret.is_some() {
        HELLO_AUTH
    } else {
        0
    };
    hello.body_len = NONCE_LEN as u64;
    hello.epoch = relay.epoch;
    let io = |e: std::io::Error| format!("handshake I/O: {e}");
    // A peer gone before it said anything (the HELLO cannot be written,
    // the socket is reset or closed) is silent, not a failed answer.
    let silent = |_| SILENT.to_string();
    wr.write_all(&hello.encode()).await.map_err(silent)?;
    wr.write_all(&relay_nonce).await.map_err(silent)?;
    // Nothing but an AUTH of its fixed size is read before the handshake.
    let (h, _) = match read_request_head(rd, 0).await {
        Ok(Some(head)) => head,
        Ok(None) | Err(frame::FrameError::Io(_)) => return Err(SILENT.into()),
        Err(e) => return Err(format!("not a handshake answer: {e}")),
    };
    if h.op != Op::Auth {
        return Err(format!("{:?} before the handshake", h.op));
    }
    let mut body = [0u8; NONCE_LEN + MAC_LEN];
    rd.read_exact(&mut body).await.map_err(io)?;
    let (client_nonce, client_mac) = body.split_at(NONCE_LEN);
    let proof = match &relay.cfg.secret {
        Some(secret) => {
            if !secret.verify_client(&relay_nonce, client_nonce, client_mac) {
                return Err("wrong secret".into());
            }
            Bytes::copy_from_slice(&secret.server_mac(&relay_nonce, client_nonce))
        }
        None => Bytes::new(),
    };
    let ok = ok_reply(h.seq, relay.epoch, 0, proof);
    wr.write_all(&ok.header.encode()).await.map_err(io)?;
    wr.write_all(&ok.body).await.map_err(io)?;
    Ok(())
}

/// How long a connection closed for a protocol error keeps reading (and discarding) input.
const LINGER: Duration = Duration::from_secs(2);
/// How much input such a connection discards at most.
const LINGER_MAX_BYTES: u64 = 256 << 20;

async fn write_replies(relay: Arc<Relay>, wr: OwnedWriteHalf, mut rx: mpsc::Receiver<Reply>) {
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
