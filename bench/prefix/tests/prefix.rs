//! Tests of `rngd-pd-bench prefix`: the prefix lengths (whole blocks), the
//! memory of a block, the random prompts, a run against a fake OpenAI
//! server (axum on 127.0.0.1:0) with a tiny prefix cache of its own, which
//! checks the request pattern (each warm request is the prompt's prefix,
//! `cached0`'s shares nothing, `cold` has none), and a short run against a
//! real solo worker (`rngd-pd worker --port 0`: `$RNGD_PD_BIN` or
//! `$CARGO_TARGET_DIR/release/rngd-pd`, with the model in the cache, as
//! `tests/run` sets up). No timing is asserted.

use std::sync::{Arc, Mutex};

use axum::Router;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use rngd_bench_prefix::{Ids, Options, TOKEN_HI, TOKEN_LO, block_bytes, prefix_len};
use serde_json::Value;

#[test]
fn prefixes_are_whole_blocks_and_a_block_is_360_kib() {
    assert_eq!(prefix_len(480, 90, 16), 432);
    assert_eq!(prefix_len(480, 50, 16), 240);
    assert_eq!(prefix_len(480, 0, 16), 0);
    assert_eq!(prefix_len(480, 100, 16), 480);
    assert_eq!(prefix_len(100, 90, 16), 80, "90 rounded down to 5 blocks");
    assert_eq!(prefix_len(100, 10, 16), 0);
    assert_eq!(prefix_len(480, 90, 32), 416);
    // SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64, 16 positions, bf16.
    assert_eq!(block_bytes(30, 3, 64, 16), 368_640);
    assert_eq!(block_bytes(30, 3, 64, 16), 360 * 1024);
    assert_eq!((256u64 << 20) / block_bytes(30, 3, 64, 16), 728);
}

#[test]
fn prompts_are_ordinary_ids_and_differ() {
    let mut ids = Ids::new(1);
    let a = ids.prompt(480);
    let b = ids.prompt(480);
    assert_eq!(a.len(), 480);
    assert!(a.iter().chain(&b).all(|t| (TOKEN_LO..TOKEN_HI).contains(t)));
    assert_ne!(a[..16], b[..16], "fresh prompts share no first block");
    assert_eq!(Ids::new(1).prompt(480), a, "a seed gives the same ids");
}

#[derive(Default)]
struct Fake {
    prompts: Mutex<Vec<Vec<u32>>>,
}

/// Streams one token; `cached_tokens` is the whole blocks of 16 shared with
/// an earlier prompt, at most all but the last token's block.
async fn completions(State(f): State<Arc<Fake>>, body: axum::body::Bytes) -> Response {
    let v: Value = serde_json::from_slice(&body).expect("json body");
    assert_eq!(v["max_tokens"], 1);
    assert_eq!(v["stream"], true);
    let prompt: Vec<u32> = serde_json::from_value(v["prompt"].clone()).expect("token ids");
    let mut seen = f.prompts.lock().expect("lock");
    let common = seen
        .iter()
        .map(|p| p.iter().zip(&prompt).take_while(|(a, b)| a == b).count())
        .max()
        .unwrap_or(0);
    let cached = common.min(prompt.len() - 1) / 16 * 16;
    let n = prompt.len();
    seen.push(prompt);
    let chunk = serde_json::json!({"choices": [{"index": 0, "text": " x", "finish_reason": null}]});
    let usage = serde_json::json!({"choices": [], "usage": {"prompt_tokens": n, "completion_tokens": 1,
        "total_tokens": n + 1, "prompt_tokens_details": {"cached_tokens": cached}}});
    let sse = format!("data: {chunk}\n\ndata: {usage}\n\ndata: [DONE]\n\n");
    ([("content-type", "text/event-stream")], sse).into_response()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_against_a_fake_server_sends_the_pattern() {
    let fake = Arc::new(Fake::default());
    let app = Router::new()
        .route("/v1/completions", post(completions))
        .route(
            "/v1/models",
            get(|| async { axum::Json(serde_json::json!({"data": [{"id": "fake"}]})) }),
        )
        .route(
            "/metrics",
            get(|| async {
                "vllm:cache_config_info{model_name=\"fake\",block_size=\"16\",num_gpu_blocks=\"728\"} 1\n\
                 vllm:prefix_cache_queries_total{model_name=\"fake\"} 10\n\
                 vllm:prefix_cache_hits_total{model_name=\"fake\"} 5\n"
            }),
        )
        .with_state(fake.clone());
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", l.local_addr().expect("addr"));
    tokio::spawn(async move { axum::serve(l, app).await.expect("serve") });

    let r = rngd_bench_prefix::launch(Options {
        url: Some(url),
        rounds: 3,
        warmup: 1,
        seed: Some(42),
        json: true,
        ..Options::default()
    })
    .await
    .expect("runs");

    // 1 warm-up + 3 rounds × (cached0: 2, cached50: 2, cached90: 2, cold: 1).
    let prompts = fake.prompts.lock().expect("lock").clone();
    assert_eq!(prompts.len(), 1 + 3 * 7);
    assert_eq!(r.model, "fake");
    assert_eq!(r.block_size, 16, "from the metrics");
    assert_eq!(r.seed, 42);
    assert_eq!(
        r.variants.keys().collect::<Vec<_>>(),
        ["cached0", "cached50", "cached90", "cold"]
    );
    for (name, cached, warmed) in [
        ("cached0", 0, 432),
        ("cached50", 240, 240),
        ("cached90", 432, 432),
        ("cold", 0, 0),
    ] {
        let v = &r.variants[name];
        assert_eq!(v.warmed_tokens, warmed, "{name}");
        assert_eq!(v.ttft_ms.len(), 3, "{name}");
        assert_eq!(v.cached_tokens, vec![Some(cached); 3], "{name}");
        assert!(v.ttft_p50_ms.is_some() && v.ttft_p90_ms.is_some());
    }
    // Every timed prompt is 480 ids; every warm request is a whole-block
    // prefix of the prompt right after it, or (cached0) shares nothing.
    for w in prompts.windows(2) {
        if w[0].len() < 480 {
            assert_eq!(w[1].len(), 480);
            let shared = w[0].iter().zip(&w[1]).take_while(|(a, b)| a == b).count();
            assert!(shared == w[0].len() || shared < 16, "{shared}");
        }
    }
    assert!(
        prompts
            .iter()
            .flatten()
            .all(|t| (TOKEN_LO..TOKEN_HI).contains(t))
    );
    for k in ["cached0_vs_cold", "cached50_vs_cold", "cached90_vs_cold"] {
        assert!(r.ratios[k].is_some(), "{k}");
        assert!(r.ratios_p90[k].is_some(), "{k}");
    }
    assert!(r.meets_target.is_some());
    let w = r.worker.expect("worker metrics");
    assert_eq!(
        (
            w.prefix_cache_queries_total,
            w.prefix_cache_hits_total,
            w.num_gpu_blocks
        ),
        (Some(10.0), Some(5.0), Some(728))
    );
    assert_eq!(r.block_memory.bytes, 368_640);
    assert_eq!(r.block_memory.matches_worker, Some(true));
    let v: Value = serde_json::from_str(&r.json_line()).expect("json");
    assert!(v["ratios"]["cached90_vs_cold"].is_number());
    assert!(!r.json_line().contains('\n'));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_run_against_a_real_worker() {
    // One round, no warm-up, 96-token prompts: 7 small prefills.
    let r = rngd_bench_prefix::launch(Options {
        prompt_tokens: 96,
        rounds: 1,
        warmup: 0,
        worker_args: vec!["--threads".into(), "2".into()],
        worker_timeout_s: 120.0,
        json: true,
        ..Options::default()
    })
    .await
    .expect("a solo worker runs (needs $RNGD_PD_BIN or $CARGO_TARGET_DIR/release/rngd-pd and `rngd-pd model fetch`)");
    assert!(r.spawned_worker);
    assert_eq!(r.block_size, 16, "the worker's default block");
    // 90% of 96 = 86.4 → 80 (5 blocks); 50% → 48; the worker computes at
    // least the last block, which 80 of 96 leaves.
    for (name, cached) in [
        ("cached0", 0),
        ("cached50", 48),
        ("cached90", 80),
        ("cold", 0),
    ] {
        assert_eq!(r.variants[name].cached_tokens, vec![Some(cached)], "{name}");
    }
    let w = r.worker.expect("worker metrics");
    // Queried: 7 prompts (80 + 96 + 48 + 96 + 80 + 96 + 96); hit: 48 + 80.
    assert_eq!(w.prefix_cache_queries_total, Some(592.0));
    assert_eq!(w.prefix_cache_hits_total, Some(128.0));
    assert_eq!(w.block_size, Some(16));
    assert_eq!(
        r.block_memory.matches_worker,
        Some(true),
        "{:?}",
        r.block_memory
    );
}
