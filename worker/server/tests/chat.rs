//! `POST /v1/chat/completions` on in-process workers (the `EchoEngine` test
//! double, the in-memory transport): the chat format whole and streamed on a
//! solo worker, PD chat through a decode worker with `x-prefiller-host-port`
//! (the same tokens as solo, the KV loaded, nothing re-prefilled), refusals
//! with the rules' `param`, the prefill role's refusal, and the same chat
//! through the gateway and sent to a solo worker directly giving the same
//! tokens (the gateway counting with `ByteCounter`, whose template is the
//! echo engine's).

mod common;

use common::{metrics, sample};

use std::sync::Arc;
use std::time::Duration;

use rngd_api::openai::{ChatCompletionResponse, ErrorBody, Usage};
use rngd_engine::Engine;
use rngd_engine::fake::EchoEngine;
use rngd_kv_transport::KvTransport;
use rngd_kv_transport::fake::MemoryTransport;
use rngd_pool::PromptCounter;
use rngd_pool::prompt::ByteCounter;
use rngd_worker::{Role, RunningWorker, Transports, WorkerConfig, WorkerState};
use serde_json::{Value, json};

const SEQ_LEN: usize = 64;

async fn start_seq(role: Role, transport: &Arc<MemoryTransport>, seq_len: usize) -> RunningWorker {
    start_config(
        WorkerConfig::new(role).with_kv_secret(b"test-kv-secret-0123456789abcdef"),
        transport,
        seq_len,
    )
    .await
}

async fn start_config(
    config: WorkerConfig,
    transport: &Arc<MemoryTransport>,
    seq_len: usize,
) -> RunningWorker {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let engine: Arc<dyn Engine> = Arc::new(EchoEngine::new(seq_len));
    let t: Arc<dyn KvTransport> = transport.clone();
    rngd_worker::serve(listener, engine, Transports::fixed(vec![t]), config)
        .await
        .unwrap()
}

/// A decode worker that may orchestrate on `prefill` (`--prefill-allow`).
async fn start_decode_for(
    prefill: &RunningWorker,
    transport: &Arc<MemoryTransport>,
) -> RunningWorker {
    let mut config =
        WorkerConfig::new(Role::Decode).with_kv_secret(b"test-kv-secret-0123456789abcdef");
    config.prefill_allow = prefill.addr.to_string().parse().unwrap();
    start_config(config, transport, SEQ_LEN).await
}

async fn start(role: Role, transport: &Arc<MemoryTransport>) -> RunningWorker {
    start_seq(role, transport, SEQ_LEN).await
}

/// POSTs a chat to `base` (a worker or the gateway).
async fn post(base: &str, body: &Value, headers: &[(&str, &str)]) -> (u16, String, String) {
    let mut req = reqwest::Client::new()
        .post(format!("{base}/v1/chat/completions"))
        .json(body);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = req.send().await.unwrap();
    let status = resp.status().as_u16();
    let content_type = resp
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    (status, content_type, resp.text().await.unwrap())
}

async fn chat(base: &str, body: &Value, headers: &[(&str, &str)]) -> ChatCompletionResponse {
    let (status, _, text) = post(base, body, headers).await;
    assert_eq!(status, 200, "{text}");
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("not a chat answer ({e}): {text}"))
}

async fn error(base: &str, body: &Value, headers: &[(&str, &str)]) -> (u16, ErrorBody) {
    let (status, _, text) = post(base, body, headers).await;
    let body: ErrorBody =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("not an error body ({e}): {text}"));
    (status, body)
}

/// What a streamed chat came to.
#[derive(Debug, PartialEq)]
struct Streamed {
    text: String,
    finish: Vec<String>,
    usage: Option<Usage>,
}

/// Reads a streamed chat, checking the chat chunk format on the way: every
/// chunk a `chat.completion.chunk` with one id, the role first, one finish,
/// the usage chunk (no choices) last if any, `[DONE]` at the end.
async fn stream(base: &str, body: &Value, headers: &[(&str, &str)]) -> Streamed {
    let (status, content_type, text) = post(base, body, headers).await;
    assert_eq!(status, 200, "{text}");
    assert!(
        content_type.starts_with("text/event-stream"),
        "{content_type}"
    );
    assert!(text.ends_with("\n\n"), "{text:?}");
    let events: Vec<&str> = text
        .split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| e.strip_prefix("data: ").unwrap_or_else(|| panic!("{e:?}")))
        .collect();
    assert_eq!(events.last(), Some(&"[DONE]"), "{text}");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap_or_else(|err| panic!("{err}: {e}")))
        .collect();
    assert!(!chunks.is_empty());
    for c in &chunks {
        assert_eq!(c["object"], "chat.completion.chunk", "{c}");
        assert_eq!(c["id"], chunks[0]["id"]);
        assert!(c["id"].as_str().unwrap().starts_with("chatcmpl-"), "{c}");
    }
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(
        chunks[1..]
            .iter()
            .all(|c| c["choices"][0]["delta"].get("role").is_none()),
        "the role comes once"
    );
    let text = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    let finish = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["finish_reason"].as_str())
        .map(String::from)
        .collect();
    let with_usage: Vec<&Value> = chunks.iter().filter(|c| c.get("usage").is_some()).collect();
    let usage = match with_usage[..] {
        [] => None,
        [u] => {
            assert_eq!(u, chunks.last().unwrap(), "the usage chunk is the last");
            assert_eq!(u["choices"], json!([]));
            Some(serde_json::from_value(u["usage"].clone()).unwrap())
        }
        _ => panic!("several usage chunks: {chunks:?}"),
    };
    Streamed {
        text,
        finish,
        usage,
    }
}

/// The echo engine's text for `n` tokens of `prompt`: its bytes, cyclically.
fn echo(prompt: &str, n: usize) -> String {
    prompt.bytes().cycle().take(n).map(char::from).collect()
}

fn messages() -> Value {
    json!([
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]},
    ])
}

/// The echo engine's template for [`messages`].
const RENDERED: &str = "system: be brief\nuser: hello\n";

fn streamed(mut body: Value, include_usage: bool) -> Value {
    body["stream"] = json!(true);
    body["stream_options"] = json!({ "include_usage": include_usage });
    body
}

#[tokio::test]
async fn a_solo_worker_answers_chat_in_the_chat_format() {
    let mem = Arc::new(MemoryTransport::new());
    let solo = start(Role::Solo, &mem).await;
    let body = json!({"model": "echo", "messages": messages(), "max_tokens": 7, "temperature": 0});
    let got = chat(&solo.url(), &body, &[("x-request-id", "chat-1")]).await;
    assert_eq!(got.id, "chatcmpl-chat-1");
    assert_eq!(got.object, "chat.completion");
    assert_eq!(got.model, "echo");
    assert_eq!(got.choices.len(), 1);
    assert_eq!(got.choices[0].message.role, "assistant");
    assert_eq!(got.choices[0].message.content, echo(RENDERED, 7));
    assert_eq!(got.choices[0].finish_reason.as_deref(), Some("length"));
    // A worker with a prefix cache reports its hits (none here).
    assert_eq!(
        got.usage,
        Usage::new(RENDERED.len() as u32, 7).with_cached(0)
    );
    assert!(got.timings.and_then(|t| t.ttft_ms).is_some());

    // max_completion_tokens wins over max_tokens; without either the chat
    // fills the context; a stop sequence ends it with "stop".
    let mut b = body.clone();
    b["max_completion_tokens"] = json!(3);
    let got = chat(&solo.url(), &b, &[]).await;
    assert_eq!(got.usage.completion_tokens, 3);
    let mut b = body.clone();
    b.as_object_mut().unwrap().remove("max_tokens");
    let got = chat(&solo.url(), &b, &[]).await;
    assert_eq!(
        got.usage.completion_tokens as usize,
        SEQ_LEN - RENDERED.len()
    );
    let mut b = body.clone();
    b["stop"] = json!("em");
    let got = chat(&solo.url(), &b, &[]).await;
    assert_eq!(got.choices[0].message.content, "syst");
    assert_eq!(got.choices[0].finish_reason.as_deref(), Some("stop"));

    // Streamed: the same text, one finish, the usage chunk when asked for.
    let s = stream(&solo.url(), &streamed(body.clone(), true), &[]).await;
    assert_eq!(
        s,
        Streamed {
            text: echo(RENDERED, 7),
            finish: vec!["length".into()],
            usage: Some(Usage::new(RENDERED.len() as u32, 7).with_cached(0)),
        }
    );
    let s = stream(&solo.url(), &streamed(body.clone(), false), &[]).await;
    assert_eq!(s.usage, None);
    assert_eq!(s.text, echo(RENDERED, 7));

    let m = metrics(&solo).await;
    assert!(
        m.contains("rngd_pd_worker_requests_total{status=\"200\"} 6"),
        "{m}"
    );
}

#[tokio::test]
async fn pd_chat_through_the_prefiller_header_equals_solo() {
    let mem = Arc::new(MemoryTransport::new());
    let prefill = start(Role::Prefill, &mem).await;
    let (decode, solo) = (
        start_decode_for(&prefill, &mem).await,
        start(Role::Solo, &mem).await,
    );
    let peer = prefill.addr.to_string();
    let pd = [
        ("x-prefiller-host-port", peer.as_str()),
        ("x-rngd-pd-kv-transport", "memory"),
    ];
    let body = json!({"model": "echo", "messages": messages(), "max_tokens": 9, "temperature": 0});
    let want = chat(&solo.url(), &body, &[]).await;
    let got = chat(&decode.url(), &body, &pd).await;
    assert_eq!(got.choices, want.choices);
    assert_eq!(got.usage, want.usage);
    assert_eq!(got.object, "chat.completion");
    let t = got.timings.unwrap();
    assert!(t.prefill_ms.is_some() && t.kv_save_ms.is_some() && t.kv_load_ms.is_some());
    assert_eq!(mem.held(), 0, "the decode released the KV");
    let m = metrics(&decode).await;
    assert_eq!(sample(&m, "rngd_pd_worker_kv_loads_total"), 1.0);
    assert_eq!(sample(&m, "rngd_pd_worker_prefills_total"), 0.0);
    assert_eq!(
        sample(&metrics(&prefill).await, "rngd_pd_worker_prefills_total"),
        1.0
    );

    // Streamed PD chat: the same as a streamed solo chat.
    let want = stream(&solo.url(), &streamed(body.clone(), true), &[]).await;
    let got = stream(&decode.url(), &streamed(body.clone(), true), &pd).await;
    assert_eq!(got, want);
    assert_eq!(got.text, echo(RENDERED, 9));
    let m = metrics(&decode).await;
    assert_eq!(sample(&m, "rngd_pd_worker_kv_loads_total"), 2.0);
    assert_eq!(sample(&m, "rngd_pd_worker_prefills_total"), 0.0);
    assert_eq!(mem.held(), 0);

    // A chat too long for the context: the prefill peer's 400 comes through.
    let long = json!({"model": "echo", "messages": [{"role": "user", "content": "x".repeat(60)}], "max_tokens": 10});
    let (status, err) = error(&decode.url(), &long, &pd).await;
    assert_eq!(status, 400, "{err:?}");
    assert_eq!(err.error.code.as_deref(), Some("context_length_exceeded"));
    let (status, err) = error(&solo.url(), &long, &[]).await;
    assert_eq!(status, 400, "{err:?}");
    assert_eq!(err.error.code.as_deref(), Some("context_length_exceeded"));
    assert_eq!(err.error.param.as_deref(), Some("max_tokens"));
}

#[tokio::test]
async fn bad_chats_are_refused_with_the_param() {
    let mem = Arc::new(MemoryTransport::new());
    let solo = start(Role::Solo, &mem).await;
    let hi = json!([{"role": "user", "content": "hi"}]);
    for (body, param, code) in [
        (
            json!({"model": "echo", "messages": []}),
            Some("messages"),
            None,
        ),
        (
            json!({"model": "echo", "messages": [{"role": "wizard", "content": "hi"}]}),
            Some("messages"),
            None,
        ),
        (
            json!({"model": "echo", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
            Some("messages"),
            None,
        ),
        (
            json!({"model": "echo", "messages": hi, "max_completion_tokens": 0}),
            Some("max_completion_tokens"),
            None,
        ),
        (
            json!({"model": "echo", "messages": hi, "max_tokens": 0}),
            Some("max_tokens"),
            None,
        ),
        (
            json!({"model": "echo", "messages": hi, "temperature": 3}),
            Some("temperature"),
            None,
        ),
        (
            json!({"model": "echo", "messages": hi, "top_p": 0}),
            Some("top_p"),
            None,
        ),
        (
            json!({"model": "echo", "messages": hi, "n": 17}),
            Some("n"),
            None,
        ),
        (
            json!({"model": "echo", "messages": hi, "stop": [""]}),
            Some("stop"),
            None,
        ),
        (
            json!({"messages": hi}),
            Some("model"),
            Some("missing_model"),
        ),
        (
            json!({"model": "echo", "messages": "hi"}),
            Some("messages"),
            Some("invalid_request"),
        ),
        (json!([1, 2]), None, Some("invalid_json")),
    ] {
        let (status, err) = error(&solo.url(), &body, &[]).await;
        assert_eq!(status, 400, "{body}: {err:?}");
        assert_eq!(err.error.kind, "invalid_request_error", "{body}");
        assert_eq!(err.error.param.as_deref(), param, "{body}: {err:?}");
        if code.is_some() {
            assert_eq!(err.error.code.as_deref(), code, "{body}: {err:?}");
        }
    }
    let m = metrics(&solo).await;
    assert_eq!(sample(&m, "rngd_pd_worker_prefills_total"), 0.0);
}

#[tokio::test]
async fn a_prefill_worker_refuses_chat_as_it_refuses_completions() {
    let mem = Arc::new(MemoryTransport::new());
    let prefill = start(Role::Prefill, &mem).await;
    let body =
        json!({"model": "echo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    let (status, err) = error(&prefill.url(), &body, &[]).await;
    assert_eq!(status, 400);
    assert!(err.error.message.contains("only prefills"), "{err:?}");
    let (status, err) = error(&prefill.url(), &streamed(body.clone(), true), &[]).await;
    assert_eq!(status, 400);
    assert!(err.error.message.contains("only prefills"), "{err:?}");
    let completion = reqwest::Client::new()
        .post(format!("{}/v1/completions", prefill.url()))
        .json(&json!({"model": "echo", "prompt": "hi", "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(completion.status().as_u16(), status);
    assert_eq!(mem.held(), 0);

    // A worker still loading its model says so for chat too.
    let t: Arc<dyn KvTransport> = mem.clone();
    let state =
        WorkerState::new(WorkerConfig::new(Role::Solo), Transports::fixed(vec![t])).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let loading = rngd_worker::serve_state(listener, state).unwrap();
    let (status, err) = error(&loading.url(), &body, &[]).await;
    assert_eq!(status, 503);
    assert!(err.error.message.contains("loading"), "{err:?}");
    loading.stop().await.unwrap();
}

#[test]
fn the_gateway_counter_renders_the_echo_engines_template() {
    let engine = EchoEngine::new(SEQ_LEN);
    for messages in [
        vec![("user", "hi")],
        vec![
            ("system", "be brief"),
            ("user", "hello"),
            ("assistant", "ü 🚀"),
        ],
    ] {
        let pairs: Vec<(String, String)> = messages
            .iter()
            .map(|(r, c)| (r.to_string(), c.to_string()))
            .collect();
        let engine_prompt = engine.chat_prompt(&pairs, &Default::default()).unwrap();
        assert_eq!(
            ByteCounter
                .chat_prompt(&pairs, &Default::default())
                .unwrap(),
            engine_prompt
        );
        assert_eq!(
            ByteCounter.count(&engine_prompt).unwrap(),
            engine.tokenize(&engine_prompt).unwrap().len()
        );
    }
}

#[tokio::test]
async fn a_chat_through_the_gateway_equals_the_chat_sent_to_the_worker() {
    use rngd_gateway::GatewayConfig;
    use rngd_gateway::launch::{
        LaunchOptions, PolicyChoice, ScrapeOptions, SourceChoice, TokenizerChoice,
    };

    // The gateway's endpoint list says seq_len 512, as the worker's engine.
    let mem = Arc::new(MemoryTransport::new());
    let solo = start_seq(Role::Solo, &mem, 512).await;
    let endpoints = vec![rngd_pool::source::local_endpoint(
        solo.addr.to_string(),
        Role::Solo,
        512,
        &["memory".into()],
    )];
    let gateway = rngd_gateway::launch::launch(LaunchOptions {
        listen: "127.0.0.1:0".into(),
        kpi_listen: None,
        endpoints: SourceChoice::Static(endpoints),
        policy: PolicyChoice::Custom(Arc::new(rngd_pool::pick::NativePolicy::default())),
        admin_token: None,
        admin_listen: "127.0.0.1:0".parse().unwrap(),
        tokenizer: TokenizerChoice::Custom(Arc::new(ByteCounter)),
        config: GatewayConfig::default(),
        scrape: ScrapeOptions {
            every: None,
            stale_after: Duration::from_secs(2),
            ..ScrapeOptions::default()
        },
        cache: None,
    })
    .await
    .unwrap();
    let gw = format!("http://{}", gateway.addr);
    for body in [
        json!({"model": "echo", "messages": messages(), "max_tokens": 11}),
        json!({"model": "echo", "messages": messages(), "max_completion_tokens": 5, "stop": ["ef"]}),
        // No max_tokens: both fill the context the same way.
        json!({"model": "echo", "messages": messages()}),
    ] {
        let via_gateway = chat(&gw, &body, &[]).await;
        let direct = chat(&solo.url(), &body, &[]).await;
        assert_eq!(via_gateway.choices, direct.choices, "{body}");
        assert_eq!(via_gateway.usage, direct.usage, "{body}");
        assert!(direct.id.starts_with("chatcmpl-") && via_gateway.id.starts_with("chatcmpl-"));
        for include_usage in [true, false] {
            let b = streamed(body.clone(), include_usage);
            let via_gateway = stream(&gw, &b, &[]).await;
            let direct = stream(&solo.url(), &b, &[]).await;
            assert_eq!(via_gateway, direct, "{b}");
            assert_eq!(via_gateway.usage.is_some(), include_usage);
        }
    }
    let filled = chat(
        &solo.url(),
        &json!({"model": "echo", "messages": messages()}),
        &[],
    )
    .await;
    assert_eq!(
        filled.usage.completion_tokens as usize,
        512 - RENDERED.len()
    );
}

#[tokio::test]
async fn continuous_usage_stats_are_on_every_chat_chunk() {
    let mem = Arc::new(MemoryTransport::new());
    let solo = start(Role::Solo, &mem).await;
    let mut body =
        json!({"model": "echo", "messages": messages(), "max_tokens": 3, "temperature": 0});
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true, "continuous_usage_stats": true});
    let (status, _, text) = post(&solo.url(), &body, &[]).await;
    assert_eq!(status, 200, "{text}");
    let chunks: Vec<Value> = text
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let prompt = RENDERED.len();
    // The role chunk (nothing generated), one per token, the finish, then
    // the usage chunk: each with the usage so far, none repeated twice.
    let completions: Vec<u64> = chunks
        .iter()
        .map(|c| {
            assert_eq!(c["usage"]["prompt_tokens"], prompt, "{c}");
            c["usage"]["completion_tokens"].as_u64().unwrap()
        })
        .collect();
    assert_eq!(completions, [0, 1, 2, 3, 3, 3], "{text}");
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(
        chunks.last().unwrap()["choices"]
            .as_array()
            .unwrap()
            .is_empty()
    );
}
