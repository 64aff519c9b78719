//! The request rules every door applies the same way: the gateway, the
//! endpoint picker and the worker all call these functions, so a request is
//! accepted or refused (with the same `param`) wherever it enters.
//!
//! - [`parse_body`]: JSON body → typed request, with the messages clients see
//!   ([`parse_json`]: a key repeated in an object is refused);
//!   [`json_content_type`]: which `Content-Type` a body may come with.
//! - [`check_sampling`], [`check_completion`], [`check_chat`]: field rules.
//! - [`fields`]: the fields each request may carry (served, only "off", or
//!   informational); any other is refused by name.
//! - [`DEFAULT_MAX_TOKENS`], [`max_tokens_or_default`]: the completion default.
//! - [`prompt_too_long`]: the context-length refusal of a prompt too long to
//!   be worth tokenizing.
//! - [`sanitize_request_id`]: which client `x-request-id` values are kept.
//! - [`Role`]: what a worker does (prefill, decode, solo).
//! - [`unix_now`], [`ms`]: the clock helpers every response builder uses.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

pub mod fields;
mod sampling;
mod strict_json;

pub use sampling::{
    MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_STOP, MAX_STOP_BYTES, MAX_STOP_TOKEN_IDS, check_sampling,
    logit_bias, seed_bits, top_k,
};

use crate::openai::{ChatCompletionRequest, CompletionRequest, ErrorBody, Prompt};

pub use crate::openai::DEFAULT_MAX_TOKENS;

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
    /// The offending parameter (`None` for a body that is not a request at
    /// all, or when it is an unknown field: then `field`).
    pub param: Option<&'static str>,
    /// The offending field when it is none of the API's (its name as sent,
    /// at most 64 characters).
    pub field: Option<String>,
    /// Machine-readable code, where one is defined (`empty_body`,
    /// `invalid_json`, `duplicate_key`, `missing_model`, `invalid_request`).
    pub code: Option<&'static str>,
    /// Message for the client.
    pub message: String,
}

impl RuleError {
    /// A broken rule on `param`.
    pub fn param(param: &'static str, message: impl Into<String>) -> Self {
        RuleError {
            param: Some(param),
            field: None,
            code: None,
            message: message.into(),
        }
    }

    /// The `param` of the error body: the parameter, or the unknown field.
    pub fn param_name(&self) -> Option<&str> {
        self.param.or(self.field.as_deref())
    }

    /// Sets the unknown field's name.
    pub(crate) fn naming(mut self, field: String) -> Self {
        self.field = Some(field);
        self
    }

    fn body(code: &'static str, message: impl Into<String>) -> Self {
        RuleError {
            param: None,
            field: None,
            code: Some(code),
            message: message.into(),
        }
    }
}

/// Parses a JSON request body. Refused, each with its code: an empty body
/// (`empty_body`), malformed JSON or not an object (`invalid_json`), a key
/// repeated in an object (`duplicate_key`, [`parse_json`]), no
/// non-empty string `model` (`missing_model`, param `model`), wrongly typed
/// fields (`invalid_request`).
/// Every field is checked against the request type's table
/// ([`fields::Body::FIELDS`]): unknown (`unknown_parameter`) or not at its
/// "off" value (`unsupported_parameter`), each naming the field.
pub fn parse_body<T: fields::Body>(bytes: &[u8]) -> Result<T, RuleError> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(RuleError::body(
            "empty_body",
            "the request body is empty; expected a JSON object",
        ));
    }
    let value = parse_json(bytes)?;
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
                field: None,
                code: Some("missing_model"),
                message: "the request has no \"model\" (a non-empty string)".into(),
            });
        }
    }
    if let Some(table) = T::FIELDS {
        fields::check(obj, table)?;
    }
    match serde_json::from_value::<T>(value.clone()) {
        Ok(t) => Ok(t),
        Err(e) => {
            let mut err = RuleError::body("invalid_request", format!("invalid request: {e}"));
            if let Some(name) = T::FIELDS.and_then(|table| culprit::<T>(&value, table)) {
                err.param = Some(name);
                err.message = format!("invalid request: `{name}`: {e}");
            }
            Err(err)
        }
    }
}

/// A body as one JSON value: malformed JSON is `invalid_json`; an object
/// that repeats a key is `duplicate_key`, naming the key (`param`: the
/// request field it is or stands under), since two readers of such a body
/// (serde keeps the last, others the first) would not agree on what it asks.
pub fn parse_json(bytes: &[u8]) -> Result<serde_json::Value, RuleError> {
    strict_json::parse(bytes).map_err(|e| match e {
        strict_json::StrictError::Syntax(e) => {
            RuleError::body("invalid_json", format!("malformed JSON body: {e}"))
        }
        strict_json::StrictError::Duplicate { key, path } => {
            let (field, message) = if path.is_empty() {
                (
                    key.clone(),
                    format!("the request body repeats the key \"{key}\""),
                )
            } else {
                let top = path.split(['.', '[']).next().unwrap_or_default();
                (
                    top.to_string(),
                    format!("the request body repeats the key \"{key}\" in `{path}`"),
                )
            };
            RuleError::body("duplicate_key", message).naming(field)
        }
    })
}

/// Whether a `Content-Type` value names JSON: `application/json`, or a
/// `+json` type (`application/merge-patch+json`), its parameters (`charset`)
/// aside. The doors refuse any other with a 415 before reading the body.
pub fn json_content_type(value: &str) -> bool {
    let media = value.split(';').next().unwrap_or_default().trim();
    media.eq_ignore_ascii_case("application/json")
        || media
            .rsplit_once('+')
            .is_some_and(|(_, suffix)| suffix.eq_ignore_ascii_case("json"))
}

/// The field a body's type error comes from (serde names none through the
/// flattened sampling fields): an optional field whose removal makes the
/// body parse, else the one required field besides `model` (checked
/// before) when the body cut to its required fields still fails. `None`
/// when no single field is to blame (two bad fields); run only on the error
/// path, at most once per known field.
fn culprit<T: fields::Body>(
    value: &serde_json::Value,
    table: &'static [fields::Field],
) -> Option<&'static str> {
    let obj = value.as_object()?;
    let parses = |o: serde_json::Map<String, serde_json::Value>| {
        serde_json::from_value::<T>(serde_json::Value::Object(o))
    };
    let mut required = Vec::new();
    for name in table.iter().map(|f| f.name) {
        if !obj.contains_key(name) {
            continue;
        }
        let mut without = obj.clone();
        without.remove(name);
        match parses(without) {
            Ok(_) => return Some(name),
            Err(e)
                if e.to_string()
                    .starts_with(&format!("missing field `{name}`")) =>
            {
                required.push(name)
            }
            Err(_) => {}
        }
    }
    let only: serde_json::Map<_, _> = obj
        .iter()
        .filter(|(k, _)| required.contains(&k.as_str()))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    match (
        parses(only),
        required.iter().filter(|n| **n != "model").count(),
    ) {
        (Err(_), 1) => required.into_iter().find(|n| *n != "model"),
        _ => None,
    }
}

/// The context-length refusal of a prompt whose size alone proves it cannot
/// fit, found before (or while) tokenizing it: `at_least` is a proven lower
/// bound on its tokens (from its bytes and the tokenizer's longest token, or
/// from a tokenized prefix); `max_tokens` as asked for, `None` when not known
/// (then at least 1 token must fit). Same code, `param` and message family as the
/// refusal of a counted prompt (`openai::context_length_message`).
pub fn prompt_too_long(at_least: usize, max_tokens: Option<usize>, seq_len: usize) -> RuleError {
    RuleError {
        param: Some("max_tokens"),
        field: None,
        code: Some(crate::openai::CONTEXT_LENGTH_CODE),
        message: match max_tokens {
            Some(m) => format!(
                "prompt (at least {at_least} tokens) + max_tokens ({m}) = at least {} exceeds the compiled context length of {seq_len} tokens",
                at_least.saturating_add(m)
            ),
            None => format!(
                "prompt (at least {at_least} tokens) + max_tokens (at least 1) = at least {} exceeds the compiled context length of {seq_len} tokens",
                at_least.saturating_add(1)
            ),
        },
    }
}

/// A prompt of token ids holds only ids of the model's vocabulary of
/// `vocab` tokens; the first one past it is refused with `param` `prompt`.
pub fn check_token_ids(ids: &[u32], vocab: usize) -> Result<(), RuleError> {
    match ids.iter().position(|&t| t as usize >= vocab) {
        Some(i) => Err(RuleError::param(
            "prompt",
            format!(
                "prompt[{i}]: token id {} is outside the vocabulary (size {vocab})",
                ids[i]
            ),
        )),
        None => Ok(()),
    }
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
    sampling::check_min_tokens(
        &req.sampling,
        "max_tokens",
        max_tokens_or_default(req.sampling.max_tokens),
    )?;
    sampling::check_logprobs(req.logprobs, "logprobs")?;
    sampling::check_logprobs(req.chat_logprobs, "chat_logprobs")?;
    if req.echo == Some(true) && req.logprobs.is_some() {
        return Err(RuleError {
            param: Some("echo"),
            field: None,
            code: Some("unsupported_parameter"),
            message: "`echo` with `logprobs` needs the prompt's log-probabilities, which this server does not compute; send one or the other".into(),
        });
    }
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
    sampling::check_logprobs(req.top_logprobs, "top_logprobs")?;
    if req.top_logprobs.unwrap_or(0) > 0 && req.logprobs != Some(true) {
        return Err(RuleError::param(
            "top_logprobs",
            "top_logprobs needs \"logprobs\": true",
        ));
    }
    if let Some(m) = req.max_completion_tokens.or(req.sampling.max_tokens) {
        let name = if req.max_completion_tokens.is_some() {
            "max_completion_tokens"
        } else {
            "max_tokens"
        };
        sampling::check_min_tokens(&req.sampling, name, m)?;
    }
    if req.max_completion_tokens == Some(0) {
        return Err(RuleError::param(
            "max_completion_tokens",
            "max_completion_tokens must be at least 1",
        ));
    }
    chat_messages(req)?;
    check_template_fields(req)
}

/// `continue_final_message` needs `add_generation_prompt: false` (both on
/// contradict each other, as vLLM says); `chat_template_kwargs` may not
/// replace a variable the server gives the template.
fn check_template_fields(req: &ChatCompletionRequest) -> Result<(), RuleError> {
    if req.continue_final_message == Some(true) && req.add_generation_prompt != Some(false) {
        return Err(RuleError::param(
            "continue_final_message",
            "continue_final_message: true needs \"add_generation_prompt\": false \
             (the two cannot both be on)",
        ));
    }
    if let Some(kwargs) = &req.chat_template_kwargs
        && let Some(k) = kwargs
            .keys()
            .find(|k| crate::chat::RESERVED_TEMPLATE_VARIABLES.contains(&k.as_str()))
    {
        return Err(RuleError::param(
            "chat_template_kwargs",
            format!(
                "chat_template_kwargs.{k} is a variable the server gives the template; it cannot be replaced"
            ),
        ));
    }
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

// === impl From<&RuleError> for ErrorBody ===

/// A broken request rule as the 400 body every door sends: its message, its
/// `param` (the parameter, or the unknown field) and its code.
impl From<&RuleError> for ErrorBody {
    fn from(r: &RuleError) -> Self {
        let mut body = ErrorBody::new(ErrorBody::kind_for_status(400), r.message.clone());
        if let Some(p) = r.param_name() {
            body = body.with_param(p);
        }
        if let Some(c) = r.code {
            body = body.with_code(c);
        }
        body
    }
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
        ] {
            let e = completion(body).unwrap_err();
            assert_eq!((e.param, e.code), (None, Some(code)), "{body}");
        }
        // A wrongly typed field is named.
        let e = completion(r#"{"model":"m","prompt":5}"#).unwrap_err();
        assert_eq!((e.param, e.code), (Some("prompt"), Some("invalid_request")));
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

    /// A repeated key is refused wherever it stands, named (the request
    /// field it is or stands under) in `param`; so is a body that would be
    /// split into choices first.
    #[test]
    fn repeated_keys_are_refused_by_name() {
        for (body, param) in [
            (r#"{"model":"m","model":"n","prompt":"x"}"#, "model"),
            (
                r#"{"model":"m","prompt":"x","stop":"a","stop":"b"}"#,
                "stop",
            ),
            (
                r#"{"model":"m","prompt":"x","logit_bias":{"5":1,"5":-1}}"#,
                "logit_bias",
            ),
            (r#"{"model":"m","n":2,"n":1,"prompt":"x"}"#, "n"),
        ] {
            let e = completion(body).unwrap_err();
            assert_eq!(
                (e.param_name(), e.code),
                (Some(param), Some("duplicate_key")),
                "{body}"
            );
            assert!(
                crate::fanout::split(body.as_bytes(), false)
                    .unwrap()
                    .is_none()
            );
        }
        let chat = r#"{"model":"m","messages":[{"role":"user","content":"a","content":"b"}]}"#;
        let e = parse_body::<ChatCompletionRequest>(chat.as_bytes()).unwrap_err();
        assert_eq!(e.param_name(), Some("messages"));
        assert!(e.message.contains("messages[0]"), "{}", e.message);
    }

    #[test]
    fn token_ids_past_the_vocabulary_are_named() {
        assert!(check_token_ids(&[0, 1, 49_151], 49_152).is_ok());
        let e = check_token_ids(&[0, 49_152, 7], 49_152).unwrap_err();
        assert_eq!(e.param, Some("prompt"));
        assert!(e.message.contains("prompt[1]") && e.message.contains("49152"));
    }

    #[test]
    fn json_content_types() {
        for ok in [
            "application/json",
            "application/json; charset=utf-8",
            " APPLICATION/JSON ",
            "application/vnd.api+json",
        ] {
            assert!(json_content_type(ok), "{ok}");
        }
        for bad in [
            "text/plain",
            "text/json",
            "",
            "multipart/form-data; boundary=x",
        ] {
            assert!(!json_content_type(bad), "{bad}");
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
