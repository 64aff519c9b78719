//! The `shm` transport's one-copy path ([`KvTransport::reserve`]): a room is
//! a slot of this process's [`Arena`]; the producer writes the wire bytes
//! straight into it and seals each blob with its CRC-32 ([`ShmSink`]); the
//! slot ([`ShmSlot`]) then publishes the pointer file `<key>.kv` (header
//! version 2: arena, slot, generation, blob sizes and checksums) exactly as
//! a push publishes its file. A room dropped unpublished frees its slot.
//! The reader's half is [`load_slot`] and [`release_slot`].
//!
//! [`KvTransport::reserve`]: crate::KvTransport::reserve

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use bytes::Bytes;
use rngd_kv_wire::{BlobMeta, KvHandle, KvSink, SinkShape};

use super::arena::{Arena, Lease};
use super::{Inner, MAGIC, NAME, corrupt_at, io_err};
use crate::{KvError, KvSlot, Reserved};

/// Header version of a pointer file (a request held in an arena slot).
pub(super) const POINTER_VERSION: u32 = 2;
/// Largest pointer file a reader reads.
const MAX_POINTER: u64 = 64 * 1024;

/// What the sink tells the slot.
#[derive(Debug)]
struct Seals {
    /// The CRC-32 of each blob, once sealed.
    crcs: Vec<Option<u32>>,
    /// The sink still exists (it may still write).
    sink_live: bool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The writing half of a reserved slot.
pub struct ShmSink {
    arena: Arc<Arena>,
    slot: usize,
    blob: usize,
    shape: SinkShape,
    seals: Arc<Mutex<Seals>>,
}

impl std::fmt::Debug for ShmSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmSink")
            .field("slot", &self.slot)
            .field("shape", &self.shape)
            .finish_non_exhaustive()
    }
}

impl KvSink for ShmSink {
    fn shape(&self) -> SinkShape {
        self.shape
    }

    fn blob_mut(&mut self, i: usize) -> &mut [u8] {
        assert!(i < self.shape.layout.blob_count(), "blob {i} out of range");
        // SAFETY: the slot is `WRITING`, held by this sink alone (taken by
        // compare-and-swap; no reader claims a slot before it is `READY`);
        // blobs `0..count` of `blob` bytes fit the slot (checked at reserve),
        // the pages are allocated (`Arena::take`), and the mapping lives as
        // long as the `Arc<Arena>` held here; `&mut self` keeps the slices
        // from overlapping in time.
        unsafe {
            std::slice::from_raw_parts_mut(
                self.arena.slot_ptr(self.slot).add(i * self.blob),
                self.blob,
            )
        }
    }

    fn seal(&mut self, i: usize, crc: u32) {
        lock(&self.seals).crcs[i] = Some(crc);
    }
}

impl Drop for ShmSink {
    fn drop(&mut self) {
        lock(&self.seals).sink_live = false;
    }
}

/// The publishing half of a reserved slot.
pub struct ShmSlot {
    inner: Arc<Inner>,
    arena: Arc<Arena>,
    slot: usize,
    generation: u64,
    request_id: String,
    key: String,
    shape: SinkShape,
    seals: Arc<Mutex<Seals>>,
    published: bool,
}

impl std::fmt::Debug for ShmSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmSlot")
            .field("request_id", &self.request_id)
            .field("slot", &self.slot)
            .finish_non_exhaustive()
    }
}

/// The owner's arena for requests of up to `bytes`, made on first use (and
/// again if its file was removed). `None`: the arena's slots are smaller.
fn arena_for(inner: &Inner, bytes: usize, full: usize) -> Result<Option<Arc<Arena>>, KvError> {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let mut held = lock(&inner.arena);
    if let Some(a) = held.as_ref().filter(|a| a.is_current()) {
        return Ok((bytes <= a.slot_bytes()).then(|| a.clone()));
    }
    let name = format!(
        "arena.{}.{}.{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed),
        super::arena::ARENA_EXT
    );
    let a = Arc::new(Arena::create(
        &inner.root,
        name,
        inner.slots,
        full.max(bytes),
    )?);
    tracing::info!(
        arena = a.name(),
        slots = a.slots(),
        slot_bytes = a.slot_bytes(),
        "shm: slot arena made"
    );
    *held = Some(a.clone());
    Ok(Some(a))
}

/// Reserves a slot for `shape` under `key` (blocking). `None`: no arena
/// (`slots` = 0), no free slot, no room for the slot's pages, or a request
/// larger than a slot; the caller pushes instead.
pub(super) fn reserve(
    inner: &Arc<Inner>,
    request_id: String,
    key: String,
    shape: SinkShape,
) -> Result<Option<Reserved>, KvError> {
    if inner.slots == 0 {
        return Ok(None);
    }
    let bad = |detail: String| KvError::BadRequest {
        transport: NAME,
        detail,
    };
    let blob = shape
        .blob_bytes()
        .map_err(|e| bad(format!("cannot reserve for request `{request_id}`: {e}")))?;
    let count = shape.layout.blob_count();
    let bytes = blob.checked_mul(count).filter(|&t| t > 0).ok_or_else(|| {
        bad(format!(
            "cannot reserve {count} blobs of {blob} bytes for request `{request_id}`"
        ))
    })?;
    let Some(arena) = arena_for(inner, bytes, shape.layout.request_bytes())? else {
        tracing::debug!(bytes, "shm: request larger than a slot; pushing instead");
        return Ok(None);
    };
    let (slot, generation) = match arena.take(bytes, inner.writer.as_ref()) {
        Ok(Some(taken)) => taken,
        Ok(None) => {
            tracing::debug!(
                slots = arena.slots(),
                "shm: every slot busy; pushing instead"
            );
            return Ok(None);
        }
        Err(e) => {
            // No room for the slot's pages (the arena's other slots may
            // hold them): the push gets its chance, and its own error.
            let e = inner.write_error(Path::new(arena.name()), e);
            tracing::warn!(error = %e, bytes, "shm: no room in the arena; pushing instead");
            return Ok(None);
        }
    };
    let seals = Arc::new(Mutex::new(Seals {
        crcs: vec![None; count],
        sink_live: true,
    }));
    let sink = ShmSink {
        arena: arena.clone(),
        slot,
        blob,
        shape,
        seals: seals.clone(),
    };
    let slot = ShmSlot {
        inner: inner.clone(),
        arena,
        slot,
        generation,
        request_id,
        key,
        shape,
        seals,
        published: false,
    };
    Ok(Some(Reserved {
        sink: Box::new(sink),
        slot: Box::new(slot),
    }))
}

/// A pointer file's contents.
#[derive(Debug)]
struct Pointer {
    arena: String,
    slot: usize,
    generation: u64,
    metas: Vec<BlobMeta>,
}

impl Pointer {
    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(64 + self.arena.len() + 12 * self.metas.len());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&POINTER_VERSION.to_le_bytes());
        out.extend_from_slice(&(self.metas.len() as u32).to_le_bytes());
        out.extend_from_slice(&(self.slot as u64).to_le_bytes());
        out.extend_from_slice(&self.generation.to_le_bytes());
        out.extend_from_slice(&(self.arena.len() as u16).to_le_bytes());
        out.extend_from_slice(self.arena.as_bytes());
        for m in &self.metas {
            out.extend_from_slice(&m.len.to_le_bytes());
            out.extend_from_slice(&m.crc32.to_le_bytes());
        }
        out
    }

    /// Reads a pointer file (whose first 12 bytes said version 2).
    fn read(path: &Path, file: &File) -> Result<Pointer, KvError> {
        let corrupt = corrupt_at(path);
        let len = file
            .metadata()
            .map_err(io_err(format!("stat {}", path.display())))?
            .len();
        if len > MAX_POINTER {
            return Err(corrupt(format!("pointer file of {len} bytes")));
        }
        let mut b = vec![0u8; len as usize];
        file.read_exact_at(&mut b, 0)
            .map_err(io_err(format!("reading {}", path.display())))?;
        let short = || corrupt("pointer file cut short".into());
        let take = |at: &mut usize, n: usize| -> Result<&[u8], KvError> {
            let s = b.get(*at..*at + n).ok_or_else(short)?;
            *at += n;
            Ok(s)
        };
        let mut at = 12;
        let u32_of = |s: &[u8]| u32::from_le_bytes(s.try_into().expect("4 bytes"));
        let u64_of = |s: &[u8]| u64::from_le_bytes(s.try_into().expect("8 bytes"));
        let count = u32_of(take(&mut at, 4)?) as usize;
        let slot = u64_of(take(&mut at, 8)?) as usize;
        let generation = u64_of(take(&mut at, 8)?);
        let name_len = u16::from_le_bytes(take(&mut at, 2)?.try_into().expect("2 bytes")) as usize;
        let arena = std::str::from_utf8(take(&mut at, name_len)?)
            .map_err(|_| corrupt("arena name is not UTF-8".into()))?
            .to_string();
        let mut metas = Vec::with_capacity(count.min(1024));
        for _ in 0..count {
            let len = u64_of(take(&mut at, 8)?);
            let crc32 = u32_of(take(&mut at, 4)?);
            metas.push(BlobMeta { len, crc32 });
        }
        if at != b.len() {
            return Err(corrupt("trailing bytes after the pointer".into()));
        }
        Ok(Pointer {
            arena,
            slot,
            generation,
            metas,
        })
    }
}

/// Bytes of the request a pointer file points to: the sizes of its blobs in
/// the arena slot (`None`: not a well-formed pointer file).
pub(super) fn pointer_bytes(path: &Path, file: &File) -> Option<u64> {
    Pointer::read(path, file)
        .ok()
        .map(|p| p.metas.iter().map(|m| m.len).sum())
}

impl ShmSlot {
    /// Checks the seals, marks the slot ready, publishes the pointer (blocking).
    fn finish(mut self) -> Result<KvHandle, KvError> {
        let blob = self.shape.blob_bytes().unwrap_or(0) as u64;
        let metas = {
            let seals = lock(&self.seals);
            let refuse = |detail: String| KvError::BadRequest {
                transport: NAME,
                detail: format!("request `{}`: {detail}", self.request_id),
            };
            if seals.sink_live {
                return Err(refuse("published while its sink may still write".into()));
            }
            seals
                .crcs
                .iter()
                .enumerate()
                .map(|(i, c)| {
                    c.map(|crc32| BlobMeta { len: blob, crc32 })
                        .ok_or_else(|| refuse(format!("blob {i} was never written")))
                })
                .collect::<Result<Vec<_>, _>>()?
        };
        if !self.arena.ready(self.slot, self.generation) {
            return Err(KvError::Protocol {
                transport: NAME,
                peer: self.arena.name().to_string(),
                detail: format!("slot {} was taken from its writer", self.slot),
            });
        }
        let pointer = Pointer {
            arena: self.arena.name().to_string(),
            slot: self.slot,
            generation: self.generation,
            metas,
        };
        self.inner.publish_bytes(&self.key, &pointer.encode())?;
        self.published = true;
        Ok(KvHandle {
            request_id: std::mem::take(&mut self.request_id),
            transport: NAME.into(),
            location: self.inner.location.clone(),
            layout: self.shape.layout,
            tokens: self.shape.tokens,
            wire: self.shape.wire,
            blobs: pointer.metas,
        })
    }
}

impl Drop for ShmSlot {
    fn drop(&mut self) {
        if !self.published {
            self.arena.abandon(self.slot, self.generation);
        }
    }
}

#[async_trait::async_trait]
impl KvSlot for ShmSlot {
    async fn publish(self: Box<Self>) -> Result<KvHandle, KvError> {
        tokio::task::spawn_blocking(move || self.finish())
            .await
            .map_err(|e| KvError::Io {
                transport: NAME,
                context: "publish task failed".into(),
                source: io::Error::other(e),
            })?
    }
}

/// A reader's map of the arena `name` (kept, at most a few, while its
/// file stays the same).
fn mapped(inner: &Inner, name: &str) -> Result<Arc<Arena>, KvError> {
    if let Some(a) = lock(&inner.arena)
        .as_ref()
        .filter(|a| a.name() == name && a.is_current())
    {
        return Ok(a.clone());
    }
    let mut maps = lock(&inner.maps);
    maps.retain(|a| a.is_current());
    if let Some(a) = maps.iter().find(|a| a.name() == name) {
        return Ok(a.clone());
    }
    let a = Arc::new(Arena::open(&inner.root, name)?);
    if maps.len() >= super::arena::MAX_MAPPED {
        maps.remove(0);
    }
    maps.push(a.clone());
    Ok(a)
}

/// Reads the request a pointer file names (blocking): claims its slot,
/// checks sizes and CRC-32s in place and lends the bytes. A slot whose
/// bytes fail the check is freed with the error.
pub(super) fn load_slot(
    inner: &Inner,
    path: &Path,
    file: &File,
    handle: &KvHandle,
) -> Result<Vec<Bytes>, KvError> {
    let corrupt = corrupt_at(path);
    let p = Pointer::read(path, file)?;
    if p.metas != handle.blobs {
        return Err(corrupt(format!(
            "the pointer's {} blobs are not the handle's {}",
            p.metas.len(),
            handle.blobs.len()
        )));
    }
    let arena = mapped(inner, &p.arena)?;
    let total = p
        .metas
        .iter()
        .try_fold(0u64, |t, m| t.checked_add(m.len))
        .filter(|&t| t <= arena.slot_bytes() as u64)
        .ok_or_else(|| corrupt(format!("blobs larger than a slot of {}", arena.name())))?;
    if !arena.claim(p.slot, p.generation) {
        return Err(corrupt(format!(
            "slot {} of {} no longer holds this request",
            p.slot,
            arena.name()
        )));
    }
    let whole = Bytes::from_owner(Lease {
        arena,
        slot: p.slot,
        generation: p.generation,
        len: total as usize,
    });
    let mut at = 0;
    let blobs: Vec<Bytes> = p
        .metas
        .iter()
        .map(|m| {
            let b = whole.slice(at..at + m.len as usize);
            at += m.len as usize;
            b
        })
        .collect();
    drop(whole);
    crate::verify_all(NAME, handle, &blobs)?;
    Ok(blobs)
}

/// Frees the unread slot a pointer file names, if it still holds it (a
/// release); an unreadable pointer frees nothing.
pub(super) fn release_slot(inner: &Inner, path: &Path, file: &File) {
    let Ok(p) = Pointer::read(path, file) else {
        return;
    };
    if let Ok(arena) = mapped(inner, &p.arena) {
        arena.release(p.slot, p.generation);
    }
}
