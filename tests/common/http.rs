//! The HTTP side of the root tests that drive real workers: a greedy
//! completion body, a POST with headers, a completion that must succeed,
//! the token ids of an answer (whole or streamed) and one metric's value.

use serde_json::{Value, json};

use super::Proc;

/// A greedy completion of 12 tokens.
pub fn request(prompt: &str) -> Value {
    json!({"model": super::SERVED_MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0})
}

/// A client that never goes through a proxy the environment names.
pub fn client() -> reqwest::Client {
    reqwest::Client::builder().no_proxy().build().unwrap()
}

/// POSTs `body` with `headers`; status and body text.
pub async fn post(url: &str, body: &Value, headers: &[(&str, &str)]) -> (u16, String) {
    let mut req = client().post(url).json(body);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = req
        .send()
        .await
        .unwrap_or_else(|e| panic!("POST {url}: {e}"));
    let status = resp.status().as_u16();
    (status, resp.text().await.unwrap())
}

/// `POST /v1/completions` on `w`, which must answer 200; the answer.
pub async fn complete(w: &Proc, body: &Value, headers: &[(&str, &str)]) -> Value {
    let (status, text) = post(&w.url("/v1/completions"), body, headers).await;
    assert_eq!(status, 200, "{} answered {status}: {text}", w.name);
    serde_json::from_str(&text).unwrap()
}

/// The token ids of a whole answer.
pub fn ids(v: &Value) -> Vec<u64> {
    v["choices"][0]["token_ids"]
        .as_array()
        .unwrap_or_else(|| panic!("no token_ids in {v}"))
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect()
}

/// The token ids of a streamed answer (SSE text ending in `[DONE]`).
pub fn streamed_ids(body: &str) -> Vec<u64> {
    assert!(body.ends_with("data: [DONE]\n\n"), "{body}");
    body.split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .flat_map(|d| {
            let v: Value = serde_json::from_str(d).unwrap();
            v["choices"][0]["token_ids"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .map(|t| t.as_u64().unwrap())
        .collect()
}

/// The value of the unlabelled sample `name` on `w`'s `/metrics`.
pub async fn metric(w: &Proc, name: &str) -> f64 {
    let text = client()
        .get(w.url("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(' ')))
        .unwrap_or_else(|| panic!("{name} missing from {}'s metrics:\n{text}", w.name))
        .trim()
        .parse()
        .unwrap()
}
