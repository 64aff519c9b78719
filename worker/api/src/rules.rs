//! The request rules every door applies the same way: the gateway, the
//! endpoint picker and the worker all call these functions, so a request is
//! accepted or refused (with the same `param`) wherever it enters.
//!
//! - [`parse_body`]: JSON body → typed request, with the messages clients see.
//! - [`check_sampling`], [`check_completion`], [`check_chat`]: field rules.
//! - [`DEFAULT_MAX_TOKENS`], [`max_tokens_or_default`]: the completion default.
//! - [`sanitize_request_id`]: which client `x-request-id` values are kept.
//! - [`Role`]: what a worker does (prefill, decode, solo).
//! - [`unix_now`], [`ms`]: the clock helpers every response builder uses.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::openai::{ChatCompletionRequest, CompletionRequest, Prompt, SamplingFields};

/// `max_tokens` of a completion that sets none (OpenAI's default).
pub const DEFAULT_MAX_TOKENS: u32 = 16;

/// Largest `temperature` accepted (OpenAI's range is `[0, 2]`).
pub const MAX_TEMPERATURE: f32 = 2.0;

/// Longest client request id kept; longer ones are replaced by a fresh id.
pub const MAX_REQUEST_ID_LEN: usize = 64;

/// Chat roles a message may have.
pub const CHAT_ROLES: [&str; 5] = ["system", "user", "assistant", "tool", "developer"];

/// A request that breaks a rule: always a 400, with the parameter at fault.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct RuleError {
    /// The offending parameter (`None` for a body that is not a request at all).
    pub param: Option<&'static str>,
    /// Machine-readable code, where one is defined (`empty_body`,
    /// `invalid_json`, `missing_model`, `invalid_request`).
    pub code: Option<&'static str>,
    /// Message for the client.
    pub message: String,
}

impl RuleError {
    /// A broken rule on `param`.
    pub fn param(param: &'static str, message: impl Into<String>) -> Self {
        RuleError {
            param: Some(param),
            code: None,
            message: message.into(),
        }
    }

    fn body(code: &'static str, message: impl Into<String>) -> Self {
        RuleError {
            param: None,
            code: Some(code),
            message: message.into(),
        }
    }
}

/// Parses a JSON request body. Refused, each with its code: an empty body
/// (`empty_body`), malformed JSON or not an object (`invalid_json`), no
/// non-empty string `model` (`missing_model`, param `model`), wrongly typed
/// fields (`invalid_request`).
pub fn parse_body<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, RuleError> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(RuleError::body(
            "empty_body",
            "the request body is empty; expected a JSON object",
        ));
    }
    let value: serde_json::Value = serde_json::from_slice(bytes)
        .map_err(|e| RuleError::body("invalid_json", format!("malformed JSON body: {e}")))?;
    let Some(obj) = value.as_object() else {
        return Err(RuleError::body(
            "invalid_json",
            "malformed JSON body: the request body must be a JSON object",
        ));
    };
    match obj.get("model") {
        Some(serde_json::Value::String(m)) if !m.is_empty() => {}
        _ => {
            return Err(RuleError {
                param: Some("model"),
                code: Some("missing_model"),
                message: "the request has no \"model\" (a non-empty string)".into(),
            });
        }
    }
    check_unsupported(obj)?;
    serde_json::from_value(value)
        .map_err(|e| RuleError::body("invalid_request", format!("invalid request: {e}")))
}

/// Is this value the parameter's "off" setting?
type Off = fn(&serde_json::Value) -> bool;

fn null(v: &serde_json::Value) -> bool {
    v.is_null()
}
fn falsy(v: &serde_json::Value) -> bool {
    v.is_null() || v == &serde_json::Value::Bool(false)
}
fn zero(v: &serde_json::Value) -> bool {
    v.is_null() || v.as_f64() == Some(0.0)
}
fn one(v: &serde_json::Value) -> bool {
    v.is_null() || v.as_f64() == Some(1.0)
}
fn empty(v: &serde_json::Value) -> bool {
    match v {
        serde_json::Value::Null => true,
        serde_json::Value::String(s) => s.is_empty(),
        serde_json::Value::Array(a) => a.is_empty(),
        serde_json::Value::Object(o) => o.is_empty(),
        _ => false,
    }
}
fn no_tool(v: &serde_json::Value) -> bool {
    v.is_null() || v.as_str() == Some("none")
}
fn text_format(v: &serde_json::Value) -> bool {
    v.is_null() || v.get("type").and_then(|t| t.as_str()) == Some("text")
}

/// Parameters of the OpenAI and vLLM request schemas this server does not
/// implement, with the value that means "off": accepted only at that value
/// (clients send some of them explicitly), anything else is a 400 naming the
/// parameter, never silently ignored.
pub const UNSUPPORTED: &[(&str, &str)] = &[
    ("best_of", "1"),
    ("echo", "false"),
    ("suffix", "empty"),
    ("logprobs", "null or false"),
    ("top_logprobs", "0"),
    ("prompt_logprobs", "null"),
    ("presence_penalty", "0"),
    ("frequency_penalty", "0"),
    ("repetition_penalty", "1"),
    ("logit_bias", "empty"),
    ("min_tokens", "0"),
    ("min_p", "0"),
    ("ignore_eos", "false"),
    ("stop_token_ids", "empty"),
    ("use_beam_search", "false"),
    ("tools", "empty"),
    ("functions", "empty"),
    ("tool_choice", "\"none\""),
    ("function_call", "\"none\""),
    ("response_format", "{\"type\": \"text\"}"),
    ("guided_json", "null"),
    ("guided_regex", "null"),
    ("guided_choice", "null"),
    ("guided_grammar", "null"),
    ("audio", "null"),
    ("modalities", "null"),
    ("prediction", "null"),
];

/// The "off" test of each [`UNSUPPORTED`] parameter, in the same order.
const OFF: &[Off] = &[
    one,
    falsy,
    empty,
    falsy,
    zero,
    null,
    zero,
    zero,
    one,
    empty,
    zero,
    zero,
    falsy,
    empty,
    falsy,
    empty,
    empty,
    no_tool,
    no_tool,
    text_format,
    null,
    null,
    null,
    null,
    null,
    null,
    null,
];

fn check_unsupported(obj: &serde_json::Map<String, serde_json::Value>) -> Result<(), RuleError> {
    for ((name, off), is_off) in UNSUPPORTED.iter().zip(OFF) {
        if let Some(v) = obj.get(*name)
            && !is_off(v)
        {
            return Err(RuleError {
                param: Some(name),
                code: Some("unsupported_parameter"),
                message: format!(
                    "`{name}` is not supported by this server; only its default ({off}) is accepted"
                ),
            });
        }
    }
    Ok(())
}

/// The sampling rules shared by completions and chat.
pub fn check_sampling(s: &SamplingFields) -> Result<(), RuleError> {
    if let Some(n) = s.n
        && n != 1
    {
        return Err(RuleError::param(
            "n",
            format!("n = {n} is not supported; only n = 1 is served"),
        ));
    }
    if s.max_tokens == Some(0) {
        return Err(RuleError::param(
            "max_tokens",
            "max_tokens must be at least 1",
        ));
    }
    if let Some(t) = s.temperature
        && !(t.is_finite() && (0.0..=MAX_TEMPERATURE).contains(&t))
    {
        return Err(RuleError::param(
            "temperature",
            format!("temperature {t} is outside [0, {MAX_TEMPERATURE}]"),
        ));
    }
    if let Some(p) = s.top_p
        && !(p > 0.0 && p <= 1.0)
    {
        return Err(RuleError::param(
            "top_p",
            format!("top_p {p} is outside (0, 1]"),
        ));
    }
    if let Some(stop) = &s.stop
        && stop.to_vec().iter().any(String::is_empty)
    {
        return Err(RuleError::param("stop", "stop sequences must not be empty"));
    }
    Ok(())
}

/// `max_tokens` as given, or [`DEFAULT_MAX_TOKENS`].
pub fn max_tokens_or_default(max_tokens: Option<u32>) -> u32 {
    max_tokens.unwrap_or(DEFAULT_MAX_TOKENS)
}

/// The one prompt of a completion request (a batch of one is unwrapped);
/// several prompts or an empty one are refused.
pub fn single_prompt(prompt: &Prompt) -> Result<Prompt, RuleError> {
    let one = match prompt {
        Prompt::TextBatch(v) if v.len() == 1 => Prompt::Text(v[0].clone()),
        Prompt::TokensBatch(v) if v.len() == 1 => Prompt::Tokens(v[0].clone()),
        Prompt::TextBatch(_) | Prompt::TokensBatch(_) => {
            return Err(RuleError::param(
                "prompt",
                "only one prompt per request is served",
            ));
        }
        p => p.clone(),
    };
    let empty = match &one {
        Prompt::Text(t) => t.is_empty(),
        Prompt::Tokens(t) => t.is_empty(),
        Prompt::TextBatch(_) | Prompt::TokensBatch(_) => false,
    };
    if empty {
        return Err(RuleError::param("prompt", "prompt must not be empty"));
    }
    Ok(one)
}

/// Every rule of a completion request a client sends (`kv_transfer_params`
/// is checked by the door that owns the PD protocol, not here).
pub fn check_completion(req: &CompletionRequest) -> Result<(), RuleError> {
    check_sampling(&req.sampling)?;
    single_prompt(&req.prompt)?;
    Ok(())
}

/// The chat messages as `(role, text)` pairs, each role checked.
pub fn chat_messages(req: &ChatCompletionRequest) -> Result<Vec<(String, String)>, RuleError> {
    if req.messages.is_empty() {
        return Err(RuleError::param("messages", "messages must not be empty"));
    }
    let mut out = Vec::with_capacity(req.messages.len());
    for (i, m) in req.messages.iter().enumerate() {
        if !CHAT_ROLES.contains(&m.role.as_str()) {
            return Err(RuleError::param(
                "messages",
                format!(
                    "messages[{i}].role '{}' is not one of {}",
                    m.role.chars().take(40).collect::<String>(),
                    CHAT_ROLES.join(", ")
                ),
            ));
        }
        let text = m
            .content
            .text()
            .map_err(|e| RuleError::param("messages", format!("messages[{i}]: {e}")))?;
        out.push((m.role.clone(), text));
    }
    Ok(out)
}

/// Every rule of a chat request.
pub fn check_chat(req: &ChatCompletionRequest) -> Result<(), RuleError> {
    check_sampling(&req.sampling)?;
    if req.max_completion_tokens == Some(0) {
        return Err(RuleError::param(
            "max_completion_tokens",
            "max_completion_tokens must be at least 1",
        ));
    }
    chat_messages(req)?;
    Ok(())
}

/// A client's `x-request-id`, kept only when it is 1 to
/// [`MAX_REQUEST_ID_LEN`] characters of `[A-Za-z0-9._-]` (after trimming).
///
/// Anything else is not filtered into shape (`a/b` and `ab` would then be the
/// same id): it is dropped, and the caller makes a fresh id.
pub fn sanitize_request_id(raw: &str) -> Option<String> {
    let v = raw.trim();
    let ok = !v.is_empty()
        && v.len() <= MAX_REQUEST_ID_LEN
        && v.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    ok.then(|| v.to_string())
}

/// What an endpoint (a worker) does with requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Prefill only: answers `do_remote_decode` requests, pushes the KV.
    Prefill,
    /// Decode: continues from a pulled KV cache; also serves whole requests
    /// (prefilling locally) and orchestrates `x-prefiller-host-port` requests.
    Decode,
    /// Everything on one worker (also answers prefill-only requests).
    Solo,
}

impl Role {
    /// Lower-case name (`prefill`, `decode`, `solo`).
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Solo => "solo",
        }
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Role {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "prefill" => Ok(Role::Prefill),
            "decode" => Ok(Role::Decode),
            "solo" => Ok(Role::Solo),
            other => Err(format!(
                "role '{other}' is not one of prefill, decode, solo"
            )),
        }
    }
}

/// Seconds since the Unix epoch (0 if the clock is before it).
pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// A duration in milliseconds, as the `timings` fields carry it.
pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

#[cfg(test)]
mod tests {
    use super::*;

    fn completion(json: &str) -> Result<(), RuleError> {
        check_completion(&parse_body::<CompletionRequest>(json.as_bytes())?)
    }

    #[test]
    fn sampling_ranges() {
        assert!(completion(r#"{"model":"m","prompt":"x","temperature":2}"#).is_ok());
        assert!(completion(r#"{"model":"m","prompt":"x","temperature":0,"top_p":1}"#).is_ok());
        for (body, param) in [
            (
                r#"{"model":"m","prompt":"x","temperature":2.5}"#,
                "temperature",
            ),
            (
                r#"{"model":"m","prompt":"x","temperature":-1}"#,
                "temperature",
            ),
            (r#"{"model":"m","prompt":"x","top_p":0}"#, "top_p"),
            (r#"{"model":"m","prompt":"x","max_tokens":0}"#, "max_tokens"),
            (r#"{"model":"m","prompt":"x","n":2}"#, "n"),
            (r#"{"model":"m","prompt":""}"#, "prompt"),
            (r#"{"model":"m","prompt":["a","b"]}"#, "prompt"),
            (r#"{"model":"m","prompt":"x","stop":["a",""]}"#, "stop"),
            (r#"{"model":"m","prompt":"x","stop":""}"#, "stop"),
        ] {
            assert_eq!(completion(body).unwrap_err().param, Some(param), "{body}");
        }
    }

    #[test]
    fn bodies_that_are_not_requests() {
        for (body, code) in [
            ("", "empty_body"),
            ("  ", "empty_body"),
            ("{", "invalid_json"),
            ("[1]", "invalid_json"),
            (r#"{"model":"m","prompt":5}"#, "invalid_request"),
        ] {
            let e = completion(body).unwrap_err();
            assert_eq!((e.param, e.code), (None, Some(code)), "{body}");
        }
        for body in [
            r#"{"prompt":"x"}"#,
            r#"{"model":"","prompt":"x"}"#,
            r#"{"model":1}"#,
        ] {
            let e = completion(body).unwrap_err();
            assert_eq!(
                (e.param, e.code),
                (Some("model"), Some("missing_model")),
                "{body}"
            );
        }
    }

    #[test]
    fn unsupported_parameters_are_refused_by_name_and_accepted_when_off() {
        assert_eq!(UNSUPPORTED.len(), OFF.len());
        let on: &[(&str, &str)] = &[
            ("best_of", "2"),
            ("echo", "true"),
            ("suffix", "\"x\""),
            ("logprobs", "1"),
            ("logprobs", "true"),
            ("top_logprobs", "3"),
            ("prompt_logprobs", "1"),
            ("presence_penalty", "0.5"),
            ("frequency_penalty", "-1"),
            ("repetition_penalty", "1.2"),
            ("logit_bias", "{\"50256\": -100}"),
            ("min_tokens", "4"),
            ("min_p", "0.1"),
            ("ignore_eos", "true"),
            ("stop_token_ids", "[2]"),
            ("use_beam_search", "true"),
            ("tools", "[{\"type\":\"function\"}]"),
            ("functions", "[{}]"),
            ("tool_choice", "\"auto\""),
            ("function_call", "\"auto\""),
            ("response_format", "{\"type\":\"json_object\"}"),
            ("guided_json", "{}"),
            ("guided_regex", "\"a+\""),
            ("guided_choice", "[\"a\"]"),
            ("guided_grammar", "\"g\""),
            ("audio", "{}"),
            ("modalities", "[\"audio\"]"),
            ("prediction", "{}"),
        ];
        for (name, value) in on {
            let body = format!(r#"{{"model":"m","prompt":"x","{name}":{value}}}"#);
            let e = completion(&body).unwrap_err();
            assert_eq!(
                (e.param, e.code),
                (Some(*name), Some("unsupported_parameter")),
                "{body}"
            );
        }
        // Every listed parameter has a refused value above.
        for (name, _) in UNSUPPORTED {
            assert!(on.iter().any(|(n, _)| n == name), "{name} untested");
        }
        let off: &[(&str, &str)] = &[
            ("best_of", "1"),
            ("echo", "false"),
            ("suffix", "\"\""),
            ("logprobs", "null"),
            ("logprobs", "false"),
            ("top_logprobs", "0"),
            ("presence_penalty", "0"),
            ("frequency_penalty", "0.0"),
            ("repetition_penalty", "1.0"),
            ("logit_bias", "{}"),
            ("min_tokens", "0"),
            ("ignore_eos", "false"),
            ("stop_token_ids", "[]"),
            ("tools", "[]"),
            ("tool_choice", "\"none\""),
            ("response_format", "{\"type\":\"text\"}"),
            ("user", "\"someone\""),
        ];
        for (name, value) in off {
            let body = format!(r#"{{"model":"m","prompt":"x","{name}":{value}}}"#);
            assert!(completion(&body).is_ok(), "{body}");
        }
    }

    #[test]
    fn chat_rules() {
        let chat = |s: &str| check_chat(&parse_body::<ChatCompletionRequest>(s.as_bytes())?);
        assert!(chat(r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#).is_ok());
        assert_eq!(
            chat(r#"{"model":"m","messages":[]}"#).unwrap_err().param,
            Some("messages")
        );
        assert_eq!(
            chat(r#"{"model":"m","messages":[{"role":"wizard","content":"hi"}]}"#)
                .unwrap_err()
                .param,
            Some("messages")
        );
        assert_eq!(
            chat(r#"{"model":"m","messages":[{"role":"user","content":"x"}],"max_completion_tokens":0}"#)
                .unwrap_err()
                .param,
            Some("max_completion_tokens")
        );
    }

    #[test]
    fn request_ids_are_kept_whole_or_not_at_all() {
        assert_eq!(sanitize_request_id(" abc-1.2_x "), Some("abc-1.2_x".into()));
        assert_eq!(sanitize_request_id("a/b"), None);
        assert_eq!(sanitize_request_id("ab"), Some("ab".into()));
        assert_eq!(sanitize_request_id(""), None);
        assert_eq!(sanitize_request_id(&"a".repeat(65)), None);
        assert_eq!(
            sanitize_request_id(&"a".repeat(64)).map(|s| s.len()),
            Some(64)
        );
    }

    #[test]
    fn roles_round_trip() {
        for r in [Role::Prefill, Role::Decode, Role::Solo] {
            assert_eq!(r.as_str().parse::<Role>(), Ok(r));
            assert_eq!(
                serde_json::to_string(&r).unwrap(),
                format!("\"{}\"", r.as_str())
            );
        }
        assert!("both".parse::<Role>().is_err());
    }
}
