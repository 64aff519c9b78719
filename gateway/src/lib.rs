//! The OpenAI-compatible gateway: runs the routing policy, drives prefill, the
//! KV handoff and decode over the PD protocol, and streams the result back.
//!
//! - [`state`]: the state ([`Gateway`]) and settings ([`GatewayConfig`]).
//! - [`server`]: router ([`router`]), handlers, `serve`.
//! - [`flow`]: one request end to end (policy → prefill → decode, streaming).
//! - [`error`]: [`ApiError`], the one place statuses and messages are decided.
//! - [`admission`]: the concurrency limit and bounded waiting room (429s).
//! - The endpoint pool, the prompt counter, the request rules and the policy
//!   call are `rngd-pool`'s, shared with the endpoint picker: this crate is
//!   the HTTP/SSE adapter over them.
//! - [`launch`]: assembles a running gateway from options (CLI, benchmark).
//! - [`metrics`]: histograms, request counter and the `airm_*` KPIs.
//! - [`probe`]: a readiness GET for `rngd-pd up`.
//! - [`sse`]: server-sent events reader/writer.
//!
//! See `docs/gateway.md`.

pub mod admission;
pub mod error;
pub mod flow;
pub mod launch;
pub mod metrics;
pub mod probe;
pub mod server;
pub mod sse;
pub mod state;

pub use error::{ApiError, BoxError, GatewayError, Stage};
pub use metrics::GatewayMetrics;
pub use server::{kpi_router, router, serve};
pub use state::{Gateway, GatewayConfig};
