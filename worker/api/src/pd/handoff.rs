//! The orchestrator's half of the PD protocol, written once for every
//! orchestrator (the gateway's two-step flow, a decode worker serving
//! `x-prefiller-host-port`): the prefill request made from the client's
//! ([`prefill_request`]), the one verdict on a prefill answer and the decode
//! request made from it ([`decode_request_from`]), and the release-only
//! request an orchestrator sends when its client went away after the prefill
//! ([`release_request`]).
//!
//! The verdict on an answer never quotes it (a peer's body may hold
//! anything): it names the field that is missing or of the wrong type — always
//! one of the protocol's own names — or where the JSON broke off.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::KvTransferParams;
use crate::openai::{CompletionRequest, CompletionResponse};

/// Why a prefill answer cannot start a decode. Both orchestrators answer it
/// with a 502 whose message carries this text.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PdAnswerError {
    /// The answer is not JSON.
    #[error(
        "the prefill answer is not a completion response: it is not JSON (line {line}, column {column})"
    )]
    NotJson {
        /// Where the JSON broke off: line (1-based).
        line: usize,
        /// Column (1-based).
        column: usize,
    },
    /// The answer is JSON but not a completion response.
    #[error("the prefill answer is not a completion response: {}", not_completion(*.field))]
    NotCompletion {
        /// The completion field at fault (none: the answer is not an object).
        field: Option<&'static str>,
    },
    /// The answer has no `kv_transfer_params` (or `null`).
    #[error("the prefill answer carries no kv_transfer_params")]
    NoParams,
    /// `kv_transfer_params` is not an object.
    #[error("the prefill answer's kv_transfer_params is not an object")]
    ParamsNotObject,
    /// A field of `kv_transfer_params` has the wrong type.
    #[error(
        "the prefill answer's kv_transfer_params.{field} is of the wrong type (expected {expected})"
    )]
    WrongType {
        /// The field.
        field: &'static str,
        /// What the protocol expects there.
        expected: &'static str,
    },
    /// What a decode needs is not there.
    #[error("the prefill answer's kv_transfer_params lack {}", .missing.join(", "))]
    Missing {
        /// What is missing: `do_remote_prefill: true`, `kv_handle`, `first_token`.
        missing: Vec<&'static str>,
    },
}

fn not_completion(field: Option<&str>) -> String {
    match field {
        Some(f) => format!("`{f}` is missing or of the wrong type"),
        None => "it is not a JSON object".to_string(),
    }
}

/// A prefill answer accepted for a decode.
#[derive(Debug, Clone, PartialEq)]
pub struct Handoff {
    /// The decode request: the client's request with the answer's
    /// `kv_transfer_params` (`do_remote_prefill` set, `do_remote_decode`
    /// cleared).
    pub request: CompletionRequest,
    /// Those `kv_transfer_params`.
    pub params: KvTransferParams,
}

/// The prefill request an orchestrator sends a prefill worker for the
/// client's `original`: the same request, not streamed, with
/// `kv_transfer_params = {"do_remote_decode": true, "kv_transport": ...}`.
pub fn prefill_request(
    original: &CompletionRequest,
    kv_transport: Option<String>,
) -> CompletionRequest {
    let mut req = original.clone();
    req.sampling.stream = false;
    req.sampling.stream_options = None;
    req.kv_transfer_params = Some(KvTransferParams {
        do_remote_decode: true,
        kv_transport,
        ..KvTransferParams::default()
    });
    req
}

/// The one verdict on a prefill worker's answer (its body as received) and,
/// when it is good, the decode request for `original`. A good answer is a
/// completion response whose `kv_transfer_params` have every field of the
/// protocol's type and carry `do_remote_prefill: true`, a `kv_handle` and the
/// `first_token`.
pub fn decode_request_from(
    original: &CompletionRequest,
    prefill_answer: &[u8],
) -> Result<Handoff, PdAnswerError> {
    let value: Value =
        serde_json::from_slice(prefill_answer).map_err(|e| PdAnswerError::NotJson {
            line: e.line(),
            column: e.column(),
        })?;
    let Value::Object(mut answer) = value else {
        return Err(PdAnswerError::NotCompletion { field: None });
    };
    let params = answer.remove("kv_transfer_params");
    check_completion(answer)?;
    let mut params = check_params(params)?;
    params.do_remote_decode = false;
    params.release_only = false;
    let mut request = original.clone();
    request.kv_transfer_params = Some(params.clone());
    Ok(Handoff { request, params })
}

/// The request that releases a handoff's KV without decoding it, for the
/// decode worker the handoff was meant for: the decode request, not
/// streamed, with `kv_transfer_params.release_only`.
pub fn release_request(decode: &CompletionRequest) -> CompletionRequest {
    let mut req = decode.clone();
    req.sampling.stream = false;
    req.sampling.stream_options = None;
    if let Some(p) = req.kv_transfer_params.as_mut() {
        p.release_only = true;
    }
    req
}

/// The request that serves a handoff whole on its decode worker when the
/// worker could not load its KV ([`kv_load_failed`]) and the orchestrator's
/// [`KvLoadFailurePolicy`] is `recompute`: the decode request without
/// `kv_transfer_params`, with the seed the prefill signed (the client's, or
/// the one the prefill drew), so it samples the stream the prefill started
/// and its tokens are those the disaggregated answer would have had.
pub fn recompute_request(decode: &CompletionRequest) -> CompletionRequest {
    let mut req = decode.clone();
    if let Some(params) = req.kv_transfer_params.take()
        && req.sampling.seed.is_none()
        && let Some(seed) = params.seed
    {
        // The worker reads a seed's bits back unchanged (`rules::seed_bits`).
        req.sampling.seed = Some(seed as i64);
    }
    req
}

/// Error code of a decode worker's 410 for a verified handle whose KV it
/// cannot load: the handle expired, or its transport no longer holds the
/// KV (released, expired, taken). Nothing was pulled or waited for.
pub const KV_UNAVAILABLE_CODE: &str = "kv_unavailable";

/// Whether a decode worker's refusal (`status`, error `code`) says it could
/// not load the handoff's KV (gone or expired, already consumed by another
/// decode): the request itself is sound and can be recomputed whole on that
/// worker ([`recompute_request`]). A 409 `weight_version_mismatch` is not
/// one: the pair the policy chose serves two sets of weights, and the
/// client is told so.
pub fn kv_load_failed(status: u16, code: Option<&str>) -> bool {
    matches!((status, code), (410, Some(c)) if c == KV_UNAVAILABLE_CODE || c == "kv_handle_consumed")
}

/// What an orchestrator does when its decode worker cannot load the KV of
/// a handoff ([`kv_load_failed`]), as vLLM's `kv_load_failure_policy`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum KvLoadFailurePolicy {
    /// Serve the request whole on the decode worker ([`recompute_request`]):
    /// the same tokens, the prefill paid twice.
    #[default]
    Recompute,
    /// Answer the worker's refusal (the client sees an error, never other
    /// tokens).
    Fail,
}

impl KvLoadFailurePolicy {
    /// `recompute` or `fail`.
    pub fn as_str(self) -> &'static str {
        match self {
            KvLoadFailurePolicy::Recompute => "recompute",
            KvLoadFailurePolicy::Fail => "fail",
        }
    }
}

impl std::str::FromStr for KvLoadFailurePolicy {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "recompute" => Ok(KvLoadFailurePolicy::Recompute),
            "fail" => Ok(KvLoadFailurePolicy::Fail),
            other => Err(format!(
                "kv_load_failure_policy `{other}`: expected `recompute` or `fail`"
            )),
        }
    }
}

impl std::fmt::Display for KvLoadFailurePolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a decode worker knew of a handle before a release-only request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HandleState {
    /// Nothing had used it: its KV was released now, nothing pulled.
    Unused,
    /// A decode had taken it (pulled its KV, or was pulling it).
    Consumed,
    /// A release-only request had released it already.
    Released,
}

impl HandleState {
    /// `unused`, `consumed` or `released`.
    pub fn as_str(self) -> &'static str {
        match self {
            HandleState::Unused => "unused",
            HandleState::Consumed => "consumed",
            HandleState::Released => "released",
        }
    }
}

/// A decode worker's answer (200) to a release-only request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvReleaseAnswer {
    /// `kv_release`.
    pub object: String,
    /// The handle's key (`kv_handle.request_id`).
    pub kv_key: String,
    /// What the worker knew of the handle before this request.
    pub previous_state: HandleState,
}

/// The fields of a completion response, and a value of each that parses.
fn completion_template() -> Map<String, Value> {
    let mut m = Map::new();
    m.insert("id".into(), Value::from(""));
    m.insert("object".into(), Value::from("text_completion"));
    m.insert("created".into(), Value::from(0));
    m.insert("model".into(), Value::from(""));
    m.insert("choices".into(), Value::Array(Vec::new()));
    m
}

/// Every field of [`CompletionResponse`] but `kv_transfer_params`.
const COMPLETION_FIELDS: [&str; 7] = [
    "id", "object", "created", "model", "choices", "usage", "timings",
];

/// The answer without its `kv_transfer_params` is a completion response; else
/// the field at fault, the first in [`COMPLETION_FIELDS`] order (one field at
/// a time over a template that parses, so the name comes from the protocol,
/// never from the answer).
fn check_completion(answer: Map<String, Value>) -> Result<(), PdAnswerError> {
    if serde_json::from_value::<CompletionResponse>(Value::Object(answer.clone())).is_ok() {
        return Ok(());
    }
    let template = completion_template();
    for field in COMPLETION_FIELDS {
        let Some(v) = answer.get(field) else {
            continue;
        };
        let mut one = template.clone();
        one.insert(field.to_string(), v.clone());
        if serde_json::from_value::<CompletionResponse>(Value::Object(one)).is_err() {
            return Err(PdAnswerError::NotCompletion { field: Some(field) });
        }
    }
    let absent = COMPLETION_FIELDS
        .iter()
        .find(|f| template.contains_key(**f) && !answer.contains_key(**f));
    Err(PdAnswerError::NotCompletion {
        field: absent.copied(),
    })
}

/// Every field of [`KvTransferParams`] and the type the protocol gives it.
const PARAM_TYPES: [(&str, &str); 20] = [
    ("do_remote_decode", "a boolean"),
    ("do_remote_prefill", "a boolean"),
    ("kv_transport", "a string"),
    (
        "kv_handle",
        "a KV handle: request_id, transport, location, layout, tokens, blobs",
    ),
    ("first_token", "a token id"),
    ("prompt_token_ids", "an array of token ids"),
    ("kv_handle_signature", "a string"),
    ("kv_handle_expires_ms", "Unix milliseconds"),
    ("seed", "an unsigned 64-bit integer"),
    ("first_token_logprobs", "{\"logprob\", \"top\"}"),
    ("cached_tokens", "a token count"),
    ("weight_version", "a string"),
    ("prefill_ms", "a number"),
    ("kv_save_ms", "a number"),
    ("release_only", "a boolean"),
    ("resumed_tokens", "a token count"),
    ("remote_engine_id", "a string"),
    ("remote_host", "a string"),
    ("remote_port", "a port number"),
    // Not a field: what a whole-object failure names.
    ("kv_transfer_params", "the protocol's fields"),
];

fn check_params(params: Option<Value>) -> Result<KvTransferParams, PdAnswerError> {
    let map = match params {
        None | Some(Value::Null) => return Err(PdAnswerError::NoParams),
        Some(Value::Object(m)) => m,
        Some(_) => return Err(PdAnswerError::ParamsNotObject),
    };
    // Each field alone, in the table's order: every field is optional, so
    // one that does not parse alone is of the wrong type.
    for (field, expected) in PARAM_TYPES {
        let Some(v) = map.get(field) else {
            continue;
        };
        let one = Value::Object(Map::from_iter([(field.to_string(), v.clone())]));
        if serde_json::from_value::<KvTransferParams>(one).is_err() {
            return Err(PdAnswerError::WrongType { field, expected });
        }
    }
    let params: KvTransferParams =
        serde_json::from_value(Value::Object(map)).map_err(|_| PdAnswerError::WrongType {
            field: "kv_transfer_params",
            expected: "the protocol's fields",
        })?;
    let mut missing = Vec::new();
    if !params.do_remote_prefill {
        missing.push("do_remote_prefill: true");
    }
    if params.kv_handle.is_none() {
        missing.push("kv_handle");
    }
    if params.first_token.is_none() {
        missing.push("first_token");
    }
    if missing.is_empty() {
        Ok(params)
    } else {
        Err(PdAnswerError::Missing { missing })
    }
}

#[cfg(test)]
mod tests;
