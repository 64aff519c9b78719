//! An indexed endpoint: what the indexer is told about it ([`EndpointSpec`])
//! and whether its cache information can be trusted ([`Health`]). A leaf:
//! the index, the streams, the counters and the indexer all name these.

/// One endpoint whose events are indexed.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct EndpointSpec {
    /// The id the routers name it by (its URL, its pod name); unique.
    pub id: String,
    /// The publisher's PUB endpoint to connect to (`tcp://host:5557`).
    pub endpoint: String,
    /// The publisher's ROUTER replay endpoint; without one a gap or a late
    /// join cannot be recovered and leaves the endpoint without cache
    /// information until an `AllBlocksCleared`.
    pub replay_endpoint: Option<String>,
    /// The topic prefix to subscribe to (`""`: every message).
    pub topic: String,
}

/// Whether an endpoint's cache information can be trusted; only
/// [`Health::Live`] endpoints get a match, every other state answers `None`
/// (no cache information), never 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Health {
    /// Subscribed, nothing known yet (no batch, no replay).
    Unknown,
    /// A replay that rebuilds the endpoint's entries is under way.
    Replaying,
    /// Every batch applied in order: the information is current.
    Live,
    /// No batch for `stale_after` and no probe answered.
    Stale,
    /// A stored chain named a parent hash never stored.
    UnknownParent,
    /// Batches were lost and no replay could bring them (no replay socket,
    /// a failed replay, or history the publisher no longer holds).
    MissedBatches,
    /// A payload could not be decoded.
    Undecodable,
}

impl Health {
    /// The state's name (`"live"`, `"stale"`, …) for logs and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Health::Unknown => "unknown",
            Health::Replaying => "replaying",
            Health::Live => "live",
            Health::Stale => "stale",
            Health::UnknownParent => "unknown_parent",
            Health::MissedBatches => "missed_batches",
            Health::Undecodable => "undecodable",
        }
    }

    /// A state that only a successful recovery replay or an
    /// `AllBlocksCleared` ends.
    pub fn is_broken(self) -> bool {
        matches!(
            self,
            Health::UnknownParent | Health::MissedBatches | Health::Undecodable
        )
    }
}
