//! [`KvIndexer`]: the handle the routers hold. It owns the [`Index`] (behind
//! a mutex the subscriber thread locks per batch and a match locks per
//! lookup) and the one background thread that reads every endpoint's
//! sockets (`stream.rs`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::KvIndexError;
use crate::endpoint::{EndpointSpec, Health};
use crate::index::Index;
use crate::options::Options;
use crate::stats::{EndpointStats, IndexStats};
use crate::stream::{Command, Subscriber};

/// Commands waiting for the thread, at most.
const COMMAND_QUEUE: usize = 16;

/// The running indexer. Dropping it stops the thread (within about one
/// `poll_interval`, or one `replay_timeout` slice of a replay under way) and
/// closes every socket.
pub struct KvIndexer {
    index: Arc<Mutex<Index>>,
    tx: Option<SyncSender<Command>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    options: Options,
}

impl std::fmt::Debug for KvIndexer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvIndexer")
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl KvIndexer {
    /// Starts the subscriber thread with no endpoint.
    pub fn start(options: Options) -> Result<Self, KvIndexError> {
        options.check()?;
        let index = Arc::new(Mutex::new(Index::new(options.max_blocks)));
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, rx) = sync_channel(COMMAND_QUEUE);
        let sub = Subscriber::new(options.clone(), Arc::clone(&index), Arc::clone(&stop));
        let thread = std::thread::Builder::new()
            .name("kv-index".into())
            .spawn(move || sub.run(rx))
            .map_err(|source| KvIndexError::Thread { source })?;
        Ok(KvIndexer {
            index,
            tx: Some(tx),
            stop,
            thread: Some(thread),
            options,
        })
    }

    /// Replaces the endpoint set with `endpoints` (the whole new list): an
    /// endpoint no longer listed is unsubscribed and forgotten, a new one is
    /// subscribed (and replayed from 0 when it has a replay endpoint), one
    /// whose addresses or topic changed is forgotten and subscribed anew.
    /// Returns once the thread applied it (within `command_timeout`); an
    /// endpoint that could not be subscribed is reported (the others are
    /// applied).
    pub fn set_endpoints(&self, endpoints: Vec<EndpointSpec>) -> Result<(), KvIndexError> {
        let mut seen = std::collections::HashSet::new();
        for e in &endpoints {
            let bad = |m: &str| KvIndexError::Endpoint {
                id: e.id.clone(),
                message: m.into(),
            };
            if e.id.is_empty() {
                return Err(bad("the id is empty"));
            }
            if !seen.insert(e.id.as_str()) {
                return Err(bad("listed twice"));
            }
            if e.endpoint.is_empty() {
                return Err(bad("the PUB endpoint is empty"));
            }
        }
        let tx = self.tx.as_ref().ok_or(KvIndexError::Stopped)?;
        let (reply_tx, reply_rx) = sync_channel(1);
        let deadline = Instant::now() + self.options.command_timeout;
        let mut cmd = Command::SetEndpoints(endpoints, reply_tx);
        loop {
            match tx.try_send(cmd) {
                Ok(()) => break,
                Err(TrySendError::Disconnected(_)) => return Err(KvIndexError::Stopped),
                Err(TrySendError::Full(c)) => {
                    if Instant::now() >= deadline {
                        return Err(KvIndexError::Timeout(self.options.command_timeout));
                    }
                    cmd = c;
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        }
        match reply_rx.recv_timeout(self.options.command_timeout) {
            Ok(r) => r,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                Err(KvIndexError::Timeout(self.options.command_timeout))
            }
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => Err(KvIndexError::Stopped),
        }
    }

    /// Drops `endpoint`'s entries now (it answers "no cache information"
    /// from this call on) and asks the thread to rebuild them by a replay
    /// from 0 (without a replay socket it stays without information until
    /// an `AllBlocksCleared`). For a router that found the entries wrong
    /// (its predictions against the engine's reports). `false` when the
    /// endpoint is not in the set.
    pub fn resync(&self, endpoint: &str) -> bool {
        {
            let mut idx = self.lock();
            let Some(slot) = idx.slot(endpoint) else {
                return false;
            };
            idx.clear_slot(slot);
            idx.set_health(slot, Health::Replaying);
        }
        // The thread schedules the replay; a full queue or a stopped thread
        // leaves the entries dropped, which is what matters for routing,
        // and its own checks find the endpoint without information.
        if let Some(tx) = &self.tx {
            let _ = tx.try_send(Command::Resync(endpoint.to_string()));
        }
        true
    }

    fn lock(&self) -> MutexGuard<'_, Index> {
        // A panic while the thread held the lock leaves an index that is
        // still consistent per operation; keep serving it.
        self.index.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The cached prefix of `token_ids` on `endpoint`, in tokens (the longest
    /// run of full blocks from token 0 it holds); `None` when the endpoint is
    /// not in the set or has no cache information (see [`Health`]), never a
    /// silent 0.
    pub fn match_prefix(&self, endpoint: &str, token_ids: &[u32]) -> Option<usize> {
        self.lock().match_prefix(endpoint, token_ids)
    }

    /// [`KvIndexer::match_prefix`] for every endpoint, in id order, the key
    /// chain computed once per block size.
    pub fn match_all(&self, token_ids: &[u32]) -> Vec<(String, Option<usize>)> {
        self.lock().match_all(token_ids)
    }

    /// [`KvIndexer::match_all`] of a prompt sent with vLLM's `cache_salt`
    /// `salt`: only blocks its endpoints stored under the same salt match.
    pub fn match_all_salted(
        &self,
        token_ids: &[u32],
        salt: Option<&str>,
    ) -> Vec<(String, Option<usize>)> {
        self.lock().match_all_salted(token_ids, salt)
    }

    /// One endpoint's state (`None`: not in the set).
    pub fn health(&self, endpoint: &str) -> Option<Health> {
        let idx = self.lock();
        idx.slot(endpoint).and_then(|s| idx.health(s))
    }

    /// The counters, per endpoint and in total.
    pub fn stats(&self) -> IndexStats {
        self.lock().stats(Instant::now())
    }

    /// One endpoint's counters (`None`: not in the set).
    pub fn endpoint_stats(&self, endpoint: &str) -> Option<EndpointStats> {
        self.stats()
            .endpoints
            .into_iter()
            .find(|(id, _)| id == endpoint)
            .map(|(_, s)| s)
    }

    /// The options it runs with.
    pub fn options(&self) -> &Options {
        &self.options
    }

    /// Stops the thread and closes the sockets (what dropping does).
    pub fn shutdown(mut self) {
        self.stop_thread();
    }

    fn stop_thread(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        self.tx.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for KvIndexer {
    fn drop(&mut self) {
        self.stop_thread();
    }
}
