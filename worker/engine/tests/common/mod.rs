//! Helpers shared by the engine's integration tests.
#![allow(dead_code)]

pub mod lockstep;

use std::path::PathBuf;

use rngd_engine::{Engine, EngineError, FinishReason, GenEvent, SamplingParams};

/// The real model: `$RNGD_PD_MODEL` or the default cache path. Panics with a
/// message naming `rngd-pd model fetch` when it is absent.
pub fn real_model() -> PathBuf {
    match rngd_engine::model_fetch::resolve(None) {
        Ok(p) => p,
        Err(e) => panic!(
            "this test needs the real model: {e}\n(run `rngd-pd model fetch`, or set RNGD_PD_MODEL to a GGUF file)"
        ),
    }
}

/// Everything a stream produced.
#[derive(Debug, Clone, PartialEq)]
pub struct Output {
    pub ids: Vec<u32>,
    pub text: String,
    pub finish: Option<FinishReason>,
    pub completion_tokens: usize,
}

/// Reads a stream to its end; panics on an error event.
pub async fn collect(mut rx: tokio::sync::mpsc::Receiver<GenEvent>) -> Output {
    let mut out = Output {
        ids: vec![],
        text: String::new(),
        finish: None,
        completion_tokens: 0,
    };
    while let Some(ev) = rx.recv().await {
        match ev {
            GenEvent::Token { id, text, .. } => {
                out.ids.push(id);
                out.text.push_str(&text);
            }
            GenEvent::Done {
                finish_reason,
                completion_tokens,
                ..
            } => {
                out.finish = Some(finish_reason);
                out.completion_tokens = completion_tokens;
            }
            GenEvent::Error(e) => panic!("stream failed: {e}"),
        }
    }
    out
}

/// Prefill and decode on one engine.
pub async fn solo(
    engine: &dyn Engine,
    prompt: &[u32],
    params: &SamplingParams,
) -> Result<Output, EngineError> {
    Ok(collect(engine.generate(prompt, params).await?).await)
}

/// Serializes a KV cache to raw wire bytes and back (what a transport does).
pub fn through_the_wire(kv: &rngd_engine::KvCache) -> rngd_engine::KvCache {
    let raw: Vec<Vec<u8>> = kv.blobs.iter().map(|b| b.to_vec()).collect();
    let handle_blobs = rngd_kv_wire::describe(&raw);
    assert_eq!(handle_blobs.len(), kv.layout.blob_count());
    let want = kv.layout.wire_blob_bytes(kv.wire, kv.tokens).unwrap();
    for (b, meta) in raw.iter().zip(&handle_blobs) {
        assert_eq!(meta.len as usize, want);
        assert_eq!(b.len(), want);
    }
    rngd_engine::KvCache {
        layout: kv.layout,
        tokens: kv.tokens,
        wire: kv.wire,
        blobs: raw.into_iter().map(bytes::Bytes::from).collect(),
    }
}

/// A prompt of `n` byte tokens (the tiny model's vocabulary), varied by `salt`.
pub fn byte_prompt(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 37 + salt * 11) % 256).collect()
}

/// The prefix cache turned off.
pub fn no_prefix_cache() -> rngd_engine::prefix::PrefixCacheOptions {
    rngd_engine::prefix::PrefixCacheOptions {
        enabled: false,
        ..Default::default()
    }
}

/// Greedy with the top-20 log-probabilities of the raw logits, EOS ignored.
pub fn logprob_params(max_tokens: usize) -> SamplingParams {
    SamplingParams {
        logprobs: Some(20),
        ignore_eos: true,
        ..SamplingParams::greedy(max_tokens)
    }
}

/// Two prefills give the same first token, log-probabilities and KV (their
/// timing and cache count aside).
pub fn same_prefill(a: &rngd_engine::Prefilled, b: &rngd_engine::Prefilled, what: &str) {
    assert_eq!(a.first_token, b.first_token, "{what}: first token");
    assert_eq!(
        a.first_logprobs, b.first_logprobs,
        "{what}: log-probabilities"
    );
    assert_eq!(a.kv, b.kv, "{what}: KV");
}

/// A stream's next token with its log-probabilities.
pub async fn next_token(
    rx: &mut tokio::sync::mpsc::Receiver<GenEvent>,
) -> Option<(u32, Option<rngd_engine::TokenLogprobs>)> {
    loop {
        match rx.recv().await? {
            GenEvent::Token { id, logprobs, .. } => return Some((id, logprobs)),
            GenEvent::Error(e) => panic!("stream failed: {e}"),
            GenEvent::Done { .. } => {}
        }
    }
}

/// The tiny model (S = 512, 4 decode slots) with its prefills' projections
/// on `kernels` (`Auto`: the f32 GEMM, its random weights having no exact
/// int8 blocks), chunking under `budget`.
pub fn tiny_on(
    budget: Option<usize>,
    prefix: rngd_engine::prefix::PrefixCacheOptions,
    kernels: rngd_engine::cpu::PrefillProjections,
) -> std::sync::Arc<rngd_engine::cpu::CpuEngine> {
    let cfg = rngd_engine::tiny::TinyConfig {
        prefill_projections: kernels,
        ..Default::default()
    };
    rngd_engine::tiny::engine_with_budget(&cfg, 512, 4, &prefix, budget).unwrap()
}
