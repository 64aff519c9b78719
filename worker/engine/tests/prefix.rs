//! The prefix cache on the tiny model: a warm prefill equals a cold one (first
//! token, log-probabilities, every KV value), `cached_tokens`, eviction under
//! a small budget while requests run, `cache_salt` isolation, a decode
//! stream's blocks reused by the next turn, PD from a warm prefill.

mod common;

use std::sync::{Arc, Mutex};

use common::{
    byte_prompt, collect, logprob_params, no_prefix_cache, same_prefill, solo, through_the_wire,
};
use rngd_engine::cpu::PrefillProjections;
use rngd_engine::prefix::{PrefixCacheOptions, PrefixEvent, PrefixEventSink, block_bytes};
use rngd_engine::tiny::{self, TinyConfig};
use rngd_engine::{Engine, Prefilled, SamplingParams};

const S: usize = 256;
const B: usize = 16;

fn engine(prefix: PrefixCacheOptions) -> Arc<rngd_engine::cpu::CpuEngine> {
    engine_on(prefix, PrefillProjections::Auto)
}

/// The tiny model with its prefills' projections on `kernels` (`Auto` is
/// the f32 GEMM there: its random f32 weights have no exact int8 blocks).
fn engine_on(
    prefix: PrefixCacheOptions,
    kernels: PrefillProjections,
) -> Arc<rngd_engine::cpu::CpuEngine> {
    let cfg = TinyConfig {
        prefill_projections: kernels,
        ..TinyConfig::default()
    };
    tiny::engine_with_prefix(&cfg, S, 4, &prefix).unwrap()
}

#[tokio::test]
async fn a_warm_prefill_equals_a_cold_one_bit_for_bit() {
    for kernels in [PrefillProjections::Auto, PrefillProjections::Int8] {
        let cold = engine_on(no_prefix_cache(), kernels);
        let warm = engine_on(PrefixCacheOptions::default(), kernels);
        let want = match kernels {
            PrefillProjections::Int8 => 0,
            _ => 8,
        };
        assert_eq!(warm.f32_prefill_projections(), (want, 8), "{kernels}");
        warm_equals_cold(&cold, &warm, &format!("{kernels}")).await;
    }
}

async fn warm_equals_cold(
    cold: &rngd_engine::cpu::CpuEngine,
    warm: &rngd_engine::cpu::CpuEngine,
    kernels: &str,
) {
    let p = logprob_params(1);
    let base = byte_prompt(150, 1);
    let first = warm.prefill(&base, &p).await.unwrap();
    assert_eq!(first.cached_tokens, 0);
    // (prompt, expected cached tokens)
    let mut cases: Vec<(&str, Vec<u32>, usize)> = Vec::new();
    // No block shared: the first token differs.
    let mut none = base.clone();
    none[0] = 255 - none[0];
    cases.push(("no block", none, 0));
    // One block shared, then different.
    let mut one = base[..B].to_vec();
    one.extend(byte_prompt(40, 7));
    cases.push(("one block", one, B));
    // Many blocks, then a partial last block of new tokens.
    let mut many = base[..6 * B + 5].to_vec();
    many.extend(byte_prompt(11, 3));
    cases.push(("many blocks + partial", many, 6 * B));
    // The whole prompt again: 150 tokens, 9 full blocks below the last one,
    // which would leave 6 to compute: 8 are reused.
    cases.push(("whole prompt", base.clone(), 8 * B));
    // A prefix of exactly 4 blocks: the 4th is recomputed (its last token).
    cases.push(("exact blocks", base[..4 * B].to_vec(), 3 * B));
    // Full blocks and fewer than 8 more tokens: the last block is
    // recomputed too (the GEMM sums very few rows in another order).
    for extra in 1..=9 {
        let expect = if extra < 8 { 3 * B } else { 4 * B };
        cases.push((
            "full blocks + a few",
            base[..4 * B + extra].to_vec(),
            expect,
        ));
    }
    // One token: nothing to reuse.
    cases.push(("one token", base[..1].to_vec(), 0));
    for (what, ids, expect) in cases {
        let what = format!("{kernels}: {what}");
        let c = cold.prefill(&ids, &p).await.unwrap();
        let w = warm.prefill(&ids, &p).await.unwrap();
        assert_eq!(c.cached_tokens, 0, "{what}");
        assert_eq!(w.cached_tokens, expect, "{what}");
        same_prefill(&w, &c, &what);
        // And the generation from it.
        let g = logprob_params(24);
        let (cs, ws) = (
            solo(cold, &ids, &g).await.unwrap(),
            solo(warm, &ids, &g).await.unwrap(),
        );
        assert_eq!(ws.ids, cs.ids, "{what}: tokens");
    }
    let st = warm.prefix_cache_stats().unwrap();
    assert!(st.hits > 0 && st.queries > st.hits, "{st:?}");
    assert!(cold.prefix_cache_stats().unwrap().hits == 0);
}

#[tokio::test]
async fn cache_salt_keeps_tenants_apart() {
    let e = engine(PrefixCacheOptions::default());
    let ids = byte_prompt(70, 4);
    let salted = |s: Option<&str>| SamplingParams {
        cache_salt: s.map(String::from),
        ..logprob_params(1)
    };
    let a = e.prefill(&ids, &salted(Some("tenant-a"))).await.unwrap();
    assert_eq!(a.cached_tokens, 0);
    let b = e.prefill(&ids, &salted(Some("tenant-b"))).await.unwrap();
    assert_eq!(b.cached_tokens, 0, "another salt never hits");
    let none = e.prefill(&ids, &salted(None)).await.unwrap();
    assert_eq!(none.cached_tokens, 0, "no salt never hits a salted block");
    let a2 = e.prefill(&ids, &salted(Some("tenant-a"))).await.unwrap();
    // 70 tokens: 3 blocks (a 4th would leave 6 to compute).
    assert_eq!(a2.cached_tokens, 3 * B, "the same salt hits");
    same_prefill(&a2, &a, "salted warm");
    same_prefill(&b, &a, "salted cold");
}

#[derive(Default)]
struct Events(Mutex<Vec<PrefixEvent>>);

impl PrefixEventSink for Events {
    fn publish(&self, e: PrefixEvent) {
        self.0.lock().unwrap().push(e);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eviction_under_a_small_budget_while_requests_run() {
    let reference = engine(no_prefix_cache());
    let budget_blocks = 5;
    let layout = reference.info().kv_layout;
    let opts = PrefixCacheOptions {
        max_bytes: (budget_blocks * block_bytes(layout, B)) as u64,
        ..PrefixCacheOptions::default()
    };
    let e = engine(opts.clone());
    let events = Arc::new(Events::default());
    e.set_prefix_events(Some(events.clone()));
    // Prompts sharing prefixes of several lengths, more blocks than fit.
    let shared = byte_prompt(64, 9);
    let mut prompts = Vec::new();
    for i in 0..12u32 {
        let mut p = shared[..(i as usize % 4) * B + 3].to_vec();
        p.extend(byte_prompt(20 + i as usize * 3, 20 + i % 3));
        prompts.push(p);
    }
    let g = logprob_params(12);
    let mut want = Vec::new();
    for p in &prompts {
        want.push(solo(&*reference, p, &g).await.unwrap().ids);
    }
    // Twice, all at once: the second round hits what the first left.
    for round in 0..2 {
        let mut tasks = Vec::new();
        for p in prompts.clone() {
            let (e, g) = (e.clone(), g.clone());
            tasks.push(tokio::spawn(async move {
                let rx = e.generate(&p, &g).await.unwrap();
                collect(rx).await.ids
            }));
        }
        for (i, t) in tasks.into_iter().enumerate() {
            assert_eq!(t.await.unwrap(), want[i], "round {round} prompt {i}");
        }
        let st = e.prefix_cache_stats().unwrap();
        assert_eq!(st.capacity_blocks, budget_blocks);
        assert!(st.blocks <= budget_blocks, "{st:?}");
        assert!(st.bytes <= opts.max_bytes, "{st:?}");
    }
    let st = e.prefix_cache_stats().unwrap();
    assert!(st.hits > 0, "{st:?}");
    let ev = events.0.lock().unwrap().clone();
    let stored: usize = ev
        .iter()
        .map(|e| match e {
            PrefixEvent::BlockStored {
                hashes, token_ids, ..
            } => {
                assert_eq!(token_ids.len(), hashes.len() * B);
                hashes.len()
            }
            _ => 0,
        })
        .sum();
    let removed: usize = ev
        .iter()
        .map(|e| match e {
            PrefixEvent::BlockRemoved { hashes } => hashes.len(),
            _ => 0,
        })
        .sum();
    assert!(removed > 0, "nothing was evicted");
    assert_eq!(
        stored - removed,
        st.blocks,
        "events account for every block"
    );
    e.reset_prefix_cache();
    assert_eq!(e.prefix_cache_stats().unwrap().blocks, 0);
    assert_eq!(
        events.0.lock().unwrap().last(),
        Some(&PrefixEvent::AllCleared)
    );
}

#[tokio::test]
async fn a_decode_streams_blocks_serve_the_next_turn() {
    let e = engine(PrefixCacheOptions::default());
    let turn1 = byte_prompt(37, 5);
    let g = logprob_params(30);
    let out = solo(&*e, &turn1, &g).await.unwrap();
    assert_eq!(out.ids.len(), 30);
    // The next turn: the conversation so far, then new tokens.
    let mut turn2 = turn1.clone();
    turn2.extend(&out.ids);
    turn2.extend(byte_prompt(9, 6));
    let pre = e.prefill(&turn2, &logprob_params(1)).await.unwrap();
    // The stream's cache held the prompt and every generated token but the
    // last (never fed): 37 + 29 = 66 positions, 4 full blocks.
    assert_eq!(pre.cached_tokens, 4 * B);
    // The prompt's 2 blocks came from the prefill, the other 2 were kept by
    // the decode.
    let turn1_again = e.prefill(&turn1, &logprob_params(1)).await.unwrap();
    assert_eq!(
        turn1_again.cached_tokens, B,
        "37 tokens: 2 blocks would leave 5"
    );
}

#[tokio::test]
async fn a_pd_split_from_a_warm_prefill_gives_the_solo_tokens() {
    let reference = engine(no_prefix_cache());
    let prefiller = engine(PrefixCacheOptions::default());
    let decoder = engine(PrefixCacheOptions::default());
    let base = byte_prompt(120, 2);
    let g = logprob_params(20);
    prefiller.prefill(&base, &g).await.unwrap();
    let mut ids = base[..5 * B + 2].to_vec();
    ids.extend(byte_prompt(30, 8));
    let want = solo(&*reference, &ids, &g).await.unwrap();
    let pre = prefiller.prefill(&ids, &g).await.unwrap();
    assert_eq!(pre.cached_tokens, 5 * B);
    assert_eq!(
        pre.kv.tokens,
        ids.len(),
        "the whole prompt's KV is exported"
    );
    let shipped = Prefilled {
        kv: through_the_wire(&pre.kv),
        ..pre
    };
    let got = collect(decoder.decode(&ids, shipped, &g).await.unwrap()).await;
    assert_eq!(got, want);
}

/// The real model (SmolLM2-135M): a warm prefill equals a cold one bit for
/// bit for a shared prefix of several lengths, on either prefill kernel
/// (`Auto` takes the int8 one there: every projection is Q4_1).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_model_warm_equals_cold() {
    for (kernels, f32_projections) in [
        (PrefillProjections::Auto, 0),
        (PrefillProjections::F32, 120),
    ] {
        real_model_warm_equals_cold_on(kernels, f32_projections).await;
    }
}

async fn real_model_warm_equals_cold_on(kernels: PrefillProjections, f32_projections: usize) {
    use rngd_engine::cpu::{CpuEngine, CpuEngineOptions};
    let load = |prefix: PrefixCacheOptions| {
        let mut o = CpuEngineOptions::new(common::real_model());
        o.batch = 1;
        o.prefix_cache = prefix;
        o.prefill_projections = kernels;
        CpuEngine::load(o).expect("loading the real model")
    };
    let (cold, warm) = (load(no_prefix_cache()), load(PrefixCacheOptions::default()));
    assert_eq!(
        warm.f32_prefill_projections(),
        (f32_projections, 120),
        "{kernels}"
    );
    let para = "Rust is a systems programming language focused on safety, speed and concurrency. \
        It achieves memory safety without a garbage collector. ";
    let base = warm.tokenize(&para.repeat(6)).unwrap();
    assert!(base.len() > 120, "{}", base.len());
    let p = logprob_params(1);
    warm.prefill(&base, &p).await.unwrap();
    for (cut, tail) in [(B + 3, 20), (4 * B + 1, 1), (6 * B, 2), (7 * B + 5, 9)] {
        let mut ids = base[..cut].to_vec();
        ids.extend(warm.tokenize(&" and more words".repeat(tail)).unwrap());
        let c = cold.prefill(&ids, &p).await.unwrap();
        let w = warm.prefill(&ids, &p).await.unwrap();
        assert!(w.cached_tokens >= B, "cut {cut}: {}", w.cached_tokens);
        same_prefill(&w, &c, &format!("real model, {kernels}, cut {cut}"));
    }
}

/// `kv_usage` counts blocks as vLLM does: the blocks the running streams'
/// caches hold (a partial block whole) over the blocks of every decode slot;
/// cached blocks no stream uses count as free.
#[tokio::test]
async fn kv_usage_counts_the_blocks_of_running_streams() {
    let e = engine(PrefixCacheOptions::default());
    assert_eq!(e.kv_usage(), 0.0);
    // 4 slots of 256 positions: 64 blocks of 16.
    let total = (4 * S.div_ceil(B)) as f64;
    let (n, max_tokens) = (40, 180);
    let mut rx = e
        .generate(&byte_prompt(n, 9), &logprob_params(max_tokens))
        .await
        .unwrap();
    let mut seen = Vec::new();
    while let Some(ev) = rx.recv().await {
        if matches!(ev, rngd_engine::GenEvent::Done { .. }) {
            break;
        }
        seen.push(e.kv_usage());
    }
    let most = (n + max_tokens).div_ceil(B) as f64 / total;
    assert!(seen.iter().all(|&u| u <= most + 1e-12), "{seen:?}");
    assert!(
        seen.iter().any(|&u| u > 0.0),
        "never saw the stream's blocks"
    );
    // Each value is a whole number of blocks.
    for u in &seen {
        let blocks = u * total;
        assert!((blocks - blocks.round()).abs() < 1e-9, "{u}");
    }
    // The stream ended: its blocks are free again (the cached copies do not count).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while e.kv_usage() != 0.0 {
        assert!(
            std::time::Instant::now() < deadline,
            "usage stayed {}",
            e.kv_usage()
        );
        tokio::task::yield_now().await;
    }
    assert!(e.prefix_cache_stats().unwrap().blocks > 0);
}
