//! The sandbox every module runs in: the wasmtime engine (pooling
//! allocator, epoch interruption and its ticker), the linker with the host's
//! imports, compiling and linking a module, and the canned requests a module
//! must answer before it is activated. Used by [`super::PolicyRuntime`] and by
//! `rngd-pd policy check`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use rngd_policy_core::{Endpoint, Role, Vendor};
use wasmtime::{
    Config, Engine, InstanceAllocationStrategy, InstancePre, Linker, Module,
    PoolingAllocationConfig,
};

use crate::abi::{self, HostState};
use crate::guest::check_exports;
use crate::{PolicyError, PolicyRequest, SandboxLimits};

/// A wasmtime error as the host's boxed cause.
pub(super) fn boxed(e: wasmtime::Error) -> crate::BoxError {
    e.into()
}

/// A wasmtime engine configured for the sandbox, with its epoch ticker
/// (which also counts its ticks in `ticks`, the clock of the decision
/// budget).
pub(crate) fn sandbox_engine(
    limits: &SandboxLimits,
    stop: Arc<AtomicBool>,
    ticks: Arc<AtomicU64>,
) -> Result<Engine, PolicyError> {
    let mut pool = PoolingAllocationConfig::new();
    let slots = (limits.instances as u32).saturating_mul(4).clamp(8, 64);
    pool.total_core_instances(slots)
        .total_memories(slots)
        .total_tables(slots)
        .max_memories_per_module(1)
        .max_tables_per_module(1)
        .max_memory_size(limits.memory_bytes);
    let mut config = Config::new();
    config
        .epoch_interruption(true)
        // Compiling on one thread keeps a swap from stalling the serving threads.
        .parallel_compilation(false)
        .allocation_strategy(InstanceAllocationStrategy::Pooling(pool));
    if rngd_api::env::var(rngd_api::env::RNGD_PD_POLICY_PERFMAP).as_deref() == Some("1") {
        // Symbol map for `perf` (profiling the guest code); off by default.
        config.profiler(wasmtime::ProfilingStrategy::PerfMap);
    }
    let engine = Engine::new(&config).map_err(|e| PolicyError::Engine { source: boxed(e) })?;
    let ticker = engine.clone();
    let tick = limits.epoch_tick;
    std::thread::Builder::new()
        .name("policy-epoch".into())
        .spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                std::thread::sleep(tick);
                ticker.increment_epoch();
                ticks.fetch_add(1, Ordering::Relaxed);
            }
        })
        .map_err(|e| PolicyError::Engine {
            source: Box::new(e),
        })?;
    Ok(engine)
}

/// A linker with every import of the host's ABI defined.
pub(crate) fn sandbox_linker(engine: &Engine) -> Result<Linker<HostState>, PolicyError> {
    let mut linker = Linker::new(engine);
    abi::define(&mut linker).map_err(|e| PolicyError::Engine { source: boxed(e) })?;
    Ok(linker)
}

/// Compiles and links a module (no instance yet).
pub(crate) fn compile(
    engine: &Engine,
    linker: &Linker<HostState>,
    wasm: &[u8],
) -> Result<InstancePre<HostState>, PolicyError> {
    let module =
        Module::new(engine, wasm).map_err(|e| PolicyError::Compile { source: boxed(e) })?;
    check_exports(&module)?;
    linker
        .instantiate_pre(&module)
        .map_err(|e| PolicyError::Abi {
            detail: format!("{e:#}"),
        })
}

/// The canned requests every new module must answer (route or reject, no error).
pub(crate) fn canned_requests() -> Vec<(&'static str, PolicyRequest)> {
    let ep = |address: &str, role: Role, node: &str, queue: u32| Endpoint {
        address: address.to_string(),
        role,
        vendor: Vendor::Cpu,
        node: node.to_string(),
        seq_len: 512,
        queue_depth: queue,
        running: 1,
        kv_usage: 0.25,
        healthy: true,
        transports: vec![],
        weight_version: None,
    };
    let pool = vec![
        ep("10.0.0.1:8001", Role::Decode, "node-a", 2),
        ep("10.0.0.2:8001", Role::Decode, "node-b", 0),
        ep("10.0.0.3:8002", Role::Prefill, "node-b", 0),
    ];
    let headers = |method: &str| {
        vec![
            (":method".to_string(), method.to_string()),
            (":path".to_string(), "/v1/chat/completions".to_string()),
            (":authority".to_string(), "gateway".to_string()),
            ("content-type".to_string(), "application/json".to_string()),
        ]
    };
    let chat = br#"{"model":"smollm2","messages":[{"role":"user","content":"Explain disaggregated serving in one paragraph."}],"max_tokens":64}"#.to_vec();
    vec![
        (
            "long prompt, 3 endpoints",
            PolicyRequest {
                headers: headers("POST"),
                body: chat.clone(),
                endpoints: Some(pool.clone().into()),
                prompt_tokens: Some(200),
                ..PolicyRequest::default()
            },
        ),
        (
            "short prompt, 3 endpoints",
            PolicyRequest {
                headers: headers("POST"),
                body: chat.clone(),
                endpoints: Some(pool.clone().into()),
                prompt_tokens: Some(8),
                ..PolicyRequest::default()
            },
        ),
        (
            "prompt over the context length",
            PolicyRequest {
                headers: headers("POST"),
                body: chat.clone(),
                endpoints: Some(pool.into()),
                prompt_tokens: Some(500),
                ..PolicyRequest::default()
            },
        ),
        (
            "no endpoints",
            PolicyRequest {
                headers: headers("POST"),
                body: chat,
                endpoints: Some(Arc::from([])),
                prompt_tokens: Some(10),
                ..PolicyRequest::default()
            },
        ),
        (
            "no snapshot property, no body",
            PolicyRequest {
                headers: headers("GET"),
                body: vec![],
                endpoints: None,
                prompt_tokens: None,
                ..PolicyRequest::default()
            },
        ),
    ]
}
