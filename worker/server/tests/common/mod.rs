//! Helpers the worker's test files share: reading a worker's `/metrics` page
//! and one sample of it.
#![allow(dead_code)]

use rngd_worker::RunningWorker;

/// The worker's `/metrics` page.
pub async fn metrics(w: &RunningWorker) -> String {
    reqwest::get(format!("{}/metrics", w.url()))
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// The value of one sample (`name` with its label set, if any) in Prometheus text.
pub fn sample(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(' ')))
        .unwrap_or_else(|| panic!("{name} missing from metrics:\n{text}"))
        .trim()
        .parse()
        .unwrap()
}
