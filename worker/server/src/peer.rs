//! The prefill peer a decode worker calls for `x-prefiller-host-port` requests
//! (llm-d routing-sidecar behaviour): [`PrefillPeer`], real over HTTP.

use std::time::Duration;

use rngd_api::headers;
use rngd_api::openai::{CompletionRequest, CompletionResponse, ErrorBody};

use crate::error::ApiError;

/// Sends a prefill request to another worker (environment edge: the network).
#[async_trait::async_trait]
pub trait PrefillPeer: Send + Sync + 'static {
    /// POSTs `body` to `http://{host_port}/v1/completions` and returns the parsed answer.
    async fn prefill(
        &self,
        host_port: &str,
        request_id: &str,
        body: &CompletionRequest,
        timeout: Duration,
    ) -> Result<CompletionResponse, ApiError>;
}

/// [`PrefillPeer`] over HTTP with reqwest.
#[derive(Debug, Clone, Default)]
pub struct HttpPrefillPeer {
    client: reqwest::Client,
}

impl HttpPrefillPeer {
    /// A peer client with a fresh connection pool.
    pub fn new() -> Self {
        Self::default()
    }
}

#[async_trait::async_trait]
impl PrefillPeer for HttpPrefillPeer {
    async fn prefill(
        &self,
        host_port: &str,
        request_id: &str,
        body: &CompletionRequest,
        timeout: Duration,
    ) -> Result<CompletionResponse, ApiError> {
        let peer_err = |detail: String, source: Option<reqwest::Error>| ApiError::PrefillPeer {
            peer: host_port.to_string(),
            request_id: request_id.to_string(),
            detail,
            source,
        };
        let url = format!("http://{host_port}/v1/completions");
        let call = async {
            let resp = self
                .client
                .post(&url)
                .header(headers::REQUEST_ID, request_id)
                .json(body)
                .send()
                .await
                .map_err(|e| peer_err("request failed".into(), Some(e)))?;
            let status = resp.status();
            let bytes = resp
                .bytes()
                .await
                .map_err(|e| peer_err("reading the answer failed".into(), Some(e)))?;
            if !status.is_success() {
                let parsed: Option<ErrorBody> = serde_json::from_slice(&bytes).ok();
                return match parsed {
                    Some(body) if status.is_client_error() => Err(ApiError::PrefillPeerRejected {
                        peer: host_port.to_string(),
                        request_id: request_id.to_string(),
                        status: status.as_u16(),
                        body: Box::new(body),
                    }),
                    Some(body) => Err(peer_err(
                        format!("status {status}: {}", body.error.message),
                        None,
                    )),
                    None => Err(peer_err(
                        format!("status {status}: {}", String::from_utf8_lossy(&bytes)),
                        None,
                    )),
                };
            }
            serde_json::from_slice::<CompletionResponse>(&bytes)
                .map_err(|e| peer_err(format!("answer is not a completion response: {e}"), None))
        };
        match tokio::time::timeout(timeout, call).await {
            Ok(r) => r,
            Err(_) => Err(ApiError::PrefillPeerTimeout {
                peer: host_port.to_string(),
                request_id: request_id.to_string(),
                after: timeout,
            }),
        }
    }
}
