//! The Mooncake conversation trace (JSON lines: `timestamp` ms,
//! `input_length`, `output_length`, `hash_ids`, one id per 512-token block
//! of the prompt): parsing it, mapping each block id to a fixed run of token
//! ids, cutting prompts to the compiled context with whole leading blocks,
//! and the trace's own prefix reuse share (an infinite cache on one worker).
//!
//! - **Blocks**: a trace block (512 tokens) becomes `block_tokens` (16) token
//!   ids, a function of its id alone ([`block_ids`]): two requests that share
//!   leading ids share exactly that prompt prefix, as in the trace.
//! - **Lengths**: `input_length` and `output_length` are scaled by the same
//!   factor (`block_tokens / 512`, rounded up); when prompt + `max_tokens`
//!   exceed the budget the prompt is cut to the whole leading blocks that
//!   fit ([`cut`]), which keeps the prefix structure.
//! - **Reuse** ([`reuse`]): for each request in order, the longest run of its
//!   leading full blocks whose chain from block 0 was sent before, over its
//!   prompt tokens.
//! - **History** ([`history`]): for a window that starts later in the
//!   trace, the earlier turns of its conversations (rows before the window),
//!   so the caches can hold what a server running since the trace's start
//!   would hold when the window begins.

use std::collections::HashMap;
use std::time::Duration;

use serde::Deserialize;

use crate::Error;

/// Tokens of one block in the trace (`hash_ids` has one id per this many).
pub const TRACE_BLOCK_TOKENS: u32 = 512;

/// Lowest token id a block maps to: far above SmolLM2's special tokens (ids
/// below 20), in its ordinary vocabulary (49,152 ids).
pub const TOKEN_LO: u32 = 1000;

/// One past the highest token id a block maps to.
pub const TOKEN_HI: u32 = 40_000;

/// The engine's fewest computed rows (`MIN_ROWS` in
/// `worker/engine/src/cpu.rs`): a prefill computes at least the last prompt
/// token and at least this many rows, so a fully cached prompt reuses one
/// block less. Used by [`reuse`] for the `capped` figure only.
pub const ENGINE_MIN_ROWS: u32 = 8;

/// Shared leading full blocks that make an earlier row the same
/// conversation as a later one ([`history`]): every request of the trace
/// starts with block id 0 (one shared system prompt), so one block in
/// common says nothing about the conversation.
pub const HISTORY_MIN_BLOCKS: usize = 2;

/// `max_tokens` of a history request at most ([`history`]): only its
/// prompt's blocks are reused later (the trace names the next turn's blocks
/// itself), so its answer is kept short.
pub const HISTORY_MAX_TOKENS: u32 = 16;

/// One request of the trace.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Row {
    /// Arrival, milliseconds from the trace's start.
    #[serde(rename = "timestamp")]
    pub timestamp_ms: u64,
    /// Prompt tokens of the original request.
    pub input_length: u32,
    /// Generated tokens of the original request.
    pub output_length: u32,
    /// One id per 512-token block of the prompt (shared leading ids: a
    /// shared prefix).
    pub hash_ids: Vec<u64>,
}

/// Parses the JSON-lines text, one [`Row`] per line. Blank lines are
/// skipped; anything else malformed (not JSON, a missing or unknown field,
/// no block) is an error naming the line.
pub fn parse(text: &str) -> Result<Vec<Row>, Error> {
    let mut rows = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let row: Row =
            serde_json::from_str(line).map_err(|e| Error::Trace(format!("line {}: {e}", i + 1)))?;
        if row.hash_ids.is_empty() {
            return Err(Error::Trace(format!("line {}: empty hash_ids", i + 1)));
        }
        rows.push(row);
    }
    if rows.is_empty() {
        return Err(Error::Trace("empty trace".into()));
    }
    Ok(rows)
}

/// SplitMix64: the next value of the stream in `state`.
fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The `n` token ids of block `id`, all in `TOKEN_LO..TOKEN_HI`, a function
/// of `id` alone. The first two spell `id` in base `TOKEN_HI - TOKEN_LO`
/// (low digit first), so two ids below 39,000² (1.5 × 10⁹; the trace's are
/// far below) never give the same run when `n ≥ 2`; the rest are a
/// SplitMix64 stream seeded by `id`.
pub fn block_ids(id: u64, n: usize) -> Vec<u32> {
    let span = u64::from(TOKEN_HI - TOKEN_LO);
    let mut out = Vec::with_capacity(n);
    out.push(TOKEN_LO + (id % span) as u32);
    out.push(TOKEN_LO + ((id / span) % span) as u32);
    let mut state = id ^ 0x6D6F_6F6E_6361_6B65;
    while out.len() < n {
        out.push(TOKEN_LO + (splitmix64(&mut state) % span) as u32);
    }
    out.truncate(n);
    out
}

/// The lengths of one request after scaling and cutting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cut {
    /// Prompt tokens to send.
    pub prompt_tokens: u32,
    /// `max_tokens` to send (at least 1).
    pub max_tokens: u32,
    /// Leading trace blocks the prompt covers, the last possibly in part.
    pub blocks: usize,
    /// Of those, the full blocks (`prompt_tokens / block_tokens`): the ones a
    /// prefix cache can hold.
    pub full_blocks: usize,
}

/// `ceil(n × block_tokens / 512)`.
fn scaled(n: u32, block_tokens: u32) -> u32 {
    (u64::from(n) * u64::from(block_tokens)).div_ceil(u64::from(TRACE_BLOCK_TOKENS)) as u32
}

/// Scales `row`'s lengths to `block_tokens` a block and cuts them to
/// `budget` (prompt + `max_tokens`): `max_tokens` is the scaled output (at
/// least 1, at most `budget - block_tokens` so a block of prompt fits); the
/// prompt is the scaled input (never more than its blocks hold), and when
/// that does not fit beside `max_tokens`, the whole leading blocks that do.
pub fn cut(row: &Row, block_tokens: u32, budget: u32) -> Cut {
    let bt = block_tokens.max(1);
    let budget = budget.max(2);
    let max_tokens = scaled(row.output_length, bt).clamp(1, budget.saturating_sub(bt).max(1));
    let room = budget - max_tokens;
    let whole = u32::try_from(row.hash_ids.len())
        .unwrap_or(u32::MAX)
        .saturating_mul(bt);
    let wanted = scaled(row.input_length, bt).clamp(1, whole.max(1));
    let prompt_tokens = if wanted <= room {
        wanted
    } else if room >= bt {
        room / bt * bt
    } else {
        room.max(1)
    };
    Cut {
        prompt_tokens,
        max_tokens,
        blocks: prompt_tokens.div_ceil(bt) as usize,
        full_blocks: (prompt_tokens / bt) as usize,
    }
}

/// The prompt's token ids: the runs of `hash_ids`' leading blocks
/// ([`block_ids`]), cut to `prompt_tokens`.
pub fn prompt_ids(hash_ids: &[u64], prompt_tokens: u32, block_tokens: u32) -> Vec<u32> {
    let bt = block_tokens.max(1) as usize;
    let n = prompt_tokens as usize;
    let mut out = Vec::with_capacity(n);
    for &id in hash_ids.iter().take(n.div_ceil(bt)) {
        out.extend(block_ids(id, bt));
    }
    out.truncate(n);
    out
}

/// One request to send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Planned {
    /// Index of the row in the trace (0 = the first line).
    pub row: usize,
    /// When to send it, from the start of the run (already divided by the speedup).
    pub offset: Duration,
    /// Its lengths.
    pub cut: Cut,
    /// Its full blocks' trace ids (the chain a prefix cache can hold).
    pub full_blocks: Vec<u64>,
    /// The prompt's token ids.
    pub prompt: Vec<u32>,
}

impl Planned {
    /// Row `row` (`r`) sent at `offset` with the lengths `cut`: its full
    /// blocks' ids and its prompt's token ids.
    fn new(row: usize, r: &Row, offset: Duration, cut: Cut, block_tokens: u32) -> Planned {
        Planned {
            row,
            offset,
            cut,
            full_blocks: r.hash_ids[..cut.full_blocks].to_vec(),
            prompt: prompt_ids(&r.hash_ids, cut.prompt_tokens, block_tokens),
        }
    }
}

/// The requests of a run: rows from `skip` on, at most `max_requests`, with
/// offsets from row `skip`'s timestamp divided by `speedup`, and only those
/// within `duration` (when given); lengths by [`cut`].
pub fn schedule(
    rows: &[Row],
    skip: usize,
    max_requests: Option<usize>,
    duration: Option<Duration>,
    speedup: f64,
    block_tokens: u32,
    budget: u32,
) -> Vec<Planned> {
    let mut out = Vec::new();
    // Out of order: fires at once.
    let elapsed =
        |r: &Row, first: &Row| r.timestamp_ms.saturating_sub(first.timestamp_ms) as f64 / 1e3;
    for (i, r, offset) in crate::trace::window(rows, skip, max_requests, duration, speedup, elapsed)
    {
        out.push(Planned::new(
            i,
            r,
            offset,
            cut(r, block_tokens, budget),
            block_tokens,
        ));
    }
    out
}

/// The earlier turns of `window`'s conversations: for each request of the
/// window, the latest row before `window`'s first row whose full-block
/// chain shares the longest run of leading blocks with it, at least
/// [`HISTORY_MIN_BLOCKS`]; each such row once, in trace order, with offset
/// 0, its lengths by [`cut`] and `max_tokens` at most
/// [`HISTORY_MAX_TOKENS`]. Empty when the window starts at row 0.
pub fn history(rows: &[Row], window: &[Planned], block_tokens: u32, budget: u32) -> Vec<Planned> {
    let Some(start) = window.first().map(|p| p.row) else {
        return Vec::new();
    };
    // The chains of the rows before the window, as a trie: (parent, block id)
    // -> node; `latest[node]` is the last row whose chain passes through it.
    let mut trie: HashMap<(u32, u64), u32> = HashMap::new();
    let mut latest: HashMap<u32, usize> = HashMap::new();
    for (i, r) in rows.iter().enumerate().take(start) {
        let c = cut(r, block_tokens, budget);
        let mut node = 0u32;
        for (depth, &id) in r.hash_ids[..c.full_blocks].iter().enumerate() {
            let next = u32::try_from(trie.len() + 1).unwrap_or(u32::MAX);
            node = *trie.entry((node, id)).or_insert(next);
            if depth + 1 >= HISTORY_MIN_BLOCKS {
                latest.insert(node, i);
            }
        }
    }
    let mut wanted = std::collections::BTreeSet::new();
    for p in window {
        let mut node = 0u32;
        let mut found = None;
        for &id in &p.full_blocks {
            let Some(&n) = trie.get(&(node, id)) else {
                break;
            };
            node = n;
            found = latest.get(&n).copied().or(found);
        }
        wanted.extend(found);
    }
    wanted
        .into_iter()
        .map(|i| {
            let mut c = cut(&rows[i], block_tokens, budget);
            c.max_tokens = c.max_tokens.min(HISTORY_MAX_TOKENS);
            Planned::new(i, &rows[i], Duration::ZERO, c, block_tokens)
        })
        .collect()
}

/// The trace's own prefix reuse over some requests, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Reuse {
    /// Prompt tokens of the requests.
    pub prompt_tokens: u64,
    /// Of those, tokens in leading full blocks whose chain was sent before
    /// (an infinite cache on one worker).
    pub reused_tokens: u64,
    /// The same with the engine's rule that a prefill computes at least its
    /// last token and [`ENGINE_MIN_ROWS`] rows (what a served hit can be at most).
    pub reused_tokens_capped: u64,
    /// Distinct blocks (chains from block 0) sent: what an infinite cache holds.
    pub unique_blocks: u64,
}

impl Reuse {
    /// `reused_tokens / prompt_tokens` (`None` for no prompt token).
    pub fn share(&self) -> Option<f64> {
        (self.prompt_tokens > 0).then(|| self.reused_tokens as f64 / self.prompt_tokens as f64)
    }

    /// `reused_tokens_capped / prompt_tokens`.
    pub fn share_capped(&self) -> Option<f64> {
        (self.prompt_tokens > 0)
            .then(|| self.reused_tokens_capped as f64 / self.prompt_tokens as f64)
    }
}

/// Reuse of `requests` in order, each `(its full blocks' ids, its prompt
/// tokens)`, with `block_tokens` a block: a request reuses the longest run
/// of its leading blocks whose chain from block 0 an earlier request sent
/// (the same id after a different parent is not a hit); then its own full
/// blocks count as sent.
pub fn reuse<'a>(requests: impl IntoIterator<Item = (&'a [u64], u32)>, block_tokens: u32) -> Reuse {
    let bt = block_tokens.max(1);
    // The chains sent, as a trie: (parent node, block id) -> node; node 0 is the root.
    let mut trie: HashMap<(u32, u64), u32> = HashMap::new();
    let mut r = Reuse::default();
    for (blocks, prompt_tokens) in requests {
        r.prompt_tokens += u64::from(prompt_tokens);
        let mut node = 0u32;
        let mut hit = 0u32;
        let mut missed = false;
        for &id in blocks {
            match trie.get(&(node, id)) {
                Some(&n) => {
                    node = n;
                    if !missed {
                        hit += 1;
                    }
                }
                None => {
                    missed = true;
                    let n = u32::try_from(trie.len() + 1).unwrap_or(u32::MAX);
                    trie.insert((node, id), n);
                    node = n;
                }
            }
        }
        let mut most = prompt_tokens.saturating_sub(1) / bt;
        while most > 0 && prompt_tokens - most * bt < ENGINE_MIN_ROWS {
            most -= 1;
        }
        r.reused_tokens += u64::from(hit * bt);
        r.reused_tokens_capped += u64::from(hit.min(most) * bt);
    }
    r.unique_blocks = trie.len() as u64;
    r
}

/// Prompt tokens of `requests` (as for [`reuse`]) found in a cache of
/// `capacity` blocks that evicts the least recently used: each request
/// reuses its leading blocks still held, then its whole chain is the most
/// recently used (parents more recent than children, so a chain is evicted
/// from its tail, as in the engine). Only prompt blocks are held (a
/// worker's cache also keeps the generated tokens' blocks, which take room
/// and are never reused here), so this is an upper bound of what a worker
/// with that budget serves one request at a time.
pub fn reused_with_lru<'a>(
    requests: impl IntoIterator<Item = (&'a [u64], u32)>,
    block_tokens: u32,
    capacity: usize,
) -> u64 {
    let bt = u64::from(block_tokens.max(1));
    let mut trie: HashMap<(u32, u64), u32> = HashMap::new();
    let mut held: HashMap<u32, u64> = HashMap::new();
    let mut lru: std::collections::BTreeMap<u64, u32> = std::collections::BTreeMap::new();
    let mut tick = 0u64;
    let mut reused = 0u64;
    for (blocks, _) in requests {
        let mut node = 0u32;
        let mut chain = Vec::with_capacity(blocks.len());
        for &id in blocks {
            let next = u32::try_from(trie.len() + 1).unwrap_or(u32::MAX);
            node = *trie.entry((node, id)).or_insert(next);
            chain.push(node);
        }
        let hit = chain.iter().take_while(|n| held.contains_key(n)).count() as u64;
        reused += hit * bt;
        for &n in chain.iter().take(capacity).rev() {
            tick += 1;
            if let Some(old) = held.insert(n, tick) {
                lru.remove(&old);
            }
            lru.insert(tick, n);
        }
        while held.len() > capacity {
            let Some((_, n)) = lru.pop_first() else { break };
            held.remove(&n);
        }
    }
    reused
}
