//! [`MemoryTransport`]: an in-process transport for tests of other crates
//! (workers, gateway). It behaves like a real one — waits for unpublished
//! requests up to the timeout, checks CRC-32 on pull, frees on release — and
//! passes the [`crate::conformance`] suite, but moves nothing across processes.
//! Requests older than the TTL ([`MemoryTransport::with_ttl`], default none)
//! are dropped lazily, at the next call.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use rngd_kv_wire::KvHandle;
use tokio::sync::Notify;

use crate::{KvError, KvPayload, KvTransport, check_handle, sanitize_key};

/// Registry-style name of the fake (handles carry it in `transport`).
pub const NAME: &str = "memory";

/// An in-memory [`KvTransport`]. Share it (`Arc`) between the "prefill" and
/// "decode" sides of a test.
#[derive(Debug, Default)]
pub struct MemoryTransport {
    store: Mutex<HashMap<String, (Vec<Bytes>, Instant)>>,
    ttl: Option<Duration>,
    arrived: Notify,
    fail_pushes: AtomicBool,
}

impl MemoryTransport {
    /// An empty transport.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty transport whose unread requests expire after `ttl`.
    pub fn with_ttl(ttl: Duration) -> Self {
        MemoryTransport {
            ttl: Some(ttl),
            ..Self::default()
        }
    }

    fn locked(&self) -> std::sync::MutexGuard<'_, HashMap<String, (Vec<Bytes>, Instant)>> {
        let mut store = self.store.lock().expect("store poisoned");
        if let Some(ttl) = self.ttl {
            store.retain(|_, (_, at)| at.elapsed() < ttl);
        }
        store
    }

    /// Requests held (pushed, not yet released nor expired).
    pub fn held(&self) -> usize {
        self.locked().len()
    }

    /// Makes every following push fail with [`KvError::Capacity`] (or stop failing).
    pub fn fail_pushes(&self, fail: bool) {
        self.fail_pushes.store(fail, Ordering::SeqCst);
    }

    /// Flips one bit of byte `byte` of blob `blob` of a held request; returns
    /// whether there was such a byte.
    pub fn corrupt(&self, request_id: &str, blob: usize, byte: usize) -> bool {
        let Ok(key) = sanitize_key(NAME, request_id) else {
            return false;
        };
        let mut store = self.locked();
        let Some(b) = store
            .get_mut(&key)
            .and_then(|(blobs, _)| blobs.get_mut(blob))
        else {
            return false;
        };
        if byte >= b.len() {
            return false;
        }
        let mut v = b.to_vec();
        v[byte] ^= 0x01;
        *b = Bytes::from(v);
        true
    }
}

#[async_trait::async_trait]
impl KvTransport for MemoryTransport {
    fn name(&self) -> &'static str {
        NAME
    }

    async fn push(&self, payload: KvPayload) -> Result<KvHandle, KvError> {
        let key = sanitize_key(NAME, &payload.request_id)?;
        if self.fail_pushes.load(Ordering::SeqCst) {
            return Err(KvError::Capacity {
                transport: NAME,
                detail: "injected failure (MemoryTransport::fail_pushes)".into(),
                source: None,
            });
        }
        let blobs = rngd_kv_wire::describe(&payload.blobs);
        self.locked().insert(key, (payload.blobs, Instant::now()));
        self.arrived.notify_waiters();
        Ok(KvHandle {
            request_id: payload.request_id,
            transport: NAME.into(),
            location: "memory".into(),
            layout: payload.layout,
            tokens: payload.tokens,
            wire: payload.wire,
            blobs,
        })
    }

    async fn pull(&self, handle: &KvHandle, timeout: Duration) -> Result<Vec<Bytes>, KvError> {
        self.pull_within(handle, timeout).await
    }

    async fn pull_published(
        &self,
        handle: &KvHandle,
        _timeout: Duration,
    ) -> Result<Vec<Bytes>, KvError> {
        self.pull_within(handle, Duration::ZERO).await
    }

    async fn release(&self, handle: &KvHandle) -> Result<(), KvError> {
        check_handle(NAME, handle)?;
        let key = sanitize_key(NAME, &handle.request_id)?;
        self.locked().remove(&key);
        Ok(())
    }
}

impl MemoryTransport {
    /// Takes a copy of the key's blobs, waiting at most `timeout` for them.
    async fn pull_within(
        &self,
        handle: &KvHandle,
        timeout: Duration,
    ) -> Result<Vec<Bytes>, KvError> {
        check_handle(NAME, handle)?;
        let key = sanitize_key(NAME, &handle.request_id)?;
        let started = Instant::now();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notified = self.arrived.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let found = self.locked().get(&key).map(|(b, _)| b.clone());
            if let Some(blobs) = found {
                crate::verify_all(NAME, handle, &blobs)?;
                return Ok(blobs);
            }
            tokio::select! {
                _ = &mut notified => {}
                _ = tokio::time::sleep_until(deadline) => {
                    return Err(KvError::NotFound {
                        transport: NAME,
                        request_id: handle.request_id.clone(),
                        waited: started.elapsed(),
                    });
                }
            }
        }
    }
}
