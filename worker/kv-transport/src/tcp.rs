//! The `tcp` transport: a client of the KV relay ([`crate::relay`]) at
//! `AIRM_KV_TCP_ADDR`. The protocol exchanges and the connection pool are
//! the relay client's; this module is the [`KvTransport`] over it (retries,
//! handles, logging).
//!
//! push sends one PUT per blob, pipelined on one pooled connection (CRC-32 is
//! computed right before each blob is written, while it is in cache); pull
//! sends one GET per blob and reads the replies as they come, straight into
//! one buffer per blob. Connections are kept in a per-transport pool; an
//! operation whose pooled connection turns out to be dead (e.g. the relay
//! restarted) is retried once on a fresh one. The handle's `location` is
//! `host:port#epoch`: the relay's epoch lets a relay that restarted answer
//! "cache lost" at once instead of a pull waiting for blobs that will never
//! come. The puller connects to its own configured address, never to one taken
//! from the handle.
//!
//! Every new connection runs TLS when configured (`AIRM_KV_TCP_TLS`, by
//! default keyed by the secret; [`crate::relay::tls`]) and is authenticated
//! with the shared secret (`AIRM_KV_TCP_SECRET` /
//! `AIRM_KV_TCP_SECRET_FILE`, see [`crate::frame`]).
//! Every operation has a deadline: push, release and STATS
//! `AIRM_KV_TCP_TIMEOUT_MS` (connecting and the handshake at most
//! [`CONNECT_TIMEOUT`]), pull its timeout plus a grace; a relay that stops
//! answering is a [`KvError::Timeout`] naming the transport, not a hang.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use rngd_kv_wire::KvHandle;

use crate::frame::RelayStats;
pub use crate::relay::client::{CONNECT_TIMEOUT, MAX_IDLE};
use crate::relay::client::{Client, Refused, is_dead_connection, log_blob};
use crate::{KvError, KvPayload, KvTransport, TransportConfig, check_handle, sanitize_key};

/// Registry name.
pub const NAME: &str = crate::frame::TRANSPORT;
/// Extra time a pull allows the relay beyond the caller's timeout before
/// declaring it unresponsive.
const GRACE: Duration = Duration::from_secs(5);

/// The `tcp` transport. Cheap to clone; clones share the connection pool.
#[derive(Clone)]
pub struct TcpTransport {
    inner: Arc<Client>,
}

impl std::fmt::Debug for TcpTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpTransport")
            .field("addr", &self.inner.addr)
            .field("crc", &self.inner.crc)
            .field("timeout", &self.inner.timeout)
            .finish_non_exhaustive()
    }
}

/// Splits a handle location `host:port#epoch` (epoch hex; absent = any).
pub fn parse_location(location: &str) -> (&str, u64) {
    match location.rsplit_once('#') {
        Some((addr, epoch)) => (addr, u64::from_str_radix(epoch, 16).unwrap_or(0)),
        None => (location, 0),
    }
}

// === impl TcpTransport ===

impl TcpTransport {
    /// Creates the transport for `cfg.tcp_addr` (`AIRM_KV_TCP_ADDR`), which
    /// must be set, authenticating with `cfg.tcp_secret` (without one the
    /// relay must run with `--insecure-no-auth`; [`TransportConfig::from_env`]
    /// refuses that unless `AIRM_KV_TCP_INSECURE_NO_AUTH=1`).
    pub fn new(cfg: &TransportConfig) -> Result<Self, KvError> {
        let addr = cfg.tcp_addr.clone().ok_or_else(|| KvError::Config {
            detail: format!(
                "the tcp transport needs the relay address in {}",
                rngd_api::env::AIRM_KV_TCP_ADDR
            ),
        })?;
        Ok(Self::connect_to(addr, cfg))
    }

    /// Creates the transport for the relay at `addr` (other settings, the
    /// secret among them, from `cfg`). Nothing is connected until the first
    /// operation.
    pub fn connect_to(addr: impl Into<String>, cfg: &TransportConfig) -> Self {
        TcpTransport {
            inner: Arc::new(Client::new(
                addr.into(),
                cfg.tcp_crc,
                cfg.tcp_log,
                cfg.tcp_secret.clone(),
                cfg.tcp_tls.clone(),
                cfg.tcp_timeout,
            )),
        }
    }

    fn timeout(&self, op: &'static str, after: Duration) -> KvError {
        KvError::Timeout {
            transport: NAME,
            peer: self.inner.addr.clone(),
            op,
            after,
        }
    }

    /// The relay address.
    pub fn addr(&self) -> &str {
        &self.inner.addr
    }

    /// The relay's counters (STATS frame): blobs and bytes held, waiting GETs,
    /// rejections, … Within the transport's deadline.
    pub async fn stats(&self) -> Result<RelayStats, KvError> {
        let after = self.inner.timeout;
        tokio::time::timeout(after, self.stats_now())
            .await
            .unwrap_or_else(|_| Err(self.timeout("STATS", after)))
    }

    async fn stats_now(&self) -> Result<RelayStats, KvError> {
        let c = &self.inner;
        let mut retried = false;
        loop {
            let mut conn = c.checkout().await?;
            let res = c.stats_on(&mut conn).await;
            match res {
                Ok(v) => {
                    c.checkin(conn);
                    return Ok(v);
                }
                Err(e) if conn.reused && !retried && is_dead_connection(&e) => {
                    c.clear_pool();
                    retried = true;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Idle pooled connections (for tests).
    pub fn idle_connections(&self) -> usize {
        self.inner.idle_count()
    }
}

#[async_trait::async_trait]
impl KvTransport for TcpTransport {
    fn name(&self) -> &'static str {
        NAME
    }

    #[tracing::instrument(name = "kv.push", skip_all, fields(transport = NAME, request_id = %payload.request_id, blobs = payload.blobs.len()))]
    async fn push(&self, payload: KvPayload) -> Result<KvHandle, KvError> {
        let after = self.inner.timeout;
        tokio::time::timeout(after, self.push_now(payload))
            .await
            .unwrap_or_else(|_| Err(self.timeout("push", after)))
    }

    #[tracing::instrument(name = "kv.pull", skip_all, fields(transport = NAME, request_id = %handle.request_id, bytes = handle.total_bytes()))]
    async fn pull(&self, handle: &KvHandle, timeout: Duration) -> Result<Vec<Bytes>, KvError> {
        self.pull_within(handle, timeout, timeout).await
    }

    #[tracing::instrument(name = "kv.pull", skip_all, fields(transport = NAME, request_id = %handle.request_id, bytes = handle.total_bytes()))]
    async fn pull_published(
        &self,
        handle: &KvHandle,
        timeout: Duration,
    ) -> Result<Vec<Bytes>, KvError> {
        self.pull_within(handle, Duration::ZERO, timeout).await
    }

    #[tracing::instrument(name = "kv.release", skip_all, fields(transport = NAME, request_id = %handle.request_id))]
    async fn release(&self, handle: &KvHandle) -> Result<(), KvError> {
        check_handle(NAME, handle)?;
        let key = sanitize_key(NAME, &handle.request_id)?;
        let after = self.inner.timeout;
        tokio::time::timeout(after, self.inner.release_key(&key))
            .await
            .unwrap_or_else(|_| Err(self.timeout("release", after)))
    }
}

// The operations without their overall deadlines.
impl TcpTransport {
    async fn push_now(&self, payload: KvPayload) -> Result<KvHandle, KvError> {
        let key = sanitize_key(NAME, &payload.request_id)?;
        let c = &self.inner;
        let started = Instant::now();
        let (metas, epoch) = if payload.blobs.is_empty() {
            (Vec::new(), 0)
        } else {
            let mut retried = false;
            loop {
                let mut conn = c.checkout().await?;
                match c
                    .push_on(&mut conn, &payload.request_id, &key, &payload.blobs)
                    .await
                {
                    Ok(Ok(v)) => {
                        c.checkin(conn);
                        break v;
                    }
                    Ok(Err(Refused {
                        error: refused,
                        usable,
                    })) => {
                        // Every reply was read, or the relay closed the
                        // connection: nothing of this request is in flight,
                        // so the release cannot race a late PUT.
                        if usable {
                            c.checkin(conn);
                        }
                        if let Err(e) = c.release_key(&key).await {
                            tracing::warn!(request_id = %payload.request_id, error = %e, "tcp: cleanup after a refused push failed");
                        }
                        return Err(refused);
                    }
                    Err(e) if conn.reused && !retried && is_dead_connection(&e) => {
                        c.clear_pool();
                        retried = true;
                    }
                    Err(e) => return Err(e),
                }
            }
        };
        let bytes: u64 = metas.iter().map(|m| m.len).sum();
        tracing::debug!(request_id = %payload.request_id, bytes, ms = started.elapsed().as_secs_f64() * 1e3, "tcp: pushed");
        Ok(KvHandle {
            request_id: payload.request_id,
            transport: NAME.into(),
            location: format!("{}#{epoch:016x}", c.addr),
            layout: payload.layout,
            tokens: payload.tokens,
            wire: payload.wire,
            blobs: metas,
        })
    }

    /// Pulls `handle`'s blobs: the relay waits at most `appear` for a blob
    /// it does not hold (`0`: it answers "not found" at once); the whole
    /// pull has `timeout` (plus [`GRACE`] for the relay's answer).
    pub(crate) async fn pull_within(
        &self,
        handle: &KvHandle,
        appear: Duration,
        timeout: Duration,
    ) -> Result<Vec<Bytes>, KvError> {
        let after = timeout + GRACE;
        tokio::time::timeout(after, self.pull_now(handle, appear, timeout))
            .await
            .unwrap_or_else(|_| Err(self.timeout("pull", after)))
    }

    async fn pull_now(
        &self,
        handle: &KvHandle,
        appear: Duration,
        timeout: Duration,
    ) -> Result<Vec<Bytes>, KvError> {
        check_handle(NAME, handle)?;
        let key = sanitize_key(NAME, &handle.request_id)?;
        if handle.blobs.is_empty() {
            return Ok(Vec::new());
        }
        let (_, epoch) = parse_location(&handle.location);
        let c = &self.inner;
        let started = Instant::now();
        let mut retried = false;
        let blobs = loop {
            let mut conn = c.checkout().await?;
            let remaining = timeout.saturating_sub(started.elapsed());
            let res = tokio::time::timeout(
                remaining + GRACE,
                c.pull_on(&mut conn, handle, &key, epoch, appear.min(remaining)),
            )
            .await
            .unwrap_or_else(|_| Err(self.timeout("pull", remaining + GRACE)));
            match res {
                Ok(v) => {
                    c.checkin(conn);
                    break v;
                }
                Err(e) if conn.reused && !retried && is_dead_connection(&e) => {
                    c.clear_pool();
                    retried = true;
                }
                Err(e) => return Err(e),
            }
        };
        if c.log {
            for (i, b) in blobs.iter().enumerate() {
                log_blob("pull", &handle.request_id, i, b);
            }
        }
        tracing::debug!(request_id = %handle.request_id, bytes = handle.total_bytes(), ms = started.elapsed().as_secs_f64() * 1e3, "tcp: pulled");
        Ok(blobs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn location_carries_the_epoch() {
        assert_eq!(
            parse_location("10.0.0.1:7070#00000000000000ff"),
            ("10.0.0.1:7070", 255)
        );
        assert_eq!(parse_location("relay:7070"), ("relay:7070", 0));
    }
}
