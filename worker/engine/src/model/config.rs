//! The shape of a Llama model from its GGUF metadata, and the refusals: every
//! metadata key or tensor that asks for something the forward does not
//! compute is a load error naming it, never a silently different model.

use crate::EngineError;
use crate::tokenizer::Meta;

/// Shape of a Llama model.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Config {
    pub(crate) vocab: usize,
    pub(crate) hidden: usize,
    pub(crate) ffn: usize,
    pub(crate) layers: usize,
    pub(crate) heads: usize,
    pub(crate) kv_heads: usize,
    pub(crate) head_dim: usize,
    pub(crate) rope_dims: usize,
    pub(crate) rope_base: f32,
    /// Linear RoPE scaling: positions are multiplied by this (1 / `rope.scaling.factor`).
    pub(crate) rope_freq_scale: f32,
    pub(crate) eps: f32,
}

/// Metadata keys (after `{arch}.`) of features this forward does not have.
const UNSUPPORTED_KEYS: &[(&str, &str)] = &[
    ("attention.scale", "a custom attention scale"),
    ("logit_scale", "scaled logits"),
    ("embedding_scale", "scaled embeddings"),
    ("residual_scale", "scaled residuals"),
    ("attn_logit_softcapping", "attention logit soft-capping"),
    ("final_logit_softcapping", "final logit soft-capping"),
    ("attention.sliding_window", "sliding-window attention"),
    (
        "attention.layer_norm_epsilon",
        "LayerNorm (the forward has RMSNorm)",
    ),
];

impl Config {
    /// Reads the `llama.*` metadata of a GGUF file; refuses what the forward
    /// does not implement, naming the key.
    pub(crate) fn from_meta(meta: &Meta<'_>) -> Result<Config, EngineError> {
        let arch = meta.string("general.architecture")?;
        if arch != "llama" {
            return Err(meta.invalid(format!(
                "metadata key `general.architecture` is `{arch}`: not supported (only `llama` is)"
            )));
        }
        let key = |k: &str| format!("{arch}.{k}");
        for (k, what) in UNSUPPORTED_KEYS {
            if meta.map.contains_key(&key(k)) {
                return Err(meta.invalid(format!(
                    "metadata key `{}` asks for {what}, which this engine does not implement",
                    key(k)
                )));
            }
        }
        if let Some(n) = meta.opt_uint(&key("expert_count"))
            && n > 0
        {
            return Err(meta.invalid(format!(
                "metadata key `{}` is {n}: mixture-of-experts models are not supported",
                key("expert_count")
            )));
        }
        let hidden = meta.uint(&key("embedding_length"))? as usize;
        let heads = meta.uint(&key("attention.head_count"))? as usize;
        let kv_heads = meta
            .opt_uint(&key("attention.head_count_kv"))
            .map(|x| x as usize)
            .unwrap_or(heads);
        if heads == 0 || kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
            return Err(meta.invalid(format!(
                "inconsistent attention shape: `{}` = {heads}, `{}` = {kv_heads} \
                 (the query heads must be a multiple of the KV heads)",
                key("attention.head_count"),
                key("attention.head_count_kv")
            )));
        }
        let head_dim = match meta.opt_uint(&key("attention.key_length")) {
            Some(k) => k as usize,
            None if hidden.is_multiple_of(heads) => hidden / heads,
            None => {
                return Err(meta.invalid(format!(
                    "`{}` = {hidden} is not a multiple of `{}` = {heads}",
                    key("embedding_length"),
                    key("attention.head_count")
                )));
            }
        };
        if let Some(v) = meta.opt_uint(&key("attention.value_length"))
            && v as usize != head_dim
        {
            return Err(meta.invalid(format!(
                "metadata key `{}` = {v} differs from the key length {head_dim}: not supported",
                key("attention.value_length")
            )));
        }
        let rope_dims = meta
            .opt_uint(&key("rope.dimension_count"))
            .map(|x| x as usize)
            .unwrap_or(head_dim);
        if rope_dims > head_dim || rope_dims % 2 == 1 {
            return Err(meta.invalid(format!(
                "metadata key `{}` = {rope_dims} is not an even number up to the head size {head_dim}",
                key("rope.dimension_count")
            )));
        }
        Ok(Config {
            vocab: 0, // filled from the embedding table
            hidden,
            ffn: meta.uint(&key("feed_forward_length"))? as usize,
            layers: meta.uint(&key("block_count"))? as usize,
            heads,
            kv_heads,
            head_dim,
            rope_dims,
            rope_base: meta.opt_f32(&key("rope.freq_base")).unwrap_or(10_000.0),
            rope_freq_scale: rope_freq_scale(meta, &arch)?,
            eps: meta
                .opt_f32(&key("attention.layer_norm_rms_epsilon"))
                .unwrap_or(1e-5),
        })
    }
}

/// The linear RoPE scaling of the metadata, as llama.cpp reads it:
/// `rope.scaling.type` absent or `linear` → positions × 1/`rope.scaling.factor`
/// (or the older `rope.scale_linear`; absent or 0 → 1); `none` → 1; `yarn`,
/// `longrope` and anything else → refused. Llama 3.1's `llama3` scaling is
/// not here: GGUF files carry it as the `rope_freqs.weight` tensor.
fn rope_freq_scale(meta: &Meta<'_>, arch: &str) -> Result<f32, EngineError> {
    let type_key = format!("{arch}.rope.scaling.type");
    let kind = match meta.map.get(&type_key) {
        None => "linear".to_string(),
        Some(_) => meta.string(&type_key)?,
    };
    match kind.as_str() {
        "none" => return Ok(1.0),
        "linear" => {}
        other => {
            return Err(meta.invalid(format!(
                "metadata key `{type_key}` is `{other}`: only `none` and `linear` RoPE scaling \
                 are implemented (Llama 3.1's scaling comes as `rope_freqs.weight`)"
            )));
        }
    }
    let factor = meta
        .opt_f32(&format!("{arch}.rope.scaling.factor"))
        .or_else(|| meta.opt_f32(&format!("{arch}.rope.scale_linear")))
        .unwrap_or(0.0);
    if factor == 0.0 {
        return Ok(1.0);
    }
    if !(factor.is_finite() && factor > 0.0) {
        return Err(meta.invalid(format!(
            "metadata key `{arch}.rope.scaling.factor` is {factor}, not a positive number"
        )));
    }
    Ok(1.0 / factor)
}

/// Whether a GGUF tensor name is one the Llama forward reads.
pub(crate) fn is_known_tensor(name: &str, layers: usize) -> bool {
    const GLOBAL: &[&str] = &[
        "token_embd.weight",
        "output_norm.weight",
        "output.weight",
        "rope_freqs.weight",
    ];
    const PER_LAYER: &[&str] = &[
        "attn_norm.weight",
        "attn_q.weight",
        "attn_k.weight",
        "attn_v.weight",
        "attn_output.weight",
        "ffn_norm.weight",
        "ffn_gate.weight",
        "ffn_up.weight",
        "ffn_down.weight",
    ];
    if GLOBAL.contains(&name) {
        return true;
    }
    let Some((layer, rest)) = name.strip_prefix("blk.").and_then(|r| r.split_once('.')) else {
        return false;
    };
    layer.parse::<usize>().is_ok_and(|l| l < layers) && PER_LAYER.contains(&rest)
}

/// Why a tensor outside the forward is refused (for the error message).
pub(crate) fn unknown_tensor_reason(name: &str) -> String {
    let what = if name.ends_with(".bias") {
        "a bias, which this forward does not add"
    } else if name.contains("exp") {
        "an expert (mixture-of-experts) weight"
    } else {
        "not one the Llama forward reads"
    };
    format!("tensor `{name}` is {what}; refusing rather than computing a different model")
}
