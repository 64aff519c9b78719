//! The host arena of `nixl-ucx`: one anonymous mapping per transport
//! (`AIRM_KV_UCX_POOL_MB`), registered with NIXL once, carved into extents
//! by a first-fit allocator. Extents are handed out as [`Extent`] guards that
//! give their range back when dropped, so an extent cannot outlive its owner
//! or be freed twice.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use memmap2::MmapMut;

/// Allocation granularity (bytes): every extent starts on a page.
pub const ALIGN: usize = 4096;

/// Bytes copied and checksummed at a time by [`Extent::write_crc`] and
/// [`Extent::read_crc`] (fits in L2 with room to spare).
pub const CHUNK: usize = 64 << 10;

/// The mapped, registrable memory and its free list.
pub struct Arena {
    /// Owns the memory (NIXL registered `base..base + len`).
    _map: MmapMut,
    base: usize,
    len: usize,
    free: Mutex<Free>,
}

#[derive(Debug, Default)]
struct Free {
    /// Free ranges: offset → length, never adjacent (coalesced).
    ranges: BTreeMap<usize, usize>,
    /// Extents handed out and not yet returned.
    in_use: usize,
}

impl std::fmt::Debug for Arena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Arena")
            .field("base", &format_args!("{:#x}", self.base))
            .field("len", &self.len)
            .field("in_use", &self.in_use())
            .finish()
    }
}

/// A range of the arena owned by one push or pull; given back on drop.
pub struct Extent {
    arena: Arc<Arena>,
    off: usize,
    cap: usize,
    len: usize,
}

impl std::fmt::Debug for Extent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Extent")
            .field("off", &self.off)
            .field("len", &self.len)
            .finish()
    }
}

impl Arena {
    /// Maps `len` bytes (rounded up to [`ALIGN`]) of anonymous memory.
    pub fn new(len: usize) -> std::io::Result<Arc<Arena>> {
        let len = len.div_ceil(ALIGN).max(1) * ALIGN;
        let mut map = MmapMut::map_anon(len)?;
        let base = map.as_mut_ptr() as usize;
        let mut ranges = BTreeMap::new();
        ranges.insert(0, len);
        Ok(Arc::new(Arena {
            _map: map,
            base,
            len,
            free: Mutex::new(Free { ranges, in_use: 0 }),
        }))
    }

    /// Address of the first byte (what NIXL registers).
    pub fn base(&self) -> usize {
        self.base
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the arena has no bytes (never: at least one page is mapped).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Extents handed out and not yet returned.
    pub fn in_use(&self) -> usize {
        self.free.lock().unwrap_or_else(|p| p.into_inner()).in_use
    }

    /// Bytes free (possibly fragmented).
    pub fn free_bytes(&self) -> usize {
        let f = self.free.lock().unwrap_or_else(|p| p.into_inner());
        f.ranges.values().sum()
    }

    /// An extent of at least `len` bytes (first fit), or `None` if no free
    /// range is that large.
    pub fn alloc(self: &Arc<Self>, len: usize) -> Option<Extent> {
        let cap = len.div_ceil(ALIGN).max(1) * ALIGN;
        let mut f = self.free.lock().unwrap_or_else(|p| p.into_inner());
        let (&off, &have) = f.ranges.iter().find(|&(_, &have)| have >= cap)?;
        f.ranges.remove(&off);
        if have > cap {
            f.ranges.insert(off + cap, have - cap);
        }
        f.in_use += 1;
        Some(Extent {
            arena: self.clone(),
            off,
            cap,
            len,
        })
    }

    fn give_back(&self, off: usize, cap: usize) {
        let mut f = self.free.lock().unwrap_or_else(|p| p.into_inner());
        f.in_use -= 1;
        let (mut start, mut len) = (off, cap);
        if let Some((&prev, &plen)) = f.ranges.range(..off).next_back()
            && prev + plen == off
        {
            f.ranges.remove(&prev);
            start = prev;
            len += plen;
        }
        if let Some(&nlen) = f.ranges.get(&(off + cap)) {
            f.ranges.remove(&(off + cap));
            len += nlen;
        }
        f.ranges.insert(start, len);
    }
}

impl Extent {
    /// Address of the first byte.
    pub fn addr(&self) -> usize {
        self.arena.base + self.off
    }

    /// Bytes asked for.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the extent holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Copies `src` into the extent at `at`.
    ///
    /// # Panics
    /// If the range does not fit in the extent.
    pub fn write(&mut self, at: usize, src: &[u8]) {
        assert!(at + src.len() <= self.len, "write past the extent");
        // SAFETY: the range lies inside this extent (checked above), which
        // lies inside the live mapping; extents are disjoint, so no other
        // Rust reference aliases it (NIXL reads it only while a descriptor
        // naming it is published, and never writes it).
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), (self.addr() + at) as *mut u8, src.len())
        }
    }

    /// Copies `src` into the extent at `at` and returns its CRC-32, in one
    /// pass: each [`CHUNK`] is checksummed right after it is copied, while it
    /// is still in cache (not a second walk over the blob from memory).
    ///
    /// # Panics
    /// If the range does not fit in the extent.
    pub fn write_crc(&mut self, at: usize, src: &[u8]) -> u32 {
        let mut crc = rngd_kv_wire::Crc32::new();
        let mut off = at;
        for c in src.chunks(CHUNK) {
            self.write(off, c);
            crc.update(c);
            off += c.len();
        }
        crc.finish()
    }

    /// Copies the extent's bytes `at..at + len` into a new buffer and returns
    /// it with its CRC-32, in one pass as [`Extent::write_crc`]. Only call
    /// when no transfer into the extent is in flight.
    ///
    /// # Panics
    /// If the range does not fit in the extent.
    pub fn read_crc(&self, at: usize, len: usize) -> (Bytes, u32) {
        let src = self.slice(at, len);
        let mut out = Vec::with_capacity(len);
        let mut crc = rngd_kv_wire::Crc32::new();
        for c in src.chunks(CHUNK) {
            out.extend_from_slice(c);
            crc.update(&out[out.len() - c.len()..]);
        }
        (Bytes::from(out), crc.finish())
    }

    /// The extent's bytes `at..at + len`. Only call when no transfer into
    /// the extent is in flight.
    ///
    /// # Panics
    /// If the range does not fit in the extent.
    pub fn slice(&self, at: usize, len: usize) -> &[u8] {
        assert!(at + len <= self.len, "read past the extent");
        // SAFETY: inside this extent of the live mapping (kept alive by the
        // Arc); the caller has no transfer writing into it, and the extent
        // is exclusively this guard's.
        unsafe { std::slice::from_raw_parts((self.addr() + at) as *const u8, len) }
    }

    /// Flips one bit of byte `at` (tests: a corrupted slot).
    pub fn flip(&mut self, at: usize) {
        let b = self.slice(at, 1)[0] ^ 0x40;
        self.write(at, &[b]);
    }
}

impl Drop for Extent {
    fn drop(&mut self) {
        self.arena.give_back(self.off, self.cap);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extents_are_disjoint_and_come_back_coalesced() {
        let a = Arena::new(16 * ALIGN).unwrap();
        let x = a.alloc(1).unwrap();
        let y = a.alloc(3 * ALIGN).unwrap();
        let z = a.alloc(ALIGN + 1).unwrap();
        assert_eq!(a.in_use(), 3);
        assert!(x.addr() + ALIGN <= y.addr() && y.addr() + 3 * ALIGN <= z.addr());
        assert_eq!(a.free_bytes(), 10 * ALIGN);
        assert!(a.alloc(11 * ALIGN).is_none(), "larger than what is free");
        drop(y);
        drop(x);
        drop(z);
        assert_eq!((a.in_use(), a.free_bytes()), (0, 16 * ALIGN));
        let all = a.alloc(16 * ALIGN).expect("coalesced back into one range");
        assert_eq!(all.addr(), a.base());
    }

    #[test]
    fn bytes_written_are_read_back() {
        let a = Arena::new(ALIGN).unwrap();
        let mut e = a.alloc(10).unwrap();
        e.write(2, b"abc");
        assert_eq!(e.slice(2, 3), b"abc");
        e.flip(3);
        assert_ne!(e.slice(2, 3), b"abc");
    }

    #[test]
    fn copies_with_crc_match_crc32() {
        let a = Arena::new(4 * CHUNK).unwrap();
        let mut e = a.alloc(3 * CHUNK + 17).unwrap();
        let src: Vec<u8> = (0..2 * CHUNK + 9)
            .map(|i| (i * 7 + i / 251) as u8)
            .collect();
        assert_eq!(e.write_crc(5, &src), rngd_kv_wire::crc32(&src));
        let (back, crc) = e.read_crc(5, src.len());
        assert_eq!((&back[..], crc), (&src[..], rngd_kv_wire::crc32(&src)));
        assert_eq!(e.read_crc(0, 0).1, rngd_kv_wire::crc32(&[]));
    }
}
