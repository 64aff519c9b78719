//! The relay's pre-auth budget and its rate-limited warnings.
//!
//! [`PreAuth`] keeps the sockets that have not passed the handshake yet, in
//! arrival order, under their own small cap (`--max-handshakes`), apart
//! from the authenticated connections: a socket counts against the
//! connection cap only once its handshake has passed. One more socket over
//! the cap closes the *oldest silent* one: one that has sent no byte yet
//! (checked on its socket, so bytes not read yet count) or whose handshake
//! already failed. A socket whose AUTH has started arriving is never closed
//! for a silent one; when every socket in the pool has sent bytes, the new
//! one is refused instead. The scan is linear in the cap (small). It also
//! counts the failed handshakes by [`Failure`] reason (STATS
//! `handshake_failures`).
//!
//! [`WarnLimit`] writes at most one WARN line per interval for failures a
//! peer can cause at will (failed handshakes, failed accepts); the ones held
//! back are counted and summarised in the next line.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// How the ERR `Capacity` of a socket closed over the pre-auth cap begins
/// (the client tries such a handshake again on a fresh connection).
pub(super) const PREAUTH_CLOSED: &str = "closed in the handshake";

/// Why a socket did not pass the handshake (the `reason` label of STATS
/// `handshake_failures`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Failure {
    /// A wrong secret or an answer that is not an AUTH.
    Refused,
    /// No answer within the handshake deadline.
    Timeout,
    /// Closed over the pre-auth cap: the oldest silent socket, or the new
    /// one when no socket in the pool is silent.
    Evicted,
}

impl Failure {
    const ALL: [Failure; 3] = [Failure::Refused, Failure::Timeout, Failure::Evicted];

    /// The kind of warning it is logged as.
    pub(super) fn warning(self) -> &'static str {
        match self {
            Failure::Refused => "handshake refused",
            Failure::Timeout => "no handshake answer in time",
            Failure::Evicted => "closed in the handshake over the pre-auth cap",
        }
    }

    /// The label value.
    pub(super) fn as_str(self) -> &'static str {
        match self {
            Failure::Refused => "refused",
            Failure::Timeout => "timeout",
            Failure::Evicted => "evicted",
        }
    }
}

/// A socket in the handshake: who, the token that closes it, whether its
/// handshake already failed (it is being refused: closing it early is no
/// new failure), whether it has sent bytes, and a second handle on its
/// socket to look for bytes not read yet (dropped once it spoke).
struct Waiting {
    peer: SocketAddr,
    evict: CancellationToken,
    failed: bool,
    spoke: bool,
    probe: Option<std::net::TcpStream>,
}

impl Waiting {
    /// Whether it may be closed for a new socket: its handshake failed, or
    /// it has sent nothing (no bytes waiting on its socket either).
    fn evictable(&mut self) -> bool {
        if self.failed {
            return true;
        }
        if self.spoke {
            return false;
        }
        let mut byte = [0u8; 1];
        // The socket is non-blocking: WouldBlock is "nothing sent yet";
        // EOF or an error is a socket gone, silent too.
        if let Some(Ok(n)) = self.probe.as_ref().map(|p| p.peek(&mut byte))
            && n > 0
        {
            self.spoke = true;
            self.probe = None;
            return false;
        }
        true
    }
}

/// The sockets in the handshake, oldest first, under their cap.
pub(super) struct PreAuth {
    cap: usize,
    open: Mutex<Open>,
    failures: [AtomicU64; Failure::ALL.len()],
}

#[derive(Default)]
struct Open {
    next: u64,
    by_age: BTreeMap<u64, Waiting>,
}

/// A socket [`PreAuth::admit`] took in.
pub(super) struct Admitted {
    /// Its place in the pool (for [`Slot::adopt`]).
    pub(super) id: u64,
    /// Cancelled when it is evicted.
    pub(super) evict: CancellationToken,
    /// The peer of the oldest silent socket, closed to make room (unless
    /// that one had failed its handshake already).
    pub(super) evicted: Option<SocketAddr>,
}

/// [`PreAuth::admit`] refused a new socket: the pool is at its cap and
/// every socket in it has sent bytes.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Full;

impl PreAuth {
    /// An empty pool of at most `cap` sockets.
    pub(super) fn new(cap: usize) -> PreAuth {
        PreAuth {
            cap,
            open: Mutex::new(Open::default()),
            failures: Default::default(),
        }
    }

    /// Takes a new socket in (`probe`: a second handle on it, to look for
    /// bytes not read yet); over the cap, evicts the oldest silent one
    /// (cancels its token) and, unless it was already being refused, counts
    /// it as [`Failure::Evicted`] and says whose it was. When no socket in
    /// the pool is silent, refuses the new one ([`Full`], counted as
    /// [`Failure::Evicted`] too).
    pub(super) fn admit(
        &self,
        peer: SocketAddr,
        probe: Option<std::net::TcpStream>,
    ) -> Result<Admitted, Full> {
        let evict = CancellationToken::new();
        let mut open = self.open.lock().expect("pre-auth pool poisoned");
        let evicted = if open.by_age.len() >= self.cap {
            let victim = open
                .by_age
                .iter_mut()
                .find_map(|(id, w)| w.evictable().then_some(*id));
            let Some(victim) = victim else {
                drop(open);
                self.fail(Failure::Evicted);
                return Err(Full);
            };
            let old = open.by_age.remove(&victim).expect("found just now");
            old.evict.cancel();
            (!old.failed).then_some(old.peer)
        } else {
            None
        };
        let id = open.next;
        open.next += 1;
        open.by_age.insert(
            id,
            Waiting {
                peer,
                evict: evict.clone(),
                failed: false,
                spoke: false,
                probe,
            },
        );
        drop(open);
        if evicted.is_some() {
            self.fail(Failure::Evicted);
        }
        Ok(Admitted { id, evict, evicted })
    }

    /// Takes `id` out of the pool; false if it was no longer there (evicted).
    fn leave(&self, id: u64) -> bool {
        let mut open = self.open.lock().expect("pre-auth pool poisoned");
        open.by_age.remove(&id).is_some()
    }

    /// Sockets in the handshake now.
    pub(super) fn len(&self) -> usize {
        self.open
            .lock()
            .expect("pre-auth pool poisoned")
            .by_age
            .len()
    }

    /// The cap.
    pub(super) fn cap(&self) -> usize {
        self.cap
    }

    /// Counts a failed handshake.
    pub(super) fn fail(&self, why: Failure) {
        self.failures[why as usize].fetch_add(1, Ordering::SeqCst);
    }

    /// The failed handshakes so far, by reason.
    pub(super) fn failures(&self) -> BTreeMap<String, u64> {
        Failure::ALL
            .iter()
            .map(|f| {
                (
                    f.as_str().to_string(),
                    self.failures[*f as usize].load(Ordering::SeqCst),
                )
            })
            .collect()
    }
}

/// A socket's place in the [`PreAuth`] pool, given back when dropped
/// unless [`Slot::promote`]d.
pub(super) struct Slot<'a> {
    pool: &'a PreAuth,
    id: Option<u64>,
}

impl<'a> Slot<'a> {
    /// Takes over the place [`PreAuth::admit`] gave `id`.
    pub(super) fn adopt(pool: &'a PreAuth, id: u64) -> Slot<'a> {
        Slot { pool, id: Some(id) }
    }

    /// The handshake passed: leaves the pool. False if the socket was
    /// evicted meanwhile (it must close).
    pub(super) fn promote(mut self) -> bool {
        self.id.take().is_some_and(|id| self.pool.leave(id))
    }

    /// Bytes have arrived on the socket (its AUTH is coming): it is no
    /// longer silent and is never evicted for a silent one.
    pub(super) fn spoke(&self) {
        if let Some(id) = self.id {
            let mut open = self.pool.open.lock().expect("pre-auth pool poisoned");
            if let Some(w) = open.by_age.get_mut(&id) {
                w.spoke = true;
                w.probe = None;
            }
        }
    }

    /// The handshake failed (and is counted): the socket stays in the pool
    /// while it is refused, but evicting it is no further failure.
    pub(super) fn failed(&self) {
        if let Some(id) = self.id {
            let mut open = self.pool.open.lock().expect("pre-auth pool poisoned");
            if let Some(w) = open.by_age.get_mut(&id) {
                w.failed = true;
            }
        }
    }
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        if let Some(id) = self.id.take() {
            self.pool.leave(id);
        }
    }
}

/// At most one WARN line per interval; what is held back is counted by
/// kind and summarised in the next line.
pub(super) struct WarnLimit {
    interval: Duration,
    state: Mutex<Held>,
    suppressed: AtomicU64,
}

#[derive(Default)]
struct Held {
    /// When the last line was written.
    last: Option<Instant>,
    /// Warnings held back since then, by kind.
    by_kind: BTreeMap<&'static str, u64>,
}

impl Held {
    /// `timeout 1093, refused 2` (and empties the counts).
    fn take_summary(&mut self) -> (u64, String) {
        let mut total = 0;
        let mut text = String::new();
        for (kind, n) in std::mem::take(&mut self.by_kind) {
            total += n;
            if !text.is_empty() {
                text.push_str(", ");
            }
            let _ = write!(text, "{kind} {n}");
        }
        (total, text)
    }
}

impl WarnLimit {
    /// A limit of one line per `interval`.
    pub(super) fn new(interval: Duration) -> WarnLimit {
        WarnLimit {
            interval,
            state: Mutex::new(Held::default()),
            suppressed: AtomicU64::new(0),
        }
    }

    /// Warns of a `kind` of failure (`peer` when there is one): a line now
    /// if none was written within the interval, else counted for the next.
    pub(super) fn warn(&self, kind: &'static str, peer: Option<SocketAddr>, detail: &str) {
        self.warn_at(Instant::now(), kind, peer, detail);
    }

    fn warn_at(&self, now: Instant, kind: &'static str, peer: Option<SocketAddr>, detail: &str) {
        let mut held = self.state.lock().expect("warn limit poisoned");
        if held
            .last
            .is_some_and(|t| now.duration_since(t) < self.interval)
        {
            *held.by_kind.entry(kind).or_default() += 1;
            self.suppressed.fetch_add(1, Ordering::SeqCst);
            return;
        }
        held.last = Some(now);
        let (more, by_kind) = held.take_summary();
        drop(held);
        let peer = peer.map(|p| p.to_string()).unwrap_or_default();
        tracing::warn!(
            kind,
            peer,
            detail,
            held_back = more,
            held_back_by_kind = by_kind,
            interval = ?self.interval,
            "relay: {kind} (at most one such warning per interval; held_back counts the others since the last)"
        );
    }

    /// Writes the summary of what was held back, if anything was and the
    /// interval has passed since the last line.
    pub(super) fn flush(&self) {
        self.flush_at(Instant::now());
    }

    /// Whether a line was written.
    fn flush_at(&self, now: Instant) -> bool {
        let mut held = self.state.lock().expect("warn limit poisoned");
        if held.by_kind.is_empty()
            || held
                .last
                .is_some_and(|t| now.duration_since(t) < self.interval)
        {
            return false;
        }
        held.last = Some(now);
        let (more, by_kind) = held.take_summary();
        drop(held);
        tracing::warn!(
            held_back = more,
            held_back_by_kind = by_kind,
            interval = ?self.interval,
            "relay: {more} more connection failures since the last warning"
        );
        true
    }

    /// Warnings held back so far.
    pub(super) fn suppressed(&self) -> u64 {
        self.suppressed.load(Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(port: u16) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], port))
    }

    #[test]
    fn over_the_cap_the_oldest_silent_one_is_evicted() {
        let pool = PreAuth::new(2);
        let a = pool.admit(peer(1), None).unwrap();
        let b = pool.admit(peer(2), None).unwrap();
        assert_eq!((a.evicted, b.evicted, pool.len()), (None, None, 2));
        let c = pool.admit(peer(3), None).unwrap();
        assert_eq!(c.evicted, Some(peer(1)));
        assert!(a.evict.is_cancelled() && !b.evict.is_cancelled());
        assert_eq!(pool.len(), 2);
        assert_eq!(pool.failures()["evicted"], 1);
        // The evicted one cannot be promoted; the others leave on promotion or drop.
        assert!(!Slot::adopt(&pool, a.id).promote());
        assert!(Slot::adopt(&pool, b.id).promote());
        assert_eq!(pool.len(), 1);
        // A socket whose handshake failed is evicted without a second count.
        let failing = Slot::adopt(&pool, c.id);
        failing.failed();
        let d = pool.admit(peer(4), None).unwrap();
        let e = pool.admit(peer(5), None).unwrap();
        assert_eq!(e.evicted, None, "{:?}", d.evicted);
        assert!(c.evict.is_cancelled());
        assert_eq!(pool.failures()["evicted"], 1);
        drop(failing);
        assert_eq!(pool.len(), 2);
        drop((Slot::adopt(&pool, d.id), Slot::adopt(&pool, e.id)));
        assert_eq!(pool.len(), 0);
    }

    #[test]
    fn a_socket_that_spoke_is_never_evicted_for_a_silent_one() {
        let pool = PreAuth::new(2);
        let worker = pool.admit(peer(1), None).unwrap();
        let worker_slot = Slot::adopt(&pool, worker.id);
        worker_slot.spoke();
        let silent = pool.admit(peer(2), None).unwrap();
        // The worker is the oldest, but it spoke: the silent one goes.
        let next = pool.admit(peer(3), None).unwrap();
        assert_eq!(next.evicted, Some(peer(2)));
        assert!(silent.evict.is_cancelled() && !worker.evict.is_cancelled());
        // Every socket in the pool spoke: the new one is refused.
        let next_slot = Slot::adopt(&pool, next.id);
        next_slot.spoke();
        assert_eq!(pool.admit(peer(4), None).err(), Some(Full));
        assert!(!worker.evict.is_cancelled() && !next.evict.is_cancelled());
        assert_eq!((pool.len(), pool.failures()["evicted"]), (2, 2));
        assert!(worker_slot.promote());
        drop(next_slot);
        assert_eq!(pool.len(), 0);
    }

    #[test]
    fn bytes_not_read_yet_count_as_spoken() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let mut talker = std::net::TcpStream::connect(addr).unwrap();
        let (talking, _) = listener.accept().unwrap();
        let _quiet = std::net::TcpStream::connect(addr).unwrap();
        let (quiet, _) = listener.accept().unwrap();
        for s in [&talking, &quiet] {
            s.set_nonblocking(true).unwrap();
        }
        std::io::Write::write_all(&mut talker, b"AUTH").unwrap();
        let mut byte = [0u8; 1];
        // Wait until the byte is there (loopback: at once).
        while talking.peek(&mut byte).is_err() {
            std::thread::yield_now();
        }
        let pool = PreAuth::new(2);
        let t = pool.admit(peer(1), Some(talking)).unwrap();
        let q = pool.admit(peer(2), Some(quiet)).unwrap();
        let next = pool.admit(peer(3), None).unwrap();
        assert_eq!(next.evicted, Some(peer(2)), "the quiet one, not the oldest");
        assert!(!t.evict.is_cancelled() && q.evict.is_cancelled());
    }

    #[test]
    fn warnings_are_held_back_within_the_interval_and_summarised() {
        let limit = WarnLimit::new(Duration::from_secs(10));
        let t0 = Instant::now();
        limit.warn_at(t0, "timeout", Some(peer(1)), "first");
        for i in 0..100 {
            limit.warn_at(
                t0 + Duration::from_millis(i),
                "timeout",
                Some(peer(2)),
                "more",
            );
        }
        limit.warn_at(t0 + Duration::from_secs(9), "refused", None, "other");
        assert_eq!(limit.suppressed(), 101);
        assert!(
            !limit.flush_at(t0 + Duration::from_secs(9)),
            "nothing written within the interval"
        );
        assert!(limit.flush_at(t0 + Duration::from_secs(10)), "the summary");
        assert!(limit.state.lock().unwrap().by_kind.is_empty());
        assert!(
            !limit.flush_at(t0 + Duration::from_secs(30)),
            "nothing held back: no line"
        );
        // The first warning after a quiet interval is written at once.
        limit.warn_at(t0 + Duration::from_secs(31), "timeout", None, "again");
        assert_eq!(limit.suppressed(), 101);
    }
}
