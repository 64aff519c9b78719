//! Shared state of a worker: configuration, engine (once loaded, and
//! replaceable while serving: [`WorkerState::replace_engine`]), transports,
//! metrics and the prefill-peer client.

use std::sync::{Arc, Mutex, OnceLock, RwLock};
use std::time::Duration;

use rngd_api::models::ServedModels;
use rngd_engine::Engine;
use rngd_engine::prefix::PrefixEventSink;

use crate::allow::{ClientAllow, PrefillAllow};
use crate::args::{Role, WorkerOptions};
use crate::error::WorkerError;
use crate::handles::KvAuth;
use crate::metrics::WorkerMetrics;
use crate::peer::{HttpPrefillPeer, PrefillPeer};
use crate::transports::Transports;

/// What a worker does and how long it waits.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// Role.
    pub role: Role,
    /// How long a decode waits for the KV pull.
    pub kv_pull_timeout: Duration,
    /// What an orchestrated decode (`x-prefiller-host-port`) does when this
    /// worker cannot load the KV (expired, gone, consumed):
    /// serve the request whole here (`recompute`, the default) or answer
    /// the refusal (`fail`).
    pub kv_load_failure_policy: rngd_api::pd::KvLoadFailurePolicy,
    /// How long a decode worker waits for its prefill peer.
    pub prefill_timeout: Duration,
    /// Node name (reported as `remote_engine_id` in PD responses).
    pub node: Option<String>,
    /// Prefill peers `x-prefiller-host-port` may name; empty: none (the
    /// header is refused with 403).
    pub prefill_allow: PrefillAllow,
    /// Clients (by socket address) that may send `do_remote_decode`: the
    /// front doors and decode workers. Default: loopback only.
    pub front_door_allow: ClientAllow,
    /// How KV handles are signed and checked; [`KvAuth::Off`] refuses PD.
    pub kv_auth: KvAuth,
    /// How long a signed handle stays valid (the transports' TTL).
    pub handle_ttl: Duration,
    /// Largest request body, bytes (larger: 413).
    pub body_limit: usize,
    /// Time a client has to send its whole body (then 408).
    pub body_timeout: Duration,
    /// Completion requests admitted at once (waiting in the engine's queue or
    /// running, their pulled KV held); one more is a 429 at once, never a
    /// wait.
    pub max_in_flight: usize,
    /// The limits of the worker's listener (header and idle timeouts,
    /// connection cap, in-flight body bytes; `docs/pd-protocol.md`,
    /// "Listener limits").
    pub edge: rngd_http_edge::Options,
    /// Model names accepted besides the engine's own
    /// ([`rngd_api::models::aliases`]); any other is a 404.
    pub model_aliases: Vec<String>,
    /// The model file's name, the `root` of `/v1/models`; `None`: the
    /// engine's model name.
    pub model_root: Option<String>,
    /// The API key every route but the probes and metrics wants, and that
    /// this worker sends its prefill peers; `None`: open.
    pub api_key: Option<rngd_http_edge::api_key::ApiKey>,
}

impl WorkerConfig {
    /// Defaults for `role`: 30 s KV pull timeout, 120 s prefill-peer timeout,
    /// no prefill peer allowed, `do_remote_decode` from loopback only, no KV
    /// secret (PD refused until [`WorkerConfig::kv_auth`] is set), 60 s
    /// handles, 2 MiB bodies.
    pub fn new(role: Role) -> Self {
        WorkerConfig {
            role,
            kv_pull_timeout: Duration::from_secs(30),
            kv_load_failure_policy: rngd_api::pd::KvLoadFailurePolicy::Recompute,
            prefill_timeout: Duration::from_secs(120),
            node: None,
            prefill_allow: PrefillAllow::default(),
            front_door_allow: ClientAllow::loopback(),
            kv_auth: KvAuth::Off,
            handle_ttl: Duration::from_secs(60),
            body_limit: crate::args::DEFAULT_BODY_LIMIT,
            body_timeout: Duration::from_secs(30),
            max_in_flight: crate::args::DEFAULT_MAX_IN_FLIGHT,
            edge: rngd_http_edge::Options::default(),
            model_aliases: Vec::new(),
            model_root: None,
            api_key: None,
        }
    }

    /// This configuration with handles signed and checked under `secret`.
    pub fn with_kv_secret(mut self, secret: &[u8]) -> Self {
        self.kv_auth = KvAuth::Signed(crate::handles::HandleSigner::new(secret));
        self
    }

    /// The configuration the flags describe (`kv_auth` and `handle_ttl` come
    /// from the transports' configuration, set by [`crate::launch`]).
    pub fn from_args(args: &WorkerOptions) -> Self {
        WorkerConfig {
            kv_pull_timeout: Duration::from_millis(args.kv_pull_timeout_ms),
            kv_load_failure_policy: args.kv_load_failure_policy,
            prefill_timeout: Duration::from_millis(args.prefill_timeout_ms),
            node: args.node.clone(),
            prefill_allow: args.prefill_allow.clone(),
            front_door_allow: args.front_door_allow.clone(),
            body_limit: args.body_limit,
            body_timeout: Duration::from_millis(args.body_timeout_ms),
            max_in_flight: args.max_in_flight,
            edge: args.edge.clone(),
            api_key: args.api_key.clone(),
            ..WorkerConfig::new(args.role)
        }
    }
}

struct Inner {
    slots: Arc<tokio::sync::Semaphore>,
    config: WorkerConfig,
    engine: RwLock<Option<Arc<dyn Engine>>>,
    /// The prefix cache's event sink, moved to a replacing engine.
    prefix_sink: Mutex<Option<Arc<dyn PrefixEventSink>>>,
    served: OnceLock<Arc<ServedModels>>,
    weights: OnceLock<Arc<crate::weights::WeightUpdater>>,
    transports: Transports,
    metrics: WorkerMetrics,
    peer: Arc<dyn PrefillPeer>,
    used_handles: crate::handles::UsedHandles,
}

/// Cheaply clonable handle on a worker's state (the axum state).
#[derive(Clone)]
pub struct WorkerState(Arc<Inner>);

impl std::fmt::Debug for WorkerState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerState")
            .field("config", &self.0.config)
            .field("ready", &self.is_ready())
            .finish_non_exhaustive()
    }
}

impl WorkerState {
    /// A worker with no engine yet (`/ready` answers 503 until [`WorkerState::set_engine`]),
    /// calling prefill peers over HTTP.
    pub fn new(config: WorkerConfig, transports: Transports) -> Result<Self, WorkerError> {
        let peer = HttpPrefillPeer::new().with_api_key(config.api_key.clone());
        Self::with_peer(config, transports, Arc::new(peer))
    }

    /// Like [`WorkerState::new`] with another prefill-peer client (tests).
    pub fn with_peer(
        config: WorkerConfig,
        transports: Transports,
        peer: Arc<dyn PrefillPeer>,
    ) -> Result<Self, WorkerError> {
        Ok(WorkerState(Arc::new(Inner {
            slots: Arc::new(tokio::sync::Semaphore::new(config.max_in_flight.max(1))),
            config,
            engine: RwLock::new(None),
            prefix_sink: Mutex::new(None),
            served: OnceLock::new(),
            weights: OnceLock::new(),
            transports,
            metrics: WorkerMetrics::new().map_err(WorkerError::Metrics)?,
            peer,
            used_handles: crate::handles::UsedHandles::default(),
        })))
    }

    /// Installs the loaded engine; returns false if one was already installed.
    /// The served names become the engine's model name and the configured
    /// aliases.
    pub fn set_engine(&self, engine: Arc<dyn Engine>) -> bool {
        let served = Arc::new(ServedModels::new(
            engine.info().name.clone(),
            self.0.config.model_aliases.clone(),
        ));
        // Names first: whoever sees the engine sees its names (a second
        // engine is refused, and the first one's names stay).
        let _ = self.0.served.set(served);
        let mut slot = self.0.engine.write().unwrap_or_else(|p| p.into_inner());
        if slot.is_some() {
            return false;
        }
        // Its iterations feed `vllm:iteration_tokens_total`.
        engine.set_iteration_observer(Some(self.metrics().iteration_observer(&engine.info().name)));
        if let Some(sink) = self.prefix_sink() {
            engine.set_prefix_events(Some(sink));
        }
        *slot = Some(engine);
        true
    }

    /// Attaches the prefix cache's event sink (the KV-event publisher) to the
    /// engine serving now and to any that replaces it; false when the engine
    /// keeps no prefix cache (nothing will be published).
    pub fn set_prefix_sink(&self, sink: Option<Arc<dyn PrefixEventSink>>) -> bool {
        *self.0.prefix_sink.lock().unwrap_or_else(|p| p.into_inner()) = sink.clone();
        self.engine().is_some_and(|e| e.set_prefix_events(sink))
    }

    fn prefix_sink(&self) -> Option<Arc<dyn PrefixEventSink>> {
        self.0
            .prefix_sink
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Replaces the engine serving new requests with `engine` (other weights
    /// of the same model) and returns the one it replaced. Requests already
    /// admitted keep the engine they started on (they hold it) and finish
    /// there; no request sees both. The replacement must serve the same
    /// names, KV layout, context and vocabulary (a client, a router and a
    /// PD peer see only its `weight_version` change); otherwise it is
    /// refused with the difference and the old engine stays. The old
    /// engine's prefix cache stops publishing and routers are told every
    /// block is gone (`AllBlocksCleared`): the new one starts empty.
    pub fn replace_engine(&self, engine: Arc<dyn Engine>) -> Result<Arc<dyn Engine>, String> {
        self.swap_engine(engine, false)
    }

    /// [`WorkerState::replace_engine`] for a variant of the same weights
    /// (`/switch_variant`): the context length (and the KV layout's
    /// `seq_len`) may differ, the `weight_version` may not. Its prefix
    /// cache is emptied before it serves (a prepared variant may hold
    /// blocks routers were told are gone).
    pub fn replace_variant(&self, engine: Arc<dyn Engine>) -> Result<Arc<dyn Engine>, String> {
        self.swap_engine(engine, true)
    }

    fn swap_engine(
        &self,
        engine: Arc<dyn Engine>,
        variant: bool,
    ) -> Result<Arc<dyn Engine>, String> {
        let mut slot = self.0.engine.write().unwrap_or_else(|p| p.into_inner());
        let Some(old) = slot.clone() else {
            return Err("no engine is loaded yet".into());
        };
        let (a, b) = (old.info(), engine.info());
        let layout = |l: &rngd_engine::KvLayout| {
            let mut l = *l;
            if variant {
                l.seq_len = 0;
            }
            l
        };
        let differs = if a.name != b.name {
            Some(format!("model name {:?}, serving {:?}", b.name, a.name))
        } else if variant && a.weight_version != b.weight_version {
            Some(format!(
                "weight_version {}, serving {}",
                b.weight_version, a.weight_version
            ))
        } else if layout(&a.kv_layout) != layout(&b.kv_layout) {
            Some(format!(
                "KV layout {:?}, serving {:?}",
                b.kv_layout, a.kv_layout
            ))
        } else if a.vocab_size != b.vocab_size {
            Some(format!(
                "vocabulary of {} tokens, serving {}",
                b.vocab_size, a.vocab_size
            ))
        } else {
            None
        };
        if let Some(d) = differs {
            return Err(format!("the new model has {d}"));
        }
        engine.set_iteration_observer(Some(self.metrics().iteration_observer(&b.name)));
        if variant {
            // Nothing is attached yet: no event leaves.
            engine.reset_prefix_cache();
        }
        if let Some(sink) = self.prefix_sink() {
            old.set_prefix_events(None);
            sink.publish(rngd_engine::prefix::PrefixEvent::AllCleared);
            engine.set_prefix_events(Some(sink));
        }
        *slot = Some(engine);
        Ok(old)
    }

    /// Lets the admin API update the weights through `updater`; false if
    /// one was set already.
    pub fn set_weight_updater(&self, updater: crate::weights::WeightUpdater) -> bool {
        self.0.weights.set(Arc::new(updater)).is_ok()
    }

    /// What updates the weights, if this worker can.
    pub fn weight_updater(&self) -> Option<&Arc<crate::weights::WeightUpdater>> {
        self.0.weights.get()
    }

    /// The `root` of `/v1/models`: the name of the file serving now.
    pub fn model_root(&self) -> Option<String> {
        match self.weight_updater() {
            Some(u) => Some(u.current_file()),
            None => self.0.config.model_root.clone(),
        }
    }

    /// The names the model is served under, once loaded.
    pub fn served(&self) -> Option<&Arc<ServedModels>> {
        self.0.served.get()
    }

    /// The engine serving new requests, once loaded (a request keeps the
    /// one it got: [`WorkerState::replace_engine`]).
    pub fn engine(&self) -> Option<Arc<dyn Engine>> {
        self.0
            .engine
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Whether the model is loaded.
    pub fn is_ready(&self) -> bool {
        self.0
            .engine
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .is_some()
    }

    /// The configuration.
    pub fn config(&self) -> &WorkerConfig {
        &self.0.config
    }

    /// The transports.
    pub fn transports(&self) -> &Transports {
        &self.0.transports
    }

    /// The metrics.
    pub fn metrics(&self) -> &WorkerMetrics {
        &self.0.metrics
    }

    /// An engine slot for one request, or `None` when all are taken.
    pub fn try_admit(&self) -> Option<Slot> {
        let permit = Arc::clone(&self.0.slots).try_acquire_owned().ok()?;
        self.0.metrics.in_flight.inc();
        Some(Slot {
            _permit: permit,
            in_flight: self.0.metrics.in_flight.clone(),
        })
    }

    /// The prefill-peer client.
    pub fn peer(&self) -> &dyn PrefillPeer {
        &*self.0.peer
    }

    /// The KV handles this worker consumed or released (a second decode of
    /// one is refused at once).
    pub fn used_handles(&self) -> &crate::handles::UsedHandles {
        &self.0.used_handles
    }
}

impl crate::weights::EngineSlot for WorkerState {
    fn engine(&self) -> Option<Arc<dyn Engine>> {
        WorkerState::engine(self)
    }

    fn replace_engine(&self, engine: Arc<dyn Engine>) -> Result<Arc<dyn Engine>, String> {
        WorkerState::replace_engine(self, engine)
    }

    fn replace_variant(&self, engine: Arc<dyn Engine>) -> Result<Arc<dyn Engine>, String> {
        WorkerState::replace_variant(self, engine)
    }
}

/// One request's engine slot; dropping it frees the slot.
#[derive(Debug)]
pub struct Slot {
    _permit: tokio::sync::OwnedSemaphorePermit,
    in_flight: prometheus::Gauge,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.in_flight.dec();
    }
}
