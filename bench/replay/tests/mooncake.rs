//! Tests of the Mooncake path of the replay: the JSON-lines parser (a bad
//! line is an error naming it), the block → token ids mapping, the prompt
//! cut (whole leading blocks), the reuse share on a hand-made trace with a
//! known answer, the worker's listening line and prefix metrics, and a
//! whole run against a fake OpenAI server (axum on 127.0.0.1:0) that
//! records the prompts and reports `cached_tokens`.

use std::sync::{Arc, Mutex};

use axum::Router;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use rngd_bench_replay::metrics::PrefixMetrics;
use rngd_bench_replay::mooncake::{self, Row};
use rngd_bench_replay::{Options, TraceFormat, worker};
use serde_json::Value;

fn row(ts: u64, input: u32, output: u32, ids: &[u64]) -> Row {
    Row {
        timestamp_ms: ts,
        input_length: input,
        output_length: output,
        hash_ids: ids.to_vec(),
    }
}

#[test]
fn the_jsonl_parses_and_a_bad_line_is_named() {
    let text = "{\"timestamp\": 0, \"input_length\": 6758, \"output_length\": 500, \"hash_ids\": [0, 1, 2]}\n\
        \n\
        {\"timestamp\": 3000, \"input_length\": 600, \"output_length\": 3, \"hash_ids\": [0, 46]}\n";
    let rows = mooncake::parse(text).expect("parses");
    assert_eq!(rows.len(), 2, "the blank line is skipped");
    assert_eq!(rows[0], row(0, 6758, 500, &[0, 1, 2]));
    assert_eq!(rows[1].timestamp_ms, 3000);

    for (bad, what) in [
        (
            "{\"timestamp\": 0, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [0]}\nnot json\n",
            "line 2",
        ),
        (
            "{\"timestamp\": 0, \"input_length\": 1, \"hash_ids\": [0]}\n",
            "output_length",
        ),
        (
            "{\"timestamp\": 0, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [0]}\n\n{\"timestamp\": 1, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": []}\n",
            "line 3",
        ),
        (
            "{\"timestamp\": 0, \"input_length\": -1, \"output_length\": 1, \"hash_ids\": [0]}\n",
            "line 1",
        ),
        ("", "empty"),
    ] {
        let e = mooncake::parse(bad).expect_err(bad);
        assert!(e.to_string().contains(what), "{bad:?}: {e}");
    }
}

#[test]
fn a_block_id_always_gives_the_same_ordinary_ids() {
    let a = mooncake::block_ids(42, 16);
    assert_eq!(a.len(), 16);
    assert_eq!(a, mooncake::block_ids(42, 16), "same id, same ids");
    assert!(
        a.iter()
            .all(|t| (mooncake::TOKEN_LO..mooncake::TOKEN_HI).contains(t)),
        "{a:?}"
    );
    // Different ids differ, neighbours and ids a digit apart included.
    let ids: Vec<u64> = (0..2000)
        .chain([39_000, 39_001, 78_000, 1_000_000, 12_345_678])
        .collect();
    let mut seen = std::collections::HashSet::new();
    for id in &ids {
        assert!(
            seen.insert(mooncake::block_ids(*id, 16)),
            "id {id} repeats a run"
        );
    }
    // Shorter runs are prefixes of longer ones.
    assert_eq!(mooncake::block_ids(7, 4), mooncake::block_ids(7, 16)[..4]);
    // A prompt is the blocks' runs in order, cut to its length.
    let p = mooncake::prompt_ids(&[5, 9, 11], 40, 16);
    assert_eq!(p.len(), 40);
    assert_eq!(p[..16], mooncake::block_ids(5, 16)[..]);
    assert_eq!(p[16..32], mooncake::block_ids(9, 16)[..]);
    assert_eq!(p[32..], mooncake::block_ids(11, 16)[..8]);
}

#[test]
fn prompts_are_cut_to_whole_leading_blocks() {
    // Fits: input 6758 → ceil(6758/32) = 212 tokens (13 blocks + 4), output
    // 500 → 16.
    let c = mooncake::cut(&row(0, 6758, 500, &[0; 14]), 16, 496);
    assert_eq!(
        (c.prompt_tokens, c.max_tokens, c.blocks, c.full_blocks),
        (212, 16, 14, 13)
    );
    // Too long: 23141 → 724 tokens; 453 → 15; room 481 → 30 whole blocks.
    let ids: Vec<u64> = (0..46).collect();
    let c = mooncake::cut(&row(0, 23141, 453, &ids), 16, 496);
    assert_eq!((c.max_tokens, c.prompt_tokens), (15, 480));
    assert_eq!((c.blocks, c.full_blocks), (30, 30));
    assert!(c.prompt_tokens + c.max_tokens <= 496);
    assert_eq!(c.prompt_tokens % 16, 0, "cut at a block boundary");
    let planned = mooncake::schedule(&[row(0, 23141, 453, &ids)], 0, None, None, 1.0, 16, 496);
    assert_eq!(planned[0].full_blocks, ids[..30]);
    assert_eq!(planned[0].prompt, mooncake::prompt_ids(&ids, 480, 16));
    // A huge output leaves at least a block of prompt; a zero one asks for 1.
    let c = mooncake::cut(&row(0, 9000, 100_000, &ids), 16, 496);
    assert_eq!((c.max_tokens, c.prompt_tokens), (480, 16));
    let c = mooncake::cut(&row(0, 100, 0, &[1]), 16, 496);
    assert_eq!((c.max_tokens, c.prompt_tokens, c.full_blocks), (1, 4, 0));
    for (input, output, n) in [(1, 1, 1), (512, 512, 1), (40_000, 2000, 79), (5000, 5, 10)] {
        let ids: Vec<u64> = (0..n).collect();
        let c = mooncake::cut(&row(0, input, output, &ids), 16, 496);
        assert!(c.prompt_tokens >= 1 && c.max_tokens >= 1);
        assert!(c.prompt_tokens + c.max_tokens <= 496, "{input} {output}");
        assert!(c.blocks <= ids.len());
    }
}

#[test]
fn the_schedule_divides_time_and_honours_its_bounds() {
    let rows = vec![
        row(1000, 64, 32, &[1, 2]),
        row(3000, 64, 32, &[1, 3]),
        row(61_000, 64, 32, &[4, 5]),
    ];
    let s = mooncake::schedule(&rows, 0, None, None, 2.0, 16, 496);
    assert_eq!(s.len(), 3);
    assert_eq!(s[1].offset.as_millis(), 1000);
    assert_eq!(s[2].offset.as_millis(), 30_000);
    assert_eq!(s[0].cut.prompt_tokens, 2);
    let s = mooncake::schedule(&rows, 1, Some(1), None, 1.0, 16, 496);
    assert_eq!((s.len(), s[0].row, s[0].offset.as_millis()), (1, 1, 0));
    let s = mooncake::schedule(
        &rows,
        0,
        None,
        Some(std::time::Duration::from_secs(10)),
        1.0,
        16,
        496,
    );
    assert_eq!(s.len(), 2);
}

#[test]
fn the_history_is_the_latest_earlier_turn_of_each_conversation_in_the_window() {
    // 16-token blocks; 512 trace tokens a block, so `input_length` n × 512
    // is n full blocks. Block 0 is shared by every row, as in the trace.
    let rows = vec![
        row(0, 3 * 512, 32, &[0, 1, 2]),          // A, turn 1
        row(1, 2 * 512, 1024, &[0, 3]),           // B, turn 1 (long answer)
        row(2, 4 * 512, 32, &[0, 1, 2, 4]),       // A, turn 2
        row(3, 2 * 512, 32, &[0, 5]),             // a stranger
        row(4, 5 * 512, 32, &[0, 1, 2, 4, 6]),    // window: A, turn 3
        row(5, 3 * 512, 32, &[0, 3, 7]),          // window: B, turn 2
        row(6, 2 * 512, 32, &[0, 8]),             // window: only block 0 shared
        row(7, 6 * 512, 32, &[0, 1, 2, 4, 6, 9]), // window: A, turn 4
    ];
    let window = mooncake::schedule(&rows, 4, None, None, 1.0, 16, 496);
    assert_eq!(window.len(), 4);
    let h = mooncake::history(&rows, &window, 16, 496);
    // A's turns 3 and 4 both continue row 2 (the deepest shared chain before
    // the window; row 4 is in the window itself); B's turn 2 continues row
    // 1; row 6 shares only block 0 and brings none; each row once, in order.
    assert_eq!(h.iter().map(|p| p.row).collect::<Vec<_>>(), [1, 2]);
    assert!(h.iter().all(|p| p.offset.is_zero()));
    assert_eq!(h[1].full_blocks, [0, 1, 2, 4]);
    assert_eq!(h[1].prompt, mooncake::prompt_ids(&[0, 1, 2, 4], 64, 16));
    // B's turn 1 asked for 32 tokens (1024 × 16 / 512): a history answer
    // is kept to HISTORY_MAX_TOKENS.
    assert_eq!(h[0].cut.max_tokens, mooncake::HISTORY_MAX_TOKENS);
    assert_eq!(h[1].cut.max_tokens, 1);
    // A window from row 0 has no history.
    let from0 = mooncake::schedule(&rows, 0, Some(3), None, 1.0, 16, 496);
    assert!(mooncake::history(&rows, &from0, 16, 496).is_empty());
}

#[test]
fn the_reuse_share_of_a_hand_made_trace() {
    // Blocks of 4 tokens. Prompts (full blocks, prompt tokens):
    //   1: [a b c]   12 tokens, nothing seen             -> 0
    //   2: [a b d]   12, a b seen                        -> 8
    //   3: [x b]      8, b seen only after a: no hit     -> 0
    //   4: [a b c e] 18 (a partial block after e), a b c -> 12
    //   5: [a b c]   12, all seen                        -> 12 (capped: 8)
    //   6: []         2 tokens, no full block            -> 0
    let (a, b, c, d, e, x) = (1, 2, 3, 4, 5, 6);
    let reqs: Vec<(Vec<u64>, u32)> = vec![
        (vec![a, b, c], 12),
        (vec![a, b, d], 12),
        (vec![x, b], 8),
        (vec![a, b, c, e], 18),
        (vec![a, b, c], 12),
        (vec![], 2),
    ];
    let r = mooncake::reuse(reqs.iter().map(|(b, n)| (b.as_slice(), *n)), 4);
    assert_eq!(r.prompt_tokens, 64);
    assert_eq!(r.reused_tokens, 8 + 12 + 12);
    assert_eq!(r.share(), Some(32.0 / 64.0));
    // Capped (at least the last token and 8 rows computed): a 12-token
    // prompt reuses at most 1 block (12 - 4 = 8 rows), so requests 2 and 5
    // give 4 each; the 18-token one at most 2 (18 - 8 = 10 rows): 8.
    assert_eq!(r.reused_tokens_capped, 4 + 8 + 4);
    // Distinct chains: a, ab, abc, abd, x, xb, abce.
    assert_eq!(r.unique_blocks, 7);
    assert_eq!(mooncake::reuse(std::iter::empty(), 16).share(), None);

    // A cache of 3 blocks, least recently used out (a chain's root touched
    // last): 1 holds abc ab a; 2 reuses a ab (8), holds abd ab a (abc out);
    // 3 reuses nothing, holds x xb a (abd and ab out); 4 reuses a only (4),
    // holds abc ab a (its first 3; x and xb out); 5 reuses all three (12).
    assert_eq!(
        mooncake::reused_with_lru(reqs.iter().map(|(b, n)| (b.as_slice(), *n)), 4, 3),
        8 + 4 + 12
    );
    // A cache as large as the trace is the infinite one.
    assert_eq!(
        mooncake::reused_with_lru(reqs.iter().map(|(b, n)| (b.as_slice(), *n)), 4, 100),
        r.reused_tokens
    );

    // With 16-token blocks the engine's cap is only the last block.
    let same: Vec<u64> = vec![9, 8, 7];
    let r = mooncake::reuse([(same.as_slice(), 48), (same.as_slice(), 48)], 16);
    assert_eq!((r.reused_tokens, r.reused_tokens_capped), (48, 32));
}

#[test]
fn worker_lines_and_prefix_metrics_parse() {
    assert_eq!(
        worker::listening_url("rngd-pd worker listening on http://127.0.0.1:4242\n"),
        Some("http://127.0.0.1:4242".into())
    );
    assert_eq!(worker::listening_url("loading"), None);
    assert_eq!(
        worker::listening_url("rngd-pd worker listening on http://"),
        None
    );
    let text = "# HELP vllm:cache_config_info Cache configuration\n\
        vllm:cache_config_info{model_name=\"m\",block_size=\"16\",num_gpu_blocks=\"728\"} 1\n\
        vllm:prefix_cache_queries_total{model_name=\"m\"} 960\n\
        vllm:prefix_cache_hits_total{model_name=\"m\"} 432\n";
    let m = PrefixMetrics::parse(text);
    assert_eq!(
        m,
        PrefixMetrics {
            prefix_cache_queries_total: Some(960.0),
            prefix_cache_hits_total: Some(432.0),
            block_size: Some(16),
            num_gpu_blocks: Some(728),
        }
    );
    let before = PrefixMetrics {
        prefix_cache_queries_total: Some(480.0),
        prefix_cache_hits_total: Some(0.0),
        ..PrefixMetrics::default()
    };
    assert_eq!(m.hit_share_since(&before), Some(0.9));
    assert_eq!(PrefixMetrics::parse("other 1\n"), PrefixMetrics::default());
    assert_eq!(
        TraceFormat::Auto.of(std::path::Path::new("a/t.jsonl")),
        TraceFormat::Mooncake
    );
    assert_eq!(
        TraceFormat::Auto.of(std::path::Path::new("a/t.csv")),
        TraceFormat::Azure
    );
    assert_eq!(
        TraceFormat::Azure.of(std::path::Path::new("t.jsonl")),
        TraceFormat::Azure
    );
}

// ---- a whole run against a fake server --------------------------------------

#[derive(Default)]
struct Fake {
    prompts: Mutex<Vec<Vec<u32>>>,
}

/// Answers with the prompt's length as `prompt_tokens` and, as
/// `cached_tokens`, the whole blocks of 16 it shares with an earlier prompt
/// (at most all but the last token's block): a tiny prefix cache.
async fn completions(State(f): State<Arc<Fake>>, body: axum::body::Bytes) -> Response {
    let v: Value = serde_json::from_slice(&body).expect("json body");
    let prompt: Vec<u32> = serde_json::from_value(v["prompt"].clone()).expect("token ids");
    let mut seen = f.prompts.lock().expect("lock");
    let common = seen
        .iter()
        .map(|p| p.iter().zip(&prompt).take_while(|(a, b)| a == b).count())
        .max()
        .unwrap_or(0);
    let cached = (common.min(prompt.len() - 1)) / 16 * 16;
    let n = prompt.len();
    seen.push(prompt);
    let chunk = serde_json::json!({"choices": [{"index": 0, "text": " x", "finish_reason": null}]});
    let usage = serde_json::json!({"choices": [], "usage": {"prompt_tokens": n, "completion_tokens": 1,
        "total_tokens": n + 1, "prompt_tokens_details": {"cached_tokens": cached}}});
    let sse = format!("data: {chunk}\n\ndata: {usage}\n\ndata: [DONE]\n\n");
    ([("content-type", "text/event-stream")], sse).into_response()
}

/// Serves `app` on 127.0.0.1:0 and returns its base URL.
async fn serve(app: Router) -> String {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", l.local_addr().expect("addr"));
    tokio::spawn(async move { axum::serve(l, app).await.expect("serve") });
    url
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mooncake_run_sends_token_ids_and_reports_both_shares() {
    let fake = Arc::new(Fake::default());
    let app = Router::new()
        .route("/v1/completions", post(completions))
        .route(
            "/metrics",
            get(|| async {
                "vllm:cache_config_info{model_name=\"m\",block_size=\"16\",num_gpu_blocks=\"9\"} 1\n\
                 vllm:prefix_cache_queries_total{model_name=\"m\"} 0\n\
                 vllm:prefix_cache_hits_total{model_name=\"m\"} 0\n"
            }),
        )
        .with_state(fake.clone());
    let url = serve(app).await;

    // Three requests 10 ms apart: two turns of one conversation, then a
    // stranger. 1024 tokens = 2 blocks = 32 ids; 1536 = 3 blocks = 48.
    let trace = "{\"timestamp\": 0, \"input_length\": 1024, \"output_length\": 32, \"hash_ids\": [7, 8]}\n\
        {\"timestamp\": 10, \"input_length\": 1536, \"output_length\": 32, \"hash_ids\": [7, 8, 9]}\n\
        {\"timestamp\": 20, \"input_length\": 1024, \"output_length\": 32, \"hash_ids\": [5, 8]}\n";
    let path =
        std::env::temp_dir().join(format!("rngd_mooncake_test_{}.jsonl", std::process::id()));
    std::fs::write(&path, trace).expect("write trace");
    let r = rngd_bench_replay::launch(Options {
        trace: path.clone(),
        url: Some(url),
        model: Some("m".into()),
        // One at a time, so the second turn arrives after the first is answered.
        speedup: 0.1,
        json: true,
        ..Options::default()
    })
    .await
    .expect("runs");
    let _ = std::fs::remove_file(&path);

    assert_eq!((r.requests, r.ok), (3, 3));
    assert_eq!(r.settings.trace_format, TraceFormat::Mooncake);
    let prompts = fake.prompts.lock().expect("lock").clone();
    assert_eq!(prompts.len(), 3);
    assert_eq!(prompts[0], mooncake::prompt_ids(&[7, 8], 32, 16));
    assert_eq!(prompts[1], mooncake::prompt_ids(&[7, 8, 9], 48, 16));
    assert_eq!(prompts[2], mooncake::prompt_ids(&[5, 8], 32, 16));
    let p = r.prefix.clone().expect("prefix section");
    assert_eq!(p.trace_prompt_tokens, 112);
    assert_eq!(p.trace_reused_tokens, 32, "the second turn's two blocks");
    assert_eq!(p.trace_unique_blocks, 5, "7, 7-8, 7-8-9, 5, 5-8");
    assert_eq!((p.served_prompt_tokens, p.served_cached_tokens), (112, 32));
    assert_eq!(p.served_cached_share, Some(32.0 / 112.0));
    assert_eq!(p.served_usage_with_cached, 3);
    assert_eq!(p.worker_end.and_then(|m| m.num_gpu_blocks), Some(9));
    let v: Value = serde_json::from_str(&r.json_line()).expect("json");
    assert!(v["prefix"]["trace_reuse_share"].is_number());
    assert_eq!(v["settings"]["block_tokens"], 16);
    assert_eq!(p.history_requests, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_window_with_history_sends_the_earlier_turn_first_and_counts_only_the_window() {
    let fake = Arc::new(Fake::default());
    let app = Router::new()
        .route("/v1/completions", post(completions))
        .with_state(fake.clone());
    let url = serve(app).await;

    // Rows 0 and 1 come before the window (--skip 2); row 2 continues row
    // 0's conversation, row 1 is another one.
    let trace = "{\"timestamp\": 0, \"input_length\": 1024, \"output_length\": 32, \"hash_ids\": [7, 8]}\n\
        {\"timestamp\": 10, \"input_length\": 1024, \"output_length\": 32, \"hash_ids\": [5, 8]}\n\
        {\"timestamp\": 20, \"input_length\": 1536, \"output_length\": 32, \"hash_ids\": [7, 8, 9]}\n";
    let path = std::env::temp_dir().join(format!(
        "rngd_mooncake_history_test_{}.jsonl",
        std::process::id()
    ));
    std::fs::write(&path, trace).expect("write trace");
    let opts = Options {
        trace: path.clone(),
        url: Some(url),
        model: Some("m".into()),
        skip: 2,
        history: true,
        json: true,
        ..Options::default()
    };
    let r = rngd_bench_replay::launch(opts.clone()).await.expect("runs");

    let prompts = fake.prompts.lock().expect("lock").clone();
    assert_eq!(
        prompts,
        [
            mooncake::prompt_ids(&[7, 8], 32, 16),
            mooncake::prompt_ids(&[7, 8, 9], 48, 16)
        ],
        "the earlier turn first, then the window; the other conversation never"
    );
    // Only the window is timed and counted.
    assert_eq!((r.requests, r.ok), (1, 1));
    let p = r.prefix.clone().expect("prefix section");
    assert_eq!(
        (
            p.history_requests,
            p.history_errors,
            p.history_prompt_tokens
        ),
        (1, 0, 32)
    );
    assert_eq!(p.trace_prompt_tokens, 48);
    assert_eq!(
        p.trace_reused_tokens, 32,
        "the history's blocks count as sent"
    );
    assert_eq!((p.served_prompt_tokens, p.served_cached_tokens), (48, 32));
    assert!(r.settings.history);

    // The Azure trace names no conversation: --history is refused.
    let csv = path.with_extension("csv");
    std::fs::write(
        &csv,
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n",
    )
    .expect("write csv");
    let e = rngd_bench_replay::launch(Options {
        trace: csv.clone(),
        ..opts
    })
    .await
    .expect_err("refused");
    let _ = std::fs::remove_file(&path);
    let _ = std::fs::remove_file(&csv);
    assert!(e.to_string().contains("--history"), "{e}");
}
