//! [`UsedHandles`]: the handles a decode worker has used — consumed by a
//! decode (pulled, or being pulled) or released without one — so that a
//! second decode of the same handle is refused at once (410) instead of
//! waiting the whole pull timeout, holding a slot, for a KV that is gone.
//!
//! Bounded: an entry lives until its handle expires (the signed expiry plus
//! the clock skew; after that the signature check refuses the handle anyway)
//! and at most [`USED_HANDLES_CAP`] entries are kept, the oldest dropped
//! first. Keys are kept as 128 bits of their SHA-256 (about 72 bytes an
//! entry with the index: under 5 MB at the cap).

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use rngd_api::pd::HandleState;

/// Most handles a worker remembers as used. At the default 60 s handle TTL
/// this covers over 1,000 decodes a second, far above what one worker runs.
pub const USED_HANDLES_CAP: usize = 65_536;

/// A handle that was used before: what happened to it, and how long ago.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Used {
    /// `Consumed` or `Released`.
    pub state: HandleState,
    /// How long ago, ms.
    pub ago_ms: u64,
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    state: HandleState,
    at_ms: u64,
}

#[derive(Debug, Default)]
struct Inner {
    by_key: HashMap<u128, Entry>,
    /// Keys in the order they were first used, with their expiry.
    order: VecDeque<(u128, u64)>,
}

/// The record of used handles (see the module docs).
#[derive(Debug)]
pub struct UsedHandles {
    inner: Mutex<Inner>,
    cap: usize,
}

impl Default for UsedHandles {
    fn default() -> Self {
        Self::new(USED_HANDLES_CAP)
    }
}

fn digest(key: &str) -> u128 {
    let d = ring::digest::digest(&ring::digest::SHA256, key.as_bytes());
    let mut b = [0u8; 16];
    b.copy_from_slice(&d.as_ref()[..16]);
    u128::from_le_bytes(b)
}

impl UsedHandles {
    /// An empty record of at most `cap` handles (at least 1).
    pub fn new(cap: usize) -> Self {
        UsedHandles {
            inner: Mutex::new(Inner::default()),
            cap: cap.max(1),
        }
    }

    fn locked(&self, now_ms: u64) -> std::sync::MutexGuard<'_, Inner> {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        while let Some(&(k, until)) = g.order.front() {
            if until > now_ms {
                break;
            }
            g.order.pop_front();
            g.by_key.remove(&k);
        }
        g
    }

    fn insert(&self, g: &mut Inner, key: u128, entry: Entry, until_ms: u64) {
        while g.by_key.len() >= self.cap {
            let Some((old, _)) = g.order.pop_front() else {
                break;
            };
            g.by_key.remove(&old);
        }
        g.by_key.insert(key, entry);
        g.order.push_back((key, until_ms));
    }

    /// Takes the handle `key` for a decode: `Ok` if nothing used it before
    /// (it is consumed from now on, until `until_ms`), else what did.
    pub fn take(&self, key: &str, until_ms: u64, now_ms: u64) -> Result<(), Used> {
        let k = digest(key);
        let mut g = self.locked(now_ms);
        if let Some(e) = g.by_key.get(&k) {
            return Err(Used {
                state: e.state,
                ago_ms: now_ms.saturating_sub(e.at_ms),
            });
        }
        let entry = Entry {
            state: HandleState::Consumed,
            at_ms: now_ms,
        };
        self.insert(&mut g, k, entry, until_ms);
        Ok(())
    }

    /// Records the handle `key` as released (a decode of it is refused from
    /// now on) and says what was known of it before: `Unused`, `Consumed`
    /// (a decode had taken it; it stays so) or `Released`.
    pub fn release(&self, key: &str, until_ms: u64, now_ms: u64) -> HandleState {
        let k = digest(key);
        let mut g = self.locked(now_ms);
        if let Some(e) = g.by_key.get(&k) {
            return e.state;
        }
        let entry = Entry {
            state: HandleState::Released,
            at_ms: now_ms,
        };
        self.insert(&mut g, k, entry, until_ms);
        HandleState::Unused
    }

    /// Handles recorded now (expired ones dropped first).
    pub fn len(&self, now_ms: u64) -> usize {
        self.locked(now_ms).by_key.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_handle_is_taken_once_and_a_release_is_remembered() {
        let u = UsedHandles::new(8);
        u.take("a", 1_000, 10).unwrap();
        assert_eq!(
            u.take("a", 1_000, 30),
            Err(Used {
                state: HandleState::Consumed,
                ago_ms: 20
            })
        );
        assert_eq!(u.release("a", 1_000, 40), HandleState::Consumed);
        assert_eq!(u.release("b", 1_000, 40), HandleState::Unused);
        assert_eq!(u.release("b", 1_000, 41), HandleState::Released);
        assert_eq!(
            u.take("b", 1_000, 50).unwrap_err().state,
            HandleState::Released
        );
        u.take("c", 1_000, 50).unwrap();
    }

    #[test]
    fn entries_expire_with_their_handle_and_the_cap_holds() {
        let u = UsedHandles::new(3);
        u.take("a", 100, 0).unwrap();
        u.take("b", 200, 0).unwrap();
        assert_eq!(u.len(99), 2);
        assert_eq!(u.len(100), 1, "a expired with its handle");
        u.take("a", 300, 100).unwrap();
        u.take("c", 300, 100).unwrap();
        u.take("d", 300, 100).unwrap();
        // At the cap the oldest (b) made room.
        assert_eq!(u.len(150), 3);
        u.take("b", 300, 150).unwrap();
        assert!(u.take("d", 300, 150).is_err());
        for i in 0..1000 {
            u.take(&format!("k{i}"), 10_000, 200).unwrap();
        }
        assert_eq!(u.len(200), 3);
    }
}
