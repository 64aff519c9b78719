//! The events and their MessagePack encoding, byte for byte as vLLM's
//! `msgspec` encoder writes `KVEventBatch` since vLLM switched its event
//! structs to maps (vllm-project/vllm#42892):
//!
//! - the batch is an array `[ts, [event, …], data_parallel_rank]`
//!   (`EventBatch` keeps `array_like=True`, every field written);
//! - each event is a map whose first key is `type` (the struct's tag: its
//!   class name), then its fields in declaration order; fields whose value
//!   is their default (`None`) and that have one are omitted
//!   (`omit_defaults=True`);
//! - integers take msgspec's smallest form (positive ones as fixint / uint8 /
//!   16 / 32 / 64), floats are float64, strings fixstr / str8 / 16 / 32.

/// vLLM's `MEDIUM_GPU`: the engine's own KV memory (not an offload tier).
pub const MEDIUM_GPU: &str = "GPU";

/// One KV-cache event (vLLM's `BlockStored`, `BlockRemoved`,
/// `AllBlocksCleared`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// Full blocks entered the cache, as one chain.
    BlockStored {
        /// Their hashes, in chain order.
        block_hashes: Vec<u64>,
        /// The parent of the first block (`None`: the chain starts a prompt).
        parent_block_hash: Option<u64>,
        /// Their tokens, `block_size` per block.
        token_ids: Vec<u32>,
        /// Tokens per block.
        block_size: u32,
        /// The cache tier (`"GPU"` for the engine's own cache, as in vLLM).
        medium: Option<String>,
        /// The prompt's `cache_salt`, on a chain that starts it: written as
        /// `extra_keys` (`[[salt], nil, …]`, one entry per block, as vLLM).
        salt: Option<String>,
    },
    /// Blocks left the cache.
    BlockRemoved {
        /// Their hashes.
        block_hashes: Vec<u64>,
        /// The cache tier.
        medium: Option<String>,
    },
    /// Every block was dropped.
    AllBlocksCleared,
}

/// One published batch: `[ts, events, data_parallel_rank]`.
#[derive(Debug, Clone, PartialEq)]
pub struct KvEventBatch {
    /// Seconds since the Unix epoch (Python's `time.time()`).
    pub ts: f64,
    /// The events, in the order they happened.
    pub events: Vec<KvEvent>,
    /// The data-parallel rank (always 0 here: one engine per worker).
    pub data_parallel_rank: Option<i64>,
}

impl KvEventBatch {
    /// The MessagePack payload (the message's third frame).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(64 + self.events.len() * 64);
        let w = &mut out;
        // An array-like struct is written whole: msgspec's omit_defaults
        // leaves no field out of it (an unset rank is nil).
        array_header(w, 3);
        float(w, self.ts);
        events(w, &self.events);
        match self.data_parallel_rank {
            Some(rank) => int(w, rank),
            None => nil(w),
        }
        out
    }
}

fn events(w: &mut Vec<u8>, events: &[KvEvent]) {
    array_header(w, events.len());
    for e in events {
        event(w, e);
    }
}

fn event(w: &mut Vec<u8>, e: &KvEvent) {
    match e {
        KvEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            medium,
            salt,
        } => {
            // BlockStored's fields without a default are always written:
            // block_hashes, parent_block_hash, token_ids, block_size,
            // lora_id, medium, lora_name; extra_keys only for a salted
            // chain; group_idx, kv_cache_spec_kind and
            // kv_cache_spec_sliding_window default to None and are left out.
            map_header(w, if salt.is_some() { 9 } else { 8 });
            str(w, "type");
            str(w, "BlockStored");
            str(w, "block_hashes");
            uints(w, block_hashes.iter().copied());
            str(w, "parent_block_hash");
            opt_uint(w, *parent_block_hash);
            str(w, "token_ids");
            uints(w, token_ids.iter().map(|&t| u64::from(t)));
            str(w, "block_size");
            uint(w, u64::from(*block_size));
            str(w, "lora_id");
            nil(w);
            str(w, "medium");
            opt_str(w, medium.as_deref());
            str(w, "lora_name");
            nil(w);
            if let Some(salt) = salt {
                str(w, "extra_keys");
                array_header(w, block_hashes.len());
                for i in 0..block_hashes.len() {
                    if i == 0 {
                        array_header(w, 1);
                        str(w, salt);
                    } else {
                        nil(w);
                    }
                }
            }
        }
        KvEvent::BlockRemoved {
            block_hashes,
            medium,
        } => {
            map_header(w, 3);
            str(w, "type");
            str(w, "BlockRemoved");
            str(w, "block_hashes");
            uints(w, block_hashes.iter().copied());
            str(w, "medium");
            opt_str(w, medium.as_deref());
        }
        KvEvent::AllBlocksCleared => {
            map_header(w, 1);
            str(w, "type");
            str(w, "AllBlocksCleared");
        }
    }
}

fn uints(w: &mut Vec<u8>, v: impl ExactSizeIterator<Item = u64>) {
    array_header(w, v.len());
    for x in v {
        uint(w, x);
    }
}

fn opt_uint(w: &mut Vec<u8>, v: Option<u64>) {
    match v {
        Some(x) => uint(w, x),
        None => nil(w),
    }
}

fn opt_str(w: &mut Vec<u8>, v: Option<&str>) {
    match v {
        Some(s) => str(w, s),
        None => nil(w),
    }
}

fn nil(w: &mut Vec<u8>) {
    w.push(0xc0);
}

fn uint(w: &mut Vec<u8>, x: u64) {
    if x < 0x80 {
        w.push(x as u8);
    } else if x <= u64::from(u8::MAX) {
        w.extend_from_slice(&[0xcc, x as u8]);
    } else if x <= u64::from(u16::MAX) {
        w.push(0xcd);
        w.extend_from_slice(&(x as u16).to_be_bytes());
    } else if x <= u64::from(u32::MAX) {
        w.push(0xce);
        w.extend_from_slice(&(x as u32).to_be_bytes());
    } else {
        w.push(0xcf);
        w.extend_from_slice(&x.to_be_bytes());
    }
}

fn int(w: &mut Vec<u8>, x: i64) {
    if x >= 0 {
        return uint(w, x as u64);
    }
    if x >= -32 {
        w.push(x as i8 as u8);
    } else if x >= i64::from(i8::MIN) {
        w.extend_from_slice(&[0xd0, x as i8 as u8]);
    } else if x >= i64::from(i16::MIN) {
        w.push(0xd1);
        w.extend_from_slice(&(x as i16).to_be_bytes());
    } else if x >= i64::from(i32::MIN) {
        w.push(0xd2);
        w.extend_from_slice(&(x as i32).to_be_bytes());
    } else {
        w.push(0xd3);
        w.extend_from_slice(&x.to_be_bytes());
    }
}

fn float(w: &mut Vec<u8>, x: f64) {
    w.push(0xcb);
    w.extend_from_slice(&x.to_bits().to_be_bytes());
}

fn str(w: &mut Vec<u8>, s: &str) {
    let n = s.len();
    if n < 32 {
        w.push(0xa0 | n as u8);
    } else if n <= usize::from(u8::MAX) {
        w.extend_from_slice(&[0xd9, n as u8]);
    } else if n <= usize::from(u16::MAX) {
        w.push(0xda);
        w.extend_from_slice(&(n as u16).to_be_bytes());
    } else {
        w.push(0xdb);
        w.extend_from_slice(&(n as u32).to_be_bytes());
    }
    w.extend_from_slice(s.as_bytes());
}

fn array_header(w: &mut Vec<u8>, n: usize) {
    if n < 16 {
        w.push(0x90 | n as u8);
    } else if n <= usize::from(u16::MAX) {
        w.push(0xdc);
        w.extend_from_slice(&(n as u16).to_be_bytes());
    } else {
        w.push(0xdd);
        w.extend_from_slice(&(n as u32).to_be_bytes());
    }
}

fn map_header(w: &mut Vec<u8>, n: usize) {
    if n < 16 {
        w.push(0x80 | n as u8);
    } else if n <= usize::from(u16::MAX) {
        w.push(0xde);
        w.extend_from_slice(&(n as u16).to_be_bytes());
    } else {
        w.push(0xdf);
        w.extend_from_slice(&(n as u32).to_be_bytes());
    }
}
