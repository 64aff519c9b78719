//! The live endpoint snapshot the policy routes on.
//!
//! The configured endpoints (flags or an endpoints file) are scraped in a
//! background task every ~50 ms ([`EndpointTable::spawn_scraper`]) through a
//! [`LoadSource`] (real: HTTP `GET /metrics` reading the `vllm:*` gauges).
//! An endpoint whose last good scrape is older than the staleness bound, or
//! that never answered, is reported unhealthy in the snapshot.

use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use rngd_policy_core::{Endpoint, Role, Vendor};
use rngd_telemetry::names;

use crate::error::{BoxError, GatewayError};

/// Load figures of one worker, from its `/metrics`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct WorkerLoad {
    /// `vllm:num_requests_waiting`.
    pub waiting: u32,
    /// `vllm:num_requests_running`.
    pub running: u32,
    /// `vllm:kv_cache_usage_perc`, 0..1.
    pub kv_usage: f64,
}

/// Where load figures come from (the network edge of the scraper).
#[async_trait::async_trait]
pub trait LoadSource: Send + Sync + 'static {
    /// Reads one worker's load; an error marks it unreachable.
    async fn scrape(&self, address: &str) -> Result<WorkerLoad, BoxError>;
}

/// Scrapes `http://ADDRESS/metrics` (Prometheus text).
#[derive(Debug, Clone)]
pub struct HttpLoadSource {
    client: reqwest::Client,
}

impl HttpLoadSource {
    /// A source whose requests give up after `timeout`.
    pub fn new(timeout: Duration) -> Result<Self, GatewayError> {
        let client = reqwest::Client::builder()
            .timeout(timeout)
            .connect_timeout(timeout)
            .pool_max_idle_per_host(2)
            .build()
            .map_err(GatewayError::Client)?;
        Ok(HttpLoadSource { client })
    }
}

#[async_trait::async_trait]
impl LoadSource for HttpLoadSource {
    async fn scrape(&self, address: &str) -> Result<WorkerLoad, BoxError> {
        let resp = self
            .client
            .get(format!("http://{address}/metrics"))
            .send()
            .await?;
        if !resp.status().is_success() {
            return Err(format!("/metrics answered {}", resp.status()).into());
        }
        let text = resp.text().await?;
        Ok(parse_load(&text))
    }
}

/// Reads the `vllm:*` gauges from a Prometheus text exposition (summed over
/// label sets; absent gauges read as 0).
pub fn parse_load(text: &str) -> WorkerLoad {
    let mut load = WorkerLoad::default();
    let (mut waiting, mut running) = (0.0f64, 0.0f64);
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (name, rest) = match line.find(['{', ' ', '\t']) {
            Some(i) => (&line[..i], &line[i..]),
            None => continue,
        };
        let rest = if rest.starts_with('{') {
            match rest.rfind('}') {
                Some(j) => &rest[j + 1..],
                None => continue,
            }
        } else {
            rest
        };
        let Some(value) = rest
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok())
        else {
            continue;
        };
        if !value.is_finite() {
            continue;
        }
        match name {
            n if n == names::VLLM_NUM_REQUESTS_WAITING => waiting += value,
            n if n == names::VLLM_NUM_REQUESTS_RUNNING => running += value,
            n if n == names::VLLM_KV_CACHE_USAGE_PERC => load.kv_usage = load.kv_usage.max(value),
            _ => {}
        }
    }
    load.waiting = waiting.max(0.0).round() as u32;
    load.running = running.max(0.0).round() as u32;
    load
}

struct Entry {
    base: Endpoint,
    last_ok: Option<(WorkerLoad, Instant)>,
}

/// The configured endpoints with their latest scraped load.
pub struct EndpointTable {
    entries: RwLock<Vec<Entry>>,
    stale_after: Duration,
}

impl std::fmt::Debug for EndpointTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EndpointTable")
            .field("endpoints", &self.addresses())
            .field("stale_after", &self.stale_after)
            .finish()
    }
}

impl EndpointTable {
    /// A table of `endpoints`; data older than `stale_after` marks an endpoint unhealthy.
    pub fn new(endpoints: Vec<Endpoint>, stale_after: Duration) -> Arc<Self> {
        let entries = endpoints
            .into_iter()
            .map(|base| Entry {
                base,
                last_ok: None,
            })
            .collect();
        Arc::new(EndpointTable {
            entries: RwLock::new(entries),
            stale_after,
        })
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Vec<Entry>> {
        self.entries.read().unwrap_or_else(|e| e.into_inner())
    }

    /// Addresses of every configured endpoint.
    pub fn addresses(&self) -> Vec<String> {
        self.read().iter().map(|e| e.base.address.clone()).collect()
    }

    /// The snapshot handed to the policy: configuration + latest load; stale or
    /// never-scraped endpoints are unhealthy.
    pub fn snapshot(&self) -> Vec<Endpoint> {
        let now = Instant::now();
        self.read()
            .iter()
            .map(|e| {
                let mut ep = e.base.clone();
                match e.last_ok {
                    Some((load, at)) if now.duration_since(at) <= self.stale_after => {
                        ep.queue_depth = load.waiting;
                        ep.running = load.running;
                        ep.kv_usage = load.kv_usage;
                    }
                    _ => ep.healthy = false,
                }
                ep
            })
            .collect()
    }

    /// Records a scrape result of `address`.
    pub fn record(&self, address: &str, result: Result<WorkerLoad, &BoxError>) {
        let mut entries = self.entries.write().unwrap_or_else(|e| e.into_inner());
        for e in entries.iter_mut().filter(|e| e.base.address == address) {
            match result {
                Ok(load) => e.last_ok = Some((load, Instant::now())),
                Err(err) => {
                    if e.last_ok.is_some() {
                        tracing::warn!(endpoint = address, error = %err, "endpoint scrape failed");
                    }
                    e.last_ok = None;
                }
            }
        }
    }

    /// Scrapes every endpoint once, concurrently.
    pub async fn scrape_once(&self, source: &dyn LoadSource) {
        let addresses = self.addresses();
        let results = futures::future::join_all(addresses.iter().map(|a| source.scrape(a))).await;
        for (address, result) in addresses.iter().zip(results) {
            self.record(address, result.as_ref().copied());
        }
    }

    /// Scrapes every `every` until the table is dropped.
    pub fn spawn_scraper(
        self: &Arc<Self>,
        source: Arc<dyn LoadSource>,
        every: Duration,
    ) -> tokio::task::JoinHandle<()> {
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(table) = weak.upgrade() else { break };
                table.scrape_once(source.as_ref()).await;
            }
        })
    }

    /// Whether at least one endpoint that can decode is healthy now.
    pub fn can_serve(&self) -> bool {
        self.snapshot()
            .iter()
            .any(|e| e.healthy && matches!(e.role, Role::Decode | Role::Solo))
    }
}

/// Parses an endpoints file: a JSON list of [`Endpoint`].
pub fn parse_endpoints_file(path: &str, text: &str) -> Result<Vec<Endpoint>, GatewayError> {
    serde_json::from_str(text).map_err(|source| GatewayError::Endpoints {
        path: path.to_string(),
        source,
    })
}

/// Reads an endpoints file.
pub fn load_endpoints_file(path: &std::path::Path) -> Result<Vec<Endpoint>, GatewayError> {
    let text = std::fs::read_to_string(path).map_err(|source| GatewayError::Read {
        path: path.display().to_string(),
        source,
    })?;
    parse_endpoints_file(&path.display().to_string(), &text)
}

/// `host:port` of a worker URL (`http://host:port/…`, or already `host:port`).
pub fn address_of(url: &str) -> Result<String, GatewayError> {
    let rest = url
        .strip_prefix("http://")
        .or_else(|| url.strip_prefix("HTTP://"))
        .unwrap_or(url);
    if url.starts_with("https://") {
        return Err(GatewayError::Config(format!(
            "{url}: workers are plain http"
        )));
    }
    let addr = rest.split('/').next().unwrap_or("");
    if addr.is_empty() || !addr.contains(':') {
        return Err(GatewayError::Config(format!(
            "{url}: expected http://HOST:PORT"
        )));
    }
    Ok(addr.to_string())
}

/// An endpoint of the CPU backend on this node (from `--prefill`/`--decode` flags).
pub fn local_endpoint(
    address: String,
    role: Role,
    seq_len: u32,
    transports: &[String],
) -> Endpoint {
    Endpoint {
        address,
        role,
        vendor: Vendor::Cpu,
        node: "local".to_string(),
        seq_len,
        queue_depth: 0,
        running: 0,
        kv_usage: 0.0,
        healthy: true,
        transports: transports.to_vec(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[test]
    fn parses_vllm_gauges() {
        let text = "# HELP vllm:num_requests_waiting w\n# TYPE vllm:num_requests_waiting gauge\n\
            vllm:num_requests_waiting 3\nvllm:num_requests_running{model_name=\"a b\"} 2\n\
            vllm:num_requests_running{model_name=\"c\"} 1\nvllm:kv_cache_usage_perc 0.25 1700000000\nother 9\n";
        let l = parse_load(text);
        assert_eq!(
            l,
            WorkerLoad {
                waiting: 3,
                running: 3,
                kv_usage: 0.25
            }
        );
    }

    struct FakeSource(Mutex<Option<WorkerLoad>>);

    #[async_trait::async_trait]
    impl LoadSource for FakeSource {
        async fn scrape(&self, _address: &str) -> Result<WorkerLoad, BoxError> {
            self.0
                .lock()
                .unwrap()
                .ok_or_else(|| "connection refused".into())
        }
    }

    #[tokio::test]
    async fn unreachable_and_stale_endpoints_are_unhealthy() {
        let ep = local_endpoint("127.0.0.1:1".into(), Role::Decode, 512, &[]);
        let table = EndpointTable::new(vec![ep], Duration::from_millis(200));
        // Never scraped: unhealthy.
        assert!(!table.snapshot()[0].healthy);
        let src = FakeSource(Mutex::new(Some(WorkerLoad {
            waiting: 4,
            running: 1,
            kv_usage: 0.5,
        })));
        table.scrape_once(&src).await;
        let snap = table.snapshot();
        assert!(snap[0].healthy);
        assert_eq!(
            (snap[0].queue_depth, snap[0].running, snap[0].kv_usage),
            (4, 1, 0.5)
        );
        assert!(table.can_serve());
        // Unreachable: unhealthy at once.
        *src.0.lock().unwrap() = None;
        table.scrape_once(&src).await;
        assert!(!table.snapshot()[0].healthy);
        // Fresh again, then stale once the bound passes with no scrape.
        *src.0.lock().unwrap() = Some(WorkerLoad::default());
        table.scrape_once(&src).await;
        assert!(table.snapshot()[0].healthy);
        let deadline = Instant::now() + Duration::from_secs(5);
        while table.snapshot()[0].healthy {
            assert!(Instant::now() < deadline, "endpoint never went stale");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    #[test]
    fn addresses_from_urls() {
        assert_eq!(
            address_of("http://127.0.0.1:8000").unwrap(),
            "127.0.0.1:8000"
        );
        assert_eq!(address_of("http://h:1/v1").unwrap(), "h:1");
        assert_eq!(address_of("h:2").unwrap(), "h:2");
        assert!(address_of("https://h:1").is_err());
        assert!(address_of("http://nohost").is_err());
    }
}
