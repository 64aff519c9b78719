//! Loading GGUF Llamas: tied and untied output heads, `rope_freqs.weight`,
//! and the refusals (an unsupported architecture, RoPE scaling, feature key,
//! extra tensor or tensor type is an `InvalidModel` error naming it). The
//! files are small random Llamas written here with candle's GGUF writer.

use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use rngd_engine::cpu::{CpuEngine, CpuEngineOptions};
use rngd_engine::{Engine, EngineError, GenEvent, SamplingParams};

const HIDDEN: usize = 64;
const FFN: usize = 128;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const HEAD_DIM: usize = HIDDEN / HEADS;

/// A byte-level vocabulary (GPT-2's alphabet) plus `<|endoftext|>` (control).
fn vocab() -> (Vec<String>, Vec<i32>) {
    let mut tokens = Vec::new();
    let mut extra = 0u32;
    for b in 0..256u32 {
        let printable =
            (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
        let c = if printable {
            b
        } else {
            extra += 1;
            255 + extra
        };
        tokens.push(char::from_u32(c).unwrap().to_string());
    }
    tokens.push("Ġt".into());
    let mut types = vec![1; tokens.len()];
    tokens.push("<|endoftext|>".into());
    types.push(3);
    (tokens, types)
}

fn random(shape: &[usize], seed: u64, scale: f32) -> Tensor {
    let n: usize = shape.iter().product();
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let data: Vec<f32> = (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect();
    Tensor::from_vec(data, shape, &Device::Cpu).unwrap()
}

/// Metadata entries and named tensors of a GGUF file.
type Meta = Vec<(String, Value)>;
type Tensors = Vec<(String, Tensor)>;

/// The metadata and tensors of a one-layer random Llama.
fn parts(tied: bool) -> (Meta, Tensors) {
    let (tokens, types) = vocab();
    let n_vocab = tokens.len();
    let s = |x: &str| Value::String(x.into());
    let meta = vec![
        ("general.architecture".into(), s("llama")),
        ("general.name".into(), s("tiny-test")),
        ("llama.block_count".into(), Value::U32(1)),
        ("llama.embedding_length".into(), Value::U32(HIDDEN as u32)),
        ("llama.feed_forward_length".into(), Value::U32(FFN as u32)),
        (
            "llama.attention.head_count".into(),
            Value::U32(HEADS as u32),
        ),
        (
            "llama.attention.head_count_kv".into(),
            Value::U32(KV_HEADS as u32),
        ),
        ("llama.rope.freq_base".into(), Value::F32(10_000.0)),
        (
            "llama.attention.layer_norm_rms_epsilon".into(),
            Value::F32(1e-5),
        ),
        ("tokenizer.ggml.model".into(), s("gpt2")),
        ("tokenizer.ggml.pre".into(), s("smollm")),
        (
            "tokenizer.ggml.tokens".into(),
            Value::Array(tokens.iter().map(|t| s(t)).collect()),
        ),
        (
            "tokenizer.ggml.token_type".into(),
            Value::Array(types.into_iter().map(Value::I32).collect()),
        ),
        ("tokenizer.ggml.merges".into(), Value::Array(vec![s("Ġ t")])),
        (
            "tokenizer.ggml.eos_token_id".into(),
            Value::U32(n_vocab as u32 - 1),
        ),
    ];
    let kvw = KV_HEADS * HEAD_DIM;
    let mut tensors = vec![
        (
            "token_embd.weight".to_string(),
            random(&[n_vocab, HIDDEN], 1, 1.0),
        ),
        (
            "output_norm.weight".into(),
            Tensor::ones(HIDDEN, candle_core::DType::F32, &Device::Cpu).unwrap(),
        ),
        (
            "blk.0.attn_norm.weight".into(),
            Tensor::ones(HIDDEN, candle_core::DType::F32, &Device::Cpu).unwrap(),
        ),
        (
            "blk.0.ffn_norm.weight".into(),
            Tensor::ones(HIDDEN, candle_core::DType::F32, &Device::Cpu).unwrap(),
        ),
        (
            "blk.0.attn_q.weight".into(),
            random(&[HIDDEN, HIDDEN], 2, 0.25),
        ),
        (
            "blk.0.attn_k.weight".into(),
            random(&[kvw, HIDDEN], 3, 0.25),
        ),
        (
            "blk.0.attn_v.weight".into(),
            random(&[kvw, HIDDEN], 4, 0.25),
        ),
        (
            "blk.0.attn_output.weight".into(),
            random(&[HIDDEN, HIDDEN], 5, 0.25),
        ),
        (
            "blk.0.ffn_gate.weight".into(),
            random(&[FFN, HIDDEN], 6, 0.25),
        ),
        (
            "blk.0.ffn_up.weight".into(),
            random(&[FFN, HIDDEN], 7, 0.25),
        ),
        (
            "blk.0.ffn_down.weight".into(),
            random(&[HIDDEN, FFN], 8, 0.18),
        ),
    ];
    if !tied {
        tensors.push(("output.weight".into(), random(&[n_vocab, HIDDEN], 9, 0.5)));
    }
    (meta, tensors)
}

fn write(
    dir: &Path,
    name: &str,
    meta: &[(String, Value)],
    tensors: &[(String, Tensor)],
) -> PathBuf {
    let path = dir.join(name);
    let q: Vec<(String, QTensor)> = tensors
        .iter()
        .map(|(n, t)| (n.clone(), QTensor::quantize(t, GgmlDType::F32).unwrap()))
        .collect();
    let m: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let t: Vec<(&str, &QTensor)> = q.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut f = std::fs::File::create(&path).unwrap();
    gguf_file::write(&mut f, &m, &t).unwrap();
    path
}

fn load(path: &Path) -> Result<std::sync::Arc<CpuEngine>, EngineError> {
    let mut o = CpuEngineOptions::new(path);
    o.seq_len = 64;
    o.batch = 1;
    CpuEngine::load(o)
}

async fn greedy(e: &CpuEngine, n: usize) -> Vec<u32> {
    let prompt = e.tokenize("the tiny test prompt").unwrap();
    let mut rx = e
        .generate(&prompt, &SamplingParams::greedy(n))
        .await
        .unwrap();
    let mut ids = Vec::new();
    while let Some(ev) = rx.recv().await {
        if let GenEvent::Token { id, .. } = ev {
            ids.push(id);
        }
    }
    ids
}

/// Loads `meta`/`tensors` after `edit`; the error's text.
fn refusal(edit: impl FnOnce(&mut Meta, &mut Tensors)) -> String {
    let dir = tempfile::tempdir().unwrap();
    let (mut meta, mut tensors) = parts(false);
    edit(&mut meta, &mut tensors);
    let err = load(&write(dir.path(), "m.gguf", &meta, &tensors)).unwrap_err();
    assert!(matches!(err, EngineError::InvalidModel { .. }), "{err:?}");
    err.to_string()
}

fn set(meta: &mut Meta, key: &str, v: Value) {
    meta.retain(|(k, _)| k != key);
    meta.push((key.into(), v));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tied_and_untied_heads_and_rope_freqs_load_and_generate() {
    let dir = tempfile::tempdir().unwrap();
    let (meta, tensors) = parts(false);
    let untied = load(&write(dir.path(), "untied.gguf", &meta, &tensors)).unwrap();
    let (tmeta, ttensors) = parts(true);
    let tied = load(&write(dir.path(), "tied.gguf", &tmeta, &ttensors)).unwrap();
    let (a, b) = (greedy(&untied, 8).await, greedy(&tied, 8).await);
    assert_eq!(a.len(), 8);
    assert_eq!(b.len(), 8);
    assert_ne!(
        a, b,
        "the tied head is the embedding table, not output.weight"
    );
    // All-ones divisors are plain RoPE: the same tokens.
    let mut ones = tensors.clone();
    ones.push((
        "rope_freqs.weight".into(),
        Tensor::ones(HEAD_DIM / 2, candle_core::DType::F32, &Device::Cpu).unwrap(),
    ));
    let with_ones = load(&write(dir.path(), "ones.gguf", &meta, &ones)).unwrap();
    assert_eq!(greedy(&with_ones, 8).await, a);
}

#[test]
fn rope_freqs_of_the_wrong_length_is_refused() {
    let err = refusal(|_, t| {
        t.push((
            "rope_freqs.weight".into(),
            Tensor::ones(3, candle_core::DType::F32, &Device::Cpu).unwrap(),
        ))
    });
    assert!(err.contains("rope_freqs.weight"), "{err}");
}

#[test]
fn an_unsupported_architecture_is_refused_by_name() {
    let err = refusal(|m, _| set(m, "general.architecture", Value::String("qwen2".into())));
    assert!(
        err.contains("general.architecture") && err.contains("qwen2"),
        "{err}"
    );
}

#[test]
fn a_vocabulary_other_than_byte_level_bpe_is_refused_by_name() {
    let err = refusal(|m, _| set(m, "tokenizer.ggml.model", Value::String("llama".into())));
    assert!(
        err.contains("tokenizer.ggml.model") && err.contains("`llama`"),
        "{err}"
    );
    let err = refusal(|m, _| set(m, "tokenizer.ggml.pre", Value::String("qwen2".into())));
    assert!(
        err.contains("tokenizer.ggml.pre") && err.contains("`qwen2`"),
        "{err}"
    );
}

#[test]
fn unimplemented_rope_scalings_are_refused_and_linear_is_read() {
    for kind in ["yarn", "longrope", "llama3"] {
        let err = refusal(|m, _| set(m, "llama.rope.scaling.type", Value::String(kind.into())));
        assert!(
            err.contains("llama.rope.scaling.type") && err.contains(kind),
            "{err}"
        );
    }
    let err = refusal(|m, _| {
        set(m, "llama.rope.scaling.type", Value::String("linear".into()));
        set(m, "llama.rope.scaling.factor", Value::F32(-2.0));
    });
    assert!(err.contains("llama.rope.scaling.factor"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn linear_rope_scaling_is_read() {
    let dir = tempfile::tempdir().unwrap();
    let (meta, tensors) = parts(false);
    let plain = load(&write(dir.path(), "a.gguf", &meta, &tensors)).unwrap();
    let mut scaled_meta = meta.clone();
    set(
        &mut scaled_meta,
        "llama.rope.scaling.type",
        Value::String("linear".into()),
    );
    set(
        &mut scaled_meta,
        "llama.rope.scaling.factor",
        Value::F32(1.0),
    );
    let factor_one = load(&write(dir.path(), "b.gguf", &scaled_meta, &tensors)).unwrap();
    assert_eq!(greedy(&factor_one, 8).await, greedy(&plain, 8).await);
    set(
        &mut scaled_meta,
        "llama.rope.scaling.factor",
        Value::F32(4.0),
    );
    let factor_four = load(&write(dir.path(), "c.gguf", &scaled_meta, &tensors)).unwrap();
    assert_ne!(greedy(&factor_four, 8).await, greedy(&plain, 8).await);
}

#[test]
fn features_the_forward_lacks_are_refused_by_key() {
    for (key, v) in [
        ("llama.expert_count", Value::U32(8)),
        ("llama.attention.sliding_window", Value::U32(32)),
        ("llama.attn_logit_softcapping", Value::F32(50.0)),
        ("llama.attention.value_length", Value::U32(8)),
        ("llama.vocab_size", Value::U32(1000)),
    ] {
        let err = refusal(|m, _| set(m, key, v));
        assert!(err.contains(key), "{key}: {err}");
    }
}

#[test]
fn tensors_the_forward_does_not_read_are_refused_by_name() {
    for name in [
        "blk.0.attn_q.bias",
        "blk.0.ffn_gate_exps.weight",
        "blk.1.attn_q.weight",
    ] {
        let err = refusal(|_, t| t.push((name.into(), random(&[HIDDEN], 10, 1.0))));
        assert!(err.contains(name), "{name}: {err}");
    }
}

/// A tensor of a type the reader does not know (IQ4_NL, GGML type 20) is
/// refused naming the tensor and the type.
#[test]
fn an_unreadable_tensor_type_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let (meta, tensors) = parts(false);
    let path = write(dir.path(), "iq.gguf", &meta, &tensors);
    // Patch the type field of blk.0.ffn_down.weight's tensor info: after the
    // name come n_dims (u32), the dims (u64 each), then the type (u32).
    let mut bytes = std::fs::read(&path).unwrap();
    let name = b"blk.0.ffn_down.weight";
    let at = bytes
        .windows(name.len())
        .position(|w| w == name)
        .expect("tensor info")
        + name.len();
    let n_dims = u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()) as usize;
    let ty = at + 4 + 8 * n_dims;
    assert_eq!(
        u32::from_le_bytes(bytes[ty..ty + 4].try_into().unwrap()),
        0,
        "F32 before the patch"
    );
    bytes[ty..ty + 4].copy_from_slice(&20u32.to_le_bytes());
    std::fs::write(&path, bytes).unwrap();
    let err = load(&path).unwrap_err().to_string();
    assert!(
        err.contains("blk.0.ffn_down.weight") && err.contains("IQ4_NL"),
        "{err}"
    );
}
