//! The `shm` transport: one file per request under `PD_SHM_ROOT`
//! (default `/dev/shm/rngd_kv_cluster`).
//!
//! - reserve ([`slot`]): the same temporary file, allocated whole and mapped,
//!   for a producer that writes the blobs in place; published as a push is;
//! - push: blobs are written to a temporary name (`.tmp.<key>.<pid>.<n>`, mode
//!   0600, `O_EXCL|O_NOFOLLOW`) and published atomically as `<key>.kv` by a
//!   `link`, which replaces nothing (only this user's own earlier file of the
//!   key, by `rename`); a failed write (e.g. ENOSPC) removes the temporary
//!   file, so no partial file is ever visible;
//! - pull: waits (polling) until `<key>.kv` exists, opens it
//!   `O_NOFOLLOW|O_NONBLOCK` and goes on only if it is a regular file of this
//!   user that nobody else may write, maps it with memmap2, checks header and
//!   CRC-32 of every blob, then unlinks it: the returned [`Bytes`] borrow the
//!   mapping, so nothing is copied and the memory goes away with the last `Bytes`;
//! - a sweeper task removes this user's files older than the TTL (`AIRM_KV_SHM_TTL_S`)
//!   and, on the same pass, sums the stranded bytes
//!   ([`ShmTransport::stranded_bytes`]): the payload of this user's published
//!   `<key>.kv` files (for a pointer file, the sizes of the blobs in the arena
//!   slot it points to) older than the claim window (`AIRM_KV_CLAIM_WINDOW_S`,
//!   at most the TTL) that no decode has pulled or released. The figure is
//!   the root's: every process of this user on the root sees the same files.
//!
//! The root is checked once, at creation, never following a symlink: a real
//! directory owned by this user or root, sticky if others may write to it (a
//! private root of this user is set to 0700). Rules: `docs/kv-wire.md`.
//!
//! File layout (little-endian): magic `RNGDKV01`, u32 version, u32 blob count,
//! u64 payload offset, u64 payload bytes, then per blob (u64 len, u32 crc32),
//! zero padding up to the payload offset (a multiple of 4096), then the blobs
//! back to back in wire order.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{DirBuilderExt, FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use rngd_kv_wire::{BlobMeta, KvHandle};

use crate::{
    KvError, KvPayload, KvTransport, Reserved, SinkShape, TransportConfig, check_handle,
    sanitize_key,
};

mod arena;
mod slot;
pub use arena::{ARENA_EXT, busy_slots_in};
pub use slot::{ShmSink, ShmSlot};

/// Registry name.
pub const NAME: &str = "shm";

const MAGIC: &[u8; 8] = b"RNGDKV01";
const VERSION: u32 = 1;
const FIXED_HEADER: usize = 32;
const BLOB_ENTRY: usize = 12;
const PAGE: usize = 4096;
/// Extension of published request files.
pub const EXT: &str = "kv";
const TMP_PREFIX: &str = ".tmp.";

/// How the transport writes bytes into a file: the disk edge, behind a trait
/// so tests can inject faults (ENOSPC) without a full disk.
pub trait ShmWriter: Send + Sync + 'static {
    /// Writes all of `bytes` at `offset` of `file`.
    fn write_all_at(&self, file: &File, bytes: &[u8], offset: u64) -> io::Result<()>;
    /// Allocates `len` bytes of `file` at `offset` (growing it if they end
    /// past its end; pages already there stay), so that writing them through
    /// a mapping cannot fail for space: a full disk is an error here.
    fn allocate(&self, file: &File, offset: u64, len: u64) -> io::Result<()> {
        allocate(file, offset, len)
    }
}

/// `fallocate(2)` of `len` bytes at `offset`.
fn allocate(file: &File, offset: u64, len: u64) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let (offset, len) = (
        libc::off_t::try_from(offset).map_err(io::Error::other)?,
        libc::off_t::try_from(len).map_err(io::Error::other)?,
    );
    loop {
        // SAFETY: a plain system call on a descriptor this `File` owns for
        // the whole call; no memory is passed.
        let r = unsafe { libc::fallocate(file.as_raw_fd(), 0, offset, len) };
        if r == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Offset of the first blob in a request file of `blob_count` blobs (the
/// header padded to a page); blob `i` follows blobs `0..i` back to back.
pub const fn data_offset(blob_count: usize) -> u64 {
    ((FIXED_HEADER + BLOB_ENTRY * blob_count).div_ceil(PAGE) * PAGE) as u64
}

/// The real writer: `pwrite` until done.
#[derive(Debug, Default, Clone, Copy)]
pub struct FileWriter;

impl ShmWriter for FileWriter {
    fn write_all_at(&self, file: &File, bytes: &[u8], offset: u64) -> io::Result<()> {
        FileExt::write_all_at(file, bytes, offset)
    }
}

/// The `shm` transport. Cheap to share (`Arc` inside).
#[derive(Clone)]
pub struct ShmTransport {
    inner: Arc<Inner>,
}

struct Inner {
    root: PathBuf,
    location: String,
    ttl: Duration,
    /// Published KV unclaimed this long counts as stranded.
    claim_window: Duration,
    /// Stranded bytes as of the last sweep.
    stranded: AtomicU64,
    writer: Arc<dyn ShmWriter>,
    /// Slots of this process's arena (0: none).
    slots: usize,
    /// This process's arena, made on the first reserve.
    arena: std::sync::Mutex<Option<Arc<arena::Arena>>>,
    /// Other processes' arenas this one reads from.
    maps: std::sync::Mutex<Vec<Arc<arena::Arena>>>,
}

impl std::fmt::Debug for ShmTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmTransport")
            .field("root", &self.inner.root)
            .field("ttl", &self.inner.ttl)
            .finish()
    }
}

fn io_err(context: String) -> impl FnOnce(io::Error) -> KvError {
    move |source| KvError::Io {
        transport: NAME,
        context,
        source,
    }
}

fn is_no_space(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOSPC) | Some(libc::EDQUOT))
        || e.kind() == io::ErrorKind::StorageFull
}

/// This process's effective uid.
fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// Creates the root if missing (mode 0700) and checks it, never following a
/// symlink: see the module docs for the rules.
fn prepare_root(root: &Path) -> Result<(), KvError> {
    let meta = match std::fs::symlink_metadata(root) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            if let Some(parent) = root.parent().filter(|p| !p.as_os_str().is_empty()) {
                std::fs::create_dir_all(parent)
                    .map_err(io_err(format!("creating {}", parent.display())))?;
            }
            match std::fs::DirBuilder::new().mode(0o700).create(root) {
                Ok(()) => {}
                // Somebody else made it meanwhile: checked below like any existing root.
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(io_err(format!("creating {}", root.display()))(e)),
            }
            std::fs::symlink_metadata(root)
                .map_err(io_err(format!("reading {}", root.display())))?
        }
        Err(e) => return Err(io_err(format!("reading {}", root.display()))(e)),
    };
    let (ft, owner, mode, me) = (meta.file_type(), meta.uid(), meta.mode(), euid());
    let sticky = mode & 0o1000 != 0;
    let why = if ft.is_symlink() {
        let target = std::fs::read_link(root)
            .map_or_else(|e| format!("unreadable: {e}"), |t| t.display().to_string());
        format!("is a symlink (to {target}), which is never followed")
    } else if !ft.is_dir() {
        "is not a directory".into()
    } else if owner != me && owner != 0 {
        format!("is owned by uid {owner}, neither this process's uid {me} nor root")
    } else if mode & 0o022 != 0 && !sticky {
        format!(
            "is writable by group or others (mode {:o}) without the sticky bit, \
             so anyone could replace or remove the caches",
            mode & 0o7777
        )
    } else {
        String::new()
    };
    if !why.is_empty() {
        return Err(KvError::Config {
            detail: format!(
                "shm root {}: {why}; refusing to use it (PD_SHM_ROOT)",
                root.display()
            ),
        });
    }
    if owner == me && !sticky && mode & 0o777 != 0o700 {
        std::fs::set_permissions(root, std::fs::Permissions::from_mode(0o700))
            .map_err(io_err(format!("setting mode 0700 on {}", root.display())))?;
    }
    Ok(())
}

/// Refuses `meta` (of a file about to be read or replaced) unless it is a
/// regular file of this user that nobody else may write.
fn check_own_file(path: &Path, meta: &std::fs::Metadata) -> Result<(), KvError> {
    let refuse = |why: String| KvError::Io {
        transport: NAME,
        context: format!("refusing {}: {why}", path.display()),
        source: io::Error::from(io::ErrorKind::PermissionDenied),
    };
    if !meta.file_type().is_file() {
        return Err(refuse("not a regular file".into()));
    }
    let (owner, me) = (meta.uid(), euid());
    if owner != me {
        return Err(refuse(format!(
            "owned by uid {owner}, not this process's uid {me} (another user's file is never read or replaced)"
        )));
    }
    if meta.mode() & 0o022 != 0 {
        return Err(refuse(format!(
            "writable by group or others (mode {:o})",
            meta.mode() & 0o7777
        )));
    }
    Ok(())
}

impl ShmTransport {
    /// Creates the transport on `cfg.shm_root` (checked, or created with mode
    /// 0700, as the module docs say) with the real file writer. Inside a tokio
    /// runtime this also starts the TTL sweeper, which stops with the last clone.
    pub fn new(cfg: &TransportConfig) -> Result<Self, KvError> {
        Self::with_writer(cfg, Arc::new(FileWriter))
    }

    /// Like [`ShmTransport::new`] with a custom [`ShmWriter`] (tests).
    pub fn with_writer(cfg: &TransportConfig, writer: Arc<dyn ShmWriter>) -> Result<Self, KvError> {
        let root = cfg.shm_root.clone();
        prepare_root(&root)?;
        let inner = Arc::new(Inner {
            location: root.display().to_string(),
            root,
            ttl: cfg.shm_ttl,
            claim_window: cfg.claim_window_for(cfg.shm_ttl),
            stranded: AtomicU64::new(0),
            writer,
            slots: cfg.shm_slots.min(crate::config::MAX_SHM_SLOTS),
            arena: Default::default(),
            maps: Default::default(),
        });
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(sweeper(Arc::downgrade(&inner)));
        }
        Ok(ShmTransport { inner })
    }

    /// The directory this transport publishes into.
    pub fn root(&self) -> &Path {
        &self.inner.root
    }

    /// Path of the published file for `request_id`.
    pub fn path_of(&self, request_id: &str) -> Result<PathBuf, KvError> {
        let key = sanitize_key(NAME, request_id)?;
        Ok(self.inner.root.join(format!("{key}.{EXT}")))
    }

    /// Request files currently in the root (published, pointers and
    /// temporary; not the arenas): with [`ShmTransport::busy_slots`], the
    /// leak counter.
    pub fn held_files(&self) -> Result<usize, KvError> {
        let dir = std::fs::read_dir(&self.inner.root)
            .map_err(io_err(format!("listing {}", self.inner.root.display())))?;
        let arena = format!(".{}", arena::ARENA_EXT);
        Ok(dir
            .flatten()
            .filter(|e| !e.file_name().to_string_lossy().ends_with(&arena))
            .count())
    }

    /// Slots of this process's arena not free (written, published or being
    /// read); 0 before the first reserve.
    pub fn busy_slots(&self) -> usize {
        slot_lock(&self.inner.arena)
            .as_ref()
            .map_or(0, |a| a.busy())
    }

    /// Removes every file older than the TTL now; returns how many were removed.
    /// Updates [`ShmTransport::stranded_bytes`] too.
    pub fn sweep(&self) -> Result<usize, KvError> {
        self.inner.sweep()
    }

    /// Bytes of KV published under the root and claimed by no decode
    /// (neither pulled nor released) although older than the claim window,
    /// as of the last sweep (the sweeper's, every quarter TTL at most 5 s
    /// apart, or [`ShmTransport::sweep`]): what a client gone or an
    /// orchestrator dead leaves until the TTL removes it.
    pub fn stranded_bytes(&self) -> u64 {
        self.inner.stranded.load(Ordering::Relaxed)
    }
}

/// How far a file's modification time may lag behind the clock it is compared with.
const MTIME_SLACK: Duration = Duration::from_millis(20);

fn slot_lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Inner {
    fn sweep(&self) -> Result<usize, KvError> {
        // First the arena (which touches its file, so the scan below leaves it).
        let own = slot_lock(&self.arena).clone();
        if let Some(a) = &own {
            let freed = a.sweep(self.ttl);
            if freed > 0 {
                tracing::info!(
                    freed,
                    arena = a.name(),
                    "shm: freed expired or orphaned slots"
                );
            }
        }
        let now = SystemTime::now();
        let mut removed = 0;
        let mut stranded = 0u64;
        let dir = std::fs::read_dir(&self.root)
            .map_err(io_err(format!("listing {}", self.root.display())))?;
        for entry in dir.flatten() {
            let Ok(meta) = entry.metadata() else { continue };
            let Ok(modified) = meta.modified() else {
                continue;
            };
            let age = now.duration_since(modified).unwrap_or_default();
            // File times come from the kernel's coarse clock (one tick, up to
            // 10 ms, behind the real time): without the slack a file could go
            // a few ms before its TTL.
            // Only this user's regular files: never a symlink (the entry's
            // metadata is an lstat), never another user's file.
            let mine = meta.is_file() && meta.uid() == euid();
            let name = entry.file_name();
            let published = mine
                && name.to_string_lossy().ends_with(&format!(".{EXT}"))
                && !name.to_string_lossy().starts_with(TMP_PREFIX);
            if mine && age >= self.ttl + MTIME_SLACK {
                // An arena goes only once its owner is gone (or, if that
                // cannot be told, once nobody touched it for a long while):
                // a live owner touches it every few seconds, whatever its TTL.
                if name.to_string_lossy().ends_with(&format!(".{ARENA_EXT}"))
                    && !arena::orphaned(&entry.path(), age)
                {
                    continue;
                }
                match std::fs::remove_file(entry.path()) {
                    Ok(()) => {
                        removed += 1;
                        tracing::info!(path = %entry.path().display(), ?age, "shm: removed expired KV file");
                        continue;
                    }
                    Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                    Err(e) => {
                        tracing::warn!(path = %entry.path().display(), error = %e, "shm: sweep failed")
                    }
                }
            }
            if published && age >= self.claim_window {
                stranded += published_bytes(&entry.path()).unwrap_or(0);
            }
        }
        self.stranded.store(stranded, Ordering::Relaxed);
        Ok(removed)
    }

    /// Creates a fresh temporary file for `key` (`O_EXCL|O_NOFOLLOW`, mode
    /// 0600), removed again by the returned guard unless it is disarmed.
    fn create_tmp(&self, key: &str) -> Result<(PathBuf, File, TmpGuard), KvError> {
        static SEQ: AtomicU64 = AtomicU64::new(0);
        // O_EXCL: an existing name (a symlink or file somebody planted at a
        // guessed temporary name) is never opened; try another name.
        let mut attempt = 0;
        loop {
            let tmp = self.root.join(format!(
                "{TMP_PREFIX}{key}.{}.{}",
                std::process::id(),
                SEQ.fetch_add(1, Ordering::Relaxed)
            ));
            match OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .mode(0o600)
                .custom_flags(libc::O_NOFOLLOW)
                .open(&tmp)
            {
                Ok(f) => return Ok((tmp.clone(), f, TmpGuard(Some(tmp)))),
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists && attempt < 16 => {
                    attempt += 1;
                }
                Err(e) => return Err(self.write_error(&tmp, e)),
            }
        }
    }

    fn write_request(&self, key: &str, blobs: &[Bytes]) -> Result<Vec<BlobMeta>, KvError> {
        let (tmp, file, guard) = self.create_tmp(key)?;
        let data_offset = data_offset(blobs.len());
        let total: u64 = blobs.iter().map(|b| b.len() as u64).sum();
        file.set_len(data_offset + total)
            .map_err(|e| self.write_error(&tmp, e))?;
        let mut metas = Vec::with_capacity(blobs.len());
        let mut offset = data_offset;
        for blob in blobs {
            // CRC right before the write: the blob is still in cache for the copy.
            metas.push(BlobMeta {
                len: blob.len() as u64,
                crc32: rngd_kv_wire::crc32(blob),
            });
            self.writer
                .write_all_at(&file, blob, offset)
                .map_err(|e| self.write_error(&tmp, e))?;
            offset += blob.len() as u64;
        }
        self.seal_and_publish(key, &tmp, file, guard, &metas)?;
        Ok(metas)
    }

    /// Writes the header of a filled temporary file and publishes it under
    /// `key` (the temporary name goes with the guard).
    fn seal_and_publish(
        &self,
        key: &str,
        tmp: &Path,
        file: File,
        guard: TmpGuard,
        metas: &[BlobMeta],
    ) -> Result<(), KvError> {
        let data_offset = data_offset(metas.len());
        let total: u64 = metas.iter().map(|m| m.len).sum();
        let mut header = Vec::with_capacity(FIXED_HEADER + BLOB_ENTRY * metas.len());
        header.extend_from_slice(MAGIC);
        header.extend_from_slice(&VERSION.to_le_bytes());
        header.extend_from_slice(&(metas.len() as u32).to_le_bytes());
        header.extend_from_slice(&data_offset.to_le_bytes());
        header.extend_from_slice(&total.to_le_bytes());
        for m in metas {
            header.extend_from_slice(&m.len.to_le_bytes());
            header.extend_from_slice(&m.crc32.to_le_bytes());
        }
        self.writer
            .write_all_at(&file, &header, 0)
            .map_err(|e| self.write_error(tmp, e))?;
        drop(file);
        let path = self.root.join(format!("{key}.{EXT}"));
        self.publish(tmp, &path)?;
        // The temporary name (still linked after a `link`) goes with the guard.
        drop(guard);
        Ok(())
    }

    /// Publishes `bytes` as the whole file of `key` (a pointer file).
    fn publish_bytes(&self, key: &str, bytes: &[u8]) -> Result<(), KvError> {
        let (tmp, file, guard) = self.create_tmp(key)?;
        self.writer
            .write_all_at(&file, bytes, 0)
            .map_err(|e| self.write_error(&tmp, e))?;
        drop(file);
        let path = self.root.join(format!("{key}.{EXT}"));
        self.publish(&tmp, &path)?;
        drop(guard);
        Ok(())
    }

    /// Gives the temporary file its published name, replacing nothing but this
    /// user's own earlier regular file of the key (a re-push), by `rename`.
    fn publish(&self, tmp: &Path, path: &Path) -> Result<(), KvError> {
        match std::fs::hard_link(tmp, path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                let meta = std::fs::symlink_metadata(path)
                    .map_err(io_err(format!("reading {}", path.display())))?;
                if meta.file_type().is_symlink() {
                    let why = format!(
                        "refusing to publish {}: a symlink is there (not followed, not replaced)",
                        path.display()
                    );
                    return Err(io_err(why)(e));
                }
                check_own_file(path, &meta)?;
                std::fs::rename(tmp, path).map_err(|e| self.write_error(path, e))
            }
            Err(e) => Err(self.write_error(path, e)),
        }
    }

    fn write_error(&self, path: &Path, e: io::Error) -> KvError {
        if is_no_space(&e) {
            KvError::Capacity {
                transport: NAME,
                detail: format!(
                    "no space left for {} in {}",
                    path.display(),
                    self.root.display()
                ),
                source: Some(e),
            }
        } else {
            KvError::Io {
                transport: NAME,
                context: format!("writing {}", path.display()),
                source: e,
            }
        }
    }
}

/// Removes a temporary file unless disarmed (published).
struct TmpGuard(Option<PathBuf>);

impl Drop for TmpGuard {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let _ = std::fs::remove_file(&p);
        }
    }
}

async fn sweeper(inner: Weak<Inner>) {
    let period = match inner.upgrade() {
        Some(i) => (i.ttl / 4).clamp(Duration::from_millis(10), Duration::from_secs(5)),
        None => return,
    };
    loop {
        tokio::time::sleep(period).await;
        let Some(inner) = inner.upgrade() else { return };
        let _ = tokio::task::spawn_blocking(move || {
            if let Err(e) = inner.sweep() {
                tracing::warn!(error = %e, "shm: sweep failed");
            }
        })
        .await;
    }
}

/// The error for a malformed file at `path`, given what is wrong.
fn corrupt_at(path: &Path) -> impl Fn(String) -> KvError + '_ {
    move |detail| KvError::Protocol {
        transport: NAME,
        peer: path.display().to_string(),
        detail,
    }
}

/// Bytes of KV a published file holds (`None`: gone meanwhile, or not a
/// request file): a request file's payload, or the blobs in the arena slot a
/// pointer file points to; never the size of the pointer file itself.
fn published_bytes(path: &Path) -> Option<u64> {
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .ok()?;
    match version_of(&file)? {
        VERSION => {
            let mut total = [0u8; 8];
            file.read_exact_at(&mut total, 24).ok()?;
            Some(u64::from_le_bytes(total))
        }
        slot::POINTER_VERSION => slot::pointer_bytes(path, &file),
        _ => None,
    }
}

/// The header version of a request file (`None`: no header or not ours).
fn version_of(file: &File) -> Option<u32> {
    let mut head = [0u8; 12];
    file.read_exact_at(&mut head, 0).ok()?;
    (&head[..8] == MAGIC).then(|| u32::from_le_bytes(head[8..12].try_into().expect("4 bytes")))
}

/// Maps a published file and checks it against the handle.
fn load(path: &Path, file: File, handle: &KvHandle) -> Result<Vec<Bytes>, KvError> {
    let corrupt = corrupt_at(path);
    let len = file
        .metadata()
        .map_err(io_err(format!("stat {}", path.display())))?
        .len() as usize;
    if len < FIXED_HEADER {
        return Err(corrupt(format!("file of {len} bytes has no header")));
    }
    // SAFETY: the file was checked to be a regular file owned by this user
    // that nobody else may write (`check_own_file`); this user's writers never
    // modify a published file in place (they write a temporary file and link
    // or rename it), and removal only unlinks, so the mapped pages stay valid
    // and unchanged for the lifetime of the mapping.
    let map = unsafe { memmap2::MmapOptions::new().populate().map(&file) }
        .map_err(io_err(format!("mapping {}", path.display())))?;
    let h = &map[..];
    let u32_at = |o: usize| u32::from_le_bytes(h[o..o + 4].try_into().expect("4 bytes"));
    let u64_at = |o: usize| u64::from_le_bytes(h[o..o + 8].try_into().expect("8 bytes"));
    if &h[..8] != MAGIC || u32_at(8) != VERSION {
        return Err(corrupt("bad magic or version".into()));
    }
    let count = u32_at(12) as usize;
    let data_offset = u64_at(16) as usize;
    let total = u64_at(24) as usize;
    if count != handle.blobs.len() {
        return Err(corrupt(format!(
            "file has {count} blobs, the handle {}",
            handle.blobs.len()
        )));
    }
    let header_len = FIXED_HEADER + BLOB_ENTRY * count;
    if header_len > len || data_offset < header_len || data_offset.saturating_add(total) != len {
        return Err(corrupt(format!(
            "header ({count} blobs, payload {total} at {data_offset}) does not fit a file of {len} bytes"
        )));
    }
    let mut ranges = Vec::with_capacity(count);
    let mut offset = data_offset;
    for i in 0..count {
        let blob_len = u64_at(FIXED_HEADER + BLOB_ENTRY * i) as usize;
        if blob_len as u64 != handle.blobs[i].len || offset + blob_len > len {
            return Err(corrupt(format!(
                "blob {i} is {blob_len} bytes in the file, {} in the handle",
                handle.blobs[i].len
            )));
        }
        ranges.push(offset..offset + blob_len);
        offset += blob_len;
    }
    let whole = Bytes::from_owner(map);
    let blobs: Vec<Bytes> = ranges.into_iter().map(|r| whole.slice(r)).collect();
    crate::verify_all(NAME, handle, &blobs)?;
    Ok(blobs)
}

#[async_trait::async_trait]
impl KvTransport for ShmTransport {
    fn name(&self) -> &'static str {
        NAME
    }

    #[tracing::instrument(name = "kv.push", skip_all, fields(transport = NAME, request_id = %payload.request_id, blobs = payload.blobs.len()))]
    async fn push(&self, payload: KvPayload) -> Result<KvHandle, KvError> {
        let key = sanitize_key(NAME, &payload.request_id)?;
        let started = Instant::now();
        let inner = self.inner.clone();
        let blobs = payload.blobs;
        let (metas, blobs) = tokio::task::spawn_blocking(move || {
            let r = inner.write_request(&key, &blobs);
            (r, blobs)
        })
        .await
        .map_err(|e| KvError::Io {
            transport: NAME,
            context: "push task failed".into(),
            source: io::Error::other(e),
        })?;
        let metas = metas?;
        let bytes: usize = blobs.iter().map(|b| b.len()).sum();
        tracing::debug!(request_id = %payload.request_id, bytes, ms = started.elapsed().as_secs_f64() * 1e3, "shm: pushed");
        Ok(KvHandle {
            request_id: payload.request_id,
            transport: NAME.into(),
            location: self.inner.location.clone(),
            layout: payload.layout,
            tokens: payload.tokens,
            wire: payload.wire,
            blobs: metas,
        })
    }

    #[tracing::instrument(name = "kv.reserve", skip_all, fields(transport = NAME, request_id = %request_id, tokens = shape.tokens))]
    async fn reserve(
        &self,
        request_id: &str,
        shape: SinkShape,
    ) -> Result<Option<Reserved>, KvError> {
        let key = sanitize_key(NAME, request_id)?;
        let inner = self.inner.clone();
        let id = request_id.to_string();
        tokio::task::spawn_blocking(move || slot::reserve(&inner, id, key, shape))
            .await
            .map_err(|e| KvError::Io {
                transport: NAME,
                context: "reserve task failed".into(),
                source: io::Error::other(e),
            })?
    }

    #[tracing::instrument(name = "kv.pull", skip_all, fields(transport = NAME, request_id = %handle.request_id, bytes = handle.total_bytes()))]
    async fn pull(&self, handle: &KvHandle, timeout: Duration) -> Result<Vec<Bytes>, KvError> {
        self.pull_within(handle, timeout).await
    }

    #[tracing::instrument(name = "kv.pull", skip_all, fields(transport = NAME, request_id = %handle.request_id, bytes = handle.total_bytes()))]
    async fn pull_published(
        &self,
        handle: &KvHandle,
        _timeout: Duration,
    ) -> Result<Vec<Bytes>, KvError> {
        // A local map: the bytes take no time worth a deadline; a file that
        // is not there now never will be.
        self.pull_within(handle, Duration::ZERO).await
    }

    #[tracing::instrument(name = "kv.release", skip_all, fields(transport = NAME, request_id = %handle.request_id))]
    async fn release(&self, handle: &KvHandle) -> Result<(), KvError> {
        self.release_now(handle)
    }

    fn stranded_bytes(&self) -> Option<u64> {
        Some(ShmTransport::stranded_bytes(self))
    }
}

// === impl ShmTransport (pull and release) ===

impl ShmTransport {
    /// Opens the key's file, waiting at most `timeout` for it to appear,
    /// maps and verifies it, and unlinks it.
    async fn pull_within(
        &self,
        handle: &KvHandle,
        timeout: Duration,
    ) -> Result<Vec<Bytes>, KvError> {
        check_handle(NAME, handle)?;
        if handle.location != self.inner.location {
            return Err(KvError::BadRequest {
                transport: NAME,
                detail: format!(
                    "handle of request `{}` points at {}, this transport uses {}",
                    handle.request_id, handle.location, self.inner.location
                ),
            });
        }
        let path = self.path_of(&handle.request_id)?;
        let started = Instant::now();
        let deadline = started + timeout;
        let mut backoff = Duration::from_millis(1);
        let file = loop {
            // O_NOFOLLOW: a symlink at the key's path is refused, not followed;
            // O_NONBLOCK: a FIFO planted there cannot block the open.
            match OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
                .open(&path)
            {
                Ok(f) => break f,
                Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
                    let why = format!(
                        "refusing {}: it is a symlink (never followed)",
                        path.display()
                    );
                    return Err(io_err(why)(e));
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    let now = Instant::now();
                    if now >= deadline {
                        return Err(KvError::NotFound {
                            transport: NAME,
                            request_id: handle.request_id.clone(),
                            waited: now - started,
                        });
                    }
                    tokio::time::sleep(backoff.min(deadline - now)).await;
                    backoff = (backoff * 2).min(Duration::from_millis(16));
                }
                Err(e) => return Err(io_err(format!("opening {}", path.display()))(e)),
            }
        };
        let h = handle.clone();
        let inner = self.inner.clone();
        let blobs = tokio::task::spawn_blocking(move || {
            let meta = file
                .metadata()
                .map_err(io_err(format!("stat {}", path.display())))?;
            check_own_file(&path, &meta)?;
            let blobs = if version_of(&file) == Some(slot::POINTER_VERSION) {
                slot::load_slot(&inner, &path, &file, &h)?
            } else {
                load(&path, file, &h)?
            };
            // The reader releases (the mapping stays valid after the unlink),
            // unless the name now belongs to another file.
            let same = std::fs::symlink_metadata(&path)
                .is_ok_and(|m| m.dev() == meta.dev() && m.ino() == meta.ino());
            if !same {
                return Ok(blobs);
            }
            match std::fs::remove_file(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(io_err(format!("removing {}", path.display()))(e)),
            }
            Ok(blobs)
        })
        .await
        .map_err(|e| KvError::Io {
            transport: NAME,
            context: "pull task failed".into(),
            source: io::Error::other(e),
        })??;
        tracing::debug!(request_id = %handle.request_id, bytes = handle.total_bytes(), ms = started.elapsed().as_secs_f64() * 1e3, "shm: pulled");
        Ok(blobs)
    }

    /// Frees the key's slot and removes its file (idempotent).
    fn release_now(&self, handle: &KvHandle) -> Result<(), KvError> {
        check_handle(NAME, handle)?;
        let path = self.path_of(&handle.request_id)?;
        // A pointer file's slot is freed first (its own file, never a link's target).
        if let Ok(file) = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(&path)
            && file
                .metadata()
                .is_ok_and(|m| check_own_file(&path, &m).is_ok())
            && version_of(&file) == Some(slot::POINTER_VERSION)
        {
            slot::release_slot(&self.inner, &path, &file);
        }
        match std::fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io_err(format!("removing {}", path.display()))(e)),
        }
    }
}
