//! The relay's request loop on an authenticated connection: reads frames
//! in order under the idle and read deadlines, and handles PUT (memory cap,
//! CRC-32 check), GET (a waiting task per request, under the waiting-GET
//! cap), DEL and STATS; a fatal error is answered and ends the loop.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};
use tokio::net::tcp::OwnedReadHalf;
use tokio::sync::mpsc;
use tokio::time::{Instant, timeout, timeout_at};
use tokio_util::sync::CancellationToken;

use super::super::MAX_WAIT;
use super::super::store::{Gauge, Reject, Relay};
use super::{End, Reply, err_reply, ok_reply};
use crate::frame::{
    self, Body, ErrCode, FLAG_CRC, Header, Op, read_body_admitted, read_request_head,
};

/// Reads and handles frames until EOF or a fatal error (answered before it returns).
pub(super) async fn read_requests(
    relay: &Arc<Relay>,
    rd: &mut BufReader<OwnedReadHalf>,
    tx: &mpsc::Sender<Reply>,
    cancel: &CancellationToken,
) -> End {
    let epoch = relay.epoch;
    let cfg = &relay.cfg;
    // GETs of this connection still waiting (the connection is not idle then).
    let pending = Arc::new(AtomicUsize::new(0));
    macro_rules! send {
        ($r:expr) => {
            if tx.send($r).await.is_err() {
                return End::Fatal {
                    reason: "writer gone".into(),
                    linger: false,
                };
            }
        };
    }
    // Answers a fatal error (closing) and ends the loop.
    macro_rules! fatal {
        ($seq:expr, $code:expr, $why:expr, $msg:expr, $linger:expr) => {{
            let msg: String = $msg;
            relay.reject($why);
            let _ = tx
                .send(err_reply($seq, epoch, $code, msg.clone(), true))
                .await;
            return End::Fatal {
                reason: msg,
                linger: $linger,
            };
        }};
    }
    loop {
        // Idle until the next frame's first byte.
        let n = loop {
            match timeout(cfg.idle_timeout, async {
                rd.fill_buf().await.map(|b| b.len())
            })
            .await
            {
                Ok(Ok(n)) => break n,
                Ok(Err(e)) => {
                    return End::Fatal {
                        reason: format!("read failed: {e}"),
                        linger: false,
                    };
                }
                Err(_) if pending.load(Ordering::SeqCst) > 0 => continue,
                Err(_) => fatal!(
                    0,
                    ErrCode::Timeout,
                    Reject::IdleTimeout,
                    format!("connection idle for {:?}", cfg.idle_timeout),
                    false
                ),
            }
        };
        if n == 0 {
            return End::Done;
        }
        let deadline = Instant::now() + cfg.read_timeout;
        let late = || format!("a frame did not arrive within {:?}", cfg.read_timeout);
        // Skips a refused body within the frame's deadline.
        macro_rules! discard_or_end {
            ($seq:expr, $n:expr) => {
                match timeout_at(deadline, discard(&mut *rd, $n)).await {
                    Err(_) => fatal!($seq, ErrCode::Timeout, Reject::ReadTimeout, late(), false),
                    Ok(Err(reason)) => {
                        return End::Fatal {
                            reason,
                            linger: false,
                        };
                    }
                    Ok(Ok(())) => {}
                }
            };
        }
        let (h, key) = match timeout_at(deadline, read_request_head(rd, cfg.max_frame)).await {
            Err(_) => fatal!(0, ErrCode::Timeout, Reject::ReadTimeout, late(), false),
            Ok(Ok(Some(head))) => head,
            Ok(Ok(None)) => return End::Done,
            Ok(Err(frame::FrameError::Io(e))) => {
                return End::Fatal {
                    reason: format!("read failed: {e}"),
                    linger: false,
                };
            }
            Ok(Err(frame::FrameError::Truncated)) => {
                return End::Fatal {
                    reason: "connection closed inside a frame".into(),
                    linger: false,
                };
            }
            Ok(Err(e)) => {
                let why = match e.code() {
                    ErrCode::TooLarge => Reject::TooLarge,
                    _ => Reject::Malformed,
                };
                fatal!(0, e.code(), why, format!("{e}"), true)
            }
        };
        match h.op {
            Op::Put => {
                let n = h.body_len;
                if let Err(why) = relay.admit_put() {
                    relay.reject(why);
                    discard_or_end!(h.seq, n);
                    let msg = match why {
                        Reject::Entries => {
                            format!("the relay holds its maximum of {} blobs", cfg.max_entries)
                        }
                        _ => memory_full(relay),
                    };
                    send!(err_reply(h.seq, epoch, ErrCode::Capacity, msg, false));
                    continue;
                }
                let crc = (h.flags & FLAG_CRC != 0).then_some(h.crc32);
                let mut received = 0u64;
                let body = {
                    let _g = Gauge::up(&relay.puts_in_progress);
                    let admit = |k: usize| {
                        let ok = relay.reserve(k as u64);
                        if ok {
                            received += k as u64;
                        }
                        ok
                    };
                    timeout_at(
                        deadline,
                        read_body_admitted(&mut *rd, n as usize, crc.is_some(), admit),
                    )
                    .await
                };
                let (body, computed) = match body {
                    Ok(Ok(Body::Complete(b, c))) => (b, c),
                    Ok(Ok(Body::Refused { read })) => {
                        relay.abandon_put(received);
                        relay.reject(Reject::Memory);
                        let rest = n - read as u64;
                        discard_or_end!(h.seq, rest);
                        send!(err_reply(
                            h.seq,
                            epoch,
                            ErrCode::Capacity,
                            memory_full(relay),
                            false
                        ));
                        continue;
                    }
                    Ok(Err(e)) => {
                        relay.abandon_put(received);
                        return End::Fatal {
                            reason: format!("connection lost inside a PUT body: {e}"),
                            linger: false,
                        };
                    }
                    Err(_) => {
                        // A stalled PUT gives back what it held at once.
                        relay.abandon_put(received);
                        fatal!(h.seq, ErrCode::Timeout, Reject::ReadTimeout, late(), false)
                    }
                };
                if let Some(actual) = computed
                    && actual != h.crc32
                {
                    relay.abandon_put(received);
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
                    send!(r);
                    continue;
                }
                relay.insert(key, h.index, (body, crc));
                send!(ok_reply(h.seq, epoch, h.index, Bytes::new()));
            }
            Op::Get => {
                if h.epoch != 0 && h.epoch != epoch {
                    send!(restarted(&key, h, epoch));
                    continue;
                }
                if !relay.admit_waiter() {
                    relay.reject(Reject::Waiters);
                    send!(err_reply(
                        h.seq,
                        epoch,
                        ErrCode::Capacity,
                        format!(
                            "the relay's cap of {} waiting GETs is reached",
                            cfg.max_waiters
                        ),
                        false
                    ));
                    continue;
                }
                let wait = Duration::from_millis(h.arg as u64).min(MAX_WAIT);
                let deadline = Instant::now() + wait;
                let relay = relay.clone();
                let tx = tx.clone();
                let cancel = cancel.clone();
                pending.fetch_add(1, Ordering::SeqCst);
                let pending = pending.clone();
                tokio::spawn(async move {
                    let _p = Gauge::adopt(&pending);
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
                send!(ok_reply(h.seq, epoch, 0, Bytes::new()));
            }
            Op::Stats => {
                let body = serde_json::to_vec(&relay.stats()).expect("stats serialize");
                send!(ok_reply(h.seq, epoch, 0, Bytes::from(body)));
            }
            Op::Hello | Op::Auth | Op::Ok | Op::Err => fatal!(
                h.seq,
                ErrCode::Malformed,
                Reject::Malformed,
                format!("{:?} frame sent to the relay after the handshake", h.op),
                true
            ),
        }
    }
}

fn memory_full(relay: &Relay) -> String {
    format!(
        "relay memory cap of {} bytes reached ({} held)",
        relay.cfg.max_bytes,
        relay.used.load(Ordering::SeqCst)
    )
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

/// Reads and drops `n` bytes; an error if the stream ends first.
async fn discard<R: tokio::io::AsyncRead + Unpin>(rd: &mut R, n: u64) -> Result<(), String> {
    let copied = tokio::io::copy(&mut (&mut *rd).take(n), &mut tokio::io::sink())
        .await
        .map_err(|e| format!("read failed: {e}"))?;
    if copied != n {
        return Err("connection closed inside a frame body".into());
    }
    Ok(())
}
