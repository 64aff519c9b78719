//! Pool discovery: the endpoint list read from the Kubernetes API, as the
//! reference endpoint picker does it. With a pool name and namespace, the
//! source watches that `InferencePool` (`inference.networking.k8s.io/v1`) and
//! the pods its `spec.selector.matchLabels` selects; every Running, Ready pod
//! with an IP is an endpoint at `podIP:spec.targetPorts[0]`, its role, vendor,
//! node, context length, transports and KV-event stream read from its
//! labels, spec and annotations ([`objects`] has the names). Pods that turn unready, start
//! terminating or vanish leave the snapshot with the event that says so.
//!
//! The list/watch protocol (resource versions, `410 Gone` relists, bookmarks,
//! retries with backoff) is the `kube` crate's watcher; a failing watch keeps
//! the last good snapshot and marks it stale (a gauge, a log line) once it has
//! failed for longer than [`KubeOptions::stale_after`].
//!
//! - this module: [`KubeOptions`], [`KubeEndpoints`] (the [`EndpointSource`]),
//!   [`start`], and the name checks `--check` runs;
//! - [`objects`]: the `InferencePool` type and pod → endpoint;
//! - `watch`: the watch loop.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use prometheus::{IntCounterVec, IntGauge, IntGaugeVec, Registry};
use rngd_policy_core::Endpoint;
use rngd_telemetry::names;
use tokio::task::JoinHandle;

use crate::PoolError;
use crate::source::EndpointSource;

pub mod objects;
mod watch;

/// Default of [`KubeOptions::stale_after`].
pub const DEFAULT_STALE_AFTER: Duration = Duration::from_secs(30);

/// What to discover and how.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KubeOptions {
    /// Name of the `InferencePool` (`--pool-name`).
    pub pool_name: String,
    /// Namespace of the pool and its pods (`--pool-namespace`).
    pub namespace: String,
    /// A kubeconfig file (out-of-cluster use); `None` = `$KUBECONFIG` or
    /// `~/.kube/config` if present, else the pod's service account
    /// (in-cluster).
    pub kubeconfig: Option<PathBuf>,
    /// A watch failing for longer than this marks the snapshot stale (it is
    /// still served: the workers' own health comes from the scrapes).
    pub stale_after: Duration,
}

impl KubeOptions {
    /// Options for pool `name` in `namespace`, other fields at their defaults.
    pub fn new(name: impl Into<String>, namespace: impl Into<String>) -> Self {
        KubeOptions {
            pool_name: name.into(),
            namespace: namespace.into(),
            kubeconfig: None,
            stale_after: DEFAULT_STALE_AFTER,
        }
    }

    /// Checks the names (DNS-1123: what the API server accepts) and that the
    /// kubeconfig file, if one is named, parses. Connects to nothing.
    pub fn check(&self) -> Result<(), PoolError> {
        check_name("--pool-name", &self.pool_name, 253, true)?;
        check_name("--pool-namespace", &self.namespace, 63, false)?;
        if let Some(path) = &self.kubeconfig {
            kube::config::Kubeconfig::read_from(path).map_err(|e| PoolError::Discovery {
                what: format!("kubeconfig {}", path.display()),
                source: Box::new(e),
            })?;
        }
        Ok(())
    }
}

/// A DNS-1123 subdomain (`dots`) or label: lower-case alphanumerics and `-`
/// (and `.`), starting and ending alphanumeric.
fn check_name(flag: &str, s: &str, max: usize, dots: bool) -> Result<(), PoolError> {
    let ok_char =
        |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || dots && b == b'.';
    let edge = |b: Option<&u8>| b.is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
    if s.len() > max
        || !s.bytes().all(ok_char)
        || !edge(s.as_bytes().first())
        || !edge(s.as_bytes().last())
    {
        return Err(PoolError::Config(format!(
            "{flag} {s:?}: not a Kubernetes name (lower-case letters, digits, '-'{}; at most {max})",
            if dots { ", '.'" } else { "" }
        )));
    }
    Ok(())
}

// === impl KubeEndpoints ===

/// The discovered endpoints (an [`EndpointSource`]).
#[derive(Debug)]
pub struct KubeEndpoints {
    list: RwLock<Arc<[Endpoint]>>,
    streams: RwLock<Arc<[crate::source::KvStream]>>,
    health: Mutex<WatchHealth>,
    stale_after: Duration,
    metrics: DiscoveryMetrics,
}

#[derive(Debug, Default)]
struct WatchHealth {
    /// When the watch started failing (cleared by the next good event).
    failing_since: Option<Instant>,
    /// The last failure, for the stale log line.
    last_error: String,
    /// Whether the pool and its pods have been listed once.
    synced: bool,
    /// Whether the snapshot is marked stale now.
    stale: bool,
}

#[derive(Debug, Clone)]
struct DiscoveryMetrics {
    endpoints: IntGauge,
    skipped: IntGaugeVec,
    errors: IntCounterVec,
    stale: IntGauge,
}

impl DiscoveryMetrics {
    fn new() -> Self {
        let opts = prometheus::Opts::new;
        // The names and label sets are constants: creation cannot fail.
        DiscoveryMetrics {
            endpoints: IntGauge::with_opts(opts(
                names::DISCOVERY_ENDPOINTS,
                "Endpoints discovered from the InferencePool's ready pods",
            ))
            .expect("valid metric"),
            skipped: IntGaugeVec::new(
                opts(
                    names::DISCOVERY_SKIPPED_PODS,
                    "Pods of the pool that are not endpoints, by reason",
                ),
                &["reason"],
            )
            .expect("valid metric"),
            errors: IntCounterVec::new(
                opts(
                    names::DISCOVERY_WATCH_ERRORS_TOTAL,
                    "Failed list/watch calls of the Kubernetes API, by resource",
                ),
                &["resource"],
            )
            .expect("valid metric"),
            stale: IntGauge::with_opts(opts(
                names::DISCOVERY_STALE,
                "1 while the watch has failed for longer than the stale bound (the last good endpoints are served)",
            ))
            .expect("valid metric"),
        }
    }

    fn register(&self, r: &Registry) -> Result<(), prometheus::Error> {
        r.register(Box::new(self.endpoints.clone()))?;
        r.register(Box::new(self.skipped.clone()))?;
        r.register(Box::new(self.errors.clone()))?;
        r.register(Box::new(self.stale.clone()))
    }
}

impl KubeEndpoints {
    fn new(stale_after: Duration) -> Self {
        let metrics = DiscoveryMetrics::new();
        for reason in ["not_ready", "invalid"] {
            metrics.skipped.with_label_values(&[reason]).set(0);
        }
        KubeEndpoints {
            list: RwLock::new(Vec::new().into()),
            streams: RwLock::new(Vec::new().into()),
            health: Mutex::new(WatchHealth::default()),
            stale_after,
            metrics,
        }
    }

    /// Registers the discovery metrics (`rngd_pd_discovery_*`) in `r`.
    pub fn register_metrics(&self, r: &Registry) -> Result<(), PoolError> {
        self.metrics.register(r).map_err(|e| PoolError::Discovery {
            what: "metrics".into(),
            source: Box::new(e),
        })
    }

    /// Whether the pool and its pods have been listed at least once.
    pub fn synced(&self) -> bool {
        self.health().synced
    }

    /// Whether the snapshot is stale: the watch has failed for longer than the
    /// bound, and what is served is the last good list.
    pub fn is_stale(&self) -> bool {
        self.health().stale
    }

    fn health(&self) -> std::sync::MutexGuard<'_, WatchHealth> {
        self.health.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Replaces the list if it differs (an unchanged list keeps its `Arc`).
    fn publish(
        &self,
        list: Vec<Endpoint>,
        streams: Vec<crate::source::KvStream>,
        skipped: &[(&'static str, i64)],
    ) {
        {
            let mut cur = self.streams.write().unwrap_or_else(|e| e.into_inner());
            if cur[..] != streams[..] {
                *cur = streams.into();
            }
        }
        let m = &self.metrics;
        m.endpoints.set(list.len() as i64);
        for (reason, n) in skipped {
            m.skipped.with_label_values(&[reason]).set(*n);
        }
        let mut cur = self.list.write().unwrap_or_else(|e| e.into_inner());
        if cur[..] != list[..] {
            tracing::info!(endpoints = list.len(), "discovered endpoints changed");
            *cur = list.into();
        }
    }

    fn mark_synced(&self) {
        self.health().synced = true;
    }

    fn watch_ok(&self) {
        let mut h = self.health();
        if h.failing_since.take().is_some() {
            tracing::info!("Kubernetes watch recovered");
        }
        if h.stale {
            h.stale = false;
            self.metrics.stale.set(0);
        }
    }

    fn watch_failed(&self, resource: &str, error: &dyn std::fmt::Display) {
        self.metrics.errors.with_label_values(&[resource]).inc();
        let mut h = self.health();
        let msg = format!("{resource}: {error}");
        if h.failing_since.is_none() {
            tracing::warn!(error = %msg, "Kubernetes watch failed; retrying with backoff, serving the last good endpoints");
            h.failing_since = Some(Instant::now());
        }
        h.last_error = msg;
    }

    /// Marks the snapshot stale once the watch has failed for longer than the bound.
    fn check_stale(&self, now: Instant) {
        let mut h = self.health();
        let stale = h
            .failing_since
            .is_some_and(|t| now.duration_since(t) >= self.stale_after);
        if stale && !h.stale {
            tracing::error!(
                error = %h.last_error,
                after_s = self.stale_after.as_secs_f64(),
                "Kubernetes watch still failing; the endpoint list is stale"
            );
        }
        h.stale = stale;
        self.metrics.stale.set(i64::from(stale));
    }
}

impl EndpointSource for KubeEndpoints {
    fn snapshot(&self) -> Arc<[Endpoint]> {
        Arc::clone(&self.list.read().unwrap_or_else(|e| e.into_inner()))
    }

    fn kv_streams(&self) -> Arc<[crate::source::KvStream]> {
        Arc::clone(&self.streams.read().unwrap_or_else(|e| e.into_inner()))
    }
}

/// A running discovery: the source and its watch task (stopped on drop).
#[derive(Debug)]
pub struct Discovery {
    /// The source the picker reads.
    pub source: Arc<KubeEndpoints>,
    /// The watch task.
    pub task: JoinHandle<()>,
}

/// Builds the API client (kubeconfig or in-cluster) and starts the watch.
/// The list is empty until the first list answers.
pub async fn start(opts: &KubeOptions) -> Result<Discovery, PoolError> {
    opts.check()?;
    let client = client(opts).await?;
    let source = Arc::new(KubeEndpoints::new(opts.stale_after));
    tracing::info!(pool = %opts.pool_name, namespace = %opts.namespace, "watching the InferencePool and its pods");
    let task = tokio::spawn(watch::run(client, opts.clone(), Arc::clone(&source)));
    Ok(Discovery { source, task })
}

async fn client(opts: &KubeOptions) -> Result<kube::Client, PoolError> {
    let fail = |what: String| {
        move |e: Box<dyn std::error::Error + Send + Sync>| PoolError::Discovery { what, source: e }
    };
    let mut config = match &opts.kubeconfig {
        Some(path) => {
            let what = format!("kubeconfig {}", path.display());
            let kc = kube::config::Kubeconfig::read_from(path)
                .map_err(|e| fail(what.clone())(Box::new(e)))?;
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await
                .map_err(|e| fail(what)(Box::new(e)))?
        }
        None => kube::Config::infer().await.map_err(|e| {
            fail("Kubernetes configuration (no kubeconfig, not in a cluster)".into())(Box::new(e))
        })?,
    };
    config.connect_timeout = Some(Duration::from_secs(10));
    // The watcher retries with its own backoff; the client's retry of 503s
    // (up to 15 times, minutes apart) would hide an outage from the stale
    // bound.
    config.default_retry = false;
    kube::Client::try_from(config).map_err(|e| fail("Kubernetes client".into())(Box::new(e)))
}
