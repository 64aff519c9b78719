//! A tiny Llama with deterministic random weights, built in memory.
//!
//! Same code path as a GGUF model (the same [`crate::cpu::CpuEngine`],
//! forward, cache and sampling), small enough that a test builds it in
//! milliseconds. Its tokenizer is byte-level (256 byte tokens, three merges)
//! with the ChatML control tokens, so chat rendering and streaming
//! detokenization work too. Its outputs are meaningless text, and its
//! control tokens (EOS) have near-zero embeddings so it seldom stops early.

use std::sync::Arc;

use candle_core::{Device, Tensor};

use crate::EngineError;
use crate::cpu::{CpuEngine, PrefillProjections};
use crate::model::{Config, Model};
use crate::prefix::PrefixCacheOptions;
use crate::sampling::uniform;
use crate::tokenizer::{Tokenizer, TokenizerParts};

/// Shape and seed of a tiny model.
#[derive(Debug, Clone, PartialEq)]
pub struct TinyConfig {
    /// Transformer layers.
    pub layers: usize,
    /// Hidden width (a multiple of 32 and of `heads`).
    pub hidden: usize,
    /// Feed-forward width (a multiple of 32).
    pub ffn: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (divides `heads`).
    pub kv_heads: usize,
    /// Seed of the weights.
    pub seed: u64,
    /// Kernel of the prefills' projections; the default (`Auto`) takes the
    /// f32 GEMM, the random f32 weights having no exact int8 blocks.
    pub prefill_projections: PrefillProjections,
}

impl Default for TinyConfig {
    /// 2 layers, hidden 64, 4 query heads over 2 KV heads (head_dim 16), FFN 128.
    fn default() -> Self {
        TinyConfig {
            layers: 2,
            hidden: 64,
            ffn: 128,
            heads: 4,
            kv_heads: 2,
            seed: 7,
            prefill_projections: PrefillProjections::Auto,
        }
    }
}

/// Token ids of the tiny tokenizer's control tokens.
pub const TINY_ENDOFTEXT: u32 = 259;
/// `<|im_start|>`.
pub const TINY_IM_START: u32 = 260;
/// `<|im_end|>` (the EOS token).
pub const TINY_IM_END: u32 = 261;

/// The tiny byte-level tokenizer.
pub fn tokenizer() -> Result<Tokenizer, EngineError> {
    let table = crate::tokenizer::bytes_to_unicode();
    let mut tokens: Vec<String> = table.iter().map(|c| c.to_string()).collect();
    let g = table[b' ' as usize];
    // Three merges: "he", "Ġt", "Ġthe".
    tokens.push("he".into());
    tokens.push(format!("{g}t"));
    tokens.push(format!("{g}the"));
    let merges = vec!["h e".to_string(), format!("{g} t"), format!("{g}t he")];
    tokens.push("<|endoftext|>".into());
    tokens.push("<|im_start|>".into());
    tokens.push("<|im_end|>".into());
    let mut token_types = vec![1; tokens.len()];
    for t in [TINY_ENDOFTEXT, TINY_IM_START, TINY_IM_END] {
        token_types[t as usize] = 3;
    }
    Tokenizer::from_parts(TokenizerParts {
        model_name: "tiny-llama".into(),
        tokens,
        merges,
        pre: crate::tokenizer::PreTokenizer::Smollm,
        token_types,
        eos_token_id: Some(TINY_IM_END),
        bos_token_id: None,
        add_bos: false,
        add_eos: false,
        chat_template: None,
    })
}

fn random(shape: (usize, usize), scale: f32, seed: u64, salt: u64) -> Result<Tensor, EngineError> {
    let n = shape.0 * shape.1;
    let base = seed.wrapping_mul(1_000_003).wrapping_add(salt << 32);
    let data: Vec<f32> = (0..n as u64)
        .map(|i| ((uniform(base, i) * 2.0 - 1.0) as f32) * scale)
        .collect();
    Ok(Tensor::from_vec(data, shape, &Device::Cpu)?)
}

/// Builds the tiny model's weights.
pub(crate) fn model(cfg: &TinyConfig, seq_len: usize) -> Result<Model, EngineError> {
    let tok = tokenizer()?;
    let vocab = tok.vocab_size();
    let head_dim = cfg.hidden / cfg.heads;
    let c = Config {
        vocab,
        hidden: cfg.hidden,
        ffn: cfg.ffn,
        layers: cfg.layers,
        heads: cfg.heads,
        kv_heads: cfg.kv_heads,
        head_dim,
        rope_dims: head_dim,
        rope_base: 10_000.0,
        rope_freq_scale: 1.0,
        eps: 1e-5,
    };
    let d = cfg.hidden;
    let kvw = cfg.kv_heads * head_dim;
    let s = cfg.seed;
    let inv = |n: usize| 1.0 / (n as f32).sqrt();
    let mut digest = crate::identity::WeightDigest::new();
    let mut model = Model::build(
        c,
        |name| {
            let salt = name
                .bytes()
                .fold(0u64, |h, b| h.wrapping_mul(131).wrapping_add(u64::from(b)));
            let layer_part = name.strip_prefix("blk.").and_then(|r| r.split_once('.'));
            let t = match layer_part.map(|(_, n)| n).unwrap_or(name) {
                "token_embd.weight" => {
                    // Control tokens get near-zero rows, so the tied head rarely picks
                    // EOS and tests see long generations.
                    let t = random((vocab, d), 1.0, s, salt)?;
                    let mut rows = Vec::with_capacity(vocab);
                    for r in 0..vocab {
                        let row = t.narrow(0, r, 1)?;
                        rows.push(if r as u32 >= TINY_ENDOFTEXT {
                            (row * 0.01)?
                        } else {
                            row
                        });
                    }
                    Tensor::cat(&rows, 0)?
                }
                "output_norm.weight" | "attn_norm.weight" | "ffn_norm.weight" => {
                    Tensor::ones(d, candle_core::DType::F32, &Device::Cpu)?
                }
                "attn_q.weight" | "attn_output.weight" => random((d, d), 2.0 * inv(d), s, salt)?,
                "attn_k.weight" | "attn_v.weight" => random((kvw, d), 2.0 * inv(d), s, salt)?,
                "ffn_gate.weight" | "ffn_up.weight" => random((cfg.ffn, d), 2.0 * inv(d), s, salt)?,
                "ffn_down.weight" => random((d, cfg.ffn), 2.0 * inv(cfg.ffn), s, salt)?,
                _ => return Ok(None),
            };
            let bytes: Vec<u8> = t
                .flatten_all()?
                .to_vec1::<f32>()?
                .iter()
                .flat_map(|x| x.to_le_bytes())
                .collect();
            digest.add(name, "f32", t.dims(), &bytes);
            Ok(Some(t))
        },
        seq_len,
        cfg.prefill_projections,
    )?;
    model.weight_version = digest.finish();
    Ok(model)
}

/// A running engine on the default tiny model.
pub fn engine(seq_len: usize, batch: usize) -> Result<Arc<CpuEngine>, EngineError> {
    engine_with(&TinyConfig::default(), seq_len, batch)
}

/// A running engine on a tiny model of the given shape.
pub fn engine_with(
    cfg: &TinyConfig,
    seq_len: usize,
    batch: usize,
) -> Result<Arc<CpuEngine>, EngineError> {
    engine_with_prefix(cfg, seq_len, batch, &PrefixCacheOptions::default())
}

/// [`engine_with`] with these prefix-cache options (prefills unchunked).
pub fn engine_with_prefix(
    cfg: &TinyConfig,
    seq_len: usize,
    batch: usize,
    prefix: &PrefixCacheOptions,
) -> Result<Arc<CpuEngine>, EngineError> {
    engine_with_budget(cfg, seq_len, batch, prefix, None)
}

/// [`engine_with_prefix`] with a per-iteration token budget: prefills are
/// chunked under it (`None`: unchunked; see
/// [`crate::cpu::CpuEngineOptions::max_num_batched_tokens`]).
pub fn engine_with_budget(
    cfg: &TinyConfig,
    seq_len: usize,
    batch: usize,
    prefix: &PrefixCacheOptions,
    max_num_batched_tokens: Option<usize>,
) -> Result<Arc<CpuEngine>, EngineError> {
    if cfg.heads == 0
        || cfg.kv_heads == 0
        || !cfg.heads.is_multiple_of(cfg.kv_heads)
        || !cfg.hidden.is_multiple_of(cfg.heads)
    {
        return Err(EngineError::InvalidRequest(format!(
            "inconsistent tiny config {cfg:?}"
        )));
    }
    CpuEngine::start(
        model(cfg, seq_len)?,
        tokenizer()?,
        seq_len,
        batch,
        prefix,
        max_num_batched_tokens,
        None,
    )
}
