//! The `tcp` transport: a client of the KV relay ([`crate::relay`]) at
//! `AIRM_KV_TCP_ADDR`.
//!
//! push sends one PUT per blob, pipelined on one pooled connection (CRC-32 is
//! computed right before each blob is written, while it is in cache); pull
//! sends one GET per blob and reads the replies as they come, straight into
//! one buffer per blob. Connections are kept in a per-transport pool; an
//! operation whose pooled connection turns out to be dead (e.g. the relay
//! restarted) is retried once on a fresh one. The handle's `location` is
//! `host:port#epoch`: the relay's epoch lets a relay that restarted answer
//! "cache lost" at once instead of a pull waiting for blobs that will never
//! come. The puller connects to its own configured address, never to one taken
//! from the handle.

use std::io;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use rngd_kv_wire::{BlobMeta, KvHandle, WireError};
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};

use crate::frame::{ErrCode, FLAG_CRC, HEADER_LEN, Header, Op};
use crate::relay::{RelayStats, read_body, read_body_crc};
use crate::{KvError, KvPayload, KvTransport, TransportConfig, check_handle, sanitize_key};

/// Registry name.
pub const NAME: &str = "tcp";
/// Idle connections kept per transport.
pub const MAX_IDLE: usize = 16;
/// How long connecting to the relay may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Extra time a pull allows the relay beyond the caller's timeout before
/// declaring it unresponsive.
const GRACE: Duration = Duration::from_secs(5);
/// Buffer size for frame headers and small bodies. Small on purpose: a body
/// at least this large bypasses the buffer and goes straight between the
/// socket and the blob's own memory, so blobs are not copied twice.
pub(crate) const IO_BUF: usize = 8 * 1024;

/// The `tcp` transport. Cheap to clone; clones share the connection pool.
#[derive(Clone)]
pub struct TcpTransport {
    inner: Arc<Client>,
}

struct Client {
    addr: String,
    crc: bool,
    log: bool,
    idle: Mutex<Vec<Conn>>,
    seq: AtomicU32,
}

/// A push the relay refused (an ERR reply), and whether the connection it
/// came on can be used again.
struct Refused {
    error: KvError,
    usable: bool,
}

struct Conn {
    rd: BufReader<OwnedReadHalf>,
    wr: BufWriter<OwnedWriteHalf>,
    reused: bool,
}

impl std::fmt::Debug for TcpTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpTransport")
            .field("addr", &self.inner.addr)
            .field("crc", &self.inner.crc)
            .finish()
    }
}

fn lost(peer: &str, detail: &str, e: io::Error) -> KvError {
    KvError::ConnectionLost {
        transport: NAME,
        peer: peer.to_string(),
        detail: format!("{detail}: {e}"),
        source: Some(e),
    }
}

/// Whether an error means "this connection is dead" (worth one retry on a fresh one).
fn is_dead_connection(e: &KvError) -> bool {
    matches!(
        e,
        KvError::ConnectionLost {
            source: Some(_),
            ..
        }
    )
}

/// Splits a handle location `host:port#epoch` (epoch hex; absent = any).
pub fn parse_location(location: &str) -> (&str, u64) {
    match location.rsplit_once('#') {
        Some((addr, epoch)) => (addr, u64::from_str_radix(epoch, 16).unwrap_or(0)),
        None => (location, 0),
    }
}

fn log_blob(dir: &str, request_id: &str, index: usize, blob: &[u8]) {
    let digest = Sha256::digest(blob);
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    tracing::info!(dir, request_id, index, bytes = blob.len(), sha256 = %hex, "tcp: KV blob");
}

impl TcpTransport {
    /// Creates the transport for `cfg.tcp_addr` (`AIRM_KV_TCP_ADDR`), which must be set.
    pub fn new(cfg: &TransportConfig) -> Result<Self, KvError> {
        let addr = cfg.tcp_addr.clone().ok_or_else(|| KvError::Config {
            detail: format!(
                "the tcp transport needs the relay address in {}",
                rngd_api::env::AIRM_KV_TCP_ADDR
            ),
        })?;
        Ok(Self::connect_to(addr, cfg))
    }

    /// Creates the transport for the relay at `addr` (other settings from `cfg`).
    /// Nothing is connected until the first operation.
    pub fn connect_to(addr: impl Into<String>, cfg: &TransportConfig) -> Self {
        TcpTransport {
            inner: Arc::new(Client {
                addr: addr.into(),
                crc: cfg.tcp_crc,
                log: cfg.tcp_log,
                idle: Mutex::new(Vec::new()),
                seq: AtomicU32::new(1),
            }),
        }
    }

    /// The relay address.
    pub fn addr(&self) -> &str {
        &self.inner.addr
    }

    /// The relay's counters (STATS frame): blobs and bytes held, waiting GETs, …
    pub async fn stats(&self) -> Result<RelayStats, KvError> {
        let c = &self.inner;
        let mut retried = false;
        loop {
            let mut conn = c.checkout().await?;
            let res = c.stats_on(&mut conn).await;
            match res {
                Ok(v) => {
                    c.checkin(conn);
                    return Ok(v);
                }
                Err(e) if conn.reused && !retried && is_dead_connection(&e) => {
                    c.clear_pool();
                    retried = true;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Idle pooled connections (for tests).
    pub fn idle_connections(&self) -> usize {
        self.inner.idle.lock().expect("pool poisoned").len()
    }
}

impl Client {
    fn next_seq(&self) -> u32 {
        self.seq.fetch_add(1, Ordering::Relaxed)
    }

    async fn checkout(&self) -> Result<Conn, KvError> {
        loop {
            let pooled = self.idle.lock().expect("pool poisoned").pop();
            let Some(conn) = pooled else { break };
            // A pooled connection must have nothing to read: data or EOF means
            // the relay closed it (restart, shutdown).
            if !conn.rd.buffer().is_empty() {
                continue;
            }
            let mut probe = [0u8; 1];
            match conn.rd.get_ref().try_read(&mut probe) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(conn),
                _ => continue,
            }
        }
        let stream = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(&self.addr))
            .await
            .map_err(|_| KvError::ConnectionLost {
                transport: NAME,
                peer: self.addr.clone(),
                detail: format!("connect timed out after {CONNECT_TIMEOUT:?}"),
                source: None,
            })?
            .map_err(|e| KvError::ConnectionLost {
                transport: NAME,
                peer: self.addr.clone(),
                detail: format!("cannot connect to the KV relay: {e}"),
                source: None,
            })?;
        let _ = stream.set_nodelay(true);
        let (rd, wr) = stream.into_split();
        Ok(Conn {
            rd: BufReader::with_capacity(IO_BUF, rd),
            wr: BufWriter::with_capacity(IO_BUF, wr),
            reused: false,
        })
    }

    fn checkin(&self, mut conn: Conn) {
        conn.reused = true;
        let mut idle = self.idle.lock().expect("pool poisoned");
        if idle.len() < MAX_IDLE {
            idle.push(conn);
        }
    }

    fn clear_pool(&self) {
        self.idle.lock().expect("pool poisoned").clear();
    }

    async fn send(
        &self,
        conn: &mut Conn,
        h: &Header,
        key: &[u8],
        body: &[u8],
    ) -> Result<(), KvError> {
        let peer = &self.addr;
        conn.wr
            .write_all(&h.encode())
            .await
            .map_err(|e| lost(peer, "write failed", e))?;
        conn.wr
            .write_all(key)
            .await
            .map_err(|e| lost(peer, "write failed", e))?;
        conn.wr
            .write_all(body)
            .await
            .map_err(|e| lost(peer, "write failed", e))
    }

    async fn flush(&self, conn: &mut Conn) -> Result<(), KvError> {
        conn.wr
            .flush()
            .await
            .map_err(|e| lost(&self.addr, "write failed", e))
    }

    /// Reads one reply header. The outer error is the connection failing; the
    /// inner one is an ERR reply (the connection stays usable).
    async fn read_reply(
        &self,
        rd: &mut BufReader<OwnedReadHalf>,
        request_id: &str,
        waited_since: Instant,
    ) -> Result<Result<Header, KvError>, KvError> {
        let peer = &self.addr;
        let mut hb = [0u8; HEADER_LEN];
        rd.read_exact(&mut hb).await.map_err(|e| {
            if e.kind() == io::ErrorKind::UnexpectedEof {
                lost(peer, "the relay closed the connection", e)
            } else {
                lost(peer, "read failed", e)
            }
        })?;
        let h = Header::decode(&hb).map_err(|e| KvError::Protocol {
            transport: NAME,
            peer: peer.clone(),
            detail: e.to_string(),
        })?;
        match h.op {
            Op::Ok => Ok(Ok(h)),
            Op::Err => {
                let body = read_body(rd, h.body_len.min(64 * 1024) as usize)
                    .await
                    .map_err(|e| lost(peer, "read failed", e))?;
                let msg = String::from_utf8_lossy(&body).into_owned();
                let err = match ErrCode::from_u32(h.arg) {
                    ErrCode::NotFound => KvError::NotFound {
                        transport: NAME,
                        request_id: request_id.to_string(),
                        waited: waited_since.elapsed(),
                    },
                    ErrCode::Crc => KvError::Crc {
                        transport: NAME,
                        request_id: request_id.to_string(),
                        source: WireError::Crc {
                            index: h.index as usize,
                            expected: 0,
                            actual: h.crc32,
                        },
                    },
                    ErrCode::Capacity => KvError::Capacity {
                        transport: NAME,
                        detail: msg,
                        source: None,
                    },
                    ErrCode::BadRequest | ErrCode::TooLarge => KvError::BadRequest {
                        transport: NAME,
                        detail: msg,
                    },
                    ErrCode::Restarted => KvError::ConnectionLost {
                        transport: NAME,
                        peer: peer.clone(),
                        detail: msg,
                        source: None,
                    },
                    ErrCode::ShuttingDown => KvError::ConnectionLost {
                        transport: NAME,
                        peer: peer.clone(),
                        detail: msg.clone(),
                        source: Some(io::Error::new(io::ErrorKind::ConnectionAborted, msg)),
                    },
                    ErrCode::Malformed => KvError::Protocol {
                        transport: NAME,
                        peer: peer.clone(),
                        detail: msg,
                    },
                };
                // After these the relay closes the connection.
                match ErrCode::from_u32(h.arg) {
                    ErrCode::ShuttingDown | ErrCode::Malformed | ErrCode::TooLarge => Err(err),
                    _ => Ok(Err(err)),
                }
            }
            other => Err(KvError::Protocol {
                transport: NAME,
                peer: peer.clone(),
                detail: format!("unexpected op {other:?} in a reply"),
            }),
        }
    }

    async fn stats_on(&self, conn: &mut Conn) -> Result<RelayStats, KvError> {
        let h = Header::new(Op::Stats, self.next_seq());
        self.send(conn, &h, b"", b"").await?;
        self.flush(conn).await?;
        let r = self.read_reply(&mut conn.rd, "", Instant::now()).await??;
        let body = read_body(&mut conn.rd, r.body_len as usize)
            .await
            .map_err(|e| lost(&self.addr, "read failed", e))?;
        serde_json::from_slice(&body).map_err(|e| KvError::Protocol {
            transport: NAME,
            peer: self.addr.clone(),
            detail: format!("bad STATS body: {e}"),
        })
    }

    /// Sends every PUT and reads the replies concurrently; returns the blob
    /// table and the relay epoch.
    async fn push_on(
        &self,
        conn: &mut Conn,
        request_id: &str,
        key: &str,
        blobs: &[Bytes],
    ) -> Result<Result<(Vec<BlobMeta>, u64), Refused>, KvError> {
        let first_seq = self.seq.fetch_add(blobs.len() as u32, Ordering::Relaxed);
        let Conn { rd, wr, .. } = conn;
        let peer = &self.addr;
        let write = async {
            let mut metas = Vec::with_capacity(blobs.len());
            for (i, blob) in blobs.iter().enumerate() {
                let mut h = Header::new(Op::Put, first_seq.wrapping_add(i as u32));
                h.key_len = key.len() as u16;
                h.index = i as u32;
                h.body_len = blob.len() as u64;
                if self.crc {
                    h.crc32 = rngd_kv_wire::crc32(blob);
                    h.flags = FLAG_CRC;
                }
                metas.push(BlobMeta {
                    len: blob.len() as u64,
                    crc32: h.crc32,
                });
                let io = async {
                    wr.write_all(&h.encode()).await?;
                    wr.write_all(key.as_bytes()).await?;
                    wr.write_all(blob).await
                };
                io.await.map_err(|e| lost(peer, "write failed", e))?;
                if self.log {
                    log_blob("push", request_id, i, blob);
                }
            }
            wr.flush()
                .await
                .map_err(|e| lost(peer, "write failed", e))?;
            Ok::<_, KvError>(metas)
        };
        let mut refused = None;
        let read = async {
            let started = Instant::now();
            let mut epoch = 0u64;
            for _ in 0..blobs.len() {
                // Read every reply, even after a refusal, so that no PUT of
                // this request is still in flight when the caller cleans up.
                let r = match self.read_reply(rd, request_id, started).await? {
                    Ok(r) => r,
                    Err(e) => {
                        refused.get_or_insert(e);
                        continue;
                    }
                };
                let i = r.seq.wrapping_sub(first_seq) as usize;
                if i >= blobs.len() {
                    return Err(KvError::Protocol {
                        transport: NAME,
                        peer: peer.clone(),
                        detail: format!("reply for unknown seq {}", r.seq),
                    });
                }
                if epoch != 0 && r.epoch != epoch {
                    return Err(KvError::ConnectionLost {
                        transport: NAME,
                        peer: peer.clone(),
                        detail: "the relay restarted during the push".into(),
                        source: None,
                    });
                }
                epoch = r.epoch;
            }
            Ok::<_, KvError>(epoch)
        };
        let (written, read) = tokio::join!(write, read);
        match (written, read, refused) {
            (Ok(metas), Ok(epoch), None) => Ok(Ok((metas, epoch))),
            // A refusal with every reply read: the connection stays usable.
            (Ok(_), Ok(_), Some(error)) => Ok(Err(Refused {
                error,
                usable: true,
            })),
            // The relay refused a frame and then closed the connection (an
            // oversize frame): the refusal is the cause, the failed write or
            // read only its consequence.
            (_, _, Some(error)) => Ok(Err(Refused {
                error,
                usable: false,
            })),
            (Err(e), _, None) | (_, Err(e), None) => Err(e),
        }
    }

    async fn pull_on(
        &self,
        conn: &mut Conn,
        handle: &KvHandle,
        key: &str,
        epoch: u64,
        timeout: Duration,
    ) -> Result<Vec<Bytes>, KvError> {
        let n = handle.blobs.len();
        let started = Instant::now();
        let first_seq = self.seq.fetch_add(n as u32, Ordering::Relaxed);
        // Rounded up: the relay must not give up before the caller's timeout.
        let wait_ms = timeout.as_micros().div_ceil(1000).min(u32::MAX as u128) as u32;
        for i in 0..n {
            let mut h = Header::new(Op::Get, first_seq.wrapping_add(i as u32));
            h.key_len = key.len() as u16;
            h.index = i as u32;
            h.arg = wait_ms;
            h.epoch = epoch;
            if self.crc {
                h.flags = FLAG_CRC;
            }
            self.send(conn, &h, key.as_bytes(), b"").await?;
        }
        self.flush(conn).await?;
        let mut out: Vec<Option<Bytes>> = vec![None; n];
        for _ in 0..n {
            let r = self
                .read_reply(&mut conn.rd, &handle.request_id, started)
                .await??;
            let i = r.seq.wrapping_sub(first_seq) as usize;
            if i >= n || out[i].is_some() || r.index as usize != i {
                return Err(KvError::Protocol {
                    transport: NAME,
                    peer: self.addr.clone(),
                    detail: format!("unexpected reply (seq {}, index {})", r.seq, r.index),
                });
            }
            if r.body_len != handle.blobs[i].len {
                return Err(KvError::Crc {
                    transport: NAME,
                    request_id: handle.request_id.clone(),
                    source: WireError::BlobSize {
                        index: i,
                        expected: handle.blobs[i].len,
                        actual: r.body_len,
                    },
                });
            }
            let (body, crc) = read_body_crc(&mut conn.rd, r.body_len as usize, self.crc)
                .await
                .map_err(|e| lost(&self.addr, "read failed", e))?;
            // Checked against the handle (not the relay's header) as it arrived.
            if let Some(actual) = crc
                && actual != handle.blobs[i].crc32
            {
                return Err(KvError::Crc {
                    transport: NAME,
                    request_id: handle.request_id.clone(),
                    source: WireError::Crc {
                        index: i,
                        expected: handle.blobs[i].crc32,
                        actual,
                    },
                });
            }
            out[i] = Some(body);
        }
        Ok(out
            .into_iter()
            .map(|b| b.expect("every index filled"))
            .collect())
    }

    async fn del_on(&self, conn: &mut Conn, key: &str) -> Result<(), KvError> {
        let mut h = Header::new(Op::Del, self.next_seq());
        h.key_len = key.len() as u16;
        self.send(conn, &h, key.as_bytes(), b"").await?;
        self.flush(conn).await?;
        self.read_reply(&mut conn.rd, key, Instant::now()).await??;
        Ok(())
    }

    async fn release_key(&self, key: &str) -> Result<(), KvError> {
        let mut retried = false;
        loop {
            let mut conn = self.checkout().await?;
            match self.del_on(&mut conn, key).await {
                Ok(()) => {
                    self.checkin(conn);
                    return Ok(());
                }
                Err(e) if conn.reused && !retried && is_dead_connection(&e) => {
                    self.clear_pool();
                    retried = true;
                }
                Err(e) => return Err(e),
            }
        }
    }
}

#[async_trait::async_trait]
impl KvTransport for TcpTransport {
    fn name(&self) -> &'static str {
        NAME
    }

    #[tracing::instrument(name = "kv.push", skip_all, fields(transport = NAME, request_id = %payload.request_id, blobs = payload.blobs.len()))]
    async fn push(&self, payload: KvPayload) -> Result<KvHandle, KvError> {
        let key = sanitize_key(NAME, &payload.request_id)?;
        let c = &self.inner;
        let started = Instant::now();
        let (metas, epoch) = if payload.blobs.is_empty() {
            (Vec::new(), 0)
        } else {
            let mut retried = false;
            loop {
                let mut conn = c.checkout().await?;
                match c
                    .push_on(&mut conn, &payload.request_id, &key, &payload.blobs)
                    .await
                {
                    Ok(Ok(v)) => {
                        c.checkin(conn);
                        break v;
                    }
                    Ok(Err(Refused {
                        error: refused,
                        usable,
                    })) => {
                        // Every reply was read, or the relay closed the
                        // connection: nothing of this request is in flight,
                        // so the release cannot race a late PUT.
                        if usable {
                            c.checkin(conn);
                        }
                        if let Err(e) = c.release_key(&key).await {
                            tracing::warn!(request_id = %payload.request_id, error = %e, "tcp: cleanup after a refused push failed");
                        }
                        return Err(refused);
                    }
                    Err(e) if conn.reused && !retried && is_dead_connection(&e) => {
                        c.clear_pool();
                        retried = true;
                    }
                    Err(e) => return Err(e),
                }
            }
        };
        let bytes: u64 = metas.iter().map(|m| m.len).sum();
        tracing::debug!(request_id = %payload.request_id, bytes, ms = started.elapsed().as_secs_f64() * 1e3, "tcp: pushed");
        Ok(KvHandle {
            request_id: payload.request_id,
            transport: NAME.into(),
            location: format!("{}#{epoch:016x}", c.addr),
            layout: payload.layout,
            tokens: payload.tokens,
            blobs: metas,
        })
    }

    #[tracing::instrument(name = "kv.pull", skip_all, fields(transport = NAME, request_id = %handle.request_id, bytes = handle.total_bytes()))]
    async fn pull(&self, handle: &KvHandle, timeout: Duration) -> Result<Vec<Bytes>, KvError> {
        check_handle(NAME, handle)?;
        let key = sanitize_key(NAME, &handle.request_id)?;
        if handle.blobs.is_empty() {
            return Ok(Vec::new());
        }
        let (_, epoch) = parse_location(&handle.location);
        let c = &self.inner;
        let started = Instant::now();
        let mut retried = false;
        let blobs = loop {
            let mut conn = c.checkout().await?;
            let remaining = timeout.saturating_sub(started.elapsed());
            let res = tokio::time::timeout(
                remaining + GRACE,
                c.pull_on(&mut conn, handle, &key, epoch, remaining),
            )
            .await
            .unwrap_or_else(|_| {
                Err(KvError::ConnectionLost {
                    transport: NAME,
                    peer: c.addr.clone(),
                    detail: format!("the relay did not answer within {:?}", remaining + GRACE),
                    source: None,
                })
            });
            match res {
                Ok(v) => {
                    c.checkin(conn);
                    break v;
                }
                Err(e) if conn.reused && !retried && is_dead_connection(&e) => {
                    c.clear_pool();
                    retried = true;
                }
                Err(e) => return Err(e),
            }
        };
        if c.log {
            for (i, b) in blobs.iter().enumerate() {
                log_blob("pull", &handle.request_id, i, b);
            }
        }
        tracing::debug!(request_id = %handle.request_id, bytes = handle.total_bytes(), ms = started.elapsed().as_secs_f64() * 1e3, "tcp: pulled");
        Ok(blobs)
    }

    #[tracing::instrument(name = "kv.release", skip_all, fields(transport = NAME, request_id = %handle.request_id))]
    async fn release(&self, handle: &KvHandle) -> Result<(), KvError> {
        check_handle(NAME, handle)?;
        let key = sanitize_key(NAME, &handle.request_id)?;
        self.inner.release_key(&key).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn location_carries_the_epoch() {
        assert_eq!(
            parse_location("10.0.0.1:7070#00000000000000ff"),
            ("10.0.0.1:7070", 255)
        );
        assert_eq!(parse_location("relay:7070"), ("relay:7070", 0));
    }
}
