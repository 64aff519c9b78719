//! Rows of the fault suite at the gateway: overload is answered with 429 +
//! `Retry-After` beyond `max_concurrent` + `max_queued` (or after
//! `queue_timeout`), never a 5xx or a hang, and every slot is freed after;
//! a client that does not send its body gets a 408 at the deadline, holding
//! no slot while it stalls.

mod common;

use std::time::{Duration, Instant};

use common::{client, cluster, metrics, sample};
use rngd_gateway::GatewayConfig;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[tokio::test]
async fn overload_is_429_with_retry_after_and_frees_every_slot() {
    let config = GatewayConfig {
        max_concurrent: 2,
        max_queued: 2,
        queue_timeout: Duration::from_millis(100),
        ..GatewayConfig::default()
    };
    let c = cluster(config, Duration::from_millis(20)).await;
    let url = format!("{}/v1/completions", c.url);
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..60 {
        let url = url.clone();
        tasks.push(tokio::spawn(async move {
            let r = client()
                .post(url)
                .json(&json!({"model": "fake-model", "prompt": "a b", "max_tokens": 8, "stream": true}))
                .send()
                .await
                .unwrap();
            let status = r.status().as_u16();
            let retry = r.headers().get("retry-after").map(|v| v.to_str().unwrap().to_string());
            (status, retry, r.text().await.unwrap())
        }));
    }
    let mut rejected = 0;
    let mut served = 0;
    for t in tasks {
        let (status, retry, text) = t.await.unwrap();
        match status {
            200 => served += 1,
            429 => {
                rejected += 1;
                assert!(retry.is_some(), "429 without Retry-After");
                let e: Value = serde_json::from_str(&text).unwrap();
                assert_eq!(e["error"]["code"], "server_overloaded", "{text}");
            }
            other => panic!("a {other} under overload: {text}"),
        }
    }
    assert!(t0.elapsed() < Duration::from_secs(60), "the flood hung");
    assert!(
        served >= 2 && rejected > 0,
        "served {served}, rejected {rejected}"
    );
    let m = metrics(&c.url).await;
    let reason = |r: &str| {
        sample(
            &m,
            &format!("rngd_pd_gateway_overload_rejections_total{{reason=\"{r}\"}}"),
        )
    };
    let counted = reason("queue_full").expect("queue_full rejections")
        + reason("queue_timeout").unwrap_or(0.0);
    assert_eq!(counted, rejected as f64, "{m}");
    assert_eq!(
        sample(&m, "rngd_pd_gateway_in_flight"),
        Some(0.0),
        "every slot freed"
    );
    assert_eq!(sample(&m, "rngd_pd_gateway_queued"), Some(0.0));
    let r = client()
        .post(url)
        .json(&json!({"model": "fake-model", "prompt": "a b", "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
}

#[tokio::test]
async fn a_stalled_body_is_a_408_and_holds_no_slot() {
    let config = GatewayConfig {
        max_concurrent: 1,
        body_timeout: Duration::from_millis(300),
        ..GatewayConfig::default()
    };
    let c = cluster(config, Duration::ZERO).await;
    let addr = c.url.trim_start_matches("http://").to_string();
    let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
    s.write_all(b"POST /v1/completions HTTP/1.1\r\nhost: g\r\ncontent-type: application/json\r\ncontent-length: 200\r\n\r\n{\"model\":")
        .await
        .unwrap();
    // While it stalls, the one slot serves others.
    let r = client()
        .post(format!("{}/v1/completions", c.url))
        .json(&json!({"model": "fake-model", "prompt": "a b", "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    while !String::from_utf8_lossy(&buf).contains("request_timeout") {
        match tokio::time::timeout(Duration::from_secs(10), s.read(&mut chunk)).await {
            Ok(Ok(n)) if n > 0 => buf.extend_from_slice(&chunk[..n]),
            _ => break,
        }
    }
    let text = String::from_utf8_lossy(&buf);
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
}
