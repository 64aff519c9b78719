//! The Envoy `ext_proc` endpoint picker of rngd-pd, speaking the protocol of the
//! Gateway API Inference Extension (GIE) endpoint picker (`docs/epp.md`).
//!
//! Envoy streams each request to [`processor::ExtProcService`]; once the body is
//! complete it is parsed, its prompt counted ([`picker::PromptCounter`]), and the
//! policy module ([`picker::Decider`]) picks the decode (and prefill) endpoint
//! from the current endpoint snapshot ([`endpoints::EndpointSource`]). The
//! answer is a header mutation (`x-gateway-destination-endpoint`, plus
//! `x-prefiller-host-port` / `x-rngd-pd-kv-transport` for PD) with
//! `clear_route_cache` and `envoy.lb` dynamic metadata, followed by the body
//! re-sent in chunks of at most 62,000 bytes.
//!
//! - [`endpoints`]: the endpoints file (hot-reloaded) and the `/metrics` scraper.
//! - [`picker`]: body parsing, prompt counting, subset hints, policy call, error mapping.
//! - [`policy`]: the wasm policy runtime as a [`picker::Decider`].
//! - [`processor`]: the `ext_proc` stream state machine (FULL_DUPLEX_STREAMED and BUFFERED).
//! - [`server`]: the gRPC, health and metrics listeners.
//! - [`metrics`]: the picker's Prometheus metrics.

pub mod endpoints;
pub mod metrics;
pub mod picker;
pub mod policy;
pub mod processor;
pub mod server;

use std::net::SocketAddr;
use std::path::PathBuf;

pub use envoy_types;

/// A boxed error from an implementation of one of this crate's traits.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Errors of the endpoint picker.
#[derive(Debug, thiserror::Error)]
pub enum ExtProcError {
    /// A listener could not be bound.
    #[error("bind {what} listener on {addr}: {source}")]
    Bind {
        /// Which listener (`grpc`, `health`, `metrics`).
        what: &'static str,
        /// Requested address.
        addr: SocketAddr,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
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
    /// The policy failed (trap, timeout, bad output).
    #[error("policy decision failed: {source}")]
    Decide {
        /// HTTP status the client gets (500 for a guest fault, 503 when unavailable, …).
        status: u16,
        /// Cause.
        #[source]
        source: BoxError,
    },
    /// The prompt could not be tokenized.
    #[error("count prompt tokens: {source}")]
    Count {
        /// Cause.
        #[source]
        source: BoxError,
    },
    /// A metric could not be registered.
    #[error("metrics: {source}")]
    Metrics {
        /// Cause.
        #[source]
        source: rngd_telemetry::TelemetryError,
    },
    /// A gRPC server failed.
    #[error("serve {what}: {source}")]
    Serve {
        /// Which server.
        what: &'static str,
        /// Cause.
        #[source]
        source: tonic::transport::Error,
    },
    /// The metrics HTTP server failed.
    #[error("serve metrics: {source}")]
    ServeMetrics {
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// A serving thread or its runtime could not be started, or it panicked.
    #[error("grpc serving thread: {source}")]
    Runtime {
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// A server task panicked or was cancelled.
    #[error("server task: {source}")]
    Task {
        /// Cause.
        #[source]
        source: tokio::task::JoinError,
    },
}
