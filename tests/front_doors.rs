//! The three doors a request can enter by — the gateway (HTTP), the endpoint
//! picker (ext_proc) and a worker called directly — apply the same request
//! rules and count the same prompt tokens.
//!
//! - `same_verdicts_at_every_door`: one table of good and bad bodies, fed to
//!   a real gateway, a real picker and a real worker server (on the
//!   `EchoEngine` test double, behind the native default policy); every door
//!   must give the same verdict (status and `param`).
//! - `every_openai_request_field_is_honoured_or_refused_by_name`: every
//!   field of OpenAI's completion and chat request schemas (and vLLM's
//!   sampling extensions), at a non-default value, at every door: honoured
//!   (200) or a 400 naming it, never silently ignored.
//! - `limits_and_precedence_are_the_same_at_every_door`: the list caps,
//!   `max_completion_tokens` over `max_tokens`, and a chat without either
//!   whose prompt is within 16 tokens of the context, the same at every door.
//! - `chat_prompt_tokens_agree_with_the_engine`: the same chat through the
//!   gateway and the picker reaches the policy with the prompt-token count of
//!   the engine's own tokenizer and chat template (the real SmolLM2 GGUF;
//!   `rngd-pd model fetch` puts it in the cache, as `tests/run` does), with
//!   the model's template and with a `--chat-template` file.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use rngd_engine::fake::EchoEngine;
use rngd_ext_proc::metrics::EppMetrics;
use rngd_ext_proc::picker::{PickInput, Picker as EppPicker};
use rngd_gateway::GatewayConfig;
use rngd_gateway::launch::{
    LaunchOptions, Launched, PolicyChoice, ScrapeOptions, SourceChoice, TokenizerChoice,
};
use rngd_policy_core::{Decision, Role};
use rngd_policy_host::PolicyRequest;
use rngd_pool::pick::NativePolicy;
use rngd_pool::prompt::ByteCounter;
use rngd_pool::source::local_endpoint;
use rngd_pool::{Policy, PolicyFailure, PromptCounter, StaticEndpoints};
use rngd_worker::{RunningWorker, Transports, WorkerConfig};
use serde_json::{Value, json};

#[path = "front_doors/limits.rs"]
mod limits;
#[path = "front_doors/schema.rs"]
mod schema;
use schema::{CHAT_SCHEMA, COMPLETION_SCHEMA};

/// The native default policy, recording the prompt tokens it was given.
#[derive(Default)]
struct Recording {
    inner: NativePolicy,
    prompt_tokens: Mutex<Vec<Option<usize>>>,
}

#[async_trait]
impl Policy for Recording {
    async fn decide(&self, req: PolicyRequest) -> Result<Decision, PolicyFailure> {
        self.prompt_tokens.lock().unwrap().push(req.prompt_tokens);
        self.inner.decide(req).await
    }
}

/// A solo echo worker that also serves `model` (the doors' tokenizer's name:
/// workers and doors serve the same names).
async fn worker(model: &str) -> RunningWorker {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let transports = Transports::from_env("shm".to_string()).unwrap();
    let mut config = WorkerConfig::new(Role::Solo);
    config.model_aliases = vec![model.to_string()];
    rngd_worker::serve(l, Arc::new(EchoEngine::new(512)), transports, config)
        .await
        .unwrap()
}

struct Doors {
    worker: RunningWorker,
    gateway: Launched,
    picker: EppPicker,
    policy: Arc<Recording>,
}

async fn doors(tokenizer: TokenizerChoice) -> Doors {
    let counter: Arc<dyn PromptCounter> = tokenizer.load().await.unwrap();
    let worker = worker(counter.model_name()).await;
    let endpoints = vec![local_endpoint(
        worker.addr.to_string(),
        Role::Solo,
        512,
        &["shm".into()],
    )];
    let policy = Arc::new(Recording::default());
    let gateway = rngd_gateway::launch::launch(LaunchOptions {
        listen: "127.0.0.1:0".into(),
        kpi_listen: None,
        endpoints: SourceChoice::Static(endpoints.clone()),
        policy: PolicyChoice::Custom(policy.clone()),
        admin_token: None,
        admin_listen: "127.0.0.1:0".parse().unwrap(),
        tokenizer: tokenizer.clone(),
        config: GatewayConfig::default(),
        // The list's own `healthy` is used: no scrape to wait for.
        scrape: ScrapeOptions {
            every: None,
            stale_after: Duration::from_secs(2),
            ..ScrapeOptions::default()
        },
        cache: None,
    })
    .await
    .unwrap();
    let picker = EppPicker::new(
        rngd_pool::Picker::new(policy.clone(), StaticEndpoints::new(endpoints)),
        Some(counter),
        EppMetrics::new().unwrap(),
    );
    Doors {
        worker,
        gateway,
        picker,
        policy,
    }
}

/// Status and `error.param` of an HTTP answer.
async fn http_verdict(url: String, body: &'static str) -> (u16, Option<String>) {
    let resp = reqwest::Client::new()
        .post(url)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let v: Value = resp.json().await.unwrap_or(Value::Null);
    let param = v["error"]["param"].as_str().map(String::from);
    (status, param)
}

/// Status and `error.param` of the picker's answer (200 for a route).
async fn picker_verdict(p: &EppPicker, path: &str, body: &'static str) -> (u16, Option<String>) {
    let input = PickInput {
        headers: vec![
            (":method".into(), "POST".into()),
            (":path".into(), path.into()),
        ],
        body: Some(body.as_bytes().to_vec()),
        subset: None,
    };
    match p.pick(input).await {
        Decision::Route(_) => (200, None),
        Decision::Reject(local) => {
            let v: Value = serde_json::from_slice(&local.body).unwrap_or(Value::Null);
            (local.status, v["error"]["param"].as_str().map(String::from))
        }
    }
}

const COMPLETIONS: &[(&str, u16, Option<&str>)] = &[
    (
        r#"{"model":"echo","prompt":"hi","max_tokens":2}"#,
        200,
        None,
    ),
    (
        r#"{"model":"echo","prompt":"hi","max_tokens":2,"temperature":2}"#,
        200,
        None,
    ),
    (
        r#"{"model":"echo","prompt":"hi","temperature":2.5}"#,
        400,
        Some("temperature"),
    ),
    (
        r#"{"model":"echo","prompt":"hi","temperature":-0.5}"#,
        400,
        Some("temperature"),
    ),
    (
        r#"{"model":"echo","prompt":"hi","top_p":0}"#,
        400,
        Some("top_p"),
    ),
    (
        r#"{"model":"echo","prompt":"hi","top_p":1.5}"#,
        400,
        Some("top_p"),
    ),
    (
        r#"{"model":"echo","prompt":"hi","max_tokens":0}"#,
        400,
        Some("max_tokens"),
    ),
    (r#"{"model":"echo","prompt":"hi","n":17}"#, 400, Some("n")),
    (r#"{"model":"echo","prompt":""}"#, 400, Some("prompt")),
    (r#"{"model":"echo","prompt":[]}"#, 400, Some("prompt")),
    (
        r#"{"model":"echo","prompt":["a","b"],"n":9}"#,
        400,
        Some("prompt"),
    ),
    (
        r#"{"model":"echo","prompt":"hi","stop":["x",""]}"#,
        400,
        Some("stop"),
    ),
    (r#"{"prompt":"hi"}"#, 400, Some("model")),
    (r#"{"model":"","prompt":"hi"}"#, 400, Some("model")),
    ("", 400, None),
    (r#"{"model":"echo","prompt":"#, 400, None),
    (r#"[1,2]"#, 400, None),
    (r#"{"model":"echo","prompt":5}"#, 400, Some("prompt")),
    // Served now (they used to be refused): honoured, not ignored.
    (
        r#"{"model":"echo","prompt":"hi","max_tokens":2,"presence_penalty":0.5,"frequency_penalty":-1,"repetition_penalty":1.2}"#,
        200,
        None,
    ),
    (
        r#"{"model":"echo","prompt":"hi","max_tokens":2,"logprobs":2}"#,
        200,
        None,
    ),
    (
        r#"{"model":"echo","prompt":"hi","max_tokens":2,"echo":true}"#,
        200,
        None,
    ),
    // Several choices: served by splitting, the same verdict at every door.
    (
        r#"{"model":"echo","prompt":["a","b"],"n":2,"max_tokens":2,"seed":1}"#,
        200,
        None,
    ),
    (
        r#"{"model":"echo","prompt":"hi","n":2,"best_of":3}"#,
        400,
        Some("best_of"),
    ),
    (
        r#"{"model":"echo","prompt":"hi","max_tokens":2,"logit_bias":{"1":5}}"#,
        200,
        None,
    ),
    (
        r#"{"model":"echo","prompt":"hi","max_tokens":2,"top_k":-1,"min_p":0.1,"seed":-3,"min_tokens":1,"ignore_eos":true,"stop_token_ids":[3]}"#,
        200,
        None,
    ),
    // Their ranges.
    (
        r#"{"model":"echo","prompt":"hi","logprobs":21}"#,
        400,
        Some("logprobs"),
    ),
    (
        r#"{"model":"echo","prompt":"hi","logprobs":1,"echo":true}"#,
        400,
        Some("echo"),
    ),
    (
        r#"{"model":"echo","prompt":"hi","presence_penalty":2.5}"#,
        400,
        Some("presence_penalty"),
    ),
    (
        r#"{"model":"echo","prompt":"hi","logit_bias":{"1":101}}"#,
        400,
        Some("logit_bias"),
    ),
    (
        r#"{"model":"echo","prompt":"hi","top_k":-2}"#,
        400,
        Some("top_k"),
    ),
    (
        r#"{"model":"echo","prompt":"hi","max_tokens":2,"min_tokens":3}"#,
        400,
        Some("min_tokens"),
    ),
    // Defined by the API, not implemented: refused by name, not ignored.
    (
        r#"{"model":"echo","prompt":"hi","best_of":3}"#,
        400,
        Some("best_of"),
    ),
    (
        r#"{"model":"echo","prompt":"hi","suffix":"x"}"#,
        400,
        Some("suffix"),
    ),
    (
        r#"{"model":"echo","prompt":"hi","prompt_logprobs":1}"#,
        400,
        Some("prompt_logprobs"),
    ),
    // In no schema: refused by name too.
    (
        r#"{"model":"echo","prompt":"hi","temprature":1}"#,
        400,
        Some("temprature"),
    ),
    // ... and accepted at their "off" value.
    (
        r#"{"model":"echo","prompt":"hi","max_tokens":2,"best_of":1,"suffix":"","logprobs":null,"echo":false,"user":"u"}"#,
        200,
        None,
    ),
];

const CHATS: &[(&str, u16, Option<&str>)] = &[
    (
        r#"{"model":"echo","messages":[{"role":"user","content":"hi"}],"tools":[{"type":"function","function":{"name":"f"}}]}"#,
        400,
        Some("tools"),
    ),
    (
        r#"{"model":"echo","messages":[{"role":"user","content":"hi"}],"response_format":{"type":"json_object"}}"#,
        400,
        Some("response_format"),
    ),
    (
        r#"{"model":"echo","messages":[{"role":"user","content":"hi"}],"max_tokens":2,"logprobs":true,"top_logprobs":3}"#,
        200,
        None,
    ),
    (
        r#"{"model":"echo","messages":[{"role":"user","content":"hi"}],"top_logprobs":3}"#,
        400,
        Some("top_logprobs"),
    ),
    (
        r#"{"model":"echo","messages":[{"role":"user","content":"hi"}],"logprobs":true,"top_logprobs":21}"#,
        400,
        Some("top_logprobs"),
    ),
    (
        r#"{"model":"echo","messages":[{"role":"user","content":"hi"}],"store":true}"#,
        400,
        Some("store"),
    ),
    (
        r#"{"model":"echo","messages":[{"role":"user","content":"hi"}],"prompt":"x"}"#,
        400,
        Some("prompt"),
    ),
    (
        r#"{"model":"echo","messages":[{"role":"user","content":"hi"}],"max_tokens":2}"#,
        200,
        None,
    ),
    (r#"{"model":"echo","messages":[]}"#, 400, Some("messages")),
    (
        r#"{"model":"echo","messages":[{"role":"wizard","content":"hi"}]}"#,
        400,
        Some("messages"),
    ),
    (
        r#"{"model":"echo","messages":[{"role":"user","content":[{"type":"image_url"}]}]}"#,
        400,
        Some("messages"),
    ),
    (
        r#"{"model":"echo","messages":[{"role":"user","content":"hi"}],"max_completion_tokens":0}"#,
        400,
        Some("max_completion_tokens"),
    ),
    (
        r#"{"model":"echo","messages":[{"role":"user","content":"hi"}],"temperature":3}"#,
        400,
        Some("temperature"),
    ),
];

#[tokio::test]
async fn same_verdicts_at_every_door() {
    let d = doors(TokenizerChoice::Custom(Arc::new(ByteCounter))).await;
    let gw = format!("http://{}", d.gateway.addr);
    for &(body, status, param) in COMPLETIONS {
        let want = (status, param.map(String::from));
        let g = http_verdict(format!("{gw}/v1/completions"), body).await;
        let w = http_verdict(format!("{}/v1/completions", d.worker.url()), body).await;
        let p = picker_verdict(&d.picker, "/v1/completions", body).await;
        assert_eq!(g, want, "gateway, body {body}");
        assert_eq!(w, want, "worker, body {body}");
        assert_eq!(p, want, "picker, body {body}");
    }
    for &(body, status, param) in CHATS {
        let want = (status, param.map(String::from));
        let g = http_verdict(format!("{gw}/v1/chat/completions"), body).await;
        let w = http_verdict(format!("{}/v1/chat/completions", d.worker.url()), body).await;
        let p = picker_verdict(&d.picker, "/v1/chat/completions", body).await;
        assert_eq!(g, want, "gateway, body {body}");
        assert_eq!(w, want, "worker, body {body}");
        assert_eq!(p, want, "picker, body {body}");
    }
}

/// List caps, the `max_tokens` precedence and the near-context chat
/// (`front_doors/limits.rs`): the same verdict at every door.
#[tokio::test]
async fn limits_and_precedence_are_the_same_at_every_door() {
    let d = doors(TokenizerChoice::Custom(Arc::new(ByteCounter))).await;
    let gw = format!("http://{}", d.gateway.addr);
    for (path, body, status, param) in limits::rows() {
        let body: &'static str = Box::leak(body.into_boxed_str());
        let want = (status, param.map(String::from));
        let g = http_verdict(format!("{gw}{path}"), body).await;
        let w = http_verdict(format!("{}{path}", d.worker.url()), body).await;
        let p = picker_verdict(&d.picker, path, body).await;
        let short = &body[..body.len().min(120)];
        assert_eq!(g, want, "gateway, {short}");
        assert_eq!(w, want, "worker, {short}");
        assert_eq!(p, want, "picker, {short}");
    }
}

#[tokio::test]
async fn every_openai_request_field_is_honoured_or_refused_by_name() {
    let d = doors(TokenizerChoice::Custom(Arc::new(ByteCounter))).await;
    let gw = format!("http://{}", d.gateway.addr);
    for (path, base, table) in [
        (
            "/v1/completions",
            r#"{"model":"echo","prompt":"hi","#,
            COMPLETION_SCHEMA,
        ),
        (
            "/v1/chat/completions",
            r#"{"model":"echo","messages":[{"role":"user","content":"hi"}],"#,
            CHAT_SCHEMA,
        ),
    ] {
        for &(field, fragment, honoured) in table {
            // Two tokens unless the field sets the length itself.
            let len = if fragment.contains("max_tokens") {
                ""
            } else {
                r#","max_tokens":2"#
            };
            let body: &'static str = Box::leak(format!("{base}{fragment}{len}}}").into_boxed_str());
            let want = if honoured {
                (200, None)
            } else {
                (400, Some(field.to_string()))
            };
            let g = http_verdict(format!("{gw}{path}"), body).await;
            let w = http_verdict(format!("{}{path}", d.worker.url()), body).await;
            let p = picker_verdict(&d.picker, path, body).await;
            assert_eq!(g, want, "gateway, {field}: {body}");
            assert_eq!(w, want, "worker, {field}: {body}");
            assert_eq!(p, want, "picker, {field}: {body}");
        }
    }
}

#[tokio::test]
async fn chat_prompt_tokens_agree_with_the_engine() {
    let model = rngd_engine::model_fetch::resolve(None)
        .expect("the default model is in the cache (`rngd-pd model fetch`)");
    // The model's own template, then a `--chat-template` file (a Llama-3-style
    // template that counts differently) with a `--served-model-name`.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("llama3-style.jinja");
    std::fs::write(
        &file,
        "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n\
         {{ m.content | trim }}<|eot_id|>{% endfor %}<|start_header_id|>assistant<|end_header_id|>\n\n",
    )
    .unwrap();
    let overridden = rngd_engine::tokenizer::TokenizerOverrides {
        chat_template: Some(file),
        served_model_name: Some("custom-served-name".into()),
    };
    let mut counts = Vec::new();
    for overrides in [Default::default(), overridden] {
        counts.push(tokens_agree(&model, overrides).await);
    }
    assert_ne!(
        counts[0], counts[1],
        "the override file is the template in use at every door"
    );
}

/// Sends two chats through the gateway and the picker built with `overrides`;
/// both must report the engine's count (same file, same overrides). Returns
/// the counts.
async fn tokens_agree(
    model: &std::path::Path,
    overrides: rngd_engine::tokenizer::TokenizerOverrides,
) -> Vec<usize> {
    let tokenizer = rngd_engine::tokenizer::Tokenizer::from_gguf(model)
        .and_then(|t| t.with_overrides(&overrides))
        .unwrap();
    // With a system message, and without one (the template then inserts
    // its default system prompt: a count of the bare ChatML would miss it).
    let with_system = vec![
        ("system", "You answer in one word."),
        ("user", "What is the capital of France? Think, then answer."),
        ("assistant", "Paris"),
        ("user", "And of Italy, with ünïcödé and emoji 🚀?"),
    ];
    let without_system = vec![("user", "Name three colours.")];
    let d = doors(TokenizerChoice::Gguf(model.to_path_buf(), overrides)).await;
    let mut want = Vec::new();
    for messages in [&with_system, &without_system] {
        let pairs: Vec<(String, String)> = messages
            .iter()
            .map(|(r, c)| (r.to_string(), c.to_string()))
            .collect();
        // What the engine will prefill: its own template, its own tokenizer.
        let engine_count = tokenizer
            .encode(&tokenizer.chat_prompt(&pairs, &Default::default()).unwrap())
            .unwrap()
            .len();
        let body: &'static str = Box::leak(
            json!({
                "model": tokenizer.model_name(),
                "max_tokens": 4,
                "messages": messages.iter().map(|(r, c)| json!({"role": r, "content": c})).collect::<Vec<_>>(),
            })
            .to_string()
            .into_boxed_str(),
        );
        let (status, _) = http_verdict(
            format!("http://{}/v1/chat/completions", d.gateway.addr),
            body,
        )
        .await;
        assert_eq!(status, 200, "the gateway served the chat");
        let (status, _) = picker_verdict(&d.picker, "/v1/chat/completions", body).await;
        assert_eq!(status, 200, "the picker routed the chat");
        want.extend([Some(engine_count), Some(engine_count)]);
    }
    let seen = d.policy.prompt_tokens.lock().unwrap().clone();
    assert_eq!(
        seen, want,
        "gateway, then picker, for each chat: the engine's count every time"
    );
    let engine_count = want[0].unwrap();
    let messages = with_system;
    // The count is the template's, not the bare message text's.
    let bare: usize = messages
        .iter()
        .map(|(_, c)| tokenizer.encode(c).unwrap().len())
        .sum();
    assert!(engine_count > bare, "{engine_count} vs {bare}");
    want.into_iter().flatten().collect()
}

#[tokio::test]
async fn forged_kv_handles_do_not_pass_a_front_door() {
    // A client cannot hand a worker a KV handle (forged, oversized, or one it
    // saw) through the gateway or the picker: kv_transfer_params in a client
    // body is a 400 naming it at both, before any routing. (A decode worker
    // reached directly verifies the handle's signature itself:
    // worker/server/tests/handles.rs.)
    let d = doors(TokenizerChoice::Custom(Arc::new(ByteCounter))).await;
    let gw = format!("http://{}", d.gateway.addr);
    let forged: &'static str = r#"{"model":"m","prompt":"hello","max_tokens":2,"kv_transfer_params":{"do_remote_prefill":true,"first_token":104,"kv_handle":{"request_id":"0123456789abcdef0123456789abcdef","transport":"tcp","location":"10.0.0.9:7070","layout":{"layers":1,"kv_heads":1,"head_dim":1,"seq_len":8,"dtype":"bf16"},"tokens":5,"blobs":[{"len":1099511627776,"crc32":0}]},"kv_handle_signature":"00"}}"#;
    let parks: &'static str = r#"{"model":"m","prompt":"hello","max_tokens":2,"kv_transfer_params":{"do_remote_decode":true}}"#;
    for body in [forged, parks] {
        let want = (400, Some("kv_transfer_params".to_string()));
        assert_eq!(
            http_verdict(format!("{gw}/v1/completions"), body).await,
            want,
            "gateway"
        );
        assert_eq!(
            picker_verdict(&d.picker, "/v1/completions", body).await,
            want,
            "picker"
        );
    }
    assert!(
        d.policy.prompt_tokens.lock().unwrap().is_empty(),
        "refused before the policy was asked"
    );
}
