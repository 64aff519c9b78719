//! Rows for `limits_and_precedence_are_the_same_at_every_door`: the list
//! caps of the request rules (`stop`, `stop_token_ids`, `logit_bias`), one
//! `max_tokens` precedence (`max_completion_tokens` first), and a chat
//! without either whose prompt is within 16 tokens of the context (it fills
//! the rest, at every door). Bodies are built, not written out: some are
//! long. The doors count with `ByteCounter` (a byte is a token) and serve a
//! context of 512; the chat template renders `user: {content}\n`.

use rngd_api::rules::{MAX_LOGIT_BIAS, MAX_STOP, MAX_STOP_BYTES, MAX_STOP_TOKEN_IDS};
use serde_json::{Value, json};

/// (path, body, status, `param`).
pub type Row = (&'static str, String, u16, Option<&'static str>);

fn completion(extra: Value) -> String {
    let mut b = json!({"model": "echo", "prompt": "hi", "max_tokens": 2});
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b.to_string()
}

/// A chat whose rendered prompt is `tokens` tokens (bytes) long.
fn chat(tokens: usize, extra: Value) -> String {
    let content = "x".repeat(tokens - "user: \n".len());
    let mut b = json!({"model": "echo", "messages": [{"role": "user", "content": content}]});
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b.to_string()
}

pub fn rows() -> Vec<Row> {
    const C: &str = "/v1/completions";
    const CHAT: &str = "/v1/chat/completions";
    let stops = |n: usize, len: usize| vec!["s".repeat(len); n];
    let bias = |n: usize| -> serde_json::Map<String, Value> {
        (0..n).map(|i| (i.to_string(), json!(1))).collect()
    };
    vec![
        (
            C,
            completion(json!({"stop": stops(MAX_STOP, 4)})),
            200,
            None,
        ),
        (
            C,
            completion(json!({"stop": stops(MAX_STOP + 1, 4)})),
            400,
            Some("stop"),
        ),
        (
            C,
            completion(json!({"stop": stops(1, MAX_STOP_BYTES + 1)})),
            400,
            Some("stop"),
        ),
        (
            C,
            completion(json!({"stop_token_ids": vec![3; MAX_STOP_TOKEN_IDS + 1]})),
            400,
            Some("stop_token_ids"),
        ),
        (
            C,
            completion(json!({"logit_bias": bias(MAX_LOGIT_BIAS + 1)})),
            400,
            Some("logit_bias"),
        ),
        (C, completion(json!({"logit_bias": bias(200)})), 200, None),
        (
            CHAT,
            chat(8, json!({"stop": stops(MAX_STOP + 1, 1), "max_tokens": 2})),
            400,
            Some("stop"),
        ),
        // Within 16 tokens of the context, no max_tokens: fills the rest.
        (CHAT, chat(500, json!({})), 200, None),
        // max_completion_tokens wins: 8 fits after 500, 400 would not.
        (
            CHAT,
            chat(500, json!({"max_tokens": 400, "max_completion_tokens": 8})),
            200,
            None,
        ),
    ]
}
