//! The handoff's table of prefill answers and their one verdict.

use serde_json::{Value, json};

use super::*;
use crate::openai::Prompt;

fn original(stream: bool) -> CompletionRequest {
    serde_json::from_value(json!({
        "model": "m", "prompt": "hello", "max_tokens": 5, "stream": stream,
        "stream_options": {"include_usage": true}
    }))
    .unwrap()
}

fn handle() -> Value {
    json!({
        "request_id": "0123456789abcdef0123456789abcdef",
        "transport": "shm",
        "location": "/dev/shm/x",
        "layout": {"layers": 1, "kv_heads": 1, "head_dim": 4, "seq_len": 8, "dtype": "bf16"},
        "tokens": 2,
        "blobs": [{"len": 64, "crc32": 1}, {"len": 64, "crc32": 2}]
    })
}

fn good() -> Value {
    json!({
        "id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
        "choices": [{"index": 0, "text": "x", "token_ids": [7], "finish_reason": "length", "logprobs": null}],
        "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3},
        "kv_transfer_params": {
            "do_remote_decode": false,
            "do_remote_prefill": true,
            "kv_handle": handle(),
            "kv_handle_signature": "ab",
            "kv_handle_expires_ms": 99,
            "first_token": 7,
            "prompt_token_ids": [1, 2],
            "seed": 5
        }
    })
}

fn with(path: &[&str], v: Option<Value>) -> Vec<u8> {
    let mut a = good();
    let mut at = &mut a;
    for p in &path[..path.len() - 1] {
        at = &mut at[*p];
    }
    let last = path[path.len() - 1];
    match v {
        Some(v) => at[last] = v,
        None => {
            at.as_object_mut().unwrap().remove(last);
        }
    }
    serde_json::to_vec(&a).unwrap()
}

#[test]
fn a_good_answer_makes_the_decode_request() {
    let h = decode_request_from(&original(true), &serde_json::to_vec(&good()).unwrap()).unwrap();
    assert!(h.params.do_remote_prefill && !h.params.do_remote_decode);
    assert_eq!(h.params.first_token, Some(7));
    assert_eq!(h.params.kv_handle.as_ref().unwrap().tokens, 2);
    assert_eq!(h.request.kv_transfer_params.as_ref(), Some(&h.params));
    // The client's request otherwise unchanged: still streamed.
    assert!(h.request.sampling.stream);
    assert_eq!(h.request.prompt, Prompt::Text("hello".into()));
    // A do_remote_decode the answer echoed back is cleared.
    let echoed = with(
        &["kv_transfer_params", "do_remote_decode"],
        Some(json!(true)),
    );
    let h = decode_request_from(&original(false), &echoed).unwrap();
    assert!(!h.params.do_remote_decode);
}

#[test]
fn every_bad_answer_has_one_verdict_naming_what_is_wrong() {
    let secret = "peer-secret-9f8e7d";
    let cases: Vec<(&str, Vec<u8>, PdAnswerError)> = vec![
        (
            "not JSON",
            format!("<html>{secret}</html>").into_bytes(),
            PdAnswerError::NotJson { line: 1, column: 1 },
        ),
        (
            "not an object",
            serde_json::to_vec(&json!([secret])).unwrap(),
            PdAnswerError::NotCompletion { field: None },
        ),
        (
            "id of the wrong type",
            serde_json::to_vec(&json!({"id": 1, "choices": secret})).unwrap(),
            PdAnswerError::NotCompletion { field: Some("id") },
        ),
        (
            "no model",
            with(&["model"], None),
            PdAnswerError::NotCompletion {
                field: Some("model"),
            },
        ),
        (
            "no kv_transfer_params",
            with(&["kv_transfer_params"], None),
            PdAnswerError::NoParams,
        ),
        (
            "null kv_transfer_params",
            with(&["kv_transfer_params"], Some(Value::Null)),
            PdAnswerError::NoParams,
        ),
        (
            "kv_transfer_params a string",
            with(&["kv_transfer_params"], Some(json!(secret))),
            PdAnswerError::ParamsNotObject,
        ),
        (
            "missing flag",
            with(&["kv_transfer_params", "do_remote_prefill"], None),
            PdAnswerError::Missing {
                missing: vec!["do_remote_prefill: true"],
            },
        ),
        (
            "flag false",
            with(
                &["kv_transfer_params", "do_remote_prefill"],
                Some(json!(false)),
            ),
            PdAnswerError::Missing {
                missing: vec!["do_remote_prefill: true"],
            },
        ),
        (
            "missing handle",
            with(&["kv_transfer_params", "kv_handle"], None),
            PdAnswerError::Missing {
                missing: vec!["kv_handle"],
            },
        ),
        (
            "missing first token",
            with(&["kv_transfer_params", "first_token"], None),
            PdAnswerError::Missing {
                missing: vec!["first_token"],
            },
        ),
        (
            "flag a string",
            with(
                &["kv_transfer_params", "do_remote_prefill"],
                Some(json!("true")),
            ),
            PdAnswerError::WrongType {
                field: "do_remote_prefill",
                expected: "a boolean",
            },
        ),
        (
            "handle a string",
            with(&["kv_transfer_params", "kv_handle"], Some(json!(secret))),
            PdAnswerError::WrongType {
                field: "kv_handle",
                expected: "a KV handle: request_id, transport, location, layout, tokens, blobs",
            },
        ),
        (
            "handle without blobs",
            with(&["kv_transfer_params", "kv_handle", "blobs"], None),
            PdAnswerError::WrongType {
                field: "kv_handle",
                expected: "a KV handle: request_id, transport, location, layout, tokens, blobs",
            },
        ),
        (
            "first token negative",
            with(&["kv_transfer_params", "first_token"], Some(json!(-1))),
            PdAnswerError::WrongType {
                field: "first_token",
                expected: "a token id",
            },
        ),
        (
            "prompt ids of strings",
            with(
                &["kv_transfer_params", "prompt_token_ids"],
                Some(json!([secret])),
            ),
            PdAnswerError::WrongType {
                field: "prompt_token_ids",
                expected: "an array of token ids",
            },
        ),
    ];
    for (what, body, want) in cases {
        let got = decode_request_from(&original(false), &body).unwrap_err();
        assert_eq!(got, want, "{what}");
        let msg = got.to_string();
        assert!(!msg.contains(secret), "{what}: {msg}");
        assert!(msg.starts_with("the prefill answer"), "{what}: {msg}");
    }
    // Both missing at once: both named.
    let mut a = good();
    let p = a["kv_transfer_params"].as_object_mut().unwrap();
    p.remove("do_remote_prefill");
    p.remove("kv_handle");
    let e = decode_request_from(&original(false), &serde_json::to_vec(&a).unwrap()).unwrap_err();
    assert_eq!(
        e.to_string(),
        "the prefill answer's kv_transfer_params lack do_remote_prefill: true, kv_handle"
    );
}

#[test]
fn every_parameter_has_its_type_in_the_table() {
    let full = KvTransferParams {
        do_remote_decode: true,
        do_remote_prefill: true,
        kv_transport: Some("shm".into()),
        kv_handle: serde_json::from_value(handle()).unwrap(),
        first_token: Some(1),
        prompt_token_ids: Some(vec![1]),
        kv_handle_signature: Some("ab".into()),
        kv_handle_expires_ms: Some(1),
        seed: Some(1),
        first_token_logprobs: Some(crate::pd::TokenLogprobs::default()),
        cached_tokens: Some(16),
        weight_version: Some("0123456789abcdef".into()),
        prefill_ms: Some(1.0),
        kv_save_ms: Some(1.0),
        release_only: true,
        resumed_tokens: 3,
        remote_engine_id: Some("e".into()),
        remote_host: Some("h".into()),
        remote_port: Some(1),
    };
    let v = serde_json::to_value(&full).unwrap();
    let fields: Vec<&String> = v.as_object().unwrap().keys().collect();
    assert_eq!(fields.len(), PARAM_TYPES.len() - 1);
    for f in fields {
        assert!(
            PARAM_TYPES.iter().any(|(t, _)| *t == f.as_str()),
            "{f} not in PARAM_TYPES"
        );
    }
}

#[test]
fn the_prefill_and_release_requests() {
    let pre = prefill_request(&original(true), Some("tcp".into()));
    assert!(!pre.sampling.stream && pre.sampling.stream_options.is_none());
    let p = pre.kv_transfer_params.unwrap();
    assert!(p.do_remote_decode && !p.do_remote_prefill);
    assert_eq!(p.kv_transport.as_deref(), Some("tcp"));
    assert_eq!(pre.prompt, original(true).prompt);

    let h = decode_request_from(&original(true), &serde_json::to_vec(&good()).unwrap()).unwrap();
    let rel = release_request(&h.request);
    assert!(!rel.sampling.stream);
    let rp = rel.kv_transfer_params.unwrap();
    assert!(rp.release_only && rp.do_remote_prefill);
    assert_eq!(rp.kv_handle, h.params.kv_handle);
    // The flag is on the wire only when set.
    let wire = serde_json::to_value(&h.params).unwrap();
    assert!(wire.get("release_only").is_none(), "{wire}");
    assert_eq!(
        serde_json::to_value(HandleState::Consumed).unwrap(),
        json!("consumed")
    );
}

#[test]
fn a_recompute_is_the_whole_request_with_the_prefills_seed() {
    let mut answer = good();
    answer["kv_transfer_params"]["seed"] = json!(u64::MAX - 3);
    let handoff = decode_request_from(&original(true), &serde_json::to_vec(&answer).unwrap())
        .expect("a good answer");
    let again = recompute_request(&handoff.request);
    assert!(again.kv_transfer_params.is_none());
    // The seed's bits come back unchanged at the worker.
    assert_eq!(
        again.sampling.seed.map(crate::rules::seed_bits),
        Some(u64::MAX - 3)
    );
    // The client's own seed is never replaced.
    let mut seeded = original(true);
    seeded.sampling.seed = Some(-5);
    let handoff =
        decode_request_from(&seeded, &serde_json::to_vec(&answer).unwrap()).expect("good");
    assert_eq!(recompute_request(&handoff.request).sampling.seed, Some(-5));
}

#[test]
fn only_kv_load_refusals_are_recomputed() {
    assert!(kv_load_failed(410, Some(KV_UNAVAILABLE_CODE)));
    assert!(kv_load_failed(410, Some("kv_handle_consumed")));
    // Two sets of weights: the client is told (409), nothing recomputed.
    assert!(!kv_load_failed(
        409,
        Some(crate::pd::WEIGHT_VERSION_MISMATCH_CODE)
    ));
    // A released handle: the orchestrator gave the request up itself.
    assert!(!kv_load_failed(410, Some("kv_handle_released")));
    assert!(!kv_load_failed(400, Some("invalid_kv_handle")));
    assert!(!kv_load_failed(410, None));
    assert!(!kv_load_failed(500, Some(KV_UNAVAILABLE_CODE)));
    for p in [KvLoadFailurePolicy::Recompute, KvLoadFailurePolicy::Fail] {
        assert_eq!(p.as_str().parse::<KvLoadFailurePolicy>(), Ok(p));
    }
    assert!("retry".parse::<KvLoadFailurePolicy>().is_err());
    assert_eq!(
        KvLoadFailurePolicy::default(),
        KvLoadFailurePolicy::Recompute
    );
}
