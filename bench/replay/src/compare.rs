//! `--policies` (and `--llama-server`): several systems replaying the same
//! requests in one run, one after the other. For each routing strategy of
//! the default policy (`cache`, `load`, `round_robin`: `routing` in its
//! plugin configuration) `rngd-pd up --decode-workers D --prefill-workers P
//! --policy-config FILE` is started, the trace window replayed against its
//! gateway ([`crate::replay`], the same code as a single run), and stopped;
//! then, with `--llama-server`, llama.cpp's server ([`crate::llama`]) on
//! the same GGUF gets the same requests. The JSON line carries every
//! system's summary next to the trace's oracle share, the ratios the
//! issue-26 targets name, and every system's full report.

use std::time::Duration;

use serde::Serialize;

use crate::{Error, Options, Report, TraceFormat, llama, up};

/// The routing strategies, as the policy's configuration spells them.
pub const POLICIES: [&str; 3] = ["cache", "load", "round_robin"];

/// The system name of the llama.cpp peer.
pub const LLAMA_SERVER: &str = "llama-server";

/// The routing strategies of `--policies`, checked: each one of
/// [`POLICIES`], none twice.
pub fn parse_policies(list: &[String]) -> Result<Vec<String>, Error> {
    let mut out: Vec<String> = Vec::new();
    for p in list.iter().map(|p| p.trim()) {
        if !POLICIES.contains(&p) {
            return Err(Error::Options(format!(
                "--policies: unknown routing {p:?} (one of {})",
                POLICIES.join(", ")
            )));
        }
        if out.iter().any(|o| o == p) {
            return Err(Error::Options(format!("--policies: {p} given twice")));
        }
        out.push(p.to_string());
    }
    Ok(out)
}

/// The name of the rngd-pd system with routing `p`.
pub fn system_name(p: &str) -> String {
    format!("rngd-pd {p}")
}

/// The KV transport `rngd-pd up` is told to use in `up_args`
/// (`--kv-transport X` or `--kv-transport=X`), else its default `shm`.
pub fn kv_transport(up_args: &[String]) -> String {
    let mut it = up_args.iter();
    let mut found = None;
    while let Some(a) = it.next() {
        if a == "--kv-transport" {
            found = it.next().cloned();
        } else if let Some(v) = a.strip_prefix("--kv-transport=") {
            found = Some(v.to_string());
        }
    }
    found.unwrap_or_else(|| "shm".into())
}

/// The policy configuration of the run with routing `p`: what `rngd-pd up`
/// writes when given none (its transport for both node cases), the
/// `settings` (a JSON object, `--policy-settings`; they may set the
/// transports), plus `routing`.
pub fn policy_config(p: &str, transport: &str, settings: Option<&str>) -> Result<String, Error> {
    let mut cfg = serde_json::Map::new();
    cfg.insert("same_node_transport".into(), transport.into());
    cfg.insert("cross_node_transport".into(), transport.into());
    if let Some(raw) = settings {
        let bad = |why: String| Error::Options(format!("--policy-settings: {why}"));
        let extra: serde_json::Map<String, serde_json::Value> =
            serde_json::from_str(raw).map_err(|e| bad(format!("not a JSON object: {e}")))?;
        if extra.contains_key("routing") {
            return Err(bad("`routing` is set by --policies".into()));
        }
        cfg.extend(extra);
    }
    cfg.insert("routing".into(), p.into());
    Ok(serde_json::Value::Object(cfg).to_string())
}

/// One system's figures (the issue's columns) and its full report.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct System {
    /// `rngd-pd cache`, `rngd-pd load`, `rngd-pd round_robin`, `llama-server`.
    pub system: String,
    /// Requests sent / completed.
    pub requests: u64,
    /// Completed.
    pub ok: u64,
    /// Not completed.
    pub errors: u64,
    /// Summed `cached_tokens` over summed `prompt_tokens` (successful requests).
    pub served_cached_share: Option<f64>,
    /// TTFT p50, ms.
    pub ttft_p50_ms: Option<f64>,
    /// TTFT p90, ms.
    pub ttft_p90_ms: Option<f64>,
    /// TPOT p50, ms.
    pub tpot_p50_ms: Option<f64>,
    /// TPOT p90, ms.
    pub tpot_p90_ms: Option<f64>,
    /// Requests per second meeting the SLO (both bounds in `slo`).
    pub goodput_rps: f64,
    /// Share of successful requests meeting it.
    pub slo_share: Option<f64>,
    /// First arrival to the last request's end, seconds.
    pub wall_s: f64,
    /// The system's full report (as a single run prints it).
    pub report: Report,
}

impl System {
    /// The summary of `report` under `name`.
    pub fn new(name: String, report: Report) -> Self {
        System {
            system: name,
            requests: report.requests,
            ok: report.ok,
            errors: report.errors,
            served_cached_share: report.prefix.as_ref().and_then(|p| p.served_cached_share),
            ttft_p50_ms: report.ttft_p50_ms,
            ttft_p90_ms: report.ttft_p90_ms,
            tpot_p50_ms: report.tpot_p50_ms,
            tpot_p90_ms: report.tpot_p90_ms,
            goodput_rps: report.goodput_rps,
            slo_share: report.slo_share,
            wall_s: report.wall_s,
            report,
        }
    }
}

/// The ratios the targets name, each `None` when a side is missing.
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Default)]
pub struct Ratios {
    /// Cache-aware served cached share over the trace's oracle share (target ≥ 0.8).
    pub cache_cached_share_vs_oracle: Option<f64>,
    /// TTFT p50, cache-aware over load-only (target ≤ 0.6).
    pub ttft_p50_cache_vs_load: Option<f64>,
    /// TTFT p50, cache-aware over llama-server (target ≤ 0.67).
    pub ttft_p50_cache_vs_llama_server: Option<f64>,
    /// TPOT p90, cache-aware over llama-server (target ≤ 0.1).
    pub tpot_p90_cache_vs_llama_server: Option<f64>,
    /// Goodput, cache-aware over llama-server (target ≥ 1).
    pub goodput_cache_vs_llama_server: Option<f64>,
}

/// Whether each target is met (`None`: its ratio is missing).
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Default)]
pub struct Targets {
    /// Served cached share ≥ 0.8 × the oracle's.
    pub cached_share: Option<bool>,
    /// TTFT p50 ≤ 0.6 × load-only's.
    pub ttft_vs_load: Option<bool>,
    /// TTFT p50 ≤ 0.67 × llama-server's.
    pub ttft_vs_llama_server: Option<bool>,
    /// TPOT p90 ≤ 0.1 × llama-server's.
    pub tpot_vs_llama_server: Option<bool>,
    /// Goodput ≥ llama-server's.
    pub goodput_vs_llama_server: Option<bool>,
}

/// `a / b` when both exist and `b` is positive.
fn ratio(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => Some(a / b),
        _ => None,
    }
}

/// The ratios of the cache-aware system to the others, and the oracle.
pub fn ratios(systems: &[System], oracle_share: Option<f64>) -> Ratios {
    let find = |name: &str| systems.iter().find(|s| s.system == name);
    let cache = find(&system_name("cache"));
    let load = find(&system_name("load"));
    let llama = find(LLAMA_SERVER);
    let of = |s: Option<&System>, f: fn(&System) -> Option<f64>| s.and_then(f);
    Ratios {
        cache_cached_share_vs_oracle: ratio(of(cache, |s| s.served_cached_share), oracle_share),
        ttft_p50_cache_vs_load: ratio(of(cache, |s| s.ttft_p50_ms), of(load, |s| s.ttft_p50_ms)),
        ttft_p50_cache_vs_llama_server: ratio(
            of(cache, |s| s.ttft_p50_ms),
            of(llama, |s| s.ttft_p50_ms),
        ),
        tpot_p90_cache_vs_llama_server: ratio(
            of(cache, |s| s.tpot_p90_ms),
            of(llama, |s| s.tpot_p90_ms),
        ),
        goodput_cache_vs_llama_server: ratio(
            of(cache, |s| Some(s.goodput_rps)),
            of(llama, |s| Some(s.goodput_rps)),
        ),
    }
}

impl Ratios {
    /// The targets of issue 26 against these ratios.
    pub fn targets(&self) -> Targets {
        Targets {
            cached_share: self.cache_cached_share_vs_oracle.map(|r| r >= 0.8),
            ttft_vs_load: self.ttft_p50_cache_vs_load.map(|r| r <= 0.6),
            ttft_vs_llama_server: self.ttft_p50_cache_vs_llama_server.map(|r| r <= 0.67),
            tpot_vs_llama_server: self.tpot_p90_cache_vs_llama_server.map(|r| r <= 0.1),
            goodput_vs_llama_server: self.goodput_cache_vs_llama_server.map(|r| r >= 1.0),
        }
    }
}

/// The SLO goodput counts against.
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct Slo {
    /// TTFT bound, ms (`null`: none).
    pub ttft_ms: Option<f64>,
    /// TPOT bound, ms.
    pub tpot_ms: f64,
}

/// The JSON line of a comparison run.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct CompareReport {
    /// The trace's own reuse share of the requests sent (an infinite cache
    /// on one server; `null` for the Azure trace).
    pub oracle_share: Option<f64>,
    /// The same under the engine's rule that a prefill computes its last token.
    pub oracle_share_capped: Option<f64>,
    /// The SLO of `goodput_rps`.
    pub slo: Slo,
    /// `rngd-pd up` workers: decode.
    pub decode_workers: u32,
    /// `rngd-pd up` workers: prefill.
    pub prefill_workers: u32,
    /// The systems, in the order they ran.
    pub systems: Vec<System>,
    /// The ratios the targets name.
    pub ratios: Ratios,
    /// Whether each target is met.
    pub targets: Targets,
    /// The peer's command line (`null` without `--llama-server`).
    pub llama_server_args: Option<Vec<String>>,
}

impl CompareReport {
    /// The one-line JSON text.
    pub fn json_line(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
    }
}

/// Whether `opts` asks for a comparison run.
pub fn wanted(opts: &Options) -> bool {
    !opts.policies.is_empty() || opts.llama_server.is_some()
}

/// Runs every system on the same requests and returns the comparison.
pub async fn launch(opts: Options) -> Result<CompareReport, Error> {
    let policies = parse_policies(&opts.policies)?;
    let (format, planned, history) = crate::prepare(&opts)?;
    let bin = up::locate(opts.rngd_pd.as_deref())?;
    let timeout = Duration::from_secs_f64(opts.up_timeout_s);
    let transport = kv_transport(&opts.up_args);
    let scratch =
        std::env::temp_dir().join(format!("rngd-pd-bench-compare-{}", std::process::id()));
    std::fs::create_dir_all(&scratch)
        .map_err(|e| Error::Options(format!("creating {}: {e}", scratch.display())))?;
    let mut systems = Vec::new();
    for p in &policies {
        let cfg = scratch.join(format!("policy-{p}.json"));
        std::fs::write(
            &cfg,
            policy_config(p, &transport, opts.policy_settings.as_deref())?,
        )
        .map_err(|e| Error::Options(format!("writing {}: {e}", cfg.display())))?;
        let mut args = opts.up_args.clone();
        args.extend([
            "--decode-workers".into(),
            opts.decode_workers.to_string(),
            "--prefill-workers".into(),
            opts.prefill_workers.to_string(),
            "--policy-config".into(),
            cfg.display().to_string(),
        ]);
        if !opts.json {
            eprintln!("replay: {} — starting {} up", system_name(p), bin.display());
        }
        let stack = up::start(&bin, opts.seq_len, &args, timeout).await?;
        let run = Options {
            spawn_up: true,
            ..opts.clone()
        };
        let result = crate::replay(&run, format, &planned, &history, Some(&stack), None).await;
        if let Err(e) = stack.stop(Duration::from_secs(30)).await {
            eprintln!("replay: {e}");
        }
        let report = result?;
        if !opts.json {
            eprintln!("{}", report.json_line());
        }
        systems.push(System::new(system_name(p), report));
    }
    let mut llama_server_args = None;
    if let Some(server) = &opts.llama_server {
        let model = match &opts.llama_model {
            Some(m) => m.clone(),
            None => llama::default_model(&bin).await?,
        };
        let cfg = llama::LlamaConfig {
            bin: server.clone(),
            model,
            threads: opts.llama_threads,
            parallel: opts.llama_parallel,
            seq_len: opts.seq_len,
            extra: opts.llama_args.clone(),
        };
        if !opts.json {
            eprintln!("replay: {LLAMA_SERVER} — starting {}", server.display());
        }
        let peer = llama::start(&cfg, timeout).await?;
        llama_server_args = Some(cfg.args(peer.port));
        let mut pids = opts.pids.clone();
        pids.push(peer.pid);
        let run = Options {
            url: Some(peer.url.clone()),
            pids,
            ..opts.clone()
        };
        let result = crate::replay(&run, format, &planned, &history, None, None).await;
        if let Err(e) = peer.stop(Duration::from_secs(30)).await {
            eprintln!("replay: {e}");
        }
        let report = result?;
        if !opts.json {
            eprintln!("{}", report.json_line());
        }
        systems.push(System::new(LLAMA_SERVER.into(), report));
    }
    let _ = std::fs::remove_dir_all(&scratch);
    let prefix = systems
        .first()
        .and_then(|s| s.report.prefix.as_ref())
        .filter(|_| format == TraceFormat::Mooncake);
    let oracle_share = prefix.and_then(|p| p.trace_reuse_share);
    let ratios = ratios(&systems, oracle_share);
    Ok(CompareReport {
        oracle_share,
        oracle_share_capped: prefix.and_then(|p| p.trace_reuse_share_capped),
        slo: Slo {
            ttft_ms: opts.slo_ttft_ms,
            tpot_ms: opts.slo_tpot_ms,
        },
        decode_workers: opts.decode_workers,
        prefill_workers: opts.prefill_workers,
        targets: ratios.targets(),
        ratios,
        systems,
        llama_server_args,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn the_policy_list_is_checked() {
        assert_eq!(
            parse_policies(&strings(&["cache", " load", "round_robin"])).unwrap(),
            strings(&["cache", "load", "round_robin"])
        );
        assert_eq!(parse_policies(&[]).unwrap(), Vec::<String>::new());
        for bad in [&["cache", "cache"][..], &["lru"], &["round-robin"], &[""]] {
            let e = parse_policies(&strings(bad)).unwrap_err().to_string();
            assert!(e.contains("--policies"), "{bad:?}: {e}");
        }
    }

    #[test]
    fn the_policy_configuration_keeps_up_s_transport() {
        assert_eq!(kv_transport(&[]), "shm");
        assert_eq!(kv_transport(&strings(&["--kv-transport", "tcp"])), "tcp");
        assert_eq!(
            kv_transport(&strings(&["--kv-transport=nixl-ucx"])),
            "nixl-ucx"
        );
        let c: serde_json::Value =
            serde_json::from_str(&policy_config("load", "tcp", None).unwrap()).unwrap();
        assert_eq!(
            c,
            serde_json::json!({"same_node_transport":"tcp","cross_node_transport":"tcp","routing":"load"})
        );
    }

    #[test]
    fn policy_settings_join_every_routing_s_configuration() {
        let c: serde_json::Value = serde_json::from_str(
            &policy_config("cache", "shm", Some(r#"{"queue_ms_per_request":0}"#)).unwrap(),
        )
        .unwrap();
        assert_eq!(
            c,
            serde_json::json!({"same_node_transport":"shm","cross_node_transport":"shm",
                "queue_ms_per_request":0,"routing":"cache"})
        );
        let err = policy_config("load", "shm", Some(r#"{"routing":"cache"}"#))
            .unwrap_err()
            .to_string();
        assert!(err.contains("`routing` is set by --policies"), "{err}");
        let err = policy_config("load", "shm", Some("[1]"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("not a JSON object"), "{err}");
    }

    fn system(name: &str, share: Option<f64>, ttft: f64, tpot90: f64, goodput: f64) -> System {
        let mut s = System::new(name.into(), test_report());
        s.served_cached_share = share;
        s.ttft_p50_ms = Some(ttft);
        s.tpot_p90_ms = Some(tpot90);
        s.goodput_rps = goodput;
        s
    }

    fn test_report() -> Report {
        Report {
            requests: 0,
            scheduled: 0,
            client_dropped: 0,
            ok: 0,
            errors: 0,
            http_429: 0,
            http_5xx: 0,
            http_other: 0,
            stream_errors: 0,
            timeouts: 0,
            transport: 0,
            usage_missing: 0,
            ttft_p50_ms: None,
            ttft_p90_ms: None,
            ttft_p99_ms: None,
            tpot_p50_ms: None,
            tpot_p90_ms: None,
            tpot_p99_ms: None,
            max_gap_p50_ms: None,
            max_gap_p99_ms: None,
            slo_share: None,
            goodput_rps: 0.0,
            tok_s: 0.0,
            output_tokens: 0,
            prompt_tokens_sent: 0,
            max_tokens_sent: 0,
            prompt_tokens_usage: 0,
            error_bodies: Default::default(),
            rss_mb_start: Default::default(),
            rss_mb_end: Default::default(),
            leaked_kv: None,
            prefix: None,
            by_route: Default::default(),
            chaos: None,
            kpis: crate::kpi::Kpis::compute(
                crate::kpi::Counts {
                    prompt_tokens: 0,
                    cached_tokens: 0,
                    output_tokens: 0,
                    wall_s: 0.0,
                },
                &[],
                crate::kpi::Peak::from_cpuinfo("", 1),
                (Err(String::new()), Err(String::new())),
            ),
            wall_s: 0.0,
            settings: crate::Settings {
                trace: String::new(),
                trace_format: TraceFormat::Mooncake,
                block_tokens: Some(16),
                url: String::new(),
                model: String::new(),
                speedup: 1.0,
                skip: 0,
                max_requests: None,
                history: false,
                duration_s: None,
                seq_len: 512,
                margin: 16,
                max_in_flight: 256,
                request_timeout_s: 120.0,
                slo_tpot_ms: 150.0,
                slo_ttft_ms: None,
                spawn_up: true,
                spawn_worker: false,
            },
        }
    }

    #[test]
    fn ratios_and_targets() {
        let systems = vec![
            system("rngd-pd cache", Some(0.09), 300.0, 40.0, 1.2),
            system("rngd-pd load", Some(0.02), 1000.0, 45.0, 1.0),
            system("rngd-pd round_robin", Some(0.01), 1100.0, 45.0, 0.9),
            system(LLAMA_SERVER, Some(0.1), 400.0, 500.0, 1.5),
        ];
        let r = ratios(&systems, Some(0.1));
        let close = |a: Option<f64>, b: f64| assert!((a.unwrap() - b).abs() < 1e-9, "{a:?} {b}");
        close(r.cache_cached_share_vs_oracle, 0.9);
        close(r.ttft_p50_cache_vs_load, 0.3);
        close(r.ttft_p50_cache_vs_llama_server, 0.75);
        close(r.tpot_p90_cache_vs_llama_server, 0.08);
        close(r.goodput_cache_vs_llama_server, 0.8);
        assert_eq!(
            r.targets(),
            Targets {
                cached_share: Some(true),
                ttft_vs_load: Some(true),
                ttft_vs_llama_server: Some(false),
                tpot_vs_llama_server: Some(true),
                goodput_vs_llama_server: Some(false),
            }
        );
        // Without the peer or the load-only run, those ratios are missing.
        let r = ratios(&systems[..1], None);
        assert_eq!(r, Ratios::default());
        assert_eq!(r.targets(), Targets::default());
        // A zero denominator gives no ratio.
        assert_eq!(ratio(Some(1.0), Some(0.0)), None);
    }
}
