//! A tiny HTTP GET for readiness probes (used by `rngd-pd up`, which has no
//! HTTP client of its own).

use std::time::Duration;

use crate::error::GatewayError;

/// Error of a probe.
#[derive(Debug, thiserror::Error)]
#[error("GET {url}: {source}")]
pub struct ProbeError {
    /// The URL.
    pub url: String,
    /// Cause.
    #[source]
    pub source: reqwest::Error,
}

/// `GET url` with a timeout; returns the status and the body text.
pub async fn get(url: &str, timeout: Duration) -> Result<(u16, String), ProbeError> {
    get_with_key(url, timeout, None).await
}

/// [`get`] sending `key` as `Authorization: Bearer` (a route behind
/// `--api-key`).
pub async fn get_with_key(
    url: &str,
    timeout: Duration,
    key: Option<&rngd_http_edge::api_key::ApiKey>,
) -> Result<(u16, String), ProbeError> {
    let err = |source| ProbeError {
        url: url.to_string(),
        source,
    };
    let client = reqwest::Client::builder()
        .timeout(timeout)
        .build()
        .map_err(err)?;
    let mut req = client.get(url);
    if let Some(k) = key {
        req = req.header(reqwest::header::AUTHORIZATION, k.authorization());
    }
    let resp = req.send().await.map_err(err)?;
    let status = resp.status().as_u16();
    let text = resp.text().await.map_err(err)?;
    Ok((status, text))
}

impl From<ProbeError> for GatewayError {
    fn from(e: ProbeError) -> Self {
        GatewayError::Client(e.source)
    }
}
