//! The prefill peer a decode worker calls for `x-prefiller-host-port` requests
//! (llm-d routing-sidecar behaviour): [`PrefillPeer`], real over HTTP.
//!
//! The HTTP client only ever connects to a [`PeerAddr`] the allowlist
//! admitted (the URL is built from the parsed address, never from the header
//! text), follows no redirects, uses no proxy, gives up connecting after
//! [`PEER_CONNECT_TIMEOUT`] and on the whole call after the prefill timeout,
//! reads at most [`MAX_PEER_ANSWER`] bytes of the answer, and never repeats
//! the peer's body in an error.

use std::time::Duration;

use rngd_api::headers;
use rngd_api::openai::{CompletionRequest, ErrorBody};

use crate::allow::PeerAddr;
use crate::error::ApiError;

/// Largest prefill answer a decode worker reads from its peer, bytes (a
/// prefill answer is a first token, the prompt's token ids and a handle:
/// well under this for any compiled context). Beyond it the call fails (502).
pub const MAX_PEER_ANSWER: usize = 1 << 20;

/// How long connecting to a prefill peer may take (the whole call is bounded
/// by the prefill timeout as well, whichever is shorter).
pub const PEER_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Sends a prefill request to another worker (environment edge: the network).
#[async_trait::async_trait]
pub trait PrefillPeer: Send + Sync + 'static {
    /// POSTs `body` to `http://{peer}/v1/completions` and returns the body
    /// of a 2xx answer as received; the caller judges it
    /// (`rngd_api::pd::decode_request_from`, the one verdict every
    /// orchestrator gives).
    async fn prefill(
        &self,
        peer: &PeerAddr,
        request_id: &str,
        body: &CompletionRequest,
        timeout: Duration,
    ) -> Result<Vec<u8>, ApiError>;
}

/// [`PrefillPeer`] over HTTP with reqwest (no redirects, no proxy, bounded).
#[derive(Debug, Clone)]
pub struct HttpPrefillPeer {
    client: reqwest::Client,
    /// Sent as `Authorization` (peers serve under the same API key).
    api_key: Option<rngd_http_edge::api_key::ApiKey>,
}

impl Default for HttpPrefillPeer {
    fn default() -> Self {
        Self::new()
    }
}

impl HttpPrefillPeer {
    /// A peer client with a fresh connection pool.
    pub fn new() -> Self {
        let client = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .no_proxy()
            .connect_timeout(PEER_CONNECT_TIMEOUT)
            // Idle pooled connections go before the peer's own idle timer
            // closes them (a request is never written into a closing one).
            .pool_idle_timeout(
                rngd_http_edge::DEFAULT_IDLE_TIMEOUT
                    .saturating_sub(std::time::Duration::from_secs(1)),
            )
            .build()
            .unwrap_or_else(|_| reqwest::Client::new());
        HttpPrefillPeer {
            client,
            api_key: None,
        }
    }

    /// This client, sending `key` to its peers (`Authorization: Bearer`).
    pub fn with_api_key(mut self, key: Option<rngd_http_edge::api_key::ApiKey>) -> Self {
        self.api_key = key;
        self
    }
}

/// A plausible OpenAI error `code` (lower-case word characters, short), or none.
fn plausible_code(body: &[u8]) -> Option<String> {
    let parsed: ErrorBody = serde_json::from_slice(body).ok()?;
    parsed.error.code.filter(|c| {
        !c.is_empty()
            && c.len() <= 64
            && c.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
    })
}

#[async_trait::async_trait]
impl PrefillPeer for HttpPrefillPeer {
    async fn prefill(
        &self,
        peer: &PeerAddr,
        request_id: &str,
        body: &CompletionRequest,
        timeout: Duration,
    ) -> Result<Vec<u8>, ApiError> {
        let name = peer.to_string();
        let peer_err = |stage: &'static str, detail: String, source: Option<reqwest::Error>| {
            ApiError::PrefillPeer {
                peer: name.clone(),
                request_id: request_id.to_string(),
                stage,
                detail,
                source,
            }
        };
        let url = format!("http://{peer}/v1/completions");
        let call = async {
            let mut req = self
                .client
                .post(&url)
                .timeout(timeout)
                .header(headers::REQUEST_ID, request_id);
            if let Some(k) = &self.api_key {
                req = req.header(reqwest::header::AUTHORIZATION, k.authorization());
            }
            let mut resp = req.json(body).send().await.map_err(|e| {
                let stage = if e.is_connect() { "connect" } else { "send" };
                peer_err(stage, "request failed".into(), Some(e))
            })?;
            let status = resp.status();
            if resp
                .content_length()
                .is_some_and(|n| n > MAX_PEER_ANSWER as u64)
            {
                return Err(peer_err(
                    "read",
                    format!(
                        "prefill peer answered {status} with more than {MAX_PEER_ANSWER} bytes"
                    ),
                    None,
                ));
            }
            let mut bytes = Vec::new();
            loop {
                match resp.chunk().await {
                    Ok(Some(c)) => {
                        if bytes.len() + c.len() > MAX_PEER_ANSWER {
                            return Err(peer_err(
                                "read",
                                format!(
                                    "prefill peer answered {status} with more than {MAX_PEER_ANSWER} bytes"
                                ),
                                None,
                            ));
                        }
                        bytes.extend_from_slice(&c);
                    }
                    Ok(None) => break,
                    Err(e) => {
                        return Err(peer_err(
                            "read",
                            "reading the answer failed".into(),
                            Some(e),
                        ));
                    }
                }
            }
            if !status.is_success() {
                let code = plausible_code(&bytes);
                if status.is_client_error() && serde_json::from_slice::<ErrorBody>(&bytes).is_ok() {
                    return Err(ApiError::PrefillPeerRejected {
                        peer: name.clone(),
                        request_id: request_id.to_string(),
                        status: status.as_u16(),
                        code,
                    });
                }
                let detail = match code {
                    Some(c) => format!("prefill peer answered {status} (code {c})"),
                    None => format!("prefill peer answered {status}"),
                };
                return Err(peer_err("status", detail, None));
            }
            Ok(bytes)
        };
        match tokio::time::timeout(timeout, call).await {
            Ok(Err(ApiError::PrefillPeer {
                source: Some(e),
                stage,
                ..
            })) if e.is_timeout() => Err(ApiError::PrefillPeerTimeout {
                peer: name.clone(),
                request_id: request_id.to_string(),
                after: if stage == "connect" {
                    PEER_CONNECT_TIMEOUT.min(timeout)
                } else {
                    timeout
                },
            }),
            Ok(r) => r,
            Err(_) => Err(ApiError::PrefillPeerTimeout {
                peer: name.clone(),
                request_id: request_id.to_string(),
                after: timeout,
            }),
        }
    }
}
