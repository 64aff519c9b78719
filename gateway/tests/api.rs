//! The gateway against real worker servers (on the echo engine, behind taps
//! that record and inject faults) and the default policy's logic run
//! natively: PD flow, streaming, chat, the bad-input matrix, disconnects,
//! metrics.

mod common;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::{Mode, PolicyMode, cluster, expected_text};
use futures::StreamExt;
use rngd_api::openai::{ChatCompletionResponse, CompletionResponse, Prompt};
use rngd_gateway::GatewayConfig;
use serde_json::{Value, json};

fn client() -> reqwest::Client {
    reqwest::Client::new()
}

const LONG: &str = "one two three four five six";

/// Asserts an OpenAI-style error body and returns its message.
async fn error_of(resp: reqwest::Response, status: u16) -> String {
    assert_eq!(resp.status().as_u16(), status, "unexpected status");
    let v: Value = resp.json().await.expect("error body is JSON");
    let e = &v["error"];
    assert!(
        e["message"].as_str().is_some_and(|m| !m.is_empty()),
        "no message: {v}"
    );
    assert!(e["type"].as_str().is_some(), "no type: {v}");
    e["message"].as_str().unwrap().to_string()
}

async fn sse_events(resp: reqwest::Response) -> Vec<String> {
    assert_eq!(resp.status(), 200);
    assert!(
        resp.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    let text = resp.text().await.unwrap();
    text.split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .map(str::to_string)
        .collect()
}

#[tokio::test]
async fn pd_completion_runs_prefill_then_decode_and_releases_kv() {
    let c = cluster(GatewayConfig::default(), Duration::ZERO).await;
    let resp = client()
        .post(format!("{}/v1/completions", c.url))
        .header("x-request-id", "req-42")
        .json(&json!({"model": "fake-model", "prompt": LONG, "max_tokens": 5, "temperature": 0}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["x-request-id"], "req-42");
    let body: CompletionResponse = resp.json().await.unwrap();
    assert_eq!(body.id, "cmpl-req-42");
    assert_eq!(body.model, "fake-model");
    assert_eq!(body.choices[0].text, expected_text(LONG, 5));
    assert_eq!(body.usage.unwrap().completion_tokens, 5);
    assert!(
        body.kv_transfer_params.is_none(),
        "PD internals leak to the client"
    );
    let t = body.timings.expect("timings");
    assert!(t.ttft_ms.is_some() && t.total_ms.is_some());
    let (save, load) = (
        t.kv_save_ms.expect("kv_save_ms"),
        t.kv_load_ms.expect("kv_load_ms"),
    );
    let transfer = t.kv_transfer_ms.expect("kv_transfer_ms");
    assert!(
        (transfer - (save + load)).abs() < 1e-9,
        "transfer = save + load"
    );
    assert_eq!(c.prefills(), 1);
    assert_eq!(c.decodes(), 1);
    assert_eq!(c.local_prefills(), 0);
    assert_eq!(c.kv.held(), 0, "KV left behind");
    assert!(!c.decode.saw_prefiller_header.load(Ordering::SeqCst));
    // The policy saw the counted tokens, the snapshot and the body.
    let seen = c.policy.seen.lock().unwrap();
    assert_eq!(seen[0].prompt_tokens, Some(6));
    assert_eq!(seen[0].endpoints.as_ref().unwrap().len(), 2);
    assert!(
        seen[0]
            .headers
            .iter()
            .any(|(k, v)| k == ":path" && v == "/v1/completions")
    );
}

#[tokio::test]
async fn short_prompt_goes_to_the_decode_worker_alone() {
    let c = cluster(GatewayConfig::default(), Duration::ZERO).await;
    let resp = client()
        .post(format!("{}/v1/completions", c.url))
        .json(&json!({"model": "fake-model", "prompt": "hi there", "max_tokens": 3}))
        .send()
        .await
        .unwrap();
    let body: CompletionResponse = resp.json().await.unwrap();
    assert_eq!(body.choices[0].text, expected_text("hi there", 3));
    assert_eq!(c.prefills(), 0);
    assert_eq!(c.local_prefills(), 1);
    assert!(
        c.decode
            .last_request
            .lock()
            .unwrap()
            .as_ref()
            .unwrap()
            .kv_transfer_params
            .is_none()
    );
}

#[tokio::test]
async fn streaming_completion_rewrites_ids_and_matches_non_streaming() {
    let c = cluster(GatewayConfig::default(), Duration::from_millis(1)).await;
    for include_usage in [false, true] {
        let resp = client()
            .post(format!("{}/v1/completions", c.url))
            .json(
                &json!({"model": "fake-model", "prompt": LONG, "max_tokens": 6, "stream": true,
                "stream_options": {"include_usage": include_usage}}),
            )
            .send()
            .await
            .unwrap();
        let events = sse_events(resp).await;
        assert_eq!(events.last().unwrap(), "[DONE]");
        let chunks: Vec<Value> = events[..events.len() - 1]
            .iter()
            .map(|e| serde_json::from_str(e).unwrap())
            .collect();
        let id = chunks[0]["id"].as_str().unwrap().to_string();
        assert!(id.starts_with("cmpl-"));
        let mut text = String::new();
        let mut usage = None;
        for ch in &chunks {
            assert_eq!(ch["id"], id.as_str(), "ids differ across chunks");
            assert_eq!(ch["model"], "fake-model");
            assert!(ch.get("kv_transfer_params").is_none());
            if let Some(t) = ch["choices"][0]["text"].as_str() {
                text.push_str(t);
            }
            if ch.get("usage").is_some() {
                usage = Some(ch["usage"].clone());
            }
        }
        assert_eq!(text, expected_text(LONG, 6));
        assert_eq!(
            usage.is_some(),
            include_usage,
            "usage chunk only when asked"
        );
        if let Some(u) = usage {
            assert_eq!(u["completion_tokens"], 6);
        }
    }
    assert_eq!(c.kv.held(), 0);
}

#[tokio::test]
async fn chat_renders_the_template_and_answers_in_chat_format() {
    let c = cluster(GatewayConfig::default(), Duration::ZERO).await;
    let msgs = json!([{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hello"}]}]);
    let resp = client()
        .post(format!("{}/v1/chat/completions", c.url))
        .json(&json!({"model": "fake-model", "messages": msgs, "max_completion_tokens": 4}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let body: ChatCompletionResponse = resp.json().await.unwrap();
    assert_eq!(body.object, "chat.completion");
    assert!(body.id.starts_with("chatcmpl-"));
    let rendered = "<|im_start|>system be brief <|im_end|> <|im_start|>user hello <|im_end|> <|im_start|>assistant";
    assert_eq!(body.choices[0].message.role, "assistant");
    assert_eq!(body.choices[0].message.content, expected_text(rendered, 4));
    assert_eq!(body.usage.completion_tokens, 4);
    let sent = c.decode.last_request.lock().unwrap().clone().unwrap();
    assert_eq!(sent.prompt, Prompt::Text(rendered.into()));

    // Streaming chat: role first, then content deltas, then finish_reason.
    let resp = client()
        .post(format!("{}/v1/chat/completions", c.url))
        .json(
            &json!({"model": "fake-model", "messages": msgs, "max_tokens": 4, "stream": true,
            "stream_options": {"include_usage": true}}),
        )
        .send()
        .await
        .unwrap();
    let events = sse_events(resp).await;
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert!(
        chunks
            .iter()
            .all(|c| c["object"] == "chat.completion.chunk")
    );
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(text, expected_text(rendered, 4));
    let finish: Vec<&Value> = chunks
        .iter()
        .map(|c| &c["choices"][0]["finish_reason"])
        .filter(|f| !f.is_null())
        .collect();
    assert_eq!(finish, vec![&json!("length")]);
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"], json!([]));
    assert_eq!(last["usage"]["completion_tokens"], 4);
}

#[tokio::test]
async fn bad_input_matrix() {
    let config = GatewayConfig {
        body_limit: 4096,
        ..GatewayConfig::default()
    };
    let c = cluster(config, Duration::ZERO).await;
    let url = format!("{}/v1/completions", c.url);
    let post = |body: String| {
        client()
            .post(url.clone())
            .header("content-type", "application/json")
            .body(body)
    };

    // Malformed JSON / wrong types / bad values → 400.
    let m = error_of(post("{not json".into()).send().await.unwrap(), 400).await;
    assert!(m.contains("malformed JSON"), "{m}");
    let m = error_of(
        post(r#"{"model":"fake-model","prompt":5}"#.into())
            .send()
            .await
            .unwrap(),
        400,
    )
    .await;
    assert!(m.contains("invalid request"), "{m}");
    error_of(
        post(r#"{"model":"fake-model","prompt":"a","max_tokens":"x"}"#.into())
            .send()
            .await
            .unwrap(),
        400,
    )
    .await;
    error_of(
        post(r#"{"model":"fake-model","prompt":"a","n":2}"#.into())
            .send()
            .await
            .unwrap(),
        400,
    )
    .await;
    error_of(
        post(r#"{"model":"fake-model","prompt":"a","temperature":-1}"#.into())
            .send()
            .await
            .unwrap(),
        400,
    )
    .await;
    error_of(
        post(r#"{"model":"fake-model","prompt":["a","b"]}"#.into())
            .send()
            .await
            .unwrap(),
        400,
    )
    .await;
    error_of(post(String::new()).send().await.unwrap(), 400).await;
    let m = error_of(
        client()
            .post(format!("{}/v1/chat/completions", c.url))
            .json(&json!({"model": "fake-model", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}))
            .send()
            .await
            .unwrap(),
        400,
    )
    .await;
    assert!(m.contains("image_url"), "{m}");

    // Unknown model → 404.
    let m = error_of(
        post(r#"{"model":"gpt-9","prompt":"a"}"#.into())
            .send()
            .await
            .unwrap(),
        404,
    )
    .await;
    assert!(m.contains("gpt-9"));

    // Over the body limit → 413, with and without Content-Length.
    let big = format!(
        r#"{{"model":"fake-model","prompt":"{}"}}"#,
        "a ".repeat(4000)
    );
    error_of(post(big.clone()).send().await.unwrap(), 413).await;
    let chunks: Vec<Result<String, std::io::Error>> =
        vec![Ok(big[..3000].to_string()), Ok(big[3000..].to_string())];
    let streamed = reqwest::Body::wrap_stream(futures::stream::iter(chunks));
    error_of(
        client()
            .post(url.clone())
            .body(streamed)
            .send()
            .await
            .unwrap(),
        413,
    )
    .await;

    // Over the compiled length → the policy's 400 naming the numbers.
    let m = error_of(
        post(json!({"model": "fake-model", "prompt": LONG, "max_tokens": 60}).to_string())
            .send()
            .await
            .unwrap(),
        400,
    )
    .await;
    assert!(
        m.contains("6 tokens") && m.contains("60") && m.contains("66") && m.contains("64"),
        "{m}"
    );

    // No capacity → the policy's status (429 here).
    *c.policy.mode.lock().unwrap() = PolicyMode::Busy;
    error_of(
        post(json!({"model": "fake-model", "prompt": LONG}).to_string())
            .send()
            .await
            .unwrap(),
        429,
    )
    .await;

    // Policy trap → 500.
    *c.policy.mode.lock().unwrap() = PolicyMode::Trap;
    let m = error_of(
        post(json!({"model": "fake-model", "prompt": LONG}).to_string())
            .send()
            .await
            .unwrap(),
        500,
    )
    .await;
    assert!(m.contains("policy"), "{m}");
    assert!(!m.contains("unreachable"), "internal cause leaked: {m}");
    *c.policy.mode.lock().unwrap() = PolicyMode::Normal;

    // A failing worker → 502 naming the stage.
    c.prefill.set_mode(Mode::Fail);
    let m = error_of(
        post(json!({"model": "fake-model", "prompt": LONG}).to_string())
            .send()
            .await
            .unwrap(),
        502,
    )
    .await;
    assert!(m.contains("prefill"), "{m}");
    c.prefill.set_mode(Mode::Ok);
    c.decode.set_mode(Mode::Fail);
    let m = error_of(
        post(json!({"model": "fake-model", "prompt": LONG}).to_string())
            .send()
            .await
            .unwrap(),
        502,
    )
    .await;
    assert!(m.contains("decode"), "{m}");
    c.decode.set_mode(Mode::Ok);

    // Unknown route → 404 JSON.
    error_of(
        client()
            .get(format!("{}/v2/nothing", c.url))
            .send()
            .await
            .unwrap(),
        404,
    )
    .await;
}

#[tokio::test]
async fn timeouts_are_504_naming_the_stage() {
    let config = GatewayConfig {
        prefill_timeout: Duration::from_millis(200),
        decode_timeout: Duration::from_millis(200),
        ..GatewayConfig::default()
    };
    let c = cluster(config, Duration::ZERO).await;
    let url = format!("{}/v1/completions", c.url);
    c.prefill.set_mode(Mode::Hang);
    let m = error_of(
        client()
            .post(&url)
            .json(&json!({"model": "fake-model", "prompt": LONG}))
            .send()
            .await
            .unwrap(),
        504,
    )
    .await;
    assert!(m.contains("prefill"), "{m}");
    c.prefill.set_mode(Mode::Ok);
    c.decode.set_mode(Mode::Hang);
    let m = error_of(
        client()
            .post(&url)
            .json(&json!({"model": "fake-model", "prompt": LONG}))
            .send()
            .await
            .unwrap(),
        504,
    )
    .await;
    assert!(m.contains("decode"), "{m}");
}

#[tokio::test]
async fn unreachable_prefill_worker_is_502() {
    let c = cluster(GatewayConfig::default(), Duration::ZERO).await;
    // A port nobody listens on: bind, read the port, close.
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead = l.local_addr().unwrap().to_string();
    drop(l);
    let policy_eps = c.gw.endpoints().snapshot();
    // A fixed list: both count as healthy (no scraping), the dead one too.
    let table = rngd_pool::StaticEndpoints::new(vec![
        rngd_pool::source::local_endpoint(dead.clone(), rngd_policy_core::Role::Prefill, 64, &[]),
        policy_eps[1].clone(),
    ]);
    let gw = rngd_gateway::Gateway::new(
        GatewayConfig::default(),
        rngd_pool::Picker::new(c.policy.clone(), table),
        std::sync::Arc::new(common::FAKE_TOKENIZER),
    )
    .unwrap();
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/v1/completions", l.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(l, rngd_gateway::router(gw)).await.unwrap() });
    let m = error_of(
        client()
            .post(url)
            .json(&json!({"model": "fake-model", "prompt": LONG}))
            .send()
            .await
            .unwrap(),
        502,
    )
    .await;
    assert!(m.contains("prefill") && m.contains(&dead), "{m}");
}

#[tokio::test]
async fn client_disconnect_mid_stream_cancels_decode_and_leaves_no_kv() {
    let c = cluster(GatewayConfig::default(), Duration::from_millis(50)).await;
    let resp = client()
        .post(format!("{}/v1/completions", c.url))
        .json(&json!({"model": "fake-model", "prompt": LONG, "max_tokens": 50, "stream": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut body = resp.bytes_stream();
    let first = body.next().await.unwrap().unwrap();
    assert!(first.starts_with(b"data: "));
    assert_eq!(c.decode.active_streams.load(Ordering::SeqCst), 1);
    drop(body);
    let deadline = Instant::now() + Duration::from_secs(10);
    while c.decode.active_streams.load(Ordering::SeqCst) != 0 {
        assert!(
            Instant::now() < deadline,
            "decode stream still running after the client left"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(c.decode.cancelled_streams.load(Ordering::SeqCst), 1);
    assert_eq!(c.kv.held(), 0, "KV left behind");
}

#[tokio::test]
async fn models_health_and_metrics() {
    let c = cluster(GatewayConfig::default(), Duration::ZERO).await;
    let v: Value = client()
        .get(format!("{}/v1/models", c.url))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["data"][0]["id"], "fake-model");
    assert_eq!(v["data"][0]["max_model_len"], 512);
    let h = client()
        .get(format!("{}/health", c.url))
        .send()
        .await
        .unwrap();
    assert_eq!(h.status(), 200);

    for stream in [false, true] {
        let r = client()
            .post(format!("{}/v1/completions", c.url))
            .json(
                &json!({"model": "fake-model", "prompt": LONG, "max_tokens": 3, "stream": stream}),
            )
            .send()
            .await
            .unwrap();
        r.bytes().await.unwrap();
    }
    client()
        .post(format!("{}/v1/completions", c.url))
        .json(&json!({"model": "nope", "prompt": "x"}))
        .send()
        .await
        .unwrap();
    let text = client()
        .get(format!("{}/metrics", c.url))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    use rngd_telemetry::names;
    for n in [
        names::GATEWAY_TTFT_SECONDS,
        names::GATEWAY_TPOT_SECONDS,
        names::GATEWAY_POLICY_DECISION_SECONDS,
    ] {
        assert!(
            text.contains(&format!("{n}_count 2")) || text.contains(&format!("{n}_count 3")),
            "{n}:\n{text}"
        );
    }
    assert!(
        text.contains("rngd_pd_gateway_kv_transfer_seconds_count{kv_transport=\"memory\"} 2"),
        "{text}"
    );
    // Two completions and the /v1/models call.
    assert!(
        text.contains("rngd_pd_gateway_requests_total{code=\"200\"} 3"),
        "{text}"
    );
    assert!(
        text.contains("rngd_pd_gateway_requests_total{code=\"404\"} 1"),
        "{text}"
    );
    let out = promtool(&text);
    assert!(
        out.status.success(),
        "promtool rejects /metrics: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // The KPI names are fixed by the seed (`_ms`): promtool parses them; its
    // only complaint is the unit-abbreviation lint.
    let kpis = c.gw.metrics().render_kpis();
    let out = promtool(&kpis);
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        matches!(out.status.code(), Some(0) | Some(3)),
        "promtool: {report}"
    );
    assert!(
        report
            .lines()
            .filter(|l| !l.trim().is_empty())
            .all(|l| l.contains("abbreviated units")),
        "{report}"
    );
    let k = c.gw.metrics().kpis();
    assert_eq!(k.requests, 2);
    assert!(k.ttft_p90_ms > 0.0 && k.tok_s > 0.0);
    let kv_ms = k.kv_transfer_ms["memory"];
    assert!(kv_ms.is_finite() && kv_ms >= 0.0, "{kv_ms}");
}

/// Runs `promtool check metrics` on `text` (Debian's `prometheus` package).
fn promtool(text: &str) -> std::process::Output {
    use std::io::Write;
    let mut child = std::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("promtool not found: install Debian's `prometheus` package (tests/setup.sh does)");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    child.wait_with_output().unwrap()
}
