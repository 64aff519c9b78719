//! [`Estimates`]: the router's own memory of which prompt blocks it sent
//! where, for endpoints whose cache it cannot read (approximate mode) and,
//! briefly, for endpoints whose events have not yet confirmed a pick
//! (speculative entries). One store per lifetime, so its queue is in expiry
//! order; bounded by an entry cap (the oldest entries go first).

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

/// Blocks remembered per endpoint, each until its expiry.
#[derive(Debug)]
pub struct Estimates {
    ttl: Duration,
    max_entries: usize,
    by_endpoint: HashMap<String, HashMap<u64, Instant>>,
    /// (expiry, endpoint, key) in insertion order; an entry refreshed later
    /// leaves its older copy here, skipped when popped.
    queue: VecDeque<(Instant, String, u64)>,
    len: usize,
}

impl Estimates {
    /// A store whose entries live `ttl`, at most `max_entries` of them.
    pub fn new(ttl: Duration, max_entries: usize) -> Self {
        Estimates {
            ttl,
            max_entries: max_entries.max(1),
            by_endpoint: HashMap::new(),
            queue: VecDeque::new(),
            len: 0,
        }
    }

    /// Entries held now (expired ones not yet purged included).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds nothing.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Remembers that `endpoint` holds the blocks `keys` (a chain from the
    /// prompt's first block) from `now` for the store's lifetime.
    pub fn record(&mut self, endpoint: &str, keys: &[u64], now: Instant) {
        if keys.is_empty() {
            return;
        }
        self.purge(now);
        let expiry = now + self.ttl;
        let held = self.by_endpoint.entry(endpoint.to_string()).or_default();
        for &k in keys {
            if held.insert(k, expiry).is_none() {
                self.len += 1;
            }
            self.queue.push_back((expiry, endpoint.to_string(), k));
        }
        while self.len > self.max_entries {
            if !self.pop_front() {
                break;
            }
        }
    }

    /// Blocks of the chain `keys` that `endpoint` is remembered to hold,
    /// counted from the first until the first one it does not.
    pub fn matched(&self, endpoint: &str, keys: &[u64], now: Instant) -> usize {
        let Some(held) = self.by_endpoint.get(endpoint) else {
            return 0;
        };
        keys.iter()
            .take_while(|k| held.get(k).is_some_and(|&exp| exp > now))
            .count()
    }

    /// Forgets `endpoint` (it left the pool).
    pub fn forget(&mut self, endpoint: &str) {
        if let Some(held) = self.by_endpoint.remove(endpoint) {
            self.len -= held.len();
        }
    }

    /// Forgets every endpoint `keep` refuses.
    pub fn retain_endpoints(&mut self, mut keep: impl FnMut(&str) -> bool) {
        let gone: Vec<String> = self
            .by_endpoint
            .keys()
            .filter(|e| !keep(e))
            .cloned()
            .collect();
        for e in gone {
            self.forget(&e);
        }
    }

    /// Drops the entries expired at `now`.
    pub fn purge(&mut self, now: Instant) {
        while self.queue.front().is_some_and(|(exp, _, _)| *exp <= now) {
            self.pop_front();
        }
    }

    /// Pops the queue's oldest copy; removes the entry when that copy is its
    /// current one. Returns false when the queue is empty.
    fn pop_front(&mut self) -> bool {
        let Some((exp, endpoint, key)) = self.queue.pop_front() else {
            return false;
        };
        if let Some(held) = self.by_endpoint.get_mut(&endpoint)
            && held.get(&key) == Some(&exp)
        {
            held.remove(&key);
            self.len -= 1;
            if held.is_empty() {
                self.by_endpoint.remove(&endpoint);
            }
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chain_matches_from_its_first_block_until_its_lifetime_ends() {
        let t0 = Instant::now();
        let mut e = Estimates::new(Duration::from_secs(10), 100);
        e.record("a:1", &[1, 2, 3], t0);
        assert_eq!(e.matched("a:1", &[1, 2, 3, 4], t0), 3);
        assert_eq!(e.matched("a:1", &[1, 9, 3], t0), 1);
        assert_eq!(e.matched("a:1", &[9, 2, 3], t0), 0);
        assert_eq!(e.matched("b:1", &[1, 2, 3], t0), 0);
        let later = t0 + Duration::from_secs(11);
        assert_eq!(e.matched("a:1", &[1, 2, 3], later), 0);
        e.purge(later);
        assert!(e.is_empty());
    }

    #[test]
    fn a_refreshed_entry_outlives_its_first_copy() {
        let t0 = Instant::now();
        let mut e = Estimates::new(Duration::from_secs(10), 100);
        e.record("a:1", &[1], t0);
        e.record("a:1", &[1], t0 + Duration::from_secs(5));
        assert_eq!(e.len(), 1);
        let t = t0 + Duration::from_secs(12);
        e.purge(t);
        assert_eq!(e.matched("a:1", &[1], t), 1, "the refreshed copy is alive");
        e.purge(t0 + Duration::from_secs(16));
        assert!(e.is_empty());
    }

    #[test]
    fn the_cap_drops_the_oldest_and_forget_drops_an_endpoint() {
        let t0 = Instant::now();
        let mut e = Estimates::new(Duration::from_secs(10), 4);
        e.record("a:1", &[1, 2, 3], t0);
        e.record("b:1", &[7, 8], t0);
        assert_eq!(e.len(), 4);
        assert_eq!(e.matched("a:1", &[1, 2, 3], t0), 0, "block 1 went first");
        assert_eq!(e.matched("b:1", &[7, 8], t0), 2);
        e.forget("b:1");
        assert_eq!(e.len(), 2);
        assert_eq!(e.matched("b:1", &[7, 8], t0), 0);
    }
}
