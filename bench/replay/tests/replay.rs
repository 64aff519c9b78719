//! Tests of the replay: the trace parser (timestamps to offsets, scaling to
//! the context), the summary maths on known inputs, the JSON line's keys,
//! the `/proc` and `rngd-pd up` line parsers, and whole runs against a fake
//! OpenAI streaming server served here (axum on 127.0.0.1:0) that answers
//! SSE chunks + usage, and 429 or 503 for chosen requests. No timing is
//! asserted: only counts, shapes and the requests the server received.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use rngd_bench_replay::stats::{self, Outcome, Percentiles, Status};
use rngd_bench_replay::{Options, kv, procs, trace, up};
use serde_json::Value;

const TRACE: &str = "TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109

2023-11-16 18:16:46.6805900,4000,1000
2023-11-16 23:59:59.5000000,10,0
2023-11-17 00:00:00.5000000,1,1
";

#[test]
fn the_csv_parses_into_rows_and_offsets() {
    let rows = trace::parse(TRACE).expect("parses");
    assert_eq!(rows.len(), 5, "the blank line is skipped");
    assert_eq!(rows[0].context_tokens, 374);
    assert_eq!(rows[1].generated_tokens, 109);
    let d = |i: usize| rows[i].timestamp_s - rows[0].timestamp_s;
    assert!((d(1) - 4.314_579).abs() < 1e-6, "{}", d(1));
    assert!((d(2) - 60.0).abs() < 1e-6, "{}", d(2));
    // Across midnight: one second apart.
    assert!((rows[4].timestamp_s - rows[3].timestamp_s - 1.0).abs() < 1e-6);
    // Absolute: 2023-11-16 00:00:00 UTC is 1700092800.
    let midnight = trace::parse_timestamp("2023-11-16 00:00:00").expect("ts");
    assert_eq!(midnight, 1_700_092_800.0);

    // Columns in another order, by name.
    let rows2 = trace::parse("GeneratedTokens,TIMESTAMP,ContextTokens\n7,2023-01-01 00:00:01,9\n")
        .expect("parses");
    assert_eq!((rows2[0].context_tokens, rows2[0].generated_tokens), (9, 7));
}

#[test]
fn malformed_traces_are_errors_naming_the_line() {
    let e = trace::parse("TIMESTAMP,ContextTokens\n").expect_err("no column");
    assert!(e.to_string().contains("GeneratedTokens"), "{e}");
    let e = trace::parse("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,x,1\n")
        .expect_err("bad number");
    assert!(e.to_string().contains("line 2"), "{e}");
    assert!(trace::parse_timestamp("2023-13-01 00:00:00").is_none());
    assert!(trace::parse_timestamp("yesterday").is_none());
}

#[test]
fn lengths_are_scaled_to_the_context() {
    // Fits: unchanged.
    assert_eq!(trace::scale(374, 44, 496), (374, 44));
    assert_eq!(trace::scale(496 - 1, 1, 496), (495, 1));
    // Too long: both by the same factor, rounded down.
    assert_eq!(trace::scale(4000, 1000, 496), (396, 99));
    assert_eq!(trace::scale(900, 100, 500), (450, 50));
    // A zero generation still asks for one token.
    assert_eq!(trace::scale(10, 0, 496), (10, 1));
    // A tiny share never rounds to zero, and the sum still fits.
    let (p, m) = trace::scale(100_000, 1, 496);
    assert!(m >= 1 && p >= 1 && p + m <= 496, "{p} {m}");
    for (c, g) in [(1, 1), (5000, 5000), (1, 9999), (9999, 1), (497, 0)] {
        let (p, m) = trace::scale(c, g, 496);
        assert!(p >= 1 && m >= 1 && p + m <= 496, "{c},{g} -> {p},{m}");
    }
}

#[test]
fn the_schedule_scales_time_and_honours_its_bounds() {
    let rows = trace::parse(TRACE).expect("parses");
    let all = trace::schedule(&rows, 0, None, None, 10.0, 496);
    assert_eq!(all.len(), 5);
    assert_eq!(all[0].offset, Duration::ZERO);
    assert!((all[1].offset.as_secs_f64() - 0.431_457_9).abs() < 1e-6);
    assert!((all[2].offset.as_secs_f64() - 6.0).abs() < 1e-6);
    assert_eq!((all[2].prompt_tokens, all[2].max_tokens), (396, 99));
    // --skip: offsets from the skipped-to row.
    let s = trace::schedule(&rows, 1, None, None, 1.0, 496);
    assert_eq!(s.len(), 4);
    assert_eq!(s[0].row, 1);
    assert_eq!(s[0].offset, Duration::ZERO);
    // --max-requests and --duration-s.
    assert_eq!(trace::schedule(&rows, 0, Some(2), None, 1.0, 496).len(), 2);
    let d = trace::schedule(&rows, 0, None, Some(Duration::from_secs(59)), 1.0, 496);
    assert_eq!(d.len(), 2, "the row 60 s in is outside a 59 s window");
    assert!(trace::schedule(&rows, 99, None, None, 1.0, 496).is_empty());
}

#[test]
fn prompts_have_the_asked_number_of_words() {
    let p = trace::prompt_text(37, 3);
    assert_eq!(p.split(' ').count(), 37);
    assert!(!p.starts_with(' ') && !p.ends_with(' '));
    assert_ne!(trace::prompt_text(5, 0), trace::prompt_text(5, 1));
}

#[test]
fn route_groups_are_bounded() {
    use rngd_bench_replay::{MAX_ROUTES, OTHER_ROUTES, group_by_route};
    let mut routes = std::collections::BTreeMap::new();
    for i in 0..MAX_ROUTES + 5 {
        group_by_route(&mut routes, format!("r{i}"), ok(10, 10, 2));
    }
    // A known reason keeps its own group after the cap.
    group_by_route(&mut routes, "r0".into(), ok(10, 10, 2));
    assert_eq!(routes.len(), MAX_ROUTES + 1);
    assert_eq!(routes[OTHER_ROUTES].len(), 5);
    assert_eq!(routes["r0"].len(), 2);
}

#[test]
fn percentiles_by_nearest_rank() {
    let v: Vec<f64> = (1..=100).map(f64::from).collect();
    assert_eq!(stats::percentile(&v, 50.0), Some(50.0));
    assert_eq!(stats::percentile(&v, 90.0), Some(90.0));
    assert_eq!(stats::percentile(&v, 99.0), Some(99.0));
    assert_eq!(stats::percentile(&v, 100.0), Some(100.0));
    assert_eq!(stats::percentile(&[7.0], 99.0), Some(7.0));
    assert_eq!(stats::percentile(&[], 50.0), None);
    let p = Percentiles::of(vec![5.0, 1.0, 4.0, 2.0, 3.0]);
    assert_eq!((p.p50, p.p90, p.p99), (Some(3.0), Some(5.0), Some(5.0)));
}

fn ok(ttft_ms: u64, decode_ms: u64, tokens: u64) -> Outcome {
    Outcome {
        status: Status::Ok,
        ttft: Some(Duration::from_millis(ttft_ms)),
        decode: Some(Duration::from_millis(decode_ms)),
        max_gap: (tokens >= 2).then(|| Duration::from_millis(decode_ms / (tokens - 1) * 2)),
        tokens,
        usage_seen: true,
        prompt_tokens: Some(5),
        cached_tokens: None,
    }
}

#[test]
fn the_summary_counts_and_rates() {
    let outcomes = vec![
        ok(100, 900, 10),  // tpot 100 ms: meets
        ok(200, 1800, 10), // tpot 200 ms: misses
        ok(300, 0, 1),     // one token: no tpot, meets
        Outcome {
            usage_seen: false,
            ..ok(400, 150, 2) // tpot 150 ms: meets (≤)
        },
        Outcome::failed(Status::Http429),
        Outcome::failed(Status::Http429),
        Outcome::failed(Status::Http5xx(503)),
        Outcome::failed(Status::HttpOther(400)),
        Outcome::failed(Status::Timeout),
        Outcome::failed(Status::Transport),
        Outcome::failed(Status::StreamError),
    ];
    let s = stats::summarize(
        &outcomes,
        Duration::from_secs(2),
        Duration::from_millis(150),
    );
    assert_eq!(s.requests, 11);
    assert_eq!(s.ok, 4);
    assert_eq!(s.errors, 7);
    assert_eq!(
        (
            s.http_429,
            s.http_5xx,
            s.http_other,
            s.timeouts,
            s.transport,
            s.stream_errors
        ),
        (2, 1, 1, 1, 1, 1)
    );
    assert_eq!(s.usage_missing, 1);
    assert_eq!(s.output_tokens, 23);
    assert_eq!(s.prompt_tokens_usage, 20, "successes only");
    assert_eq!(s.slo_met, 3);
    assert_eq!(s.slo_share, Some(0.75));
    assert_eq!(s.goodput_rps, 1.5);
    assert_eq!(s.tok_s, 11.5);
    assert_eq!(s.ttft_ms.p50, Some(200.0));
    assert_eq!(s.ttft_ms.p99, Some(400.0));
    assert_eq!(s.tpot_ms.p50, Some(150.0));
    assert_eq!(s.tpot_ms.p90, Some(200.0));
    // The longest gaps (200, 400, 300 ms; the one-token answer has none).
    assert_eq!(s.max_gap_ms.p50, Some(300.0));
    assert_eq!(s.max_gap_ms.p99, Some(400.0));
    // Nothing succeeded: no share, no percentiles, zero rates.
    let none = stats::summarize(
        &[Outcome::failed(Status::Timeout)],
        Duration::from_secs(1),
        Duration::from_millis(150),
    );
    assert_eq!(
        (none.slo_share, none.ttft_ms.p50, none.goodput_rps),
        (None, None, 0.0)
    );
}

#[test]
fn a_ttft_slo_counts_as_well() {
    let outcomes = vec![
        ok(100, 900, 10),  // ttft 100, tpot 100: meets both
        ok(2500, 900, 10), // ttft 2.5 s: misses the TTFT bound
        ok(300, 0, 1),     // one token, ttft 300: meets
        ok(200, 1800, 10), // tpot 200 ms: misses the TPOT bound
    ];
    let s = stats::summarize_with(
        &outcomes,
        Duration::from_secs(1),
        Duration::from_millis(100),
        Some(Duration::from_secs(2)),
    );
    assert_eq!((s.slo_met, s.slo_share), (2, Some(0.5)));
    assert_eq!(s.goodput_rps, 2.0);
    // Without it, TPOT alone.
    let s = stats::summarize_with(
        &outcomes,
        Duration::from_secs(1),
        Duration::from_millis(100),
        None,
    );
    assert_eq!(s.slo_met, 3);
}

#[test]
fn proc_and_up_lines_parse() {
    assert_eq!(
        procs::parse_vm_rss_kb("Name:\tx\nVmRSS:\t  123456 kB\nVmSwap: 0 kB\n"),
        Some(123_456)
    );
    assert_eq!(procs::parse_ppid("42 (a (b) c) S 7 42 42 0"), Some(7));
    let me = std::process::id();
    assert!(procs::rss_mb(me).is_some_and(|mb| mb > 0.0));
    let args = |s: &str| s.split(' ').map(String::from).collect::<Vec<_>>();
    assert_eq!(
        procs::rngd_label(&args("/x/rngd-pd worker --role decode --port 0")),
        "decode"
    );
    assert_eq!(
        procs::rngd_label(&args("/x/rngd-pd relay --listen a")),
        "relay"
    );
    assert_eq!(
        procs::rngd_label(&args("/x/rngd-pd ext-proc --host h")),
        "ext-proc"
    );
    assert_eq!(procs::rngd_label(&args("/usr/bin/envoy -c f")), "envoy");

    let mut info = up::UpInfo::default();
    for l in [
        "rngd-pd up: relay     tcp://127.0.0.1:1",
        "rngd-pd up: prefill   http://127.0.0.1:2",
        "rngd-pd up: decode    http://127.0.0.1:3",
        "rngd-pd up: decode-1  http://127.0.0.1:6",
        "rngd-pd up: kv events decode-1 tcp://127.0.0.1:8002 replay tcp://127.0.0.1:9002",
        "rngd-pd up: shm root  /dev/shm/rngd_pd_up_9",
        "rngd-pd up: kpis      http://127.0.0.1:4",
        "rngd-pd up: gateway   http://127.0.0.1:5",
        "rngd-pd up: try       curl -s http://127.0.0.1:5/v1/completions",
    ] {
        info.line(l);
    }
    assert!(!info.ready);
    info.line("rngd-pd up: ready (Ctrl-C stops everything)");
    assert_eq!(
        info,
        up::UpInfo {
            gateway: Some("http://127.0.0.1:5".into()),
            prefill: Some("http://127.0.0.1:2".into()),
            decode: Some("http://127.0.0.1:3".into()),
            shm_root: Some("/dev/shm/rngd_pd_up_9".into()),
            more_workers: vec![("decode-1".into(), "http://127.0.0.1:6".into())],
            ready: true,
        }
    );
}

#[test]
fn worker_gauges_parse_from_prometheus_text() {
    let text = "# HELP vllm:kv_cache_usage_perc KV\n# TYPE vllm:kv_cache_usage_perc gauge\n\
        vllm:kv_cache_usage_perc{model_name=\"m\"} 0.25\n\
        vllm:num_requests_running{model_name=\"m\"} 2\n\
        vllm:num_requests_running_extra 9\n\
        vllm:num_requests_waiting 1\n";
    let w = kv::parse_worker(text);
    assert_eq!(
        (w.kv_cache_usage_perc, w.running, w.waiting),
        (Some(0.25), Some(2.0), Some(1.0))
    );
    assert_eq!(w.worker_in_flight, None, "absent gauge");
    assert!(!w.idle(), "2 running");
    let idle = kv::parse_worker("vllm:num_requests_running 0\nrngd_pd_worker_in_flight 0\n");
    assert!(idle.idle());
    assert!(!kv::parse_worker("rngd_pd_gateway_queued 3\n").idle());
    assert_eq!(kv::metric_sum(text, "vllm:absent"), None);
    assert_eq!(kv::metrics_url("http://h:1/"), "http://h:1/metrics");
    assert_eq!(kv::metrics_url("http://h:1/metrics"), "http://h:1/metrics");
    assert_eq!(
        kv::metrics_target("decode=http://h:1"),
        ("decode".into(), "http://h:1/metrics".into())
    );
    assert_eq!(
        kv::metrics_target("http://h:1/x?a=b"),
        (
            "http://h:1/x?a=b/metrics".into(),
            "http://h:1/x?a=b/metrics".into()
        )
    );
}

// ---- the fake server -------------------------------------------------------

/// What the fake server does and saw.
#[derive(Default)]
struct Fake {
    /// Requests received (1-based number of the next one = this + 1).
    n: AtomicUsize,
    /// Every Nth request is answered 429 (0 = never).
    every_429: usize,
    /// This request number is answered 503 (0 = none).
    the_503: usize,
    /// Request number 1 never answers (to hold the in-flight slot).
    hang_first: bool,
    /// The bodies received.
    bodies: Mutex<Vec<Value>>,
}

async fn completions(State(f): State<Arc<Fake>>, body: axum::body::Bytes) -> Response {
    let n = f.n.fetch_add(1, Ordering::SeqCst) + 1;
    let v: Value = serde_json::from_slice(&body).expect("json body");
    f.bodies.lock().expect("lock").push(v);
    if f.hang_first && n == 1 {
        std::future::pending::<()>().await;
    }
    if f.every_429 > 0 && n.is_multiple_of(f.every_429) {
        return (StatusCode::TOO_MANY_REQUESTS, "slow down").into_response();
    }
    if n == f.the_503 {
        return (StatusCode::SERVICE_UNAVAILABLE, "no").into_response();
    }
    let chunk = |text: &str, finish: Value| {
        serde_json::json!({"id": "c", "object": "text_completion", "choices": [
            {"index": 0, "text": text, "finish_reason": finish}
        ]})
    };
    let mut sse = String::new();
    for ev in [
        chunk(" a", Value::Null),
        chunk(" b", Value::Null),
        chunk(" c", Value::Null),
        chunk("", "stop".into()),
        serde_json::json!({"id": "c", "choices": [], "usage":
            {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}),
    ] {
        sse.push_str(&format!("data: {ev}\n\n"));
    }
    sse.push_str("data: [DONE]\n\n");
    // A router's reason for the route: odd requests `cached`, even ones
    // `disaggregated`.
    let route = if n % 2 == 1 {
        "cached"
    } else {
        "disaggregated"
    };
    (
        [
            ("content-type", "text/event-stream"),
            (rngd_api::headers::ROUTE_REASON, route),
        ],
        sse,
    )
        .into_response()
}

const METRICS: &str = "vllm:kv_cache_usage_perc{model_name=\"m\"} 0\n\
    vllm:num_requests_running{model_name=\"m\"} 0\n\
    vllm:num_requests_waiting{model_name=\"m\"} 0\n\
    rngd_pd_worker_in_flight 0\n\
    rngd_pd_worker_device_info{backend=\"cpu\",device=\"cpu\",role=\"decode\",vendor=\"amd\"} 1\n\
    rngd_pd_worker_model_flops_per_token{model_name=\"m\"} 1000\n";

async fn serve(fake: Arc<Fake>) -> String {
    let app = Router::new()
        .route("/v1/completions", post(completions))
        .route(
            "/v1/models",
            get(|| async { axum::Json(serde_json::json!({"data": [{"id": "fake-model"}]})) }),
        )
        .route("/metrics", get(|| async { METRICS }))
        .with_state(fake);
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = l.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(l, app).await.expect("serve") });
    format!("http://{addr}")
}

/// A trace of `n` rows, 1 s apart, with lengths over a 512 context.
fn write_trace(n: usize, tag: &str) -> std::path::PathBuf {
    let mut t = String::from("TIMESTAMP,ContextTokens,GeneratedTokens\n");
    for i in 0..n {
        t.push_str(&format!(
            "2023-11-16 18:{:02}:{:02}.5,{},{}\n",
            i / 60,
            i % 60,
            1000 + i,
            300
        ));
    }
    let p = std::env::temp_dir().join(format!("rngd_replay_test_{tag}_{}.csv", std::process::id()));
    std::fs::write(&p, t).expect("write trace");
    p
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_against_a_fake_server_counts_exactly() {
    let fake = Arc::new(Fake {
        every_429: 4,
        the_503: 6,
        ..Fake::default()
    });
    let url = serve(fake.clone()).await;
    let shm = std::env::temp_dir().join(format!("rngd_replay_test_shm_{}", std::process::id()));
    std::fs::create_dir_all(shm.join("sub")).expect("mkdir");
    std::fs::write(shm.join("k1.kv"), [0u8; 10]).expect("write");
    std::fs::write(shm.join("sub/.tmp.k2.1.0"), [0u8; 5]).expect("write");
    // Not an arena's header: counted as an arena with no busy slot known.
    std::fs::write(shm.join("arena.1.0.kva"), [0u8; 64]).expect("write");
    let trace = write_trace(12, "counts");
    let opts = Options {
        trace: trace.clone(),
        url: Some(url.clone()),
        speedup: 1000.0,
        max_requests: Some(10),
        seq_len: 512,
        margin: 16,
        pids: vec![std::process::id()],
        kv_metrics: vec![url.clone(), format!("named={url}/metrics")],
        shm_root: Some(shm.clone()),
        settle_s: 5.0,
        json: true,
        ..Options::default()
    };
    let r = rngd_bench_replay::launch(opts).await.expect("runs");
    let _ = std::fs::remove_dir_all(&shm);
    let _ = std::fs::remove_file(&trace);

    assert_eq!(r.requests, 10);
    assert_eq!(r.scheduled, 10);
    assert_eq!(r.client_dropped, 0);
    assert_eq!(r.http_429, 2, "requests 4 and 8");
    assert_eq!(r.http_5xx, 1, "request 6");
    assert_eq!(r.errors, 3);
    assert_eq!(r.ok, 7);
    assert_eq!(
        (r.timeouts, r.transport, r.http_other, r.stream_errors),
        (0, 0, 0, 0)
    );
    assert_eq!(r.output_tokens, 21, "3 tokens from usage per success");
    assert_eq!(r.usage_missing, 0);
    assert_eq!(
        r.error_bodies.get("429").map(String::as_str),
        Some("slow down")
    );
    assert_eq!(r.error_bodies.get("503").map(String::as_str), Some("no"));
    assert_eq!(r.error_bodies.len(), 2);
    assert_eq!(
        r.prompt_tokens_usage, 35,
        "5 prompt tokens from usage per success"
    );
    assert!(r.ttft_p50_ms.is_some() && r.tpot_p50_ms.is_some());
    assert!(r.slo_share.is_some());
    // The successes by their route header (4, 6 and 8 failed, unrouted).
    let routes: Vec<(&str, u64, u64)> = r
        .by_route
        .iter()
        .map(|(k, v)| (k.as_str(), v.requests, v.ok))
        .collect();
    assert_eq!(routes, [("cached", 5, 5), ("disaggregated", 2, 2)]);
    assert!(r.by_route["cached"].tpot_p90_ms.is_some());
    assert_eq!(r.settings.model, "fake-model");
    let me = std::process::id().to_string();
    assert!(r.rss_mb_start[&me].is_some() && r.rss_mb_end[&me].is_some());
    let leaked = r.leaked_kv.as_ref().expect("leaked_kv");
    assert_eq!((leaked.shm_files, leaked.shm_bytes), (Some(2), Some(15)));
    assert_eq!(
        (leaked.shm_arenas, leaked.shm_busy_slots),
        (Some(1), Some(0))
    );
    assert!(leaked.settled);
    assert_eq!(leaked.workers.len(), 2);
    assert_eq!(
        leaked.workers["named"],
        leaked.workers[&format!("{url}/metrics")]
    );
    assert_eq!(
        leaked.workers[&format!("{url}/metrics")],
        Some(kv::WorkerKv {
            kv_cache_usage_perc: Some(0.0),
            running: Some(0.0),
            waiting: Some(0.0),
            worker_in_flight: Some(0.0),
            ..kv::WorkerKv::default()
        })
    );

    // What the server received: streaming with usage, lengths within the context.
    let bodies = fake.bodies.lock().expect("lock").clone();
    assert_eq!(bodies.len(), 10);
    for b in &bodies {
        assert_eq!(b["stream"], true);
        assert_eq!(b["stream_options"]["include_usage"], true);
        assert_eq!(b["model"], "fake-model");
        let words = b["prompt"].as_str().expect("prompt").split(' ').count() as u64;
        let max = b["max_tokens"].as_u64().expect("max_tokens");
        assert!(max >= 1 && words + max <= 496, "{words} + {max}");
        assert!(
            words > 300,
            "a 1000-token prompt scaled, not cut to nothing: {words}"
        );
    }
    assert_eq!(
        r.prompt_tokens_sent + r.max_tokens_sent,
        bodies
            .iter()
            .map(|b| {
                b["prompt"].as_str().unwrap_or("").split(' ').count() as u64
                    + b["max_tokens"].as_u64().unwrap_or(0)
            })
            .sum::<u64>()
    );

    // The JSON line has every key the issue asks for.
    let v: Value = serde_json::from_str(&r.json_line()).expect("json line");
    for k in [
        "requests",
        "errors",
        "http_429",
        "http_5xx",
        "http_other",
        "timeouts",
        "transport",
        "client_dropped",
        "ttft_p50_ms",
        "ttft_p90_ms",
        "ttft_p99_ms",
        "tpot_p50_ms",
        "tpot_p90_ms",
        "tpot_p99_ms",
        "max_gap_p50_ms",
        "max_gap_p99_ms",
        "slo_share",
        "goodput_rps",
        "tok_s",
        "rss_mb_start",
        "rss_mb_end",
        "leaked_kv",
        "wall_s",
        "settings",
    ] {
        assert!(v.get(k).is_some(), "missing {k} in {v}");
    }
    assert!(!r.json_line().contains('\n'), "one line");
    for k in [
        "speedup",
        "seq_len",
        "max_in_flight",
        "request_timeout_s",
        "url",
        "trace",
    ] {
        assert!(v["settings"].get(k).is_some(), "missing settings.{k}");
    }
    assert_eq!(v["http_429"], 2);
    assert_eq!(v["leaked_kv"]["shm_files"], 2);

    // The KPIs: both metrics targets are this fake, so it counts twice as a
    // decode device; 35 prompt tokens (none cached) and 21 output tokens.
    let k = &r.kpis;
    assert_eq!(k.tokens_computed, 56);
    assert_eq!(k.model_flops_per_token, Some(1000.0));
    assert_eq!(k.devices["decode"]["amd"], 2);
    assert!(k.peak.cores >= 1);
    match (k.peak.flops, k.mfu) {
        (Some(p), Some(m)) => assert!((m - 1000.0 * k.tokens_computed_per_s / p).abs() < 1e-12),
        (None, m) => assert_eq!(m, None, "no peak, no MFU"),
        (Some(_), None) => panic!("a peak and FLOPs per token but no MFU"),
    }
    // Energy: a figure, or the reason there is none (this VM has no RAPL).
    assert!(k.energy_j.is_some() != k.energy_absent.is_some(), "{k:?}");
    for key in [
        "mfu",
        "peak",
        "tokens_per_joule",
        "devices",
        "model_flops_per_token",
    ] {
        assert!(v["kpis"].get(key).is_some(), "missing kpis.{key} in {v}");
    }
    assert!(v["kpis"]["peak"].get("clock_source").is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn arrivals_beyond_the_in_flight_bound_are_dropped_and_deadlines_count() {
    // Request 1 never answers and holds the only slot until its deadline;
    // the other arrivals (all within microseconds at this speedup) find no
    // slot and are not sent.
    let fake = Arc::new(Fake {
        hang_first: true,
        ..Fake::default()
    });
    let url = serve(fake.clone()).await;
    let trace = write_trace(5, "dropped");
    let opts = Options {
        trace: trace.clone(),
        url: Some(url),
        model: Some("m".into()),
        speedup: 1e6,
        max_in_flight: 1,
        request_timeout_s: 2.0,
        json: true,
        ..Options::default()
    };
    let r = rngd_bench_replay::launch(opts).await.expect("runs");
    let _ = std::fs::remove_file(&trace);
    assert_eq!(r.scheduled, 5);
    assert_eq!(r.requests, 1);
    assert_eq!(r.client_dropped, 4);
    assert_eq!(r.timeouts, 1);
    assert_eq!(r.errors, 1);
    assert_eq!(r.ok, 0);
    assert_eq!(
        fake.n.load(Ordering::SeqCst),
        1,
        "dropped arrivals are not sent"
    );
    assert!(r.leaked_kv.is_none(), "no metrics URL and no shm root");
    assert_eq!(r.slo_share, None);
    // No worker metrics: the device count says why it is empty.
    assert!(r.kpis.devices.is_empty());
    assert!(
        r.kpis
            .devices_absent
            .as_deref()
            .is_some_and(|w| w.contains("no worker metrics"))
    );
}

#[tokio::test]
async fn a_url_or_spawn_up_is_required() {
    let e = rngd_bench_replay::launch(Options::default())
        .await
        .expect_err("neither");
    assert!(e.to_string().contains("--url"), "{e}");
    let e = rngd_bench_replay::launch(Options {
        url: Some("http://127.0.0.1:1".into()),
        trace: "/nonexistent/trace.csv".into(),
        ..Options::default()
    })
    .await
    .expect_err("no file");
    assert!(e.to_string().contains("/nonexistent/trace.csv"), "{e}");
}
