//! KV transports: move one request's KV cache (a set of blobs described by a
//! [`KvHandle`]) from a prefill worker to a decode worker.
//!
//! - [`KvTransport`]: the trait every transport implements (`push`, `pull`, `release`).
//! - [`registry`]: transports selected by name (`AIRM_KV_TRANSPORT`, default `shm`).
//! - `shm`: files in `/dev/shm`, mapped with memmap2.
//! - `tcp`: a client of the relay server (`rngd-pd relay`).

use std::time::Duration;

use bytes::Bytes;
pub use rngd_kv_wire::{KvHandle, KvLayout};

/// Errors of the KV transports.
#[derive(Debug, thiserror::Error)]
pub enum KvError {
    /// Placeholder until the transports land.
    #[error("{0}")]
    Other(String),
}

/// One request's cache as handed to a transport: blobs in wire order (`K0, V0, K1, V1, …`).
#[derive(Debug, Clone)]
pub struct KvPayload {
    /// Request id (sanitized by the transport before use as a key).
    pub request_id: String,
    /// Shape of the cache.
    pub layout: KvLayout,
    /// Valid positions.
    pub tokens: usize,
    /// The blobs, `layout.blob_count()` of them.
    pub blobs: Vec<Bytes>,
}

/// A KV transport.
#[async_trait::async_trait]
pub trait KvTransport: Send + Sync + 'static {
    /// Registry name (`shm`, `tcp`, `nixl-ucx`).
    fn name(&self) -> &'static str;
    /// Publishes the blobs; returns the handle the other side pulls with.
    async fn push(&self, payload: KvPayload) -> Result<KvHandle, KvError>;
    /// Fetches and verifies (CRC-32) every blob of `handle`, waiting at most `timeout`.
    async fn pull(&self, handle: &KvHandle, timeout: Duration) -> Result<Vec<Bytes>, KvError>;
    /// Frees whatever the transport holds for `handle`. Idempotent.
    async fn release(&self, handle: &KvHandle) -> Result<(), KvError>;
}
