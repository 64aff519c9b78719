//! [`Options`]: the indexer's bounds and deadlines, with their defaults.

use std::time::Duration;

use crate::KvIndexError;

/// The indexer's options. Every queue is bounded and every wait has a
/// deadline; the defaults are what [`Options::default`] gives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Options {
    /// Blocks indexed over all endpoints at most (an endpoint holding a block
    /// counts once per endpoint); past this the least recently stored or
    /// matched-into chain tail is evicted. Default 1,000,000 (about 250 MB:
    /// 250 B per block with the maps, measured).
    pub max_blocks: usize,
    /// An endpoint from which no batch came for this long is probed through
    /// its replay socket (a replay from the next sequence number); without a
    /// replay socket, or when the probe fails, it is marked stale (no cache
    /// information) until a batch comes. Default 10 s.
    pub stale_after: Duration,
    /// The longest wait for each reply of a replay (and for the first).
    /// Default 2 s.
    pub replay_timeout: Duration,
    /// The longest a whole replay may take, however many batches it sends.
    /// Default 30 s.
    pub replay_deadline: Duration,
    /// How long after a failed replay, or after the endpoint was marked as
    /// having no cache information, the next recovery replay is tried.
    /// Default 2 s.
    pub retry_after: Duration,
    /// How long the thread waits on the sockets before it looks at its
    /// commands and deadlines again (the longest a [`crate::KvIndexer::set_endpoints`]
    /// waits to be picked up). Default 10 ms.
    pub poll_interval: Duration,
    /// The longest [`crate::KvIndexer::set_endpoints`] waits for the thread
    /// to apply a new endpoint list. Default 10 s.
    pub command_timeout: Duration,
    /// ZMQ receive high-water mark of each SUB and replay socket (messages
    /// queued before libzmq drops; a drop shows as a sequence gap). Default
    /// 10,000.
    pub rcv_hwm: i32,
    /// Largest message accepted (libzmq's `ZMQ_MAXMSGSIZE`; a larger one
    /// closes the connection, which then shows as a gap). Default 64 MiB.
    pub max_message_bytes: i64,
    /// Batches processed from one endpoint before the thread turns to the
    /// next (fairness between endpoints). Default 256.
    pub max_batches_per_turn: usize,
    /// The interval at which repeated warnings of one kind for one endpoint
    /// are logged at most once (the counters count all). Default 10 s.
    pub log_interval: Duration,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            max_blocks: 1_000_000,
            stale_after: Duration::from_secs(10),
            replay_timeout: Duration::from_secs(2),
            replay_deadline: Duration::from_secs(30),
            retry_after: Duration::from_secs(2),
            poll_interval: Duration::from_millis(10),
            command_timeout: Duration::from_secs(10),
            rcv_hwm: 10_000,
            max_message_bytes: 64 << 20,
            max_batches_per_turn: 256,
            log_interval: Duration::from_secs(10),
        }
    }
}

impl Options {
    /// Refuses options that cannot work, naming the field.
    pub fn check(&self) -> Result<(), KvIndexError> {
        let bad = |f: &str, why: &str| Err(KvIndexError::Options(format!("{f} {why}")));
        if self.max_blocks == 0 {
            return bad("max_blocks", "must be at least 1");
        }
        for (name, d) in [
            ("stale_after", self.stale_after),
            ("replay_timeout", self.replay_timeout),
            ("replay_deadline", self.replay_deadline),
            ("poll_interval", self.poll_interval),
            ("command_timeout", self.command_timeout),
        ] {
            if d.is_zero() {
                return bad(name, "must be more than 0");
            }
        }
        if self.rcv_hwm < 0 {
            return bad("rcv_hwm", "must not be negative");
        }
        if self.max_message_bytes <= 0 {
            return bad("max_message_bytes", "must be more than 0");
        }
        if self.max_batches_per_turn == 0 {
            return bad("max_batches_per_turn", "must be at least 1");
        }
        Ok(())
    }
}
