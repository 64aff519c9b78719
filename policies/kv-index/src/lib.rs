//! `rngd-kv-index`: the KV-event indexer the routers (the gateway and the
//! endpoint picker, through `rngd-pool`) ask which endpoint holds which
//! prompt prefix. See `docs/kv-index.md`.
//!
//! - [`KvIndexer`]: subscribes to every endpoint's vLLM KV-event stream (ZMQ
//!   SUB, with the ROUTER replay socket for gaps, late joins and publisher
//!   restarts) on one background thread, and answers
//!   [`KvIndexer::match_prefix`] / [`KvIndexer::match_all`];
//! - [`keys`]: the router's own chained block keys, computed from token ids,
//!   so a prompt is matched without knowing the engine's hash scheme;
//! - [`decode`]: the lenient MessagePack decoding of vLLM's event batches;
//! - [`Index`]: the index itself (router key → endpoints, a block cap with
//!   LRU eviction), usable without sockets;
//! - [`EndpointSpec`] / [`Health`]: an endpoint to index and whether its
//!   cache information can be trusted;
//! - [`IndexStats`] / [`EndpointStats`]: the counters.

pub mod decode;
pub mod endpoint;
pub mod index;
pub mod indexer;
pub mod keys;
pub mod options;
pub mod stats;
mod stream;

pub use decode::{Batch, BlockId, DecodeError, Event, decode_batch};
pub use endpoint::{EndpointSpec, Health};
pub use index::{Applied, Index};
pub use indexer::KvIndexer;
pub use keys::{ROOT_KEY, block_keys, chain_key, root_key, salted_block_keys, salted_root};
pub use options::Options;
pub use stats::{EndpointStats, IndexStats};

/// Errors of the indexer.
#[derive(Debug, thiserror::Error)]
pub enum KvIndexError {
    /// The options are not usable (the message names the field).
    #[error("kv index options: {0}")]
    Options(String),
    /// An endpoint specification is not usable (an empty or duplicate id).
    #[error("kv index endpoint {id:?}: {message}")]
    Endpoint {
        /// The endpoint's id.
        id: String,
        /// What is wrong.
        message: String,
    },
    /// A ZMQ socket operation failed.
    #[error("kv index: {what}")]
    Zmq {
        /// What was being done.
        what: String,
        /// libzmq's error.
        #[source]
        source: zmq::Error,
    },
    /// The background thread could not be started.
    #[error("kv index: starting the subscriber thread")]
    Thread {
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The background thread has stopped (it panicked or was shut down).
    #[error("kv index: the subscriber thread is not running")]
    Stopped,
    /// The background thread did not answer a command within its deadline.
    #[error("kv index: the subscriber thread did not answer within {0:?}")]
    Timeout(std::time::Duration),
}
