//! Chunked prefill under a per-iteration token budget: a prefill computed
//! in chunks equals an unchunked one bit for bit (first token,
//! log-probabilities, every KV value) on the tiny and on the real model, with
//! and without a prefix-cache hit; a decode stream running alongside a long
//! prefill gets tokens between its chunks (checked by the order of events,
//! not by time: the engine runs one iteration per step the test lets it
//! take, so a starved test never finds a stream finished); a budget below
//! the smallest step is refused. On the int8
//! kernel a prefill chunk and the decode step share one forward (a mixed
//! batch), and neither the streams nor the prefill see a different bit.

mod common;

use std::sync::Arc;

use common::lockstep::Lockstep;
use common::{byte_prompt, logprob_params, next_token, no_prefix_cache, same_prefill, tiny_on};
use rngd_engine::cpu::{CpuEngine, CpuEngineOptions, MIN_ROWS, PrefillProjections};
use rngd_engine::prefix::PrefixCacheOptions;
use rngd_engine::tiny::{self, TinyConfig};
use rngd_engine::{Engine, GenEvent, SamplingParams};

const S: usize = 512;

fn tiny(budget: Option<usize>, prefix: PrefixCacheOptions) -> Arc<CpuEngine> {
    tiny_on(budget, prefix, PrefillProjections::Auto)
}

const KERNELS: [PrefillProjections; 2] = [PrefillProjections::Auto, PrefillProjections::Int8];

#[tokio::test]
async fn a_chunked_prefill_equals_an_unchunked_one_bit_for_bit() {
    for kernels in KERNELS {
        chunked_equals_unchunked(kernels).await;
    }
}

async fn chunked_equals_unchunked(kernels: PrefillProjections) {
    let whole = tiny_on(None, no_prefix_cache(), kernels);
    let p = logprob_params(1);
    for budget in [MIN_ROWS, 16, 37, 128] {
        let chunked = tiny_on(Some(budget), no_prefix_cache(), kernels);
        for n in [
            1,
            MIN_ROWS - 1,
            MIN_ROWS,
            budget,
            budget + 1,
            budget + MIN_ROWS,
            300,
            S - 1,
        ] {
            let ids = byte_prompt(n, n as u32);
            let a = chunked.prefill(&ids, &p).await.unwrap();
            let b = whole.prefill(&ids, &p).await.unwrap();
            same_prefill(&a, &b, &format!("{kernels}, budget {budget}, {n} tokens"));
        }
    }
}

#[tokio::test]
async fn whole_generations_match_and_a_prefix_hit_is_chunked_alike() {
    for kernels in KERNELS {
        generations_match(kernels).await;
    }
}

async fn generations_match(kernels: PrefillProjections) {
    let whole = tiny_on(None, no_prefix_cache(), kernels);
    let chunked = tiny_on(Some(24), PrefixCacheOptions::default(), kernels);
    let p = logprob_params(24);
    let base = byte_prompt(200, 3);
    let want = common::solo(&*whole, &base, &p).await.unwrap();
    let got = common::solo(&*chunked, &base, &p).await.unwrap();
    assert_eq!(got.ids, want.ids);
    // A second prompt sharing 150 tokens: a warm start, then chunks.
    let mut next = base[..150].to_vec();
    next.extend(byte_prompt(120, 9));
    let warm = chunked.prefill(&next, &logprob_params(1)).await.unwrap();
    assert!(warm.cached_tokens >= 128, "{}", warm.cached_tokens);
    let cold = whole.prefill(&next, &logprob_params(1)).await.unwrap();
    same_prefill(&warm, &cold, "warm and chunked");
}

/// Drains what a stream has sent so far; the tokens among it.
fn drain(rx: &mut tokio::sync::mpsc::Receiver<GenEvent>) -> usize {
    let mut n = 0;
    while let Ok(ev) = rx.try_recv() {
        match ev {
            GenEvent::Token { .. } => n += 1,
            GenEvent::Error(e) => panic!("stream failed: {e}"),
            GenEvent::Done { .. } => panic!("the stream ended before the prefill"),
        }
    }
    n
}

/// Tokens a running stream got while a 400-token prompt was prefilled, and
/// the tokens of each engine iteration from the prefill's submission to two
/// iterations after its answer.
async fn during_a_long_prefill(engine: &CpuEngine) -> (usize, Vec<usize>) {
    let (gate, _release) = Lockstep::attach(engine);
    let mut running = gate
        .pump(engine.generate(&byte_prompt(20, 1), &logprob_params(300)))
        .await
        .unwrap();
    // It runs: its first tokens arrived.
    let mut seen = 0;
    while seen < 2 {
        match gate.pump(running.recv()).await {
            Some(GenEvent::Token { .. }) => seen += 1,
            other => panic!("{other:?}"),
        }
    }
    drain(&mut running);
    let from = gate.sizes().len();
    gate.pump(engine.prefill(&byte_prompt(400, 2), &logprob_params(1)))
        .await
        .unwrap();
    // Each token sent before the prefill's answer is in the channel now.
    let tokens = drain(&mut running);
    // The iteration that answered is observed after its decode step: a token
    // of the next iteration's step means it was.
    for _ in 0..2 {
        assert!(matches!(
            gate.pump(running.recv()).await,
            Some(GenEvent::Token { .. })
        ));
    }
    let sizes = gate.sizes()[from..].to_vec();
    gate.release();
    engine.set_iteration_observer(None);
    (tokens, sizes)
}

#[tokio::test]
async fn a_running_decode_gets_tokens_between_the_chunks() {
    // 400 tokens at 16 per iteration less the one decode row: 15-row
    // chunks, the last taking the tail, so at least 25 decode steps run
    // between the first chunk and the answer.
    let chunked = tiny(Some(16), no_prefix_cache());
    let (tokens, sizes) = during_a_long_prefill(&chunked).await;
    let chunks = 400 / 15;
    assert!(
        tokens >= chunks - 1,
        "{tokens} tokens during {chunks} chunks"
    );
    // No iteration went past the budget but the last chunk's short tail.
    assert!(sizes.iter().all(|&n| n < 16 + MIN_ROWS), "{sizes:?}");
    assert!(sizes.iter().sum::<usize>() >= 400, "{sizes:?}");
    // Unchunked, the whole prompt is one iteration: the check above fails.
    let whole = tiny(None, no_prefix_cache());
    let (_, sizes) = during_a_long_prefill(&whole).await;
    assert!(sizes.iter().any(|&n| n >= 400), "{sizes:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_mixed_into_the_decode_steps_changes_no_bit() {
    // The int8 kernel computes each row alone: chunk and decode step share
    // a forward. The f32 GEMM does not: they keep a forward each.
    let int8 = |budget| tiny_on(budget, no_prefix_cache(), PrefillProjections::Int8);
    assert!(int8(None).mixed_batches());
    assert!(!tiny_on(None, no_prefix_cache(), PrefillProjections::F32).mixed_batches());
    const STREAMS: u32 = 3;
    const TOKENS: usize = 300;
    let params = logprob_params(TOKENS);
    let long = byte_prompt(400, 2);
    // Each stream alone and the long prompt alone: the references.
    let alone = int8(None);
    let mut want = Vec::new();
    for s in 0..STREAMS {
        let mut rx = alone
            .generate(&byte_prompt(20, 10 + s), &params)
            .await
            .unwrap();
        let mut got = Vec::new();
        while let Some(t) = next_token(&mut rx).await {
            got.push(t);
        }
        assert_eq!(got.len(), TOKENS);
        want.push(got);
    }
    let want_prefill = alone.prefill(&long, &logprob_params(1)).await.unwrap();
    // Unchunked (the whole prompt in one mixed forward), and in chunks.
    for budget in [None, Some(16), Some(64)] {
        let engine = int8(budget);
        let (gate, _release) = Lockstep::attach(&engine);
        let mut streams = Vec::new();
        for s in 0..STREAMS {
            let rx = gate
                .pump(engine.generate(&byte_prompt(20, 10 + s), &params))
                .await
                .unwrap();
            streams.push((rx, Vec::new()));
        }
        for (rx, got) in &mut streams {
            got.push(gate.pump(next_token(rx)).await.unwrap());
        }
        let prefilled = gate
            .pump(engine.prefill(&long, &logprob_params(1)))
            .await
            .unwrap();
        same_prefill(&prefilled, &want_prefill, &format!("budget {budget:?}"));
        for (rx, got) in &mut streams {
            // Every stream ran from before the first chunk to after the
            // answer (the engine, held after that iteration, has sent all
            // it will until released): each of its iterations held the
            // prefill's rows too.
            got.extend(std::iter::from_fn(|| {
                rx.try_recv().ok().and_then(|ev| match ev {
                    GenEvent::Token { id, logprobs, .. } => Some((id, logprobs)),
                    _ => None,
                })
            }));
            assert!(
                got.len() < TOKENS,
                "budget {budget:?}: the stream ended first"
            );
        }
        gate.release();
        for ((rx, got), want) in streams.iter_mut().zip(&want) {
            while let Some(t) = next_token(rx).await {
                got.push(t);
            }
            assert_eq!(got, want, "budget {budget:?}: a stream's tokens");
        }
    }
}

#[test]
fn a_budget_below_the_smallest_step_is_refused() {
    let err = tiny::engine_with_budget(
        &TinyConfig::default(),
        S,
        4,
        &no_prefix_cache(),
        Some(MIN_ROWS - 1),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("max_num_batched_tokens 7"), "{err}");
    assert!(err.contains("8 tokens"), "{err}");
}

/// The real model (SmolLM2-135M): chunked under a small budget equals
/// unchunked bit for bit, prefill and a whole greedy generation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_model_chunked_equals_unchunked() {
    let load = |budget: Option<usize>| {
        let mut o = CpuEngineOptions::new(common::real_model());
        o.batch = 1;
        o.prefix_cache = no_prefix_cache();
        o.max_num_batched_tokens = budget;
        CpuEngine::load(o).expect("loading the real model")
    };
    let (whole, chunked) = (load(None), load(Some(48)));
    let para = "Rust is a systems programming language focused on safety, speed and concurrency. \
        It achieves memory safety without a garbage collector. ";
    for reps in [1, 4, 9] {
        let ids = whole.tokenize(&para.repeat(reps)).unwrap();
        let a = chunked.prefill(&ids, &logprob_params(1)).await.unwrap();
        let b = whole.prefill(&ids, &logprob_params(1)).await.unwrap();
        same_prefill(&a, &b, &format!("real model, {} tokens", ids.len()));
    }
    let ids = whole.tokenize(&para.repeat(5)).unwrap();
    let p = SamplingParams::greedy(16);
    let want = common::solo(&*whole, &ids, &p).await.unwrap();
    let got = common::solo(&*chunked, &ids, &p).await.unwrap();
    assert_eq!(got, want);
}
