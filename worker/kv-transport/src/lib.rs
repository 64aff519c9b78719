//! KV transports: move one request's KV cache (a set of blobs described by a
//! [`KvHandle`]) from a prefill worker to a decode worker.
//!
//! - [`KvTransport`]: the trait every transport implements (`push`, `pull`,
//!   `release`, and `reserve` where a producer can write in place: `shm`).
//! - [`registry`]: transports selected by name (`AIRM_KV_TRANSPORT`, default `shm`),
//!   configured by [`TransportConfig`].
//! - [`shm`]: files in `/dev/shm`, published by rename and mapped with memmap2.
//! - [`tcp`]: a client of the relay server ([`relay`], `rngd-pd relay`); [`frame`]
//!   is the relay's binary protocol, which both ends build on.
//! - `nixl`: the `nixl-ucx` transport (NIXL over UCX, one-sided READ of a
//!   registered arena, descriptors through the relay); with the `nixl` feature.
//! - [`nixl_route`]: the `nixl` transport (RNGD → ATOM over NIXL's HETERO_NPU
//!   backend): its route table as a plan step; the name is known, and this
//!   build refuses to create it ([`KvError::NotInThisBuild`]).
//! - `fake`: an in-memory transport for other crates' tests, and
//!   `conformance`: the behaviour suite every transport must pass; both only
//!   with the `test-util` feature.
//!
//! The wire format is described in `docs/kv-wire.md`.

use std::time::Duration;

use bytes::Bytes;
pub use rngd_kv_wire::{KvHandle, KvLayout, KvSink, SinkShape, WireError};

pub mod config;
#[cfg(feature = "test-util")]
pub mod conformance;
#[cfg(feature = "test-util")]
pub mod fake;
pub mod frame;
#[cfg(feature = "nixl")]
pub mod nixl;
pub mod nixl_route;
pub mod registry;
pub mod relay;
pub mod shm;
pub mod tcp;

pub use config::TransportConfig;

/// Errors of the KV transports. Each names the transport; callers map the
/// variants to statuses (see the variant docs).
#[derive(Debug, thiserror::Error)]
pub enum KvError {
    /// The request's cache did not show up in time, or the transport does not
    /// hold it (never pushed, already released, or expired). Maps to 504
    /// after a wait ([`KvTransport::pull`]), to 410 at once for published
    /// KV that is gone ([`KvTransport::pull_published`]).
    #[error(
        "transport `{transport}`: KV cache of request `{request_id}` not found within {waited:?}"
    )]
    NotFound {
        /// Transport name.
        transport: &'static str,
        /// Request id as given by the caller.
        request_id: String,
        /// How long the pull waited.
        waited: Duration,
    },
    /// A blob's bytes do not match the size or CRC-32 recorded for it. Maps to 502.
    #[error("transport `{transport}`: KV cache of request `{request_id}` is corrupt")]
    Crc {
        /// Transport name.
        transport: &'static str,
        /// Request id.
        request_id: String,
        /// Which blob and which check failed.
        #[source]
        source: WireError,
    },
    /// A local I/O operation failed. Maps to 500.
    #[error("transport `{transport}`: {context}")]
    Io {
        /// Transport name.
        transport: &'static str,
        /// What was being done (with the path).
        context: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The peer (relay) went away, could not be reached, or restarted and lost
    /// the cache. Maps to 502/503.
    #[error("transport `{transport}`: connection to {peer} lost: {detail}")]
    ConnectionLost {
        /// Transport name.
        transport: &'static str,
        /// Address of the peer.
        peer: String,
        /// What happened.
        detail: String,
        /// The socket error, if any.
        #[source]
        source: Option<std::io::Error>,
    },
    /// No room: the relay's memory cap, or a full disk (ENOSPC). Maps to 507/503.
    #[error("transport `{transport}`: out of capacity: {detail}")]
    Capacity {
        /// Transport name.
        transport: &'static str,
        /// Which limit was hit.
        detail: String,
        /// The OS error (ENOSPC), if any.
        #[source]
        source: Option<std::io::Error>,
    },
    /// The caller passed something unusable (empty id, foreign handle, wrong
    /// blob count, oversize blob). Maps to 400.
    #[error("transport `{transport}`: bad request: {detail}")]
    BadRequest {
        /// Transport name.
        transport: &'static str,
        /// What is wrong.
        detail: String,
    },
    /// The peer spoke something that is not the relay protocol. Maps to 502.
    #[error("transport `{transport}`: protocol error from {peer}: {detail}")]
    Protocol {
        /// Transport name.
        transport: &'static str,
        /// Address of the peer.
        peer: String,
        /// What was wrong.
        detail: String,
    },
    /// The relay and this client do not share the secret: the relay refused
    /// the handshake, or did not prove the secret itself. Maps to 502.
    #[error("transport `{transport}`: authentication with {peer} failed: {detail}")]
    Unauthorized {
        /// Transport name.
        transport: &'static str,
        /// Address of the peer.
        peer: String,
        /// What failed (never the secret).
        detail: String,
    },
    /// The peer did not answer within the operation's deadline (a stalled
    /// or black-holed relay). Maps to 504.
    #[error("transport `{transport}`: {peer} did not answer the {op} within {after:?}")]
    Timeout {
        /// Transport name.
        transport: &'static str,
        /// Address of the peer.
        peer: String,
        /// What was waiting (`push`, `pull`, `release`, `handshake`, …).
        op: &'static str,
        /// The deadline that passed.
        after: Duration,
    },
    /// A transport name the registry does not know.
    #[error("unknown KV transport `{name}`; known transports: {known}")]
    UnknownTransport {
        /// The name asked for.
        name: String,
        /// Comma-separated list of [`registry::KNOWN`].
        known: String,
    },
    /// A transport name this build knows but cannot run (`nixl`: it needs
    /// NPUs and a NIXL backend this build lacks). A worker asked for it
    /// refuses to start; a request naming it is refused (400).
    #[error(
        "KV transport `{transport}` is known, but this build cannot move bytes over it: {detail}"
    )]
    NotInThisBuild {
        /// Transport name.
        transport: &'static str,
        /// What it would need and why this build does not have it.
        detail: String,
    },
    /// A configuration value (environment variable or flag) is invalid.
    #[error("invalid KV transport configuration: {detail}")]
    Config {
        /// Which value and why.
        detail: String,
    },
}

impl KvError {
    /// The transport the error came from, if it is tied to one.
    pub fn transport(&self) -> Option<&'static str> {
        match self {
            KvError::NotFound { transport, .. }
            | KvError::Crc { transport, .. }
            | KvError::Io { transport, .. }
            | KvError::ConnectionLost { transport, .. }
            | KvError::Capacity { transport, .. }
            | KvError::BadRequest { transport, .. }
            | KvError::Protocol { transport, .. }
            | KvError::Unauthorized { transport, .. }
            | KvError::Timeout { transport, .. }
            | KvError::NotInThisBuild { transport, .. } => Some(transport),
            KvError::UnknownTransport { .. } | KvError::Config { .. } => None,
        }
    }
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
    /// Wire version of the blobs (`rngd_kv_wire::WIRE_FULL` or
    /// `WIRE_TRIMMED`), carried into the handle; transports move the bytes
    /// as they are.
    pub wire: u32,
    /// The blobs, normally `layout.blob_count()` of them (transports move any count).
    pub blobs: Vec<Bytes>,
}

/// Room a transport made for one request's blobs ([`KvTransport::reserve`]):
/// the producer writes every blob through `sink` and drops it; then `slot`
/// publishes them. Dropping either before publishing frees the room and
/// publishes nothing.
pub struct Reserved {
    /// Where the blobs are written.
    pub sink: Box<dyn KvSink>,
    /// What publishes them.
    pub slot: Box<dyn KvSlot>,
}

impl std::fmt::Debug for Reserved {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reserved")
            .field("shape", &self.sink.shape())
            .finish_non_exhaustive()
    }
}

/// The publishing half of a [`Reserved`] room.
#[async_trait::async_trait]
pub trait KvSlot: Send {
    /// Publishes the blobs written through the room's sink, which must be
    /// gone (dropped) with every blob sealed; returns the handle the other
    /// side pulls with. An unfinished room is refused and freed.
    async fn publish(self: Box<Self>) -> Result<KvHandle, KvError>;
}

/// A KV transport.
#[async_trait::async_trait]
pub trait KvTransport: Send + Sync + 'static {
    /// Registry name (`shm`, `tcp`, `nixl-ucx`; `nixl` is known but never created).
    fn name(&self) -> &'static str;
    /// Publishes the blobs; returns the handle the other side pulls with.
    async fn push(&self, payload: KvPayload) -> Result<KvHandle, KvError>;
    /// Makes room for the blobs of `shape` under `request_id` that a
    /// producer writes in place ([`Reserved`]): the one-copy path. `None`:
    /// this transport has no such room (the default), so the producer makes
    /// blobs and [`KvTransport::push`]es them.
    async fn reserve(
        &self,
        request_id: &str,
        shape: SinkShape,
    ) -> Result<Option<Reserved>, KvError> {
        let _ = (request_id, shape);
        Ok(None)
    }
    /// Fetches and verifies (CRC-32) every blob of `handle`, waiting at most
    /// `timeout` (for KV that is not there yet, too).
    async fn pull(&self, handle: &KvHandle, timeout: Duration) -> Result<Vec<Bytes>, KvError>;
    /// [`KvTransport::pull`] of a handle whose KV was published before the
    /// handle was handed out (the PD protocol's decode: a prefill worker
    /// answers only after its push): KV the transport does not hold now is
    /// gone (released, expired, taken by another decode) and is refused at
    /// once with [`KvError::NotFound`], nothing waited for; `timeout`
    /// bounds the transfer.
    async fn pull_published(
        &self,
        handle: &KvHandle,
        timeout: Duration,
    ) -> Result<Vec<Bytes>, KvError>;
    /// Frees whatever the transport holds for `handle`. Idempotent.
    async fn release(&self, handle: &KvHandle) -> Result<(), KvError>;
    /// Stranded KV this transport sees, bytes: published, claimed by no
    /// decode (neither pulled nor released) and older than the claim window
    /// ([`TransportConfig::claim_window`]), as of its last sweep; it stays
    /// until the TTL frees it. `None` (the default): this transport does not
    /// hold such KV itself (`tcp`: the relay holds it and shows it as
    /// `rngd_pd_relay_stranded_bytes`).
    fn stranded_bytes(&self) -> Option<u64> {
        None
    }
}

/// Longest key a transport uses for a request id (bytes).
pub const MAX_KEY_LEN: usize = 128;

/// Turns a request id into a key that is safe as a file name or relay key:
/// only `[A-Za-z0-9._-]`, no leading `.`, at most [`MAX_KEY_LEN`] bytes. An id
/// that had to be changed gets its CRC-32 appended so that distinct ids stay
/// distinct (`a/b` and `a_b` map to different keys). An empty id is rejected.
pub fn sanitize_key(transport: &'static str, request_id: &str) -> Result<String, KvError> {
    if request_id.is_empty() {
        return Err(KvError::BadRequest {
            transport,
            detail: "empty request id".into(),
        });
    }
    let mut key: String = request_id
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.' {
                c
            } else {
                '_'
            }
        })
        .collect();
    if key.starts_with('.') {
        key.replace_range(0..1, "_");
    }
    let changed = key != request_id || key.len() > MAX_KEY_LEN;
    if changed {
        let tag = format!("~{:08x}", rngd_kv_wire::crc32(request_id.as_bytes()));
        key.truncate(MAX_KEY_LEN - tag.len());
        key.push_str(&tag);
    }
    Ok(key)
}

/// Checks a handle against the transport that is asked to pull or release it.
pub(crate) fn check_handle(transport: &'static str, handle: &KvHandle) -> Result<(), KvError> {
    if handle.transport != transport {
        return Err(KvError::BadRequest {
            transport,
            detail: format!(
                "handle of request `{}` belongs to transport `{}`",
                handle.request_id, handle.transport
            ),
        });
    }
    Ok(())
}

/// Verifies every blob against the handle's table (count, sizes, CRC-32).
pub(crate) fn verify_all(
    transport: &'static str,
    handle: &KvHandle,
    blobs: &[Bytes],
) -> Result<(), KvError> {
    if blobs.len() != handle.blobs.len() {
        return Err(KvError::Crc {
            transport,
            request_id: handle.request_id.clone(),
            source: WireError::BlobCount {
                expected: handle.blobs.len(),
                actual: blobs.len(),
            },
        });
    }
    for (i, b) in blobs.iter().enumerate() {
        handle.verify(i, b).map_err(|source| KvError::Crc {
            transport,
            request_id: handle.request_id.clone(),
            source,
        })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_sanitized_and_distinct() {
        assert_eq!(sanitize_key("shm", "req-1.a_b").unwrap(), "req-1.a_b");
        let a = sanitize_key("shm", "a/b").unwrap();
        let b = sanitize_key("shm", "a_b").unwrap();
        assert_ne!(a, b);
        assert!(!a.contains('/'));
        let dots = sanitize_key("shm", "../../etc/passwd").unwrap();
        assert!(!dots.contains('/') && !dots.starts_with('.'), "{dots}");
        let long = sanitize_key("shm", &"x".repeat(1000)).unwrap();
        assert!(long.len() <= MAX_KEY_LEN);
        assert_ne!(long, sanitize_key("shm", &"x".repeat(999)).unwrap());
        assert!(matches!(
            sanitize_key("shm", ""),
            Err(KvError::BadRequest { .. })
        ));
    }
}
