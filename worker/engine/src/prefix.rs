//! The prefix cache of the CPU engine: KV of full blocks of `block_size`
//! positions, named by a chained hash, reused by later prefills that start
//! with the same tokens.
//!
//! A cached block is an immutable copy of its positions in the wire layout
//! (bf16: per layer K `[kv_heads, head_dim, block]`, V `[kv_heads, block,
//! head_dim]`). A prefill that hits copies the blocks into its own sequence
//! cache and computes only the rest, so running sequences never share or
//! write a cached block; every cached block is unreferenced and may be
//! evicted, least recently used first, to keep the bytes held under the
//! budget. Within a chain the parents are always more recently used than
//! their children, so a chain is evicted from its tail.
//!
//! The hash of block `i` is the first 8 bytes (little-endian) of
//! SHA-256(parent hash ‖ extra keys ‖ token ids), the parent of block 0 being
//! the model identity's own hash; the extra keys of block 0 are the
//! request's `cache_salt` (none for the others; the chain carries it). The
//! stored tokens and parent are compared on every hit, so a hash collision
//! can never give another prompt's KV.
//!
//! An optional [`PrefixEventSink`] hears every block stored and removed and
//! every reset: the hook a KV-event publisher attaches to.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use rngd_kv_wire::KvLayout;
use sha2::{Digest, Sha256};

use crate::kv::SeqCache;

/// Default of [`PrefixCacheOptions::block_size`] (vLLM's).
pub const DEFAULT_BLOCK_SIZE: usize = 16;

/// Default of [`PrefixCacheOptions::max_bytes`]: 256 MiB (SmolLM2-135M:
/// 728 blocks of 16 positions, 11,648 positions, ~23 full contexts of 512).
pub const DEFAULT_PREFIX_CACHE_BYTES: u64 = 256 << 20;

/// How the engine keeps prompts' KV for reuse.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefixCacheOptions {
    /// Reuse the KV of cached prompt prefixes (`--enable-prefix-caching`,
    /// default on; `--no-enable-prefix-caching` turns it off).
    pub enabled: bool,
    /// Positions per block (`--block-size`, default 16); only full blocks
    /// are cached and reused.
    pub block_size: usize,
    /// Bytes the cached blocks may hold at most (`--prefix-cache-bytes`,
    /// default 256 MiB); least recently used blocks are evicted past it.
    pub max_bytes: u64,
}

impl Default for PrefixCacheOptions {
    fn default() -> Self {
        PrefixCacheOptions {
            enabled: true,
            block_size: DEFAULT_BLOCK_SIZE,
            max_bytes: DEFAULT_PREFIX_CACHE_BYTES,
        }
    }
}

/// A block's name.
pub type BlockHash = u64;

/// What happened to the cache, for a KV-event publisher.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PrefixEvent {
    /// Blocks entered the cache: a chain, each block the parent of the next.
    BlockStored {
        /// The new blocks' hashes, in chain order.
        hashes: Vec<BlockHash>,
        /// The parent of the first one (`None`: it starts a prompt).
        parent: Option<BlockHash>,
        /// Their tokens, `block_size` per block.
        token_ids: Vec<u32>,
        /// Positions per block.
        block_size: usize,
        /// vLLM's `cache_salt` of the prompt, when the chain starts it
        /// (`parent` is `None`): its blocks' KV is keyed under the salt,
        /// and a router must key it so too (vLLM publishes it in the first
        /// block's `extra_keys`).
        salt: Option<String>,
    },
    /// Blocks left the cache (evicted).
    BlockRemoved {
        /// Their hashes.
        hashes: Vec<BlockHash>,
    },
    /// Every block was dropped ([`crate::cpu::CpuEngine::reset_prefix_cache`]).
    AllCleared,
}

/// Hears the cache's events (called on the engine's thread: keep it short).
pub trait PrefixEventSink: Send + Sync {
    /// One event.
    fn publish(&self, event: PrefixEvent);
}

/// Counters and sizes of a prefix cache.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixCacheStats {
    /// Prompt tokens looked up (every prefill's prompt length).
    pub queries: u64,
    /// Of those, tokens found cached (not computed).
    pub hits: u64,
    /// Blocks held now.
    pub blocks: usize,
    /// Blocks the budget holds.
    pub capacity_blocks: usize,
    /// Positions per block.
    pub block_size: usize,
    /// Bytes of one block.
    pub block_bytes: usize,
    /// Bytes held now (`blocks × block_bytes`).
    pub bytes: u64,
}

struct Block {
    parent: Option<BlockHash>,
    tokens: Box<[u32]>,
    data: Box<[u16]>,
    /// Its key in the LRU order.
    tick: u64,
}

/// The cache (owned behind a mutex by the engine; see the module docs).
pub(crate) struct PrefixCache {
    block_size: usize,
    capacity: usize,
    layout: KvLayout,
    /// The parent of every prompt's first block: the model identity's hash.
    root: BlockHash,
    blocks: HashMap<BlockHash, Block>,
    lru: BTreeMap<u64, BlockHash>,
    tick: u64,
    queries: u64,
    hits: u64,
    sink: Option<Arc<dyn PrefixEventSink>>,
}

/// Bytes of one block of `block_size` positions in `layout`.
pub fn block_bytes(layout: KvLayout, block_size: usize) -> usize {
    layout.layers * 2 * layout.kv_heads * layout.head_dim * block_size * 2
}

impl PrefixCache {
    /// An empty cache for `layout`; `model` names the model (its identity
    /// enters every hash).
    pub(crate) fn new(opts: &PrefixCacheOptions, layout: KvLayout, model: &str) -> Self {
        let block_size = opts.block_size.max(1);
        let capacity = if opts.enabled {
            (opts.max_bytes / block_bytes(layout, block_size) as u64) as usize
        } else {
            0
        };
        let mut h = Sha256::new();
        h.update(b"rngd-pd prefix cache\0");
        h.update(model.as_bytes());
        h.update([0]);
        for n in [
            layout.layers,
            layout.kv_heads,
            layout.head_dim,
            layout.seq_len,
            block_size,
        ] {
            h.update((n as u64).to_le_bytes());
        }
        PrefixCache {
            block_size,
            capacity,
            layout,
            root: first8(&h.finalize()),
            blocks: HashMap::new(),
            lru: BTreeMap::new(),
            tick: 0,
            queries: 0,
            hits: 0,
            sink: None,
        }
    }

    /// Whether blocks are kept at all (enabled and a budget of one block or more).
    pub(crate) fn enabled(&self) -> bool {
        self.capacity > 0
    }

    /// Positions per block.
    pub(crate) fn block_size(&self) -> usize {
        self.block_size
    }

    /// Attaches (or detaches) the event sink.
    pub(crate) fn set_sink(&mut self, sink: Option<Arc<dyn PrefixEventSink>>) {
        self.sink = sink;
    }

    /// The hashes of the full blocks of `tokens`.
    pub(crate) fn hashes(&self, tokens: &[u32], salt: Option<&str>) -> Vec<BlockHash> {
        let mut parent = self.root;
        tokens
            .chunks_exact(self.block_size)
            .enumerate()
            .map(|(i, block)| {
                let mut h = Sha256::new();
                h.update(parent.to_le_bytes());
                match (i, salt) {
                    (0, Some(s)) => {
                        h.update([1]);
                        h.update((s.len() as u64).to_le_bytes());
                        h.update(s.as_bytes());
                    }
                    _ => h.update([0]),
                }
                for t in block {
                    h.update(t.to_le_bytes());
                }
                parent = first8(&h.finalize());
                parent
            })
            .collect()
    }

    /// A prefill of `tokens` (with their block `hashes`): counts the query,
    /// copies the longest cached run of full blocks from token 0 (at most
    /// `max_blocks`) into `cache` (which must be empty) and returns the
    /// positions it holds now.
    pub(crate) fn load(
        &mut self,
        tokens: &[u32],
        hashes: &[BlockHash],
        max_blocks: usize,
        cache: &mut SeqCache,
    ) -> usize {
        self.queries += tokens.len() as u64;
        let b = self.block_size;
        let n = self.matched(tokens, hashes, max_blocks);
        for (i, h) in hashes[..n].iter().enumerate() {
            copy_in(&self.blocks[h].data, self.layout, b, i * b, cache);
        }
        cache.tokens = n * b;
        self.touch_chain(&hashes[..n]);
        self.hits += (n * b) as u64;
        n * b
    }

    /// How many full blocks of `tokens` (with their block `hashes`), from
    /// token 0 and at most `max_blocks`, [`Self::load`] would copy now; reads
    /// only (no statistic, no recency).
    pub(crate) fn matched(&self, tokens: &[u32], hashes: &[BlockHash], max_blocks: usize) -> usize {
        let b = self.block_size;
        let mut n = 0;
        let mut parent = None;
        for (i, h) in hashes.iter().take(max_blocks).enumerate() {
            match self.blocks.get(h) {
                Some(blk) if blk.parent == parent && *blk.tokens == tokens[i * b..(i + 1) * b] => {
                    n += 1;
                    parent = Some(*h);
                }
                _ => break,
            }
        }
        n
    }

    /// Keeps the full blocks of `cache`'s positions (`tokens` are their
    /// ids, `hashes` their names): the ones not held yet are copied in, the
    /// whole chain becomes the most recently used, least recently used
    /// blocks of other chains are evicted to make room. A chain longer than
    /// the budget keeps its first blocks. `salt`: the `cache_salt` the
    /// `hashes` were computed with (published with a chain that starts the
    /// prompt).
    pub(crate) fn store(
        &mut self,
        tokens: &[u32],
        hashes: &[BlockHash],
        cache: &SeqCache,
        salt: Option<&str>,
    ) {
        if !self.enabled() {
            return;
        }
        let b = self.block_size;
        let full = (cache.tokens / b).min(hashes.len()).min(self.capacity);
        let mut stored = Vec::new();
        let mut stored_parent = None;
        let mut stored_tokens = Vec::new();
        let mut parent = None;
        for (i, h) in hashes[..full].iter().enumerate() {
            let ids = &tokens[i * b..(i + 1) * b];
            match self.blocks.get(h) {
                Some(blk) if blk.parent == parent && *blk.tokens == *ids => {}
                // A collision with another chain's block: the chain stops here.
                Some(_) => break,
                None => {
                    self.touch_chain(&hashes[..i]);
                    self.make_room();
                    self.tick += 1;
                    self.blocks.insert(
                        *h,
                        Block {
                            parent,
                            tokens: ids.into(),
                            data: copy_out(cache, b, i * b),
                            tick: self.tick,
                        },
                    );
                    self.lru.insert(self.tick, *h);
                    if stored.is_empty() {
                        stored_parent = parent;
                    }
                    stored.push(*h);
                    stored_tokens.extend_from_slice(ids);
                }
            }
            parent = Some(*h);
        }
        let kept = hashes[..full]
            .iter()
            .take_while(|h| self.blocks.contains_key(h))
            .count();
        self.touch_chain(&hashes[..kept]);
        if !stored.is_empty()
            && let Some(s) = &self.sink
        {
            s.publish(PrefixEvent::BlockStored {
                hashes: stored,
                parent: stored_parent,
                token_ids: stored_tokens,
                block_size: b,
                salt: salt.filter(|_| stored_parent.is_none()).map(str::to_string),
            });
        }
    }

    /// Drops every block (none is ever referenced by a running sequence).
    pub(crate) fn reset(&mut self) {
        self.blocks.clear();
        self.lru.clear();
        if let Some(s) = &self.sink {
            s.publish(PrefixEvent::AllCleared);
        }
    }

    /// Counters and sizes now.
    pub(crate) fn stats(&self) -> PrefixCacheStats {
        let block_bytes = block_bytes(self.layout, self.block_size);
        PrefixCacheStats {
            queries: self.queries,
            hits: self.hits,
            blocks: self.blocks.len(),
            capacity_blocks: self.capacity,
            block_size: self.block_size,
            block_bytes,
            bytes: (self.blocks.len() * block_bytes) as u64,
        }
    }

    /// Makes `chain` the most recently used, its first block the newest.
    fn touch_chain(&mut self, chain: &[BlockHash]) {
        for h in chain.iter().rev() {
            if let Some(blk) = self.blocks.get_mut(h) {
                self.lru.remove(&blk.tick);
                self.tick += 1;
                blk.tick = self.tick;
                self.lru.insert(self.tick, *h);
            }
        }
    }

    /// Evicts least recently used blocks until one more fits.
    fn make_room(&mut self) {
        let mut removed = Vec::new();
        while self.blocks.len() >= self.capacity {
            let Some((_, h)) = self.lru.pop_first() else {
                break;
            };
            self.blocks.remove(&h);
            removed.push(h);
        }
        if !removed.is_empty()
            && let Some(s) = &self.sink
        {
            s.publish(PrefixEvent::BlockRemoved { hashes: removed });
        }
    }
}

fn first8(digest: &[u8]) -> BlockHash {
    let mut b = [0u8; 8];
    b.copy_from_slice(&digest[..8]);
    u64::from_le_bytes(b)
}

/// Positions `at..at + b` of `cache` as a block (per layer: K rows, then V heads).
fn copy_out(cache: &SeqCache, b: usize, at: usize) -> Box<[u16]> {
    let l = cache.layout;
    let mut out = Vec::with_capacity(block_bytes(l, b) / 2);
    for layer in 0..l.layers {
        for row in 0..l.kv_heads * l.head_dim {
            let s = row * l.seq_len + at;
            out.extend_from_slice(&cache.k[layer][s..s + b]);
        }
        for h in 0..l.kv_heads {
            let s = l.v_offset(h, at, 0);
            out.extend_from_slice(&cache.v[layer][s..s + b * l.head_dim]);
        }
    }
    out.into_boxed_slice()
}

/// A block (of [`copy_out`]'s layout) into positions `at..at + b` of `cache`.
fn copy_in(data: &[u16], l: KvLayout, b: usize, at: usize, cache: &mut SeqCache) {
    let mut off = 0;
    for layer in 0..l.layers {
        for row in 0..l.kv_heads * l.head_dim {
            let s = row * l.seq_len + at;
            cache.k[layer][s..s + b].copy_from_slice(&data[off..off + b]);
            off += b;
        }
        let n = b * l.head_dim;
        for h in 0..l.kv_heads {
            let s = l.v_offset(h, at, 0);
            cache.v[layer][s..s + n].copy_from_slice(&data[off..off + n]);
            off += n;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rngd_kv_wire::Dtype;

    fn layout() -> KvLayout {
        KvLayout {
            layers: 2,
            kv_heads: 2,
            head_dim: 4,
            seq_len: 16,
            dtype: Dtype::Bf16,
        }
    }

    fn filled(tokens: usize) -> SeqCache {
        let mut c = SeqCache::new(layout());
        for pos in 0..tokens {
            for layer in 0..2 {
                let k: Vec<f32> = (0..8)
                    .map(|i| (pos * 100 + layer * 10 + i) as f32)
                    .collect();
                let v: Vec<f32> = k.iter().map(|x| -x).collect();
                c.write(layer, pos, &k, &v);
            }
        }
        c.tokens = tokens;
        c
    }

    fn opts(blocks: usize, b: usize) -> PrefixCacheOptions {
        PrefixCacheOptions {
            enabled: true,
            block_size: b,
            max_bytes: (blocks * block_bytes(layout(), b)) as u64,
        }
    }

    #[test]
    fn blocks_round_trip_and_only_full_blocks_are_kept() {
        let mut pc = PrefixCache::new(&opts(8, 4), layout(), "m");
        let toks: Vec<u32> = (0..11).collect();
        let src = filled(11);
        let hs = pc.hashes(&toks, None);
        assert_eq!(hs.len(), 2);
        pc.store(&toks, &hs, &src, None);
        assert_eq!(pc.stats().blocks, 2);
        let mut dst = SeqCache::new(layout());
        assert_eq!(pc.load(&toks, &hs, 2, &mut dst), 8);
        let (a, b) = (src.export(), {
            let mut s = src.clone();
            s.tokens = 8;
            s.export()
        });
        assert_ne!(a, b);
        assert_eq!(dst.export(), b);
        assert_eq!(pc.stats().hits, 8);
        assert_eq!(pc.stats().queries, 11);
    }

    #[test]
    fn salt_model_and_parent_change_every_hash() {
        let pc = PrefixCache::new(&opts(8, 4), layout(), "m");
        let other = PrefixCache::new(&opts(8, 4), layout(), "n");
        let toks: Vec<u32> = (0..8).collect();
        let plain = pc.hashes(&toks, None);
        assert_ne!(plain, pc.hashes(&toks, Some("a")));
        assert_ne!(pc.hashes(&toks, Some("a")), pc.hashes(&toks, Some("b")));
        assert_ne!(plain, other.hashes(&toks, None));
        // Same second block after a different first one: another name.
        let mut t2 = toks.clone();
        t2[0] = 99;
        assert_ne!(plain[1], pc.hashes(&t2, None)[1]);
    }

    #[test]
    fn eviction_is_lru_from_the_tail_and_holds_the_budget() {
        let mut pc = PrefixCache::new(&opts(3, 4), layout(), "m");
        let a: Vec<u32> = (0..16).collect();
        let src = filled(16);
        let ha = pc.hashes(&a, None);
        pc.store(&a, &ha, &src, None);
        // A chain longer than the budget keeps its first blocks.
        assert_eq!(pc.stats().blocks, 3);
        let mut d = SeqCache::new(layout());
        assert_eq!(pc.load(&a, &ha, 4, &mut d), 12);
        // Another prompt of two blocks evicts a's tail first.
        let b: Vec<u32> = (100..108).collect();
        let hb = pc.hashes(&b, None);
        pc.store(&b, &hb, &filled(8), None);
        assert_eq!(pc.stats().blocks, 3);
        assert!(pc.stats().bytes <= opts(3, 4).max_bytes);
        let mut d = SeqCache::new(layout());
        assert_eq!(pc.load(&a, &ha, 4, &mut d), 4);
        pc.reset();
        assert_eq!(pc.stats().blocks, 0);
    }
}
