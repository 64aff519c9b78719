//! [`Index`]: router block key → the endpoints holding it, per endpoint the
//! engine's block hashes (opaque ids) → router keys, its block size and its
//! [`Health`], and one LRU order over every (endpoint, block) under a block
//! cap. No sockets here: [`crate::KvIndexer`]'s thread feeds it batches, and
//! the unit tests drive it directly. The queries (match, stats) are in
//! `index/query.rs`.

use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use crate::decode::{Batch, BlockId, Event};
use crate::endpoint::Health;
use crate::keys::{ROOT_KEY, chain_key};
use crate::stats::{Counters, add};

use few::Few;

/// The cache tier of the engine's own KV memory (vLLM's `MEDIUM_GPU`).
pub const MEDIUM_GPU: &str = "GPU";

/// Ancestors touched at most when a chain is stored or matched (a chain
/// deeper than this has its oldest part aged first).
const MAX_TOUCH_DEPTH: usize = 4096;

/// Engine hashes kept per block at most (several name one block when the
/// engine hashes more than the tokens, e.g. per cache salt).
const MAX_ENGINE_IDS: usize = 16;

/// What applying one batch found.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Applied {
    /// Events applied.
    pub events: u64,
    /// Stored chains with an unknown parent.
    pub unknown_parents: u64,
    /// Events that could not be decoded.
    pub undecodable: u64,
    /// Blocks evicted by the cap while applying.
    pub evicted: u64,
}

#[derive(Debug)]
struct Block {
    /// The parent's router key ([`ROOT_KEY`], or a salted root, for a
    /// prompt's first block).
    parent: u64,
    /// Its place in the LRU order.
    tick: u64,
    /// The engine hashes naming it (usually one).
    engine: Few<BlockId>,
}

#[derive(Debug)]
struct Endpoint {
    id: String,
    counters: Arc<Counters>,
    block_size: Option<u32>,
    by_engine: HashMap<BlockId, u64>,
    blocks: HashMap<u64, Block>,
    /// Engine hashes deliberately not indexed (their children are not either,
    /// without counting an unknown parent).
    ignored: HashSet<BlockId>,
    health: Health,
    last_batch: Option<Instant>,
}

/// The index of every endpoint's cached blocks.
#[derive(Debug)]
pub struct Index {
    max_blocks: usize,
    endpoints: HashMap<u32, Endpoint>,
    ids: BTreeMap<String, u32>,
    next_slot: u32,
    holders: HashMap<u64, Few<u32>>,
    lru: BTreeMap<u64, (u32, u64)>,
    tick: u64,
    ignored_fifo: VecDeque<(u32, BlockId)>,
    total: Arc<Counters>,
}

impl Index {
    /// An empty index holding at most `max_blocks` (endpoint, block) pairs.
    pub fn new(max_blocks: usize) -> Self {
        Index {
            max_blocks: max_blocks.max(1),
            endpoints: HashMap::new(),
            ids: BTreeMap::new(),
            next_slot: 0,
            holders: HashMap::new(),
            lru: BTreeMap::new(),
            tick: 0,
            ignored_fifo: VecDeque::new(),
            total: Arc::new(Counters::default()),
        }
    }

    /// The counters of the whole index.
    pub fn total_counters(&self) -> &Arc<Counters> {
        &self.total
    }

    /// Adds an endpoint (state [`Health::Unknown`]) and returns its slot;
    /// an id already present is replaced (forgotten, then added anew).
    pub fn add_endpoint(&mut self, id: &str) -> u32 {
        self.remove_endpoint(id);
        let slot = self.next_slot;
        self.next_slot = self.next_slot.wrapping_add(1);
        self.endpoints.insert(
            slot,
            Endpoint {
                id: id.to_owned(),
                counters: Arc::new(Counters::default()),
                block_size: None,
                by_engine: HashMap::new(),
                blocks: HashMap::new(),
                ignored: HashSet::new(),
                health: Health::Unknown,
                last_batch: None,
            },
        );
        self.ids.insert(id.to_owned(), slot);
        slot
    }

    /// Forgets an endpoint and every block it held.
    pub fn remove_endpoint(&mut self, id: &str) -> bool {
        let Some(slot) = self.ids.remove(id) else {
            return false;
        };
        self.clear_slot(slot);
        self.endpoints.remove(&slot);
        true
    }

    /// The slot of an endpoint id.
    pub fn slot(&self, id: &str) -> Option<u32> {
        self.ids.get(id).copied()
    }

    /// The ids of the endpoints, in order.
    pub fn endpoint_ids(&self) -> Vec<String> {
        self.ids.keys().cloned().collect()
    }

    /// One endpoint's counters.
    pub fn counters(&self, slot: u32) -> Option<&Arc<Counters>> {
        self.endpoints.get(&slot).map(|e| &e.counters)
    }

    /// One endpoint's state.
    pub fn health(&self, slot: u32) -> Option<Health> {
        self.endpoints.get(&slot).map(|e| e.health)
    }

    /// Sets one endpoint's state.
    pub fn set_health(&mut self, slot: u32, health: Health) {
        if let Some(e) = self.endpoints.get_mut(&slot) {
            e.health = health;
        }
    }

    /// Blocks held now, over all endpoints.
    pub fn len(&self) -> usize {
        self.lru.len()
    }

    /// No block is held.
    pub fn is_empty(&self) -> bool {
        self.lru.is_empty()
    }

    /// Drops every block of one endpoint (its block size is kept).
    pub fn clear_slot(&mut self, slot: u32) {
        let Some(e) = self.endpoints.get_mut(&slot) else {
            return;
        };
        let blocks = std::mem::take(&mut e.blocks);
        e.by_engine.clear();
        e.ignored.clear();
        for (key, b) in blocks {
            self.lru.remove(&b.tick);
            unhold(&mut self.holders, key, slot);
        }
    }

    /// Applies one decoded batch to one endpoint: counts, keys, evictions,
    /// and the state changes the events themselves cause (a batch makes an
    /// [`Health::Unknown`] or [`Health::Stale`] endpoint live; an unknown
    /// parent marks it [`Health::UnknownParent`]; `AllBlocksCleared` makes a
    /// broken endpoint live again, its state known exactly from there).
    pub fn apply_batch(&mut self, slot: u32, batch: &Batch, now: Instant) -> Applied {
        let mut out = Applied::default();
        let Some(e) = self.endpoints.get_mut(&slot) else {
            return out;
        };
        e.last_batch = Some(now);
        if matches!(e.health, Health::Unknown | Health::Stale) {
            e.health = Health::Live;
        }
        let counters = Arc::clone(&e.counters);
        add(&counters.batches, 1);
        add(&self.total.batches, 1);
        for ev in &batch.events {
            match ev {
                Ok(ev) => {
                    out.events += 1;
                    let before = self.total.evicted_now();
                    if self.apply_event(slot, ev) {
                        out.unknown_parents += 1;
                    }
                    out.evicted += self.total.evicted_now() - before;
                }
                Err(_) => out.undecodable += 1,
            }
        }
        let both = |f: fn(&Counters) -> &std::sync::atomic::AtomicU64, n: u64| {
            add(f(&counters), n);
            add(f(&self.total), n);
        };
        both(|c| &c.events, out.events);
        both(|c| &c.unknown_parents, out.unknown_parents);
        both(|c| &c.undecodable, out.undecodable);
        out
    }

    /// Applies one event; true when it was a chain with an unknown parent.
    pub fn apply_event(&mut self, slot: u32, ev: &Event) -> bool {
        match ev {
            Event::AllBlocksCleared => {
                self.clear_slot(slot);
                if let Some(e) = self.endpoints.get_mut(&slot)
                    && e.health.is_broken()
                {
                    e.health = Health::Live;
                }
                false
            }
            Event::BlockRemoved {
                block_hashes,
                medium,
            } => {
                if !is_engine_medium(medium.as_deref()) {
                    return false;
                }
                for h in block_hashes {
                    self.remove_engine_id(slot, *h);
                }
                false
            }
            Event::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                medium,
                lora,
                extra_keys,
                salt,
            } => self.store(
                slot,
                block_hashes,
                (*parent_block_hash, salt.as_deref()),
                token_ids,
                *block_size,
                medium.as_deref(),
                *lora || *extra_keys,
            ),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn store(
        &mut self,
        slot: u32,
        hashes: &[BlockId],
        (parent, salt): (Option<BlockId>, Option<&str>),
        tokens: &[u32],
        block_size: u32,
        medium: Option<&str>,
        not_by_tokens: bool,
    ) -> bool {
        if !is_engine_medium(medium) {
            return false;
        }
        let Some(e) = self.endpoints.get_mut(&slot) else {
            return false;
        };
        let counters = Arc::clone(&e.counters);
        let n = hashes.len() as u64;
        let bs = block_size as usize;
        if tokens.len() != bs * hashes.len() {
            add(&counters.undecodable, 1);
            add(&self.total.undecodable, 1);
            self.ignore(slot, hashes);
            return false;
        }
        if e.block_size.is_some_and(|b| b != block_size) {
            tracing::warn!(endpoint = %e.id, old = ?e.block_size, new = block_size, "KV index: the block size changed; the endpoint's entries are dropped");
            self.clear_slot(slot);
        }
        let Some(e) = self.endpoints.get_mut(&slot) else {
            return false;
        };
        e.block_size = Some(block_size);
        let mut parent_key = match parent {
            None => crate::keys::root_key(salt),
            Some(p) => match e.by_engine.get(&p) {
                Some(k) => *k,
                None => {
                    let unknown = !e.ignored.contains(&p);
                    if unknown {
                        e.health = Health::UnknownParent;
                    } else {
                        add(&counters.ignored_blocks, n);
                        add(&self.total.ignored_blocks, n);
                    }
                    self.ignore(slot, hashes);
                    return unknown;
                }
            },
        };
        if not_by_tokens {
            add(&counters.ignored_blocks, n);
            add(&self.total.ignored_blocks, n);
            self.ignore(slot, hashes);
            return false;
        }
        let mut chain = Vec::with_capacity(hashes.len());
        for (h, block) in hashes.iter().zip(tokens.chunks_exact(bs)) {
            let key = chain_key(parent_key, block);
            self.remove_engine_id(slot, *h);
            let Some(e) = self.endpoints.get_mut(&slot) else {
                return false;
            };
            match e.blocks.get_mut(&key) {
                Some(b) if b.engine.as_slice().len() >= MAX_ENGINE_IDS => {
                    // Bounded: a further name of the same block is not kept
                    // (its children are then ignored, not unknown parents).
                    add(&counters.ignored_blocks, 1);
                    add(&self.total.ignored_blocks, 1);
                    self.ignore(slot, std::slice::from_ref(h));
                    parent_key = key;
                    continue;
                }
                Some(b) => {
                    b.engine.push(*h);
                    e.by_engine.insert(*h, key);
                }
                None => {
                    e.by_engine.insert(*h, key);
                    self.tick += 1;
                    e.blocks.insert(
                        key,
                        Block {
                            parent: parent_key,
                            tick: self.tick,
                            engine: Few::One(*h),
                        },
                    );
                    self.lru.insert(self.tick, (slot, key));
                    match self.holders.entry(key) {
                        Entry::Occupied(mut o) => o.get_mut().push(slot),
                        Entry::Vacant(v) => {
                            v.insert(Few::One(slot));
                        }
                    }
                    add(&counters.blocks_indexed, 1);
                    add(&self.total.blocks_indexed, 1);
                }
            }
            chain.push(key);
            parent_key = key;
        }
        if let Some(&last) = chain.last() {
            self.touch_chain(slot, last);
        }
        self.enforce_cap();
        false
    }

    /// Marks engine hashes as deliberately not indexed (bounded: the oldest
    /// marks are forgotten past `max_blocks` of them).
    fn ignore(&mut self, slot: u32, hashes: &[BlockId]) {
        for h in hashes {
            self.remove_engine_id(slot, *h);
            if let Some(e) = self.endpoints.get_mut(&slot)
                && e.ignored.insert(*h)
            {
                self.ignored_fifo.push_back((slot, *h));
            }
        }
        while self.ignored_fifo.len() > self.max_blocks {
            if let Some((s, h)) = self.ignored_fifo.pop_front()
                && let Some(e) = self.endpoints.get_mut(&s)
            {
                e.ignored.remove(&h);
            }
        }
    }

    /// Drops one engine hash; its block goes when no hash names it any more.
    fn remove_engine_id(&mut self, slot: u32, h: BlockId) {
        let Some(e) = self.endpoints.get_mut(&slot) else {
            return;
        };
        e.ignored.remove(&h);
        let Some(key) = e.by_engine.remove(&h) else {
            return;
        };
        let Some(b) = e.blocks.get_mut(&key) else {
            return;
        };
        if b.engine.remove(h) {
            let tick = b.tick;
            e.blocks.remove(&key);
            self.lru.remove(&tick);
            unhold(&mut self.holders, key, slot);
        }
    }

    /// Makes a chain the most recently used, its ancestors newer than their
    /// children, so the cap evicts chains from their tails.
    fn touch_chain(&mut self, slot: u32, last: u64) {
        let Some(e) = self.endpoints.get_mut(&slot) else {
            return;
        };
        let mut key = last;
        for _ in 0..MAX_TOUCH_DEPTH {
            let Some(b) = e.blocks.get_mut(&key) else {
                break;
            };
            self.lru.remove(&b.tick);
            self.tick += 1;
            b.tick = self.tick;
            self.lru.insert(self.tick, (slot, key));
            if b.parent == ROOT_KEY {
                break;
            }
            key = b.parent;
        }
    }

    /// Evicts the least recently used blocks past the cap; their engine
    /// hashes are marked ignored, so a later child is not an unknown parent.
    fn enforce_cap(&mut self) {
        while self.lru.len() > self.max_blocks {
            let Some((_, (slot, key))) = self.lru.pop_first() else {
                break;
            };
            unhold(&mut self.holders, key, slot);
            let Some(e) = self.endpoints.get_mut(&slot) else {
                continue;
            };
            let Some(b) = e.blocks.remove(&key) else {
                continue;
            };
            for h in b.engine.as_slice() {
                e.by_engine.remove(h);
            }
            add(&e.counters.evicted, 1);
            add(&self.total.evicted, 1);
            self.ignore(slot, b.engine.as_slice());
        }
    }

    /// The block size an endpoint's events carry.
    pub fn block_size(&self, slot: u32) -> Option<u32> {
        self.endpoints.get(&slot).and_then(|e| e.block_size)
    }
}

impl Counters {
    fn evicted_now(&self) -> u64 {
        self.evicted.load(std::sync::atomic::Ordering::Relaxed)
    }
}

fn is_engine_medium(m: Option<&str>) -> bool {
    m.is_none_or(|m| m.eq_ignore_ascii_case(MEDIUM_GPU))
}

fn unhold(holders: &mut HashMap<u64, Few<u32>>, key: u64, slot: u32) {
    if let Some(v) = holders.get_mut(&key)
        && v.remove(slot)
    {
        holders.remove(&key);
    }
}

mod few;
mod query;
#[cfg(test)]
mod tests;
