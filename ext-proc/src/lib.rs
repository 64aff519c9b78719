//! The Envoy `ext_proc` endpoint picker of rngd-pd, speaking the protocol of the
//! Gateway API Inference Extension (GIE) endpoint picker (`docs/epp.md`).
//!
//! Envoy streams each request to [`processor::ExtProcService`]; once the body is
//! complete it goes through the request rules and prompt counting the gateway
//! uses too ([`rngd_pool::prepare`]), and the pool's picker
//! ([`rngd_pool::Picker`]) asks the policy module for the decode (and prefill)
//! endpoint from the current endpoint snapshot ([`rngd_pool::EndpointSource`]). The
//! answer is a header mutation (`x-gateway-destination-endpoint`, plus
//! `x-prefiller-host-port` / `x-rngd-pd-kv-transport` for PD) with
//! `clear_route_cache` and `envoy.lb` dynamic metadata, followed by the body
//! re-sent in chunks of at most 62,000 bytes.
//!
//! - [`launch`]: assembles a running picker from [`launch::Options`] (CLI, benchmark).
//! - [`picker`]: the pool's pick seen from ext_proc, and its error mapping.
//! - [`processor`]: the `ext_proc` stream state machine (FULL_DUPLEX_STREAMED and BUFFERED).
//! - [`server`]: the gRPC, health and metrics listeners.
//! - [`metrics`]: the picker's Prometheus metrics.
//! - [`tls`]: TLS of the ext_proc listener (self-signed or a reloaded certificate directory).

pub mod launch;
pub mod metrics;
pub mod picker;
pub mod processor;
pub mod server;
pub mod tls;

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
    /// The endpoint pool (endpoints file, scraper, tokenizer) could not be set up.
    #[error(transparent)]
    Pool(#[from] rngd_pool::PoolError),
    /// The policy module could not be loaded.
    #[error("policy {path}: {source}")]
    Policy {
        /// The module.
        path: PathBuf,
        /// Cause.
        #[source]
        source: rngd_policy_host::PolicyError,
    },
    /// A file could not be read.
    #[error("read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
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
    /// A TLS certificate or configuration could not be set up.
    #[error("TLS {what}: {reason}")]
    Tls {
        /// What was being loaded (the certificate directory, `self-signed certificate`, ...).
        what: String,
        /// Why it failed.
        reason: String,
    },
    /// A server task panicked or was cancelled.
    #[error("server task: {source}")]
    Task {
        /// Cause.
        #[source]
        source: tokio::task::JoinError,
    },
}
