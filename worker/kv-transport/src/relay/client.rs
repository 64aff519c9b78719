//! The client side of the relay protocol: a pool of connections to one
//! relay, the handshake that authenticates each new connection (the shared
//! secret, [`crate::frame`]; in `client/handshake.rs`), and the
//! request/reply exchanges (PUT, GET, DEL, STATS) on a connection (replies
//! read and ERR codes mapped to errors in `client/reply.rs`). The [`crate::tcp`] transport drives it (and
//! puts its deadlines on them); it speaks [`crate::frame`] and knows
//! nothing of the server.

use std::io;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use rngd_kv_wire::{BlobMeta, KvHandle, WireError};
use sha2::{Digest, Sha256};
use std::os::fd::AsFd;

use tokio::io::{AsyncRead, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::TcpStream;

use super::preauth::PREAUTH_CLOSED;
use super::tls::{BoxRead, BoxWrite, ClientTls, TlsFailure, client_failure, split_plain};
use crate::KvError;
use crate::frame::{
    FLAG_CRC, Header, IO_BUF, Op, RelayStats, Secret, TRANSPORT as NAME, read_body, read_body_crc,
};

mod handshake;
mod reply;

pub use handshake::authenticate;
use handshake::handshake;
use reply::read_reply;

/// Idle connections kept per transport.
pub const MAX_IDLE: usize = 16;
/// How long connecting to the relay, handshake included, may take (at most;
/// a shorter operation deadline shortens it).
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// A client of one relay: its address, settings and idle connections.
pub(crate) struct Client {
    /// The relay's `host:port`.
    pub(crate) addr: String,
    /// Send and check CRC-32s.
    pub(crate) crc: bool,
    /// Log size and SHA-256 of every blob.
    pub(crate) log: bool,
    /// The shared secret (`None`: the relay must not check one).
    secret: Option<Secret>,
    /// TLS of the connections (`None`: plaintext).
    tls: Option<ClientTls>,
    /// Deadline of push, release and STATS (the transport applies it).
    pub(crate) timeout: Duration,
    idle: Mutex<Vec<Conn>>,
    seq: AtomicU32,
}

/// A push the relay refused (an ERR reply), and whether the connection it
/// came on can be used again.
pub(crate) struct Refused {
    /// The refusal.
    pub(crate) error: KvError,
    /// Whether the connection can go back to the pool.
    pub(crate) usable: bool,
}

/// One connection to the relay.
pub(crate) struct Conn {
    rd: BufReader<BoxRead>,
    wr: BufWriter<BoxWrite>,
    /// A second handle on the socket, to see (without reading) whether the
    /// relay closed it while it was idle in the pool (under TLS the halves
    /// cannot look at the socket).
    probe: Option<std::net::TcpStream>,
    /// It came from the pool (so it may have died while idle).
    pub(crate) reused: bool,
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
pub(crate) fn is_dead_connection(e: &KvError) -> bool {
    matches!(
        e,
        KvError::ConnectionLost {
            source: Some(_),
            ..
        }
    )
}

/// Whether the relay closed our handshake over its pre-auth cap (its ERR
/// `Capacity` says [`PREAUTH_CLOSED`]): worth a fresh connection, unlike
/// the authenticated connection cap.
fn is_preauth_closed(e: &KvError) -> bool {
    matches!(e, KvError::Capacity { detail, .. } if detail.starts_with(PREAUTH_CLOSED))
}

/// What a client sees of a relay that closes a socket before TLS is up
/// (its pre-auth or connection cap: it cannot send a TLS client a
/// plaintext reason).
const TLS_CLOSED: &str = "the relay closed the connection during the TLS handshake";

/// Whether the relay closed our socket before TLS was up (worth a fresh
/// connection within the connect deadline, like [`is_preauth_closed`]).
fn is_tls_closed(e: &KvError) -> bool {
    matches!(e, KvError::ConnectionLost { detail, source: None, .. } if detail.starts_with(TLS_CLOSED))
}

/// The error of a failed TLS handshake with the relay at `peer`.
fn tls_error(peer: &str, e: io::Error) -> KvError {
    match client_failure(&e) {
        TlsFailure::Untrusted => KvError::Unauthorized {
            transport: NAME,
            peer: peer.to_string(),
            detail: format!(
                "the relay's TLS key is not the trusted one ({e}): a relay with another \
                 secret or certificate, or someone in between"
            ),
        },
        TlsFailure::NotTls => KvError::Protocol {
            transport: NAME,
            peer: peer.to_string(),
            detail: format!(
                "the relay does not speak TLS ({e}); it runs with --tls off while this \
                 client uses TLS (set {}=off here, or turn TLS on at the relay)",
                rngd_api::env::AIRM_KV_TCP_TLS
            ),
        },
        TlsFailure::Io => KvError::ConnectionLost {
            transport: NAME,
            peer: peer.to_string(),
            detail: format!(
                "{TLS_CLOSED} ({e}; it may be at its connection cap, or not expect TLS)"
            ),
            source: None,
        },
    }
}

/// Logs size and SHA-256 of a blob (`AIRM_KV_TCP_LOG=1`).
pub(crate) fn log_blob(dir: &str, request_id: &str, index: usize, blob: &[u8]) {
    let digest = Sha256::digest(blob);
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    tracing::info!(dir, request_id, index, bytes = blob.len(), sha256 = %hex, "tcp: KV blob");
}

// === impl Client ===

impl Client {
    /// A client of the relay at `addr`; nothing is connected until the first operation.
    pub(crate) fn new(
        addr: String,
        crc: bool,
        log: bool,
        secret: Option<Secret>,
        tls: Option<ClientTls>,
        timeout: Duration,
    ) -> Client {
        Client {
            addr,
            crc,
            log,
            secret,
            tls,
            timeout,
            idle: Mutex::new(Vec::new()),
            seq: AtomicU32::new(1),
        }
    }

    /// Idle pooled connections.
    pub(crate) fn idle_count(&self) -> usize {
        self.idle.lock().expect("pool poisoned").len()
    }

    fn next_seq(&self) -> u32 {
        self.seq.fetch_add(1, Ordering::Relaxed)
    }

    pub(crate) async fn checkout(&self) -> Result<Conn, KvError> {
        loop {
            let pooled = self.idle.lock().expect("pool poisoned").pop();
            let Some(conn) = pooled else { break };
            // A pooled connection must have nothing to read: data or EOF means
            // the relay closed it (restart, shutdown).
            if !conn.rd.buffer().is_empty() {
                continue;
            }
            let Some(probe) = &conn.probe else {
                // Cannot look: use it (a dead one is retried on a fresh one).
                return Ok(conn);
            };
            match probe.peek(&mut [0u8; 1]) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(conn),
                _ => continue,
            }
        }
        let limit = CONNECT_TIMEOUT.min(self.timeout);
        let started = Instant::now();
        // A handshake closed over the relay's pre-auth cap (a flood of
        // silent sockets took the places while ours waited for its HELLO)
        // is tried again on a fresh connection, with a short backoff,
        // within the same connect deadline.
        let mut backoff = Duration::from_millis(5);
        loop {
            match self.connect_once(limit, started).await {
                Err(e)
                    if (is_preauth_closed(&e) || is_tls_closed(&e))
                        && started.elapsed() + backoff < limit =>
                {
                    tracing::debug!(peer = %self.addr, "tcp: handshake closed over the relay's pre-auth cap; trying again");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_millis(100));
                }
                res => return res,
            }
        }
    }

    /// One connection and its handshake, within `limit` of `started`.
    async fn connect_once(&self, limit: Duration, started: Instant) -> Result<Conn, KvError> {
        let left = limit.saturating_sub(started.elapsed());
        let stream = tokio::time::timeout(left, TcpStream::connect(&self.addr))
            .await
            .map_err(|_| KvError::ConnectionLost {
                transport: NAME,
                peer: self.addr.clone(),
                detail: format!("connect timed out after {limit:?}"),
                source: None,
            })?
            .map_err(|e| KvError::ConnectionLost {
                transport: NAME,
                peer: self.addr.clone(),
                detail: format!("cannot connect to the KV relay: {e}"),
                source: None,
            })?;
        let _ = stream.set_nodelay(true);
        // The duplicate shares the socket's non-blocking mode: a peek on it
        // never waits.
        let probe = stream
            .as_fd()
            .try_clone_to_owned()
            .ok()
            .map(std::net::TcpStream::from);
        let (rd, wr) = match &self.tls {
            None => split_plain(stream),
            Some(tls) => {
                let left = limit.saturating_sub(started.elapsed());
                tokio::time::timeout(left, tls.connect(&self.addr, stream))
                    .await
                    .map_err(|_| KvError::Timeout {
                        transport: NAME,
                        peer: self.addr.clone(),
                        op: "TLS handshake",
                        after: limit,
                    })?
                    .map_err(|e| tls_error(&self.addr, e))?
            }
        };
        let mut conn = Conn {
            rd: BufReader::with_capacity(IO_BUF, rd),
            wr: BufWriter::with_capacity(IO_BUF, wr),
            probe,
            reused: false,
        };
        let left = limit.saturating_sub(started.elapsed());
        let Conn { rd, wr, .. } = &mut conn;
        tokio::time::timeout(left, handshake(rd, wr, &self.addr, self.secret.as_ref()))
            .await
            .map_err(|_| KvError::Timeout {
                transport: NAME,
                peer: self.addr.clone(),
                op: "handshake",
                after: limit,
            })??;
        Ok(conn)
    }

    pub(crate) fn checkin(&self, mut conn: Conn) {
        conn.reused = true;
        let mut idle = self.idle.lock().expect("pool poisoned");
        if idle.len() < MAX_IDLE {
            idle.push(conn);
        }
    }

    pub(crate) fn clear_pool(&self) {
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

    /// Reads one reply header ([`read_reply`]).
    async fn read_reply<R: AsyncRead + Unpin>(
        &self,
        rd: &mut R,
        request_id: &str,
        waited_since: Instant,
    ) -> Result<Result<Header, KvError>, KvError> {
        read_reply(rd, &self.addr, request_id, waited_since).await
    }

    pub(crate) async fn stats_on(&self, conn: &mut Conn) -> Result<RelayStats, KvError> {
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
    pub(crate) async fn push_on(
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

    pub(crate) async fn pull_on(
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

    pub(crate) async fn release_key(&self, key: &str) -> Result<(), KvError> {
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
