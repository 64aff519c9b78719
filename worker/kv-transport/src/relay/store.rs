//! The relay's memory: blobs keyed by `(request key, blob index)`, the
//! caps (memory with a per-blob overhead, blobs, waiting GETs,
//! authenticated connections; the sockets still in the handshake are
//! [`super::preauth`]'s), the TTL sweep (which also sums the stranded
//! bytes: blobs older than the claim window not deleted yet), the GETs
//! waiting for a blob, and
//! the counters of the STATS reply (with the rejections by reason). The
//! protocol side is [`super::server`].

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

use bytes::Bytes;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::preauth::{PreAuth, WarnLimit};
use super::{ENTRY_OVERHEAD, RelayConfig};
use crate::frame::RelayStats;

/// Why the relay refused something or closed a connection (the `reason`
/// label of the STATS `rejections` counter).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Reject {
    /// Wrong, missing or late handshake answer.
    Auth,
    /// Over the connection cap.
    Connections,
    /// Closed in the handshake, the oldest over the pre-auth cap.
    Preauth,
    /// Over the waiting-GET cap.
    Waiters,
    /// Over the blob cap.
    Entries,
    /// Over the memory cap.
    Memory,
    /// A frame that is not the protocol (bad magic, version, op, key, a body where none belongs).
    Malformed,
    /// A frame body over the maximum frame.
    TooLarge,
    /// A frame that did not arrive within the read deadline.
    ReadTimeout,
    /// A connection idle for the idle timeout.
    IdleTimeout,
    /// A reply the client did not take within the read deadline.
    WriteTimeout,
}

impl Reject {
    const ALL: [Reject; 11] = [
        Reject::Auth,
        Reject::Connections,
        Reject::Preauth,
        Reject::Waiters,
        Reject::Entries,
        Reject::Memory,
        Reject::Malformed,
        Reject::TooLarge,
        Reject::ReadTimeout,
        Reject::IdleTimeout,
        Reject::WriteTimeout,
    ];

    /// The label value.
    pub(super) fn as_str(self) -> &'static str {
        match self {
            Reject::Auth => "auth",
            Reject::Connections => "connections",
            Reject::Preauth => "preauth",
            Reject::Waiters => "waiters",
            Reject::Entries => "entries",
            Reject::Memory => "memory",
            Reject::Malformed => "malformed",
            Reject::TooLarge => "too_large",
            Reject::ReadTimeout => "read_timeout",
            Reject::IdleTimeout => "idle_timeout",
            Reject::WriteTimeout => "write_timeout",
        }
    }
}

/// A stored blob and the CRC-32 it was PUT with (`None`: sent without one).
pub(super) type Stored = (Bytes, Option<u32>);

struct Slot {
    blobs: HashMap<u32, Stored>,
    created: Instant,
}

/// One relay process's state, shared by its connections.
pub(super) struct Relay {
    /// This process's epoch (see [`new_epoch`]).
    pub(super) epoch: u64,
    pub(super) cfg: RelayConfig,
    store: Mutex<HashMap<String, Slot>>,
    /// Bytes held or reserved (the memory cap counts these).
    pub(super) used: AtomicU64,
    /// Blobs held plus PUTs admitted and still being received (the blob cap counts these).
    entries: AtomicUsize,
    arrived: Notify,
    waiters: AtomicUsize,
    /// Open authenticated connections (a gauge).
    pub(super) connections: AtomicUsize,
    /// The sockets still in the handshake, and the failed handshakes.
    pub(super) preauth: PreAuth,
    /// The rate limit of the warnings peers can cause at will.
    pub(super) warnings: WarnLimit,
    /// PUT bodies being received (a gauge).
    pub(super) puts_in_progress: AtomicUsize,
    expired: AtomicU64,
    /// Bytes of blobs older than the claim window, as of the last sweep.
    stranded: AtomicU64,
    rejections: [AtomicU64; Reject::ALL.len()],
}

/// Decrements a gauge when dropped.
pub(super) struct Gauge<'a>(&'a AtomicUsize);

impl<'a> Gauge<'a> {
    /// Increments `g` until the returned guard drops.
    pub(super) fn up(g: &'a AtomicUsize) -> Gauge<'a> {
        g.fetch_add(1, Ordering::SeqCst);
        Gauge(g)
    }
}

impl<'a> Gauge<'a> {
    /// Takes over one unit of `g` that was already counted, to give it back on drop.
    pub(super) fn adopt(g: &'a AtomicUsize) -> Gauge<'a> {
        Gauge(g)
    }
}

impl Drop for Gauge<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A random, non-zero epoch for a new relay process.
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
    /// A relay with an empty store and a fresh epoch.
    pub(super) fn new(cfg: RelayConfig) -> Relay {
        Relay {
            epoch: new_epoch(),
            store: Mutex::new(HashMap::new()),
            used: AtomicU64::new(0),
            entries: AtomicUsize::new(0),
            arrived: Notify::new(),
            waiters: AtomicUsize::new(0),
            connections: AtomicUsize::new(0),
            preauth: PreAuth::new(cfg.max_handshakes),
            warnings: WarnLimit::new(cfg.warn_interval),
            puts_in_progress: AtomicUsize::new(0),
            expired: AtomicU64::new(0),
            stranded: AtomicU64::new(0),
            rejections: Default::default(),
            cfg,
        }
    }

    /// The STATS reply.
    pub(super) fn stats(&self) -> RelayStats {
        let store = self.store.lock().expect("relay store poisoned");
        RelayStats {
            epoch: self.epoch,
            keys: store.len(),
            blobs: store.values().map(|s| s.blobs.len()).sum(),
            bytes: self.used.load(Ordering::SeqCst),
            waiters: self.waiters.load(Ordering::SeqCst),
            connections: self.connections.load(Ordering::SeqCst),
            handshakes: self.preauth.len(),
            handshake_failures: self.preauth.failures(),
            warnings_held_back: self.warnings.suppressed(),
            puts_in_progress: self.puts_in_progress.load(Ordering::SeqCst),
            expired: self.expired.load(Ordering::SeqCst),
            stranded_bytes: self.stranded.load(Ordering::SeqCst),
            rejections: Reject::ALL
                .iter()
                .map(|r| {
                    (
                        r.as_str().to_string(),
                        self.rejections[*r as usize].load(Ordering::SeqCst),
                    )
                })
                .collect(),
        }
    }

    /// Counts a refusal or forced close.
    pub(super) fn reject(&self, why: Reject) {
        self.rejections[why as usize].fetch_add(1, Ordering::SeqCst);
    }

    /// Takes one unit of `gauge` if it is below `cap`.
    fn acquire(gauge: &AtomicUsize, cap: usize) -> bool {
        gauge
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |cur| {
                (cur < cap).then_some(cur + 1)
            })
            .is_ok()
    }

    /// Admits an authenticated connection under the connection cap; the
    /// connection's task gives it back ([`Gauge::adopt`] of
    /// [`Relay::connections`]).
    pub(super) fn admit_connection(&self) -> bool {
        Self::acquire(&self.connections, self.cfg.max_connections)
    }

    /// Whether the connection cap is reached (a new socket is refused
    /// before its handshake then).
    pub(super) fn connections_full(&self) -> bool {
        self.connections.load(Ordering::SeqCst) >= self.cfg.max_connections
    }

    /// Takes a waiting-GET slot under the cap; [`Relay::wait_for`] gives it back.
    pub(super) fn admit_waiter(&self) -> bool {
        Self::acquire(&self.waiters, self.cfg.max_waiters)
    }

    /// Admits a PUT under the blob cap and reserves its [`ENTRY_OVERHEAD`]
    /// under the memory cap; on refusal says which cap. A PUT admitted here
    /// ends in [`Relay::insert`] or [`Relay::abandon_put`].
    pub(super) fn admit_put(&self) -> Result<(), Reject> {
        if !Self::acquire(&self.entries, self.cfg.max_entries) {
            return Err(Reject::Entries);
        }
        if !self.reserve(ENTRY_OVERHEAD) {
            self.entries.fetch_sub(1, Ordering::SeqCst);
            return Err(Reject::Memory);
        }
        Ok(())
    }

    /// Gives back what an admitted PUT held: its entry, its overhead and the
    /// `received` body bytes reserved so far.
    pub(super) fn abandon_put(&self, received: u64) {
        self.unreserve(ENTRY_OVERHEAD + received);
        self.entries.fetch_sub(1, Ordering::SeqCst);
    }

    /// Gives back what dropped blobs held (`count` entries of `bytes` in all).
    fn release_blobs(&self, count: usize, bytes: u64) {
        self.unreserve(bytes + ENTRY_OVERHEAD * count as u64);
        self.entries.fetch_sub(count, Ordering::SeqCst);
    }

    /// Reserves `n` bytes under the memory cap.
    pub(super) fn reserve(&self, n: u64) -> bool {
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

    /// Gives back bytes [`Relay::reserve`]d (or held by a dropped blob).
    pub(super) fn unreserve(&self, n: u64) {
        self.used.fetch_sub(n, Ordering::SeqCst);
    }

    /// Stores the blob of an admitted PUT (replacing one at the same index)
    /// and wakes the waiting GETs.
    pub(super) fn insert(&self, key: String, index: u32, blob: Stored) {
        let old = {
            let mut store = self.store.lock().expect("relay store poisoned");
            let slot = store.entry(key).or_insert_with(|| Slot {
                blobs: HashMap::new(),
                created: Instant::now(),
            });
            slot.blobs.insert(index, blob)
        };
        if let Some((old, _)) = old {
            self.release_blobs(1, old.len() as u64);
        }
        self.arrived.notify_waiters();
    }

    fn lookup(&self, key: &str, index: u32) -> Option<Stored> {
        let store = self.store.lock().expect("relay store poisoned");
        store.get(key).and_then(|s| s.blobs.get(&index).cloned())
    }

    /// Drops every blob of `key`; returns how many there were.
    pub(super) fn remove(&self, key: &str) -> usize {
        let slot = self.store.lock().expect("relay store poisoned").remove(key);
        match slot {
            Some(slot) => {
                let bytes: u64 = slot.blobs.values().map(|b| b.0.len() as u64).sum();
                self.release_blobs(slot.blobs.len(), bytes);
                slot.blobs.len()
            }
            None => 0,
        }
    }

    /// Drops the requests older than the TTL; sums the bytes of the ones
    /// left that are older than the claim window (the stranded bytes).
    pub(super) fn expire(&self) {
        let now = Instant::now();
        let gone: Vec<(String, Slot)> = {
            let mut store = self.store.lock().expect("relay store poisoned");
            let keys: Vec<String> = store
                .iter()
                .filter(|(_, s)| now.duration_since(s.created) >= self.cfg.ttl)
                .map(|(k, _)| k.clone())
                .collect();
            let gone = keys
                .into_iter()
                .filter_map(|k| store.remove(&k).map(|s| (k, s)))
                .collect();
            let stranded: u64 = store
                .values()
                .filter(|s| now.duration_since(s.created) >= self.cfg.claim_window)
                .flat_map(|s| s.blobs.values())
                .map(|b| b.0.len() as u64)
                .sum();
            self.stranded.store(stranded, Ordering::SeqCst);
            gone
        };
        for (key, slot) in gone {
            let bytes: u64 = slot.blobs.values().map(|b| b.0.len() as u64).sum();
            self.release_blobs(slot.blobs.len(), bytes);
            self.expired.fetch_add(1, Ordering::SeqCst);
            tracing::info!(key, bytes, "relay: expired unread KV cache");
        }
    }

    /// Waits for blob `index` of `key` until `deadline`, or until `cancel`;
    /// then gives back the slot [`Relay::admit_waiter`] took.
    pub(super) async fn wait_for(
        &self,
        key: &str,
        index: u32,
        deadline: tokio::time::Instant,
        cancel: &CancellationToken,
    ) -> Option<Stored> {
        let _g = Gauge(&self.waiters);
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
