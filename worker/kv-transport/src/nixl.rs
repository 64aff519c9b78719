//! The `nixl-ucx` transport: NIXL over UCX, one-sided READ, descriptors
//! through the KV relay.
//!
//! Each transport (one per worker process) has one NIXL agent with the UCX
//! backend and one host arena (`AIRM_KV_UCX_POOL_MB`, default 1024 MiB),
//! registered once ([`agent`], [`arena`]). The runtime is found and loaded by
//! [`runtime`].
//!
//! - push copies the blobs back to back into a slot (an extent of the arena),
//!   computing each blob's CRC-32, and publishes a [`descriptor::Descriptor`]
//!   (agent name and metadata, slot address and length, CRC-32 per blob) in
//!   the relay at `AIRM_KV_TCP_ADDR` (the `tcp` transport's client, with its
//!   secret, pool and deadlines) under `nixl.<key>`. The handle's location
//!   carries the descriptor's SHA-256, so the signature over the handle covers
//!   the descriptor.
//! - pull fetches the descriptor (waiting for it up to the timeout), checks
//!   it against the handle, loads the prefill agent's metadata, READs the slot
//!   into an extent of its own arena, waits for completion with a deadline,
//!   copies the blobs out and checks every CRC-32 against the handle. The
//!   READ carries a notification that frees the prefill slot.
//! - release frees the caller's own slot of the request (prefill side) and
//!   deletes the descriptor from the relay.
//!
//! A slot is freed by the READ's notification, by release, after
//! `AIRM_KV_TCP_TTL_S` unread (the housekeeping thread), or with the
//! transport (shutdown). Slots unread and unreleased for longer than the
//! claim window (`AIRM_KV_CLAIM_WINDOW_S`, at most the TTL) are summed by
//! the same thread as stranded bytes ([`KvTransport::stranded_bytes`]); the
//! descriptors in the relay are the relay's `rngd_pd_relay_stranded_bytes`. A pull cancelled mid-READ parks its extent for
//! [`QUARANTINE`] before reuse. Failures are errors naming `nixl-ucx`; nothing
//! falls back to another transport. `AIRM_KV_UCX_LOG=1` logs size and SHA-256
//! of every blob.

pub mod agent;
pub mod arena;
pub mod descriptor;
mod housekeeping;
mod relay_errors;
pub mod runtime;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use ring::rand::{SecureRandom, SystemRandom};
use rngd_kv_wire::{BlobMeta, KvHandle, WireError};
use sha2::{Digest, Sha256};

use crate::tcp::TcpTransport;
use crate::{
    KvError, KvPayload, KvTransport, TransportConfig, check_handle, sanitize_key, verify_all,
};
use agent::Agent;
use arena::{Arena, Extent};
use descriptor::{Descriptor, Location};
use housekeeping::housekeeping;
use relay_errors::rename;

/// Registry name.
pub const NAME: &str = "nixl-ucx";
/// A READ may take at least this long, whatever is left of the pull's timeout.
pub const READ_MIN: Duration = Duration::from_secs(5);
/// How long the extent of a READ cancelled in flight stays unused.
pub const QUARANTINE: Duration = Duration::from_secs(1);
/// How often the housekeeping thread looks for notifications.
const POLL: Duration = Duration::from_millis(1);

/// The `nixl-ucx` transport. Cheap to clone; clones share the agent and arena.
#[derive(Clone)]
pub struct NixlUcxTransport {
    inner: Arc<Inner>,
}

struct Inner {
    agent: Agent,
    relay: TcpTransport,
    ttl: Duration,
    /// A slot unclaimed this long counts as stranded.
    claim_window: Duration,
    /// Bytes of slots older than the claim window, as of the last sweep.
    stranded: AtomicU64,
    log: bool,
    /// Published slots by key.
    slots: Mutex<HashMap<String, Slot>>,
    /// Extents of READs cancelled in flight, with when they may be reused.
    quarantine: Mutex<Vec<(Instant, Extent)>>,
    /// READs in progress.
    reading: AtomicUsize,
    next_slot: AtomicU64,
    stop: AtomicBool,
}

struct Slot {
    id: u64,
    nonce: u64,
    expires: Instant,
    /// When it was published.
    published: Instant,
    /// The request's bytes.
    bytes: u64,
    /// `None` for a request of zero bytes.
    _extent: Option<Extent>,
}

impl std::fmt::Debug for NixlUcxTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NixlUcxTransport")
            .field("agent", &self.inner.agent)
            .field("relay", &self.inner.relay.addr())
            .finish_non_exhaustive()
    }
}

fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    // The system RNG failing is not recoverable.
    SystemRandom::new()
        .fill(&mut b)
        .expect("the system random number generator works");
    u64::from_le_bytes(b)
}

fn io_err(context: String, e: impl std::error::Error + Send + Sync + 'static) -> KvError {
    KvError::Io {
        transport: NAME,
        context,
        source: std::io::Error::other(e),
    }
}

/// Logs size and SHA-256 of a blob (`AIRM_KV_UCX_LOG=1`).
fn log_blob(dir: &str, request_id: &str, index: usize, blob: &[u8]) {
    let hex = descriptor::hex(&Sha256::digest(blob));
    tracing::info!(dir, request_id, index, bytes = blob.len(), sha256 = %hex, "nixl-ucx: KV blob");
}

fn agent_name() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "host".into());
    format!(
        "rngd-kv-{host}-{}-{:08x}",
        std::process::id(),
        random_u64() as u32
    )
}

// === impl NixlUcxTransport ===

impl NixlUcxTransport {
    /// Creates the transport: loads the NIXL runtime, maps and registers the
    /// arena, starts the agent; descriptors go through the relay at
    /// `cfg.tcp_addr` (`AIRM_KV_TCP_ADDR`, required) with `cfg.tcp_secret`.
    pub fn new(cfg: &TransportConfig) -> Result<Self, KvError> {
        let addr = cfg.tcp_addr.clone().ok_or_else(|| KvError::Config {
            detail: format!(
                "transport `nixl-ucx` publishes its descriptors through the KV relay: set {}",
                rngd_api::env::AIRM_KV_TCP_ADDR
            ),
        })?;
        Self::with_relay(addr, cfg)
    }

    /// As [`NixlUcxTransport::new`], with the relay at `addr`.
    pub fn with_relay(addr: impl Into<String>, cfg: &TransportConfig) -> Result<Self, KvError> {
        runtime::load(cfg)?;
        let bytes = cfg.ucx_pool_mb << 20;
        let arena = Arena::new(bytes).map_err(|source| KvError::Io {
            transport: NAME,
            context: format!("mapping the {} MiB arena", cfg.ucx_pool_mb),
            source,
        })?;
        let name = agent_name();
        let agent = Agent::new(&name, arena)
            .map_err(|e| io_err(format!("starting NIXL agent {name} (UCX backend)"), e))?;
        tracing::info!(agent = %name, arena_mb = cfg.ucx_pool_mb, "nixl-ucx: agent ready");
        let inner = Arc::new(Inner {
            agent,
            relay: TcpTransport::connect_to(addr, cfg),
            ttl: cfg.tcp_ttl,
            claim_window: cfg.claim_window_for(cfg.tcp_ttl),
            stranded: AtomicU64::new(0),
            log: cfg.ucx_log,
            slots: Mutex::new(HashMap::new()),
            quarantine: Mutex::new(Vec::new()),
            reading: AtomicUsize::new(0),
            next_slot: AtomicU64::new(1),
            stop: AtomicBool::new(false),
        });
        let weak = Arc::downgrade(&inner);
        std::thread::Builder::new()
            .name("nixl-ucx".into())
            .spawn(move || housekeeping(weak))
            .map_err(|source| KvError::Io {
                transport: NAME,
                context: "starting the housekeeping thread".into(),
                source,
            })?;
        Ok(NixlUcxTransport { inner })
    }

    /// This transport's NIXL agent.
    pub fn agent(&self) -> &Agent {
        &self.inner.agent
    }

    /// The relay client the descriptors go through.
    pub fn relay(&self) -> &TcpTransport {
        &self.inner.relay
    }

    /// What this transport holds: published slots, READs in progress and
    /// extents in quarantine. Zero means nothing leaked.
    pub fn held(&self) -> usize {
        let i = &self.inner;
        lock(&i.slots).len() + i.reading.load(Ordering::SeqCst) + lock(&i.quarantine).len()
    }

    /// Published slots (requests pushed and not yet read, released or expired).
    pub fn slots(&self) -> usize {
        lock(&self.inner.slots).len()
    }

    /// Flips one byte of blob `index` of the slot holding `handle` (tests:
    /// a corrupted slot). `false` if this transport holds no such slot.
    #[cfg(feature = "test-util")]
    pub fn corrupt_slot(&self, handle: &KvHandle, index: usize) -> bool {
        let Ok(key) = sanitize_key(NAME, &handle.request_id) else {
            return false;
        };
        let mut slots = lock(&self.inner.slots);
        let Some(Slot {
            _extent: Some(e), ..
        }) = slots.get_mut(&key)
        else {
            return false;
        };
        let at: u64 = handle.blobs[..index].iter().map(|b| b.len).sum();
        let len = handle.blobs[index].len;
        if len == 0 {
            return false;
        }
        e.flip((at + len / 2) as usize);
        true
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        let n = lock(&self.slots).len();
        if n > 0 {
            tracing::info!(
                slots = n,
                "nixl-ucx: shutting down with unread slots; freed"
            );
        }
    }
}

/// A READ in flight: on drop before completion the request is released
/// (cancelled) and the extent quarantined.
struct Read<'a> {
    inner: &'a Inner,
    req: Option<nixl_sys::XferRequest>,
    dest: Option<Extent>,
}

impl Drop for Read<'_> {
    fn drop(&mut self) {
        drop(self.req.take());
        if let Some(e) = self.dest.take() {
            lock(&self.inner.quarantine).push((Instant::now() + QUARANTINE, e));
        }
        self.inner.reading.fetch_sub(1, Ordering::SeqCst);
    }
}

fn relay_id(request_id: &str) -> String {
    format!("{}{request_id}", descriptor::RELAY_PREFIX)
}

#[async_trait::async_trait]
impl KvTransport for NixlUcxTransport {
    fn name(&self) -> &'static str {
        NAME
    }

    #[tracing::instrument(name = "kv.push", skip_all, fields(transport = NAME, request_id = %payload.request_id, blobs = payload.blobs.len()))]
    async fn push(&self, payload: KvPayload) -> Result<KvHandle, KvError> {
        let i = &self.inner;
        let key = sanitize_key(NAME, &payload.request_id)?;
        let total: usize = payload.blobs.iter().map(|b| b.len()).sum();
        let mut extent = if total > 0 {
            Some(i.agent.arena.alloc(total).ok_or_else(|| KvError::Capacity {
                transport: NAME,
                detail: format!(
                    "the {} MiB arena has no free range of {total} bytes ({} bytes free in all; AIRM_KV_UCX_POOL_MB)",
                    i.agent.arena.len() >> 20,
                    i.agent.arena.free_bytes()
                ),
                source: None,
            })?)
        } else {
            None
        };
        let mut metas = Vec::with_capacity(payload.blobs.len());
        let mut at = 0;
        for (n, b) in payload.blobs.iter().enumerate() {
            // One pass per blob: copied and checksummed chunk by chunk.
            let crc32 = match extent.as_mut() {
                Some(e) => e.write_crc(at, b),
                None => rngd_kv_wire::crc32(b),
            };
            at += b.len();
            metas.push(BlobMeta {
                len: b.len() as u64,
                crc32,
            });
            if i.log {
                log_blob("push", &payload.request_id, n, b);
            }
        }
        let (id, nonce) = (i.next_slot.fetch_add(1, Ordering::Relaxed), random_u64());
        let desc = Descriptor {
            v: descriptor::VERSION,
            agent: i.agent.name.clone(),
            metadata: descriptor::hex(&i.agent.metadata),
            addr: extent.as_ref().map_or(0, |e| e.addr() as u64),
            len: total as u64,
            slot: id,
            nonce,
            blobs: metas.clone(),
        };
        let desc_bytes = serde_json::to_vec(&desc).expect("a descriptor serializes");
        let sha256 = descriptor::sha256_hex(&desc_bytes);
        lock(&i.slots).insert(
            key.clone(),
            Slot {
                id,
                nonce,
                expires: Instant::now() + i.ttl,
                published: Instant::now(),
                bytes: total as u64,
                _extent: extent,
            },
        );
        let published = i
            .relay
            .push(KvPayload {
                request_id: relay_id(&payload.request_id),
                layout: payload.layout,
                tokens: payload.tokens,
                wire: payload.wire,
                blobs: vec![Bytes::from(desc_bytes)],
            })
            .await;
        let published = match published {
            Ok(h) => h,
            Err(e) => {
                i.free_slot(&key, Some((id, nonce)), "push failed");
                return Err(rename(e, &payload.request_id));
            }
        };
        let loc = Location {
            relay: published.location,
            len: published.blobs[0].len,
            crc32: published.blobs[0].crc32,
            sha256,
        };
        Ok(KvHandle {
            request_id: payload.request_id,
            transport: NAME.into(),
            location: loc.encode(),
            layout: payload.layout,
            tokens: payload.tokens,
            wire: payload.wire,
            blobs: metas,
        })
    }

    #[tracing::instrument(name = "kv.pull", skip_all, fields(transport = NAME, request_id = %handle.request_id, bytes = handle.total_bytes()))]
    async fn pull(&self, handle: &KvHandle, timeout: Duration) -> Result<Vec<Bytes>, KvError> {
        self.pull_within(handle, timeout, timeout).await
    }

    async fn pull_published(
        &self,
        handle: &KvHandle,
        timeout: Duration,
    ) -> Result<Vec<Bytes>, KvError> {
        // The descriptor is on the relay before the handle exists: one that
        // is gone now is not waited for.
        self.pull_within(handle, Duration::ZERO, timeout).await
    }

    fn stranded_bytes(&self) -> Option<u64> {
        Some(self.inner.stranded.load(Ordering::Relaxed))
    }

    #[tracing::instrument(name = "kv.release", skip_all, fields(transport = NAME, request_id = %handle.request_id))]
    async fn release(&self, handle: &KvHandle) -> Result<(), KvError> {
        check_handle(NAME, handle)?;
        let key = sanitize_key(NAME, &handle.request_id)?;
        self.inner.free_slot(&key, None, "release");
        let relay = Location::parse(&handle.location)
            .map(|l| l.relay)
            .unwrap_or_default();
        let relay_handle = KvHandle {
            request_id: relay_id(&handle.request_id),
            transport: crate::tcp::NAME.into(),
            location: relay,
            layout: handle.layout,
            tokens: handle.tokens,
            wire: handle.wire,
            blobs: Vec::new(),
        };
        self.inner
            .relay
            .release(&relay_handle)
            .await
            .map_err(|e| rename(e, &handle.request_id))
    }
}

// === impl NixlUcxTransport (pull) ===

impl NixlUcxTransport {
    /// Pulls `handle`'s blobs: the descriptor is waited for on the relay at
    /// most `appear`; `timeout` bounds the pull.
    async fn pull_within(
        &self,
        handle: &KvHandle,
        appear: Duration,
        timeout: Duration,
    ) -> Result<Vec<Bytes>, KvError> {
        check_handle(NAME, handle)?;
        let key = sanitize_key(NAME, &handle.request_id)?;
        let i = &self.inner;
        let loc = Location::parse(&handle.location).ok_or_else(|| KvError::BadRequest {
            transport: NAME,
            detail: format!("location {:?} is not a nixl-ucx location", handle.location),
        })?;
        let started = Instant::now();
        let relay_handle = KvHandle {
            request_id: relay_id(&handle.request_id),
            transport: crate::tcp::NAME.into(),
            location: loc.relay.clone(),
            layout: handle.layout,
            tokens: handle.tokens,
            wire: handle.wire,
            blobs: vec![BlobMeta {
                len: loc.len,
                crc32: loc.crc32,
            }],
        };
        let desc_bytes = i
            .relay
            .pull_within(&relay_handle, appear, timeout)
            .await
            .map_err(|e| rename(e, &handle.request_id))?
            .pop()
            .unwrap_or_default();
        let protocol = |detail: String| KvError::Protocol {
            transport: NAME,
            peer: i.relay.addr().to_string(),
            detail,
        };
        if descriptor::sha256_hex(&desc_bytes) != loc.sha256 {
            return Err(protocol(format!(
                "the descriptor of request `{}` is not the one the signed handle names",
                handle.request_id
            )));
        }
        let desc: Descriptor = serde_json::from_slice(&desc_bytes)
            .map_err(|e| protocol(format!("bad descriptor: {e}")))?;
        if desc.v != descriptor::VERSION {
            return Err(protocol(format!("descriptor version {}", desc.v)));
        }
        // Sizes must agree; the bytes are checked against the handle's CRCs.
        let sizes = |b: &[BlobMeta]| b.iter().map(|m| m.len).collect::<Vec<_>>();
        if sizes(&desc.blobs) != sizes(&handle.blobs) || desc.len != handle.total_bytes() {
            return Err(KvError::Crc {
                transport: NAME,
                request_id: handle.request_id.clone(),
                source: WireError::BlobCount {
                    expected: handle.blobs.len(),
                    actual: desc.blobs.len(),
                },
            });
        }
        let len = desc.len as usize;
        if len == 0 {
            let blobs = vec![Bytes::new(); handle.blobs.len()];
            verify_all(NAME, handle, &blobs)?;
            return Ok(blobs);
        }
        let peer_lost = |detail: String| KvError::ConnectionLost {
            transport: NAME,
            peer: desc.agent.clone(),
            detail,
            source: None,
        };
        let md = descriptor::unhex(&desc.metadata)
            .ok_or_else(|| protocol("descriptor metadata is not hex".into()))?;
        i.agent
            .ensure_remote(&desc.agent, &md)
            .map_err(|e| peer_lost(format!("loading the prefill agent's metadata: {e}")))?;
        let dest = i.agent.arena.alloc(len).ok_or_else(|| KvError::Capacity {
            transport: NAME,
            detail: format!(
                "the {} MiB arena has no free range of {len} bytes to READ into (AIRM_KV_UCX_POOL_MB)",
                i.agent.arena.len() >> 20
            ),
            source: None,
        })?;
        i.reading.fetch_add(1, Ordering::SeqCst);
        let mut read = Read {
            inner: i,
            req: None,
            dest: Some(dest),
        };
        let dest_addr = read.dest.as_ref().map_or(0, Extent::addr);
        let notif = descriptor::free_notif(&key, desc.slot, desc.nonce);
        let req = i
            .agent
            .post_read(
                &desc.agent,
                desc.addr as usize,
                dest_addr,
                len,
                notif.as_bytes(),
            )
            .map_err(|e| {
                i.agent.forget_remote(&desc.agent);
                peer_lost(format!("posting the READ: {e}"))
            })?;
        read.req = Some(req);
        let posted = Instant::now();
        let budget = timeout.saturating_sub(started.elapsed()).max(READ_MIN);
        let deadline = Instant::now() + budget;
        let mut spins = 0u32;
        loop {
            let req = read.req.as_ref().expect("posted");
            match i.agent.done(req) {
                Ok(true) => break,
                Ok(false) => {}
                Err(e) => {
                    i.agent.forget_remote(&desc.agent);
                    return Err(peer_lost(format!("the READ failed: {e}")));
                }
            }
            if Instant::now() >= deadline {
                i.agent.forget_remote(&desc.agent);
                return Err(KvError::Timeout {
                    transport: NAME,
                    peer: desc.agent.clone(),
                    op: "READ",
                    after: budget,
                });
            }
            // How often this polls does not change how long the READ takes
            // (measured with UCX over TCP: bench/README.md, kv).
            spins += 1;
            if spins <= 64 {
                tokio::task::yield_now().await;
            } else {
                tokio::time::sleep(Duration::from_micros(200)).await;
            }
        }
        let read_done = Instant::now();
        drop(read.req.take());
        let dest = read.dest.take().expect("the extent is there");
        drop(read);
        // One pass per blob: copied out and checked against the handle's
        // CRC-32 chunk by chunk (sizes are the handle's, checked above).
        let mut blobs = Vec::with_capacity(handle.blobs.len());
        let mut at = 0;
        for (index, m) in handle.blobs.iter().enumerate() {
            let (blob, actual) = dest.read_crc(at, m.len as usize);
            if actual != m.crc32 {
                return Err(KvError::Crc {
                    transport: NAME,
                    request_id: handle.request_id.clone(),
                    source: WireError::Crc {
                        index,
                        expected: m.crc32,
                        actual,
                    },
                });
            }
            blobs.push(blob);
            at += m.len as usize;
        }
        drop(dest);
        if i.log {
            for (n, b) in blobs.iter().enumerate() {
                log_blob("pull", &handle.request_id, n, b);
            }
        }
        let ms = |a: Instant, b: Instant| (b - a).as_secs_f64() * 1e3;
        let now = Instant::now();
        tracing::debug!(
            request_id = %handle.request_id,
            bytes = len,
            ms = ms(started, now),
            descriptor_ms = ms(started, posted),
            read_ms = ms(posted, read_done),
            polls = spins,
            copy_crc_ms = ms(read_done, now),
            "nixl-ucx: pulled"
        );
        Ok(blobs)
    }
}
