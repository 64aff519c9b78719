//! The gateway against real worker servers (on the echo engine, behind taps
//! that record and inject faults) and the default policy's logic run
//! natively: PD flow, streaming, chat, disconnects, metrics. Refusals and
//! failures are in `errors.rs`.

mod common;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::{LONG, client, cluster, expected_text, sse_events};
use futures::StreamExt;
use rngd_api::openai::{ChatCompletionResponse, CompletionResponse, Prompt};
use rngd_gateway::GatewayConfig;
use serde_json::{Value, json};

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
    let text = common::metrics(&c.url).await;
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
    let r = rngd_telemetry::promtool::check(&text);
    assert_eq!(
        r.code,
        Some(0),
        "promtool rejects /metrics: {:?}",
        r.findings
    );
    // The KPI names are fixed by the seed (`_ms`): promtool parses them; its
    // only complaint is the unit-abbreviation lint.
    let kpis = c.gw.metrics().render_kpis();
    let r = rngd_telemetry::promtool::check(&kpis);
    assert!(
        r.clean_but(|l| l.contains("abbreviated units")),
        "promtool: {r:?}"
    );
    let k = c.gw.metrics().kpis();
    assert_eq!(k.requests, 2);
    assert!(k.ttft_p90_ms > 0.0 && k.tok_s > 0.0);
    let kv_ms = k.kv_transfer_ms["memory"];
    assert!(kv_ms.is_finite() && kv_ms >= 0.0, "{kv_ms}");
}

#[tokio::test]
async fn continuous_usage_stats_reach_the_client_through_the_pd_path() {
    let c = cluster(GatewayConfig::default(), Duration::ZERO).await;
    let msgs = json!([{"role": "user", "content": "hello there"}]);
    for (path, body) in [
        (
            "/v1/completions",
            json!({"model": "fake-model", "prompt": LONG, "max_tokens": 5}),
        ),
        (
            "/v1/chat/completions",
            json!({"model": "fake-model", "messages": msgs, "max_tokens": 5}),
        ),
    ] {
        let mut body = body;
        body["stream"] = json!(true);
        body["stream_options"] = json!({"include_usage": true, "continuous_usage_stats": true});
        let resp = client()
            .post(format!("{}{path}", c.url))
            .json(&body)
            .send()
            .await
            .unwrap();
        let events = sse_events(resp).await;
        assert_eq!(events.last().unwrap(), "[DONE]");
        let chunks: Vec<Value> = events[..events.len() - 1]
            .iter()
            .map(|e| serde_json::from_str(e).unwrap())
            .collect();
        // Every chunk carries the usage so far; it never goes down and ends at 5.
        let done: Vec<u64> = chunks
            .iter()
            .map(|ch| {
                ch["usage"]["completion_tokens"]
                    .as_u64()
                    .unwrap_or_else(|| panic!("{path}: no usage on {ch}"))
            })
            .collect();
        assert!(done.windows(2).all(|w| w[0] <= w[1]), "{path}: {done:?}");
        assert_eq!(done.last(), Some(&5), "{path}: {done:?}");
        assert!(
            done.iter().filter(|d| **d < 5).count() >= 4,
            "{path}: {done:?}"
        );
        // The upstream decode was asked for it too.
        let sent = c.decode.last_request.lock().unwrap().clone().unwrap();
        let opts = sent.sampling.stream_options.unwrap();
        assert!(opts.include_usage && opts.continuous_usage_stats);
    }
}
