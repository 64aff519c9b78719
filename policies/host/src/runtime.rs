//! [`PolicyRuntime`]: compiles a module, self-tests it, serves decisions from a
//! small pool of warm instances off the async threads, swaps modules
//! atomically, watches the module file and rolls a hot-swapped module back
//! to the one before it after repeated runtime faults.
//!
//! This module holds the runtime and its instance pool (the decision path);
//! `sandbox` sets up the engine, the linker and the canned self-test
//! requests; `swap` replaces the active module (swap, file watch, and the
//! fault counting and rollback to the module before).

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::{Instant, SystemTime};

use prometheus::{IntCounter, IntCounterVec, Registry};
use rngd_policy_core::{Decision, Endpoint};
use rngd_telemetry::names;
use wasmtime::{Engine, InstancePre, Linker};

use crate::abi::{CapHits, HostEnv, HostState, LogBucket};
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
    /// The module active before this one was swapped in (what a rollback
    /// restores); `None` for the first module and for a restored one.
    previous: Option<Fallback>,
    /// When its last guest faults happened (at most `rollback_after`).
    faults: Mutex<VecDeque<Instant>>,
}

/// A module a rollback can go back to.
struct Fallback {
    info: ModuleInfo,
    pre: InstancePre<HostState>,
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

pub(crate) struct Metrics {
    registry: Registry,
    reloads: IntCounter,
    reload_failures: IntCounter,
    traps: IntCounter,
    rollbacks: IntCounter,
    cap_hits: IntCounterVec,
    /// Admin requests with a missing or wrong token.
    pub(crate) admin_auth_failures: IntCounter,
    /// Admin requests answered 429.
    pub(crate) admin_throttled: IntCounter,
}

/// Runs policy modules: see the crate docs.
pub struct PolicyRuntime {
    me: Weak<PolicyRuntime>,
    engine: Engine,
    linker: Linker<HostState>,
    limits: SandboxLimits,
    config: Arc<[u8]>,
    path: PathBuf,
    /// Shared by every instance (epoch tick count, log rate, cap counters).
    env: HostEnv,
    active: RwLock<Arc<Loaded>>,
    /// `active`'s generation, readable without the lock.
    generation: AtomicU64,
    /// The generation the next activation (swap or rollback) takes.
    next_generation: AtomicU64,
    /// SHA-256 of modules rolled back (the watcher skips them).
    rolled_back: Mutex<VecDeque<String>>,
    /// Warm instances, of the active module or (until a decision drops
    /// them) of the one before a swap.
    idle: Mutex<Vec<Warm>>,
    permits: Arc<tokio::sync::Semaphore>,
    memo: Mutex<SnapshotMemo>,
    pub(crate) metrics: Metrics,
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

/// What [`prepare`] builds a module with.
struct Sandbox<'a> {
    engine: &'a Engine,
    linker: &'a Linker<HostState>,
    limits: &'a SandboxLimits,
    config: &'a Arc<[u8]>,
    env: &'a HostEnv,
}

/// Builds a loaded module: compile, instantiate, run the canned requests;
/// returns it with a first warm instance.
fn prepare(
    sb: &Sandbox<'_>,
    wasm: &[u8],
    path: Option<PathBuf>,
    generation: u64,
) -> Result<Warm, PolicyError> {
    let Sandbox {
        engine,
        linker,
        limits,
        config,
        env,
    } = *sb;
    let pre = compile(engine, linker, wasm)?;
    let mut guest = Guest::new(engine, &pre, limits, config.clone(), env)?;
    for (name, mut req) in canned_requests() {
        let snap = req.endpoints.as_ref().map(|eps| SnapshotProps {
            json: serde_json::to_string(&**eps).unwrap_or_default().into(),
            version: "self-test".into(),
        });
        let snap = snap.map(|s| SnapshotProps {
            version: format!("self-test-{name}").into(),
            ..s
        });
        let mut result = guest.run(&mut req, |_| snap.clone());
        if let Err(PolicyError::DecisionBudget { .. }) = result {
            // Once more on a fresh instance: a thread descheduled mid-decision
            // spends the (wall-time) budget too, and a module refused here is
            // not retried until its file changes. A module that is slow
            // fails twice.
            guest = Guest::new(engine, &pre, limits, config.clone(), env)?;
            result = guest.run(&mut req, |_| snap);
        }
        if let Err(e) = result {
            return Err(PolicyError::SelfTest {
                request: name,
                source: Box::new(e),
            });
        }
    }
    // The self-test instance has parsed a different snapshot; start clean.
    drop(guest);
    let guest = Guest::new(engine, &pre, limits, config.clone(), env)?;
    let loaded = Loaded {
        info: ModuleInfo {
            sha256: sha256_hex(wasm),
            loaded_at: SystemTime::now(),
            path,
        },
        pre,
        generation,
        previous: None,
        faults: Mutex::default(),
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
    fn sandbox(&self) -> Sandbox<'_> {
        Sandbox {
            engine: &self.engine,
            linker: &self.linker,
            limits: &self.limits,
            config: &self.config,
            env: &self.env,
        }
    }

    /// Reads, compiles, self-tests and activates `source.module`.
    pub fn new(
        source: PolicySource,
        limits: SandboxLimits,
    ) -> Result<Arc<PolicyRuntime>, PolicyError> {
        let wasm = std::fs::read(&source.module).map_err(|e| PolicyError::Io {
            path: source.module.clone(),
            source: e,
        })?;
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
                "Policy guest traps, timeouts, memory-cap hits and spent decision budgets",
            )?,
            rollbacks: metric(
                names::POLICY_ROLLBACKS_TOTAL,
                "Rollbacks to the previous policy module after repeated runtime faults",
            )?,
            admin_auth_failures: metric(
                names::POLICY_ADMIN_AUTH_FAILURES_TOTAL,
                "Policy admin API requests with a missing or wrong token",
            )?,
            admin_throttled: metric(
                names::POLICY_ADMIN_THROTTLED_TOTAL,
                "Policy admin API requests answered 429 after repeated failed attempts",
            )?,
            cap_hits: rngd_telemetry::counter_vec(
                &registry,
                names::POLICY_HOST_CAP_HITS_TOTAL,
                "Policy hostcalls refused at a host-side cap",
                &["cap"],
            )
            .map_err(|e| PolicyError::Engine {
                source: Box::new(e),
            })?,
            registry,
        };
        let env = HostEnv {
            ticks: Arc::default(),
            log_bucket: Arc::new(LogBucket::new(limits.log_lines_per_second)),
            caps: CapHits::of(&metrics.cap_hits),
        };
        let stop = Arc::new(AtomicBool::new(false));
        let engine = sandbox_engine(&limits, stop.clone(), env.ticks.clone())?;
        let linker = sandbox_linker(&engine)?;
        let config: Arc<[u8]> = source.config.clone().into();
        let sandbox = Sandbox {
            engine: &engine,
            linker: &linker,
            limits: &limits,
            config: &config,
            env: &env,
        };
        let first = match prepare(&sandbox, &wasm, Some(source.module.clone()), 0) {
            Ok(l) => l,
            Err(e) => {
                stop.store(true, Ordering::Relaxed);
                return Err(e);
            }
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
            env,
            active: RwLock::new(first.loaded.clone()),
            generation: AtomicU64::new(0),
            next_generation: AtomicU64::new(1),
            rolled_back: Mutex::default(),
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

    /// The module a rollback would restore: the one active before the
    /// active module was swapped in. `None` for the first module and for a
    /// module restored by a rollback.
    pub fn previous(&self) -> Option<ModuleInfo> {
        self.current().previous.as_ref().map(|p| p.info.clone())
    }

    /// The registry holding `policy_reloads_total`,
    /// `policy_reload_failures_total`, `policy_traps_total`,
    /// `policy_rollbacks_total`, `policy_host_cap_hits_total`,
    /// `policy_admin_auth_failures_total` and `policy_admin_throttled_total`.
    pub fn registry(&self) -> &Registry {
        &self.metrics.registry
    }

    /// Registers the runtime's metrics in another registry too (e.g. a
    /// server's `/metrics`).
    pub fn register_metrics(&self, registry: &Registry) -> Result<(), prometheus::Error> {
        let m = &self.metrics;
        for c in [
            &m.reloads,
            &m.reload_failures,
            &m.traps,
            &m.rollbacks,
            &m.admin_auth_failures,
            &m.admin_throttled,
        ] {
            registry.register(Box::new(c.clone()))?;
        }
        registry.register(Box::new(m.cap_hits.clone()))?;
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
                self.note_fault(&warm.loaded);
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
        Guest::new(
            &self.engine,
            &loaded.pre,
            &self.limits,
            self.config.clone(),
            &self.env,
        )
        .map(|guest| Warm {
            guest,
            loaded: loaded.clone(),
        })
        .inspect_err(|e| {
            if e.is_guest_fault() {
                self.metrics.traps.inc();
                self.note_fault(loaded);
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
