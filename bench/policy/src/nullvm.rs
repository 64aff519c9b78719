//! The benchmark's native baseline: the default policy module's own code
//! (crate `pd-default` with its proxy-wasm SDK, linked natively) run in
//! process through the same proxy-wasm lifecycle (context create, request
//! headers, body, done, delete) and the same host semantics
//! ([`RequestState`]) as the wasm host, with no VM in between, as Envoy's
//! "null VM" runs a natively compiled plugin.
//!
//! The SDK imports the ABI's `proxy_*` host functions by name; this module
//! defines them as native symbols over a thread-local [`RequestState`]. The
//! SDK keeps its contexts in a thread-local dispatcher, so a [`NullVm`] is
//! bound to the thread that made it.
//!
//! Pointers here come from the module's own code in this process, not from a
//! sandbox: like any native plugin, it is trusted.

use std::cell::{Cell, RefCell};
use std::marker::PhantomData;
use std::sync::Arc;

use rngd_policy_core::{Decision, Endpoint};
use rngd_policy_host::codes::{
    BUFFER_PLUGIN_CONFIGURATION, BUFFER_REQUEST_BODY, MAP_REQUEST_HEADERS, status,
};
use rngd_policy_host::{PolicyError, PolicyRequest, RequestState};

const ROOT_CONTEXT: u32 = 1;

// The lifecycle entry points the SDK exports (`#[no_mangle]` in `proxy-wasm`).
unsafe extern "C" {
    fn proxy_on_context_create(context_id: u32, root_context_id: u32);
    fn proxy_on_vm_start(context_id: u32, vm_configuration_size: usize) -> bool;
    fn proxy_on_configure(context_id: u32, plugin_configuration_size: usize) -> bool;
    fn proxy_on_request_headers(context_id: u32, num_headers: usize, end_of_stream: bool) -> u32;
    fn proxy_on_request_body(context_id: u32, body_size: usize, end_of_stream: bool) -> u32;
    fn proxy_on_done(context_id: u32) -> bool;
    fn proxy_on_delete(context_id: u32);
    fn proxy_on_memory_allocate(size: usize) -> *mut u8;
}

/// What the host functions see: the request and the plugin configuration.
#[derive(Default)]
struct Host {
    req: RequestState,
    config: Vec<u8>,
}

thread_local! {
    static HOST: RefCell<Host> = RefCell::new(Host::default());
    /// Whether this thread's SDK dispatcher has its root context.
    static ROOT_READY: Cell<bool> = const { Cell::new(false) };
    static NEXT_CONTEXT: Cell<u32> = const { Cell::new(ROOT_CONTEXT + 1) };
}

/// The default policy module run natively on this thread (see the module docs).
pub struct NullVm {
    /// The endpoints whose snapshot JSON the host state holds.
    seen: Option<Arc<[Endpoint]>>,
    generation: u64,
    /// The SDK's dispatcher is thread-local: not `Send`.
    _thread: PhantomData<*const ()>,
}

impl NullVm {
    /// Registers the module's root context on this thread (once) and
    /// configures it with `config` (plugin configuration JSON).
    pub fn new(config: &[u8]) -> Result<NullVm, PolicyError> {
        HOST.with_borrow_mut(|h| h.config = config.to_vec());
        if !ROOT_READY.get() {
            pd_default::register_native_root();
            // SAFETY: an SDK export with plain integer arguments; the root
            // context is created once per thread (ROOT_READY).
            unsafe { proxy_on_context_create(ROOT_CONTEXT, 0) };
            // SAFETY: as above.
            if !unsafe { proxy_on_vm_start(ROOT_CONTEXT, 0) } {
                return Err(PolicyError::Rejected {
                    phase: "vm start",
                    guest_log: vec![],
                });
            }
            ROOT_READY.set(true);
        }
        // SAFETY: as above; the configuration is read back through
        // `proxy_get_buffer_bytes` from the thread's host state.
        if !unsafe { proxy_on_configure(ROOT_CONTEXT, config.len()) } {
            return Err(PolicyError::Rejected {
                phase: "plugin configuration",
                guest_log: vec![],
            });
        }
        Ok(NullVm {
            seen: None,
            generation: 0,
            _thread: PhantomData,
        })
    }

    /// Decides one request through a new HTTP context. The request is lent
    /// as to the wasm host (headers and body swapped in and back out).
    pub fn decide(&mut self, req: &mut PolicyRequest) -> Result<Decision, PolicyError> {
        let same = match (&self.seen, &req.endpoints) {
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            (None, None) => true,
            _ => false,
        };
        if !same {
            self.generation += 1;
            let json: Option<Arc<str>> = req.endpoints.as_deref().map(|eps| {
                serde_json::to_string(eps)
                    .unwrap_or_else(|_| "[]".into())
                    .into()
            });
            let version: Arc<str> = self.generation.to_string().into();
            let version = json.as_ref().map(|_| version);
            HOST.with_borrow_mut(|h| h.req.set_snapshot(json, version));
            self.seen = req.endpoints.clone();
        }
        let headers = req.headers.len();
        let body = req.body.len();
        HOST.with_borrow_mut(|h| h.req.begin(req));
        let ctx = NEXT_CONTEXT.get();
        NEXT_CONTEXT.set(ctx.checked_add(1).unwrap_or(ROOT_CONTEXT + 1));
        // SAFETY: SDK exports with plain integer arguments, called in the
        // lifecycle order a host uses; no host state is borrowed across them
        // (the module calls back into the host functions below).
        unsafe {
            proxy_on_context_create(ctx, ROOT_CONTEXT);
            proxy_on_request_headers(ctx, headers, body == 0);
            if body > 0 && !HOST.with_borrow(|h| h.req.has_local_response()) {
                proxy_on_request_body(ctx, body, true);
            }
            proxy_on_done(ctx);
            proxy_on_delete(ctx);
        }
        HOST.with_borrow_mut(|h| h.req.finish(req))
    }
}

/// Reads `len` bytes the module passed at `ptr`.
///
/// # Safety
/// `ptr..ptr+len` must be readable (or `len` 0).
unsafe fn bytes<'a>(ptr: *const u8, len: usize) -> &'a [u8] {
    if len == 0 || ptr.is_null() {
        return &[];
    }
    // SAFETY: the caller's contract.
    unsafe { std::slice::from_raw_parts(ptr, len) }
}

/// Hands `data` to the module: a block from its own allocator (as a wasm host
/// does), pointer and length written to the two return slots; `None` is
/// `NotFound`, empty data a null pointer.
///
/// # Safety
/// `rp` and `rl` must be writable.
unsafe fn give(data: Option<&[u8]>, rp: *mut *mut u8, rl: *mut usize) -> u32 {
    let Some(data) = data else {
        return status::NOT_FOUND;
    };
    let ptr = if data.is_empty() {
        std::ptr::null_mut()
    } else {
        // SAFETY: the SDK's allocator export returns a block of `len` bytes.
        let p = unsafe { proxy_on_memory_allocate(data.len()) };
        // SAFETY: `p` has room for `data.len()` bytes and does not overlap it.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), p, data.len()) };
        p
    };
    // SAFETY: the caller's contract.
    unsafe {
        rp.write(ptr);
        rl.write(data.len());
    }
    status::OK
}

/// Runs `f` on the header name at `kp..kp+kl` (`BadArgument` if not UTF-8).
///
/// # Safety
/// As [`bytes`].
unsafe fn with_key(kp: *const u8, kl: usize, f: impl FnOnce(&str) -> u32) -> u32 {
    // SAFETY: the caller's contract.
    match std::str::from_utf8(unsafe { bytes(kp, kl) }) {
        Ok(k) => f(k),
        Err(_) => status::BAD_ARGUMENT,
    }
}

/// `proxy_log`: into `tracing`, as the wasm host does.
///
/// # Safety
/// As [`bytes`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn proxy_log(level: u32, p: *const u8, l: usize) -> u32 {
    // SAFETY: the caller's contract.
    let msg = String::from_utf8_lossy(unsafe { bytes(p, l) });
    if level >= 4 {
        tracing::error!(target: "policy_guest", "{msg}");
    } else {
        tracing::debug!(target: "policy_guest", "{msg}");
    }
    status::OK
}

/// `proxy_get_buffer_bytes`: the request body and the plugin configuration.
///
/// # Safety
/// `rp` and `rl` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn proxy_get_buffer_bytes(
    kind: u32,
    start: usize,
    max: usize,
    rp: *mut *mut u8,
    rl: *mut usize,
) -> u32 {
    HOST.with_borrow(|h| {
        let whole: &[u8] = match kind {
            BUFFER_REQUEST_BODY => h.req.body(),
            BUFFER_PLUGIN_CONFIGURATION => &h.config,
            _ => return status::NOT_FOUND,
        };
        let s = start.min(whole.len());
        let e = s.saturating_add(max).min(whole.len());
        // SAFETY: the caller's contract.
        unsafe { give(Some(&whole[s..e]), rp, rl) }
    })
}

/// `proxy_get_header_map_value`: a request header as the module sees it.
///
/// # Safety
/// `kp..kp+kl` readable, `rp` and `rl` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn proxy_get_header_map_value(
    map: u32,
    kp: *const u8,
    kl: usize,
    rp: *mut *mut u8,
    rl: *mut usize,
) -> u32 {
    if map != MAP_REQUEST_HEADERS {
        return status::NOT_FOUND;
    }
    // SAFETY: the caller's contract.
    unsafe {
        with_key(kp, kl, |k| {
            HOST.with_borrow(|h| give(h.req.header(k).map(str::as_bytes), rp, rl))
        })
    }
}

/// `proxy_replace_header_map_value` and `proxy_add_header_map_value`.
///
/// # Safety
/// Both ranges readable.
unsafe fn set_header(
    map: u32,
    kp: *const u8,
    kl: usize,
    vp: *const u8,
    vl: usize,
    add: bool,
) -> u32 {
    if map != MAP_REQUEST_HEADERS {
        return status::BAD_ARGUMENT;
    }
    // SAFETY: the caller's contract.
    let value = match std::str::from_utf8(unsafe { bytes(vp, vl) }) {
        Ok(v) => v,
        Err(_) => return status::BAD_ARGUMENT,
    };
    // SAFETY: the caller's contract.
    unsafe {
        with_key(kp, kl, |k| {
            HOST.with_borrow_mut(|h| h.req.set_header(k, value, add));
            status::OK
        })
    }
}

/// `proxy_replace_header_map_value`.
///
/// # Safety
/// Both ranges readable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn proxy_replace_header_map_value(
    map: u32,
    kp: *const u8,
    kl: usize,
    vp: *const u8,
    vl: usize,
) -> u32 {
    // SAFETY: the caller's contract.
    unsafe { set_header(map, kp, kl, vp, vl, false) }
}

/// `proxy_add_header_map_value`.
///
/// # Safety
/// Both ranges readable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn proxy_add_header_map_value(
    map: u32,
    kp: *const u8,
    kl: usize,
    vp: *const u8,
    vl: usize,
) -> u32 {
    // SAFETY: the caller's contract.
    unsafe { set_header(map, kp, kl, vp, vl, true) }
}

/// `proxy_remove_header_map_value`.
///
/// # Safety
/// `kp..kp+kl` readable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn proxy_remove_header_map_value(map: u32, kp: *const u8, kl: usize) -> u32 {
    if map != MAP_REQUEST_HEADERS {
        return status::BAD_ARGUMENT;
    }
    // SAFETY: the caller's contract.
    unsafe {
        with_key(kp, kl, |k| {
            HOST.with_borrow_mut(|h| h.req.remove_header(k));
            status::OK
        })
    }
}

/// `proxy_get_property`: the `rngd_pd.*` properties.
///
/// # Safety
/// `pp..pp+pl` readable, `rp` and `rl` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn proxy_get_property(
    pp: *const u8,
    pl: usize,
    rp: *mut *mut u8,
    rl: *mut usize,
) -> u32 {
    // SAFETY: the caller's contract.
    let path = unsafe { bytes(pp, pl) };
    // SAFETY: the caller's contract.
    HOST.with_borrow(|h| unsafe { give(h.req.property_at(path), rp, rl) })
}

/// `proxy_send_local_response`.
///
/// # Safety
/// The three ranges readable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn proxy_send_local_response(
    code: u32,
    _dp: *const u8,
    _dl: usize,
    bp: *const u8,
    bl: usize,
    hp: *const u8,
    hl: usize,
    _grpc: i32,
) -> u32 {
    // SAFETY: the caller's contract.
    let (body, hdrs) = unsafe { (bytes(bp, bl).to_vec(), bytes(hp, hl)) };
    HOST.with_borrow_mut(|h| {
        h.req
            .send_local_response(code, body, hdrs)
            .map_or(status::BAD_ARGUMENT, |()| status::OK)
    })
}

/// `proxy_get_log_level`: info.
///
/// # Safety
/// `ret` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn proxy_get_log_level(ret: *mut u32) -> u32 {
    // SAFETY: the caller's contract.
    unsafe { ret.write(2) };
    status::OK
}

/// `proxy_get_current_time_nanoseconds`.
///
/// # Safety
/// `ret` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn proxy_get_current_time_nanoseconds(ret: *mut u64) -> u32 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    // SAFETY: the caller's contract.
    unsafe { ret.write(now) };
    status::OK
}

/// Defines the ABI functions the default module never calls (the SDK links
/// them all): they only return `status`.
macro_rules! refused {
    ($($name:ident($($arg:ty),*) => $status:expr;)*) => {$(
        #[doc = concat!("`", stringify!($name), "`: not offered.")]
        #[unsafe(no_mangle)]
        pub extern "C" fn $name($(_: $arg),*) -> u32 {
            $status
        }
    )*};
}

refused! {
    proxy_set_tick_period_milliseconds(u32) => status::BAD_ARGUMENT;
    proxy_set_buffer_bytes(u32, usize, usize, *const u8, usize) => status::BAD_ARGUMENT;
    proxy_get_header_map_pairs(u32, *mut *mut u8, *mut usize) => status::BAD_ARGUMENT;
    proxy_set_header_map_pairs(u32, *const u8, usize) => status::BAD_ARGUMENT;
    proxy_set_property(*const u8, usize, *const u8, usize) => status::BAD_ARGUMENT;
    proxy_get_shared_data(*const u8, usize, *mut *mut u8, *mut usize, *mut u32) => status::NOT_FOUND;
    proxy_set_shared_data(*const u8, usize, *const u8, usize, u32) => status::BAD_ARGUMENT;
    proxy_register_shared_queue(*const u8, usize, *mut u32) => status::BAD_ARGUMENT;
    proxy_resolve_shared_queue(*const u8, usize, *const u8, usize, *mut u32) => status::NOT_FOUND;
    proxy_dequeue_shared_queue(u32, *mut *mut u8, *mut usize) => status::NOT_FOUND;
    proxy_enqueue_shared_queue(u32, *const u8, usize) => status::NOT_FOUND;
    proxy_continue_stream(u32) => status::OK;
    proxy_close_stream(u32) => status::BAD_ARGUMENT;
    proxy_http_call(*const u8, usize, *const u8, usize, *const u8, usize, *const u8, usize, u32, *mut u32) => status::BAD_ARGUMENT;
    proxy_grpc_call(*const u8, usize, *const u8, usize, *const u8, usize, *const u8, usize, *const u8, usize, u32, *mut u32) => status::BAD_ARGUMENT;
    proxy_grpc_stream(*const u8, usize, *const u8, usize, *const u8, usize, *const u8, usize, *mut u32) => status::BAD_ARGUMENT;
    proxy_grpc_send(u32, *const u8, usize, bool) => status::NOT_FOUND;
    proxy_grpc_cancel(u32) => status::NOT_FOUND;
    proxy_grpc_close(u32) => status::NOT_FOUND;
    proxy_get_status(*mut u32, *mut *mut u8, *mut usize) => status::NOT_FOUND;
    proxy_set_effective_context(u32) => status::OK;
    proxy_call_foreign_function(*const u8, usize, *const u8, usize, *mut *mut u8, *mut usize) => status::NOT_FOUND;
    proxy_done() => status::OK;
    proxy_define_metric(u32, *const u8, usize, *mut u32) => status::BAD_ARGUMENT;
    proxy_get_metric(u32, *mut u64) => status::NOT_FOUND;
    proxy_record_metric(u32, u64) => status::NOT_FOUND;
    proxy_increment_metric(u32, i64) => status::NOT_FOUND;
}
