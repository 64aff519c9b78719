//! The `shm` transport's slot arena: requests written in place, read in place.
//!
//! A process that prefills keeps one arena file, `arena.<pid>.<n>.kva` in
//! the root, mapped once: a header (one 64-byte entry per slot) padded to a
//! page, then `slots` slots, each the size of a full S-wide request of the
//! first layout reserved. Pages are allocated when a slot is first used and
//! stay, so after warm-up a handoff neither allocates, faults nor frees a
//! page: the producer's copy into the slot is the only copy, and the reader
//! lends the slot's bytes without copying.
//!
//! Each slot's state is a word in its entry, changed only by
//! compare-and-swap, in both processes:
//! `FREE → WRITING` (a reserve took it) `→ READY` (published) `→ READING`
//! (a reader claimed it) `→ FREE` (the reader's last blob dropped); or
//! `READY → FREE` (released unread, or unread past the TTL). Every use has a
//! fresh generation. The pointer file `<key>.kv` (header version 2, published
//! as a push publishes its file) names arena, slot and generation and holds
//! the blob sizes and CRC-32s; a reader claims only the slot of that
//! generation and verifies the checksums in place.
//!
//! A slot being read is never reused while its reader lives: the owner frees
//! a `READING` slot only when the reader's process is gone (same PID
//! namespace, checked with `kill(pid, 0)`); a reader elsewhere keeps it
//! until it lets go or the arena goes. The arena file goes with its owner;
//! if the owner is killed, any sweeper removes it once its TTL has passed
//! and the owner is gone (same PID namespace), or once nobody touched it
//! for [`ARENA_IDLE`] (the owner touches it on every sweep).

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, SystemTime};

use super::{NAME, PAGE, ShmWriter, check_own_file, io_err};
use crate::KvError;

/// Extension of arena files.
pub const ARENA_EXT: &str = "kva";
const ARENA_MAGIC: &[u8; 8] = b"RNGDKVA1";
const ENTRY: usize = 64;
const HEADER: usize = 64;

const FREE: u32 = 0;
const WRITING: u32 = 1;
const READY: u32 = 2;
const READING: u32 = 3;

// Entry fields (byte offsets inside a slot's entry).
const E_STATE: usize = 0;
const E_PID: usize = 4;
const E_GEN: usize = 8;
const E_PUBLISHED_MS: usize = 16;
const E_PIDNS: usize = 24;

// Header fields past the sizes: the owner's PID and PID namespace.
const H_OWNER_PID: usize = 32;
const H_OWNER_PIDNS: usize = 40;

/// How long an arena nobody touched stays when its owner's liveness cannot
/// be told (another PID namespace): its owner touches it every few seconds.
pub(super) const ARENA_IDLE: Duration = Duration::from_secs(600);

/// Whether the arena file at `path`, last touched `age` ago, has lost its
/// owner: the owner (in this PID namespace) is gone, or nobody touched it
/// for [`ARENA_IDLE`]. A file that cannot be read is judged by age alone.
pub(super) fn orphaned(path: &Path, age: Duration) -> bool {
    if age >= ARENA_IDLE {
        return true;
    }
    let mut head = [0u8; HEADER];
    let read = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .and_then(|f| f.read_exact_at(&mut head, 0));
    if read.is_err() || &head[..8] != ARENA_MAGIC {
        return false;
    }
    let pid = u32::from_le_bytes(
        head[H_OWNER_PID..H_OWNER_PID + 4]
            .try_into()
            .expect("4 bytes"),
    );
    let ns = u64::from_le_bytes(
        head[H_OWNER_PIDNS..H_OWNER_PIDNS + 8]
            .try_into()
            .expect("8 bytes"),
    );
    let mine = pid_namespace();
    mine != 0 && ns == mine && process_gone(pid)
}

/// Slots not free in the arena file at `path`, read from its header (what
/// any process of the user may read; a leak check from outside the
/// workers). `None` if it is not an arena file or cannot be read.
pub fn busy_slots_in(path: &Path) -> Option<usize> {
    let f = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .ok()?;
    let mut head = [0u8; 12];
    f.read_exact_at(&mut head, 0).ok()?;
    if &head[..8] != ARENA_MAGIC {
        return None;
    }
    let slots = u32::from_le_bytes(head[8..12].try_into().expect("4 bytes")) as usize;
    if slots > crate::config::MAX_SHM_SLOTS {
        return None;
    }
    let mut entries = vec![0u8; ENTRY * slots];
    f.read_exact_at(&mut entries, HEADER as u64).ok()?;
    Some(
        entries
            .chunks_exact(ENTRY)
            .filter(|e| e[E_STATE..E_STATE + 4] != [0; 4])
            .count(),
    )
}

/// Most arena files a reader keeps mapped.
pub(super) const MAX_MAPPED: usize = 16;

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// This process's PID namespace (the inode of `/proc/self/ns/pid`), 0 if unknown.
fn pid_namespace() -> u64 {
    std::fs::metadata("/proc/self/ns/pid").map_or(0, |m| m.ino())
}

/// Whether process `pid` is gone (in this PID namespace).
fn process_gone(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    if pid <= 0 {
        return false;
    }
    // SAFETY: signal 0 only checks that the process exists; nothing is sent.
    let r = unsafe { libc::kill(pid, 0) };
    r != 0 && io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
}

/// Whether `name` can be an arena file's name (no path, no leading dot).
pub(super) fn valid_name(name: &str) -> bool {
    name.len() <= 128
        && name.starts_with("arena.")
        && name.ends_with(".kva")
        && name
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || c == b'.' || c == b'-' || c == b'_')
}

/// One mapped arena file (the owner's, or a reader's map of another's).
pub(super) struct Arena {
    name: String,
    path: PathBuf,
    file: File,
    map: memmap2::MmapRaw,
    slots: usize,
    slot_bytes: usize,
    data_offset: usize,
    dev_ino: (u64, u64),
    /// The owner's arena: the file goes with it.
    owned: bool,
    next_gen: AtomicU64,
    /// The owner's record of the bytes of each slot allocated so far (pages
    /// stay once allocated: nothing here punches holes).
    allocated: Vec<AtomicUsize>,
}

impl std::fmt::Debug for Arena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Arena")
            .field("path", &self.path)
            .field("slots", &self.slots)
            .field("slot_bytes", &self.slot_bytes)
            .finish_non_exhaustive()
    }
}

/// Bytes of the header of an arena of `slots` slots (a whole number of pages).
const fn header_bytes(slots: usize) -> usize {
    (HEADER + ENTRY * slots).div_ceil(PAGE) * PAGE
}

impl Arena {
    /// Creates this process's arena file `name` in `root` (mode 0600,
    /// `O_EXCL`), sized for `slots` slots of `slot_bytes` (pages come on
    /// first use), and maps it.
    pub(super) fn create(
        root: &Path,
        name: String,
        slots: usize,
        slot_bytes: usize,
    ) -> Result<Arena, KvError> {
        let path = root.join(&name);
        let slot_bytes = slot_bytes.div_ceil(PAGE) * PAGE;
        let data_offset = header_bytes(slots);
        let len = slots
            .checked_mul(slot_bytes)
            .and_then(|d| d.checked_add(data_offset))
            .ok_or_else(|| KvError::Config {
                detail: format!("an arena of {slots} slots of {slot_bytes} bytes is too large"),
            })?;
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)
            .map_err(io_err(format!("creating {}", path.display())))?;
        let mut header = vec![0u8; HEADER];
        header[..8].copy_from_slice(ARENA_MAGIC);
        header[8..12].copy_from_slice(&(slots as u32).to_le_bytes());
        header[16..24].copy_from_slice(&(slot_bytes as u64).to_le_bytes());
        header[24..32].copy_from_slice(&(data_offset as u64).to_le_bytes());
        header[H_OWNER_PID..H_OWNER_PID + 4].copy_from_slice(&std::process::id().to_le_bytes());
        header[H_OWNER_PIDNS..H_OWNER_PIDNS + 8].copy_from_slice(&pid_namespace().to_le_bytes());
        let sized = file
            .set_len(len as u64)
            .and_then(|()| file.write_all_at(&header, 0))
            .and_then(|()| super::allocate(&file, 0, data_offset as u64));
        if let Err(e) = sized {
            let _ = std::fs::remove_file(&path);
            return Err(io_err(format!("sizing {}", path.display()))(e));
        }
        let meta = file
            .metadata()
            .map_err(io_err(format!("stat {}", path.display())))?;
        let map = map(&file, &path).inspect_err(|_| {
            let _ = std::fs::remove_file(&path);
        })?;
        Ok(Arena {
            name,
            path,
            file,
            map,
            slots,
            slot_bytes,
            data_offset,
            dev_ino: (meta.dev(), meta.ino()),
            owned: true,
            next_gen: AtomicU64::new(unix_ms() << 16),
            allocated: (0..slots).map(|_| AtomicUsize::new(0)).collect(),
        })
    }

    /// Maps another process's arena `name` in `root` to read from it: a
    /// regular file of this user nobody else may write, whose header fits
    /// its length.
    pub(super) fn open(root: &Path, name: &str) -> Result<Arena, KvError> {
        let path = root.join(name);
        let corrupt = |detail: String| KvError::Protocol {
            transport: NAME,
            peer: path.display().to_string(),
            detail,
        };
        if !valid_name(name) {
            return Err(corrupt(format!("`{name}` is not an arena's name")));
        }
        // O_NOFOLLOW: a symlink is refused; O_NONBLOCK: a FIFO cannot block.
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(&path)
            .map_err(|e| {
                let what = if e.raw_os_error() == Some(libc::ELOOP) {
                    format!(
                        "refusing {}: it is a symlink (never followed)",
                        path.display()
                    )
                } else {
                    format!("opening {}", path.display())
                };
                io_err(what)(e)
            })?;
        let meta = file
            .metadata()
            .map_err(io_err(format!("stat {}", path.display())))?;
        check_own_file(&path, &meta)?;
        let mut header = [0u8; HEADER];
        file.read_exact_at(&mut header, 0)
            .map_err(io_err(format!("reading {}", path.display())))?;
        if &header[..8] != ARENA_MAGIC {
            return Err(corrupt("bad arena magic".into()));
        }
        let u64_at = |o: usize| u64::from_le_bytes(header[o..o + 8].try_into().expect("8 bytes"));
        let slots = u32::from_le_bytes(header[8..12].try_into().expect("4 bytes")) as usize;
        let (slot_bytes, data_offset) = (u64_at(16) as usize, u64_at(24) as usize);
        let fits = slots <= crate::config::MAX_SHM_SLOTS
            && data_offset == header_bytes(slots)
            && slots
                .checked_mul(slot_bytes)
                .and_then(|d| d.checked_add(data_offset))
                == Some(meta.len() as usize);
        if !fits {
            return Err(corrupt(format!(
                "header ({slots} slots of {slot_bytes} bytes at {data_offset}) does not fit a file of {} bytes",
                meta.len()
            )));
        }
        let map = map(&file, &path)?;
        Ok(Arena {
            name: name.to_string(),
            path,
            file,
            map,
            slots,
            slot_bytes,
            data_offset,
            dev_ino: (meta.dev(), meta.ino()),
            owned: false,
            next_gen: AtomicU64::new(0),
            allocated: Vec::new(),
        })
    }

    /// The file's name inside the root.
    pub(super) fn name(&self) -> &str {
        &self.name
    }

    /// Bytes of each slot.
    pub(super) fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// Slots.
    pub(super) fn slots(&self) -> usize {
        self.slots
    }

    /// Whether the file at `path` (looked up now) is still this arena's.
    pub(super) fn is_current(&self) -> bool {
        std::fs::symlink_metadata(&self.path).is_ok_and(|m| (m.dev(), m.ino()) == self.dev_ino)
    }

    fn entry<T>(&self, slot: usize, field: usize) -> &T {
        assert!(slot < self.slots, "slot {slot} out of range");
        let at = HEADER + ENTRY * slot + field;
        // SAFETY: `at` lies inside the header page(s) of the mapping, which
        // lives as long as `self`; entries are 64-byte aligned in a
        // page-aligned mapping and the fields are naturally aligned, and
        // these words are only ever accessed atomically (in every process).
        unsafe { &*self.map.as_ptr().add(at).cast::<T>() }
    }

    fn state(&self, slot: usize) -> &AtomicU32 {
        self.entry(slot, E_STATE)
    }

    fn gen_of(&self, slot: usize) -> &AtomicU64 {
        self.entry(slot, E_GEN)
    }

    /// Start of slot `slot`'s bytes in the mapping.
    pub(super) fn slot_ptr(&self, slot: usize) -> *mut u8 {
        assert!(slot < self.slots, "slot {slot} out of range");
        // SAFETY: the offset is inside the mapping (checked at create/open:
        // `data_offset + slots × slot_bytes` is the file's length).
        unsafe {
            self.map
                .as_mut_ptr()
                .add(self.data_offset + slot * self.slot_bytes)
        }
    }

    /// The owner takes a free slot for `bytes` bytes (allocated on the
    /// slot's first use of them, so a full disk is an error here and never
    /// a fault while writing): its index and fresh generation. `None`:
    /// none free.
    pub(super) fn take(
        &self,
        bytes: usize,
        disk: &dyn ShmWriter,
    ) -> Result<Option<(usize, u64)>, io::Error> {
        for slot in 0..self.slots {
            if self
                .state(slot)
                .compare_exchange(FREE, WRITING, Ordering::Acquire, Ordering::Relaxed)
                .is_ok()
            {
                // Only the first use of a slot's bytes allocates them.
                if self.allocated[slot].load(Ordering::Relaxed) < bytes {
                    let at = self.data_offset + slot * self.slot_bytes;
                    if let Err(e) = disk.allocate(&self.file, at as u64, bytes as u64) {
                        self.state(slot).store(FREE, Ordering::Release);
                        return Err(e);
                    }
                    self.allocated[slot].store(bytes, Ordering::Relaxed);
                }
                let generation = self.next_gen.fetch_add(1, Ordering::Relaxed);
                self.gen_of(slot).store(generation, Ordering::Relaxed);
                return Ok(Some((slot, generation)));
            }
        }
        Ok(None)
    }

    /// The owner publishes a written slot (`WRITING → READY`).
    pub(super) fn ready(&self, slot: usize, generation: u64) -> bool {
        self.entry::<AtomicU64>(slot, E_PUBLISHED_MS)
            .store(unix_ms(), Ordering::Relaxed);
        self.gen_of(slot).load(Ordering::Relaxed) == generation
            && self
                .state(slot)
                .compare_exchange(WRITING, READY, Ordering::Release, Ordering::Relaxed)
                .is_ok()
    }

    /// Frees slot `slot` of `generation` if it is in state `from`.
    fn free_from(&self, slot: usize, generation: u64, from: u32) -> bool {
        self.gen_of(slot).load(Ordering::Acquire) == generation
            && self
                .state(slot)
                .compare_exchange(from, FREE, Ordering::Release, Ordering::Relaxed)
                .is_ok()
    }

    /// Frees an unpublished slot (a reserve given up).
    pub(super) fn abandon(&self, slot: usize, generation: u64) -> bool {
        self.free_from(slot, generation, WRITING) || self.free_from(slot, generation, READY)
    }

    /// Frees a published, unread slot (a release).
    pub(super) fn release(&self, slot: usize, generation: u64) -> bool {
        self.free_from(slot, generation, READY)
    }

    /// A reader claims slot `slot` of `generation` (`READY → READING`).
    pub(super) fn claim(&self, slot: usize, generation: u64) -> bool {
        if slot >= self.slots || self.gen_of(slot).load(Ordering::Acquire) != generation {
            return false;
        }
        if self
            .state(slot)
            .compare_exchange(READY, READING, Ordering::AcqRel, Ordering::Relaxed)
            .is_err()
        {
            return false;
        }
        if self.gen_of(slot).load(Ordering::Acquire) != generation {
            // Another use of the slot, READY before the swap: put it back.
            self.state(slot).store(READY, Ordering::Release);
            return false;
        }
        self.entry::<AtomicU32>(slot, E_PID)
            .store(std::process::id(), Ordering::Relaxed);
        self.entry::<AtomicU64>(slot, E_PIDNS)
            .store(pid_namespace(), Ordering::Relaxed);
        true
    }

    /// A reader lets go of its slot (`READING → FREE`).
    pub(super) fn done_reading(&self, slot: usize, generation: u64) {
        self.free_from(slot, generation, READING);
    }

    /// Slots not free.
    pub(super) fn busy(&self) -> usize {
        (0..self.slots)
            .filter(|&s| self.state(s).load(Ordering::Acquire) != FREE)
            .count()
    }

    /// The owner's sweep: frees slots published longer than `ttl` ago and
    /// never read, and slots whose reader (in this PID namespace) is gone;
    /// touches the file so that no sweeper takes a live arena for stale.
    /// Returns the slots freed.
    pub(super) fn sweep(&self, ttl: Duration) -> usize {
        let _ = self.file.set_modified(SystemTime::now());
        let now = unix_ms();
        let ns = pid_namespace();
        let mut freed = 0;
        for slot in 0..self.slots {
            let generation = self.gen_of(slot).load(Ordering::Acquire);
            let published = self
                .entry::<AtomicU64>(slot, E_PUBLISHED_MS)
                .load(Ordering::Relaxed);
            let stale = now.saturating_sub(published) >= ttl.as_millis() as u64;
            match self.state(slot).load(Ordering::Acquire) {
                READY if stale => freed += usize::from(self.release(slot, generation)),
                READING => {
                    let pid = self.entry::<AtomicU32>(slot, E_PID).load(Ordering::Relaxed);
                    let their_ns = self
                        .entry::<AtomicU64>(slot, E_PIDNS)
                        .load(Ordering::Relaxed);
                    if ns != 0 && their_ns == ns && process_gone(pid) {
                        freed += usize::from(self.free_from(slot, generation, READING));
                    }
                }
                _ => {}
            }
        }
        freed
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        if self.owned && self.is_current() {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Maps a whole arena file shared, read-write.
fn map(file: &File, path: &Path) -> Result<memmap2::MmapRaw, KvError> {
    memmap2::MmapOptions::new()
        .map_raw(file)
        .map_err(io_err(format!("mapping {}", path.display())))
}

/// A reader's lease on a claimed slot: lends its first `len` bytes; the
/// slot is freed when the lease goes (with the last [`bytes::Bytes`] of it).
pub(super) struct Lease {
    pub(super) arena: Arc<Arena>,
    pub(super) slot: usize,
    pub(super) generation: u64,
    pub(super) len: usize,
}

impl AsRef<[u8]> for Lease {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: the slot is claimed (`READING`) by this lease: its owner
        // writes a slot only while it holds it as `WRITING`, and frees a
        // `READING` slot only once this process is gone; `len` is at most
        // the slot's size (checked before the lease was made), and the
        // mapping lives as long as the `Arc<Arena>` held here.
        unsafe { std::slice::from_raw_parts(self.arena.slot_ptr(self.slot), self.len) }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.arena.done_reading(self.slot, self.generation);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shm::FileWriter;

    #[test]
    fn names_are_checked() {
        assert!(valid_name("arena.123.0.kva"));
        for bad in [
            "../arena.1.kva",
            "arena.1.kv",
            ".arena.1.kva",
            "arena/1.kva",
        ] {
            assert!(!valid_name(bad), "{bad}");
        }
    }

    #[test]
    fn a_slot_goes_round_once_per_generation() {
        let dir = tempfile::tempdir().unwrap();
        let a = Arena::create(dir.path(), "arena.1.0.kva".into(), 2, 3 * PAGE).unwrap();
        let r = Arena::open(dir.path(), "arena.1.0.kva").unwrap();
        let (s0, g0) = a.take(PAGE, &FileWriter).unwrap().unwrap();
        let (s1, _) = a.take(PAGE, &FileWriter).unwrap().unwrap();
        assert_ne!(s0, s1);
        assert_eq!(a.take(PAGE, &FileWriter).unwrap(), None, "both slots taken");
        assert!(!r.claim(s0, g0), "not published yet");
        assert!(a.ready(s0, g0));
        assert!(!r.claim(s0, g0 + 1), "another generation");
        assert!(r.claim(s0, g0));
        assert!(!r.claim(s0, g0), "claimed once");
        assert!(!a.release(s0, g0), "a slot being read is not released");
        assert_eq!(a.sweep(Duration::ZERO), 0, "its reader lives");
        r.done_reading(s0, g0);
        assert_eq!(a.busy(), 1);
        let (again, g1) = a.take(PAGE, &FileWriter).unwrap().unwrap();
        assert_eq!(again, s0);
        assert_ne!(g1, g0);
        let path = dir.path().join("arena.1.0.kva");
        assert_eq!(busy_slots_in(&path), Some(2), "read from outside");
        assert_eq!(busy_slots_in(dir.path()), None, "not an arena");
        assert!(a.abandon(again, g1));
        assert!(a.abandon(s1, a.gen_of(s1).load(Ordering::Relaxed)));
        assert_eq!(a.busy(), 0);
        assert_eq!(busy_slots_in(&path), Some(0));
        drop(r);
        assert!(path.exists(), "a reader's map leaves the file");
        drop(a);
        assert!(!path.exists(), "the owner's arena goes with it");
    }

    #[test]
    fn a_slot_whose_reader_died_is_reclaimed_and_a_live_ones_is_not() {
        let dir = tempfile::tempdir().unwrap();
        let a = Arena::create(dir.path(), "arena.4.0.kva".into(), 1, PAGE).unwrap();
        let (s, g) = a.take(PAGE, &FileWriter).unwrap().unwrap();
        assert!(a.ready(s, g));
        assert!(a.claim(s, g));
        assert_eq!(a.sweep(Duration::ZERO), 0, "this process reads it");
        // A reader in another PID namespace is never judged by its PID.
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        a.entry::<AtomicU32>(s, E_PID)
            .store(dead, Ordering::Relaxed);
        a.entry::<AtomicU64>(s, E_PIDNS).store(1, Ordering::Relaxed);
        assert_eq!(a.sweep(Duration::ZERO), 0, "another namespace");
        a.entry::<AtomicU64>(s, E_PIDNS)
            .store(pid_namespace(), Ordering::Relaxed);
        assert_eq!(a.sweep(Duration::ZERO), 1, "its reader is gone");
        assert_eq!(a.busy(), 0);
    }

    #[test]
    fn an_arena_is_orphaned_only_when_its_owner_is_gone_or_it_idled_long() {
        let dir = tempfile::tempdir().unwrap();
        let a = Arena::create(dir.path(), "arena.5.0.kva".into(), 1, PAGE).unwrap();
        let path = dir.path().join("arena.5.0.kva");
        assert!(!orphaned(&path, Duration::from_secs(61)), "its owner lives");
        assert!(orphaned(&path, ARENA_IDLE), "idle too long");
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        a.file
            .write_all_at(&dead.to_le_bytes(), H_OWNER_PID as u64)
            .unwrap();
        assert!(orphaned(&path, Duration::from_secs(1)), "its owner is gone");
        a.file
            .write_all_at(&1u64.to_le_bytes(), H_OWNER_PIDNS as u64)
            .unwrap();
        assert!(
            !orphaned(&path, Duration::from_secs(1)),
            "another namespace: judged by idleness alone"
        );
    }

    #[test]
    fn unread_slots_are_swept_after_the_ttl() {
        let dir = tempfile::tempdir().unwrap();
        let a = Arena::create(dir.path(), "arena.2.0.kva".into(), 1, PAGE).unwrap();
        let (s, g) = a.take(PAGE, &FileWriter).unwrap().unwrap();
        assert!(a.ready(s, g));
        assert_eq!(a.sweep(Duration::from_secs(60)), 0);
        assert_eq!(a.sweep(Duration::ZERO), 1);
        assert_eq!(a.busy(), 0);
    }

    #[test]
    fn a_mangled_header_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let a = Arena::create(dir.path(), "arena.3.0.kva".into(), 1, PAGE).unwrap();
        a.file.write_all_at(&[9u8; 4], 8).unwrap();
        let err = Arena::open(dir.path(), "arena.3.0.kva").unwrap_err();
        assert!(err.to_string().contains("does not fit"), "{err}");
        let err = Arena::open(dir.path(), "arena.9.0.kv").unwrap_err();
        assert!(err.to_string().contains("not an arena"), "{err}");
    }
}
