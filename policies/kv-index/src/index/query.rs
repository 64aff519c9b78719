//! The index's queries: the cached prefix of a prompt on one endpoint or on
//! all at once (the key chain computed once per block size, looked up in the
//! key → endpoints map), and the counters' snapshot.

use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

use super::{Few, Health, Index};
use crate::keys::{chain_key, root_key};
use crate::stats::{EndpointStats, IndexStats};

impl Index {
    /// The cached prefix of `token_ids` on one endpoint, in tokens: the
    /// longest run of full blocks from token 0 it holds. `None` when the
    /// endpoint is unknown or has no cache information (not
    /// [`Health::Live`]); `Some(0)` when it is live and holds none of it.
    /// The matched chain becomes the most recently used.
    pub fn match_prefix(&mut self, endpoint: &str, token_ids: &[u32]) -> Option<usize> {
        self.match_prefix_salted(endpoint, token_ids, None)
    }

    /// [`Index::match_prefix`] of a prompt sent with vLLM's `cache_salt`
    /// `salt`: only blocks stored under the same salt match.
    pub fn match_prefix_salted(
        &mut self,
        endpoint: &str,
        token_ids: &[u32],
        salt: Option<&str>,
    ) -> Option<usize> {
        let slot = *self.ids.get(endpoint)?;
        let e = self.endpoints.get(&slot)?;
        if e.health != Health::Live {
            return None;
        }
        let Some(bs) = e.block_size else {
            return Some(0);
        };
        let bs = bs as usize;
        let mut parent = root_key(salt);
        let mut n = 0;
        let mut last = None;
        for block in token_ids.chunks_exact(bs) {
            let key = chain_key(parent, block);
            if !e.blocks.contains_key(&key) {
                break;
            }
            n += 1;
            last = Some(key);
            parent = key;
        }
        if let Some(last) = last {
            self.touch_chain(slot, last);
        }
        Some(n * bs)
    }

    /// [`Index::match_prefix`] for every endpoint at once, in id order, the
    /// key chain computed once per block size and looked up in the key →
    /// endpoints map.
    pub fn match_all(&mut self, token_ids: &[u32]) -> Vec<(String, Option<usize>)> {
        self.match_all_salted(token_ids, None)
    }

    /// [`Index::match_all`] of a prompt sent with `salt` (vLLM's
    /// `cache_salt`): only blocks stored under the same salt match.
    pub fn match_all_salted(
        &mut self,
        token_ids: &[u32],
        salt: Option<&str>,
    ) -> Vec<(String, Option<usize>)> {
        let mut by_size: BTreeMap<u32, HashMap<u32, usize>> = BTreeMap::new();
        for (slot, e) in &self.endpoints {
            if e.health == Health::Live
                && let Some(bs) = e.block_size
            {
                by_size.entry(bs).or_default().insert(*slot, 0);
            }
        }
        let mut touched: HashMap<u32, u64> = HashMap::new();
        for (bs, runs) in &mut by_size {
            let mut parent = root_key(salt);
            for (i, block) in token_ids.chunks_exact(*bs as usize).enumerate() {
                let key = chain_key(parent, block);
                let mut any = false;
                for s in self.holders.get(&key).map(Few::as_slice).unwrap_or(&[]) {
                    if let Some(run) = runs.get_mut(s)
                        && *run == i
                    {
                        *run = i + 1;
                        any = true;
                    }
                }
                if !any {
                    break;
                }
                parent = key;
                // The last key of each run still growing, for the LRU touch.
                for (s, run) in runs.iter() {
                    if *run == i + 1 {
                        touched.insert(*s, key);
                    }
                }
            }
        }
        for (slot, key) in touched {
            self.touch_chain(slot, key);
        }
        self.ids
            .iter()
            .map(|(id, slot)| {
                let e = &self.endpoints[slot];
                let m = match (e.health, e.block_size) {
                    (Health::Live, None) => Some(0),
                    (Health::Live, Some(bs)) => by_size
                        .get(&bs)
                        .and_then(|r| r.get(slot))
                        .map(|run| run * bs as usize),
                    _ => None,
                };
                (id.clone(), m)
            })
            .collect()
    }

    /// A snapshot of the counters and states.
    pub fn stats(&self, now: Instant) -> IndexStats {
        let since = |t: Option<Instant>| t.map(|t| now.saturating_duration_since(t).as_secs_f64());
        let mut newest: Option<Instant> = None;
        let mut all_live = true;
        let endpoints = self
            .ids
            .iter()
            .map(|(id, slot)| {
                let e = &self.endpoints[slot];
                newest = newest.max(e.last_batch);
                all_live &= e.health == Health::Live;
                (
                    id.clone(),
                    EndpointStats::from_counters(
                        &e.counters,
                        e.blocks.len() as u64,
                        since(e.last_batch),
                        e.health,
                    ),
                )
            })
            .collect();
        IndexStats {
            total: EndpointStats::from_counters(
                &self.total,
                self.lru.len() as u64,
                since(newest),
                if all_live {
                    Health::Live
                } else {
                    Health::Unknown
                },
            ),
            endpoints,
        }
    }
}
