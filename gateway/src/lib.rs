//! The OpenAI-compatible gateway: runs the routing policy, drives prefill, the
//! KV handoff and decode over the PD protocol, and streams the result back.
//!
//! - [`server`]: state ([`Gateway`]), router ([`router`]), handlers, `serve`.
//! - [`flow`]: one request end to end (policy → prefill → decode, streaming).
//! - [`error`]: [`ApiError`], the one place statuses and messages are decided.
//! - [`endpoints`]: the live endpoint snapshot, scraped from workers' `/metrics`.
//! - [`policy`], [`tokens`]: the pluggable edges (wasm policy, tokenizer).
//! - [`launch`]: assembles a running gateway from options (CLI, benchmark).
//! - [`metrics`]: histograms, request counter and the `airm_*` KPIs.
//! - [`probe`]: a readiness GET for `rngd-pd up`.
//! - [`sse`]: server-sent events reader/writer.
//!
//! See `docs/gateway.md`.

pub mod endpoints;
pub mod error;
pub mod flow;
pub mod launch;
pub mod metrics;
pub mod policy;
pub mod probe;
pub mod server;
pub mod sse;
pub mod tokens;

pub use endpoints::{EndpointTable, HttpLoadSource, LoadSource, WorkerLoad};
pub use error::{ApiError, BoxError, GatewayError, Stage};
pub use metrics::GatewayMetrics;
pub use policy::Policy;
pub use server::{Gateway, GatewayConfig, kpi_router, router, serve};
pub use tokens::{ByteTokenizer, PromptTokenizer};
