//! The five WASI preview-1 functions a `wasm32-wasip1` guest imports, as
//! stubs with no capabilities: no entropy (deterministic filler), no
//! environment, stdout/stderr into the log (at most
//! [`SandboxLimits::max_log_bytes`](crate::SandboxLimits::max_log_bytes) of
//! one write, the rest dropped; lines past the runtime's log rate dropped
//! and counted), `proc_exit` traps.

use super::logging::MAX_KEPT_ERRORS;
use super::memory::{read, write};
use super::time::now_nanos;
use super::{Cx, Hostcall};

/// The WASI import module.
const WASI: &str = "wasi_snapshot_preview1";

/// WASI `errno` for "bad file descriptor".
const WASI_EBADF: i32 = 8;

/// The WASI functions.
pub(super) const HOSTCALLS: &[Hostcall] = hostcalls![WASI =>
    random_get,
    environ_sizes_get,
    environ_get,
    fd_write,
    proc_exit,
];

fn random_get(mut cx: Cx<'_>, p: u32, l: u32) -> wasmtime::Result<i32> {
    // Deterministic filler: the sandbox offers no entropy source. Only
    // hash-map seeding in the guest's std reads this.
    let mut seed = now_nanos() | 1;
    let bytes: Vec<u8> = (0..l)
        .map(|_| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed as u8
        })
        .collect();
    Ok(write(&mut cx, p, &bytes).map_or(WASI_EBADF, |_| 0))
}

fn environ_sizes_get(mut cx: Cx<'_>, count: u32, size: u32) -> wasmtime::Result<i32> {
    let ok = write(&mut cx, count, &0u32.to_le_bytes())
        .and_then(|_| write(&mut cx, size, &0u32.to_le_bytes()));
    Ok(if ok.is_ok() { 0 } else { WASI_EBADF })
}

fn environ_get(_: Cx<'_>, _: u32, _: u32) -> wasmtime::Result<i32> {
    Ok(0)
}

fn fd_write(mut cx: Cx<'_>, fd: u32, iovs: u32, n: u32, written: u32) -> wasmtime::Result<i32> {
    // stdout/stderr go to the log (a panicking guest prints its message here);
    // no other descriptor exists.
    if fd != 1 && fd != 2 {
        return Ok(WASI_EBADF);
    }
    // The guest is told everything was written (an error would turn a
    // print into a guest panic); the host keeps at most `log_bytes` of it.
    let cap = cx.data().caps.log_bytes;
    let mut total = 0u32;
    let mut text = Vec::new();
    for i in 0..n.min(64) {
        let Ok(iov) = read(&cx, iovs.wrapping_add(i * 8), 8) else {
            return Ok(WASI_EBADF);
        };
        let p = u32::from_le_bytes([iov[0], iov[1], iov[2], iov[3]]);
        let l = u32::from_le_bytes([iov[4], iov[5], iov[6], iov[7]]).min(64 * 1024);
        let keep = (l as usize).min(cap - text.len()) as u32;
        let Ok(chunk) = read(&cx, p, keep) else {
            return Ok(WASI_EBADF);
        };
        total = total.saturating_add(l);
        text.extend_from_slice(&chunk);
    }
    if (total as usize) > text.len() {
        cx.data().env.caps.log_size.inc();
    }
    let line = String::from_utf8_lossy(&text).trim_end().to_string();
    if !line.is_empty() {
        if cx.data().env.log_bucket.take() {
            tracing::warn!(target: "policy_guest", fd, "{line}");
        } else {
            cx.data().env.caps.log_rate.inc();
        }
        let errors = &mut cx.data_mut().errors;
        if errors.len() < MAX_KEPT_ERRORS {
            errors.push(line);
        }
    }
    Ok(write(&mut cx, written, &total.to_le_bytes()).map_or(WASI_EBADF, |_| 0))
}

fn proc_exit(_: Cx<'_>, code: u32) -> wasmtime::Result<()> {
    Err(wasmtime::format_err!("guest called proc_exit({code})"))
}
