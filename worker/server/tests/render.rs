//! vLLM's render and tokenizer endpoints on an in-process worker (the
//! `EchoEngine` double, whose decode echoes the prompt's tokens, so what a
//! completion prefilled can be read back from its answer): render returns
//! exactly the ids the completion and chat paths prefill, `/tokenize` agrees
//! and round-trips through `/detokenize`, and refusals are OpenAI error bodies
//! with their `param`.

mod common;

use std::sync::Arc;

use common::{SEQ_LEN, start_with};
use rngd_kv_transport::fake::MemoryTransport;
use rngd_worker::{Role, RunningWorker};
use serde_json::{Value, json};

async fn start() -> RunningWorker {
    start_with(Role::Solo, &Arc::new(MemoryTransport::new()), |_| {}).await
}

async fn post(w: &RunningWorker, path: &str, body: Value) -> (u16, Value) {
    let r = reqwest::Client::new()
        .post(format!("{}{path}", w.url()))
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap())
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("an id list")
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// The echo engine's ids are the text's bytes.
fn bytes(ids: &[u32]) -> Vec<u8> {
    ids.iter().map(|&t| t as u8).collect()
}

#[tokio::test]
async fn completion_render_is_what_the_completion_prefills_and_tokenize_agrees() {
    let w = start().await;
    let prompt = "render me, exactly";
    let (s, r) = post(
        &w,
        "/v1/completions/render",
        json!({"model": "echo", "prompt": prompt, "max_tokens": 5, "temperature": 0}),
    )
    .await;
    assert_eq!(s, 200, "{r}");
    let list = r
        .as_array()
        .expect("a list of GenerateRequest, one per prompt");
    assert_eq!(list.len(), 1);
    let g = &list[0];
    assert!(
        g["request_id"].as_str().unwrap().starts_with("cmpl-"),
        "{g}"
    );
    assert_eq!(g["features"], Value::Null);
    assert_eq!(g["model"], "echo");
    assert_eq!(g["sampling_params"]["max_tokens"], 5);
    assert_eq!(g["sampling_params"]["temperature"], 0.0);
    let rendered = ids(&g["token_ids"]);

    // The completion path: its prompt echoed back token for token.
    let n = rendered.len();
    let (s, c) = post(
        &w,
        "/v1/completions",
        json!({"model": "echo", "prompt": prompt, "max_tokens": n, "temperature": 0}),
    )
    .await;
    assert_eq!(s, 200, "{c}");
    assert_eq!(c["usage"]["prompt_tokens"], n);
    assert_eq!(
        c["choices"][0]["text"].as_str().unwrap().as_bytes(),
        bytes(&rendered)
    );

    // Token ids in, the same ids out.
    let (s, r2) = post(
        &w,
        "/v1/completions/render",
        json!({"model": "echo", "prompt": rendered.clone()}),
    )
    .await;
    assert_eq!(s, 200, "{r2}");
    assert_eq!(ids(&r2[0]["token_ids"]), rendered);

    let (s, t) = post(&w, "/tokenize", json!({"model": "echo", "prompt": prompt})).await;
    assert_eq!(s, 200, "{t}");
    assert_eq!(ids(&t["tokens"]), rendered);
    assert_eq!(t["count"], n);
    assert_eq!(t["max_model_len"], SEQ_LEN);
    assert_eq!(t["token_strs"], Value::Null);

    let (s, d) = post(
        &w,
        "/detokenize",
        json!({"model": "echo", "tokens": rendered}),
    )
    .await;
    assert_eq!(s, 200, "{d}");
    assert_eq!(d["prompt"], prompt);
}

#[tokio::test]
async fn chat_render_is_what_the_chat_prefills_with_the_template() {
    let w = start().await;
    let messages =
        json!([{"role": "system", "content": "be short"}, {"role": "user", "content": "hi"}]);
    let (s, g) = post(
        &w,
        "/v1/chat/completions/render",
        json!({"model": "echo", "messages": messages}),
    )
    .await;
    assert_eq!(s, 200, "{g}");
    assert!(g.is_object(), "one GenerateRequest: {g}");
    assert!(
        g["request_id"].as_str().unwrap().starts_with("chatcmpl-"),
        "{g}"
    );
    let rendered = ids(&g["token_ids"]);
    // The echo engine's template.
    assert_eq!(bytes(&rendered), b"system: be short\nuser: hi\n");
    // A chat's max_tokens defaults to the rest of the context, as served.
    assert_eq!(g["sampling_params"]["max_tokens"], SEQ_LEN - rendered.len());

    let n = rendered.len();
    let (s, c) = post(
        &w,
        "/v1/chat/completions",
        json!({"model": "echo", "messages": messages, "max_tokens": n, "temperature": 0}),
    )
    .await;
    assert_eq!(s, 200, "{c}");
    assert_eq!(c["usage"]["prompt_tokens"], n);
    assert_eq!(
        c["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .as_bytes(),
        bytes(&rendered)
    );

    let (s, t) = post(
        &w,
        "/tokenize",
        json!({"model": "echo", "messages": messages}),
    )
    .await;
    assert_eq!(s, 200, "{t}");
    assert_eq!(ids(&t["tokens"]), rendered);
}

async fn refused(w: &RunningWorker, path: &str, body: Value, status: u16, param: &str) {
    let (s, e) = post(w, path, body.clone()).await;
    assert_eq!(s, status, "{path} {body}: {e}");
    assert!(
        e["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()),
        "{e}"
    );
    assert_eq!(e["error"]["param"], param, "{path} {body}: {e}");
}

#[tokio::test]
async fn refusals_are_openai_errors_naming_the_param() {
    let w = start().await;
    let long = "x".repeat(SEQ_LEN + 8);
    // Longer than the context: refused as the completion path refuses it.
    let (s, e) = post(
        &w,
        "/v1/completions/render",
        json!({"model": "echo", "prompt": long}),
    )
    .await;
    assert_eq!(s, 400, "{e}");
    let (s2, e2) = post(
        &w,
        "/v1/completions",
        json!({"model": "echo", "prompt": long}),
    )
    .await;
    assert_eq!((s2, &e2["error"]["code"]), (s, &e["error"]["code"]));
    let (s, _) = post(&w, "/tokenize", json!({"model": "echo", "prompt": long})).await;
    assert_eq!(s, 400);

    // A model that is not served: the serving path's 404 on every route.
    let chat = json!([{"role": "user", "content": "hi"}]);
    for (path, body) in [
        (
            "/v1/completions/render",
            json!({"model": "nope", "prompt": "hi"}),
        ),
        (
            "/v1/chat/completions/render",
            json!({"model": "nope", "messages": chat}),
        ),
        ("/tokenize", json!({"model": "nope", "prompt": "hi"})),
        ("/tokenize", json!({"model": "nope", "messages": chat})),
        ("/detokenize", json!({"model": "nope", "tokens": [104]})),
    ] {
        refused(&w, path, body.clone(), 404, "model").await;
        let (_, e) = post(&w, path, body).await;
        assert_eq!(e["error"]["code"], "model_not_found", "{path}: {e}");
    }

    refused(
        &w,
        "/v1/completions/render",
        json!({"prompt": "hi"}),
        400,
        "model",
    )
    .await;
    refused(
        &w,
        "/v1/completions/render",
        json!({"model": "echo", "prompt": "hi", "best_of": 3}),
        400,
        "best_of",
    )
    .await;
    refused(
        &w,
        "/v1/chat/completions/render",
        json!({"model": "echo", "messages": [{"role": "wizard", "content": "x"}]}),
        400,
        "messages",
    )
    .await;
    refused(
        &w,
        "/tokenize",
        json!({"model": "echo", "prompt": "hi", "colour": 1}),
        400,
        "colour",
    )
    .await;
    refused(&w, "/tokenize", json!({"model": "echo"}), 400, "prompt").await;
    refused(
        &w,
        "/tokenize",
        json!({"model": "echo", "prompt": "hi", "return_token_strs": true}),
        400,
        "return_token_strs",
    )
    .await;
    refused(
        &w,
        "/detokenize",
        json!({"model": "echo", "tokens": [104, 300]}),
        400,
        "tokens",
    )
    .await;
}

#[tokio::test]
async fn bodies_are_bounded_like_the_completion_endpoints() {
    let w = start_with(Role::Solo, &Arc::new(MemoryTransport::new()), |c| {
        c.body_limit = 256
    })
    .await;
    let big = json!({"model": "echo", "prompt": "y".repeat(400)});
    for path in [
        "/v1/completions/render",
        "/v1/chat/completions/render",
        "/tokenize",
        "/detokenize",
    ] {
        let (s, e) = post(&w, path, big.clone()).await;
        assert_eq!(s, 413, "{path}: {e}");
        assert!(
            e["error"]["message"].as_str().unwrap().contains("256"),
            "{e}"
        );
    }
}
