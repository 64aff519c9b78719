//! The host side of the proxy-wasm ABI 0.2.1 (HTTP filter subset) on wasmtime:
//! every `env.proxy_*` import a `proxy-wasm` 0.2.5 guest links, plus the five
//! WASI preview-1 functions a `wasm32-wasip1` guest imports (stubs without
//! capabilities). Every guest pointer and length is bounds-checked: a guest
//! that passes garbage gets `InvalidMemoryAccess` (6) and the host stays sound.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use wasmtime::{Caller, Linker, Memory, ResourceLimiter, TypedFunc};

use crate::SandboxLimits;
use crate::request::{Property, RequestState};

use crate::codes::{
    BUFFER_PLUGIN_CONFIGURATION, BUFFER_REQUEST_BODY, BUFFER_VM_CONFIGURATION, MAP_REQUEST_HEADERS,
    status,
};

/// WASI `errno` for "bad file descriptor".
const WASI_EBADF: i32 = 8;

/// Memory cap of a store; records when the guest hit it.
pub(crate) struct Limiter {
    pub memory_bytes: usize,
    pub hit: bool,
}

impl ResourceLimiter for Limiter {
    fn memory_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        if desired > self.memory_bytes {
            self.hit = true;
            // An error (not `Ok(false)`) traps at the `memory.grow`, so a Rust
            // guest's allocation failure is reported as the memory cap.
            return Err(wasmtime::format_err!(
                "guest memory cap of {} bytes reached (asked for {desired})",
                self.memory_bytes
            ));
        }
        Ok(true)
    }

    fn table_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        Ok(desired <= 100_000)
    }
}

/// Per-store host state.
pub(crate) struct HostState {
    pub limiter: Limiter,
    pub memory: Option<Memory>,
    pub alloc: Option<TypedFunc<u32, u32>>,
    pub plugin_config: Arc<[u8]>,
    pub req: RequestState,
    pub max_header_bytes: usize,
    /// Bytes on their way into guest memory (see [`give`]).
    scratch: Vec<u8>,
    metrics: HashMap<u32, (String, u64)>,
    shared: HashMap<String, (Vec<u8>, u32)>,
    /// Last guest log lines at error level (for reports).
    pub errors: Vec<String>,
}

impl HostState {
    /// Fresh state for a new instance.
    pub fn new(limits: &SandboxLimits, plugin_config: Arc<[u8]>) -> Self {
        HostState {
            limiter: Limiter {
                memory_bytes: limits.memory_bytes,
                hit: false,
            },
            memory: None,
            alloc: None,
            plugin_config,
            req: RequestState::default(),
            max_header_bytes: limits.max_header_bytes,
            scratch: Vec::new(),
            metrics: HashMap::new(),
            shared: HashMap::new(),
            errors: Vec::new(),
        }
    }
}

type Cx<'a> = Caller<'a, HostState>;
type R = wasmtime::Result<u32>;

/// A guest memory range, bounds-checked.
fn range(len_of_memory: usize, ptr: u32, len: u32) -> Option<std::ops::Range<usize>> {
    let start = ptr as usize;
    let end = start.checked_add(len as usize)?;
    (end <= len_of_memory).then_some(start..end)
}

fn read(cx: &Cx<'_>, ptr: u32, len: u32) -> Result<Vec<u8>, u32> {
    let mem = cx.data().memory.ok_or(status::INTERNAL_FAILURE)?;
    let data = mem.data(cx);
    let r = range(data.len(), ptr, len).ok_or(status::INVALID_MEMORY_ACCESS)?;
    Ok(data[r].to_vec())
}

fn read_str(cx: &Cx<'_>, ptr: u32, len: u32) -> Result<String, u32> {
    String::from_utf8(read(cx, ptr, len)?).map_err(|_| status::BAD_ARGUMENT)
}

fn write(cx: &mut Cx<'_>, ptr: u32, bytes: &[u8]) -> Result<(), u32> {
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
fn give_from(
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
fn give(cx: &mut Cx<'_>, bytes: Vec<u8>, ret_ptr: u32, ret_len: u32) -> wasmtime::Result<u32> {
    cx.data_mut().scratch = bytes;
    let r = give_from(cx, ret_ptr, ret_len, |st| Some(&st.scratch));
    cx.data_mut().scratch = Vec::new();
    r
}

/// Runs `f` on a guest memory range without copying it.
fn with_guest<T>(
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

/// Serializes header pairs in the ABI's map encoding.
pub(crate) fn encode_map(pairs: &[(String, String)]) -> Vec<u8> {
    let size = 4 + pairs
        .iter()
        .map(|(k, v)| 8 + k.len() + v.len() + 2)
        .sum::<usize>();
    let mut out = Vec::with_capacity(size);
    out.extend_from_slice(&(pairs.len() as u32).to_le_bytes());
    for (k, v) in pairs {
        out.extend_from_slice(&(k.len() as u32).to_le_bytes());
        out.extend_from_slice(&(v.len() as u32).to_le_bytes());
    }
    for (k, v) in pairs {
        out.extend_from_slice(k.as_bytes());
        out.push(0);
        out.extend_from_slice(v.as_bytes());
        out.push(0);
    }
    out
}

/// Parses the ABI's map encoding; `None` if malformed.
pub(crate) fn decode_map(bytes: &[u8]) -> Option<Vec<(String, String)>> {
    if bytes.is_empty() {
        return Some(Vec::new());
    }
    let word = |at: usize| -> Option<usize> {
        Some(u32::from_le_bytes(bytes.get(at..at + 4)?.try_into().ok()?) as usize)
    };
    let n = word(0)?;
    let mut p = 4usize.checked_add(n.checked_mul(8)?)?;
    if p > bytes.len() {
        return None;
    }
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let kl = word(4 + i * 8)?;
        let vl = word(8 + i * 8)?;
        let k = bytes.get(p..p.checked_add(kl)?)?;
        p = p.checked_add(kl + 1)?;
        let v = bytes.get(p..p.checked_add(vl)?)?;
        p = p.checked_add(vl + 1)?;
        out.push((
            String::from_utf8(k.to_vec()).ok()?,
            String::from_utf8(v.to_vec()).ok()?,
        ));
    }
    Some(out)
}

/// Sets (`add`: appends to) a request header, reading name and value in
/// place from guest memory.
fn header_replace(cx: &mut Cx<'_>, map: u32, kp: u32, kl: u32, vp: u32, vl: u32, add: bool) -> R {
    if map != MAP_REQUEST_HEADERS {
        return Ok(status::BAD_ARGUMENT);
    }
    let max = cx.data().max_header_bytes;
    if kl as usize + vl as usize > max {
        tracing::warn!(
            bytes = kl as u64 + vl as u64,
            max,
            "policy guest set an oversized header; refused"
        );
        return Ok(status::BAD_ARGUMENT);
    }
    let Some(mem) = cx.data().memory else {
        return Ok(status::INTERNAL_FAILURE);
    };
    let (data, st) = mem.data_and_store_mut(&mut *cx);
    let (Some(kr), Some(vr)) = (range(data.len(), kp, kl), range(data.len(), vp, vl)) else {
        return Ok(status::INVALID_MEMORY_ACCESS);
    };
    let (Ok(k), Ok(v)) = (
        std::str::from_utf8(&data[kr]),
        std::str::from_utf8(&data[vr]),
    ) else {
        return Ok(status::BAD_ARGUMENT);
    };
    st.req.set_header(k, v, add);
    Ok(status::OK)
}

fn now_nanos() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// Defines every import on `linker`.
pub(crate) fn define(linker: &mut Linker<HostState>) -> wasmtime::Result<()> {
    let env = "env";
    linker.func_wrap(
        env,
        "proxy_log",
        |mut cx: Cx<'_>, level: u32, p: u32, l: u32| -> R {
            let msg = match read(&cx, p, l) {
                Ok(m) => String::from_utf8_lossy(&m).into_owned(),
                Err(s) => return Ok(s),
            };
            match level {
                0 => tracing::trace!(target: "policy_guest", "{msg}"),
                1 => tracing::debug!(target: "policy_guest", "{msg}"),
                2 => tracing::info!(target: "policy_guest", "{msg}"),
                3 => tracing::warn!(target: "policy_guest", "{msg}"),
                _ => {
                    tracing::error!(target: "policy_guest", "{msg}");
                    let errors = &mut cx.data_mut().errors;
                    if errors.len() < 16 {
                        errors.push(msg);
                    }
                }
            }
            Ok(status::OK)
        },
    )?;
    linker.func_wrap(
        env,
        "proxy_get_log_level",
        |mut cx: Cx<'_>, ret: u32| -> R {
            Ok(write(&mut cx, ret, &2u32.to_le_bytes()).map_or_else(|s| s, |_| status::OK))
        },
    )?;
    linker.func_wrap(
        env,
        "proxy_get_current_time_nanoseconds",
        |mut cx: Cx<'_>, ret: u32| -> R {
            Ok(write(&mut cx, ret, &now_nanos().to_le_bytes()).map_or_else(|s| s, |_| status::OK))
        },
    )?;
    linker.func_wrap(
        env,
        "proxy_set_tick_period_milliseconds",
        |_: Cx<'_>, _period: u32| -> R {
            // Ticks are never delivered by this host.
            Ok(status::BAD_ARGUMENT)
        },
    )?;
    linker.func_wrap(
        env,
        "proxy_get_buffer_bytes",
        |mut cx: Cx<'_>, kind: u32, start: u32, max: u32, rp: u32, rl: u32| -> R {
            if !matches!(
                kind,
                BUFFER_REQUEST_BODY | BUFFER_PLUGIN_CONFIGURATION | BUFFER_VM_CONFIGURATION
            ) {
                return Ok(status::NOT_FOUND);
            }
            give_from(&mut cx, rp, rl, |st| {
                let whole: &[u8] = match kind {
                    BUFFER_REQUEST_BODY => &st.req.body,
                    BUFFER_PLUGIN_CONFIGURATION => &st.plugin_config,
                    _ => &[],
                };
                let s = (start as usize).min(whole.len());
                let e = s.saturating_add(max as usize).min(whole.len());
                Some(&whole[s..e])
            })
        },
    )?;
    linker.func_wrap(
        env,
        "proxy_set_buffer_bytes",
        |_: Cx<'_>, _: u32, _: u32, _: u32, _: u32, _: u32| -> R {
            // Policies decide; they do not rewrite bodies.
            Ok(status::BAD_ARGUMENT)
        },
    )?;
    linker.func_wrap(
        env,
        "proxy_get_header_map_pairs",
        |mut cx: Cx<'_>, map: u32, rp: u32, rl: u32| -> R {
            if map != MAP_REQUEST_HEADERS {
                return give(&mut cx, Vec::new(), rp, rl);
            }
            let bytes = encode_map(&cx.data().req.view());
            give(&mut cx, bytes, rp, rl)
        },
    )?;
    linker.func_wrap(
        env,
        "proxy_set_header_map_pairs",
        |mut cx: Cx<'_>, map: u32, p: u32, l: u32| -> R {
            if map != MAP_REQUEST_HEADERS {
                return Ok(status::BAD_ARGUMENT);
            }
            if l as usize > cx.data().max_header_bytes {
                return Ok(status::BAD_ARGUMENT);
            }
            let bytes = match read(&cx, p, l) {
                Ok(b) => b,
                Err(s) => return Ok(s),
            };
            let Some(pairs) = decode_map(&bytes) else {
                return Ok(status::BAD_ARGUMENT);
            };
            // The whole map is replaced: passed headers missing from it are
            // removed, and every pair counts as set.
            let req = &mut cx.data_mut().req;
            req.set.clear();
            req.removed.clear();
            for i in 0..req.headers.len() {
                let k = &req.headers[i].0;
                if !pairs.iter().any(|(n, _)| n.eq_ignore_ascii_case(k)) && !req.is_removed(k) {
                    let k = k.to_ascii_lowercase();
                    req.removed.push(k);
                }
            }
            for (k, v) in &pairs {
                req.set_header(k, v, false);
            }
            Ok(status::OK)
        },
    )?;
    linker.func_wrap(
        env,
        "proxy_get_header_map_value",
        |mut cx: Cx<'_>, map: u32, kp: u32, kl: u32, rp: u32, rl: u32| -> R {
            if map != MAP_REQUEST_HEADERS {
                return Ok(match with_guest(&cx, kp, kl, |_, _| ()) {
                    Err(s) => s,
                    Ok(()) if map <= 7 => status::NOT_FOUND,
                    Ok(()) => status::BAD_ARGUMENT,
                });
            }
            // The key is copied out (headers names are short) so the value can
            // be selected again after the guest's allocator ran.
            let key = match with_guest(&cx, kp, kl, |key, st| {
                let key = std::str::from_utf8(key).map_err(|_| status::BAD_ARGUMENT)?;
                Ok::<_, u32>(st.req.header(key).map(|_| key.to_string()))
            }) {
                Ok(Ok(Some(key))) => key,
                Ok(Ok(None)) => return Ok(status::NOT_FOUND),
                Ok(Err(s)) | Err(s) => return Ok(s),
            };
            give_from(&mut cx, rp, rl, |st| st.req.header(&key).map(str::as_bytes))
        },
    )?;
    linker.func_wrap(
        env,
        "proxy_remove_header_map_value",
        |mut cx: Cx<'_>, map: u32, kp: u32, kl: u32| -> R {
            if map != MAP_REQUEST_HEADERS {
                return Ok(status::BAD_ARGUMENT);
            }
            let Some(mem) = cx.data().memory else {
                return Ok(status::INTERNAL_FAILURE);
            };
            let (data, st) = mem.data_and_store_mut(&mut cx);
            let Some(kr) = range(data.len(), kp, kl) else {
                return Ok(status::INVALID_MEMORY_ACCESS);
            };
            let Ok(key) = std::str::from_utf8(&data[kr]) else {
                return Ok(status::BAD_ARGUMENT);
            };
            st.req.remove_header(key);
            Ok(status::OK)
        },
    )?;
    linker.func_wrap(
        env,
        "proxy_replace_header_map_value",
        |mut cx: Cx<'_>, map: u32, kp: u32, kl: u32, vp: u32, vl: u32| -> R {
            header_replace(&mut cx, map, kp, kl, vp, vl, false)
        },
    )?;
    linker.func_wrap(
        env,
        "proxy_add_header_map_value",
        |mut cx: Cx<'_>, map: u32, kp: u32, kl: u32, vp: u32, vl: u32| -> R {
            header_replace(&mut cx, map, kp, kl, vp, vl, true)
        },
    )?;
    linker.func_wrap(
        env,
        "proxy_get_property",
        |mut cx: Cx<'_>, pp: u32, pl: u32, rp: u32, rl: u32| -> R {
            let which = match with_guest(&cx, pp, pl, |path, _| Property::of(path)) {
                Ok(Some(w)) => w,
                Ok(None) => return Ok(status::NOT_FOUND),
                Err(s) => return Ok(s),
            };
            give_from(&mut cx, rp, rl, |st| st.req.property(which))
        },
    )?;
    linker.func_wrap(
        env,
        "proxy_set_property",
        |_: Cx<'_>, _: u32, _: u32, _: u32, _: u32| -> R { Ok(status::BAD_ARGUMENT) },
    )?;
    linker.func_wrap(
        env,
        "proxy_get_shared_data",
        |mut cx: Cx<'_>, kp: u32, kl: u32, rp: u32, rl: u32, rc: u32| -> R {
            let key = match read_str(&cx, kp, kl) {
                Ok(k) => k,
                Err(s) => return Ok(s),
            };
            let Some((v, cas)) = cx.data().shared.get(&key).cloned() else {
                return Ok(status::NOT_FOUND);
            };
            if let Err(s) = write(&mut cx, rc, &cas.to_le_bytes()) {
                return Ok(s);
            }
            give(&mut cx, v, rp, rl)
        },
    )?;
    linker.func_wrap(
        env,
        "proxy_set_shared_data",
        |mut cx: Cx<'_>, kp: u32, kl: u32, vp: u32, vl: u32, cas: u32| -> R {
            if vl as usize > cx.data().max_header_bytes {
                return Ok(status::BAD_ARGUMENT);
            }
            let (k, v) = match read_str(&cx, kp, kl).and_then(|k| read(&cx, vp, vl).map(|v| (k, v)))
            {
                Ok(kv) => kv,
                Err(s) => return Ok(s),
            };
            let shared = &mut cx.data_mut().shared;
            let current = shared.get(&k).map_or(0, |(_, c)| *c);
            if cas != 0 && cas != current {
                return Ok(8); // CasMismatch
            }
            shared.insert(k, (v, current.wrapping_add(1)));
            Ok(status::OK)
        },
    )?;
    // Shared queues, HTTP and gRPC callouts, foreign functions: not offered.
    linker.func_wrap(
        env,
        "proxy_register_shared_queue",
        |_: Cx<'_>, _: u32, _: u32, _: u32| -> R { Ok(status::BAD_ARGUMENT) },
    )?;
    linker.func_wrap(
        env,
        "proxy_resolve_shared_queue",
        |_: Cx<'_>, _: u32, _: u32, _: u32, _: u32, _: u32| -> R { Ok(status::NOT_FOUND) },
    )?;
    linker.func_wrap(
        env,
        "proxy_dequeue_shared_queue",
        |_: Cx<'_>, _: u32, _: u32, _: u32| -> R { Ok(status::NOT_FOUND) },
    )?;
    linker.func_wrap(
        env,
        "proxy_enqueue_shared_queue",
        |_: Cx<'_>, _: u32, _: u32, _: u32| -> R { Ok(status::NOT_FOUND) },
    )?;
    linker.func_wrap(env, "proxy_continue_stream", |_: Cx<'_>, _: u32| -> R {
        // Decisions are synchronous: there is nothing paused to resume.
        Ok(status::OK)
    })?;
    linker.func_wrap(env, "proxy_close_stream", |_: Cx<'_>, _: u32| -> R {
        Ok(status::BAD_ARGUMENT)
    })?;
    linker.func_wrap(
        env,
        "proxy_send_local_response",
        |mut cx: Cx<'_>, code: u32, dp: u32, dl: u32, bp: u32, bl: u32, hp: u32, hl: u32, _grpc: i32| -> R {
            let max = cx.data().max_header_bytes;
            if hl as usize > max || bl as usize > max.saturating_mul(16) {
                return Ok(status::BAD_ARGUMENT);
            }
            let (details, body, hdrs) = match (read(&cx, dp, dl), read(&cx, bp, bl), read(&cx, hp, hl)) {
                (Ok(d), Ok(b), Ok(h)) => (d, b, h),
                (Err(s), _, _) | (_, Err(s), _) | (_, _, Err(s)) => return Ok(s),
            };
            tracing::debug!(status = code, details = %String::from_utf8_lossy(&details), "policy sent a local response");
            Ok(cx.data_mut().req.send_local_response(code, body, &hdrs).map_or_else(|s| s, |()| status::OK))
        },
    )?;
    linker.func_wrap(
        env,
        "proxy_http_call",
        |_: Cx<'_>,
         _: u32,
         _: u32,
         _: u32,
         _: u32,
         _: u32,
         _: u32,
         _: u32,
         _: u32,
         _: u32,
         _: u32|
         -> R { Ok(status::BAD_ARGUMENT) },
    )?;
    linker.func_wrap(
        env,
        "proxy_grpc_call",
        |_: Cx<'_>,
         _: u32,
         _: u32,
         _: u32,
         _: u32,
         _: u32,
         _: u32,
         _: u32,
         _: u32,
         _: u32,
         _: u32,
         _: u32,
         _: u32|
         -> R { Ok(status::BAD_ARGUMENT) },
    )?;
    linker.func_wrap(
        env,
        "proxy_grpc_stream",
        |_: Cx<'_>, _: u32, _: u32, _: u32, _: u32, _: u32, _: u32, _: u32, _: u32, _: u32| -> R {
            Ok(status::BAD_ARGUMENT)
        },
    )?;
    linker.func_wrap(
        env,
        "proxy_grpc_send",
        |_: Cx<'_>, _: u32, _: u32, _: u32, _: u32| -> R { Ok(status::NOT_FOUND) },
    )?;
    linker.func_wrap(env, "proxy_grpc_cancel", |_: Cx<'_>, _: u32| -> R {
        Ok(status::NOT_FOUND)
    })?;
    linker.func_wrap(env, "proxy_grpc_close", |_: Cx<'_>, _: u32| -> R {
        Ok(status::NOT_FOUND)
    })?;
    linker.func_wrap(
        env,
        "proxy_get_status",
        |_: Cx<'_>, _: u32, _: u32, _: u32| -> R { Ok(status::NOT_FOUND) },
    )?;
    linker.func_wrap(
        env,
        "proxy_set_effective_context",
        |_: Cx<'_>, _: u32| -> R { Ok(status::OK) },
    )?;
    linker.func_wrap(
        env,
        "proxy_call_foreign_function",
        |_: Cx<'_>, _: u32, _: u32, _: u32, _: u32, _: u32, _: u32| -> R { Ok(status::NOT_FOUND) },
    )?;
    linker.func_wrap(env, "proxy_done", |_: Cx<'_>| -> R { Ok(status::OK) })?;
    linker.func_wrap(
        env,
        "proxy_define_metric",
        |mut cx: Cx<'_>, _kind: u32, np: u32, nl: u32, rid: u32| -> R {
            let name = match read_str(&cx, np, nl) {
                Ok(n) => n,
                Err(s) => return Ok(s),
            };
            let metrics = &mut cx.data_mut().metrics;
            if metrics.len() >= 1024 {
                return Ok(status::BAD_ARGUMENT);
            }
            let id = metrics
                .iter()
                .find(|(_, (n, _))| *n == name)
                .map(|(id, _)| *id)
                .unwrap_or(metrics.len() as u32 + 1);
            metrics.entry(id).or_insert((name, 0));
            Ok(write(&mut cx, rid, &id.to_le_bytes()).map_or_else(|s| s, |_| status::OK))
        },
    )?;
    linker.func_wrap(
        env,
        "proxy_get_metric",
        |mut cx: Cx<'_>, id: u32, ret: u32| -> R {
            let Some(v) = cx.data().metrics.get(&id).map(|(_, v)| *v) else {
                return Ok(status::NOT_FOUND);
            };
            Ok(write(&mut cx, ret, &v.to_le_bytes()).map_or_else(|s| s, |_| status::OK))
        },
    )?;
    linker.func_wrap(
        env,
        "proxy_record_metric",
        |mut cx: Cx<'_>, id: u32, value: u64| -> R {
            match cx.data_mut().metrics.get_mut(&id) {
                Some(m) => {
                    m.1 = value;
                    Ok(status::OK)
                }
                None => Ok(status::NOT_FOUND),
            }
        },
    )?;
    linker.func_wrap(
        env,
        "proxy_increment_metric",
        |mut cx: Cx<'_>, id: u32, offset: i64| -> R {
            match cx.data_mut().metrics.get_mut(&id) {
                Some(m) => {
                    m.1 = m.1.wrapping_add_signed(offset);
                    Ok(status::OK)
                }
                None => Ok(status::NOT_FOUND),
            }
        },
    )?;

    // WASI preview 1: stubs with no capabilities.
    let wasi = "wasi_snapshot_preview1";
    linker.func_wrap(
        wasi,
        "random_get",
        |mut cx: Cx<'_>, p: u32, l: u32| -> wasmtime::Result<i32> {
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
        },
    )?;
    linker.func_wrap(
        wasi,
        "environ_sizes_get",
        |mut cx: Cx<'_>, count: u32, size: u32| -> wasmtime::Result<i32> {
            let ok = write(&mut cx, count, &0u32.to_le_bytes())
                .and_then(|_| write(&mut cx, size, &0u32.to_le_bytes()));
            Ok(if ok.is_ok() { 0 } else { WASI_EBADF })
        },
    )?;
    linker.func_wrap(
        wasi,
        "environ_get",
        |_: Cx<'_>, _: u32, _: u32| -> wasmtime::Result<i32> { Ok(0) },
    )?;
    linker.func_wrap(
        wasi,
        "fd_write",
        |mut cx: Cx<'_>, fd: u32, iovs: u32, n: u32, written: u32| -> wasmtime::Result<i32> {
            // stdout/stderr go to the log (a panicking guest prints its message here);
            // no other descriptor exists.
            if fd != 1 && fd != 2 {
                return Ok(WASI_EBADF);
            }
            let mut total = 0u32;
            let mut text = Vec::new();
            for i in 0..n.min(64) {
                let Ok(iov) = read(&cx, iovs.wrapping_add(i * 8), 8) else {
                    return Ok(WASI_EBADF);
                };
                let p = u32::from_le_bytes([iov[0], iov[1], iov[2], iov[3]]);
                let l = u32::from_le_bytes([iov[4], iov[5], iov[6], iov[7]]).min(64 * 1024);
                let Ok(chunk) = read(&cx, p, l) else {
                    return Ok(WASI_EBADF);
                };
                total = total.saturating_add(l);
                text.extend_from_slice(&chunk);
            }
            let line = String::from_utf8_lossy(&text).trim_end().to_string();
            if !line.is_empty() {
                tracing::warn!(target: "policy_guest", fd, "{line}");
                let errors = &mut cx.data_mut().errors;
                if errors.len() < 16 {
                    errors.push(line);
                }
            }
            Ok(write(&mut cx, written, &total.to_le_bytes()).map_or(WASI_EBADF, |_| 0))
        },
    )?;
    linker.func_wrap(
        wasi,
        "proc_exit",
        |_: Cx<'_>, code: u32| -> wasmtime::Result<()> {
            Err(wasmtime::format_err!("guest called proc_exit({code})"))
        },
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state() -> RequestState {
        RequestState {
            headers: vec![
                (":path".into(), "/v1/completions".into()),
                ("Accept".into(), "text/plain".into()),
                ("x-prefiller-host-port".into(), "10.0.0.9:80".into()),
            ],
            ..RequestState::default()
        }
    }

    #[test]
    fn edits_overlay_the_passed_headers() {
        let mut st = state();
        assert_eq!(st.header("accept"), Some("text/plain"));
        st.set_header("ACCEPT", "application/json", false);
        assert_eq!(st.header("accept"), Some("application/json"));
        st.set_header("accept", "text/html", true);
        assert_eq!(st.header("Accept"), Some("application/json,text/html"));
        st.remove_header("x-prefiller-host-port");
        assert_eq!(st.header("x-prefiller-host-port"), None);
        st.set_header("x-prefiller-host-port", "10.0.0.1:80", false);
        assert_eq!(st.header("x-prefiller-host-port"), Some("10.0.0.1:80"));
        st.remove_header("accept");
        assert_eq!(st.header("accept"), None);
        // The passed headers are never edited; the view merges the edits.
        assert_eq!(st.headers, state().headers);
        assert_eq!(
            st.view(),
            vec![
                (":path".to_string(), "/v1/completions".to_string()),
                (
                    "x-prefiller-host-port".to_string(),
                    "10.0.0.1:80".to_string()
                ),
            ]
        );
        assert_eq!(
            st.set,
            vec![(
                "x-prefiller-host-port".to_string(),
                "10.0.0.1:80".to_string()
            )]
        );
        assert_eq!(st.removed, vec!["accept".to_string()]);
    }

    #[test]
    fn map_encoding_round_trips() {
        let pairs = state().headers;
        assert_eq!(decode_map(&encode_map(&pairs)), Some(pairs));
        assert_eq!(decode_map(&[1, 0, 0, 0, 9, 0, 0, 0]), None);
    }
}
