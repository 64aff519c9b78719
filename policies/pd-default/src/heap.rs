//! The module's heap in wasm: small blocks from per-size free lists, the rest
//! from the standard allocator.
//!
//! A decision allocates a handful of small blocks and frees them again: the
//! HTTP context, and the three buffers the host returns through the
//! module's exported allocator (the ABI has the host allocate every returned
//! value in guest memory: endpoints version, prompt tokens, request body).
//! Rust's wasm allocator (dlmalloc) coalesces and sorts freed chunks by size,
//! which in Cranelift-compiled code is about a twentieth of a decision. Here
//! a block of up to 2 KiB belongs to one of eight power-of-two size classes
//! for its whole life: allocating pops the class's free list, freeing pushes
//! onto it, and a list that is empty is refilled from the standard allocator
//! one block at a time. Blocks are never returned to the standard allocator;
//! what the module holds is its peak use per class (the host's memory cap
//! bounds it like any other growth).
//!
//! On wasm32 without threads, [`SizeClasses`] over [`std::alloc::System`] is
//! the module's global allocator, so it backs the ABI's `malloc` /
//! `proxy_on_memory_allocate` exports too. Natively (the benchmark's in-process
//! baseline) the process keeps its own allocator; the tests below run the type
//! natively as a plain value.

use std::alloc::{GlobalAlloc, Layout};
use std::cell::Cell;
use std::ptr;

/// Size classes: 16, 32, ..., 2048 bytes.
const CLASSES: usize = 8;
/// The smallest block (and the alignment of every block).
const MIN: usize = 16;
/// The largest block served from a free list.
const MAX: usize = MIN << (CLASSES - 1);

/// The class serving `size` bytes at `align`, if any.
fn class(size: usize, align: usize) -> Option<usize> {
    if align > MIN || size > MAX {
        return None;
    }
    let size = size.max(MIN);
    // ceil(log2(size)) - log2(MIN)
    Some((usize::BITS - (size - 1).leading_zeros()) as usize - MIN.trailing_zeros() as usize)
}

/// The layout of a class's blocks (always `Some` for a class below
/// `CLASSES`: a power-of-two size up to `MAX`, aligned to 16).
fn block(class: usize) -> Option<Layout> {
    Layout::from_size_align(MIN << class, MIN).ok()
}

/// Size-class free lists in front of a fallback allocator (see the module
/// docs). Not thread-safe: it is `Sync` only where a module has one thread.
pub struct SizeClasses<A> {
    fallback: A,
    /// The head of each class's free list (null: empty). A free block holds
    /// the pointer to the next one in its first bytes.
    heads: [Cell<*mut u8>; CLASSES],
}

impl<A: GlobalAlloc> SizeClasses<A> {
    /// Empty free lists over `fallback`.
    pub const fn new(fallback: A) -> Self {
        SizeClasses {
            fallback,
            heads: [const { Cell::new(ptr::null_mut()) }; CLASSES],
        }
    }
}

// SAFETY: a wasm32 module built without the `atomics` feature has exactly one
// thread, so the free lists (plain `Cell`s) are never touched concurrently.
#[cfg(all(target_family = "wasm", not(target_feature = "atomics")))]
unsafe impl<A: Sync> Sync for SizeClasses<A> {}

// SAFETY: every block handed out is either the fallback's own (for layouts
// no class serves, returned to the fallback with the same layout) or a block
// of `block(c)`: at least `layout.size()` bytes, aligned to 16 >= the
// requested alignment, owned by exactly one user between `alloc` and
// `dealloc` (it leaves its free list when handed out and re-enters it only
// when freed). The class of a pointer is recomputed from the layout the
// caller must pass back unchanged, so a block always returns to its list.
unsafe impl<A: GlobalAlloc> GlobalAlloc for SizeClasses<A> {
    #[inline(never)]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let Some(c) = class(layout.size(), layout.align()) else {
            // SAFETY: the caller's layout is passed through unchanged.
            return unsafe { self.fallback.alloc(layout) };
        };
        let head = self.heads[c].get();
        if head.is_null() {
            let Some(block) = block(c) else {
                return ptr::null_mut();
            };
            // SAFETY: `block` has a non-zero size.
            return unsafe { self.fallback.alloc(block) };
        }
        // SAFETY: `head` is a free block of this class (at least 16 bytes,
        // 16-aligned) whose first bytes hold the next free block.
        let next = unsafe { head.cast::<*mut u8>().read() };
        self.heads[c].set(next);
        head
    }

    #[inline(never)]
    unsafe fn dealloc(&self, p: *mut u8, layout: Layout) {
        let Some(c) = class(layout.size(), layout.align()) else {
            // SAFETY: `p` came from the fallback with this same layout.
            return unsafe { self.fallback.dealloc(p, layout) };
        };
        // SAFETY: `p` is a block of class `c` the caller no longer uses; it
        // is 16-aligned and at least 16 bytes, room for the link.
        unsafe { p.cast::<*mut u8>().write(self.heads[c].get()) };
        self.heads[c].set(p);
    }

    unsafe fn realloc(&self, p: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let (old, new) = (
            class(layout.size(), layout.align()),
            class(new_size, layout.align()),
        );
        match (old, new) {
            // The block already has room for the new size.
            (Some(a), Some(b)) if a == b => p,
            // SAFETY: both sizes are the fallback's; the caller's contract
            // (same layout, valid new size) is passed through.
            (None, None) => unsafe { self.fallback.realloc(p, layout, new_size) },
            _ => {
                // SAFETY: the caller guarantees `new_size` rounded up to the
                // alignment does not overflow, so this layout is valid.
                let to = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
                // SAFETY: `to` has a non-zero size (the caller's contract).
                let q = unsafe { self.alloc(to) };
                if !q.is_null() {
                    // SAFETY: `p` holds `layout.size()` valid bytes, `q` has
                    // room for `new_size`; two live blocks never overlap.
                    unsafe { ptr::copy_nonoverlapping(p, q, layout.size().min(new_size)) };
                    // SAFETY: `p` was allocated with `layout` and is no
                    // longer used.
                    unsafe { self.dealloc(p, layout) };
                }
                q
            }
        }
    }
}

/// The module's allocator in wasm (see the module docs).
#[cfg(all(target_family = "wasm", not(target_feature = "atomics")))]
#[global_allocator]
static HEAP: SizeClasses<std::alloc::System> = SizeClasses::new(std::alloc::System);

#[cfg(test)]
mod tests {
    use super::*;
    use std::alloc::System;

    #[test]
    fn classes_cover_sizes_by_powers_of_two() {
        assert_eq!(class(1, 1), Some(0));
        assert_eq!(class(16, 8), Some(0));
        assert_eq!(class(17, 1), Some(1));
        assert_eq!(class(450, 1), Some(5));
        assert_eq!(class(512, 1), Some(5));
        assert_eq!(class(513, 1), Some(6));
        assert_eq!(class(MAX, 16), Some(CLASSES - 1));
        assert_eq!(class(MAX + 1, 1), None);
        assert_eq!(
            class(8, 32),
            None,
            "over-aligned layouts go to the fallback"
        );
        for c in 0..CLASSES {
            let block = block(c).expect("every class has a block layout");
            assert_eq!(class(block.size(), 1), Some(c));
            assert_eq!(block.align(), MIN);
        }
    }

    /// Allocates, fills, frees and reallocates blocks of many sizes: every
    /// block is aligned, keeps its bytes, is reused after a free, and two
    /// live blocks never overlap.
    #[test]
    fn blocks_are_aligned_reused_and_disjoint() {
        let heap = SizeClasses::new(System);
        let sizes = [1usize, 7, 16, 24, 100, 450, 512, 513, 2048, 2049, 10_000];
        let mut live: Vec<(*mut u8, Layout)> = Vec::new();
        for round in 0..3u8 {
            for (i, &size) in sizes.iter().enumerate() {
                let layout = Layout::from_size_align(size, if i % 2 == 0 { 1 } else { 8 }).unwrap();
                // SAFETY: non-zero size.
                let p = unsafe { heap.alloc(layout) };
                assert!(!p.is_null());
                assert_eq!(p as usize % layout.align(), 0);
                // SAFETY: `p` has room for `size` bytes.
                unsafe { ptr::write_bytes(p, round.wrapping_mul(31).wrapping_add(i as u8), size) };
                live.push((p, layout));
            }
            // No two live blocks overlap.
            let mut spans: Vec<(usize, usize)> = live
                .iter()
                .map(|(p, l)| (*p as usize, *p as usize + l.size()))
                .collect();
            spans.sort();
            assert!(spans.windows(2).all(|w| w[0].1 <= w[1].0));
            // Every live block still holds what was written to it.
            for (j, (p, l)) in live.iter().enumerate() {
                let want = (j / sizes.len()) as u8;
                let fill = want.wrapping_mul(31).wrapping_add((j % sizes.len()) as u8);
                // SAFETY: `p` is live with `l.size()` initialized bytes.
                let bytes = unsafe { std::slice::from_raw_parts(*p, l.size()) };
                assert!(bytes.iter().all(|&b| b == fill), "block {j} changed");
            }
        }
        // A freed block is the next one its class hands out.
        let (p, l) = live.remove(5);
        // SAFETY: `p` was allocated with `l` and is not used again.
        unsafe { heap.dealloc(p, l) };
        // SAFETY: non-zero size.
        let q = unsafe { heap.alloc(Layout::from_size_align(400, 1).unwrap()) };
        assert_eq!(p, q, "450 and 400 bytes share the 512-byte class");
        live.push((q, Layout::from_size_align(400, 1).unwrap()));
        for (p, l) in live {
            // SAFETY: each block was allocated with its layout.
            unsafe { heap.dealloc(p, l) };
        }
    }

    #[test]
    fn realloc_keeps_bytes_and_stays_in_place_within_a_class() {
        let heap = SizeClasses::new(System);
        let l = Layout::from_size_align(20, 1).unwrap();
        // SAFETY: non-zero size.
        let p = unsafe { heap.alloc(l) };
        // SAFETY: 20 bytes of room.
        unsafe { ptr::copy_nonoverlapping(b"abcdefghijklmnopqrst".as_ptr(), p, 20) };
        // SAFETY: `p` was allocated with `l`; 30 bytes is a valid size.
        let same = unsafe { heap.realloc(p, l, 30) };
        assert_eq!(same, p, "20 and 30 bytes are both in the 32-byte class");
        // SAFETY: as above, now growing past the class, then past the classes.
        let grown = unsafe { heap.realloc(same, Layout::from_size_align(30, 1).unwrap(), 1000) };
        // SAFETY: as above.
        let big = unsafe { heap.realloc(grown, Layout::from_size_align(1000, 1).unwrap(), 5000) };
        // SAFETY: the first 20 bytes were carried over each time.
        let head = unsafe { std::slice::from_raw_parts(big, 20) };
        assert_eq!(head, b"abcdefghijklmnopqrst");
        // SAFETY: shrinking back into a class, then freeing with that layout.
        let small = unsafe { heap.realloc(big, Layout::from_size_align(5000, 1).unwrap(), 20) };
        // SAFETY: 20 bytes were carried over.
        let back = unsafe { std::slice::from_raw_parts(small, 20) };
        assert_eq!(back, b"abcdefghijklmnopqrst");
        // SAFETY: allocated (last) with size 20, align 1.
        unsafe { heap.dealloc(small, l) };
    }
}
