//! Packed prefills: under a per-iteration token budget, prefills waiting
//! together join one forward (beside the prefill in progress and the
//! decode step) when the scheduler mixes, that is when every projection
//! takes the int8 kernel. Checked by what each engine iteration computed (a
//! lockstep observer, not timing): a burst of short prompts is one
//! iteration; the budget's room counts only the rows the prefix cache does
//! not hold and stops packing at the first prompt that does not fit, in
//! arrival order; without a budget, or on the f32 GEMM, nothing packs. Every
//! packed prefill equals the same prompt prefilled alone bit for bit (first
//! token, log-probabilities, every KV value), and the stream running beside
//! them sees no different bit, on the tiny and on the real model.

mod common;

use common::lockstep::Lockstep;
use common::{byte_prompt, logprob_params, next_token, no_prefix_cache, same_prefill, tiny_on};
use rngd_engine::cpu::{CpuEngine, CpuEngineOptions, MAX_PACKED_PREFILLS, PrefillProjections};
use rngd_engine::prefix::PrefixCacheOptions;
use rngd_engine::{Engine, Prefilled, SamplingParams, TokenLogprobs};

type Tokens = Vec<(u32, Option<TokenLogprobs>)>;

/// Every token of a stream of `params.max_tokens` tokens on `prompt`.
async fn whole_stream(engine: &CpuEngine, prompt: &[u32], params: &SamplingParams) -> Tokens {
    let mut rx = engine.generate(prompt, params).await.unwrap();
    let mut got = Vec::new();
    while let Some(t) = next_token(&mut rx).await {
        got.push(t);
    }
    got
}

/// On `engine`, with one stream running on `stream` (its first token
/// already out), the four `prompts` submitted together: their prefills, the
/// tokens each engine iteration computed from then on (the stream's own
/// steps, one token each, left out), and the whole stream.
async fn burst(
    engine: &CpuEngine,
    stream: &[u32],
    prompts: &[Vec<u32>; 4],
) -> (Vec<Prefilled>, Vec<usize>, Tokens) {
    let params = logprob_params(60);
    let (gate, _release) = Lockstep::attach(engine);
    let mut rx = gate.pump(engine.generate(stream, &params)).await.unwrap();
    let mut got = vec![gate.pump(next_token(&mut rx)).await.unwrap()];
    let from = gate.sizes().len();
    let one = logprob_params(1);
    let (a, b, c, d) = gate
        .pump(async {
            // Polled in order, so queued in order, while the engine is
            // held after an iteration.
            tokio::join!(
                engine.prefill(&prompts[0], &one),
                engine.prefill(&prompts[1], &one),
                engine.prefill(&prompts[2], &one),
                engine.prefill(&prompts[3], &one),
            )
        })
        .await;
    // The iteration that answered is observed after its decode step: past
    // the tokens sent so far, the second token to come is the next
    // iteration's at the earliest, so it was.
    while let Ok(ev) = rx.try_recv() {
        if let rngd_engine::GenEvent::Token { id, logprobs, .. } = ev {
            got.push((id, logprobs));
        }
    }
    for _ in 0..2 {
        got.push(gate.pump(next_token(&mut rx)).await.unwrap());
    }
    let sizes = gate.sizes()[from..]
        .iter()
        .copied()
        .filter(|&n| n > 1)
        .collect();
    gate.release();
    while let Some(t) = next_token(&mut rx).await {
        got.push(t);
    }
    let prefilled = [a, b, c, d].map(|p| p.unwrap()).into();
    (prefilled, sizes, got)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_short_prefills_is_one_forward_and_changes_no_bit() {
    let lens = [20, 25, 30, 17];
    let prompts = [0, 1, 2, 3].map(|i| byte_prompt(lens[i], 40 + i as u32));
    let stream = byte_prompt(20, 1);
    let cases = [
        (PrefillProjections::Int8, Some(128)),
        (PrefillProjections::Int8, None),
        (PrefillProjections::F32, Some(128)),
    ];
    for (kernels, budget) in cases {
        let what = format!("{kernels}, budget {budget:?}");
        let alone = tiny_on(None, no_prefix_cache(), kernels);
        let engine = tiny_on(budget, no_prefix_cache(), kernels);
        let (prefilled, sizes, got) = burst(&engine, &stream, &prompts).await;
        for (i, p) in prompts.iter().enumerate() {
            let want = alone.prefill(p, &logprob_params(1)).await.unwrap();
            same_prefill(&prefilled[i], &want, &format!("{what}, prompt {i}"));
        }
        let want = whole_stream(&alone, &stream, &logprob_params(60)).await;
        assert_eq!(got, want, "{what}: the running stream's tokens");
        let rows: usize = lens.iter().sum();
        if engine.mixed_batches() && budget.is_some() {
            // Every prompt row and the stream's step, in one iteration.
            assert_eq!(sizes, [rows + 1], "{what}");
            assert_eq!(engine.max_prefills(), MAX_PACKED_PREFILLS);
        } else {
            // A prefill per iteration, in arrival order.
            assert_eq!(sizes, [21, 26, 31, 18], "{what}");
            assert_eq!(engine.max_prefills(), 1);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn packing_counts_uncached_rows_and_stops_at_the_first_that_does_not_fit() {
    let kernels = PrefillProjections::Int8;
    // Budget 64 with the stream's row: the head (30 rows) leaves 33; the
    // warm prompt's 310 tokens, 288 of them in the prefix cache, need 22
    // and fit; the third (30) does not, so it and the fourth wait and
    // share the next iteration.
    let engine = tiny_on(Some(64), PrefixCacheOptions::default(), kernels);
    let long = byte_prompt(300, 5);
    engine.prefill(&long, &logprob_params(1)).await.unwrap();
    let prompts = [
        byte_prompt(30, 6),
        byte_prompt(310, 5),
        byte_prompt(30, 7),
        byte_prompt(30, 8),
    ];
    let (prefilled, sizes, _) = burst(&engine, &byte_prompt(20, 1), &prompts).await;
    assert_eq!(sizes, [30 + 1 + 22, 30 + 1 + 30], "iterations");
    assert_eq!(prefilled[1].cached_tokens, 288);
    let cold = tiny_on(None, no_prefix_cache(), kernels);
    for (i, p) in prompts.iter().enumerate() {
        let want = cold.prefill(p, &logprob_params(1)).await.unwrap();
        same_prefill(&prefilled[i], &want, &format!("prompt {i}"));
    }
    // A chunked head leaves no room; a head that fills the room leaves
    // nothing for the one after the next.
    let engine = tiny_on(Some(128), no_prefix_cache(), kernels);
    let prompts = [
        byte_prompt(200, 9),
        byte_prompt(20, 10),
        byte_prompt(100, 11),
        byte_prompt(20, 12),
    ];
    let (_, sizes, _) = burst(&engine, &byte_prompt(20, 1), &prompts).await;
    // 200 rows at 127 a chunk: 127, then the 73 left, which leave 54 for
    // the second prompt (20); the third (100) waits, then packs the fourth.
    assert_eq!(sizes, [128, 73 + 1 + 20, 100 + 1 + 20], "iterations");
    const { assert!(MAX_PACKED_PREFILLS >= 4) };
}

/// The real model (SmolLM2-135M, int8 prefill projections by default),
/// under a budget: a burst of chat turns packed into one forward equals
/// each turn prefilled alone unchunked, and the stream beside them its run
/// alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_model_packed_prefills_equal_each_alone() {
    let load = |budget| {
        let mut o = CpuEngineOptions::new(common::real_model());
        o.batch = 2;
        o.prefix_cache = no_prefix_cache();
        o.max_num_batched_tokens = budget;
        CpuEngine::load(o).expect("loading the real model")
    };
    let (alone, engine) = (load(None), load(Some(128)));
    assert!(engine.mixed_batches());
    let turns = [
        "What is the capital of France?",
        "Name three prime numbers.",
        "Why is the sky blue? Answer in one sentence.",
        "Write a haiku about rivers.",
    ]
    .map(|q| alone.tokenize(q).unwrap());
    let stream = alone.tokenize("Count from one to twenty:").unwrap();
    let (prefilled, sizes, got) = burst(&engine, &stream, &turns).await;
    let rows: usize = turns.iter().map(Vec::len).sum();
    assert_eq!(sizes, [rows + 1]);
    for (i, t) in turns.iter().enumerate() {
        let want = alone.prefill(t, &logprob_params(1)).await.unwrap();
        same_prefill(&prefilled[i], &want, &format!("turn {i}"));
    }
    assert_eq!(
        got,
        whole_stream(&alone, &stream, &logprob_params(60)).await
    );
}
