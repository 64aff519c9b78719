//! Replacing the active module: [`PolicyRuntime::swap`] (compile off the
//! serving threads, self-test, activate atomically; the old module stays on
//! failure) and [`PolicyRuntime::watch`] (poll the module file and swap when
//! its content changes; a module rolled back is not loaded again).
//! Also the way back: a hot-swapped module's guest faults are counted, and
//! the `rollback_after`-th within `rollback_window` makes the module before
//! it active again.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant, SystemTime};

use super::{Fallback, Loaded, PolicyRuntime, lock, prepare};
use crate::{ModuleInfo, PolicyError, sha256_hex};

/// Modules rolled back and remembered so the file watcher does not load
/// them again (by SHA-256; the oldest are forgotten past this many).
const MAX_REMEMBERED_ROLLBACKS: usize = 16;

// === impl PolicyRuntime ===

impl PolicyRuntime {
    /// Compiles `wasm` off the serving threads, self-tests it with canned
    /// requests and makes it active. In-flight requests finish on the old
    /// module. On failure the old module stays active and the error says why.
    pub async fn swap(&self, wasm: Vec<u8>) -> Result<ModuleInfo, PolicyError> {
        self.swap_from(wasm, None).await
    }

    async fn swap_from(
        &self,
        wasm: Vec<u8>,
        path: Option<PathBuf>,
    ) -> Result<ModuleInfo, PolicyError> {
        let _serial = self.swap_lock.lock().await;
        let me = self.me()?;
        let sha = sha256_hex(&wasm);
        // Unique across swaps and rollbacks (a rollback may happen meanwhile).
        let generation = self.next_generation.fetch_add(1, Ordering::AcqRel);
        let res =
            tokio::task::spawn_blocking(move || prepare(&me.sandbox(), &wasm, path, generation))
                .await
                .map_err(|e| PolicyError::Unavailable {
                    detail: format!("compile thread failed: {e}"),
                })
                .and_then(|r| r);
        match res {
            Ok(mut first) => {
                let info = first.loaded.info.clone();
                let mut active = self
                    .active
                    .write()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                // What a rollback of the new module restores: the module
                // active now (only its code; not its own predecessor).
                if let Some(new) = Arc::get_mut(&mut first.loaded) {
                    new.previous = Some(Fallback {
                        info: active.info.clone(),
                        pre: active.pre.clone(),
                    });
                }
                let old = std::mem::replace(&mut *active, first.loaded.clone());
                self.generation.store(generation, Ordering::Release);
                drop(active);
                // The old module's idle instances go now; those running
                // finish their request and are dropped when handed back.
                let stale = std::mem::replace(&mut *lock(&self.idle), vec![first]);
                drop(stale);
                self.metrics.reloads.inc();
                tracing::info!(sha256 = %info.sha256, previous = %old.info.sha256, "policy module swapped");
                Ok(info)
            }
            Err(e) => {
                self.metrics.reload_failures.inc();
                tracing::warn!(sha256 = %sha, error = %e, "policy module rejected; the active module stays");
                Err(e)
            }
        }
    }

    /// Polls the module file every `every` and swaps when its content changes
    /// (also through a symlink swap, as a mounted ConfigMap does). A bad file
    /// is reported once per content and never replaces the active module.
    /// The task ends when the runtime is dropped.
    pub fn watch(self: &Arc<Self>, every: Duration) -> tokio::task::JoinHandle<()> {
        let weak = Arc::downgrade(self);
        let path = self.path.clone();
        // Taken now, not when the task first runs, so a change in between is seen.
        let mut last_stat = stat_now(&path);
        tokio::spawn(async move {
            let mut last_failed: Option<String> = None;
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(rt) = weak.upgrade() else { break };
                let now = stat(&path).await;
                if now == last_stat {
                    continue;
                }
                last_stat = now;
                let bytes = match tokio::fs::read(&path).await {
                    Ok(b) => b,
                    Err(e) => {
                        tracing::warn!(path = %path.display(), error = %e, "policy module unreadable; keeping the active one");
                        continue;
                    }
                };
                let sha = sha256_hex(&bytes);
                if sha == rt.active().sha256 || last_failed.as_deref() == Some(sha.as_str()) {
                    continue;
                }
                if rt.was_rolled_back(&sha) {
                    tracing::info!(path = %path.display(), sha256 = %sha, "policy module file holds the module rolled back; not reloaded until it changes");
                    continue;
                }
                match rt.swap_from(bytes, Some(path.clone())).await {
                    Ok(_) => last_failed = None,
                    Err(_) => last_failed = Some(sha),
                }
            }
        })
    }
}

// === impl PolicyRuntime (rollback) ===

impl PolicyRuntime {
    /// Counts a guest fault of `loaded`; the `rollback_after`-th within
    /// `rollback_window` of a hot-swapped module rolls it back.
    pub(super) fn note_fault(&self, loaded: &Arc<Loaded>) {
        let n = self.limits.rollback_after as usize;
        if n == 0 || loaded.previous.is_none() {
            return;
        }
        let now = Instant::now();
        let mut faults = lock(&loaded.faults);
        faults.push_back(now);
        while faults.len() > n {
            faults.pop_front();
        }
        let within = faults
            .front()
            .is_some_and(|&first| now.duration_since(first) <= self.limits.rollback_window);
        if faults.len() < n || !within {
            return;
        }
        faults.clear();
        drop(faults);
        self.roll_back(loaded);
    }

    /// Makes the module active before `bad` active again, if `bad` is
    /// still the active module.
    fn roll_back(&self, bad: &Arc<Loaded>) {
        let Some(prev) = &bad.previous else { return };
        let mut active = self
            .active
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if active.generation != bad.generation {
            // Swapped or rolled back meanwhile.
            return;
        }
        let generation = self.next_generation.fetch_add(1, Ordering::AcqRel);
        let restored = Arc::new(Loaded {
            info: ModuleInfo {
                loaded_at: SystemTime::now(),
                ..prev.info.clone()
            },
            pre: prev.pre.clone(),
            generation,
            previous: None,
            faults: Mutex::default(),
        });
        *active = restored;
        self.generation.store(generation, Ordering::Release);
        drop(active);
        let stale = std::mem::take(&mut *lock(&self.idle));
        drop(stale);
        {
            let mut bad_list = lock(&self.rolled_back);
            if !bad_list.contains(&bad.info.sha256) {
                if bad_list.len() >= MAX_REMEMBERED_ROLLBACKS {
                    bad_list.pop_front();
                }
                bad_list.push_back(bad.info.sha256.clone());
            }
        }
        self.metrics.rollbacks.inc();
        tracing::error!(
            bad = %bad.info.sha256,
            restored = %prev.info.sha256,
            faults = self.limits.rollback_after,
            window = ?self.limits.rollback_window,
            "policy module rolled back after repeated runtime faults; the previous module is active again and the bad one is not reloaded from its file until that changes"
        );
    }

    /// Whether the module with this SHA-256 was rolled back (the watcher
    /// does not load it again).
    pub(crate) fn was_rolled_back(&self, sha256: &str) -> bool {
        lock(&self.rolled_back).iter().any(|s| s == sha256)
    }
}

type FileStamp = (u64, Option<SystemTime>, u64);

fn stamp(m: &std::fs::Metadata) -> FileStamp {
    use std::os::unix::fs::MetadataExt;
    (m.len(), m.modified().ok(), m.ino())
}

fn stat_now(path: &Path) -> Option<FileStamp> {
    std::fs::metadata(path).ok().as_ref().map(stamp)
}

async fn stat(path: &Path) -> Option<FileStamp> {
    tokio::fs::metadata(path).await.ok().as_ref().map(stamp)
}
