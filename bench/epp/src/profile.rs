//! `--profile`: percentiles of the phase timings in Envoy's access log, and
//! the policy call timed inside the picker ([`TimedPolicy`]).

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use rngd_policy_host::PolicyRuntime;
use rngd_pool::{Policy, PolicyFailure};

use crate::{BenchError, io};

pub(crate) fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let idx = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

pub(crate) fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// Times every policy call (profile mode only).
pub(crate) struct TimedPolicy {
    pub(crate) inner: Arc<PolicyRuntime>,
    pub(crate) us: Arc<Mutex<Vec<f64>>>,
}

/// What [`Policy::decide`] returns (the trait is declared with `async_trait`).
type DecideFuture<'a> = std::pin::Pin<
    Box<
        dyn std::future::Future<Output = Result<rngd_policy_core::Decision, PolicyFailure>>
            + Send
            + 'a,
    >,
>;

impl Policy for TimedPolicy {
    fn decide<'a, 'f>(&'a self, req: rngd_policy_host::PolicyRequest) -> DecideFuture<'f>
    where
        'a: 'f,
    {
        Box::pin(async move {
            let t = Instant::now();
            let r = Policy::decide(self.inner.as_ref(), req).await;
            let us = t.elapsed().as_secs_f64() * 1e6;
            if let Ok(mut v) = self.us.lock() {
                v.push(us);
            }
            r
        })
    }
}

/// p50 / p99 of one timing, µs.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Spread {
    /// Median.
    pub p50_us: f64,
    /// 99th percentile.
    pub p99_us: f64,
}

pub(crate) fn spread(mut v: Vec<f64>) -> Spread {
    v.sort_by(f64::total_cmp);
    Spread {
        p50_us: round3(percentile(&v, 50.0)),
        p99_us: round3(percentile(&v, 99.0)),
    }
}

/// Percentiles of the profile access log, per listener and field.
pub(crate) fn read_profile(
    path: &Path,
    skip_first: usize,
) -> Result<BTreeMap<String, BTreeMap<String, Spread>>, BenchError> {
    let text = std::fs::read_to_string(path).map_err(io("read the profile access log"))?;
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut values: BTreeMap<String, BTreeMap<String, Vec<f64>>> = BTreeMap::new();
    for line in text.lines() {
        let Ok(serde_json::Value::Object(o)) = serde_json::from_str::<serde_json::Value>(line)
        else {
            continue;
        };
        let listener = o
            .get("listener")
            .and_then(|v| v.as_str())
            .unwrap_or("?")
            .to_string();
        let n = seen.entry(listener.clone()).or_default();
        *n += 1;
        if *n <= skip_first {
            continue;
        }
        for (k, v) in o {
            let x = match &v {
                serde_json::Value::Number(n) => n.as_f64(),
                serde_json::Value::String(s) => s.parse().ok(),
                _ => None,
            };
            if let Some(x) = x {
                values
                    .entry(listener.clone())
                    .or_default()
                    .entry(k)
                    .or_default()
                    .push(x);
            }
        }
    }
    Ok(values
        .into_iter()
        .map(|(l, m)| (l, m.into_iter().map(|(k, v)| (k, spread(v))).collect()))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), 51.0);
        assert_eq!(percentile(&v, 99.0), 99.0);
    }
}
