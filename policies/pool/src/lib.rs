//! The endpoint pool and the pick, shared by both front doors (the gateway
//! and the Envoy endpoint picker): each is a thin adapter over this crate,
//! HTTP/SSE in one, ext_proc in the other.
//!
//! - [`source`]: the [`EndpointSource`] seam; a fixed list and a hot-reloaded file.
//! - [`scrape`]: live load from the workers' `/metrics`, staleness, `Arc` snapshots.
//! - [`load`]: the one Prometheus reader of the `vllm:*` gauges.
//! - [`prompt`]: the prompt counter (the engine's tokenizer and chat template)
//!   and [`prepare`], which validates a client body and counts its prompt.
//! - [`pick`]: the [`Policy`] seam and [`Picker::pick`], the one routing call
//!   (client-sent steering headers never reach the policy).
//! - [`prefix`]: the [`prefix::PrefixSource`] seam (where each endpoint
//!   holds a prompt's prefix) and the `rngd_pd.prefix_cache` text;
//!   [`cache`]: its implementation, the KV-event index following the
//!   endpoints' streams, with the router's own estimates and metrics.
//! - [`predicted`]: the index's cache predictions held against the
//!   engines' reported `cached_tokens`, with a miss budget that drops and
//!   rebuilds an endpoint's entries.
//! - [`tokenizers`]: the door's tokenizer digest held against each
//!   endpoint's (exported, a mismatch warned of and given no prefix credit).
//! - [`inflight`]: the requests each door routed to a decode endpoint and
//!   has not finished, which every pick counts as that endpoint's running
//!   load until the next scrape shows more.
//! - [`admission`]: the concurrency limit, bounded waiting room and body-byte
//!   budget both doors apply (429s).
//! - [`wiring`]: the policy, tokenizer and source choices both doors start from.
//! - `discovery` (feature `kube`): the endpoints of an `InferencePool`, watched
//!   through the Kubernetes API.
//!
//! Test doubles ([`prompt::ByteCounter`], [`pick::NativePolicy`]) are behind
//! the `test-util` feature.

pub mod admission;
pub mod cache;
#[cfg(feature = "kube")]
pub mod discovery;
pub mod inflight;
pub mod load;
pub mod pick;
pub mod predicted;
pub mod prefix;
pub mod prompt;
pub mod scrape;
pub mod source;
pub mod tokenizers;
pub mod wiring;

use std::path::PathBuf;

pub use admission::{Admission, AdmissionOptions, Overloaded};
pub use cache::{CacheOptions, EstimateOptions, PrefixCache, RunningCache};
pub use inflight::{Held, InFlight};
pub use load::{LoadNames, LoadSample, parse_load, parse_load_named};
pub use pick::{PickError, PickRequest, Picked, Picker, Policy, PolicyFailure};
pub use predicted::{CacheCheck, CheckOptions, Expected};
pub use prompt::{
    ApiKind, PREPARE_INLINE_BYTES, PrepareError, Prepared, PromptCounter, TokenizerOverrides,
    gguf_counter, gguf_counter_with, prepare, prepare_async,
};
pub use scrape::{HttpFetcher, MetricsFetcher, ScrapedEndpoints};
pub use source::{EndpointSource, FileEndpoints, KvStream, StaticEndpoints, can_serve};
pub use tokenizers::TokenizerCheck;
pub use wiring::{PolicyChoice, ScrapeOptions, SourceChoice, TokenizerChoice};

/// A boxed error from an implementation of one of this crate's traits.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Errors of the pool outside a pick.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    /// A configuration value is unusable.
    #[error("configuration: {0}")]
    Config(String),
    /// The endpoints file could not be read.
    #[error("read endpoints file {path}: {source}")]
    EndpointsRead {
        /// File path.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// The endpoints file is not a JSON list of endpoints.
    #[error("parse endpoints file {path}: {source}")]
    EndpointsParse {
        /// File path.
        path: PathBuf,
        /// Cause.
        #[source]
        source: serde_json::Error,
    },
    /// A `/metrics` scrape failed at the HTTP level.
    #[error("scrape {address}: {source}")]
    Scrape {
        /// Endpoint `ip:port`.
        address: String,
        /// Cause.
        #[source]
        source: reqwest::Error,
    },
    /// A `/metrics` scrape answered with a non-success status or no model-server metrics.
    #[error("scrape {address}: {reason}")]
    ScrapeContent {
        /// Endpoint `ip:port`.
        address: String,
        /// What was wrong.
        reason: String,
    },
    /// The HTTP client could not be built.
    #[error("http client: {0}")]
    Client(#[source] reqwest::Error),
    /// Pool discovery could not start (Kubernetes configuration, client, metrics).
    #[error("pool discovery: {what}: {source}")]
    Discovery {
        /// What failed.
        what: String,
        /// Cause.
        #[source]
        source: BoxError,
    },
    /// The model's tokenizer could not be loaded.
    #[error("tokenizer of {path}: {source}")]
    Tokenizer {
        /// The model file.
        path: PathBuf,
        /// Cause.
        #[source]
        source: BoxError,
    },
}
