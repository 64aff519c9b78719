//! The original system's KPIs in a replay report: model FLOPs utilisation
//! (MFU) against the host's f32 peak with the peak's derivation, tokens per
//! joule from the host's RAPL energy counters where they are readable, and
//! the heterogeneous resource count (the serving workers' devices by role
//! and vendor, from their `rngd_pd_worker_device_info`).

use std::collections::BTreeMap;
use std::path::Path;

use serde::Serialize;

use crate::metrics::label;

/// `rngd_pd_worker_device_info` (labels `role`, `backend`, `vendor`, `device`).
pub const DEVICE_INFO: &str = "rngd_pd_worker_device_info";
/// `rngd_pd_worker_model_flops_per_token` (label `model_name`).
pub const FLOPS_PER_TOKEN: &str = "rngd_pd_worker_model_flops_per_token";

/// Where the powercap framework lists the RAPL domains.
pub const POWERCAP: &str = "/sys/class/powercap";

/// FMA units per core assumed for the peak (two on the x86 server cores of
/// the last decade; the JSON says it is assumed).
pub const FMA_UNITS_PER_CORE: u32 = 2;

/// The host's peak f32 FLOP rate and how it was derived.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Peak {
    /// Cores this process may use (`available_parallelism`).
    pub cores: u32,
    /// f32 lanes of the widest FMA the CPU flags list (`avx512f` 16, `fma`
    /// with `avx2` 8, else 4).
    pub vector_lanes_f32: u32,
    /// The flag the lanes come from.
    pub vector_isa: String,
    /// FMA units per core ([`FMA_UNITS_PER_CORE`], assumed, not measured).
    pub fma_units_per_core: u32,
    /// Clock, GHz (the `@ x.xxGHz` of `model name` when there is one, else
    /// the highest `cpu MHz`); `None` when neither is readable.
    pub clock_ghz: Option<f64>,
    /// Which of the two the clock is.
    pub clock_source: String,
    /// `cores × lanes × 2 (an FMA is two FLOPs) × FMA units × clock`, FLOP/s.
    pub flops: Option<f64>,
}

impl Peak {
    /// The peak of this host (`/proc/cpuinfo`).
    pub fn detect() -> Peak {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get() as u32);
        Peak::from_cpuinfo(&cpuinfo, cores)
    }

    /// The peak described by a `/proc/cpuinfo` text, for `cores` cores.
    pub fn from_cpuinfo(cpuinfo: &str, cores: u32) -> Peak {
        fn field<'a>(cpuinfo: &'a str, name: &'a str) -> impl Iterator<Item = &'a str> + 'a {
            cpuinfo.lines().filter_map(move |l| {
                let (k, v) = l.split_once(':')?;
                (k.trim() == name).then(|| v.trim())
            })
        }
        let field = |name: &'static str| field(cpuinfo, name);
        let flags: Vec<&str> = field("flags")
            .next()
            .map(|f| f.split_whitespace().collect())
            .unwrap_or_default();
        let has = |f: &str| flags.contains(&f);
        let (lanes, isa) = if has("avx512f") {
            (16, "avx512f")
        } else if has("avx2") && has("fma") {
            (8, "avx2+fma")
        } else {
            (4, "sse")
        };
        let named = field("model name").next().and_then(|m| {
            let at = m.rfind('@')?;
            m[at + 1..]
                .trim()
                .strip_suffix("GHz")?
                .trim()
                .parse::<f64>()
                .ok()
        });
        let mhz = field("cpu MHz")
            .filter_map(|v| v.parse::<f64>().ok())
            .fold(None, |m: Option<f64>, v| Some(m.map_or(v, |m| m.max(v))));
        let (clock_ghz, clock_source) = match (named, mhz) {
            (Some(g), _) => (Some(g), "model name"),
            (None, Some(m)) => (Some(m / 1e3), "cpu MHz (highest)"),
            (None, None) => (None, "none readable"),
        };
        let flops = clock_ghz.map(|g| {
            f64::from(cores) * f64::from(lanes) * 2.0 * f64::from(FMA_UNITS_PER_CORE) * g * 1e9
        });
        Peak {
            cores,
            vector_lanes_f32: lanes,
            vector_isa: isa.into(),
            fma_units_per_core: FMA_UNITS_PER_CORE,
            clock_ghz,
            clock_source: clock_source.into(),
            flops,
        }
    }
}

/// The RAPL package energy counters at one moment: the sum over package
/// domains, µJ, and each domain's wrap range; or why there is none.
#[derive(Debug, Clone, PartialEq)]
pub struct Energy {
    /// `(energy_uj, max_energy_range_uj)` per package domain.
    domains: Vec<(u64, u64)>,
}

impl Energy {
    /// Reads every `intel-rapl:N` package domain under `root` (normally
    /// [`POWERCAP`]); `Err` says why nothing was read.
    pub fn read(root: &Path) -> Result<Energy, String> {
        let dir = std::fs::read_dir(root).map_err(|e| {
            format!(
                "{} is not readable ({e}): the host exposes no RAPL counters here (a VM or a container without powercap)",
                root.display()
            )
        })?;
        let mut names: Vec<String> = dir
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            // Package domains only (`intel-rapl:0`); sub-domains
            // (`intel-rapl:0:0`, cores, dram) are inside their package's count.
            .filter(|n| n.starts_with("intel-rapl:") && n.matches(':').count() == 1)
            .collect();
        names.sort();
        if names.is_empty() {
            return Err(format!(
                "{} lists no intel-rapl package domain",
                root.display()
            ));
        }
        let read = |p: &Path| -> Result<u64, String> {
            std::fs::read_to_string(p)
                .map_err(|e| format!("{} is not readable ({e})", p.display()))?
                .trim()
                .parse()
                .map_err(|e| format!("{}: {e}", p.display()))
        };
        let mut domains = Vec::new();
        for n in names {
            let d = root.join(n);
            domains.push((
                read(&d.join("energy_uj"))?,
                read(&d.join("max_energy_range_uj"))?,
            ));
        }
        Ok(Energy { domains })
    }

    /// Joules from `before` to `self` (a counter that wrapped once is
    /// counted through its range).
    pub fn joules_since(&self, before: &Energy) -> Option<f64> {
        if before.domains.len() != self.domains.len() {
            return None;
        }
        let uj: u64 = self
            .domains
            .iter()
            .zip(&before.domains)
            .map(|(&(now, range), &(then, _))| {
                if now >= then {
                    now - then
                } else {
                    range.saturating_sub(then) + now
                }
            })
            .sum();
        Some(uj as f64 / 1e6)
    }
}

/// The KPIs of one run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Kpis {
    /// Model FLOPs per token the workers report (2 × the weights a token is
    /// multiplied by; attention left out); `None` when none reports it.
    pub model_flops_per_token: Option<f64>,
    /// Tokens the servers computed: prompt tokens less the cached ones,
    /// plus output tokens, of successful requests.
    pub tokens_computed: u64,
    /// `tokens_computed` per second of wall time.
    pub tokens_computed_per_s: f64,
    /// `model_flops_per_token × tokens_computed_per_s / peak.flops`.
    pub mfu: Option<f64>,
    /// The peak and its derivation.
    pub peak: Peak,
    /// Energy of the CPU packages over the run, J (every process on them).
    pub energy_j: Option<f64>,
    /// Output tokens per joule.
    pub tokens_per_joule: Option<f64>,
    /// Why there is no energy figure.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub energy_absent: Option<String>,
    /// Devices serving, by role (`prefill`, `decode`, `solo`) and vendor:
    /// each worker's `rngd_pd_worker_device_info`.
    pub devices: BTreeMap<String, BTreeMap<String, u64>>,
    /// Why `devices` is empty (no worker metrics read, or none carried the
    /// family).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub devices_absent: Option<String>,
}

/// What a run measured, for [`Kpis::compute`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Counts {
    /// `usage.prompt_tokens` of successful requests.
    pub prompt_tokens: u64,
    /// Their `cached_tokens`.
    pub cached_tokens: u64,
    /// Their output tokens.
    pub output_tokens: u64,
    /// Wall time, seconds.
    pub wall_s: f64,
}

impl Kpis {
    /// The KPIs from the run's counts, the workers' metrics texts, the peak
    /// and the energy read before and after.
    pub fn compute(
        counts: Counts,
        worker_metrics: &[String],
        peak: Peak,
        energy: (Result<Energy, String>, Result<Energy, String>),
    ) -> Kpis {
        let tokens_computed =
            counts.prompt_tokens.saturating_sub(counts.cached_tokens) + counts.output_tokens;
        let per_s = if counts.wall_s > 0.0 {
            tokens_computed as f64 / counts.wall_s
        } else {
            0.0
        };
        let flops = worker_metrics
            .iter()
            .find_map(|t| crate::kv::metric_sum(t, FLOPS_PER_TOKEN));
        let mfu = match (flops, peak.flops) {
            (Some(f), Some(p)) if p > 0.0 => Some(f * per_s / p),
            _ => None,
        };
        let (energy_j, energy_absent) = match energy {
            (Ok(a), Ok(b)) => match b.joules_since(&a) {
                Some(j) => (Some(j), None),
                None => (None, Some("the RAPL domains changed during the run".into())),
            },
            (Err(e), _) | (_, Err(e)) => (None, Some(e)),
        };
        let tokens_per_joule = energy_j
            .filter(|j| *j > 0.0)
            .map(|j| counts.output_tokens as f64 / j);
        let devices = devices(worker_metrics);
        let devices_absent = devices.is_empty().then(|| {
            if worker_metrics.is_empty() {
                "no worker metrics were read (a run against --url without --kv-metrics)".into()
            } else {
                format!("no worker exported {DEVICE_INFO}")
            }
        });
        Kpis {
            model_flops_per_token: flops,
            tokens_computed,
            tokens_computed_per_s: per_s,
            mfu,
            peak,
            energy_j,
            tokens_per_joule,
            energy_absent,
            devices,
            devices_absent,
        }
    }
}

/// Workers by role and vendor: one per metrics text carrying
/// [`DEVICE_INFO`] (a worker exports one series).
pub fn devices(worker_metrics: &[String]) -> BTreeMap<String, BTreeMap<String, u64>> {
    let mut out: BTreeMap<String, BTreeMap<String, u64>> = BTreeMap::new();
    for text in worker_metrics {
        let (Some(role), Some(vendor)) = (
            label(text, DEVICE_INFO, "role"),
            label(text, DEVICE_INFO, "vendor"),
        ) else {
            continue;
        };
        *out.entry(role).or_default().entry(vendor).or_default() += 1;
    }
    out
}

/// The metrics texts of `targets` ([`crate::kv::metrics_target`] entries)
/// that answered.
pub async fn scrape_texts(client: &reqwest::Client, targets: &[String]) -> Vec<String> {
    let mut out = Vec::new();
    for t in targets {
        let (_, url) = crate::kv::metrics_target(t);
        if let Some(text) =
            crate::kv::fetch_text(client, &url, std::time::Duration::from_secs(5)).await
        {
            out.push(text);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const CPUINFO: &str = "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Platinum 8375C CPU @ 2.90GHz\ncpu MHz\t\t: 3499.9\nflags\t\t: fpu sse avx2 fma avx512f avx512_vnni\n\nprocessor\t: 1\ncpu MHz\t\t: 1200.0\n";

    #[test]
    fn the_peak_is_derived_from_cpuinfo() {
        let p = Peak::from_cpuinfo(CPUINFO, 2);
        assert_eq!((p.cores, p.vector_lanes_f32), (2, 16));
        assert_eq!(p.clock_ghz, Some(2.9));
        assert_eq!(p.clock_source, "model name");
        // 2 cores × 16 lanes × 2 FLOPs × 2 units × 2.9 GHz.
        assert_eq!(p.flops, Some(2.0 * 16.0 * 2.0 * 2.0 * 2.9e9));
        let amd = "model name\t: AMD EPYC\ncpu MHz\t\t: 2445.4\ncpu MHz\t\t: 2600.0\nflags\t\t: avx2 fma\n";
        let p = Peak::from_cpuinfo(amd, 4);
        assert_eq!((p.vector_lanes_f32, p.clock_ghz), (8, Some(2.6)));
        assert_eq!(p.clock_source, "cpu MHz (highest)");
        let p = Peak::from_cpuinfo("", 1);
        assert_eq!((p.vector_lanes_f32, p.clock_ghz, p.flops), (4, None, None));
    }

    #[test]
    fn energy_is_read_from_package_domains_and_wraps() {
        let root = std::env::temp_dir().join(format!("rapl-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        assert!(
            Energy::read(&root)
                .unwrap_err()
                .contains("no RAPL counters")
        );
        let write = |d: &str, e: u64| {
            let p = root.join(d);
            std::fs::create_dir_all(&p).unwrap();
            std::fs::write(p.join("energy_uj"), format!("{e}\n")).unwrap();
            std::fs::write(p.join("max_energy_range_uj"), "1000000\n").unwrap();
        };
        std::fs::create_dir_all(&root).unwrap();
        assert!(
            Energy::read(&root)
                .unwrap_err()
                .contains("no intel-rapl package")
        );
        write("intel-rapl:0", 900_000);
        write("intel-rapl:1", 100_000);
        // A sub-domain is inside its package's count: not added again.
        write("intel-rapl:0:0", 5);
        let a = Energy::read(&root).unwrap();
        write("intel-rapl:0", 100_000); // wrapped: 100,000 + 100,000 µJ
        write("intel-rapl:1", 600_000); // 500,000 µJ
        let b = Energy::read(&root).unwrap();
        assert_eq!(b.joules_since(&a), Some(0.7));
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn kpis_from_counts_metrics_peak_and_energy() {
        let worker = |role: &str, vendor: &str| {
            format!(
                "# TYPE {DEVICE_INFO} gauge\n{DEVICE_INFO}{{role=\"{role}\",backend=\"cpu\",vendor=\"{vendor}\",device=\"cpu\"}} 1\n{FLOPS_PER_TOKEN}{{model_name=\"m\"}} 2e8\n"
            )
        };
        let texts = vec![
            worker("prefill", "amd"),
            worker("decode", "amd"),
            worker("decode", "amd"),
            "gateway_metric 1\n".to_string(),
        ];
        let peak = Peak::from_cpuinfo(CPUINFO, 2);
        let counts = Counts {
            prompt_tokens: 1000,
            cached_tokens: 400,
            output_tokens: 200,
            wall_s: 2.0,
        };
        let k = Kpis::compute(
            counts,
            &texts,
            peak.clone(),
            (Err("no RAPL".into()), Err("no RAPL".into())),
        );
        assert_eq!(k.tokens_computed, 800);
        assert_eq!(k.tokens_computed_per_s, 400.0);
        assert_eq!(k.model_flops_per_token, Some(2e8));
        let want = 2e8 * 400.0 / peak.flops.unwrap();
        assert!((k.mfu.unwrap() - want).abs() < 1e-15);
        assert_eq!((k.energy_j, k.tokens_per_joule), (None, None));
        assert_eq!(k.energy_absent.as_deref(), Some("no RAPL"));
        assert_eq!(k.devices["prefill"]["amd"], 1);
        assert_eq!(k.devices["decode"]["amd"], 2);
        assert!(k.devices_absent.is_none());
        // No worker metrics: every worker-side figure absent, with the reason.
        let none = Kpis::compute(counts, &[], peak, (Err("x".into()), Err("x".into())));
        assert_eq!((none.model_flops_per_token, none.mfu), (None, None));
        assert!(none.devices.is_empty());
        assert!(none.devices_absent.unwrap().contains("no worker metrics"));
    }
}
