//! The gateway's refusals and failures, against the same test cluster as
//! `api.rs`: the bad-input matrix, policy rejects and traps, failing,
//! hanging and unreachable workers — each a clear OpenAI error naming what
//! failed.

mod common;

use std::time::Duration;

use common::{LONG, Mode, PolicyMode, client, cluster, error_of};
use rngd_gateway::GatewayConfig;
use serde_json::json;

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
        post(r#"{"model":"fake-model","prompt":"a","n":17}"#.into())
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
        post(r#"{"model":"fake-model","prompt":["a","b"],"n":9}"#.into())
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

    // Unknown model → 404 naming what is served, even for a prompt too
    // long for the context (the model is checked before the prompt is
    // counted).
    for prompt in ["a".to_string(), "a ".repeat(600)] {
        let m = error_of(
            post(format!(r#"{{"model":"gpt-9","prompt":"{prompt}"}}"#))
                .send()
                .await
                .unwrap(),
            404,
        )
        .await;
        assert!(m.contains("gpt-9") && m.ends_with("fake-model"), "{m}");
    }

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

    // Over the compiled length → the policy's 400 naming the numbers. The
    // endpoints were listed with 64 positions; the workers' own
    // `rngd_pd_worker_variant_info` says 512, and what a worker says wins.
    let m = error_of(
        post(json!({"model": "fake-model", "prompt": LONG, "max_tokens": 600}).to_string())
            .send()
            .await
            .unwrap(),
        400,
    )
    .await;
    assert!(
        m.contains("6 tokens") && m.contains("600") && m.contains("606") && m.contains("512"),
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

    // Unknown route → 404 JSON; a known route with another method → 405 JSON.
    error_of(
        client()
            .get(format!("{}/v2/nothing", c.url))
            .send()
            .await
            .unwrap(),
        404,
    )
    .await;
    let m = error_of(
        client()
            .get(format!("{}/v1/completions", c.url))
            .send()
            .await
            .unwrap(),
        405,
    )
    .await;
    assert!(m.contains("GET"), "{m}");

    // vLLM's small routes: /version and /ping (GET and POST).
    let v: serde_json::Value = client()
        .get(format!("{}/version", c.url))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["version"], rngd_http_edge::surface::VERSION);
    for req in [
        client().get(format!("{}/ping", c.url)),
        client().post(format!("{}/ping", c.url)),
    ] {
        assert_eq!(req.send().await.unwrap().status(), 200);
    }
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
async fn an_api_key_guards_the_gateway_and_the_gateway_sends_it_to_the_workers() {
    let key = rngd_http_edge::api_key::ApiKey::new("gw-key");
    let config = GatewayConfig {
        api_key: key.clone(),
        ..GatewayConfig::default()
    };
    let c = common::cluster_with(config, Duration::ZERO, |w| w.api_key = key.clone()).await;
    let body = json!({"model": "fake-model", "prompt": LONG, "max_tokens": 3});
    // No key or a wrong one: 401 before any work, counted.
    for auth in [None, Some("Bearer nope")] {
        let mut req = client()
            .post(format!("{}/v1/completions", c.url))
            .json(&body);
        if let Some(a) = auth {
            req = req.header("authorization", a);
        }
        let resp = req.send().await.unwrap();
        assert_eq!(resp.headers()["www-authenticate"], "Bearer");
        error_of(resp, 401).await;
    }
    assert!(
        c.policy.seen.lock().unwrap().is_empty(),
        "the policy ran for a refused request"
    );
    // The probes stay open.
    for path in ["/health", "/metrics", "/version", "/ping"] {
        let resp = client()
            .get(format!("{}{path}", c.url))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200, "{path}");
    }
    // With the key: served over PD, the gateway authenticated to both workers.
    let resp = client()
        .post(format!("{}/v1/completions", c.url))
        .header("authorization", "Bearer gw-key")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200, "{}", resp.text().await.unwrap());
    let m = common::metrics(&c.url).await;
    assert!(
        m.contains("rngd_pd_gateway_requests_total{code=\"401\"} 2"),
        "{m}"
    );
}
