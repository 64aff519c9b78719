//! KV-cache events exactly as vLLM publishes them, for routers that index
//! where prefixes are cached (llm-d's precise-prefix-cache scorer, Dynamo's
//! KV router): see `docs/engine.md`, "KV events".
//!
//! - [`KvEventsConfig`]: vLLM's `--kv-events-config` JSON (same keys, same
//!   defaults, unknown keys refused);
//! - [`KvEvent`] / [`KvEventBatch`]: the events and their MessagePack form
//!   (vLLM's map-encoded events in an array batch);
//! - [`KvEventPublisher`]: the ZMQ PUB socket and ROUTER replay socket,
//!   driven by a background thread behind a bounded queue.

pub mod config;
pub mod encode;
pub mod publisher;

pub use config::{KvEventsConfig, PublisherKind};
pub use encode::{KvEvent, KvEventBatch, MEDIUM_GPU};
pub use publisher::{END_SEQ, KvEventPublisher, PublisherStats};

/// Errors of the KV-event publisher.
#[derive(Debug, thiserror::Error)]
pub enum KvEventsError {
    /// `--kv-events-config` is not valid (the message names the key).
    #[error("{message}")]
    Config {
        /// What is wrong.
        message: String,
        /// The JSON parser's error, when it found it.
        #[source]
        source: Option<serde_json::Error>,
    },
    /// A ZMQ socket operation failed.
    #[error("KV events: {what}")]
    Zmq {
        /// What was being done.
        what: String,
        /// libzmq's error.
        #[source]
        source: zmq::Error,
    },
    /// The publisher thread could not be started.
    #[error("KV events: starting the publisher thread")]
    Thread {
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}
