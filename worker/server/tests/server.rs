//! In-process workers on 127.0.0.1:0 with the echo engine and the in-memory
//! transport: PD round trip, `x-prefiller-host-port` orchestration, streaming
//! format, error mapping, metrics.

mod common;

use common::{
    SEQ_LEN, allow, completion, error, metrics, post, request, sample, sse_events, start,
    start_with, token_ids,
};

use std::sync::Arc;
use std::time::Duration;

use rngd_api::openai::CompletionResponse;
use rngd_engine::Engine;
use rngd_engine::fake::EchoEngine;
use rngd_kv_transport::KvTransport;
use rngd_kv_transport::fake::MemoryTransport;
use rngd_worker::{Role, Transports, WorkerConfig, WorkerState};
use serde_json::{Value, json};

#[tokio::test]
async fn pd_round_trip_matches_solo_and_releases_the_kv() {
    let mem = Arc::new(MemoryTransport::new());
    let (prefill, decode, solo) = (
        start(Role::Prefill, &mem).await,
        start_with(Role::Decode, &mem, |c| {
            c.kv_pull_timeout = Duration::from_millis(300)
        })
        .await,
        start(Role::Solo, &mem).await,
    );
    let req = request("Hello, PD world", 10);
    let want = completion(&solo, &req, &[]).await;
    assert_eq!(want.choices[0].text, "Hello, PD ");
    assert_eq!(want.usage.unwrap().completion_tokens, 10);

    let mut pre_req = req.clone();
    pre_req["kv_transfer_params"] = json!({"do_remote_decode": true});
    let pre = completion(&prefill, &pre_req, &[("x-request-id", "rt-1")]).await;
    let params = pre
        .kv_transfer_params
        .clone()
        .expect("prefill answers kv_transfer_params");
    assert!(params.do_remote_prefill);
    assert_eq!(params.first_token, Some(token_ids(&want)[0]));
    assert_eq!(token_ids(&pre), vec![token_ids(&want)[0]]);
    assert_eq!(
        params.prompt_token_ids.as_ref().unwrap().len(),
        "Hello, PD world".len()
    );
    let handle = params.kv_handle.clone().unwrap();
    assert_eq!(handle.transport, "memory");
    // The cache's key is the prefill worker's own 128 random bits, not the
    // client's request id.
    assert_eq!(handle.request_id.len(), 32, "{}", handle.request_id);
    assert!(handle.request_id.bytes().all(|b| b.is_ascii_hexdigit()));
    assert!(params.kv_handle_signature.is_some() && params.kv_handle_expires_ms.is_some());
    assert!(params.prefill_ms.is_some() && params.kv_save_ms.is_some());
    assert_eq!(mem.held(), 1, "the prefill pushed one cache");

    let mut dec_req = req.clone();
    dec_req["kv_transfer_params"] = serde_json::to_value(&params).unwrap();
    let got = completion(&decode, &dec_req, &[]).await;
    assert_eq!(
        token_ids(&got),
        token_ids(&want),
        "PD tokens must equal solo tokens"
    );
    assert_eq!(got.choices[0].text, want.choices[0].text);
    assert_eq!(got.usage, want.usage);
    let t = got.timings.unwrap();
    assert!(t.kv_load_ms.is_some() && t.kv_transfer_ms.is_some() && t.ttft_ms.is_some());
    assert_eq!(mem.held(), 0, "decode releases the KV after loading");

    let m = metrics(&decode).await;
    assert_eq!(sample(&m, "rngd_pd_worker_kv_loads_total"), 1.0);
    assert_eq!(sample(&m, "rngd_pd_worker_prefills_total"), 0.0);
    assert_eq!(sample(&m, "rngd_pd_worker_kv_load_seconds_count"), 1.0);
    let m = metrics(&prefill).await;
    assert_eq!(sample(&m, "rngd_pd_worker_prefills_total"), 1.0);
    assert_eq!(sample(&m, "rngd_pd_worker_kv_save_seconds_count"), 1.0);
    assert_eq!(sample(&m, "rngd_pd_worker_kv_loads_total"), 0.0);

    // A second decode with the same handle is refused at once (a handle
    // serves one decode; its KV is gone): 410, nothing pulled.
    let (status, body) = error(&decode, &dec_req, &[]).await;
    assert_eq!(status, 410, "{body:?}");
    assert_eq!(body.error.code.as_deref(), Some("kv_handle_consumed"));
    let m = metrics(&decode).await;
    assert_eq!(sample(&m, "rngd_pd_worker_kv_loads_total"), 1.0);
}

#[tokio::test]
async fn prefiller_header_orchestrates_prefill_then_decodes_here() {
    let mem = Arc::new(MemoryTransport::new());
    let prefill = start(Role::Prefill, &mem).await;
    let (decode, solo) = (
        start_with(Role::Decode, &mem, allow(&[&prefill.addr.to_string()])).await,
        start(Role::Solo, &mem).await,
    );
    let req = request("orchestrated by the decode worker", 12);
    let want = completion(&solo, &req, &[]).await;
    let peer = prefill.addr.to_string();
    let got = completion(
        &decode,
        &req,
        &[
            ("x-prefiller-host-port", &peer),
            ("x-rngd-pd-kv-transport", "memory"),
            ("x-request-id", "orch-1"),
        ],
    )
    .await;
    assert_eq!(token_ids(&got), token_ids(&want));
    assert_eq!(got.id, "cmpl-orch-1");
    let t = got.timings.unwrap();
    assert!(t.prefill_ms.is_some() && t.kv_save_ms.is_some() && t.kv_load_ms.is_some());
    assert_eq!(mem.held(), 0);
    assert_eq!(
        sample(&metrics(&prefill).await, "rngd_pd_worker_prefills_total"),
        1.0
    );
    let m = metrics(&decode).await;
    assert_eq!(sample(&m, "rngd_pd_worker_prefills_total"), 0.0);
    assert_eq!(sample(&m, "rngd_pd_worker_kv_loads_total"), 1.0);

    // Without the header a decode worker serves the whole request itself.
    let local = completion(&decode, &req, &[]).await;
    assert_eq!(token_ids(&local), token_ids(&want));
    assert_eq!(
        sample(&metrics(&decode).await, "rngd_pd_worker_prefills_total"),
        1.0
    );
}

#[tokio::test]
async fn streaming_format_and_tokens() {
    let mem = Arc::new(MemoryTransport::new());
    let prefill = start(Role::Prefill, &mem).await;
    let decode = start_with(Role::Decode, &mem, allow(&[&prefill.addr.to_string()])).await;
    let req = request("stream me", 6);
    let want = completion(&decode, &req, &[]).await;

    let mut sreq = req.clone();
    sreq["stream"] = json!(true);
    sreq["stream_options"] = json!({"include_usage": true});
    for headers in [
        vec![],
        vec![("x-prefiller-host-port", prefill.addr.to_string())],
    ] {
        let h: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let (status, resp_headers, body) = post(&decode, &sreq, &h).await;
        assert_eq!(status, 200, "{body}");
        assert!(
            resp_headers["content-type"]
                .to_str()
                .unwrap()
                .starts_with("text/event-stream")
        );
        let events = sse_events(&body);
        assert_eq!(events.last().unwrap(), "[DONE]");
        let chunks: Vec<CompletionResponse> = events[..events.len() - 1]
            .iter()
            .map(|e| serde_json::from_str(e).unwrap_or_else(|err| panic!("{err}: {e}")))
            .collect();
        let (mut ids, mut text) = (Vec::new(), String::new());
        for c in chunks
            .iter()
            .filter(|c| !c.choices.is_empty() && c.choices[0].finish_reason.is_none())
        {
            assert_eq!(c.object, "text_completion");
            ids.extend(c.choices[0].token_ids.clone().unwrap());
            text.push_str(&c.choices[0].text);
        }
        assert_eq!(ids, token_ids(&want));
        assert_eq!(text, want.choices[0].text);
        let fin = chunks
            .iter()
            .find(|c| {
                c.choices
                    .first()
                    .is_some_and(|ch| ch.finish_reason.is_some())
            })
            .unwrap();
        assert_eq!(fin.choices[0].finish_reason.as_deref(), Some("length"));
        assert!(fin.timings.unwrap().ttft_ms.is_some());
        let usage = chunks.last().unwrap();
        assert!(usage.choices.is_empty());
        assert_eq!(usage.usage, want.usage);
        assert!(chunks.iter().all(|c| c.id == chunks[0].id));
    }
    assert_eq!(mem.held(), 0);

    // Without include_usage there is no usage chunk.
    sreq["stream_options"] = json!({"include_usage": false});
    let (_, _, body) = post(&decode, &sreq, &[]).await;
    assert!(!body.contains("\"usage\""), "{body}");
}

#[tokio::test]
async fn errors_map_to_statuses_with_openai_bodies() {
    let mem = Arc::new(MemoryTransport::new());
    let prefill = start(Role::Prefill, &mem).await;
    // A port nothing listens on, and a peer that accepts but never answers.
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent_addr = silent.local_addr().unwrap().to_string();
    let decode = start_with(Role::Decode, &mem, |c| {
        c.kv_pull_timeout = Duration::from_millis(200);
        c.prefill_timeout = Duration::from_millis(300);
        allow(&[&prefill.addr.to_string(), &closed, &silent_addr])(c);
    })
    .await;

    // Over-length: 400, code context_length_exceeded, numbers in the message.
    let long = "x".repeat(60);
    let (status, body) = error(&decode, &request(&long, 10), &[]).await;
    assert_eq!(status, 400);
    assert_eq!(body.error.code.as_deref(), Some("context_length_exceeded"));
    for n in ["60", "10", "70", "64"] {
        assert!(body.error.message.contains(n), "{}", body.error.message);
    }
    // The same through the prefiller header: the prefill's 400 is passed through.
    let peer = prefill.addr.to_string();
    let (status, body) = error(
        &decode,
        &request(&long, 10),
        &[("x-prefiller-host-port", &peer)],
    )
    .await;
    assert_eq!(status, 400);
    assert_eq!(body.error.code.as_deref(), Some("context_length_exceeded"));

    // A prefill worker refuses whole requests; a decode worker refuses prefill-only ones.
    let (status, body) = error(&prefill, &request("hi", 3), &[]).await;
    assert_eq!(status, 400);
    assert!(
        body.error.message.contains("only prefills"),
        "{}",
        body.error.message
    );
    let mut pre = request("hi", 3);
    pre["kv_transfer_params"] = json!({"do_remote_decode": true});
    assert_eq!(error(&decode, &pre, &[]).await.0, 400);

    // Bad bodies.
    let (status, body) = error(&decode, &json!({"model": "echo"}), &[]).await;
    assert_eq!(
        (status, body.error.kind.as_str()),
        (400, "invalid_request_error")
    );
    assert_eq!(
        error(
            &decode,
            &json!({"model": "echo", "prompt": "", "max_tokens": 2}),
            &[]
        )
        .await
        .0,
        400
    );
    assert_eq!(
        error(
            &decode,
            &json!({"model": "echo", "prompt": "a", "n": 0}),
            &[]
        )
        .await
        .0,
        400
    );
    assert_eq!(
        error(
            &decode,
            &json!({"model": "echo", "prompt": [1, 999], "max_tokens": 2}),
            &[]
        )
        .await
        .0,
        400
    );

    // Unknown transport on the prefill side: 400 naming it.
    let mut pre = request("hi", 3);
    pre["kv_transfer_params"] = json!({"do_remote_decode": true, "kv_transport": "carrier-pigeon"});
    let (status, body) = error(&prefill, &pre, &[]).await;
    assert_eq!(status, 400);
    assert!(body.error.message.contains("carrier-pigeon"));

    // Push failure: 503 (capacity) naming the transport and request.
    mem.fail_pushes(true);
    let mut pre = request("hi", 3);
    pre["kv_transfer_params"] = json!({"do_remote_decode": true});
    let (status, body) = error(&prefill, &pre, &[("x-request-id", "push-fail")]).await;
    mem.fail_pushes(false);
    assert!(status >= 500, "{status}");
    assert!(body.error.message.contains("memory") && body.error.message.contains("push-fail"));

    // KV the transport no longer holds: 410 kv_unavailable at once, naming
    // the transport (nothing waited for).
    let pre_ok = completion(&prefill, &pre, &[("x-request-id", "gone-1")]).await;
    let params = pre_ok.kv_transfer_params.unwrap();
    mem.release(params.kv_handle.as_ref().unwrap())
        .await
        .unwrap();
    let mut dec = request("hi", 3);
    dec["kv_transfer_params"] = serde_json::to_value(&params).unwrap();
    let (status, body) = error(&decode, &dec, &[("x-request-id", "gone-1")]).await;
    assert_eq!(status, 410, "{body:?}");
    assert_eq!(body.error.code.as_deref(), Some("kv_unavailable"));
    assert!(
        body.error.message.contains("memory"),
        "{}",
        body.error.message
    );

    // Corrupted KV: 502, and the cache is still released.
    let pre_ok = completion(&prefill, &pre, &[("x-request-id", "corrupt-1")]).await;
    let params = pre_ok.kv_transfer_params.unwrap();
    assert!(mem.corrupt(&params.kv_handle.as_ref().unwrap().request_id, 1, 3));
    let mut dec = request("hi", 3);
    dec["kv_transfer_params"] = serde_json::to_value(params).unwrap();
    let (status, body) = error(&decode, &dec, &[("x-request-id", "corrupt-1")]).await;
    assert_eq!(status, 502, "{body:?}");
    assert!(body.error.message.contains("corrupt-1"));
    assert_eq!(mem.held(), 0);

    // Prefill peer down: 502 naming it and the request id.
    let (status, body) = error(
        &decode,
        &request("hi", 3),
        &[
            ("x-prefiller-host-port", &closed),
            ("x-request-id", "peer-down"),
        ],
    )
    .await;
    assert_eq!(status, 502, "{body:?}");
    assert!(body.error.message.contains(&closed) && body.error.message.contains("peer-down"));

    // Prefill peer that accepts but never answers: 504.
    let (status, body) = error(
        &decode,
        &request("hi", 3),
        &[("x-prefiller-host-port", &silent_addr)],
    )
    .await;
    drop(silent);
    assert_eq!(status, 504, "{body:?}");
    assert!(body.error.message.contains(&silent_addr));

    // Statuses are counted.
    let m = metrics(&decode).await;
    assert!(
        m.contains("rngd_pd_worker_requests_total{status=\"400\"}"),
        "{m}"
    );
    assert!(
        m.contains("rngd_pd_worker_requests_total{status=\"504\"}"),
        "{m}"
    );
}

#[tokio::test]
async fn not_ready_until_the_engine_is_installed() {
    let mem: Arc<dyn KvTransport> = Arc::new(MemoryTransport::new());
    let state =
        WorkerState::new(WorkerConfig::new(Role::Solo), Transports::fixed(vec![mem])).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let w = rngd_worker::serve_state(listener, state.clone()).unwrap();
    let get = |p: &'static str| {
        let url = format!("{}{p}", w.url());
        async move { reqwest::get(url).await.unwrap().status().as_u16() }
    };
    assert_eq!(get("/health").await, 200);
    assert_eq!(get("/ready").await, 503);
    assert_eq!(get("/v1/models").await, 503);
    let (status, body) = error(&w, &request("hi", 2), &[]).await;
    assert_eq!(status, 503);
    assert!(body.error.message.contains("loading"));
    assert!(state.set_engine(Arc::new(EchoEngine::new(SEQ_LEN))));
    assert_eq!(get("/ready").await, 200);
    let models: Value = reqwest::get(format!("{}/v1/models", w.url()))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(models["data"][0]["id"], "echo");
    assert_eq!(models["data"][0]["max_model_len"], SEQ_LEN);
    assert_eq!(
        completion(&w, &request("hi", 2), &[]).await.choices[0].text,
        "hi"
    );
    w.stop().await.unwrap();
}

#[tokio::test]
async fn metrics_expose_the_model_server_protocol() {
    let mem = Arc::new(MemoryTransport::new());
    let w = start(Role::Solo, &mem).await;
    completion(&w, &request("count me", 4), &[]).await;
    let resp = reqwest::get(format!("{}/metrics", w.url())).await.unwrap();
    assert!(
        resp.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/plain")
    );
    let m = resp.text().await.unwrap();
    // vLLM's families, with vLLM's `model_name` label.
    let model = "{model_name=\"echo\"}";
    assert_eq!(
        sample(&m, &format!("vllm:num_requests_waiting{model}")),
        0.0
    );
    assert_eq!(
        sample(&m, &format!("vllm:num_requests_running{model}")),
        0.0
    );
    assert_eq!(sample(&m, &format!("vllm:kv_cache_usage_perc{model}")), 0.0);
    // "count me" is 8 bytes = 8 echo tokens; 4 generated, finished by length.
    assert_eq!(sample(&m, &format!("vllm:prompt_tokens_total{model}")), 8.0);
    assert_eq!(
        sample(&m, &format!("vllm:generation_tokens_total{model}")),
        4.0
    );
    assert_eq!(
        sample(
            &m,
            "vllm:request_success_total{finished_reason=\"length\",model_name=\"echo\"}"
        ),
        1.0
    );
    assert_eq!(
        sample(
            &m,
            &format!("vllm:time_to_first_token_seconds_count{model}")
        ),
        1.0
    );
    assert_eq!(
        sample(
            &m,
            &format!("vllm:e2e_request_latency_seconds_count{model}")
        ),
        1.0
    );
    // promtool parses the page; its only complaints may be about vLLM's own
    // names, which vLLM's dashboards and the endpoint pickers expect as they
    // are: the `:` in each, and the `_total` of the histogram
    // `vllm:iteration_tokens_total`.
    let r = rngd_telemetry::promtool::check(&m);
    assert!(
        r.clean_but(
            |l| (l.starts_with("vllm:") && l.contains("should not contain ':'"))
                || l.starts_with("vllm:iteration_tokens_total non-counter metrics should not have")
        ),
        "promtool: {r:?}"
    );
    assert_eq!(sample(&m, "rngd_pd_worker_prefills_total"), 1.0);
    assert_eq!(
        sample(&m, "rngd_pd_worker_decode_tokens_per_second_count"),
        1.0
    );
    assert!(
        m.contains("rngd_pd_worker_requests_total{status=\"200\"} 1"),
        "{m}"
    );
    assert!(m.contains("# TYPE rngd_pd_worker_prefill_seconds histogram"));
}

#[test]
fn vendor_backends_fail_with_the_exact_message() {
    let err = rngd_worker::check_backend(rngd_worker::Backend::Rngd).unwrap_err();
    assert_eq!(
        err.to_string(),
        "backend rngd needs the FuriosaAI runtime, which this build does not include"
    );
    let err = rngd_worker::check_backend(rngd_worker::Backend::Atom).unwrap_err();
    assert_eq!(
        err.to_string(),
        "backend atom needs the Rebellions runtime, which this build does not include"
    );
    rngd_worker::check_backend(rngd_worker::Backend::Cpu).unwrap();
}

#[tokio::test]
async fn pd_through_an_in_process_tcp_relay() {
    use rngd_kv_transport::TransportConfig;
    use rngd_kv_transport::relay::{RelayConfig, serve as relay_serve};
    use rngd_worker::RegistryFactory;

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let relay_addr = listener.local_addr().unwrap().to_string();
    let stop = tokio_util::sync::CancellationToken::new();
    let relay_stop = stop.clone();
    let relay = tokio::spawn(relay_serve(listener, RelayConfig::default(), async move {
        relay_stop.cancelled().await
    }));
    let config = TransportConfig {
        tcp_addr: Some(relay_addr),
        ..TransportConfig::default()
    };
    let start_tcp = |role, prefill_allow: &str| {
        let config = config.clone();
        let mut worker = WorkerConfig::new(role).with_kv_secret(b"test-kv-secret-0123456789abcdef");
        worker.prefill_allow = prefill_allow.parse().unwrap();
        async move {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let engine: Arc<dyn Engine> = Arc::new(EchoEngine::new(SEQ_LEN));
            let transports = Transports::new("tcp", RegistryFactory { config });
            rngd_worker::serve(listener, engine, transports, worker)
                .await
                .unwrap()
        }
    };
    let prefill = start_tcp(Role::Prefill, "").await;
    let decode = start_tcp(Role::Decode, &prefill.addr.to_string()).await;
    let req = request("over the relay", 8);
    let want = completion(&decode, &req, &[]).await;
    let got = completion(
        &decode,
        &req,
        &[("x-prefiller-host-port", &prefill.addr.to_string())],
    )
    .await;
    assert_eq!(token_ids(&got), token_ids(&want));
    let m = metrics(&decode).await;
    assert_eq!(sample(&m, "rngd_pd_worker_kv_loads_total"), 1.0);
    stop.cancel();
    relay.await.unwrap().unwrap();
}

#[tokio::test]
async fn the_model_is_checked_and_the_server_surface_answers_as_vllm() {
    let mem = Arc::new(MemoryTransport::new());
    let w = start_with(Role::Solo, &mem, |c| {
        c.model_aliases = vec!["alias".into()];
        c.model_root = Some("echo.gguf".into());
    })
    .await;
    // Any model but the served names is a 404 naming them, before any work
    // (completion and chat alike); an alias is served.
    let mut unknown = request("hi", 2);
    unknown["model"] = json!("gpt-4o");
    let (status, body) = error(&w, &unknown, &[]).await;
    assert_eq!(status, 404);
    assert_eq!(body.error.code.as_deref(), Some("model_not_found"));
    assert_eq!(body.error.param.as_deref(), Some("model"));
    assert!(
        body.error.message.contains("'gpt-4o'") && body.error.message.ends_with("echo, alias"),
        "{}",
        body.error.message
    );
    let chat = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", w.url()))
        .json(&json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(chat.status(), 404);
    let chat: Value = chat.json().await.unwrap();
    assert_eq!(chat["error"]["code"], "model_not_found");
    let mut alias = request("hi", 2);
    alias["model"] = json!("alias");
    assert_eq!(completion(&w, &alias, &[]).await.choices[0].text, "hi");

    // /v1/models: one entry per name, with vLLM's fields.
    let models: Value = reqwest::get(format!("{}/v1/models", w.url()))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let data = models["data"].as_array().unwrap();
    assert_eq!(data.len(), 2, "{models}");
    assert_eq!(
        (data[0]["id"].as_str(), data[1]["id"].as_str()),
        (Some("echo"), Some("alias"))
    );
    for m in data {
        assert_eq!(m["root"], "echo.gguf");
        assert!(m["parent"].is_null());
        assert_eq!(m["max_model_len"], SEQ_LEN);
        assert_eq!(m["permission"][0]["object"], "model_permission");
    }

    // /version, /ping (GET and POST), and JSON bodies on 404 and 405.
    let v: Value = reqwest::get(format!("{}/version", w.url()))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["version"], rngd_http_edge::surface::VERSION);
    let client = reqwest::Client::new();
    for req in [
        client.get(format!("{}/ping", w.url())),
        client.post(format!("{}/ping", w.url())),
    ] {
        assert_eq!(req.send().await.unwrap().status(), 200);
    }
    for (req, status) in [
        (client.get(format!("{}/no/such/route", w.url())), 404),
        (client.get(format!("{}/v1/completions", w.url())), 405),
        (client.delete(format!("{}/v1/models", w.url())), 405),
    ] {
        let resp = req.send().await.unwrap();
        assert_eq!(resp.status(), status);
        let body: Value = resp.json().await.unwrap();
        assert!(body["error"]["message"].is_string(), "{body}");
    }
    w.stop().await.unwrap();
}

#[tokio::test]
async fn continuous_usage_stats_put_the_usage_so_far_on_every_chunk() {
    let mem = Arc::new(MemoryTransport::new());
    let w = start(Role::Solo, &mem).await;
    let mut req = request("hello", 4);
    req["stream"] = json!(true);
    req["stream_options"] = json!({"include_usage": true, "continuous_usage_stats": true});
    let (status, _, body) = post(&w, &req, &[]).await;
    assert_eq!(status, 200, "{body}");
    let events = sse_events(&body);
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    // Each token chunk: the prompt's 5 tokens and the tokens sent so far.
    let tokens: Vec<&Value> = chunks
        .iter()
        .filter(|c| c["choices"][0]["token_ids"].is_array())
        .collect();
    assert_eq!(tokens.len(), 4, "{body}");
    for (i, c) in tokens.iter().enumerate() {
        assert_eq!(c["usage"]["prompt_tokens"], 5, "{c}");
        assert_eq!(c["usage"]["completion_tokens"], i + 1, "{c}");
        assert_eq!(c["usage"]["total_tokens"], 5 + i + 1, "{c}");
    }
    // The finish chunk has it too, and the usage chunk still ends the stream.
    let last = chunks.last().unwrap();
    assert!(last["choices"].as_array().unwrap().is_empty(), "{last}");
    assert_eq!(last["usage"]["completion_tokens"], 4);
    assert!(chunks.iter().all(|c| c["usage"].is_object()), "{body}");
    // Without include_usage the flag changes nothing (as vLLM): no usage at all.
    req["stream_options"] = json!({"continuous_usage_stats": true});
    let (_, _, body) = post(&w, &req, &[]).await;
    assert!(!body.contains("\"usage\""), "{body}");
    w.stop().await.unwrap();
}

#[tokio::test]
async fn an_api_key_guards_every_route_but_the_probes_and_reaches_the_prefill_peer() {
    let mem = Arc::new(MemoryTransport::new());
    let key = rngd_http_edge::api_key::ApiKey::new("s3cret-key");
    let prefill = start_with(Role::Prefill, &mem, |c| c.api_key = key.clone()).await;
    let peer = prefill.addr.to_string();
    let decode = start_with(Role::Decode, &mem, |c| {
        c.api_key = key.clone();
        c.prefill_allow = peer.parse().unwrap();
    })
    .await;
    let client = reqwest::Client::new();
    // Without the key, or with another: 401, JSON, WWW-Authenticate.
    for auth in [None, Some("Bearer wrong"), Some("s3cret-key")] {
        let mut req = client
            .post(format!("{}/v1/completions", decode.url()))
            .json(&request("hi", 2));
        if let Some(a) = auth {
            req = req.header("authorization", a);
        }
        let resp = req.send().await.unwrap();
        assert_eq!(resp.status(), 401, "{auth:?}");
        assert_eq!(resp.headers()["www-authenticate"], "Bearer");
        let body: Value = resp.json().await.unwrap();
        assert_eq!(body["error"]["code"], "invalid_api_key");
        assert!(!body.to_string().contains("s3cret"), "{body}");
    }
    for path in ["/v1/models", "/tokenize"] {
        let resp = client
            .get(format!("{}{path}", decode.url()))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 401, "{path}");
    }
    // The probes, the metrics and the version stay open.
    for path in ["/health", "/ready", "/ping", "/metrics", "/version"] {
        let resp = client
            .get(format!("{}{path}", decode.url()))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200, "{path}");
    }
    // With the key: served, and the decode worker's call to its prefill
    // peer carries the key too (the prefill would refuse it otherwise).
    let resp = client
        .post(format!("{}/v1/completions", decode.url()))
        .header("authorization", "Bearer s3cret-key")
        .header("x-prefiller-host-port", &peer)
        .json(&request("hello", 3))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let body: CompletionResponse = resp.json().await.unwrap();
    assert_eq!(body.choices[0].text, "hel");
    let m = metrics(&prefill).await;
    assert_eq!(sample(&m, "rngd_pd_worker_prefills_total"), 1.0, "{m}");
    decode.stop().await.unwrap();
    prefill.stop().await.unwrap();
}
