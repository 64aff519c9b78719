//! KV left behind after the run. The workers export no gauge of KV files or
//! transferred caches they hold; what they do export is the engine's slot
//! use (`vllm:kv_cache_usage_perc`), the running / waiting requests and (with
//! admission control) `rngd_pd_worker_in_flight`, the admitted requests whose
//! pulled KV is held; the gateway exports `rngd_pd_gateway_in_flight` and
//! `rngd_pd_gateway_queued`. All must be 0 once the run is over. The `shm` transport's leftovers
//! are files in its root (`<key>.kv`, `.tmp.*`) and busy slots in the prefill
//! workers' arenas (`*.kva`, which live as long as their workers), counted here. The relay's
//! STATS needs the stack's secret, which `rngd-pd up` never prints, so it is
//! not read.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::Serialize;

/// The gauges of one server after the run (each summed over its label
/// sets; `None`, and left out of the JSON, when the server has no such gauge).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Default)]
pub struct WorkerKv {
    /// `vllm:kv_cache_usage_perc`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_cache_usage_perc: Option<f64>,
    /// `vllm:num_requests_running`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub running: Option<f64>,
    /// `vllm:num_requests_waiting`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub waiting: Option<f64>,
    /// `rngd_pd_worker_in_flight` (admitted, KV held).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub worker_in_flight: Option<f64>,
    /// `rngd_pd_gateway_in_flight`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gateway_in_flight: Option<f64>,
    /// `rngd_pd_gateway_queued`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gateway_queued: Option<f64>,
}

impl WorkerKv {
    /// Whether no request is running, waiting, admitted or queued here.
    pub fn idle(&self) -> bool {
        [
            self.running,
            self.waiting,
            self.worker_in_flight,
            self.gateway_in_flight,
            self.gateway_queued,
        ]
        .iter()
        .all(|v| v.is_none_or(|v| v == 0.0))
    }
}

/// What was left after the run.
#[derive(Debug, Clone, PartialEq, Serialize, Default)]
pub struct LeakedKv {
    /// The shm root counted (`None` if none was given).
    pub shm_root: Option<PathBuf>,
    /// Files under it (request files, pointer files and temporary files;
    /// not the prefill workers' slot arenas, which live as long as they do).
    pub shm_files: Option<u64>,
    /// Their bytes.
    pub shm_bytes: Option<u64>,
    /// Slot arenas under it (`*.kva`).
    pub shm_arenas: Option<u64>,
    /// Their slots not free (a request written, published or being read).
    pub shm_busy_slots: Option<u64>,
    /// Each server's gauges, by label (`LABEL=URL`) or metrics URL (`null`: not reachable).
    pub workers: BTreeMap<String, Option<WorkerKv>>,
    /// Whether every reachable server was [`WorkerKv::idle`] before the
    /// settle bound ran out.
    pub settled: bool,
}

/// The sum of the samples of metric `name` in a Prometheus text exposition
/// (`None` if there is no sample).
pub fn metric_sum(text: &str, name: &str) -> Option<f64> {
    let mut sum = None;
    for line in text.lines() {
        if line.starts_with('#') {
            continue;
        }
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        // `name{labels} value` or `name value`, not a longer name.
        let rest = if let Some(r) = rest.strip_prefix('{') {
            match r.rfind('}') {
                Some(i) => &r[i + 1..],
                None => continue,
            }
        } else if rest.starts_with(' ') {
            rest
        } else {
            continue;
        };
        if let Some(v) = rest
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok())
        {
            *sum.get_or_insert(0.0) += v;
        }
    }
    sum
}

/// The gauges in one `/metrics` text.
pub fn parse_worker(text: &str) -> WorkerKv {
    WorkerKv {
        kv_cache_usage_perc: metric_sum(text, "vllm:kv_cache_usage_perc"),
        running: metric_sum(text, "vllm:num_requests_running"),
        waiting: metric_sum(text, "vllm:num_requests_waiting"),
        worker_in_flight: metric_sum(text, "rngd_pd_worker_in_flight"),
        gateway_in_flight: metric_sum(text, "rngd_pd_gateway_in_flight"),
        gateway_queued: metric_sum(text, "rngd_pd_gateway_queued"),
    }
}

/// `url` with `/metrics` appended unless it already ends with it.
pub fn metrics_url(url: &str) -> String {
    let u = url.trim_end_matches('/');
    if u.ends_with("/metrics") {
        u.to_string()
    } else {
        format!("{u}/metrics")
    }
}

async fn scrape(client: &reqwest::Client, url: &str) -> Option<WorkerKv> {
    Some(parse_worker(
        &fetch_text(client, url, Duration::from_secs(5)).await?,
    ))
}

/// The body of a successful GET of `url` within `timeout` (`None` on any
/// failure: a scrape that fails is a figure left out, not an error).
pub async fn fetch_text(client: &reqwest::Client, url: &str, timeout: Duration) -> Option<String> {
    let r = client.get(url).timeout(timeout).send().await.ok()?;
    if !r.status().is_success() {
        return None;
    }
    r.text().await.ok()
}

/// What a shm root holds: request files, their bytes, arenas and the
/// arenas' busy slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ShmCount {
    /// Request, pointer and temporary files.
    pub files: u64,
    /// Their bytes.
    pub bytes: u64,
    /// Slot arenas (`*.kva`).
    pub arenas: u64,
    /// Their slots not free.
    pub busy_slots: u64,
}

/// What is under `root` (recursively); all 0 if it does not exist.
pub fn count_files(root: &Path) -> ShmCount {
    let mut c = ShmCount::default();
    let mut dirs = vec![root.to_path_buf()];
    while let Some(d) = dirs.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            let Ok(md) = e.metadata() else { continue };
            if md.is_dir() {
                dirs.push(e.path());
            } else if e.file_name().to_string_lossy().ends_with(".kva") {
                c.arenas += 1;
                c.busy_slots +=
                    rngd_kv_transport::shm::busy_slots_in(&e.path()).unwrap_or(0) as u64;
            } else {
                c.files += 1;
                c.bytes += md.len();
            }
        }
    }
    c
}

/// A `--kv-metrics` entry: `LABEL=URL` or a bare URL (its own label).
/// Returns `(label, metrics URL)`.
pub fn metrics_target(entry: &str) -> (String, String) {
    match entry.split_once('=') {
        Some((label, url)) if !label.contains('/') => (label.to_string(), metrics_url(url)),
        _ => {
            let url = metrics_url(entry);
            (url.clone(), url)
        }
    }
}

/// Polls the servers' gauges (every 200 ms) until all are idle or `settle`
/// passes, then reads them and counts the shm root's files. `metrics` are
/// [`metrics_target`] entries.
pub async fn measure(
    client: &reqwest::Client,
    metrics: &[String],
    shm_root: Option<&Path>,
    settle: Duration,
) -> LeakedKv {
    let targets: Vec<(String, String)> = metrics.iter().map(|m| metrics_target(m)).collect();
    let deadline = Instant::now() + settle;
    let mut out = LeakedKv {
        shm_root: shm_root.map(Path::to_path_buf),
        ..LeakedKv::default()
    };
    loop {
        out.workers.clear();
        for (label, url) in &targets {
            out.workers.insert(label.clone(), scrape(client, url).await);
        }
        out.settled = out.workers.values().flatten().all(WorkerKv::idle);
        if out.settled || Instant::now() >= deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    if let Some(root) = shm_root {
        let c = count_files(root);
        out.shm_files = Some(c.files);
        out.shm_bytes = Some(c.bytes);
        out.shm_arenas = Some(c.arenas);
        out.shm_busy_slots = Some(c.busy_slots);
    }
    out
}
