//! The conformance suite: one function, [`run_all`], that every transport
//! (shm, tcp, later nixl-ucx) must pass. A transport takes part by
//! implementing [`Harness`]: how to make clients, how to count what the
//! backing store holds (the leak counter), how to corrupt a stored blob, and
//! (if it has a server) how to restart it.
//!
//! Checks, in order: byte-exact round trips (blob sizes 0, 1, 4 KiB, 1 MiB and
//! a full 67.1 MB Llama-3.1-8B request), 8 requests in flight, a pull of an
//! unknown handle times out with a clear error, a flipped byte gives a CRC
//! error (never wrong bytes), nothing leaks after release, after the TTL and
//! after a cancelled pull, and a server restart mid-request gives clear errors.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use rngd_kv_wire::{KvHandle, KvLayout};

use crate::{KvError, KvPayload, KvTransport};

/// What the suite needs to know about a transport under test.
#[async_trait::async_trait]
pub trait Harness: Send + Sync {
    /// A new client of the transport; all clients share one backing store
    /// (directory, relay), like a prefill and a decode worker do.
    fn make(&self) -> Arc<dyn KvTransport>;
    /// Objects the backing store holds now (files; relay requests and waiting
    /// GETs). Zero means nothing leaked.
    async fn held(&self) -> Result<usize, KvError>;
    /// Flips one byte of stored blob `index` of a pushed request.
    async fn corrupt(&self, handle: &KvHandle, index: usize) -> Result<(), KvError>;
    /// The TTL the backing store was configured with (keep it short: the
    /// suite waits for it).
    fn ttl(&self) -> Duration;
    /// Restarts the server behind the transport and returns once the new one
    /// accepts connections; `Ok(false)` if the transport has no server (the
    /// restart check is then reported as not applicable).
    async fn restart(&self) -> Result<bool, KvError>;
}

/// A failed check.
#[derive(Debug, thiserror::Error)]
#[error("conformance check `{check}` failed: {detail}")]
pub struct ConformanceError {
    /// Which check.
    pub check: &'static str,
    /// What went wrong.
    pub detail: String,
    /// The transport error behind it, if any.
    #[source]
    pub source: Option<KvError>,
}

/// What the suite checked.
#[derive(Debug, Clone, Default)]
pub struct Report {
    /// Checks that passed, with a short note each.
    pub passed: Vec<(&'static str, String)>,
    /// Checks that do not apply to this transport, with the reason.
    pub not_applicable: Vec<(&'static str, String)>,
}

/// Generous timeout for pulls of data that is there.
const PULL_TIMEOUT: Duration = Duration::from_secs(30);
/// How long leak counters may take to settle (connections closing, …).
const SETTLE: Duration = Duration::from_secs(10);
/// How long a waiting pull may take to show up in `held` (transports whose
/// waiting pulls hold nothing spend this whole time).
const WAITER_VISIBLE: Duration = Duration::from_secs(2);

fn fail(check: &'static str, detail: impl Into<String>) -> ConformanceError {
    ConformanceError {
        check,
        detail: detail.into(),
        source: None,
    }
}

fn failed(check: &'static str, detail: impl Into<String>, e: KvError) -> ConformanceError {
    ConformanceError {
        check,
        detail: format!("{}: {e}", detail.into()),
        source: Some(e),
    }
}

/// Deterministic pseudo-random bytes (xorshift64*), distinct per `seed`.
pub fn pattern(seed: u64, len: usize) -> Bytes {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut v = Vec::with_capacity(len + 8);
    while v.len() < len {
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        v.extend_from_slice(&state.wrapping_mul(0x2545_F491_4F6C_DD1D).to_le_bytes());
    }
    v.truncate(len);
    Bytes::from(v)
}

/// A payload of `count` blobs of `blob_len` bytes (layout: Llama-3.1-8B S=512).
pub fn payload(request_id: &str, seed: u64, count: usize, blob_len: usize) -> KvPayload {
    KvPayload {
        request_id: request_id.to_string(),
        layout: KvLayout::LLAMA31_8B_S512,
        tokens: 17,
        wire: rngd_kv_wire::WIRE_FULL,
        blobs: (0..count)
            .map(|i| pattern(seed.wrapping_mul(1000) + i as u64, blob_len))
            .collect(),
    }
}

/// A full Llama-3.1-8B S=512 request: 64 blobs of 1 MiB (67.1 MB).
pub fn full_request(request_id: &str, seed: u64) -> KvPayload {
    let l = KvLayout::LLAMA31_8B_S512;
    payload(request_id, seed, l.blob_count(), l.blob_bytes())
}

fn unique(tag: &str) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    format!(
        "conf-{tag}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

fn same_bytes(check: &'static str, want: &[Bytes], got: &[Bytes]) -> Result<(), ConformanceError> {
    if want.len() != got.len() {
        return Err(fail(
            check,
            format!("pushed {} blobs, pulled {}", want.len(), got.len()),
        ));
    }
    for (i, (w, g)) in want.iter().zip(got).enumerate() {
        if w != g {
            let first = w.iter().zip(g.iter()).position(|(a, b)| a != b);
            return Err(fail(
                check,
                format!(
                    "blob {i} differs ({} vs {} bytes, first difference at {first:?})",
                    w.len(),
                    g.len()
                ),
            ));
        }
    }
    Ok(())
}

async fn held(h: &dyn Harness, check: &'static str) -> Result<usize, ConformanceError> {
    h.held()
        .await
        .map_err(|e| failed(check, "counting held objects", e))
}

/// Waits until the harness holds nothing (or `limit` passes).
async fn settle_to_zero(
    h: &dyn Harness,
    check: &'static str,
    limit: Duration,
) -> Result<(), ConformanceError> {
    let deadline = Instant::now() + limit;
    loop {
        let n = held(h, check).await?;
        if n == 0 {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(fail(
                check,
                format!("{n} objects still held after {limit:?}"),
            ));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn round_trip(
    h: &dyn Harness,
    check: &'static str,
    p: KvPayload,
) -> Result<(), ConformanceError> {
    let (a, b) = (h.make(), h.make());
    let want = p.blobs.clone();
    let (tokens, wire) = (p.tokens, p.wire);
    let handle = a.push(p).await.map_err(|e| failed(check, "push", e))?;
    if handle.blobs.len() != want.len()
        || handle.transport != a.name()
        || (handle.tokens, handle.wire) != (tokens, wire)
    {
        return Err(fail(check, format!("bad handle {handle:?}")));
    }
    let got = b
        .pull(&handle, PULL_TIMEOUT)
        .await
        .map_err(|e| failed(check, "pull", e))?;
    same_bytes(check, &want, &got)?;
    b.release(&handle)
        .await
        .map_err(|e| failed(check, "release", e))?;
    Ok(())
}

/// Runs every check against the transport behind `h`.
pub async fn run_all(h: &dyn Harness) -> Result<Report, ConformanceError> {
    let mut report = Report::default();
    settle_to_zero(h, "clean start", SETTLE).await?;

    // 1. Byte-exact round trips.
    let check = "byte_exact";
    for (n, len) in [(2, 0), (2, 1), (3, 4096), (4, 1 << 20), (1, 4097)] {
        round_trip(h, check, payload(&unique("exact"), len as u64 + 1, n, len)).await?;
    }
    round_trip(h, check, full_request(&unique("full"), 42)).await?;
    // The trimmed wire of a 100-token prompt: the handle says so.
    let l = KvLayout::LLAMA31_8B_S512;
    let len = l
        .wire_blob_bytes(rngd_kv_wire::WIRE_TRIMMED, 100)
        .map_err(|e| fail(check, e.to_string()))?;
    let mut trimmed = payload(&unique("trimmed"), 43, l.blob_count(), len);
    trimmed.tokens = 100;
    trimmed.wire = rngd_kv_wire::WIRE_TRIMMED;
    round_trip(h, check, trimmed).await?;
    settle_to_zero(h, check, SETTLE).await?;
    report.passed.push((
        check,
        "blob sizes 0, 1, 4 KiB, 4 KiB+1, 1 MiB, a 67.1 MB request, and a \
         100-token request in the trimmed wire (its version in the handle)"
            .into(),
    ));

    // 2. Eight requests in flight.
    let check = "in_flight_8";
    let mut tasks = Vec::new();
    for r in 0..8u64 {
        let (a, b) = (h.make(), h.make());
        let p = payload(&unique("flight"), 100 + r, 16, 1 << 20);
        tasks.push(tokio::spawn(async move {
            let want = p.blobs.clone();
            let handle = a.push(p).await.map_err(|e| e.to_string())?;
            let got = b
                .pull(&handle, PULL_TIMEOUT)
                .await
                .map_err(|e| e.to_string())?;
            Ok::<_, String>((want, got, handle, b))
        }));
    }
    for t in tasks {
        let (want, got, handle, b) = t
            .await
            .map_err(|e| fail(check, e.to_string()))?
            .map_err(|e| fail(check, e))?;
        same_bytes(check, &want, &got)?;
        b.release(&handle)
            .await
            .map_err(|e| failed(check, "release", e))?;
    }
    settle_to_zero(h, check, SETTLE).await?;
    report
        .passed
        .push((check, "8 concurrent requests of 16 MiB, byte-exact".into()));

    // 3. Unknown handle: times out, clear error, no hang.
    let check = "unknown_times_out";
    let a = h.make();
    let mut ghost = a
        .push(payload(&unique("ghost"), 7, 2, 64))
        .await
        .map_err(|e| failed(check, "push", e))?;
    a.release(&ghost)
        .await
        .map_err(|e| failed(check, "release", e))?;
    ghost.request_id = unique("never-pushed");
    let timeout = Duration::from_millis(300);
    let started = Instant::now();
    let res = tokio::time::timeout(timeout + Duration::from_secs(10), a.pull(&ghost, timeout))
        .await
        .map_err(|_| fail(check, "pull of an unknown handle hung"))?;
    let waited = started.elapsed();
    match res {
        Err(e @ KvError::NotFound { .. }) => {
            let msg = e.to_string();
            if !msg.contains(&ghost.request_id) || !msg.contains(a.name()) {
                return Err(fail(
                    check,
                    format!("error does not name request and transport: {msg}"),
                ));
            }
            if waited < timeout {
                return Err(fail(
                    check,
                    format!("gave up after {waited:?} < {timeout:?}"),
                ));
            }
        }
        Err(e) => return Err(failed(check, "expected NotFound", e)),
        Ok(_) => return Err(fail(check, "pull of an unknown handle returned data")),
    }
    settle_to_zero(h, check, SETTLE).await?;
    report.passed.push((
        check,
        format!("NotFound after {waited:?} (timeout {timeout:?})"),
    ));

    // 3b. Published KV: pulled whole when held; when gone (released), a
    // NotFound at once, whatever the timeout.
    let check = "published_gone_at_once";
    let (a, b) = (h.make(), h.make());
    let p = payload(&unique("published"), 11, 3, 4096);
    let want = p.blobs.clone();
    let handle = a.push(p).await.map_err(|e| failed(check, "push", e))?;
    let got = b
        .pull_published(&handle, PULL_TIMEOUT)
        .await
        .map_err(|e| failed(check, "pull_published", e))?;
    same_bytes(check, &want, &got)?;
    b.release(&handle)
        .await
        .map_err(|e| failed(check, "release", e))?;
    let started = Instant::now();
    let res = tokio::time::timeout(
        Duration::from_secs(10),
        b.pull_published(&handle, PULL_TIMEOUT),
    )
    .await
    .map_err(|_| fail(check, "pull_published of released KV hung"))?;
    let waited = started.elapsed();
    match res {
        Err(KvError::NotFound { .. }) if waited < Duration::from_secs(2) => {}
        Err(KvError::NotFound { .. }) => {
            return Err(fail(
                check,
                format!("released KV refused only after {waited:?}"),
            ));
        }
        Err(e) => return Err(failed(check, "expected NotFound", e)),
        Ok(_) => return Err(fail(check, "released KV was delivered")),
    }
    settle_to_zero(h, check, SETTLE).await?;
    report.passed.push((
        check,
        format!("held KV pulled; released KV refused after {waited:?} (timeout {PULL_TIMEOUT:?})"),
    ));

    // 4. A flipped byte is a CRC error, never wrong bytes.
    let check = "flipped_byte";
    let (a, b) = (h.make(), h.make());
    let handle = a
        .push(payload(&unique("crc"), 9, 3, 4096))
        .await
        .map_err(|e| failed(check, "push", e))?;
    h.corrupt(&handle, 1)
        .await
        .map_err(|e| failed(check, "corrupting", e))?;
    match b.pull(&handle, PULL_TIMEOUT).await {
        Err(KvError::Crc { .. }) => {}
        Err(e) => return Err(failed(check, "expected a CRC error", e)),
        Ok(_) => return Err(fail(check, "corrupt blob was delivered")),
    }
    b.release(&handle)
        .await
        .map_err(|e| failed(check, "release", e))?;
    // The same through the handle: a CRC that does not match the bytes.
    let mut handle = a
        .push(payload(&unique("crc"), 10, 2, 4096))
        .await
        .map_err(|e| failed(check, "push", e))?;
    handle.blobs[0].crc32 ^= 0x0000_0100;
    match b.pull(&handle, PULL_TIMEOUT).await {
        Err(KvError::Crc { .. }) => {}
        Err(e) => return Err(failed(check, "expected a CRC error (handle)", e)),
        Ok(_) => return Err(fail(check, "blob with a wrong CRC was delivered")),
    }
    b.release(&handle)
        .await
        .map_err(|e| failed(check, "release", e))?;
    settle_to_zero(h, check, SETTLE).await?;
    report
        .passed
        .push((check, "stored byte and handle CRC both caught".into()));

    // 5. Release frees, is idempotent, and a released request is gone.
    let check = "release";
    let handle = a
        .push(payload(&unique("rel"), 11, 4, 1000))
        .await
        .map_err(|e| failed(check, "push", e))?;
    if held(h, check).await? == 0 {
        return Err(fail(check, "nothing held after a push"));
    }
    a.release(&handle)
        .await
        .map_err(|e| failed(check, "release", e))?;
    settle_to_zero(h, check, SETTLE).await?;
    a.release(&handle)
        .await
        .map_err(|e| failed(check, "second release", e))?;
    match b.pull(&handle, Duration::from_millis(100)).await {
        Err(KvError::NotFound { .. }) => {}
        Err(e) => return Err(failed(check, "expected NotFound after release", e)),
        Ok(_) => return Err(fail(check, "released request still delivered")),
    }
    settle_to_zero(h, check, SETTLE).await?;
    report
        .passed
        .push((check, "zero held after release; idempotent".into()));

    // 6. TTL: what nobody pulls disappears.
    let check = "ttl";
    let started = Instant::now();
    let handle = a
        .push(payload(&unique("ttl"), 12, 2, 1000))
        .await
        .map_err(|e| failed(check, "push", e))?;
    if held(h, check).await? == 0 {
        return Err(fail(check, "nothing held after a push"));
    }
    settle_to_zero(h, check, h.ttl() + SETTLE).await?;
    let took = started.elapsed();
    if took < h.ttl() {
        return Err(fail(
            check,
            format!("removed after {took:?}, before the TTL"),
        ));
    }
    match b.pull(&handle, Duration::from_millis(100)).await {
        Err(KvError::NotFound { .. }) => {}
        Err(e) => return Err(failed(check, "expected NotFound after the TTL", e)),
        Ok(_) => return Err(fail(check, "expired request still delivered")),
    }
    report
        .passed
        .push((check, format!("expired after {took:?} (ttl {:?})", h.ttl())));

    // 7. A cancelled pull leaks nothing.
    let check = "cancelled_pull";
    let mut pending = a
        .push(payload(&unique("cancel"), 13, 2, 1000))
        .await
        .map_err(|e| failed(check, "push", e))?;
    a.release(&pending)
        .await
        .map_err(|e| failed(check, "release", e))?;
    pending.request_id = unique("cancel-late");
    let c = h.make();
    let p2 = pending.clone();
    let task = tokio::spawn(async move { c.pull(&p2, PULL_TIMEOUT).await });
    // Let the pull start waiting (visible in `held` where a waiting pull
    // holds something, as in the relay), then cancel it.
    let deadline = Instant::now() + WAITER_VISIBLE;
    while held(h, check).await? == 0 && Instant::now() < deadline && !task.is_finished() {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    task.abort();
    let _ = task.await;
    settle_to_zero(h, check, SETTLE).await?;
    // And a pull cancelled while data is there.
    let handle = a
        .push(full_request(&unique("cancel-full"), 14))
        .await
        .map_err(|e| failed(check, "push", e))?;
    let c = h.make();
    let h2 = handle.clone();
    let task = tokio::spawn(async move { c.pull(&h2, PULL_TIMEOUT).await });
    tokio::task::yield_now().await;
    task.abort();
    let _ = task.await;
    a.release(&handle)
        .await
        .map_err(|e| failed(check, "release", e))?;
    settle_to_zero(h, check, SETTLE).await?;
    report.passed.push((
        check,
        "zero held after cancelling a waiting and a transferring pull".into(),
    ));

    // 8. Server restart mid-request.
    let check = "restart";
    let before = a
        .push(payload(&unique("restart"), 15, 4, 1 << 16))
        .await
        .map_err(|e| failed(check, "push", e))?;
    let mut waiting = before.clone();
    waiting.request_id = unique("restart-wait");
    let c = h.make();
    let w2 = waiting.clone();
    let waiter = tokio::spawn(async move {
        let started = Instant::now();
        (c.pull(&w2, PULL_TIMEOUT).await, started.elapsed())
    });
    let base = held(h, check).await?;
    let deadline = Instant::now() + WAITER_VISIBLE;
    while held(h, check).await? <= base && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let restarted = h
        .restart()
        .await
        .map_err(|e| failed(check, "restarting the server", e))?;
    if !restarted {
        waiter.abort();
        let _ = waiter.await;
        a.release(&before)
            .await
            .map_err(|e| failed(check, "release", e))?;
        settle_to_zero(h, check, SETTLE).await?;
        report
            .not_applicable
            .push((check, "the transport has no server to restart".into()));
        return Ok(report);
    }
    let (res, waited) = waiter.await.map_err(|e| fail(check, e.to_string()))?;
    match res {
        Err(KvError::ConnectionLost { .. }) if waited < PULL_TIMEOUT / 2 => {}
        Err(e) => return Err(failed(check, format!("waiting pull after {waited:?}"), e)),
        Ok(_) => {
            return Err(fail(
                check,
                "a pull of a never-pushed request returned data",
            ));
        }
    }
    let started = Instant::now();
    match b.pull(&before, PULL_TIMEOUT).await {
        Err(KvError::ConnectionLost { .. }) if started.elapsed() < PULL_TIMEOUT / 2 => {}
        Err(e) => return Err(failed(check, "pull of a request lost in the restart", e)),
        Ok(_) => return Err(fail(check, "a request lost in the restart was delivered")),
    }
    // The transport recovers: a new request works on the same clients.
    let p = payload(&unique("after"), 16, 4, 1 << 16);
    let want = p.blobs.clone();
    let handle = a
        .push(p)
        .await
        .map_err(|e| failed(check, "push after restart", e))?;
    let got = b
        .pull(&handle, PULL_TIMEOUT)
        .await
        .map_err(|e| failed(check, "pull after restart", e))?;
    same_bytes(check, &want, &got)?;
    b.release(&handle)
        .await
        .map_err(|e| failed(check, "release", e))?;
    settle_to_zero(h, check, SETTLE).await?;
    report.passed.push((
        check,
        format!("waiting pull failed after {waited:?}; lost request reported; clients recovered"),
    ));
    Ok(report)
}
