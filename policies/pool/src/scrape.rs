//! Live load on top of an endpoint list: [`ScrapedEndpoints`] scrapes every
//! endpoint's `/metrics` (vLLM names, read by [`crate::load::parse_load`]) on
//! an interval, as GIE's picker does, and marks an endpoint unhealthy when its
//! last good scrape is older than the staleness bound or it never answered.
//! The snapshot is rebuilt only when a figure, the list or staleness changes;
//! otherwise the same `Arc` is handed out.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use rngd_policy_core::Endpoint;
use tokio::task::JoinHandle;

use crate::PoolError;
use crate::load::{LoadNames, LoadSample, parse_load_named};
use crate::source::EndpointSource;

/// Default scrape interval (GIE's refresh-metrics interval).
pub const DEFAULT_SCRAPE_INTERVAL: Duration = Duration::from_millis(50);
/// Default age after which scraped data is stale and the endpoint unhealthy.
pub const DEFAULT_STALE_AFTER: Duration = Duration::from_secs(2);
/// Default cap on one scraped `/metrics` body (a worker's page is a few KB):
/// a longer body fails the scrape (counted, logged, the endpoint stale)
/// without being buffered whole.
pub const DEFAULT_MAX_SCRAPE_BYTES: usize = 4 << 20;

/// Fetches an endpoint's `/metrics` text.
#[async_trait]
pub trait MetricsFetcher: Send + Sync + 'static {
    /// The Prometheus text of `address` (`ip:port`).
    async fn fetch(&self, address: &str) -> Result<String, PoolError>;
}

/// [`MetricsFetcher`] over HTTP: `GET http://ADDRESS/metrics`, the body read
/// up to a cap ([`DEFAULT_MAX_SCRAPE_BYTES`], [`HttpFetcher::with_max_body`]).
#[derive(Debug, Clone)]
pub struct HttpFetcher {
    client: reqwest::Client,
    /// Most bytes of one `/metrics` body; past it the scrape fails.
    max_body: usize,
}

impl HttpFetcher {
    /// Caps each scraped body at `bytes` (default [`DEFAULT_MAX_SCRAPE_BYTES`]).
    pub fn with_max_body(mut self, bytes: usize) -> Self {
        self.max_body = bytes;
        self
    }

    /// A fetcher whose requests (connect included) time out after `timeout`.
    pub fn new(timeout: Duration) -> Result<Self, PoolError> {
        let client = reqwest::Client::builder()
            .timeout(timeout)
            .connect_timeout(timeout)
            .pool_max_idle_per_host(2)
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(PoolError::Client)?;
        Ok(HttpFetcher {
            client,
            max_body: DEFAULT_MAX_SCRAPE_BYTES,
        })
    }
}

#[async_trait]
impl MetricsFetcher for HttpFetcher {
    async fn fetch(&self, address: &str) -> Result<String, PoolError> {
        let err = |source| PoolError::Scrape {
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
            return Err(PoolError::ScrapeContent {
                address: address.to_string(),
                reason: format!("HTTP {}", resp.status()),
            });
        }
        let too_long = || PoolError::ScrapeContent {
            address: address.to_string(),
            reason: format!("the /metrics body is over {} bytes", self.max_body),
        };
        if resp
            .content_length()
            .is_some_and(|n| n > self.max_body as u64)
        {
            return Err(too_long());
        }
        // Read chunk by chunk: a body past the cap is dropped, never held whole.
        let mut body = Vec::new();
        let mut resp = resp;
        while let Some(chunk) = resp.chunk().await.map_err(err)? {
            if body.len() + chunk.len() > self.max_body {
                return Err(too_long());
            }
            body.extend_from_slice(&chunk);
        }
        Ok(String::from_utf8_lossy(&body).into_owned())
    }
}

#[derive(Debug, Clone)]
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
    /// Each address's process (`process_start_time_seconds`) and the
    /// restarts seen there; kept across failed scrapes (a dead process's
    /// address is known again when its successor answers).
    instances: HashMap<String, Instance>,
    /// Each address's tokenizer digest, as last scraped; kept across
    /// failed scrapes, dropped with the address.
    digests: HashMap<String, String>,
}

/// The process last scraped at one address.
#[derive(Debug, Clone, Copy)]
struct Instance {
    started: f64,
    restarts: u64,
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
    scrape_failures: Option<prometheus::IntCounter>,
    names: LoadNames,
    /// Restarts seen over every address.
    restarts: std::sync::atomic::AtomicU64,
    /// Tokenizer digests learnt, changed or forgotten over every address.
    digest_changes: std::sync::atomic::AtomicU64,
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
        scrape_failures: Option<prometheus::IntCounter>,
    ) -> Arc<Self> {
        Self::named(
            inner,
            fetcher,
            stale_after,
            scrape_failures,
            LoadNames::default(),
        )
    }

    /// [`ScrapedEndpoints::new`] for model servers whose load gauges are
    /// named `names`.
    pub fn named(
        inner: Arc<dyn EndpointSource>,
        fetcher: Arc<dyn MetricsFetcher>,
        stale_after: Duration,
        scrape_failures: Option<prometheus::IntCounter>,
        names: LoadNames,
    ) -> Arc<Self> {
        Arc::new(ScrapedEndpoints {
            inner,
            fetcher,
            stale_after,
            state: Mutex::new(ScrapeState::default()),
            scrape_failures,
            names,
            restarts: std::sync::atomic::AtomicU64::new(0),
            digest_changes: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// Scrapes one endpoint now and records the result (at `Instant::now()`).
    pub async fn scrape_one(&self, address: &str) -> Result<LoadSample, PoolError> {
        let result = self.fetcher.fetch(address).await.and_then(|text| {
            parse_load_named(&text, &self.names).ok_or_else(|| PoolError::ScrapeContent {
                address: address.to_string(),
                reason: format!(
                    "neither {} nor {} on the page",
                    self.names.waiting, self.names.running
                ),
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
                        old.sample = sample.clone();
                        old.at = now;
                        changed
                    }
                    None => {
                        st.samples.insert(
                            address.to_string(),
                            Scraped {
                                sample: sample.clone(),
                                at: now,
                            },
                        );
                        true
                    }
                };
                if changed {
                    st.generation += 1;
                }
                if let Some(d) = &sample.tokenizer_digest
                    && st.digests.get(address) != Some(d)
                {
                    st.digests.insert(address.to_string(), d.clone());
                    self.digest_changes
                        .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
                }
                if let Some(started) = sample.started {
                    match st.instances.get_mut(address) {
                        Some(i) if i.started != started => {
                            i.started = started;
                            i.restarts += 1;
                            self.restarts
                                .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
                            tracing::info!(
                                endpoint = address,
                                restarts = i.restarts,
                                "endpoint restarted (a new process on its address): its cache is empty"
                            );
                        }
                        Some(_) => {}
                        None => {
                            st.instances.insert(
                                address.to_string(),
                                Instance {
                                    started,
                                    restarts: 0,
                                },
                            );
                        }
                    }
                }
            }
            Err(_) => {
                if let Some(c) = &self.scrape_failures {
                    c.inc();
                }
                // A failed scrape makes the endpoint unhealthy at once, not
                // only once its last good figures go stale.
                let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
                if st.samples.remove(address).is_some() {
                    st.generation += 1;
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
                        // What the worker says wins over what discovery said.
                        if s.sample.weight_version.is_some() {
                            ep.weight_version = s.sample.weight_version.clone();
                        }
                        // The variant it serves now (`/switch_variant`).
                        if let Some(n) = s.sample.seq_len {
                            ep.seq_len = n;
                        }
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
            // Dropped with this task (abort included): stops every loop.
            let mut loops = Loops::default();
            let loops = &mut loops.0;
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
                        // Bounded by the addresses listed now (the index
                        // forgets a departed address's stream too).
                        st.instances.remove(addr);
                        if st.digests.remove(addr).is_some() {
                            this.digest_changes
                                .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
                        }
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

/// The per-endpoint scrape loops, aborted when dropped.
#[derive(Default)]
struct Loops(HashMap<String, JoinHandle<()>>);

impl Drop for Loops {
    fn drop(&mut self) {
        for h in self.0.values() {
            h.abort();
        }
    }
}

impl EndpointSource for ScrapedEndpoints {
    fn snapshot(&self) -> Arc<[Endpoint]> {
        self.snapshot_at(Instant::now())
    }

    fn kv_streams(&self) -> Arc<[crate::source::KvStream]> {
        self.inner.kv_streams()
    }

    fn restarts(&self) -> u64 {
        self.restarts.load(std::sync::atomic::Ordering::Acquire)
    }

    fn restarts_of(&self, address: &str) -> u64 {
        let st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        st.instances.get(address).map_or(0, |i| i.restarts)
    }

    fn tokenizer_changes(&self) -> u64 {
        self.digest_changes
            .load(std::sync::atomic::Ordering::Acquire)
    }

    fn tokenizer_digest_of(&self, address: &str) -> Option<String> {
        let st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        st.digests.get(address).cloned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::load::parse_load;
    use crate::source::StaticEndpoints;
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
            weight_version: None,
        }
    }

    struct FakeFetcher(HashMap<String, String>);

    #[async_trait]
    impl MetricsFetcher for FakeFetcher {
        async fn fetch(&self, address: &str) -> Result<String, PoolError> {
            self.0
                .get(address)
                .cloned()
                .ok_or_else(|| PoolError::ScrapeContent {
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
            "vllm:num_requests_waiting 7\nvllm:num_requests_running 1\nvllm:kv_cache_usage_perc 0.3\n\
             rngd_pd_worker_weight_info{model_name=\"m\",weight_version=\"99dda3c02b151cb8\"} 1\n\
             rngd_pd_worker_variant_info{model_name=\"m\",seq_len=\"256\",max_batch=\"2\"} 1\n"
                .to_string(),
        );
        let failures = prometheus::IntCounter::new("f", "f").expect("counter");
        let src = ScrapedEndpoints::new(
            inner,
            Arc::new(FakeFetcher(pages)),
            Duration::from_secs(2),
            Some(failures.clone()),
        );
        src.scrape_all().await;
        let now = Instant::now();
        let snap = src.snapshot_at(now);
        assert_eq!(snap[0].queue_depth, 7);
        assert_eq!(snap[0].running, 1);
        assert_eq!(snap[0].weight_version.as_deref(), Some("99dda3c02b151cb8"));
        // The worker's own variant replaces the source's 512.
        assert_eq!((snap[0].seq_len, snap[1].seq_len), (256, 512));
        assert!(snap[0].healthy);
        assert!(!snap[1].healthy, "never scraped successfully → unhealthy");
        assert_eq!(failures.get(), 1);
        let later = src.snapshot_at(now + Duration::from_secs(3));
        assert!(!later[0].healthy, "data older than 2 s → unhealthy");
    }

    /// Serves `vllm:num_requests_waiting` = the current value of its counter.
    struct Waiting(std::sync::atomic::AtomicU32);

    #[async_trait]
    impl MetricsFetcher for Waiting {
        async fn fetch(&self, _address: &str) -> Result<String, PoolError> {
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

    /// Serves a page while it holds one; refuses otherwise.
    struct Switch(std::sync::Mutex<Option<String>>);

    #[async_trait]
    impl MetricsFetcher for Switch {
        async fn fetch(&self, address: &str) -> Result<String, PoolError> {
            self.0
                .lock()
                .unwrap()
                .clone()
                .ok_or_else(|| PoolError::ScrapeContent {
                    address: address.to_string(),
                    reason: "connection refused (fake)".to_string(),
                })
        }
    }

    #[tokio::test]
    async fn unreachable_endpoints_are_unhealthy_at_once_and_recover() {
        let inner = StaticEndpoints::new(vec![ep("127.0.0.1:1")]);
        let page = "vllm:num_requests_waiting 4\nvllm:num_requests_running 1\nvllm:kv_cache_usage_perc 0.5\n";
        let fetcher = Arc::new(Switch(std::sync::Mutex::new(Some(page.to_string()))));
        let src = ScrapedEndpoints::new(inner, fetcher.clone(), Duration::from_secs(60), None);
        assert!(!src.snapshot()[0].healthy, "never scraped → unhealthy");
        src.scrape_all().await;
        let snap = src.snapshot();
        assert!(snap[0].healthy);
        assert_eq!(
            (snap[0].queue_depth, snap[0].running, snap[0].kv_usage),
            (4, 1, 0.5)
        );
        assert!(crate::source::can_serve(&snap));
        *fetcher.0.lock().unwrap() = None;
        src.scrape_all().await;
        assert!(
            !src.snapshot()[0].healthy,
            "a failed scrape is unhealthy at once, well before the 60 s staleness bound"
        );
        *fetcher.0.lock().unwrap() = Some(page.to_string());
        src.scrape_all().await;
        assert!(src.snapshot()[0].healthy);
    }
}
