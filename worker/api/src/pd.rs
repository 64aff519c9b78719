//! The prefill/decode protocol, compatible with vLLM's `kv_transfer_params`.
//!
//! 1. The orchestrator sends the prefill worker a completion request with
//!    `"kv_transfer_params": {"do_remote_decode": true}` (and optionally the
//!    transport to use).
//! 2. The prefill worker runs the prompt, pushes the KV cache and answers with
//!    the first token and `kv_transfer_params` = `{"do_remote_prefill": true,
//!    "kv_handle": …}`.
//! 3. The orchestrator sends the original request, with those params, to the
//!    decode worker, which pulls the cache, releases it and continues from it.
//!
//! The orchestrator's half (steps 1 and 3, and the one verdict on a prefill
//! answer) is written once, in [`handoff`], for every orchestrator: the
//! gateway's two-step flow and a decode worker serving
//! `x-prefiller-host-port`.
//!
//! See `docs/pd-protocol.md`.

mod handoff;

pub use handoff::{
    HandleState, Handoff, KV_UNAVAILABLE_CODE, KvLoadFailurePolicy, KvReleaseAnswer, PdAnswerError,
    decode_request_from, kv_load_failed, prefill_request, recompute_request, release_request,
};

use rngd_kv_wire::KvHandle;
use serde::{Deserialize, Serialize};

/// Error code of a decode worker's 409 for a handle whose KV other weights
/// computed (`kv_transfer_params.weight_version` is not the worker's).
pub const WEIGHT_VERSION_MISMATCH_CODE: &str = "weight_version_mismatch";

/// `kv_transfer_params` of a completion request or response.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct KvTransferParams {
    /// On a request to a prefill worker: prefill only and push the KV for a remote decode.
    #[serde(default)]
    pub do_remote_decode: bool,
    /// On a request to a decode worker: the KV was prefilled remotely; pull it from `kv_handle`.
    #[serde(default)]
    pub do_remote_prefill: bool,
    /// KV transport to push through (prefill request); default: the worker's own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_transport: Option<String>,
    /// Where the KV cache is (prefill response, decode request).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_handle: Option<KvHandle>,
    /// The first token the prefill sampled (prefill response, decode request).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_token: Option<u32>,
    /// Prompt token ids as the prefill worker tokenized them (prefill response, decode request),
    /// so that the decode worker need not tokenize again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Option<Vec<u32>>,
    /// HMAC-SHA256 (hex) of `kv_handle`, `first_token`, `prompt_token_ids` and
    /// `kv_handle_expires_ms` under the deployment's key (prefill response,
    /// decode request): a decode worker pulls nothing it cannot verify.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_handle_signature: Option<String>,
    /// Until when the handle is valid, Unix ms (signed with it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_handle_expires_ms: Option<u64>,
    /// The sampling seed the prefill used (prefill response, decode request):
    /// the client's `seed` as a `u64`, or the fresh random seed the prefill
    /// worker chose for a request without one. Signed with the handle, so the
    /// decode continues the same random stream.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    /// Log-probabilities of `first_token`, when the request asked for them
    /// (prefill response, decode request; signed with the handle).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_token_logprobs: Option<TokenLogprobs>,
    /// Prompt tokens the prefill read from its prefix cache instead of
    /// computing (prefill response, decode request; signed with the handle):
    /// the decode worker reports them as
    /// `usage.prompt_tokens_details.cached_tokens`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cached_tokens: Option<u32>,
    /// The `weight_version` of the engine that computed the KV (prefill
    /// response, decode request; signed with the handle). A decode worker
    /// whose weights differ refuses the handle with a 409 naming both
    /// versions, before it pulls anything.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight_version: Option<String>,
    /// Prefill compute time, ms (prefill response).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill_ms: Option<f64>,
    /// KV push time, ms (prefill response).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_save_ms: Option<f64>,
    /// rngd-pd extension, on a decode request (with `do_remote_prefill` and
    /// the signed handle): generate nothing, release the handle's KV without
    /// pulling it, and refuse any later decode of it. An orchestrator whose
    /// client went away after the prefill sends this
    /// ([`release_request`]); the answer is a [`KvReleaseAnswer`].
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub release_only: bool,
    /// rngd-pd extension, on a request served whole (no `do_remote_*`):
    /// the last `resumed_tokens` ids of the prompt (token ids) are this
    /// request's own output so far. A front door that continues a stream
    /// whose worker died sends the prompt plus the tokens already streamed
    /// with this, so the worker samples, penalizes and counts them as
    /// generated and continues exactly where the first worker stopped.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub resumed_tokens: u32,
    /// vLLM field: engine id of the remote side (informational).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_engine_id: Option<String>,
    /// vLLM field: host of the remote side (informational).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_host: Option<String>,
    /// vLLM field: port of the remote side (informational).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_port: Option<u16>,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// The log-probability of one generated token and its most likely
/// alternatives, as the engine computes them (log-softmax of the raw logits):
/// `{"logprob": -0.25, "top": [[id, logprob], ...]}`, `top` descending.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TokenLogprobs {
    /// Log-probability of the chosen token.
    pub logprob: f32,
    /// The top alternatives (token id, log-probability), most likely first.
    #[serde(default)]
    pub top: Vec<(u32, f32)>,
}
