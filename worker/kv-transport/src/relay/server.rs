//! The relay server: accepts connections and speaks the protocol of
//! [`crate::frame`] over each. Per connection, a reader task handles frames
//! in order and a writer task sends replies; GETs wait in their own tasks, so
//! one connection carries many requests at once. Replies carry the request's
//! `seq`. A malformed or oversize frame closes that connection only.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpListener;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::store::{Gauge, Relay};
use super::{MAX_WAIT, RelayConfig};
use crate::frame::{ErrCode, FLAG_CRC, HEADER_LEN, Header, IO_BUF, Op, read_body_crc};
use crate::{KvError, MAX_KEY_LEN};

/// Serves the relay protocol on `listener` until `shutdown` completes; then
/// closes every connection and returns once they are all gone.
pub async fn serve(
    listener: TcpListener,
    cfg: RelayConfig,
    shutdown: impl Future<Output = ()>,
) -> Result<(), KvError> {
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
                    let _ = stream.set_nodelay(true);
                    let relay = relay.clone();
                    let cancel = stop.child_token();
                    let span = tracing::debug_span!("relay.connection", %peer);
                    tracker.spawn(tracing::Instrument::instrument(async move {
                        let _g = Gauge::up(&relay.connections);
                        tracing::debug!(%peer, "relay: connection opened");
                        let (rd, wr) = stream.into_split();
                        connection(relay.clone(), rd, wr, peer.to_string(), cancel).await;
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

async fn connection(
    relay: Arc<Relay>,
    rd: OwnedReadHalf,
    wr: OwnedWriteHalf,
    peer: String,
    stop: CancellationToken,
) {
    let (tx, rx) = mpsc::channel::<Reply>(1024);
    let writer = tokio::spawn(write_replies(wr, rx));
    // Waiting GETs of this connection end with it (or with the relay).
    let gets = stop.child_token();
    let mut rd = BufReader::with_capacity(IO_BUF, rd);
    let reason = tokio::select! {
        r = read_requests(&relay, &mut rd, &tx, &gets) => r,
        _ = stop.cancelled() => {
            let _ = tx.try_send(err_reply(0, relay.epoch, ErrCode::ShuttingDown, "relay shutting down".into(), true));
            Ok(())
        }
    };
    let fatal = reason.is_err();
    if let Err(reason) = reason {
        tracing::warn!(%peer, %reason, "relay: closing connection");
    }
    // Stop the waiting GETs (they drop their senders), then let the writer
    // send what is queued: it ends when every sender is gone or after a
    // `close` reply. A client that does not read gets a short grace.
    gets.cancel();
    drop(tx);
    let abort = writer.abort_handle();
    if tokio::time::timeout(Duration::from_secs(2), writer)
        .await
        .is_err()
    {
        abort.abort();
    }
    if fatal {
        // Lingering close: the client may still be sending the frame that was
        // refused. Closing with its bytes unread would make the kernel reset
        // the connection, and the client could lose the error reply it has
        // not read yet. The reply and our FIN are out; drain for a bounded
        // time and size, then close.
        let mut input = (&mut rd).take(LINGER_MAX_BYTES);
        let mut sink = tokio::io::sink();
        let _ = tokio::time::timeout(LINGER, tokio::io::copy(&mut input, &mut sink)).await;
    }
}

/// How long a connection closed for a protocol error keeps reading (and discarding) input.
const LINGER: Duration = Duration::from_secs(2);
/// How much input such a connection discards at most.
const LINGER_MAX_BYTES: u64 = 256 << 20;

async fn write_replies(wr: OwnedWriteHalf, mut rx: mpsc::Receiver<Reply>) {
    let mut wr = tokio::io::BufWriter::with_capacity(IO_BUF, wr);
    while let Some(reply) = rx.recv().await {
        let res = async {
            wr.write_all(&reply.header.encode()).await?;
            wr.write_all(&reply.body).await?;
            if rx.is_empty() || reply.close {
                wr.flush().await?;
            }
            std::io::Result::Ok(())
        }
        .await;
        if res.is_err() || reply.close {
            break;
        }
    }
    let _ = wr.flush().await;
    let _ = wr.shutdown().await;
}

/// Reads and handles frames until EOF or a fatal protocol error (returned as a message).
async fn read_requests(
    relay: &Arc<Relay>,
    rd: &mut BufReader<OwnedReadHalf>,
    tx: &mpsc::Sender<Reply>,
    cancel: &CancellationToken,
) -> Result<(), String> {
    let epoch = relay.epoch;
    let send = |r: Reply| async move { tx.send(r).await.map_err(|_| "writer gone".to_string()) };
    loop {
        let mut hb = [0u8; HEADER_LEN];
        match rd.read_exact(&mut hb).await {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(format!("read failed: {e}")),
        }
        let h = match Header::decode(&hb) {
            Ok(h) => h,
            Err(e) => {
                send(err_reply(
                    0,
                    epoch,
                    ErrCode::Malformed,
                    format!("malformed frame: {e}"),
                    true,
                ))
                .await?;
                return Err(format!("malformed frame: {e}"));
            }
        };
        if h.key_len as usize > MAX_KEY_LEN {
            let msg = format!("key of {} bytes exceeds {MAX_KEY_LEN}", h.key_len);
            send(err_reply(
                h.seq,
                epoch,
                ErrCode::Malformed,
                msg.clone(),
                true,
            ))
            .await?;
            return Err(msg);
        }
        let mut kb = vec![0u8; h.key_len as usize];
        rd.read_exact(&mut kb)
            .await
            .map_err(|e| format!("read failed: {e}"))?;
        let key = match String::from_utf8(kb) {
            Ok(k) if !k.is_empty() || h.op == Op::Stats => k,
            _ => {
                discard(&mut *rd, h.body_len.min(relay.cfg.max_frame)).await?;
                send(err_reply(
                    h.seq,
                    epoch,
                    ErrCode::BadRequest,
                    "empty or non-UTF-8 key".into(),
                    false,
                ))
                .await?;
                continue;
            }
        };
        if h.body_len > relay.cfg.max_frame {
            let msg = format!(
                "frame body of {} bytes exceeds the relay's maximum of {}",
                h.body_len, relay.cfg.max_frame
            );
            send(err_reply(
                h.seq,
                epoch,
                ErrCode::TooLarge,
                msg.clone(),
                true,
            ))
            .await?;
            return Err(msg);
        }
        if h.op != Op::Put && h.body_len != 0 {
            let msg = format!("{:?} frame with a body", h.op);
            send(err_reply(
                h.seq,
                epoch,
                ErrCode::Malformed,
                msg.clone(),
                true,
            ))
            .await?;
            return Err(msg);
        }
        match h.op {
            Op::Put => {
                let n = h.body_len;
                if !relay.reserve(n) {
                    discard(&mut *rd, n).await?;
                    let msg = format!(
                        "relay memory cap of {} bytes reached ({} held)",
                        relay.cfg.max_bytes,
                        relay.used.load(Ordering::SeqCst)
                    );
                    send(err_reply(h.seq, epoch, ErrCode::Capacity, msg, false)).await?;
                    continue;
                }
                let crc = (h.flags & FLAG_CRC != 0).then_some(h.crc32);
                let body = {
                    let _g = Gauge::up(&relay.puts_in_progress);
                    read_body_crc(&mut *rd, n as usize, crc.is_some()).await
                };
                let (body, computed) = match body {
                    Ok(b) => b,
                    Err(e) => {
                        relay.unreserve(n);
                        return Err(format!("connection lost inside a PUT body: {e}"));
                    }
                };
                if let Some(actual) = computed
                    && actual != h.crc32
                {
                    relay.unreserve(n);
                    let mut r = err_reply(
                        h.seq,
                        epoch,
                        ErrCode::Crc,
                        format!(
                            "blob {} of `{key}`: CRC-32 {actual:08x}, header says {:08x}",
                            h.index, h.crc32
                        ),
                        false,
                    );
                    r.header.crc32 = actual;
                    r.header.index = h.index;
                    send(r).await?;
                    continue;
                }
                relay.insert(key, h.index, (body, crc));
                send(ok_reply(h.seq, epoch, h.index, Bytes::new())).await?;
            }
            Op::Get => {
                if h.epoch != 0 && h.epoch != epoch {
                    send(restarted(&key, h, epoch)).await?;
                    continue;
                }
                let wait = Duration::from_millis(h.arg as u64).min(MAX_WAIT);
                let deadline = tokio::time::Instant::now() + wait;
                let relay = relay.clone();
                let tx = tx.clone();
                let cancel = cancel.clone();
                tokio::spawn(async move {
                    let reply = match relay.wait_for(&key, h.index, deadline, &cancel).await {
                        Some((blob, crc)) => {
                            let mut r = ok_reply(h.seq, epoch, h.index, blob);
                            if let Some(crc) = crc {
                                r.header.crc32 = crc;
                                r.header.flags = FLAG_CRC;
                            }
                            r
                        }
                        None => err_reply(
                            h.seq,
                            epoch,
                            ErrCode::NotFound,
                            format!("blob {} of `{key}` did not arrive within {wait:?}", h.index),
                            false,
                        ),
                    };
                    if !cancel.is_cancelled() {
                        let _ = tx.send(reply).await;
                    }
                });
            }
            Op::Del => {
                let removed = relay.remove(&key);
                tracing::debug!(key, removed, "relay: released");
                send(ok_reply(h.seq, epoch, 0, Bytes::new())).await?;
            }
            Op::Stats => {
                let body = serde_json::to_vec(&relay.stats()).expect("stats serialize");
                send(ok_reply(h.seq, epoch, 0, Bytes::from(body))).await?;
            }
            Op::Ok | Op::Err => {
                let msg = format!("reply op {:?} sent to the relay", h.op);
                send(err_reply(
                    h.seq,
                    epoch,
                    ErrCode::Malformed,
                    msg.clone(),
                    true,
                ))
                .await?;
                return Err(msg);
            }
        }
    }
}

fn restarted(key: &str, h: Header, epoch: u64) -> Reply {
    err_reply(
        h.seq,
        epoch,
        ErrCode::Restarted,
        format!(
            "`{key}` was pushed to relay epoch {:016x}, this relay is epoch {epoch:016x} (restarted): the KV cache is lost",
            h.epoch
        ),
        false,
    )
}

async fn discard<R: tokio::io::AsyncRead + Unpin>(rd: &mut R, n: u64) -> Result<(), String> {
    let copied = tokio::io::copy(&mut (&mut *rd).take(n), &mut tokio::io::sink())
        .await
        .map_err(|e| format!("read failed: {e}"))?;
    if copied != n {
        return Err("connection closed inside a frame body".into());
    }
    Ok(())
}
