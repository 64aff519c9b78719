//! [`PolicyRuntime`]: compiles a module, self-tests it, serves decisions from a
//! small pool of warm instances off the async threads, swaps modules
//! atomically and watches the module file.
//!
//! This module holds the runtime and its instance pool (the decision path);
//! `sandbox` sets up the engine, the linker and the canned self-test
//! requests; `swap` replaces the active module (swap, file watch).

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::SystemTime;

use prometheus::{IntCounter, Registry};
use rngd_policy_core::{Decision, Endpoint};
use rngd_telemetry::names;
use wasmtime::{Engine, InstancePre, Linker};

use crate::abi::HostState;
use crate::guest::{Guest, SnapshotProps};
use crate::{ModuleInfo, PolicyError, PolicyRequest, PolicySource, SandboxLimits, sha256_hex};

mod sandbox;
mod swap;

pub(crate) use sandbox::{canned_requests, compile, sandbox_engine, sandbox_linker};

/// A compiled module.
struct Loaded {
    info: ModuleInfo,
    pre: InstancePre<HostState>,
    /// Which activation this is (see [`PolicyRuntime::decide_blocking`]).
    generation: u64,
}

/// A warm instance and the module it runs (moved along with it, never
/// cloned per decision).
struct Warm {
    guest: Guest,
    loaded: Arc<Loaded>,
}

/// The last endpoint snapshot serialized for the guests, so an unchanged
/// snapshot is neither re-serialized nor re-parsed.
#[derive(Default)]
struct SnapshotMemo {
    endpoints: Option<Arc<[Endpoint]>>,
    props: Option<SnapshotProps>,
    generation: u64,
}

struct Metrics {
    registry: Registry,
    reloads: IntCounter,
    reload_failures: IntCounter,
    traps: IntCounter,
}

/// Runs policy modules: see the crate docs.
pub struct PolicyRuntime {
    me: Weak<PolicyRuntime>,
    engine: Engine,
    linker: Linker<HostState>,
    limits: SandboxLimits,
    config: Arc<[u8]>,
    path: PathBuf,
    active: RwLock<Arc<Loaded>>,
    /// `active`'s generation, readable without the lock.
    generation: AtomicU64,
    /// Warm instances, of the active module or (until a decision drops
    /// them) of the one before a swap.
    idle: Mutex<Vec<Warm>>,
    permits: Arc<tokio::sync::Semaphore>,
    memo: Mutex<SnapshotMemo>,
    metrics: Metrics,
    swap_lock: tokio::sync::Mutex<()>,
    stop: Arc<AtomicBool>,
}

impl std::fmt::Debug for PolicyRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PolicyRuntime")
            .field("active", &self.active())
            .field("limits", &self.limits)
            .finish()
    }
}

impl Drop for PolicyRuntime {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Builds a loaded module: compile, instantiate, run the canned requests;
/// returns it with a first warm instance.
fn prepare(
    engine: &Engine,
    linker: &Linker<HostState>,
    limits: &SandboxLimits,
    config: &Arc<[u8]>,
    wasm: &[u8],
    path: Option<PathBuf>,
    generation: u64,
) -> Result<Warm, PolicyError> {
    let pre = compile(engine, linker, wasm)?;
    let mut guest = Guest::new(engine, &pre, limits, config.clone())?;
    for (name, mut req) in canned_requests() {
        let snap = req.endpoints.as_ref().map(|eps| SnapshotProps {
            json: serde_json::to_string(&**eps).unwrap_or_default().into(),
            version: "self-test".into(),
        });
        let snap = snap.map(|s| SnapshotProps {
            version: format!("self-test-{name}").into(),
            ..s
        });
        if let Err(e) = guest.run(&mut req, |_| snap) {
            return Err(PolicyError::SelfTest {
                request: name,
                source: Box::new(e),
            });
        }
    }
    // The self-test instance has parsed a different snapshot; start clean.
    drop(guest);
    let guest = Guest::new(engine, &pre, limits, config.clone())?;
    let loaded = Loaded {
        info: ModuleInfo {
            sha256: sha256_hex(wasm),
            loaded_at: SystemTime::now(),
            path,
        },
        pre,
        generation,
    };
    Ok(Warm {
        guest,
        loaded: Arc::new(loaded),
    })
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl PolicyRuntime {
    /// Reads, compiles, self-tests and activates `source.module`.
    pub fn new(
        source: PolicySource,
        limits: SandboxLimits,
    ) -> Result<Arc<PolicyRuntime>, PolicyError> {
        let wasm = std::fs::read(&source.module).map_err(|e| PolicyError::Io {
            path: source.module.clone(),
            source: e,
        })?;
        let stop = Arc::new(AtomicBool::new(false));
        let engine = sandbox_engine(&limits, stop.clone())?;
        let linker = sandbox_linker(&engine)?;
        let config: Arc<[u8]> = source.config.clone().into();
        let first = match prepare(
            &engine,
            &linker,
            &limits,
            &config,
            &wasm,
            Some(source.module.clone()),
            0,
        ) {
            Ok(l) => l,
            Err(e) => {
                stop.store(true, Ordering::Relaxed);
                return Err(e);
            }
        };
        let registry = Registry::new();
        let metric = |name: &str, help: &str| {
            rngd_telemetry::counter(&registry, name, help).map_err(|e| PolicyError::Engine {
                source: Box::new(e),
            })
        };
        let metrics = Metrics {
            reloads: metric(
                names::POLICY_RELOADS_TOTAL,
                "Policy module reloads that succeeded",
            )?,
            reload_failures: metric(
                names::POLICY_RELOAD_FAILURES_TOTAL,
                "Policy module reloads that failed (old module kept)",
            )?,
            traps: metric(
                names::POLICY_TRAPS_TOTAL,
                "Policy guest traps, timeouts and memory-cap hits",
            )?,
            registry,
        };
        tracing::info!(sha256 = %first.loaded.info.sha256, path = %source.module.display(), "policy module active");
        let permits = Arc::new(tokio::sync::Semaphore::new(limits.instances.max(1)));
        Ok(Arc::new_cyclic(|me| PolicyRuntime {
            me: me.clone(),
            engine,
            linker,
            limits,
            config,
            path: source.module,
            active: RwLock::new(first.loaded.clone()),
            generation: AtomicU64::new(0),
            idle: Mutex::new(vec![first]),
            permits,
            memo: Mutex::new(SnapshotMemo::default()),
            metrics,
            swap_lock: tokio::sync::Mutex::new(()),
            stop,
        }))
    }

    /// The active module.
    pub fn active(&self) -> ModuleInfo {
        self.current().info.clone()
    }

    /// The sandbox limits.
    pub fn limits(&self) -> &SandboxLimits {
        &self.limits
    }

    /// The registry holding `policy_reloads_total`, `policy_reload_failures_total`
    /// and `policy_traps_total`.
    pub fn registry(&self) -> &Registry {
        &self.metrics.registry
    }

    /// Registers the runtime's metrics in another registry too (e.g. a
    /// server's `/metrics`).
    pub fn register_metrics(&self, registry: &Registry) -> Result<(), prometheus::Error> {
        registry.register(Box::new(self.metrics.reloads.clone()))?;
        registry.register(Box::new(self.metrics.reload_failures.clone()))?;
        registry.register(Box::new(self.metrics.traps.clone()))?;
        Ok(())
    }

    fn current(&self) -> Arc<Loaded> {
        self.active
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    fn me(&self) -> Result<Arc<PolicyRuntime>, PolicyError> {
        self.me.upgrade().ok_or_else(|| PolicyError::Unavailable {
            detail: "runtime dropped".into(),
        })
    }

    /// Decides one request; at most `limits.instances` decisions run at
    /// once, the rest wait for a slot.
    ///
    /// The decision runs on the calling task's thread, as a wasm filter runs
    /// on Envoy's worker threads: a decision takes microseconds, far less than
    /// a hop to a blocking-pool thread and back costs on a busy machine. A
    /// misbehaving guest holds the thread for at most the sandbox's call
    /// timeout per callback (epoch interruption), and its instance is
    /// discarded.
    pub async fn decide(&self, mut req: PolicyRequest) -> Result<Decision, PolicyError> {
        let _permit = self
            .permits
            .acquire()
            .await
            .map_err(|_| PolicyError::Unavailable {
                detail: "decision slots closed".into(),
            })?;
        self.decide_blocking(&mut req)
    }

    /// Decides one request on the calling thread (blocks it for up to the
    /// call timeout). [`PolicyRuntime::decide`] is the async entry point.
    ///
    /// The request is lent to the guest: its headers and body are swapped
    /// into the instance for the call, never copied, and are unchanged when
    /// this returns (also on error).
    pub fn decide_blocking(&self, req: &mut PolicyRequest) -> Result<Decision, PolicyError> {
        // Built only when debug is on (one load of the global level): even a
        // disabled span costs a few percent of a decision (callsite, filter
        // and `log` bridge checks).
        let span = if tracing::level_enabled!(tracing::Level::DEBUG) {
            tracing::debug_span!(
                "policy_decide",
                headers = req.headers.len(),
                body = req.body.len()
            )
        } else {
            tracing::Span::none()
        };
        let _g = span.enter();
        self.check_input(req)?;
        // A warm instance of the active module, without taking the module
        // lock: its generation says whether it is one (an instance of the
        // module before a swap is dropped here, and a new one made).
        let active = self.generation.load(Ordering::Acquire);
        let pooled = lock(&self.idle).pop();
        let mut warm = match pooled {
            Some(w) if w.loaded.generation == active => w,
            _ => self.fresh(&self.current())?,
        };
        match warm.guest.run(req, |eps| self.snapshot_props(eps)) {
            Ok(d) => {
                self.give_back(warm);
                Ok(d)
            }
            Err(e) if e.is_guest_fault() => {
                // A trapped proxy-wasm instance cannot be reused: drop it.
                self.metrics.traps.inc();
                tracing::warn!(error = %e, sha256 = %warm.loaded.info.sha256, "policy guest fault; instance discarded");
                Err(e)
            }
            Err(e) => {
                self.give_back(warm);
                Err(e)
            }
        }
    }

    /// Runs one request on a brand-new instance (for the benchmark).
    pub fn decide_fresh(&self, req: &mut PolicyRequest) -> Result<Decision, PolicyError> {
        self.check_input(req)?;
        let mut warm = self.fresh(&self.current())?;
        warm.guest.run(req, |eps| self.snapshot_props(eps))
    }

    fn fresh(&self, loaded: &Arc<Loaded>) -> Result<Warm, PolicyError> {
        Guest::new(&self.engine, &loaded.pre, &self.limits, self.config.clone())
            .map(|guest| Warm {
                guest,
                loaded: loaded.clone(),
            })
            .inspect_err(|e| {
                if e.is_guest_fault() {
                    self.metrics.traps.inc();
                }
            })
    }

    /// Keeps an instance warm if it runs the active module and the pool has
    /// room; drops it (outside the lock) otherwise.
    fn give_back(&self, warm: Warm) {
        let mut idle = lock(&self.idle);
        if warm.loaded.generation == self.generation.load(Ordering::Acquire)
            && idle.len() < self.limits.instances
        {
            idle.push(warm);
            return;
        }
        drop(idle);
        drop(warm);
    }

    fn check_input(&self, req: &PolicyRequest) -> Result<(), PolicyError> {
        let header_bytes: usize = req
            .headers
            .iter()
            .map(|(k, v)| k.len() + v.len() + 10)
            .sum::<usize>()
            + 4;
        if header_bytes > self.limits.max_header_bytes {
            return Err(PolicyError::InputTooLarge {
                what: "request headers",
                size: header_bytes,
                max: self.limits.max_header_bytes,
            });
        }
        if req.body.len() > self.limits.max_body_bytes {
            return Err(PolicyError::InputTooLarge {
                what: "request body",
                size: req.body.len(),
                max: self.limits.max_body_bytes,
            });
        }
        Ok(())
    }

    fn snapshot_props(&self, endpoints: Option<&Arc<[Endpoint]>>) -> Option<SnapshotProps> {
        let endpoints = endpoints?;
        let mut memo = lock(&self.memo);
        if let (Some(p), Some(seen)) = (&memo.props, &memo.endpoints)
            && (Arc::ptr_eq(seen, endpoints) || **seen == **endpoints)
        {
            let p = p.clone();
            // An equal list in a new `Arc`: keep that one, so the next request
            // carrying it is a pointer match.
            if !memo
                .endpoints
                .as_ref()
                .is_some_and(|s| Arc::ptr_eq(s, endpoints))
            {
                memo.endpoints = Some(endpoints.clone());
            }
            return Some(p);
        }
        memo.generation += 1;
        let props = SnapshotProps {
            json: serde_json::to_string(&**endpoints)
                .unwrap_or_else(|_| "[]".into())
                .into(),
            version: memo.generation.to_string().into(),
        };
        memo.endpoints = Some(endpoints.clone());
        memo.props = Some(props.clone());
        Some(props)
    }
}
