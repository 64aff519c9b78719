//! The counters: one [`Counters`] per endpoint and one for the whole
//! indexer (which keeps counting what endpoints removed since counted), and
//! their snapshots [`EndpointStats`] / [`IndexStats`].

use std::sync::atomic::{AtomicU64, Ordering};

use crate::endpoint::Health;

/// Monotonic counters, updated by the subscriber thread.
#[derive(Debug, Default)]
pub struct Counters {
    /// Events applied.
    pub events: AtomicU64,
    /// Batches applied (live or replayed).
    pub batches: AtomicU64,
    /// Sequence gaps seen (a batch whose number is past the next expected).
    pub gaps: AtomicU64,
    /// Replays that completed (the end marker came).
    pub replays: AtomicU64,
    /// Replays that failed (no answer in time, a bad reply, or history the
    /// publisher no longer holds).
    pub replay_failures: AtomicU64,
    /// Stored chains whose parent hash was unknown.
    pub unknown_parents: AtomicU64,
    /// Payloads or events that could not be decoded.
    pub undecodable: AtomicU64,
    /// Publisher restarts seen (the sequence went back).
    pub restarts: AtomicU64,
    /// Times the stream was found silent for `stale_after` and no probe
    /// answered.
    pub stale: AtomicU64,
    /// Blocks ever indexed.
    pub blocks_indexed: AtomicU64,
    /// Blocks evicted by the block cap.
    pub evicted: AtomicU64,
    /// Blocks not indexed because the key cannot describe them (a LoRA
    /// adapter's, extra keys, another medium than the engine's own, or a
    /// parent the cap evicted).
    pub ignored_blocks: AtomicU64,
}

/// Adds to one counter.
pub(crate) fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

/// A snapshot of one endpoint's counters and state.
#[derive(Debug, Clone, PartialEq)]
pub struct EndpointStats {
    /// Events applied.
    pub events: u64,
    /// Batches applied.
    pub batches: u64,
    /// Sequence gaps seen.
    pub gaps: u64,
    /// Replays completed.
    pub replays: u64,
    /// Replays failed.
    pub replay_failures: u64,
    /// Stored chains with an unknown parent.
    pub unknown_parents: u64,
    /// Undecodable payloads or events.
    pub undecodable: u64,
    /// Publisher restarts seen.
    pub restarts: u64,
    /// Silent-stream detections.
    pub stale: u64,
    /// Blocks ever indexed (a counter).
    pub blocks_indexed: u64,
    /// Blocks evicted by the cap.
    pub evicted: u64,
    /// Blocks not indexed (see [`Counters::ignored_blocks`]).
    pub ignored_blocks: u64,
    /// Blocks held in the index now (a gauge).
    pub blocks: u64,
    /// Seconds since the last batch (live or replayed) or successful probe;
    /// `None` before the first.
    pub seconds_since_last_event: Option<f64>,
    /// The endpoint's state ([`Health::Live`] is the only one with cache
    /// information).
    pub health: Health,
}

impl EndpointStats {
    pub(crate) fn from_counters(
        c: &Counters,
        blocks: u64,
        since: Option<f64>,
        health: Health,
    ) -> Self {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        EndpointStats {
            events: l(&c.events),
            batches: l(&c.batches),
            gaps: l(&c.gaps),
            replays: l(&c.replays),
            replay_failures: l(&c.replay_failures),
            unknown_parents: l(&c.unknown_parents),
            undecodable: l(&c.undecodable),
            restarts: l(&c.restarts),
            stale: l(&c.stale),
            blocks_indexed: l(&c.blocks_indexed),
            evicted: l(&c.evicted),
            ignored_blocks: l(&c.ignored_blocks),
            blocks,
            seconds_since_last_event: since,
            health,
        }
    }
}

/// A snapshot of the whole indexer.
#[derive(Debug, Clone, PartialEq)]
pub struct IndexStats {
    /// Every endpoint's counters added up since the start, removed endpoints
    /// included; `blocks` is the index's size, `seconds_since_last_event`
    /// the newest of any endpoint, `health` [`Health::Live`] when every
    /// current endpoint is.
    pub total: EndpointStats,
    /// The current endpoints, by id, in id order.
    pub endpoints: Vec<(String, EndpointStats)>,
}
