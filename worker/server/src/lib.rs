//! The worker sidecar: prefill / decode / solo roles over HTTP, the PD protocol
//! and model-server metrics.
//!
//! - [`WorkerOptions`] / [`launch`]: the `rngd-pd worker` process (flags, device
//!   allocation, backend, transports, model load, serve).
//! - [`serve`] / [`router`] / [`WorkerState`]: the same server in-process, for
//!   tests and benchmarks.
//! - Endpoints: `POST /v1/completions` (whole requests, PD halves,
//!   `x-prefiller-host-port` orchestration; see `docs/pd-protocol.md`),
//!   `POST /v1/chat/completions` (rendered with the engine's chat template and
//!   served as a completion: whole or orchestrated; answered in the chat
//!   format), `GET /health`, `GET /ready`, `GET /metrics`, `GET /v1/models`,
//!   and vLLM's render and tokenizer endpoints (`render`: `POST
//!   /v1/completions/render`, `/v1/chat/completions/render`, `/tokenize`,
//!   `/detokenize`).
//! - [`error::ApiError`]: every request failure, mapped to a status in one place.
//! - [`admin`]: `POST /reset_prefix_cache` on the authenticated admin
//!   listener; [`events`]: the prefix cache's events onto the KV-event
//!   publisher (`--kv-events-config`).
//! - [`allow`]: the `--prefill-allow` and `--front-door-allow` lists
//!   ([`allow_dns`]: their `dns:` entries, refreshed in the background); [`peer`]:
//!   the bounded prefill-peer client; [`handles`]: random KV keys and signed,
//!   checked KV handles.

pub mod admin;
pub mod allow;
pub mod allow_dns;
pub mod args;
mod completions;
pub mod error;
pub mod events;
pub mod handles;
pub mod metrics;
pub mod peer;
mod render;
pub mod state;
pub mod transports;
pub mod variants;
pub mod weights;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use rngd_engine::Engine;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub use allow::{AllowEntry, AllowError, ClientAllow, PeerAddr, PrefillAllow};
pub use args::{Backend, Role, WorkerOptions};
pub use error::{ApiError, WorkerError};
pub use handles::{HandleSigner, KvAuth};
pub use metrics::WorkerMetrics;
pub use peer::{HttpPrefillPeer, PrefillPeer};
pub use state::{WorkerConfig, WorkerState};
pub use transports::{FixedFactory, RegistryFactory, TransportFactory, Transports};

/// The line a worker prints on stdout once it serves with the model loaded.
pub const LISTENING_PREFIX: &str = "rngd-pd worker listening on http://";

/// The line a worker with `--kv-events-config` prints on stdout once its
/// publisher is bound: the PUB endpoint, then `replay ` and the replay
/// endpoint when there is one (a `*` port resolved).
pub const KV_EVENTS_PREFIX: &str = "rngd-pd worker kv events on ";

/// The line a worker with an admin token prints on stdout once its admin
/// listener is bound.
pub const ADMIN_PREFIX: &str = "rngd-pd worker admin on http://";

impl rngd_http_edge::HasBodyLimits for WorkerState {
    fn body_limits(&self) -> rngd_http_edge::BodyLimits {
        rngd_http_edge::BodyLimits {
            max_bytes: self.config().body_limit,
            deadline: self.config().body_timeout,
        }
    }
}

/// The worker's routes over `state`.
pub fn router(state: WorkerState) -> Router {
    let limit = state.config().body_limit;
    let key = state.config().api_key.clone();
    let routes = Router::new()
        .route("/v1/completions", post(completions::completions))
        .route("/v1/chat/completions", post(completions::chat_completions))
        .route("/health", get(health))
        .route("/ping", get(health).post(health))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics_text))
        .route("/v1/models", get(models))
        .route("/version", get(rngd_http_edge::surface::version))
        .merge(render::routes())
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::extract::DefaultBodyLimit::max(limit));
    rngd_http_edge::api_key::guard(routes, key).with_state(state)
}

/// `/health` and `/ping` (vLLM's alias, GET or POST): the process serves.
async fn health() -> &'static str {
    "ok"
}

async fn not_found(uri: axum::http::Uri) -> ApiError {
    ApiError::NotFound(rngd_http_edge::surface::shown_path(&uri))
}

async fn method_not_allowed(method: axum::http::Method, uri: axum::http::Uri) -> ApiError {
    ApiError::MethodNotAllowed {
        method: method.to_string(),
        path: rngd_http_edge::surface::shown_path(&uri),
    }
}

async fn ready(State(state): State<WorkerState>) -> Response {
    if state.is_ready() {
        (StatusCode::OK, "ready").into_response()
    } else {
        ApiError::NotReady.into_response()
    }
}

async fn metrics_text(State(state): State<WorkerState>) -> Response {
    // Stranded KV as each transport's last sweep found it.
    for t in state.transports().made() {
        if let Some(bytes) = t.stranded_bytes() {
            state.metrics().set_kv_stranded(t.name(), bytes);
        }
    }
    let engine = state.engine();
    let text = state.metrics().render(engine.as_deref());
    ([(header::CONTENT_TYPE, rngd_telemetry::CONTENT_TYPE)], text).into_response()
}

async fn models(State(state): State<WorkerState>) -> Response {
    let (Some(engine), Some(served)) = (state.engine(), state.served()) else {
        return ApiError::NotReady.into_response();
    };
    let seq_len = u32::try_from(engine.info().seq_len).unwrap_or(u32::MAX);
    let root = state.model_root().unwrap_or_default();
    let mut list = served.list(&root, seq_len, rngd_api::rules::unix_now());
    for m in &mut list.data {
        m.weight_version = Some(engine.info().weight_version.clone());
        m.tokenizer_digest = engine.tokenizer_digest().map(String::from);
    }
    axum::Json(list).into_response()
}

/// The request id: `x-request-id` if the client sent a usable one, else a new one.
pub(crate) fn request_id(headers: &HeaderMap) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    if let Some(id) = headers
        .get(rngd_api::headers::REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        .and_then(rngd_api::rules::sanitize_request_id)
    {
        return id;
    }
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!(
        "w{:x}-{:x}-{:x}",
        std::process::id(),
        nanos as u64,
        COUNTER.fetch_add(1, Ordering::Relaxed)
    )
}

/// A worker serving in the background (see [`serve`]).
#[derive(Debug)]
pub struct RunningWorker {
    /// The bound address.
    pub addr: SocketAddr,
    /// Its state (metrics, readiness).
    pub state: WorkerState,
    shutdown: CancellationToken,
    task: JoinHandle<()>,
}

impl RunningWorker {
    /// `http://addr`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops accepting, finishes open requests, and waits.
    pub async fn stop(self) -> Result<(), WorkerError> {
        self.shutdown.cancel();
        match self.task.await {
            Ok(()) => Ok(()),
            Err(e) => Err(WorkerError::Io {
                context: "server task failed".into(),
                source: std::io::Error::other(e),
            }),
        }
    }
}

/// Serves a worker with an already loaded `engine` on `listener`, in the
/// background (in-process use: tests, benchmarks, `rngd-pd up`).
pub async fn serve(
    listener: TcpListener,
    engine: Arc<dyn Engine>,
    transports: Transports,
    config: WorkerConfig,
) -> Result<RunningWorker, WorkerError> {
    let state = WorkerState::new(config, transports)?;
    state.set_engine(engine);
    serve_state(listener, state)
}

/// Serves `state` on `listener` in the background (the engine may be
/// installed later), under the listener limits of its configuration's
/// `edge` (`rngd_http_edge::serve`: header and idle timeouts, connection
/// cap, in-flight body budget, `TCP_NODELAY`, the client's address in every
/// request).
pub fn serve_state(
    listener: TcpListener,
    state: WorkerState,
) -> Result<RunningWorker, WorkerError> {
    let shutdown = CancellationToken::new();
    let token = shutdown.clone();
    let app = router(state.clone());
    let served = rngd_http_edge::serve(listener, app, state.config().edge.clone(), async move {
        token.cancelled().await
    })
    .map_err(|e| WorkerError::Config(e.to_string()))?;
    Ok(RunningWorker {
        addr: served.addr,
        state,
        shutdown,
        task: served.done,
    })
}

/// The vendor and device name `rngd_pd_worker_device_info` reports for
/// `backend` (card `chip` for the NPUs, its name alone for -1, the card
/// the device plugin allocated; the host CPU's vendor for `cpu`).
pub fn device_identity(backend: Backend, chip: i64) -> (String, String) {
    let card = |name: &str| {
        if chip < 0 {
            name.to_string()
        } else {
            format!("{name}{chip}")
        }
    };
    match backend {
        Backend::Cpu => {
            let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
            (cpu_vendor(&info), "cpu".into())
        }
        Backend::Rngd => ("furiosaai".into(), card("rngd")),
        Backend::Atom => ("rebellions".into(), card("atom")),
    }
}

/// The CPU vendor a `/proc/cpuinfo` text names (`vendor_id`): `intel`,
/// `amd`, the id itself in lower case for another, `unknown` without one.
pub fn cpu_vendor(cpuinfo: &str) -> String {
    let id = cpuinfo.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        (k.trim() == "vendor_id").then(|| v.trim().to_string())
    });
    match id.as_deref() {
        Some("GenuineIntel") => "intel".into(),
        Some("AuthenticAMD") => "amd".into(),
        Some(other) if !other.is_empty() => other.to_ascii_lowercase(),
        _ => "unknown".into(),
    }
}

/// Checks that this build can run `backend`.
pub fn check_backend(backend: Backend) -> Result<(), WorkerError> {
    match backend {
        Backend::Cpu => Ok(()),
        Backend::Rngd => Err(WorkerError::BackendUnavailable {
            backend: "rngd",
            vendor: "FuriosaAI",
        }),
        Backend::Atom => Err(WorkerError::BackendUnavailable {
            backend: "atom",
            vendor: "Rebellions",
        }),
    }
}

/// Resolves `--chip` (device plugin allocation for `-1`) against the real device directories.
pub fn select_device(args: &WorkerOptions) -> Result<rngd_devices::Selection, WorkerError> {
    let (lister, prefixes): (rngd_devices::DirCardLister, &[&str]) = match args.backend {
        Backend::Rngd => (rngd_devices::DirCardLister::rngd(), &["furiosa.ai/"]),
        Backend::Atom => (rngd_devices::DirCardLister::atom(), &["rebellions.ai/"]),
        Backend::Cpu => {
            let mut l = rngd_devices::DirCardLister::rngd();
            l.patterns
                .extend(rngd_devices::DirCardLister::atom().patterns);
            (l, &["furiosa.ai/", "rebellions.ai/"])
        }
    };
    let pod = rngd_api::env::var(rngd_api::env::POD_UID);
    let query = rngd_devices::AllocationQuery {
        chip: args.chip,
        pod_uid: pod.as_deref(),
        checkpoint: &args.kubelet_checkpoint,
        resource_prefixes: prefixes,
    };
    rngd_devices::select_chip(&query, &lister).map_err(|e| WorkerError::Devices(Box::new(e)))
}

/// How a worker started from the environment treats KV handles: signed with
/// the deployment's KV secret (`AIRM_KV_TCP_SECRET[_FILE]`) when there is one;
/// without, a prefill or decode worker refuses to start unless
/// `AIRM_KV_TCP_INSECURE_NO_AUTH=1`, and a solo worker serves no PD.
pub fn kv_auth(
    role: Role,
    config: &rngd_kv_transport::TransportConfig,
) -> Result<handles::KvAuth, WorkerError> {
    use rngd_api::env;
    let insecure = env::var(env::AIRM_KV_TCP_INSECURE_NO_AUTH).is_some_and(|v| {
        matches!(
            v.trim().to_ascii_lowercase().as_str(),
            "1" | "true" | "yes" | "on"
        )
    });
    Ok(match (&config.tcp_secret, insecure) {
        (Some(secret), _) => handles::KvAuth::Signed(handles::HandleSigner::new(
            &secret.derive(b"rngd-pd worker kv handles"),
        )),
        (None, true) => {
            tracing::warn!(
                "{}=1: KV handles are neither signed nor verified; run only on a single trusted host",
                env::AIRM_KV_TCP_INSECURE_NO_AUTH
            );
            handles::KvAuth::Insecure
        }
        (None, false) if role == Role::Solo => {
            tracing::info!("no KV secret: this solo worker serves whole requests only (no PD)");
            handles::KvAuth::Off
        }
        (None, false) => {
            return Err(WorkerError::Config(format!(
                "a {} worker signs or verifies KV handles with the deployment's KV secret: set {} or {} ({}=1 runs without, on a single trusted host only)",
                role.as_str(),
                env::AIRM_KV_TCP_SECRET_FILE,
                env::AIRM_KV_TCP_SECRET,
                env::AIRM_KV_TCP_INSECURE_NO_AUTH
            )));
        }
    })
}

/// Runs `rngd-pd worker`: checks the backend, picks the device, sets up the
/// default transport, binds, loads the model (while `/health` already answers
/// and `/ready` says 503), prints [`LISTENING_PREFIX`] + address on stdout, and
/// serves until `shutdown` resolves (the CLI passes SIGINT/SIGTERM).
pub async fn launch(
    args: WorkerOptions,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), WorkerError> {
    check_backend(args.backend)?;
    if args.seq_len == 0 || args.batch == 0 {
        return Err(WorkerError::Config(
            "--seq-len and --batch must be at least 1".into(),
        ));
    }
    // The file is found now (a missing model fails before anything binds);
    // its name is the `root` of `/v1/models`, its stem an accepted alias.
    let model_file = rngd_engine::model_fetch::resolve(args.model.as_deref())
        .map_err(|e| WorkerError::Engine(Box::new(e)))?;
    match select_device(&args) {
        Ok(d) => tracing::info!(
            role = args.role.as_str(),
            backend = args.backend.as_str(),
            ordinal = d.ordinal,
            card = ?d.card,
            source = ?d.source,
            "device selected"
        ),
        // The cpu backend uses no card: a failed lookup (no cards on a CPU node) is only reported.
        Err(e) if args.backend == Backend::Cpu => {
            tracing::info!(error = %e, "cpu backend: no NPU card is used")
        }
        Err(e) => return Err(e),
    }
    let transport_config = rngd_kv_transport::TransportConfig::from_env().map_err(|source| {
        WorkerError::Transport {
            name: args.kv_transport.clone(),
            source: Box::new(source),
        }
    })?;
    let kv_auth = kv_auth(args.role, &transport_config)?;
    let handle_ttl = transport_config.shm_ttl.max(transport_config.tcp_ttl);
    let transports = Transports::new(
        args.kv_transport.clone(),
        RegistryFactory {
            config: transport_config,
        },
    );
    // Create the default transport now: a bad configuration fails at startup,
    // and the shm sweeper starts (it frees caches whose reader never came).
    transports
        .get(None)
        .map_err(|source| WorkerError::Transport {
            name: args.kv_transport.clone(),
            source: Box::new(source),
        })?;
    let listener = TcpListener::bind((args.host.as_str(), args.port))
        .await
        .map_err(|source| WorkerError::Io {
            context: format!("binding {}:{}", args.host, args.port),
            source,
        })?;
    if args.prefill_allow.is_empty() {
        tracing::info!("no --prefill-allow: requests with x-prefiller-host-port are refused");
    } else {
        tracing::info!(prefill_allow = %args.prefill_allow, "prefill peers admitted");
    }
    // The publisher binds now (a bad endpoint fails at startup) and lives as
    // long as the worker.
    let publisher = match &args.kv_events {
        Some(c) => rngd_kv_events::KvEventPublisher::start(c)
            .map_err(|e| WorkerError::Config(format!("--kv-events-config: {e}")))?
            .map(Arc::new),
        None => None,
    };
    if let Some(p) = &publisher {
        use std::io::Write;
        let replay = p
            .replay_endpoint()
            .map(|r| format!(" replay {r}"))
            .unwrap_or_default();
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{KV_EVENTS_PREFIX}{}{replay}", p.endpoint());
        let _ = out.flush();
    }
    let config = WorkerConfig {
        kv_auth,
        handle_ttl,
        model_aliases: rngd_api::models::aliases(&args.served_model_name, Some(&model_file)),
        model_root: Some(rngd_api::models::root(&model_file)),
        ..WorkerConfig::from_args(&args)
    };
    let state = WorkerState::new(config, transports)?;
    let (vendor, device) = device_identity(args.backend, args.chip);
    state
        .metrics()
        .set_device(args.role.as_str(), args.backend.as_str(), &vendor, &device);
    // The allowlists' `dns:` names, looked up now and every few seconds.
    let mut names = args.prefill_allow.dns_names();
    names.extend(args.front_door_allow.dns_names());
    let refresher = allow_dns::refresh(names, Arc::new(allow_dns::SystemResolver));
    let admin = admin::serve(&args.admin, state.clone()).await?;
    if let Some(a) = &admin {
        use std::io::Write;
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{ADMIN_PREFIX}{}", a.addr);
        let _ = out.flush();
    }
    let running = serve_state(listener, state.clone())?;
    tracing::info!(addr = %running.addr, "serving; loading the model");
    let (engine, updater) = load_engine(&args, model_file).await?;
    tracing::info!(model = %engine.info().name, seq_len = engine.info().seq_len, "model loaded");
    state.set_engine(engine);
    state.set_weight_updater(updater);
    if let Some(p) = &publisher {
        let sink = Arc::new(events::PublisherSink(p.clone()));
        if !state.set_prefix_sink(Some(sink)) {
            tracing::warn!(
                "--kv-events-config with the prefix cache off: no block is cached, so no event is published"
            );
        }
    }
    {
        use std::io::Write;
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{LISTENING_PREFIX}{}", running.addr);
        let _ = out.flush();
    }
    shutdown.await;
    tracing::info!("shutting down");
    if let Some(r) = refresher {
        r.abort();
    }
    if let Some(a) = admin {
        a.stop().await;
    }
    let stopped = running.stop().await;
    // What is queued is sent before the sockets close.
    state.set_prefix_sink(None);
    if let Some(p) = publisher.and_then(Arc::into_inner) {
        p.shutdown();
    }
    stopped
}

/// The CPU engine's options the flags describe, for `path`.
fn engine_options(args: &WorkerOptions, path: PathBuf) -> rngd_engine::cpu::CpuEngineOptions {
    let mut opts = rngd_engine::cpu::CpuEngineOptions::new(path);
    opts.seq_len = args.seq_len;
    opts.batch = args.batch;
    opts.threads = args.threads;
    opts.tokenizer = rngd_engine::tokenizer::TokenizerOverrides {
        chat_template: args.chat_template.clone(),
        served_model_name: args.served_model_name.first().cloned(),
    };
    opts.prefix_cache = args.prefix_cache.clone();
    opts.max_num_batched_tokens = args.max_num_batched_tokens;
    opts.prefill_projections = args.prefill_projections;
    opts
}

/// Loads the model (off the runtime) and returns the engine with the
/// updater that can replace its weights later.
async fn load_engine(
    args: &WorkerOptions,
    path: PathBuf,
) -> Result<(Arc<dyn Engine>, weights::WeightUpdater), WorkerError> {
    let loader = Arc::new(weights::CpuLoader(engine_options(args, path.clone())));
    let l = loader.clone();
    let p = path.clone();
    let engine = tokio::task::spawn_blocking(move || {
        use weights::EngineLoader;
        l.load(&p).map_err(Box::new)
    })
    .await
    .map_err(|e| WorkerError::Io {
        context: "model loading task failed".into(),
        source: std::io::Error::other(e),
    })?
    .map_err(WorkerError::Engine)?;
    let updater =
        weights::WeightUpdater::new(loader, &path, None).map_err(|source| WorkerError::Io {
            context: format!("resolving the weights directory of {}", path.display()),
            source,
        })?;
    Ok((engine, updater))
}

#[cfg(test)]
mod device_tests {
    use super::*;

    #[test]
    fn the_device_names_its_vendor() {
        assert_eq!(
            cpu_vendor("vendor_id\t: GenuineIntel\nflags\t: avx2\n"),
            "intel"
        );
        assert_eq!(
            cpu_vendor("processor\t: 0\nvendor_id\t: AuthenticAMD\n"),
            "amd"
        );
        assert_eq!(cpu_vendor("vendor_id\t: HygonGenuine\n"), "hygongenuine");
        assert_eq!(cpu_vendor("processor\t: 0\n"), "unknown");
        assert_eq!(
            device_identity(Backend::Rngd, 3),
            ("furiosaai".to_string(), "rngd3".to_string())
        );
        assert_eq!(
            device_identity(Backend::Atom, -1),
            ("rebellions".to_string(), "atom".to_string())
        );
        assert_eq!(device_identity(Backend::Cpu, 0).1, "cpu");
    }
}
