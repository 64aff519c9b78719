//! The requests a door routed to each decode endpoint and has not finished:
//! the load the policy sees between two scrapes.
//!
//! A scrape reports `vllm:num_requests_running` every 50 ms, so a burst
//! routed within one scrape period sees the same load everywhere and the
//! load-weighted picks nearly all land on one decode endpoint (measured on
//! the Mooncake replay, `docs/benchmarks-prefix.md`). The picker therefore
//! counts its own routes: [`Picker::pick_held`](crate::Picker::pick_held)
//! takes a [`Held`] for the decode endpoint it chose, which the door keeps
//! until the answer ends (the gateway: the end of its stream or body; the
//! endpoint picker: the end of Envoy's `ext_proc` stream) and which gives
//! the count back when dropped. Each pick sees an endpoint's `running` as
//! the larger of the scraped figure and this count: the count is a lower
//! bound of the real load (other doors route there too), the scrape a
//! late one.
//!
//! Only decode endpoints are counted: a prefill endpoint's share of a
//! request ends when its KV is handed over, long before the answer does,
//! and its scraped queue is what the TTFT prediction reads.
//!
//! Memory is bounded by the requests in flight, which admission bounds: an
//! address whose count drops to 0 is forgotten.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use rngd_policy_core::Endpoint;

/// Routed, unfinished requests per decode endpoint address.
#[derive(Debug, Default)]
pub struct InFlight {
    counts: Mutex<HashMap<String, u32>>,
}

/// One routed request's share of its decode endpoint's count, given back
/// when dropped.
#[derive(Debug)]
pub struct Held {
    owner: Arc<InFlight>,
    address: String,
}

// === impl InFlight ===

impl InFlight {
    fn lock(&self) -> MutexGuard<'_, HashMap<String, u32>> {
        self.counts.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Counts one more request routed to `address` until the hold drops.
    pub fn hold(self: &Arc<Self>, address: &str) -> Held {
        let mut counts = self.lock();
        let n = counts.entry(address.to_string()).or_insert(0);
        *n = n.saturating_add(1);
        Held {
            owner: Arc::clone(self),
            address: address.to_string(),
        }
    }

    /// Requests routed to `address` and not finished.
    pub fn count(&self, address: &str) -> u32 {
        self.lock().get(address).copied().unwrap_or(0)
    }

    /// Addresses with requests in flight (each 0 is forgotten).
    pub fn tracked(&self) -> usize {
        self.lock().len()
    }

    /// `snapshot` with each endpoint's `running` raised to its count; the
    /// same `Arc` when no count is above a scraped figure (the policy
    /// host's same-snapshot shortcut then still hits).
    pub fn apply(&self, snapshot: Arc<[Endpoint]>) -> Arc<[Endpoint]> {
        let counts = self.lock();
        if counts.is_empty() {
            return snapshot;
        }
        let above = |e: &Endpoint| counts.get(&e.address).copied().filter(|&n| n > e.running);
        if !snapshot.iter().any(|e| above(e).is_some()) {
            return snapshot;
        }
        snapshot
            .iter()
            .map(|e| {
                let mut e = e.clone();
                if let Some(n) = above(&e) {
                    e.running = n;
                }
                e
            })
            .collect()
    }
}

// === impl Held ===

impl Held {
    /// The decode endpoint this hold counts against.
    pub fn address(&self) -> &str {
        &self.address
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let mut counts = self.owner.lock();
        if let Some(n) = counts.get_mut(&self.address) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                counts.remove(&self.address);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rngd_policy_core::Role;

    fn endpoint(address: &str, running: u32) -> Endpoint {
        let mut e = crate::source::local_endpoint(address.into(), Role::Decode, 512, &[]);
        e.running = running;
        e
    }

    #[test]
    fn holds_count_until_dropped_and_are_forgotten_at_zero() {
        let f = Arc::new(InFlight::default());
        let a = f.hold("10.0.0.1:8000");
        let b = f.hold("10.0.0.1:8000");
        let c = f.hold("10.0.0.2:8000");
        assert_eq!(f.count("10.0.0.1:8000"), 2);
        assert_eq!(f.count("10.0.0.2:8000"), 1);
        assert_eq!(a.address(), "10.0.0.1:8000");
        drop(a);
        assert_eq!(f.count("10.0.0.1:8000"), 1);
        drop((b, c));
        assert_eq!(f.count("10.0.0.1:8000"), 0);
        assert_eq!(f.tracked(), 0, "no entry outlives its last hold");
    }

    #[test]
    fn the_snapshot_sees_the_larger_of_scrape_and_count() {
        let f = Arc::new(InFlight::default());
        let snap: Arc<[Endpoint]> = vec![endpoint("a:1", 0), endpoint("b:1", 3)].into();
        // Nothing held: the very same snapshot.
        assert!(Arc::ptr_eq(&f.apply(Arc::clone(&snap)), &snap));
        let _h: Vec<Held> = (0..2).map(|_| f.hold("b:1")).collect();
        // Held below the scrape: still the same snapshot.
        assert!(Arc::ptr_eq(&f.apply(Arc::clone(&snap)), &snap));
        let _a = f.hold("a:1");
        let seen = f.apply(Arc::clone(&snap));
        assert!(!Arc::ptr_eq(&seen, &snap));
        assert_eq!(seen[0].running, 1, "the count raises a stale zero");
        assert_eq!(seen[1].running, 3, "a larger scrape stands");
        assert_eq!(snap[0].running, 0, "the shared snapshot is untouched");
    }
}
