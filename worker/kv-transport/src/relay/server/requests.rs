//! The relay's request loop on an authenticated connection: reads frames
//! in order under the idle and read deadlines, and handles PUT (memory cap,
//! CRC-32 check), GET (a waiting task per request, under the waiting-GET
//! cap), DEL and STATS; a fatal error is answered and ends the loop. Each
//! step is a method of `Conn` that returns `Err(End)` to end the loop.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncBufReadExt, AsyncReadExt};
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
    rd: &mut super::Rd,
    tx: &mpsc::Sender<Reply>,
    cancel: &CancellationToken,
) -> End {
    let mut conn = Conn {
        relay,
        rd,
        tx,
        cancel,
        pending: Arc::new(AtomicUsize::new(0)),
    };
    loop {
        if let Err(end) = conn.next_request().await {
            return end;
        }
    }
}

/// One authenticated connection's request loop: where frames come from,
/// where replies go, and the GETs of it still waiting. Each step returns
/// `Err(End)` when the loop must end (any fatal error already answered).
struct Conn<'a> {
    relay: &'a Arc<Relay>,
    rd: &'a mut super::Rd,
    tx: &'a mpsc::Sender<Reply>,
    cancel: &'a CancellationToken,
    /// GETs of this connection still waiting (the connection is not idle then).
    pending: Arc<AtomicUsize>,
}

/// The end of a connection that lost its stream (nothing to answer).
fn lost(reason: String) -> End {
    End::Fatal {
        reason,
        linger: false,
    }
}

impl Conn<'_> {
    /// Waits for a frame, reads it and handles it.
    async fn next_request(&mut self) -> Result<(), End> {
        self.wait_for_frame().await?;
        let deadline = Instant::now() + self.relay.cfg.read_timeout;
        let (h, key) = self.read_head(deadline).await?;
        match h.op {
            Op::Put => self.put(h, key, deadline).await,
            Op::Get => self.get(h, key).await,
            Op::Del => {
                let removed = self.relay.remove(&key);
                tracing::debug!(key, removed, "relay: released");
                self.send(ok_reply(h.seq, self.relay.epoch, 0, Bytes::new()))
                    .await
            }
            Op::Stats => {
                let body = serde_json::to_vec(&self.relay.stats()).expect("stats serialize");
                self.send(ok_reply(h.seq, self.relay.epoch, 0, Bytes::from(body)))
                    .await
            }
            Op::Hello | Op::Auth | Op::Ok | Op::Err => Err(self
                .fatal(
                    h.seq,
                    ErrCode::Malformed,
                    Reject::Malformed,
                    format!("{:?} frame sent to the relay after the handshake", h.op),
                    true,
                )
                .await),
        }
    }

    /// Queues a reply; the loop ends if the writer is gone.
    async fn send(&self, reply: Reply) -> Result<(), End> {
        self.tx
            .send(reply)
            .await
            .map_err(|_| lost("writer gone".into()))
    }

    /// Counts `why`, answers a fatal error (the connection closes after it)
    /// and gives the end of the loop.
    async fn fatal(&self, seq: u32, code: ErrCode, why: Reject, msg: String, linger: bool) -> End {
        self.relay.reject(why);
        let _ = self
            .tx
            .send(err_reply(seq, self.relay.epoch, code, msg.clone(), true))
            .await;
        End::Fatal {
            reason: msg,
            linger,
        }
    }

    /// The fatal error of a frame that did not arrive by its deadline.
    async fn late(&self, seq: u32) -> End {
        let msg = format!(
            "a frame did not arrive within {:?}",
            self.relay.cfg.read_timeout
        );
        self.fatal(seq, ErrCode::Timeout, Reject::ReadTimeout, msg, false)
            .await
    }

    /// Idles until the next frame's first byte (not while a GET waits:
    /// then the idle timeout starts over). `Err(End::Done)` at EOF.
    async fn wait_for_frame(&mut self) -> Result<(), End> {
        let idle = self.relay.cfg.idle_timeout;
        loop {
            let filled = timeout(idle, async {
                self.rd.fill_buf().await.map(|b| b.is_empty())
            });
            match filled.await {
                Ok(Ok(true)) => return Err(End::Done),
                Ok(Ok(false)) => return Ok(()),
                Ok(Err(e)) => return Err(lost(format!("read failed: {e}"))),
                Err(_) if self.pending.load(Ordering::SeqCst) > 0 => continue,
                Err(_) => {
                    let msg = format!("connection idle for {idle:?}");
                    return Err(self
                        .fatal(0, ErrCode::Timeout, Reject::IdleTimeout, msg, false)
                        .await);
                }
            }
        }
    }

    /// Reads a frame's header and key by `deadline`.
    async fn read_head(&mut self, deadline: Instant) -> Result<(Header, String), End> {
        let max_frame = self.relay.cfg.max_frame;
        match timeout_at(deadline, read_request_head(self.rd, max_frame)).await {
            Err(_) => Err(self.late(0).await),
            Ok(Ok(Some(head))) => Ok(head),
            Ok(Ok(None)) => Err(End::Done),
            Ok(Err(frame::FrameError::Io(e))) => Err(lost(format!("read failed: {e}"))),
            Ok(Err(frame::FrameError::Truncated)) => {
                Err(lost("connection closed inside a frame".into()))
            }
            Ok(Err(e)) => {
                let why = match e.code() {
                    ErrCode::TooLarge => Reject::TooLarge,
                    _ => Reject::Malformed,
                };
                Err(self.fatal(0, e.code(), why, format!("{e}"), true).await)
            }
        }
    }

    /// Skips `n` bytes of a refused body by the frame's `deadline`.
    async fn skip_body(&mut self, seq: u32, n: u64, deadline: Instant) -> Result<(), End> {
        match timeout_at(deadline, discard(&mut *self.rd, n)).await {
            Err(_) => Err(self.late(seq).await),
            Ok(Err(reason)) => Err(lost(reason)),
            Ok(Ok(())) => Ok(()),
        }
    }

    /// PUT: admitted under the blob and memory caps (else its body is
    /// skipped and it gets a Capacity error), received under the memory cap
    /// as it arrives, checked against its CRC-32, stored.
    async fn put(&mut self, h: Header, key: String, deadline: Instant) -> Result<(), End> {
        let relay = self.relay;
        let n = h.body_len;
        if let Err(why) = relay.admit_put() {
            relay.reject(why);
            self.skip_body(h.seq, n, deadline).await?;
            let msg = match why {
                Reject::Entries => format!(
                    "the relay holds its maximum of {} blobs",
                    relay.cfg.max_entries
                ),
                _ => memory_full(relay),
            };
            return self
                .send(err_reply(h.seq, relay.epoch, ErrCode::Capacity, msg, false))
                .await;
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
                read_body_admitted(&mut *self.rd, n as usize, crc.is_some(), admit),
            )
            .await
        };
        let (body, computed) = match body {
            Ok(Ok(Body::Complete(b, c))) => (b, c),
            Ok(Ok(Body::Refused { read })) => {
                relay.abandon_put(received);
                relay.reject(Reject::Memory);
                self.skip_body(h.seq, n - read as u64, deadline).await?;
                let msg = memory_full(relay);
                return self
                    .send(err_reply(h.seq, relay.epoch, ErrCode::Capacity, msg, false))
                    .await;
            }
            Ok(Err(e)) => {
                relay.abandon_put(received);
                return Err(lost(format!("connection lost inside a PUT body: {e}")));
            }
            Err(_) => {
                // A stalled PUT gives back what it held at once.
                relay.abandon_put(received);
                return Err(self.late(h.seq).await);
            }
        };
        if let Some(actual) = computed
            && actual != h.crc32
        {
            relay.abandon_put(received);
            let mut r = err_reply(
                h.seq,
                relay.epoch,
                ErrCode::Crc,
                format!(
                    "blob {} of `{key}`: CRC-32 {actual:08x}, header says {:08x}",
                    h.index, h.crc32
                ),
                false,
            );
            r.header.crc32 = actual;
            r.header.index = h.index;
            return self.send(r).await;
        }
        relay.insert(key, h.index, (body, crc));
        self.send(ok_reply(h.seq, relay.epoch, h.index, Bytes::new()))
            .await
    }

    /// GET: refused at once for another epoch or over the waiting-GET cap;
    /// else waits on a task of its own, which sends the blob or NotFound.
    async fn get(&mut self, h: Header, key: String) -> Result<(), End> {
        let epoch = self.relay.epoch;
        if h.epoch != 0 && h.epoch != epoch {
            return self.send(restarted(&key, h, epoch)).await;
        }
        if !self.relay.admit_waiter() {
            self.relay.reject(Reject::Waiters);
            let msg = format!(
                "the relay's cap of {} waiting GETs is reached",
                self.relay.cfg.max_waiters
            );
            return self
                .send(err_reply(h.seq, epoch, ErrCode::Capacity, msg, false))
                .await;
        }
        let wait = Duration::from_millis(h.arg as u64).min(MAX_WAIT);
        let deadline = Instant::now() + wait;
        let relay = self.relay.clone();
        let tx = self.tx.clone();
        let cancel = self.cancel.clone();
        self.pending.fetch_add(1, Ordering::SeqCst);
        let pending = self.pending.clone();
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
        Ok(())
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
