//! Calls to the workers: one POST with its deadline, the body read within
//! what is left of it, an error status turned into [`ApiError`], and the
//! [`KvGuard`] that releases an abandoned request's KV.
//!
//! A worker gets the JSON body and `x-request-id`, and no header of the
//! client's (so none of the steering headers a client may send).

use std::time::{Duration, Instant};

use bytes::Bytes;
use rngd_api::openai::{CompletionRequest, ErrorBody};
use rngd_api::pd::KvReleaseAnswer;

use crate::error::{ApiError, Stage};
use crate::state::Gateway;

/// POSTs `req` to a worker; returns the response once its status is a success.
///
/// A call whose connection closes or resets before any response byte (not
/// a refused connection, not a timeout) is sent once more, on a fresh
/// connection, within what is left of `timeout`: a pooled connection the
/// worker was closing (its idle timer; a stalled worker that resumed) took
/// the request unread. Counted in `rngd_pd_gateway_upstream_retries_total`.
/// A worker that did read it and died answers nothing on the retry either
/// (a refused connection: 502); one that spent a KV handle answers 410.
pub(super) async fn send(
    gw: &Gateway,
    stage: Stage,
    address: &str,
    req: &CompletionRequest,
    rid: &str,
    timeout: Duration,
) -> Result<reqwest::Response, ApiError> {
    let url = format!("http://{address}/v1/completions");
    let started = Instant::now();
    let post = |client: &reqwest::Client| {
        client
            .post(url.as_str())
            .header(rngd_api::headers::REQUEST_ID, rid)
            .json(req)
            .send()
    };
    let timeout_err = || ApiError::Timeout {
        stage,
        address: address.to_string(),
        after_ms: timeout.as_millis() as u64,
    };
    let mut sent = tokio::time::timeout(timeout, post(&gw.client)).await;
    if let Ok(Err(e)) = &sent
        && !e.is_timeout()
        && !e.is_connect()
    {
        tracing::info!(%address, %stage, error = %e, "the worker's connection broke before any response byte; sending again on a fresh connection");
        gw.metrics.count_upstream_retry(stage.as_str());
        let left = timeout.saturating_sub(started.elapsed());
        sent = tokio::time::timeout(left, post(&gw.fresh_client)).await;
    }
    let resp = match sent {
        Err(_) => return Err(timeout_err()),
        Ok(Err(e)) if e.is_timeout() => return Err(timeout_err()),
        Ok(Err(e)) => {
            let detail = if e.is_connect() {
                "connection failed"
            } else {
                "request failed"
            };
            return Err(ApiError::Upstream {
                stage,
                address: address.to_string(),
                detail: detail.into(),
                source: Some(Box::new(e)),
            });
        }
        Ok(Ok(r)) => r,
    };
    if resp.status().is_success() {
        return Ok(resp);
    }
    let status = resp.status().as_u16();
    let bytes = tokio::time::timeout(Duration::from_secs(5), resp.bytes())
        .await
        .ok()
        .and_then(|r| r.ok())
        .unwrap_or_default();
    let (message, code, param) = match serde_json::from_slice::<ErrorBody>(&bytes) {
        Ok(b) => (b.error.message, b.error.code, b.error.param),
        Err(_) => (
            String::from_utf8_lossy(&bytes)
                .chars()
                .take(500)
                .collect::<String>(),
            None,
            None,
        ),
    };
    Err(ApiError::UpstreamStatus {
        stage,
        address: address.to_string(),
        status,
        message,
        code,
        param,
    })
}

pub(super) async fn read_with_timeout(
    stage: Stage,
    address: &str,
    resp: reqwest::Response,
    timeout: Duration,
) -> Result<Bytes, ApiError> {
    match tokio::time::timeout(timeout, resp.bytes()).await {
        Err(_) => Err(ApiError::Timeout {
            stage,
            address: address.to_string(),
            after_ms: timeout.as_millis() as u64,
        }),
        Ok(Err(e)) => Err(ApiError::Upstream {
            stage,
            address: address.to_string(),
            detail: "its response broke off".into(),
            source: Some(Box::new(e)),
        }),
        Ok(Ok(b)) => Ok(b),
    }
}

/// POSTs `req` and reads the whole answer of a success within `timeout`.
pub(super) async fn call_bytes(
    gw: &Gateway,
    stage: Stage,
    address: &str,
    req: &CompletionRequest,
    rid: &str,
    timeout: Duration,
) -> Result<Bytes, ApiError> {
    let started = Instant::now();
    let resp = send(gw, stage, address, req, rid, timeout).await?;
    let left = timeout.saturating_sub(started.elapsed());
    read_with_timeout(stage, address, resp, left).await
}

/// How long the background release of an abandoned request's KV may take.
const RELEASE_TIMEOUT: Duration = Duration::from_secs(10);

/// Releases an abandoned request's KV (see the module docs of `flow`): on
/// drop while armed, a `release_only` request for the handle
/// (`rngd_api::pd::release_request`) goes to the decode worker in the
/// background. It never decodes, so it takes a slot only for the release.
pub(super) struct KvGuard {
    armed: Option<(reqwest::Client, String, CompletionRequest, String)>,
}

impl KvGuard {
    pub(super) fn disarmed() -> Self {
        KvGuard { armed: None }
    }

    /// Armed for the decode request `decode_req` (with its handle) to `decode`.
    pub(super) fn arm(
        gw: &Gateway,
        decode: &str,
        decode_req: &CompletionRequest,
        rid: &str,
    ) -> Self {
        KvGuard {
            armed: Some((
                gw.client.clone(),
                decode.to_string(),
                rngd_api::pd::release_request(decode_req),
                rid.to_string(),
            )),
        }
    }

    pub(super) fn disarm(&mut self) {
        self.armed = None;
    }

    /// Sends the release to `decode` instead (the request moved there and
    /// the first worker cannot answer): any decode worker of the deployment
    /// verifies the handle and releases its KV through the transport.
    pub(super) fn retarget(&mut self, decode: &str) {
        if let Some(a) = self.armed.as_mut() {
            a.1 = decode.to_string();
        }
    }
}

impl Drop for KvGuard {
    fn drop(&mut self) {
        let Some((client, address, req, rid)) = self.armed.take() else {
            return;
        };
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        tracing::info!(request = %rid, decode = %address, "request given up after its prefill: asking the decode worker to release its KV");
        rt.spawn(async move {
            let fut = async {
                let r = client
                    .post(format!("http://{address}/v1/completions"))
                    .header(rngd_api::headers::REQUEST_ID, &rid)
                    .json(&req)
                    .send()
                    .await?;
                let status = r.status();
                Ok::<_, reqwest::Error>((status, r.bytes().await?))
            };
            match tokio::time::timeout(RELEASE_TIMEOUT, fut).await {
                Ok(Ok((status, body))) if status.is_success() => {
                    let previous = serde_json::from_slice::<KvReleaseAnswer>(&body)
                        .map(|a| a.previous_state.as_str())
                        .unwrap_or("unknown");
                    tracing::debug!(request = %rid, previous, "KV released");
                }
                Ok(Ok((status, _))) => tracing::warn!(request = %rid, %status, "KV release refused; the transport TTL will reclaim it"),
                Ok(Err(e)) => tracing::warn!(request = %rid, error = %e, "KV release call failed; the transport TTL will reclaim it"),
                Err(_) => tracing::warn!(request = %rid, "KV release call timed out; the transport TTL will reclaim it"),
            }
        });
    }
}
