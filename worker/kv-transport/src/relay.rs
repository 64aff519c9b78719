//! The KV relay of the `tcp` transport (`rngd-pd relay`).
//!
//! The relay keeps blobs in memory keyed by `(request key, blob index)`:
//! PUT stores (checking the CRC-32 and the memory cap), GET waits until the
//! blob is there (bounded by the wait in the frame), DEL drops a request,
//! STATS reports counters. Blobs nobody deletes expire after the TTL. A
//! malformed or oversize frame closes that connection only. Each relay process
//! has a random epoch; requests that name another epoch (the cache was pushed
//! to an earlier process) get a clear `Restarted` error instead of a wait.
//!
//! Per connection, a reader task handles frames in order and a writer task
//! sends replies; GETs wait in their own tasks, so one connection carries many
//! requests at once. Replies carry the request's `seq`.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use rngd_api::env;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpListener;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::{Notify, mpsc};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::frame::{ErrCode, FLAG_CRC, HEADER_LEN, Header, Op};
use crate::{KvError, MAX_KEY_LEN};

const NAME: &str = "tcp";
/// Longest wait a GET may ask for.
pub const MAX_WAIT: Duration = Duration::from_secs(600);

/// Relay settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RelayConfig {
    /// Address the relay was asked to listen on (informational; [`serve`] takes a bound listener).
    pub listen: String,
    /// Lifetime of a request's blobs that nobody deletes.
    pub ttl: Duration,
    /// Memory cap: bytes of blobs held at once.
    pub max_bytes: u64,
    /// Largest blob accepted in one frame.
    pub max_frame: u64,
}

impl Default for RelayConfig {
    fn default() -> Self {
        RelayConfig {
            listen: "0.0.0.0:7070".into(),
            ttl: Duration::from_secs(60),
            max_bytes: 4 << 30,
            max_frame: 64 << 20,
        }
    }
}

/// Flags of `rngd-pd relay` (each also read from the environment).
#[derive(Debug, Clone, clap::Args)]
pub struct RelayArgs {
    /// Listen address, `HOST:PORT` (port 0 picks a free one; the bound address is logged and printed).
    #[arg(long, env = env::AIRM_KV_RELAY_LISTEN, default_value = "0.0.0.0:7070")]
    pub listen: String,
    /// Seconds an unread request's blobs live.
    #[arg(long = "ttl-s", env = env::AIRM_KV_TCP_TTL_S, default_value_t = 60.0)]
    pub ttl_s: f64,
    /// Memory cap in bytes.
    #[arg(long = "max-bytes", env = env::AIRM_KV_RELAY_MAX_BYTES, default_value_t = 4 << 30)]
    pub max_bytes: u64,
    /// Largest blob (frame body) accepted, bytes.
    #[arg(long = "max-frame", env = env::AIRM_KV_RELAY_MAX_FRAME, default_value_t = 64 << 20)]
    pub max_frame: u64,
}

impl RelayArgs {
    /// The [`RelayConfig`] these flags describe.
    pub fn config(&self) -> Result<RelayConfig, KvError> {
        let ttl = crate::config::parse_secs("--ttl-s", &self.ttl_s.to_string())?;
        if self.max_frame == 0 || self.max_bytes == 0 {
            return Err(KvError::Config {
                detail: "--max-bytes and --max-frame must be positive".into(),
            });
        }
        Ok(RelayConfig {
            listen: self.listen.clone(),
            ttl,
            max_bytes: self.max_bytes,
            max_frame: self.max_frame,
        })
    }
}

/// Runs the relay until Ctrl-C / SIGTERM: binds `--listen`, prints
/// `relay listening on ADDR` to stdout, serves.
pub async fn run(args: RelayArgs) -> Result<(), KvError> {
    let cfg = args.config()?;
    let listener = TcpListener::bind(&cfg.listen)
        .await
        .map_err(|source| KvError::Io {
            transport: NAME,
            context: format!("binding relay to {}", cfg.listen),
            source,
        })?;
    let addr = listener.local_addr().map_err(|source| KvError::Io {
        transport: NAME,
        context: "reading the relay's bound address".into(),
        source,
    })?;
    println!("relay listening on {addr}");
    tracing::info!(%addr, ttl = ?cfg.ttl, max_bytes = cfg.max_bytes, max_frame = cfg.max_frame, "KV relay listening");
    serve(listener, cfg, shutdown_signal()).await
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = ctrl_c => {}
                _ = term.recv() => {}
            }
        }
        Err(_) => {
            let _ = ctrl_c.await;
        }
    }
}

/// Relay counters (the STATS reply).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RelayStats {
    /// This relay process's epoch.
    pub epoch: u64,
    /// Requests with at least one blob held.
    pub keys: usize,
    /// Blobs held.
    pub blobs: usize,
    /// Bytes held (and reserved by PUTs being received).
    pub bytes: u64,
    /// GETs waiting for a blob.
    pub waiters: usize,
    /// Open client connections.
    pub connections: usize,
    /// PUT bodies being received right now.
    pub puts_in_progress: usize,
    /// Requests expired by the TTL so far.
    pub expired: u64,
}

/// A stored blob and the CRC-32 it was PUT with (`None`: sent without one).
type Stored = (Bytes, Option<u32>);

struct Slot {
    blobs: HashMap<u32, Stored>,
    created: Instant,
}

struct Relay {
    epoch: u64,
    cfg: RelayConfig,
    store: Mutex<HashMap<String, Slot>>,
    used: AtomicU64,
    arrived: Notify,
    waiters: AtomicUsize,
    connections: AtomicUsize,
    puts_in_progress: AtomicUsize,
    expired: AtomicU64,
}

/// Decrements a gauge when dropped.
struct Gauge<'a>(&'a AtomicUsize);

impl<'a> Gauge<'a> {
    fn up(g: &'a AtomicUsize) -> Gauge<'a> {
        g.fetch_add(1, Ordering::SeqCst);
        Gauge(g)
    }
}

impl Drop for Gauge<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

fn new_epoch() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos(),
    );
    h.write_u32(std::process::id());
    h.finish() | 1
}

impl Relay {
    fn stats(&self) -> RelayStats {
        let store = self.store.lock().expect("relay store poisoned");
        RelayStats {
            epoch: self.epoch,
            keys: store.len(),
            blobs: store.values().map(|s| s.blobs.len()).sum(),
            bytes: self.used.load(Ordering::SeqCst),
            waiters: self.waiters.load(Ordering::SeqCst),
            connections: self.connections.load(Ordering::SeqCst),
            puts_in_progress: self.puts_in_progress.load(Ordering::SeqCst),
            expired: self.expired.load(Ordering::SeqCst),
        }
    }

    /// Reserves `n` bytes under the memory cap.
    fn reserve(&self, n: u64) -> bool {
        let mut cur = self.used.load(Ordering::SeqCst);
        loop {
            if cur.saturating_add(n) > self.cfg.max_bytes {
                return false;
            }
            match self
                .used
                .compare_exchange(cur, cur + n, Ordering::SeqCst, Ordering::SeqCst)
            {
                Ok(_) => return true,
                Err(actual) => cur = actual,
            }
        }
    }

    fn unreserve(&self, n: u64) {
        self.used.fetch_sub(n, Ordering::SeqCst);
    }

    fn insert(&self, key: String, index: u32, blob: Stored) {
        let old = {
            let mut store = self.store.lock().expect("relay store poisoned");
            let slot = store.entry(key).or_insert_with(|| Slot {
                blobs: HashMap::new(),
                created: Instant::now(),
            });
            slot.blobs.insert(index, blob)
        };
        if let Some((old, _)) = old {
            self.unreserve(old.len() as u64);
        }
        self.arrived.notify_waiters();
    }

    fn lookup(&self, key: &str, index: u32) -> Option<Stored> {
        let store = self.store.lock().expect("relay store poisoned");
        store.get(key).and_then(|s| s.blobs.get(&index).cloned())
    }

    fn remove(&self, key: &str) -> usize {
        let slot = self.store.lock().expect("relay store poisoned").remove(key);
        match slot {
            Some(slot) => {
                let bytes: u64 = slot.blobs.values().map(|b| b.0.len() as u64).sum();
                self.unreserve(bytes);
                slot.blobs.len()
            }
            None => 0,
        }
    }

    fn expire(&self) {
        let now = Instant::now();
        let gone: Vec<(String, Slot)> = {
            let mut store = self.store.lock().expect("relay store poisoned");
            let keys: Vec<String> = store
                .iter()
                .filter(|(_, s)| now.duration_since(s.created) >= self.cfg.ttl)
                .map(|(k, _)| k.clone())
                .collect();
            keys.into_iter()
                .filter_map(|k| store.remove(&k).map(|s| (k, s)))
                .collect()
        };
        for (key, slot) in gone {
            let bytes: u64 = slot.blobs.values().map(|b| b.0.len() as u64).sum();
            self.unreserve(bytes);
            self.expired.fetch_add(1, Ordering::SeqCst);
            tracing::info!(key, bytes, "relay: expired unread KV cache");
        }
    }

    /// Waits for blob `index` of `key` until `deadline`, or until `cancel`.
    async fn wait_for(
        &self,
        key: &str,
        index: u32,
        deadline: tokio::time::Instant,
        cancel: &CancellationToken,
    ) -> Option<Stored> {
        let _g = Gauge::up(&self.waiters);
        loop {
            let notified = self.arrived.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(b) = self.lookup(key, index) {
                return Some(b);
            }
            tokio::select! {
                _ = &mut notified => {}
                _ = tokio::time::sleep_until(deadline) => return None,
                _ = cancel.cancelled() => return None,
            }
        }
    }
}

/// Serves the relay protocol on `listener` until `shutdown` completes; then
/// closes every connection and returns once they are all gone.
pub async fn serve(
    listener: TcpListener,
    cfg: RelayConfig,
    shutdown: impl Future<Output = ()>,
) -> Result<(), KvError> {
    let relay = Arc::new(Relay {
        epoch: new_epoch(),
        store: Mutex::new(HashMap::new()),
        used: AtomicU64::new(0),
        arrived: Notify::new(),
        waiters: AtomicUsize::new(0),
        connections: AtomicUsize::new(0),
        puts_in_progress: AtomicUsize::new(0),
        expired: AtomicU64::new(0),
        cfg,
    });
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
    let mut rd = BufReader::with_capacity(crate::tcp::IO_BUF, rd);
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
    let mut wr = tokio::io::BufWriter::with_capacity(crate::tcp::IO_BUF, wr);
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

/// Reads exactly `n` bytes into a fresh buffer without zero-filling it first.
pub(crate) async fn read_body<R: tokio::io::AsyncRead + Unpin>(
    rd: &mut R,
    n: usize,
) -> std::io::Result<Bytes> {
    Ok(read_body_crc(rd, n, false).await?.0)
}

/// Like [`read_body`], and with `crc` computes the CRC-32 chunk by chunk as
/// the bytes arrive (while they are still in cache).
pub(crate) async fn read_body_crc<R: tokio::io::AsyncRead + Unpin>(
    rd: &mut R,
    n: usize,
    crc: bool,
) -> std::io::Result<(Bytes, Option<u32>)> {
    let mut buf = BytesMut::with_capacity(n);
    let mut hasher = crc.then(rngd_kv_wire::Crc32::new);
    while buf.len() < n {
        let start = buf.len();
        let want = n - start;
        let got = (&mut *rd).take(want as u64).read_buf(&mut buf).await?;
        if got == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        if let Some(h) = hasher.as_mut() {
            h.update(&buf[start..]);
        }
    }
    Ok((buf.freeze(), hasher.map(rngd_kv_wire::Crc32::finish)))
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
