//! One sandboxed guest instance: instantiation from an `InstancePre`, the root
//! context lifecycle (`_initialize`, `proxy_on_vm_start`, `proxy_on_configure`)
//! and the HTTP context lifecycle of one request under one time budget
//! across its callbacks ([`SandboxLimits::decision_budget`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use rngd_policy_core::{Decision, Endpoint};
use wasmtime::{Engine, InstancePre, Module, Store, Trap, TypedFunc};

use crate::abi::{HostEnv, HostState};
use crate::{PolicyError, PolicyRequest, SandboxLimits};

const ROOT_CONTEXT: u32 = 1;

/// The endpoint snapshot as the guest reads it: JSON plus a version.
#[derive(Clone)]
pub(crate) struct SnapshotProps {
    pub json: Arc<str>,
    pub version: Arc<str>,
}

/// Checks the module's exports before any instance exists.
pub(crate) fn check_exports(module: &Module) -> Result<(), PolicyError> {
    let has = |n: &str| module.get_export(n).is_some();
    let mut missing: Vec<&str> = [
        "memory",
        "proxy_on_vm_start",
        "proxy_on_configure",
        "proxy_on_context_create",
        "proxy_on_request_headers",
    ]
    .into_iter()
    .filter(|n| !has(n))
    .collect();
    if !has("malloc") && !has("proxy_on_memory_allocate") {
        missing.push("malloc or proxy_on_memory_allocate");
    }
    if !has("proxy_abi_version_0_2_1") && !has("proxy_abi_version_0_2_0") {
        missing.push("proxy_abi_version_0_2_1");
    }
    if missing.is_empty() {
        Ok(())
    } else {
        Err(PolicyError::Abi {
            detail: format!("missing exports: {}", missing.join(", ")),
        })
    }
}

/// A live instance with its request entry points.
pub(crate) struct Guest {
    store: Store<HostState>,
    on_context_create: TypedFunc<(u32, u32), ()>,
    on_request_headers: TypedFunc<(u32, u32, u32), u32>,
    on_request_body: Option<TypedFunc<(u32, u32, u32), u32>>,
    on_done: Option<TypedFunc<u32, u32>>,
    on_delete: Option<TypedFunc<u32, ()>>,
    next_context: u32,
    /// The endpoints (by `Arc`) whose snapshot properties the request state holds.
    seen: Option<Arc<[Endpoint]>>,
    deadline_ticks: u64,
    /// Epoch ticks of one decision's budget (the decision's deadline is
    /// this many ticks after the count at its start).
    budget_ticks: u64,
    /// The runtime's epoch tick count.
    ticks: Arc<AtomicU64>,
    limits: SandboxLimits,
}

/// Epoch ticks that stop a call between `d` and `d + tick` after it starts.
/// Saturates far below `u64::MAX`, so a deadline of a start plus this cannot
/// overflow (a `Duration::MAX` limit is "never").
fn ticks_for(d: std::time::Duration, tick: std::time::Duration) -> u64 {
    let n = d.as_nanos().div_ceil(tick.as_nanos().max(1));
    u64::try_from(n).unwrap_or(u64::MAX).clamp(1, u64::MAX >> 2) + 1
}

fn typed<P: wasmtime::WasmParams, R: wasmtime::WasmResults>(
    instance: &wasmtime::Instance,
    store: &mut Store<HostState>,
    name: &str,
) -> Result<Option<TypedFunc<P, R>>, PolicyError> {
    match instance.get_func(&mut *store, name) {
        None => Ok(None),
        Some(f) => f
            .typed::<P, R>(&*store)
            .map(Some)
            .map_err(|e| PolicyError::Abi {
                detail: format!("export {name}: {e}"),
            }),
    }
}

impl Guest {
    /// Instantiates and configures a fresh instance.
    pub fn new(
        engine: &Engine,
        pre: &InstancePre<HostState>,
        limits: &SandboxLimits,
        config: Arc<[u8]>,
        env: &HostEnv,
    ) -> Result<Guest, PolicyError> {
        let mut store = Store::new(engine, HostState::new(limits, config.clone(), env.clone()));
        store.limiter(|s| &mut s.limiter);
        store.epoch_deadline_trap();
        let deadline_ticks = ticks_for(limits.call_timeout, limits.epoch_tick);
        store.set_epoch_deadline(deadline_ticks);
        let instance = match pre.instantiate(&mut store) {
            Ok(i) => i,
            Err(e) => return Err(classify(&store, e, limits)),
        };
        let memory = instance
            .get_memory(&mut store, "memory")
            .ok_or_else(|| PolicyError::Abi {
                detail: "no exported memory".into(),
            })?;
        let alloc = match typed::<u32, u32>(&instance, &mut store, "malloc")? {
            Some(f) => f,
            None => typed::<u32, u32>(&instance, &mut store, "proxy_on_memory_allocate")?
                .ok_or_else(|| PolicyError::Abi {
                    detail: "no allocator export".into(),
                })?,
        };
        store.data_mut().memory = Some(memory);
        store.data_mut().alloc = Some(alloc);
        let need = |what: &str| PolicyError::Abi {
            detail: format!("missing export {what}"),
        };
        let on_vm_start = typed::<(u32, u32), u32>(&instance, &mut store, "proxy_on_vm_start")?
            .ok_or_else(|| need("proxy_on_vm_start"))?;
        let on_configure = typed::<(u32, u32), u32>(&instance, &mut store, "proxy_on_configure")?
            .ok_or_else(|| need("proxy_on_configure"))?;
        let on_context_create =
            typed::<(u32, u32), ()>(&instance, &mut store, "proxy_on_context_create")?
                .ok_or_else(|| need("proxy_on_context_create"))?;
        let on_request_headers =
            typed::<(u32, u32, u32), u32>(&instance, &mut store, "proxy_on_request_headers")?
                .ok_or_else(|| need("proxy_on_request_headers"))?;
        let on_request_body =
            typed::<(u32, u32, u32), u32>(&instance, &mut store, "proxy_on_request_body")?;
        let on_done = typed::<u32, u32>(&instance, &mut store, "proxy_on_done")?;
        let on_delete = typed::<u32, ()>(&instance, &mut store, "proxy_on_delete")?;

        if let Some(init) = typed::<(), ()>(&instance, &mut store, "_initialize")? {
            store.set_epoch_deadline(deadline_ticks);
            init.call(&mut store, ())
                .map_err(|e| classify(&store, e, limits))?;
        }
        store.set_epoch_deadline(deadline_ticks);
        on_context_create
            .call(&mut store, (ROOT_CONTEXT, 0))
            .map_err(|e| classify(&store, e, limits))?;
        store.set_epoch_deadline(deadline_ticks);
        let ok = on_vm_start
            .call(&mut store, (ROOT_CONTEXT, 0))
            .map_err(|e| classify(&store, e, limits))?;
        if ok == 0 {
            return Err(PolicyError::Rejected {
                phase: "vm start",
                guest_log: store.data().errors.clone(),
            });
        }
        store.set_epoch_deadline(deadline_ticks);
        let ok = on_configure
            .call(&mut store, (ROOT_CONTEXT, config.len() as u32))
            .map_err(|e| classify(&store, e, limits))?;
        if ok == 0 {
            return Err(PolicyError::Rejected {
                phase: "plugin configuration",
                guest_log: store.data().errors.clone(),
            });
        }
        store.data_mut().errors.clear();
        Ok(Guest {
            store,
            on_context_create,
            on_request_headers,
            on_request_body,
            on_done,
            on_delete,
            next_context: ROOT_CONTEXT + 1,
            seen: None,
            deadline_ticks,
            budget_ticks: ticks_for(limits.decision_budget, limits.epoch_tick),
            ticks: env.ticks.clone(),
            limits: limits.clone(),
        })
    }

    /// Runs one request through a new HTTP context. On `Err` with
    /// [`PolicyError::is_guest_fault`] the instance must be dropped.
    ///
    /// The request's headers and body are lent to the instance's host state
    /// for the call (swapped in and back out, never copied) and come back
    /// unchanged.
    ///
    /// `snapshot` gives the snapshot properties for the endpoints it is
    /// passed (`req.endpoints`); it is called only when those are not the
    /// endpoints (the same `Arc`) this instance ran with last, so a steady
    /// snapshot costs no lookup and no reference count change.
    pub fn run(
        &mut self,
        req: &mut PolicyRequest,
        snapshot: impl FnOnce(Option<&Arc<[Endpoint]>>) -> Option<SnapshotProps>,
    ) -> Result<Decision, PolicyError> {
        let ctx = self.next_context;
        self.next_context = self.next_context.checked_add(1).unwrap_or(ROOT_CONTEXT + 1);
        let headers = req.headers.len() as u32;
        let body_len = req.body.len() as u32;
        let seen = match (&self.seen, &req.endpoints) {
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            (None, None) => true,
            _ => false,
        };
        let st = &mut self.store.data_mut().req;
        if !seen {
            let props = snapshot(req.endpoints.as_ref());
            st.set_snapshot(
                props.as_ref().map(|p| p.json.clone()),
                props.map(|p| p.version),
            );
            self.seen = req.endpoints.clone();
        }
        st.begin(req);
        let result = self.run_context(ctx, headers, body_len);
        let decision = self.store.data_mut().req.finish(req);
        result.and(decision)
    }

    fn run_context(&mut self, ctx: u32, headers: u32, body_len: u32) -> Result<(), PolicyError> {
        let end_of_stream = u32::from(body_len == 0);
        let Guest {
            store,
            on_context_create,
            on_request_headers,
            on_request_body,
            on_done,
            on_delete,
            deadline_ticks,
            budget_ticks,
            ticks,
            limits,
            ..
        } = self;
        let start = ticks.load(Ordering::Relaxed);
        let budget = Budget {
            start,
            deadline: start.saturating_add(*budget_ticks),
            call_ticks: *deadline_ticks,
            ticks,
            limits,
        };
        budget.call(store, "proxy_on_context_create", |s| {
            on_context_create.call(s, (ctx, ROOT_CONTEXT))
        })?;
        budget.call(store, "proxy_on_request_headers", |s| {
            on_request_headers.call(s, (ctx, headers, end_of_stream))
        })?;
        if end_of_stream == 0
            && !store.data().req.has_local_response()
            && let Some(body) = on_request_body
        {
            budget.call(store, "proxy_on_request_body", |s| {
                body.call(s, (ctx, body_len, 1))
            })?;
        }
        if let Some(done) = on_done {
            budget.call(store, "proxy_on_done", |s| done.call(s, ctx))?;
        }
        if let Some(delete) = on_delete {
            budget.call(store, "proxy_on_delete", |s| delete.call(s, ctx))?;
        }
        Ok(())
    }
}

/// One decision's time budget: the callbacks of a decision that started at
/// epoch tick `start` must all end by tick `deadline`.
struct Budget<'a> {
    start: u64,
    deadline: u64,
    /// Ticks of one call's timeout.
    call_ticks: u64,
    ticks: &'a AtomicU64,
    limits: &'a SandboxLimits,
}

// === impl Budget ===

impl Budget<'_> {
    /// Runs one callback with its epoch deadline armed at the nearer of the
    /// call timeout and the decision's deadline. A budget already spent is
    /// an error before the callback runs; an interruption at the decision's
    /// deadline is [`PolicyError::DecisionBudget`].
    fn call<T>(
        &self,
        store: &mut Store<HostState>,
        callback: &'static str,
        f: impl FnOnce(&mut Store<HostState>) -> wasmtime::Result<T>,
    ) -> Result<T, PolicyError> {
        let now = self.ticks.load(Ordering::Relaxed);
        let Some(left) = self.deadline.checked_sub(now).filter(|&l| l > 0) else {
            return Err(self.spent(callback));
        };
        let by_budget = left < self.call_ticks;
        store.set_epoch_deadline(left.min(self.call_ticks));
        f(store).map_err(|e| {
            if by_budget
                && !store.data().limiter.hit
                && matches!(e.downcast_ref::<Trap>(), Some(Trap::Interrupt))
            {
                self.spent(callback)
            } else {
                classify(store, e, self.limits)
            }
        })
    }

    fn spent(&self, callback: &'static str) -> PolicyError {
        let ticks = self
            .ticks
            .load(Ordering::Relaxed)
            .saturating_sub(self.start);
        PolicyError::DecisionBudget {
            budget: self.limits.decision_budget,
            spent: self.limits.epoch_tick * u32::try_from(ticks).unwrap_or(u32::MAX),
            callback,
        }
    }
}

/// Maps a wasmtime call error to the matching guest fault.
fn classify(store: &Store<HostState>, e: wasmtime::Error, limits: &SandboxLimits) -> PolicyError {
    if store.data().limiter.hit {
        return PolicyError::GuestMemory {
            limit: limits.memory_bytes,
        };
    }
    if let Some(Trap::Interrupt) = e.downcast_ref::<Trap>() {
        return PolicyError::GuestTimeout {
            limit: limits.call_timeout,
        };
    }
    PolicyError::GuestTrap {
        message: format!("{e:#}"),
        guest_log: store.data().errors.clone(),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::ticks_for;

    #[test]
    fn ticks_cover_the_limit_and_never_overflow() {
        let tick = Duration::from_millis(5);
        // Stopped between the limit and one tick past it.
        assert_eq!(ticks_for(Duration::from_millis(10), tick), 3);
        assert_eq!(ticks_for(Duration::from_millis(11), tick), 4);
        assert_eq!(ticks_for(Duration::ZERO, tick), 2);
        let max = ticks_for(Duration::MAX, tick);
        assert!(max > 1 << 60);
        assert!(max.checked_add(u64::MAX >> 1).is_some());
    }
}
