//! The prefix-cache figures a worker exports on `/metrics`, as vLLM names
//! them: `vllm:prefix_cache_queries_total` and `vllm:prefix_cache_hits_total`
//! (prompt tokens looked up and found), and the `block_size` and
//! `num_gpu_blocks` labels of `vllm:cache_config_info`.

use std::time::Duration;

use serde::Serialize;

use crate::kv::{metric_sum, metrics_url};

/// `vllm:prefix_cache_queries_total`.
pub const QUERIES: &str = "vllm:prefix_cache_queries_total";
/// `vllm:prefix_cache_hits_total`.
pub const HITS: &str = "vllm:prefix_cache_hits_total";
/// `vllm:cache_config_info`.
pub const CACHE_CONFIG_INFO: &str = "vllm:cache_config_info";

/// A worker's prefix-cache figures at one moment (each `None`, and left out
/// of the JSON, when the worker does not export it).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Default)]
pub struct PrefixMetrics {
    /// `vllm:prefix_cache_queries_total` (prompt tokens looked up).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefix_cache_queries_total: Option<f64>,
    /// `vllm:prefix_cache_hits_total` (prompt tokens found cached).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefix_cache_hits_total: Option<f64>,
    /// The `block_size` label of `vllm:cache_config_info` (positions per block).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub block_size: Option<u64>,
    /// The `num_gpu_blocks` label (blocks the prefix cache's budget holds).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub num_gpu_blocks: Option<u64>,
}

impl PrefixMetrics {
    /// The figures in a Prometheus text exposition.
    pub fn parse(text: &str) -> Self {
        PrefixMetrics {
            prefix_cache_queries_total: metric_sum(text, QUERIES),
            prefix_cache_hits_total: metric_sum(text, HITS),
            block_size: label(text, CACHE_CONFIG_INFO, "block_size").and_then(|v| v.parse().ok()),
            num_gpu_blocks: label(text, CACHE_CONFIG_INFO, "num_gpu_blocks")
                .and_then(|v| v.parse().ok()),
        }
    }

    /// Hits over queries counted between `before` and `self` (`None` when
    /// either is missing or nothing was queried).
    pub fn hit_share_since(&self, before: &PrefixMetrics) -> Option<f64> {
        let q = self.prefix_cache_queries_total? - before.prefix_cache_queries_total.unwrap_or(0.0);
        let h = self.prefix_cache_hits_total? - before.prefix_cache_hits_total.unwrap_or(0.0);
        (q > 0.0).then(|| h / q)
    }
}

/// The value of label `key` on the first sample of `metric` (not a longer
/// name) in a Prometheus text exposition.
pub fn label(text: &str, metric: &str, key: &str) -> Option<String> {
    for line in text.lines() {
        if line.starts_with('#') {
            continue;
        }
        let Some(rest) = line.strip_prefix(metric) else {
            continue;
        };
        let Some(labels) = rest.strip_prefix('{') else {
            continue;
        };
        let labels = &labels[..labels.rfind('}')?];
        // `k="v",k2="v2"`; the values here hold no quote or comma.
        for pair in labels.split(',') {
            if let Some((k, v)) = pair.split_once('=')
                && k.trim() == key
            {
                return Some(v.trim().trim_matches('"').to_string());
            }
        }
    }
    None
}

/// The worker's figures from `{url}/metrics` (`None` if it cannot be read).
pub async fn scrape(client: &reqwest::Client, url: &str) -> Option<PrefixMetrics> {
    let text = crate::kv::fetch_text(client, &metrics_url(url), Duration::from_secs(10)).await?;
    Some(PrefixMetrics::parse(&text))
}
