//! Names and wire types every rngd-pd component shares.
//!
//! - [`chat`]: chat as a completion (the request rendered, the answer and the
//!   stream turned back into the chat format), for the gateway and the workers.
//! - [`fanout`]: `n > 1` and prompt lists split into single-choice requests,
//!   their answers merged.
//! - [`env`]: every environment variable rngd-pd reads, as constants.
//! - [`headers`]: HTTP header names of the routing conventions (GIE, llm-d).
//! - [`models`]: the model names a server answers to (the 404 for any other,
//!   the `/v1/models` list).
//! - [`openai`]: the OpenAI-compatible request/response/error bodies.
//! - [`pd`]: the prefill/decode protocol (`kv_transfer_params`, vLLM-compatible).
//! - [`rules`]: the request rules every door applies (sampling ranges, defaults,
//!   request ids, worker roles).

pub mod chat;
pub mod env;
pub mod fanout;
pub mod headers;
pub mod models;
pub mod openai;
pub mod pd;
pub mod rules;

pub use rules::Role;
