//! Guest memory access for the hostcalls: bounds-checked reads and writes,
//! and [`give_from`] / [`give`], which hand host data to the guest in memory
//! the guest allocates. A bad pointer or length is `InvalidMemoryAccess`,
//! never a host fault.

use super::{Cx, HostState};
use crate::codes::status;

/// A guest memory range, bounds-checked.
pub(super) fn range(len_of_memory: usize, ptr: u32, len: u32) -> Option<std::ops::Range<usize>> {
    let start = ptr as usize;
    let end = start.checked_add(len as usize)?;
    (end <= len_of_memory).then_some(start..end)
}

/// Copies a guest memory range out.
pub(super) fn read(cx: &Cx<'_>, ptr: u32, len: u32) -> Result<Vec<u8>, u32> {
    let mem = cx.data().memory.ok_or(status::INTERNAL_FAILURE)?;
    let data = mem.data(cx);
    let r = range(data.len(), ptr, len).ok_or(status::INVALID_MEMORY_ACCESS)?;
    Ok(data[r].to_vec())
}

/// [`read`] as UTF-8 (`BadArgument` if it is not).
pub(super) fn read_str(cx: &Cx<'_>, ptr: u32, len: u32) -> Result<String, u32> {
    String::from_utf8(read(cx, ptr, len)?).map_err(|_| status::BAD_ARGUMENT)
}

/// Writes `bytes` into guest memory at `ptr`.
pub(super) fn write(cx: &mut Cx<'_>, ptr: u32, bytes: &[u8]) -> Result<(), u32> {
    let mem = cx.data().memory.ok_or(status::INTERNAL_FAILURE)?;
    let data = mem.data_mut(cx);
    let r = range(data.len(), ptr, bytes.len() as u32).ok_or(status::INVALID_MEMORY_ACCESS)?;
    data[r].copy_from_slice(bytes);
    Ok(())
}

/// Copies what `select` picks out of the host state into guest memory the
/// guest allocates (`malloc` / `proxy_on_memory_allocate`) and stores pointer
/// and length at the two return slots; `None` from `select` is `NotFound`.
/// Empty data stores a null pointer. No host-side copy is made: `select` runs
/// once to size the allocation and once more to copy; if the guest's
/// allocator changed the selected data in between (it may call back into the
/// host), the call fails instead of writing a mismatched length.
pub(super) fn give_from(
    cx: &mut Cx<'_>,
    ret_ptr: u32,
    ret_len: u32,
    select: impl Fn(&HostState) -> Option<&[u8]>,
) -> wasmtime::Result<u32> {
    let Some(mem) = cx.data().memory else {
        return Ok(status::INTERNAL_FAILURE);
    };
    let size = mem.data_size(&*cx);
    if range(size, ret_ptr, 4).is_none() || range(size, ret_len, 4).is_none() {
        return Ok(status::INVALID_MEMORY_ACCESS);
    }
    let Some(n) = select(cx.data()).map(<[u8]>::len) else {
        return Ok(status::NOT_FOUND);
    };
    let Ok(len) = u32::try_from(n) else {
        return Ok(status::BAD_ARGUMENT);
    };
    let ptr = if n == 0 {
        0
    } else {
        // Taken out for the call (not cloned: a clone of a typed function
        // touches wasmtime's type registry); a re-entrant hostcall from the
        // allocator finds it absent and fails cleanly.
        let Some(alloc) = cx.data_mut().alloc.take() else {
            return Ok(status::INTERNAL_FAILURE);
        };
        let called = alloc.call(&mut *cx, len);
        cx.data_mut().alloc = Some(alloc);
        let p = called?;
        if p == 0 {
            return Ok(status::INTERNAL_FAILURE);
        }
        p
    };
    // One view of memory for the copy and both return slots (the allocator
    // may have grown memory, never shrunk it: the slots are still in bounds,
    // and are checked again anyway).
    let (data, st) = mem.data_and_store_mut(&mut *cx);
    if n > 0 {
        let Some(bytes) = select(st).filter(|b| b.len() == n) else {
            return Ok(status::INTERNAL_FAILURE);
        };
        let Some(r) = range(data.len(), ptr, len) else {
            return Ok(status::INVALID_MEMORY_ACCESS);
        };
        data[r].copy_from_slice(bytes);
    }
    let (Some(rp), Some(rl)) = (range(data.len(), ret_ptr, 4), range(data.len(), ret_len, 4))
    else {
        return Ok(status::INVALID_MEMORY_ACCESS);
    };
    data[rp].copy_from_slice(&ptr.to_le_bytes());
    data[rl].copy_from_slice(&len.to_le_bytes());
    Ok(status::OK)
}

/// [`give_from`] for bytes the caller built.
pub(super) fn give(
    cx: &mut Cx<'_>,
    bytes: Vec<u8>,
    ret_ptr: u32,
    ret_len: u32,
) -> wasmtime::Result<u32> {
    cx.data_mut().scratch = bytes;
    let r = give_from(cx, ret_ptr, ret_len, |st| Some(&st.scratch));
    cx.data_mut().scratch = Vec::new();
    r
}

/// Runs `f` on a guest memory range without copying it.
pub(super) fn with_guest<T>(
    cx: &Cx<'_>,
    ptr: u32,
    len: u32,
    f: impl FnOnce(&[u8], &HostState) -> T,
) -> Result<T, u32> {
    let mem = cx.data().memory.ok_or(status::INTERNAL_FAILURE)?;
    let data = mem.data(cx);
    let r = range(data.len(), ptr, len).ok_or(status::INVALID_MEMORY_ACCESS)?;
    Ok(f(&data[r], cx.data()))
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::range;

    proptest! {
        /// Any guest pointer and length: a range inside memory or none,
        /// never a panic or a wrapped range.
        #[test]
        fn ranges_stay_inside_memory(memory in 0usize..(1 << 33), ptr: u32, len: u32) {
            match range(memory, ptr, len) {
                Some(r) => {
                    prop_assert_eq!(r.start, ptr as usize);
                    prop_assert_eq!(r.len(), len as usize);
                    prop_assert!(r.end <= memory);
                }
                None => prop_assert!(ptr as usize + len as usize > memory),
            }
        }
    }
}
