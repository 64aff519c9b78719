//! The fields each request body may carry, and what this server does with
//! each: [`How::Served`] (honoured; its value is checked by the field rules),
//! [`How::OnlyOff`] (in the OpenAI or vLLM schema but not implemented:
//! accepted only at the value that means "off", a 400 with code
//! `unsupported_parameter` naming it otherwise) or [`How::Informational`]
//! (accepted, without effect on the answer: `user`, …). A field in no table
//! is a 400 with code `unknown_parameter` naming it (vLLM would ignore it
//! with a warning; we refuse it, so nothing is silently ignored).

use serde::de::DeserializeOwned;
use serde_json::Value;

use super::RuleError;
use crate::openai::{ChatCompletionRequest, CompletionRequest};

/// Is this value the field's "off" setting?
pub type Off = fn(&Value) -> bool;

/// What the server does with a field.
#[derive(Clone, Copy)]
pub enum How {
    /// Honoured.
    Served,
    /// Not implemented: accepted only at its "off" value.
    OnlyOff {
        /// The "off" value, as the error message names it.
        off: &'static str,
        /// The test for it.
        is_off: Off,
    },
    /// Accepted, without effect on the answer.
    Informational,
    /// Honoured, and an object whose own fields are checked against this
    /// table the same way (an unknown one is named as `outer.inner`).
    Object(&'static [Field]),
}

/// One field of a request body.
#[derive(Clone, Copy)]
pub struct Field {
    /// The JSON name.
    pub name: &'static str,
    /// What is done with it.
    pub how: How,
}

/// A request body type [`super::parse_body`] parses, with its field table
/// (`None`: any JSON object, only `model` checked).
pub trait Body: DeserializeOwned {
    /// The fields it may carry.
    const FIELDS: Option<&'static [Field]>;
}

impl Body for CompletionRequest {
    const FIELDS: Option<&'static [Field]> = Some(COMPLETION);
}

impl Body for ChatCompletionRequest {
    const FIELDS: Option<&'static [Field]> = Some(CHAT);
}

impl Body for Value {
    const FIELDS: Option<&'static [Field]> = None;
}

fn null(v: &Value) -> bool {
    v.is_null()
}
fn falsy(v: &Value) -> bool {
    v.is_null() || v == &Value::Bool(false)
}
fn one(v: &Value) -> bool {
    v.is_null() || v.as_f64() == Some(1.0)
}
fn empty(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::String(s) => s.is_empty(),
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
        _ => false,
    }
}
fn no_tool(v: &Value) -> bool {
    v.is_null() || v.as_str() == Some("none")
}
fn text_format(v: &Value) -> bool {
    // `{"type": "text"}` and nothing else: a schema beside it would be ignored.
    v.is_null()
        || v.as_object()
            .is_some_and(|o| o.len() == 1 && o.get("type").and_then(Value::as_str) == Some("text"))
}
fn any_bool(v: &Value) -> bool {
    v.is_null() || v.is_boolean()
}
fn text_only(v: &Value) -> bool {
    v.is_null() || v == &serde_json::json!(["text"])
}
fn default_tier(v: &Value) -> bool {
    v.is_null() || matches!(v.as_str(), Some("auto" | "default"))
}

const fn served(name: &'static str) -> Field {
    Field {
        name,
        how: How::Served,
    }
}
const fn only(name: &'static str, off: &'static str, is_off: Off) -> Field {
    Field {
        name,
        how: How::OnlyOff { off, is_off },
    }
}
const fn object(name: &'static str, fields: &'static [Field]) -> Field {
    Field {
        name,
        how: How::Object(fields),
    }
}
/// The fields of `stream_options`.
pub const STREAM_OPTIONS: &[Field] = &[served("include_usage"), served("continuous_usage_stats")];
const fn info(name: &'static str) -> Field {
    Field {
        name,
        how: How::Informational,
    }
}

/// The fields both APIs share, served the same way.
macro_rules! shared {
    () => {
        [
            served("model"),
            served("max_tokens"),
            served("temperature"),
            served("top_p"),
            served("top_k"),
            served("min_p"),
            served("seed"),
            served("stop"),
            served("stream"),
            object("stream_options", STREAM_OPTIONS),
            served("presence_penalty"),
            served("frequency_penalty"),
            served("repetition_penalty"),
            served("logit_bias"),
            served("min_tokens"),
            served("ignore_eos"),
            served("stop_token_ids"),
            served("cache_salt"),
            served("skip_special_tokens"),
            served("spaces_between_special_tokens"),
            served("n"),
            only("prompt_logprobs", "null", null),
            only("use_beam_search", "false", falsy),
            only("response_format", "{\"type\": \"text\"}", text_format),
            only("guided_json", "null", null),
            only("guided_regex", "null", null),
            only("guided_choice", "null", null),
            only("guided_grammar", "null", null),
            only("guided_decoding_backend", "null", null),
            only("guided_whitespace_pattern", "null", null),
            only("allowed_token_ids", "null", null),
            only("bad_words", "empty", empty),
            only("truncate_prompt_tokens", "null", null),
            only("include_stop_str_in_output", "false", falsy),
            info("user"),
        ]
    };
}

const SHARED_LEN: usize = shared!().len();

const fn join<const A: usize, const B: usize, const N: usize>(
    a: [Field; A],
    b: [Field; B],
) -> [Field; N] {
    let mut out = [served(""); N];
    let mut i = 0;
    while i < A {
        out[i] = a[i];
        i += 1;
    }
    while i < N {
        out[i] = b[i - A];
        i += 1;
    }
    out
}

/// The fields of `tokenized_prompt` (a front door's, refused from clients there).
pub const TOKENIZED_PROMPT: &[Field] = &[served("digest"), served("ids")];

const COMPLETION_OWN: [Field; 8] = [
    served("prompt"),
    served("logprobs"),
    served("echo"),
    served("chat_logprobs"),
    served("kv_transfer_params"),
    object("tokenized_prompt", TOKENIZED_PROMPT),
    only("best_of", "1", one),
    only("suffix", "empty", empty),
];

const CHAT_OWN: [Field; 26] = [
    served("messages"),
    served("add_generation_prompt"),
    served("continue_final_message"),
    served("chat_template_kwargs"),
    served("max_completion_tokens"),
    served("logprobs"),
    served("top_logprobs"),
    only("tools", "empty", empty),
    only("tool_choice", "\"none\"", no_tool),
    only("functions", "empty", empty),
    only("function_call", "\"none\"", no_tool),
    only("parallel_tool_calls", "a boolean", any_bool),
    only("audio", "null", null),
    only("modalities", "[\"text\"]", text_only),
    only("prediction", "null", null),
    only("store", "false", falsy),
    only("metadata", "empty", empty),
    only("service_tier", "\"auto\" or \"default\"", default_tier),
    only("reasoning_effort", "null", null),
    only("verbosity", "null", null),
    only("web_search_options", "null", null),
    only("echo", "false", falsy),
    only("best_of", "1", one),
    info("safety_identifier"),
    info("prompt_cache_key"),
    only("chat_template", "null", null),
];

/// The fields of `POST /v1/completions`.
pub const COMPLETION: &[Field] =
    &join::<SHARED_LEN, 8, { SHARED_LEN + 8 }>(shared!(), COMPLETION_OWN);

/// The fields of `POST /v1/chat/completions`.
pub const CHAT: &[Field] = &join::<SHARED_LEN, 26, { SHARED_LEN + 26 }>(shared!(), CHAT_OWN);

/// Checks every field of `obj` against `table`.
pub(super) fn check(
    obj: &serde_json::Map<String, Value>,
    table: &[Field],
) -> Result<(), RuleError> {
    check_in(obj, table, None)
}

/// [`check`] of an object nested in the field `outer` (`None`: the body).
fn check_in(
    obj: &serde_json::Map<String, Value>,
    table: &[Field],
    outer: Option<&'static str>,
) -> Result<(), RuleError> {
    let path = |name: &str| match outer {
        Some(o) => format!("{o}.{name}"),
        None => name.to_string(),
    };
    for (name, v) in obj {
        let Some(field) = table.iter().find(|f| f.name == name) else {
            let shown: String = path(name).chars().take(64).collect();
            return Err(RuleError {
                param: None,
                field: None,
                code: Some("unknown_parameter"),
                message: format!("`{shown}` is not a parameter of this API"),
            }
            .naming(shown));
        };
        match field.how {
            How::OnlyOff { off, is_off } if !is_off(v) => {
                let shown = path(field.name);
                let e = RuleError {
                    param: None,
                    field: None,
                    code: Some("unsupported_parameter"),
                    message: format!(
                        "`{shown}` is not supported by this server; only its default ({off}) is accepted"
                    ),
                };
                return Err(match outer {
                    None => RuleError {
                        param: Some(field.name),
                        ..e
                    },
                    Some(_) => e.naming(shown),
                });
            }
            // Nested objects are checked only at the top level's depth + 1
            // (no table nests deeper); a non-object is the type check's.
            How::Object(inner) if outer.is_none() => {
                if let Some(o) = v.as_object() {
                    check_in(o, inner, Some(field.name))?;
                }
            }
            _ => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rules::{check_chat, check_completion, parse_body};

    fn completion(json: &str) -> Result<(), RuleError> {
        check_completion(&parse_body::<CompletionRequest>(json.as_bytes())?)
    }

    fn chat(json: &str) -> Result<(), RuleError> {
        check_chat(&parse_body::<ChatCompletionRequest>(json.as_bytes())?)
    }

    #[test]
    fn names_are_unique_per_api() {
        for table in [COMPLETION, CHAT] {
            for (i, f) in table.iter().enumerate() {
                assert!(!f.name.is_empty());
                assert!(
                    table[i + 1..].iter().all(|g| g.name != f.name),
                    "{} twice",
                    f.name
                );
            }
        }
    }

    #[test]
    fn unknown_fields_are_refused_by_name() {
        let e = completion(r#"{"model":"m","prompt":"x","temprature":1}"#).unwrap_err();
        assert_eq!(
            (e.param_name(), e.code),
            (Some("temprature"), Some("unknown_parameter"))
        );
        // A completion field is not a chat field, and the other way round.
        let e = chat(r#"{"model":"m","messages":[{"role":"user","content":"x"}],"prompt":"x"}"#)
            .unwrap_err();
        assert_eq!(e.param_name(), Some("prompt"));
        let e = completion(r#"{"model":"m","prompt":"x","top_logprobs":2}"#).unwrap_err();
        assert_eq!(e.param_name(), Some("top_logprobs"));
    }

    #[test]
    fn a_doors_tokenized_prompt_is_a_completion_field_checked_by_name() {
        let body = r#"{"model":"m","prompt":"x","tokenized_prompt":{"digest":"0123456789abcdef","ids":[1,2]}}"#;
        let req = parse_body::<CompletionRequest>(body.as_bytes()).unwrap();
        assert_eq!(
            req.tokenized_prompt,
            Some(crate::openai::TokenizedPrompt {
                digest: "0123456789abcdef".into(),
                ids: vec![1, 2],
            })
        );
        let e = completion(
            r#"{"model":"m","prompt":"x","tokenized_prompt":{"digest":"d","ids":[1],"extra":1}}"#,
        )
        .unwrap_err();
        assert_eq!(e.param_name(), Some("tokenized_prompt.extra"));
        let e = chat(
            r#"{"model":"m","messages":[{"role":"user","content":"x"}],"tokenized_prompt":{}}"#,
        )
        .unwrap_err();
        assert_eq!(e.param_name(), Some("tokenized_prompt"));
    }

    #[test]
    fn nested_objects_are_checked_field_by_field() {
        // stream_options: its two fields are served, any other is named.
        for ok in [
            r#"{"include_usage":true}"#,
            r#"{"include_usage":true,"continuous_usage_stats":true}"#,
            "{}",
        ] {
            let body =
                format!(r#"{{"model":"m","prompt":"x","stream":true,"stream_options":{ok}}}"#);
            assert!(completion(&body).is_ok(), "{body}");
        }
        let e = completion(
            r#"{"model":"m","prompt":"x","stream":true,"stream_options":{"include_usage":true,"bogus":1}}"#,
        )
        .unwrap_err();
        assert_eq!(
            (e.param_name(), e.code),
            (Some("stream_options.bogus"), Some("unknown_parameter"))
        );
        let e = chat(
            r#"{"model":"m","messages":[{"role":"user","content":"x"}],"stream":true,"stream_options":{"continuous_usage":true}}"#,
        )
        .unwrap_err();
        assert_eq!(e.param_name(), Some("stream_options.continuous_usage"));
        // A wrongly typed nested field is the type check's 400.
        let e = completion(
            r#"{"model":"m","prompt":"x","stream":true,"stream_options":{"include_usage":"yes"}}"#,
        )
        .unwrap_err();
        assert_eq!(e.code, Some("invalid_request"));
        // stream_options without a stream would do nothing: refused.
        let e = completion(r#"{"model":"m","prompt":"x","stream_options":{"include_usage":true}}"#)
            .unwrap_err();
        assert_eq!(e.param_name(), Some("stream_options"));
        // response_format: `{"type": "text"}` and nothing beside it.
        let e = completion(
            r#"{"model":"m","prompt":"x","response_format":{"type":"text","json_schema":{}}}"#,
        )
        .unwrap_err();
        assert_eq!(
            (e.param_name(), e.code),
            (Some("response_format"), Some("unsupported_parameter"))
        );
    }

    #[test]
    fn only_off_fields_are_refused_unless_off() {
        for (name, on, off) in [
            ("best_of", "2", "1"),
            ("suffix", "\"x\"", "\"\""),
            ("prompt_logprobs", "1", "null"),
            ("use_beam_search", "true", "false"),
            (
                "response_format",
                "{\"type\":\"json_object\"}",
                "{\"type\":\"text\"}",
            ),
            ("guided_json", "{}", "null"),
        ] {
            let body = format!(r#"{{"model":"m","prompt":"x","{name}":{on}}}"#);
            let e = completion(&body).unwrap_err();
            assert_eq!(
                (e.param, e.code),
                (Some(name), Some("unsupported_parameter")),
                "{body}"
            );
            let body = format!(r#"{{"model":"m","prompt":"x","{name}":{off}}}"#);
            assert!(completion(&body).is_ok(), "{body}");
        }
        // The served ones, at values they serve.
        for (name, v) in [
            ("logprobs", "5"),
            ("echo", "true"),
            ("presence_penalty", "0.5"),
            ("frequency_penalty", "-1"),
            ("repetition_penalty", "1.2"),
            ("logit_bias", "{\"50\": -100}"),
            ("min_tokens", "4"),
            ("min_p", "0.1"),
            ("ignore_eos", "true"),
            ("stop_token_ids", "[2]"),
            ("top_k", "-1"),
            ("seed", "-5"),
            ("user", "\"someone\""),
        ] {
            let body = format!(r#"{{"model":"m","prompt":"x","{name}":{v}}}"#);
            assert!(completion(&body).is_ok(), "{body}");
        }
    }

    #[test]
    fn logprobs_bounds_and_combinations() {
        let e = completion(r#"{"model":"m","prompt":"x","logprobs":21}"#).unwrap_err();
        assert_eq!(
            (e.param, e.code),
            (Some("logprobs"), Some("unsupported_parameter"))
        );
        assert!(completion(r#"{"model":"m","prompt":"x","logprobs":20}"#).is_ok());
        let e = completion(r#"{"model":"m","prompt":"x","logprobs":1,"echo":true}"#).unwrap_err();
        assert_eq!(e.param, Some("echo"));
        let e =
            completion(r#"{"model":"m","prompt":"x","max_tokens":3,"min_tokens":4}"#).unwrap_err();
        assert_eq!(e.param, Some("min_tokens"));
        let m = r#""messages":[{"role":"user","content":"x"}]"#;
        assert!(
            chat(&format!(
                r#"{{"model":"m",{m},"logprobs":true,"top_logprobs":20}}"#
            ))
            .is_ok()
        );
        for (extra, param) in [
            (r#""logprobs":true,"top_logprobs":21"#, "top_logprobs"),
            (r#""top_logprobs":2"#, "top_logprobs"),
            (r#""tools":[{"type":"function"}]"#, "tools"),
            (r#""store":true"#, "store"),
            (r#""max_completion_tokens":2,"min_tokens":3"#, "min_tokens"),
        ] {
            let e = chat(&format!(r#"{{"model":"m",{m},{extra}}}"#)).unwrap_err();
            assert_eq!(e.param, Some(param), "{extra}");
        }
    }

    #[test]
    fn vllm_template_and_detokenizer_fields() {
        let m = r#""messages":[{"role":"user","content":"x"}]"#;
        for extra in [
            r#""add_generation_prompt":false"#,
            r#""add_generation_prompt":false,"continue_final_message":true"#,
            r#""chat_template_kwargs":{"enable_thinking":false,"x":[1,{"y":null}]}"#,
            r#""skip_special_tokens":false,"spaces_between_special_tokens":false"#,
        ] {
            assert!(
                chat(&format!(r#"{{"model":"m",{m},{extra}}}"#)).is_ok(),
                "{extra}"
            );
        }
        for (extra, param) in [
            // Both on contradict each other (the default is on).
            (r#""continue_final_message":true"#, "continue_final_message"),
            (
                r#""continue_final_message":true,"add_generation_prompt":true"#,
                "continue_final_message",
            ),
            (
                r#""chat_template_kwargs":{"messages":[]}"#,
                "chat_template_kwargs",
            ),
            (
                r#""chat_template_kwargs":{"tools":[{}]}"#,
                "chat_template_kwargs",
            ),
        ] {
            let e = chat(&format!(r#"{{"model":"m",{m},{extra}}}"#)).unwrap_err();
            assert_eq!(e.param, Some(param), "{extra}");
        }
        // Wrong types are the type check's 400; chat fields are not completion fields.
        for body in [
            format!(r#"{{"model":"m",{m},"chat_template_kwargs":[1]}}"#),
            format!(r#"{{"model":"m",{m},"skip_special_tokens":"no"}}"#),
        ] {
            let e = chat(&body).unwrap_err();
            assert_eq!(e.code, Some("invalid_request"), "{body}");
            // The culprit is named, even through the flattened sampling fields.
            assert!(
                matches!(
                    e.param,
                    Some("chat_template_kwargs" | "skip_special_tokens")
                ),
                "{body}: {:?}",
                e.param
            );
        }
        // Two bad fields: no single one to blame, the message says what failed.
        let e = completion(r#"{"model":"m","prompt":"x","seed":"a","top_p":"b"}"#).unwrap_err();
        assert_eq!((e.code, e.param), (Some("invalid_request"), None));
        // A required field of the wrong type is named too.
        let e = completion(r#"{"model":"m","prompt":{"a":1}}"#).unwrap_err();
        assert_eq!(e.param, Some("prompt"));
        assert!(completion(r#"{"model":"m","prompt":"x","skip_special_tokens":false}"#).is_ok());
        let e =
            completion(r#"{"model":"m","prompt":"x","add_generation_prompt":false}"#).unwrap_err();
        assert_eq!(e.param_name(), Some("add_generation_prompt"));
    }
}
