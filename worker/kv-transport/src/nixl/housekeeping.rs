//! The housekeeping thread of a `nixl-ucx` transport: frees slots on READ
//! notifications and after the TTL, sums the stranded bytes (slots older
//! than the claim window), and returns quarantined extents.

use std::sync::Weak;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::{Inner, POLL, descriptor, lock};

/// The thread that frees slots: on READ notifications, after the TTL, and
/// returns quarantined extents. Ends with the transport.
pub(super) fn housekeeping(weak: Weak<Inner>) {
    let Ok(mut map) = nixl_sys::NotificationMap::new() else {
        tracing::error!("nixl-ucx: no notification map; slots are freed by TTL and release only");
        return;
    };
    let mut last_sweep = Instant::now();
    loop {
        let Some(inner) = weak.upgrade() else { return };
        if inner.stop.load(Ordering::Relaxed) {
            return;
        }
        for (agent, msg) in inner.agent.notifications(&mut map) {
            match descriptor::parse_free_notif(&msg) {
                Some((key, slot, nonce)) => inner.free_slot(key, Some((slot, nonce)), "read"),
                None => tracing::warn!(%agent, "nixl-ucx: unexpected notification"),
            }
        }
        if last_sweep.elapsed() >= Duration::from_millis(20) {
            last_sweep = Instant::now();
            let now = Instant::now();
            let expired: Vec<String> = lock(&inner.slots)
                .iter()
                .filter(|(_, s)| s.expires <= now)
                .map(|(k, _)| k.clone())
                .collect();
            for k in expired {
                inner.free_slot(&k, None, "ttl");
            }
            let stranded: u64 = lock(&inner.slots)
                .values()
                .filter(|s| now.duration_since(s.published) >= inner.claim_window)
                .map(|s| s.bytes)
                .sum();
            inner.stranded.store(stranded, Ordering::Relaxed);
            lock(&inner.quarantine).retain(|(until, _)| *until > now);
        }
        drop(inner);
        std::thread::sleep(POLL);
    }
}

impl Inner {
    /// Frees the slot of `key` (only the one with `tag`, if given).
    pub(super) fn free_slot(&self, key: &str, tag: Option<(u64, u64)>, why: &'static str) {
        let mut slots = lock(&self.slots);
        let matches = match (slots.get(key), tag) {
            (Some(s), Some((id, nonce))) => s.id == id && s.nonce == nonce,
            (Some(_), None) => true,
            (None, _) => false,
        };
        if matches {
            slots.remove(key);
            tracing::debug!(key, why, "nixl-ucx: slot freed");
        }
    }
}
