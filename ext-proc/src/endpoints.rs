//! Where the endpoint snapshot (`rngd_pd.endpoints`) comes from.
//!
//! [`EndpointSource`] is the seam: [`FileEndpoints`] reads a JSON list of
//! [`Endpoint`]s and reloads it when the file changes; [`ScrapedEndpoints`]
//! wraps any source and, as GIE's picker does, scrapes every endpoint's
//! `/metrics` (vLLM names) on an interval, marking an endpoint unhealthy when
//! its last good scrape is older than the staleness limit. Kubernetes
//! InferencePool discovery would be another [`EndpointSource`].

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use rngd_policy_core::Endpoint;
use rngd_telemetry::names;
use tokio::task::JoinHandle;

use crate::ExtProcError;
use crate::metrics::EppMetrics;

/// Default scrape interval (GIE's refresh-metrics interval).
pub const DEFAULT_SCRAPE_INTERVAL: Duration = Duration::from_millis(50);
/// Default age after which scraped data is stale and the endpoint unhealthy.
pub const DEFAULT_STALE_AFTER: Duration = Duration::from_secs(2);
/// Default poll interval of the endpoints file.
pub const DEFAULT_FILE_POLL: Duration = Duration::from_millis(200);

/// A source of the endpoint snapshot the policy sees.
pub trait EndpointSource: Send + Sync + 'static {
    /// The endpoints now. A source hands out the same `Arc` while its list is
    /// unchanged, so a consumer can recognise an unchanged list by pointer
    /// (the policy host then skips re-serializing it).
    fn snapshot(&self) -> Arc<[Endpoint]>;
}

/// A fixed, replaceable list (tests, embedding).
#[derive(Debug, Default)]
pub struct StaticEndpoints {
    list: RwLock<Arc<[Endpoint]>>,
}

impl StaticEndpoints {
    /// A source with these endpoints.
    pub fn new(list: Vec<Endpoint>) -> Arc<Self> {
        Arc::new(StaticEndpoints {
            list: RwLock::new(list.into()),
        })
    }

    /// Replaces the list.
    pub fn set(&self, list: Vec<Endpoint>) {
        *self.list.write().unwrap_or_else(|e| e.into_inner()) = list.into();
    }
}

impl EndpointSource for StaticEndpoints {
    fn snapshot(&self) -> Arc<[Endpoint]> {
        Arc::clone(&self.list.read().unwrap_or_else(|e| e.into_inner()))
    }
}

/// Endpoints from a JSON file (a list of [`Endpoint`]), reloaded on change.
///
/// A file that fails to parse on reload is logged and ignored: the last good
/// list stays active.
#[derive(Debug)]
pub struct FileEndpoints {
    path: PathBuf,
    state: RwLock<(Vec<u8>, Arc<[Endpoint]>)>,
}

fn read_endpoints(path: &Path) -> Result<(Vec<u8>, Arc<[Endpoint]>), ExtProcError> {
    let raw = std::fs::read(path).map_err(|source| ExtProcError::EndpointsRead {
        path: path.to_path_buf(),
        source,
    })?;
    let list: Vec<Endpoint> =
        serde_json::from_slice(&raw).map_err(|source| ExtProcError::EndpointsParse {
            path: path.to_path_buf(),
            source,
        })?;
    Ok((raw, list.into()))
}

impl FileEndpoints {
    /// Loads the file (it must exist and parse).
    pub fn load(path: impl Into<PathBuf>) -> Result<Arc<Self>, ExtProcError> {
        let path = path.into();
        let state = read_endpoints(&path)?;
        tracing::info!(path = %path.display(), endpoints = state.1.len(), "endpoints loaded");
        Ok(Arc::new(FileEndpoints {
            path,
            state: RwLock::new(state),
        }))
    }

    /// Re-reads the file; returns whether the list changed.
    pub fn reload(&self) -> Result<bool, ExtProcError> {
        let (raw, list) = read_endpoints(&self.path)?;
        let mut state = self.state.write().unwrap_or_else(|e| e.into_inner());
        if state.0 == raw {
            return Ok(false);
        }
        tracing::info!(path = %self.path.display(), endpoints = list.len(), "endpoints reloaded");
        *state = (raw, list);
        Ok(true)
    }

    /// Polls the file every `every` and reloads it when its content changes.
    pub fn watch(self: &Arc<Self>, every: Duration) -> JoinHandle<()> {
        let this = Arc::clone(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut last_error = String::new();
            loop {
                tick.tick().await;
                match this.reload() {
                    Ok(_) => last_error.clear(),
                    Err(e) => {
                        let msg = e.to_string();
                        if msg != last_error {
                            tracing::warn!(error = %e, "endpoints file not reloaded; keeping the last good list");
                            last_error = msg;
                        }
                    }
                }
            }
        })
    }
}

impl EndpointSource for FileEndpoints {
    fn snapshot(&self) -> Arc<[Endpoint]> {
        Arc::clone(&self.state.read().unwrap_or_else(|e| e.into_inner()).1)
    }
}

/// Fetches an endpoint's `/metrics` text.
#[async_trait]
pub trait MetricsFetcher: Send + Sync + 'static {
    /// The Prometheus text of `address` (`ip:port`).
    async fn fetch(&self, address: &str) -> Result<String, ExtProcError>;
}

/// [`MetricsFetcher`] over HTTP: `GET http://ADDRESS/metrics`.
#[derive(Debug, Clone)]
pub struct HttpFetcher {
    client: reqwest::Client,
}

impl HttpFetcher {
    /// A fetcher whose requests time out after `timeout`.
    pub fn new(timeout: Duration) -> Self {
        let client = reqwest::Client::builder()
            .timeout(timeout)
            .pool_max_idle_per_host(2)
            .build()
            .unwrap_or_default();
        HttpFetcher { client }
    }
}

#[async_trait]
impl MetricsFetcher for HttpFetcher {
    async fn fetch(&self, address: &str) -> Result<String, ExtProcError> {
        let err = |source| ExtProcError::Scrape {
            address: address.to_string(),
            source,
        };
        let resp = self
            .client
            .get(format!("http://{address}/metrics"))
            .send()
            .await
            .map_err(err)?;
        if !resp.status().is_success() {
            return Err(ExtProcError::ScrapeContent {
                address: address.to_string(),
                reason: format!("HTTP {}", resp.status()),
            });
        }
        resp.text().await.map_err(err)
    }
}

/// Load figures parsed from one scrape.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct LoadSample {
    /// `vllm:num_requests_waiting` (summed over label sets).
    pub waiting: u32,
    /// `vllm:num_requests_running` (summed over label sets).
    pub running: u32,
    /// `vllm:kv_cache_usage_perc` (largest over label sets).
    pub kv_usage: f64,
}

/// Parses the vLLM model-server metrics out of a Prometheus text page.
///
/// Returns `None` when neither request gauge is present (not a model server).
pub fn parse_load(text: &str) -> Option<LoadSample> {
    let mut sample = LoadSample::default();
    let mut seen = false;
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let name_end = line.find(['{', ' ']).unwrap_or(line.len());
        let name = &line[..name_end];
        let rest = &line[name_end..];
        let rest = match rest.strip_prefix('{') {
            Some(r) => match r.find('}') {
                Some(i) => &r[i + 1..],
                None => continue,
            },
            None => rest,
        };
        let Some(value) = rest
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok())
        else {
            continue;
        };
        match name {
            names::VLLM_NUM_REQUESTS_WAITING => {
                sample.waiting = sample.waiting.saturating_add(value.max(0.0) as u32);
                seen = true;
            }
            names::VLLM_NUM_REQUESTS_RUNNING => {
                sample.running = sample.running.saturating_add(value.max(0.0) as u32);
                seen = true;
            }
            names::VLLM_KV_CACHE_USAGE_PERC => sample.kv_usage = sample.kv_usage.max(value),
            _ => {}
        }
    }
    seen.then_some(sample)
}

#[derive(Debug, Clone, Copy)]
struct Scraped {
    sample: LoadSample,
    at: Instant,
}

/// The scraped samples and the last snapshot built from them.
#[derive(Default)]
struct ScrapeState {
    samples: HashMap<String, Scraped>,
    /// Bumped when a sample's figures change or an endpoint gains or loses
    /// one (a re-scrape with the same figures only refreshes its time).
    generation: u64,
    cached: Option<CachedSnapshot>,
}

/// A built snapshot and what it was built from.
struct CachedSnapshot {
    inner: Arc<[Endpoint]>,
    generation: u64,
    /// The first moment a sample it used turns stale (then it is rebuilt).
    valid_until: Option<Instant>,
    built: Arc<[Endpoint]>,
}

/// An [`EndpointSource`] that adds live load figures and freshness to another source.
pub struct ScrapedEndpoints {
    inner: Arc<dyn EndpointSource>,
    fetcher: Arc<dyn MetricsFetcher>,
    stale_after: Duration,
    state: Mutex<ScrapeState>,
    metrics: Option<EppMetrics>,
}

impl std::fmt::Debug for ScrapedEndpoints {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ScrapedEndpoints")
            .field("stale_after", &self.stale_after)
            .finish_non_exhaustive()
    }
}

impl ScrapedEndpoints {
    /// Wraps `inner`; data older than `stale_after` marks an endpoint unhealthy.
    pub fn new(
        inner: Arc<dyn EndpointSource>,
        fetcher: Arc<dyn MetricsFetcher>,
        stale_after: Duration,
        metrics: Option<EppMetrics>,
    ) -> Arc<Self> {
        Arc::new(ScrapedEndpoints {
            inner,
            fetcher,
            stale_after,
            state: Mutex::new(ScrapeState::default()),
            metrics,
        })
    }

    /// Scrapes one endpoint now and records the result (at `Instant::now()`).
    pub async fn scrape_one(&self, address: &str) -> Result<LoadSample, ExtProcError> {
        let result = self.fetcher.fetch(address).await.and_then(|text| {
            parse_load(&text).ok_or_else(|| ExtProcError::ScrapeContent {
                address: address.to_string(),
                reason: "no vllm:num_requests_* metrics on the page".to_string(),
            })
        });
        match &result {
            Ok(sample) => {
                let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
                let now = Instant::now();
                let changed = match st.samples.get_mut(address) {
                    Some(old) => {
                        // A sample that had gone stale counts as a change too.
                        let changed = old.sample != *sample
                            || now.saturating_duration_since(old.at) > self.stale_after;
                        old.sample = *sample;
                        old.at = now;
                        changed
                    }
                    None => {
                        st.samples.insert(
                            address.to_string(),
                            Scraped {
                                sample: *sample,
                                at: now,
                            },
                        );
                        true
                    }
                };
                if changed {
                    st.generation += 1;
                }
            }
            Err(_) => {
                if let Some(m) = &self.metrics {
                    m.scrape_failures.inc();
                }
            }
        }
        result
    }

    /// Scrapes every endpoint of the inner source once, concurrently.
    pub async fn scrape_all(&self) {
        let addrs: Vec<String> = self
            .inner
            .snapshot()
            .iter()
            .map(|e| e.address.clone())
            .collect();
        futures::future::join_all(addrs.iter().map(|a| self.scrape_one(a))).await;
    }

    /// The snapshot as it would be at `now` (data older than the limit =
    /// unhealthy). The same `Arc` comes back while neither the inner list nor
    /// any sample's figures changed and no sample it used has gone stale.
    pub fn snapshot_at(&self, now: Instant) -> Arc<[Endpoint]> {
        let inner = self.inner.snapshot();
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = &st.cached
            && Arc::ptr_eq(&c.inner, &inner)
            && c.generation == st.generation
            && c.valid_until.is_none_or(|t| now < t)
        {
            return Arc::clone(&c.built);
        }
        let mut valid_until: Option<Instant> = None;
        let built: Arc<[Endpoint]> = inner
            .iter()
            .map(|ep| {
                let mut ep = ep.clone();
                match st.samples.get(&ep.address) {
                    Some(s) if now.saturating_duration_since(s.at) <= self.stale_after => {
                        ep.queue_depth = s.sample.waiting;
                        ep.running = s.sample.running;
                        ep.kv_usage = s.sample.kv_usage;
                        let stale_at = s.at + self.stale_after + Duration::from_nanos(1);
                        valid_until = Some(valid_until.map_or(stale_at, |t| t.min(stale_at)));
                    }
                    _ => ep.healthy = false,
                }
                ep
            })
            .collect();
        st.cached = Some(CachedSnapshot {
            inner,
            generation: st.generation,
            valid_until,
            built: Arc::clone(&built),
        });
        built
    }

    /// Starts one scrape loop per endpoint (every `every`), following changes of
    /// the inner source's address set.
    pub fn spawn(self: &Arc<Self>, every: Duration) -> JoinHandle<()> {
        let this = Arc::clone(self);
        tokio::spawn(async move {
            let mut loops: HashMap<String, JoinHandle<()>> = HashMap::new();
            let mut tick = tokio::time::interval(every.max(Duration::from_millis(100)));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                let current: Vec<String> = this
                    .inner
                    .snapshot()
                    .iter()
                    .map(|e| e.address.clone())
                    .collect();
                loops.retain(|addr, handle| {
                    let keep = current.contains(addr);
                    if !keep {
                        handle.abort();
                        let mut st = this.state.lock().unwrap_or_else(|e| e.into_inner());
                        st.samples.remove(addr);
                        st.generation += 1;
                    }
                    keep
                });
                for addr in current {
                    if loops.contains_key(&addr) {
                        continue;
                    }
                    let scraper = Arc::clone(&this);
                    let a = addr.clone();
                    loops.insert(
                        addr,
                        tokio::spawn(async move {
                            let mut t = tokio::time::interval(every);
                            t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                            let mut failing = false;
                            loop {
                                t.tick().await;
                                match scraper.scrape_one(&a).await {
                                    Ok(_) if failing => {
                                        tracing::info!(endpoint = %a, "scrape recovered");
                                        failing = false;
                                    }
                                    Err(e) if !failing => {
                                        tracing::warn!(endpoint = %a, error = %e, "scrape failed");
                                        failing = true;
                                    }
                                    _ => {}
                                }
                            }
                        }),
                    );
                }
                tick.tick().await;
            }
        })
    }
}

impl EndpointSource for ScrapedEndpoints {
    fn snapshot(&self) -> Arc<[Endpoint]> {
        self.snapshot_at(Instant::now())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rngd_policy_core::{Role, Vendor};

    fn ep(addr: &str) -> Endpoint {
        Endpoint {
            address: addr.to_string(),
            role: Role::Solo,
            vendor: Vendor::Cpu,
            node: String::new(),
            seq_len: 512,
            queue_depth: 0,
            running: 0,
            kv_usage: 0.0,
            healthy: true,
            transports: vec![],
        }
    }

    struct FakeFetcher(HashMap<String, String>);

    #[async_trait]
    impl MetricsFetcher for FakeFetcher {
        async fn fetch(&self, address: &str) -> Result<String, ExtProcError> {
            self.0
                .get(address)
                .cloned()
                .ok_or_else(|| ExtProcError::ScrapeContent {
                    address: address.to_string(),
                    reason: "connection refused (fake)".to_string(),
                })
        }
    }

    #[test]
    fn parses_vllm_gauges_with_labels() {
        let text = "# HELP vllm:num_requests_waiting x\n# TYPE vllm:num_requests_waiting gauge\n\
            vllm:num_requests_waiting{model_name=\"a\"} 3\nvllm:num_requests_waiting{model_name=\"b\"} 2\n\
            vllm:num_requests_running 4\nvllm:kv_cache_usage_perc{model_name=\"a\"} 0.25\n\
            vllm:kv_cache_usage_perc{model_name=\"b\"} 0.5\nother_metric 9\n";
        let s = parse_load(text).expect("sample");
        assert_eq!(s.waiting, 5);
        assert_eq!(s.running, 4);
        assert!((s.kv_usage - 0.5).abs() < 1e-12);
        assert_eq!(parse_load("other_metric 1\n"), None);
    }

    #[tokio::test]
    async fn scraped_data_feeds_snapshot_and_goes_stale() {
        let inner = StaticEndpoints::new(vec![ep("10.0.0.1:1"), ep("10.0.0.2:2")]);
        let mut pages = HashMap::new();
        pages.insert(
            "10.0.0.1:1".to_string(),
            "vllm:num_requests_waiting 7\nvllm:num_requests_running 1\nvllm:kv_cache_usage_perc 0.3\n".to_string(),
        );
        let metrics = EppMetrics::new().expect("metrics");
        let src = ScrapedEndpoints::new(
            inner,
            Arc::new(FakeFetcher(pages)),
            Duration::from_secs(2),
            Some(metrics.clone()),
        );
        src.scrape_all().await;
        let now = Instant::now();
        let snap = src.snapshot_at(now);
        assert_eq!(snap[0].queue_depth, 7);
        assert_eq!(snap[0].running, 1);
        assert!(snap[0].healthy);
        assert!(!snap[1].healthy, "never scraped successfully → unhealthy");
        assert_eq!(metrics.scrape_failures.get(), 1);
        let later = src.snapshot_at(now + Duration::from_secs(3));
        assert!(!later[0].healthy, "data older than 2 s → unhealthy");
    }

    /// Serves `vllm:num_requests_waiting` = the current value of its counter.
    struct Waiting(std::sync::atomic::AtomicU32);

    #[async_trait]
    impl MetricsFetcher for Waiting {
        async fn fetch(&self, _address: &str) -> Result<String, ExtProcError> {
            let n = self.0.load(std::sync::atomic::Ordering::Relaxed);
            Ok(format!(
                "vllm:num_requests_waiting {n}\nvllm:num_requests_running 0\n"
            ))
        }
    }

    #[tokio::test]
    async fn snapshot_is_reused_until_figures_change_or_go_stale() {
        let inner = StaticEndpoints::new(vec![ep("10.0.0.1:1")]);
        let fetcher = Arc::new(Waiting(1.into()));
        let src =
            ScrapedEndpoints::new(inner.clone(), fetcher.clone(), Duration::from_secs(2), None);
        src.scrape_all().await;
        let now = Instant::now();
        let a = src.snapshot_at(now);
        assert_eq!(a[0].queue_depth, 1);
        assert!(
            Arc::ptr_eq(&a, &src.snapshot_at(now)),
            "unchanged → same Arc"
        );
        // A re-scrape with the same figures keeps the snapshot.
        src.scrape_all().await;
        assert!(Arc::ptr_eq(&a, &src.snapshot_at(now)));
        // Going stale rebuilds it (unhealthy), even with no new scrape.
        let stale = src.snapshot_at(now + Duration::from_secs(3));
        assert!(!Arc::ptr_eq(&a, &stale));
        assert!(!stale[0].healthy);
        // New figures rebuild it.
        fetcher.0.store(5, std::sync::atomic::Ordering::Relaxed);
        src.scrape_all().await;
        let b = src.snapshot_at(Instant::now());
        assert_eq!(b[0].queue_depth, 5);
        assert!(b[0].healthy);
        // A changed inner list rebuilds it.
        inner.set(vec![ep("10.0.0.1:1"), ep("10.0.0.3:3")]);
        let c = src.snapshot_at(Instant::now());
        assert_eq!(c.len(), 2);
        assert!(!Arc::ptr_eq(&b, &c));
    }

    #[tokio::test]
    async fn file_endpoints_reload_on_change_and_keep_last_good() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("endpoints.json");
        std::fs::write(&path, serde_json::to_vec(&vec![ep("1.1.1.1:1")]).unwrap()).unwrap();
        let src = FileEndpoints::load(&path).expect("load");
        assert_eq!(src.snapshot().len(), 1);
        assert!(!src.reload().expect("reload"));
        std::fs::write(
            &path,
            serde_json::to_vec(&vec![ep("1.1.1.1:1"), ep("2.2.2.2:2")]).unwrap(),
        )
        .unwrap();
        assert!(src.reload().expect("reload"));
        assert_eq!(src.snapshot()[1].address, "2.2.2.2:2");
        std::fs::write(&path, b"not json").unwrap();
        assert!(matches!(
            src.reload(),
            Err(ExtProcError::EndpointsParse { .. })
        ));
        assert_eq!(src.snapshot().len(), 2, "last good list stays");
    }
}
