//! A small run of the benchmark per transport: the report is filled in and
//! the bytes came back exact (speed is only reported, never asserted).

use rngd_bench_kv::{Options, run};

fn args(transport: &str) -> Options {
    Options {
        transport: transport.into(),
        in_flight: 2,
        requests: 2,
        rounds: 1,
        no_crc: false,
        tls: false,
        prompt_tokens: None,
        prompt_trace: None,
        json: true,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_run_reports_byte_exact_figures() {
    let r = run(args("shm")).await.unwrap();
    assert_eq!(r.transport, "shm");
    assert_eq!(r.baseline, "memcpy");
    assert_eq!(r.bytes_per_request, 67_108_864);
    assert!(r.byte_exact);
    assert!(r.gbps_median > 0.0 && r.baseline_gbps_median > 0.0);
    assert!((r.ratio_vs_baseline - r.gbps_median / r.baseline_gbps_median).abs() < 1e-9);
    // The push path and the warm memcpy, measured in the same rounds.
    let push = r.push_gbps_median.expect("the push path measured");
    assert!(push > 0.0);
    let warm = r.warm_memcpy_gbps_median.expect("the warm memcpy measured");
    let ratio = r.ratio_vs_warm_memcpy.expect("ratio_vs_warm_memcpy");
    assert!((ratio - r.gbps_median / warm).abs() < 1e-9);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_run_reports_byte_exact_figures() {
    let r = run(args("tcp")).await.unwrap();
    assert_eq!(r.baseline, "raw_tcp_loopback");
    assert!(r.byte_exact && r.crc);
    assert!(r.ms_per_request_median > 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nixl_ucx_run_reports_byte_exact_figures_and_tcp_from_the_same_run() {
    let r = run(args("nixl-ucx")).await.unwrap();
    assert_eq!(r.transport, "nixl-ucx");
    assert_eq!(r.baseline, "raw_tcp_loopback");
    assert!(r.byte_exact, "nixl-ucx and tcp both byte-exact");
    let tcp = r.tcp_gbps_median.expect("tcp measured in the same run");
    assert!(tcp > 0.0 && r.gbps_median > 0.0);
    let ratio = r.ratio_vs_tcp.expect("ratio_vs_tcp");
    assert!((ratio - r.gbps_median / tcp).abs() < 1e-9);
    let tcp_only = run(args("tcp")).await.unwrap();
    assert!(
        tcp_only.ratio_vs_tcp.is_none(),
        "only nixl-ucx compares with tcp"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_over_tls_reports_plaintext_tcp_from_the_same_run() {
    let r = run(Options {
        tls: true,
        ..args("tcp")
    })
    .await
    .unwrap();
    assert!(r.tls && r.byte_exact, "TLS and plaintext both byte-exact");
    let plain = r.tcp_gbps_median.expect("plaintext tcp in the same run");
    assert!(plain > 0.0 && r.gbps_median > 0.0);
    assert!((r.ratio_vs_tcp.unwrap() - r.gbps_median / plain).abs() < 1e-9);
    let err = run(Options {
        tls: true,
        ..args("shm")
    })
    .await
    .unwrap_err();
    assert!(err.to_string().contains("--tls"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_trimmed_wire_is_measured_next_to_the_s_wide_one() {
    for transport in ["shm", "tcp"] {
        let r = run(Options {
            prompt_tokens: Some(100),
            ..args(transport)
        })
        .await
        .unwrap();
        assert!(r.byte_exact, "{transport}");
        // 64 blobs of 8 heads × 128 dims × 100 tokens × 2 bytes.
        assert_eq!(r.trimmed_bytes_per_request, Some(64 * 8 * 128 * 100 * 2));
        let t = r.trimmed_ms_per_request_median.unwrap();
        assert!(t > 0.0);
        assert!((r.trimmed_vs_full_time.unwrap() - t / r.ms_per_request_median).abs() < 1e-9);
    }
    // Prompt lengths from a trace: 100 fits; 1000 + 24 is scaled to 500.
    let dir = tempfile::tempdir().unwrap();
    let csv = dir.path().join("trace.csv");
    std::fs::write(
        &csv,
        "TIMESTAMP,ContextTokens,GeneratedTokens\n\
         2023-11-16 18:15:46.6805900,100,20\n\
         2023-11-16 18:15:50.9951690,1000,24\n",
    )
    .unwrap();
    let r = run(Options {
        prompt_trace: Some(csv),
        ..args("tcp")
    })
    .await
    .unwrap();
    assert!(r.byte_exact);
    assert_eq!(r.trace_prompt_tokens_median, Some(300.0));
    assert_eq!(
        r.trimmed_bytes_per_request,
        Some(64 * 8 * 128 * 2 * (100 + 500) / 2)
    );
    let err = run(Options {
        prompt_tokens: Some(513),
        ..args("shm")
    })
    .await
    .unwrap_err();
    assert!(err.to_string().contains("--prompt-tokens"), "{err}");
}

#[tokio::test]
async fn unknown_transport_is_an_argument_error() {
    let err = run(args("pigeon")).await.unwrap_err();
    assert!(err.to_string().contains("pigeon"), "{err}");
}
