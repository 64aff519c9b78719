//! The host side of the proxy-wasm ABI 0.2.1 (HTTP filter subset) on wasmtime:
//! every `env.proxy_*` import a `proxy-wasm` 0.2.5 guest links, plus the five
//! WASI preview-1 functions a `wasm32-wasip1` guest imports (stubs without
//! capabilities). Every guest pointer and length is bounds-checked: a guest
//! that passes garbage gets `InvalidMemoryAccess` (6) and the host stays sound.
//!
//! This module owns the per-store state ([`HostState`]) and the registration
//! table ([`define`]); each hostcall is one function, in the module of its
//! concern:
//!
//! - `memory`: bounds-checked guest memory access, handing data to the guest;
//! - `logging`: `proxy_log`, the log level;
//! - `time`: the clock, tick timers (refused);
//! - `buffers`: request body and plugin configuration;
//! - `headers`: the header maps and their encoding;
//! - `properties`: the request's properties (endpoint snapshot, …);
//! - `shared`: shared data (and the shared queues, not offered);
//! - `stream`: local responses and the stream calls;
//! - `callouts`: HTTP, gRPC and foreign-function calls (not offered);
//! - `metrics`: guest metrics;
//! - `wasi`: the WASI stubs.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Instant;

use prometheus::IntCounter;
use wasmtime::{Caller, Linker, Memory, ResourceLimiter, TypedFunc};

use crate::SandboxLimits;
use crate::request::RequestState;

/// Table entries for hostcall functions named like their imports:
/// `hostcalls![MODULE => f, g]` defines `MODULE.f` as `f` and `MODULE.g` as `g`.
macro_rules! hostcalls {
    ($module:expr => $($f:ident),* $(,)?) => {
        &[$($crate::abi::Hostcall {
            module: $module,
            name: stringify!($f),
            define: |linker, module, name| linker.func_wrap(module, name, $f).map(|_| ()),
        }),*]
    };
}

mod buffers;
mod callouts;
mod headers;
mod logging;
mod memory;
mod metrics;
mod properties;
mod shared;
mod stream;
mod time;
mod wasi;

/// The proxy-wasm import module.
const ENV: &str = "env";

/// Every hostcall, by concern.
const TABLE: &[&[Hostcall]] = &[
    logging::HOSTCALLS,
    time::HOSTCALLS,
    buffers::HOSTCALLS,
    headers::HOSTCALLS,
    properties::HOSTCALLS,
    shared::HOSTCALLS,
    stream::HOSTCALLS,
    callouts::HOSTCALLS,
    metrics::HOSTCALLS,
    wasi::HOSTCALLS,
];

/// One import the host offers: where a guest finds it and how it is defined.
pub(crate) struct Hostcall {
    /// Import module (`env` or `wasi_snapshot_preview1`).
    pub module: &'static str,
    /// Import name (also the name of the function that implements it).
    pub name: &'static str,
    /// Defines the import on a linker, as `module.name`.
    pub define: fn(&mut Linker<HostState>, &'static str, &'static str) -> wasmtime::Result<()>,
}

/// Memory cap of a store; records when the guest hit it.
pub(crate) struct Limiter {
    pub memory_bytes: usize,
    pub hit: bool,
}

// === impl Limiter ===

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

/// The guest log rate limit of one runtime (all its instances): a token
/// bucket of `rate` lines per second, holding at most `rate`.
pub(crate) struct LogBucket {
    rate: f64,
    state: std::sync::Mutex<(f64, Instant)>,
}

// === impl LogBucket ===

impl LogBucket {
    /// A full bucket of `rate` lines per second (0: no guest line is logged).
    pub fn new(rate: u32) -> Self {
        LogBucket {
            rate: f64::from(rate),
            state: std::sync::Mutex::new((f64::from(rate), Instant::now())),
        }
    }

    /// Takes one line's token; false when the rate is used up.
    pub fn take(&self) -> bool {
        let mut st = self
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let now = Instant::now();
        let refill = now.duration_since(st.1).as_secs_f64() * self.rate;
        st.0 = (st.0 + refill).min(self.rate);
        st.1 = now;
        if st.0 >= 1.0 {
            st.0 -= 1.0;
            true
        } else {
            false
        }
    }
}

/// Counters of hostcalls refused at a host-side cap
/// (`policy_host_cap_hits_total{cap}`), one per cap, resolved once.
#[derive(Clone)]
pub(crate) struct CapHits {
    /// Shared data: entries or bytes.
    pub shared_data: IntCounter,
    /// Headers the guest sets: count or bytes.
    pub headers: IntCounter,
    /// A log message over the size cap.
    pub log_size: IntCounter,
    /// A log line over the rate.
    pub log_rate: IntCounter,
    /// Guest metric names: count or name length.
    pub metrics: IntCounter,
}

// === impl CapHits ===

impl CapHits {
    /// The counters of `vec` (label `cap`).
    pub fn of(vec: &prometheus::IntCounterVec) -> Self {
        let c = |cap: &str| vec.with_label_values(&[cap]);
        CapHits {
            shared_data: c("shared_data"),
            headers: c("headers"),
            log_size: c("log_size"),
            log_rate: c("log_rate"),
            metrics: c("metrics"),
        }
    }

    /// Counters registered nowhere (`rngd-pd policy check`).
    pub fn unregistered() -> Self {
        let vec = prometheus::IntCounterVec::new(
            prometheus::Opts::new(rngd_telemetry::names::POLICY_HOST_CAP_HITS_TOTAL, "unused"),
            &["cap"],
        )
        .expect("a valid metric name and label");
        CapHits::of(&vec)
    }
}

/// What every instance of one runtime shares with the host.
#[derive(Clone)]
pub(crate) struct HostEnv {
    /// Epoch ticks since the engine started (the ticker counts them beside
    /// the engine's own epoch, which wasmtime does not expose).
    pub ticks: Arc<AtomicU64>,
    /// The guest log rate limit.
    pub log_bucket: Arc<LogBucket>,
    /// Cap-hit counters.
    pub caps: CapHits,
}

/// Per-store host state.
pub(crate) struct HostState {
    pub limiter: Limiter,
    pub memory: Option<Memory>,
    pub alloc: Option<TypedFunc<u32, u32>>,
    pub plugin_config: Arc<[u8]>,
    pub req: RequestState,
    pub max_header_bytes: usize,
    /// Caps on what a guest can make the host keep.
    pub caps: HostCaps,
    /// Shared with the other instances of the runtime.
    pub env: HostEnv,
    /// Bytes on their way into guest memory (see `memory::give`).
    scratch: Vec<u8>,
    metrics: HashMap<u32, (String, u64)>,
    shared: HashMap<String, (Vec<u8>, u32)>,
    /// Bytes (keys plus values) held in `shared`.
    shared_bytes: usize,
    /// Last guest log lines at error level (for reports).
    pub errors: Vec<String>,
}

/// The host-side caps of [`SandboxLimits`] one store enforces.
#[derive(Clone, Copy)]
pub(crate) struct HostCaps {
    pub shared_entries: usize,
    pub shared_bytes: usize,
    pub set_headers: usize,
    pub set_header_bytes: usize,
    pub log_bytes: usize,
}

/// Longest guest metric name.
pub(crate) const MAX_METRIC_NAME_BYTES: usize = 256;

// === impl HostState ===

impl HostState {
    /// Fresh state for a new instance.
    pub fn new(limits: &SandboxLimits, plugin_config: Arc<[u8]>, env: HostEnv) -> Self {
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
            caps: HostCaps {
                shared_entries: limits.max_shared_entries,
                shared_bytes: limits.max_shared_bytes,
                set_headers: limits.max_set_headers,
                set_header_bytes: limits.max_set_header_bytes,
                log_bytes: limits.max_log_bytes,
            },
            env,
            scratch: Vec::new(),
            metrics: HashMap::new(),
            shared: HashMap::new(),
            shared_bytes: 0,
            errors: Vec::new(),
        }
    }
}

/// The caller every hostcall gets.
type Cx<'a> = Caller<'a, HostState>;
/// What a proxy-wasm hostcall returns: a status code (a trap is an error).
type R = wasmtime::Result<u32>;

/// Defines every import on `linker`.
pub(crate) fn define(linker: &mut Linker<HostState>) -> wasmtime::Result<()> {
    for hostcall in TABLE.iter().copied().flatten() {
        (hostcall.define)(linker, hostcall.module, hostcall.name)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every import the host defined before the table existed, in that order.
    const IMPORTS: &[(&str, &str)] = &[
        ("env", "proxy_log"),
        ("env", "proxy_get_log_level"),
        ("env", "proxy_get_current_time_nanoseconds"),
        ("env", "proxy_set_tick_period_milliseconds"),
        ("env", "proxy_get_buffer_bytes"),
        ("env", "proxy_set_buffer_bytes"),
        ("env", "proxy_get_header_map_pairs"),
        ("env", "proxy_set_header_map_pairs"),
        ("env", "proxy_get_header_map_value"),
        ("env", "proxy_remove_header_map_value"),
        ("env", "proxy_replace_header_map_value"),
        ("env", "proxy_add_header_map_value"),
        ("env", "proxy_get_property"),
        ("env", "proxy_set_property"),
        ("env", "proxy_get_shared_data"),
        ("env", "proxy_set_shared_data"),
        ("env", "proxy_register_shared_queue"),
        ("env", "proxy_resolve_shared_queue"),
        ("env", "proxy_dequeue_shared_queue"),
        ("env", "proxy_enqueue_shared_queue"),
        ("env", "proxy_continue_stream"),
        ("env", "proxy_close_stream"),
        ("env", "proxy_send_local_response"),
        ("env", "proxy_http_call"),
        ("env", "proxy_grpc_call"),
        ("env", "proxy_grpc_stream"),
        ("env", "proxy_grpc_send"),
        ("env", "proxy_grpc_cancel"),
        ("env", "proxy_grpc_close"),
        ("env", "proxy_get_status"),
        ("env", "proxy_set_effective_context"),
        ("env", "proxy_call_foreign_function"),
        ("env", "proxy_done"),
        ("env", "proxy_define_metric"),
        ("env", "proxy_get_metric"),
        ("env", "proxy_record_metric"),
        ("env", "proxy_increment_metric"),
        ("wasi_snapshot_preview1", "random_get"),
        ("wasi_snapshot_preview1", "environ_sizes_get"),
        ("wasi_snapshot_preview1", "environ_get"),
        ("wasi_snapshot_preview1", "fd_write"),
        ("wasi_snapshot_preview1", "proc_exit"),
    ];

    #[test]
    fn the_table_defines_every_import_once() {
        let mut defined: Vec<(&str, &str)> = TABLE
            .iter()
            .copied()
            .flatten()
            .map(|h| (h.module, h.name))
            .collect();
        let mut expected = IMPORTS.to_vec();
        defined.sort_unstable();
        expected.sort_unstable();
        assert_eq!(defined, expected);
        let mut linker = Linker::new(&wasmtime::Engine::default());
        define(&mut linker).expect("every import defines (no duplicate)");
    }
}
