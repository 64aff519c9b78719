//! The Llama forward pass on candle-core matmuls, with attention over the
//! wire-layout cache written out by hand.
//!
//! One function, [`Model::forward`], serves prefill (one sequence, many
//! positions) and decode (many sequences, one position each): the rows of all
//! sequences are stacked and go through each projection as one matmul, while
//! RoPE, the cache writes and attention run per sequence. Every operation is
//! row-independent (each output row depends only on its own input row and its
//! own cache), so a stream's tokens do not depend on which other streams share
//! its batch.
//!
//! Weights: every projection is quantized at load to 8-bit blocks in our own
//! layout ([`crate::qgemm`]: int8 × int8 kernel, weights read once per step
//! for all rows of the batch); optionally a dequantized f32 copy serves
//! multi-row (prefill) matmuls through candle's f32 GEMM. The embedding table
//! is kept in f32 and the output head is tied to it when the file has no
//! `output.weight`.

use std::path::Path;

use candle_core::quantized::QMatMul;
use candle_core::{Device, Module, Tensor};

use crate::EngineError;
use crate::kv::{SeqCache, from_bf16};
use crate::qgemm::{Pool, QWeights};
use crate::tokenizer::Meta;
use rayon::prelude::*;

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
    pub(crate) eps: f32,
}

impl Config {
    /// Reads the `llama.*` metadata of a GGUF file.
    pub(crate) fn from_meta(meta: &Meta<'_>) -> Result<Config, EngineError> {
        let arch = meta.string("general.architecture")?;
        if arch != "llama" {
            return Err(meta.invalid(format!(
                "architecture `{arch}` is not supported (only `llama` is)"
            )));
        }
        let key = |k: &str| format!("{arch}.{k}");
        let hidden = meta.uint(&key("embedding_length"))? as usize;
        let heads = meta.uint(&key("attention.head_count"))? as usize;
        let kv_heads = meta
            .opt_uint(&key("attention.head_count_kv"))
            .map(|x| x as usize)
            .unwrap_or(heads);
        if heads == 0
            || kv_heads == 0
            || !heads.is_multiple_of(kv_heads)
            || !hidden.is_multiple_of(heads)
        {
            return Err(meta.invalid(format!(
                "inconsistent attention shape: {heads} heads, {kv_heads} KV heads, hidden {hidden}"
            )));
        }
        let head_dim = meta
            .opt_uint(&key("attention.key_length"))
            .map(|x| x as usize)
            .unwrap_or(hidden / heads);
        let rope_dims = meta
            .opt_uint(&key("rope.dimension_count"))
            .map(|x| x as usize)
            .unwrap_or(head_dim);
        Ok(Config {
            vocab: 0, // filled from the embedding table
            hidden,
            ffn: meta.uint(&key("feed_forward_length"))? as usize,
            layers: meta.uint(&key("block_count"))? as usize,
            heads,
            kv_heads,
            head_dim,
            rope_dims: rope_dims.min(head_dim) & !1,
            rope_base: meta.opt_f32(&key("rope.freq_base")).unwrap_or(10_000.0),
            eps: meta
                .opt_f32(&key("attention.layer_norm_rms_epsilon"))
                .unwrap_or(1e-5),
        })
    }
}

/// A projection `y = x · Wᵀ` with `W` `[out, inp]`.
pub(crate) struct Linear {
    /// 8-bit weights for our kernel.
    quant: QWeights,
    /// f32 weights for multi-row matmuls, when enabled.
    dense: Option<QMatMul>,
    inp: usize,
}

impl Linear {
    /// Builds from f32 weights `[out, inp]`.
    fn new(w: &Tensor, keep_dense: bool) -> Result<Linear, EngineError> {
        let (out, inp) = w.dims2()?;
        let data = w.flatten_all()?.to_vec1::<f32>()?;
        let quant = QWeights::quantize(&data, out, inp)?;
        let dense = keep_dense.then(|| QMatMul::Tensor(w.clone()));
        Ok(Linear { quant, dense, inp })
    }

    /// `rows` input rows (row-major in `x`) → output rows `[rows, out]`.
    fn forward(
        &self,
        x: Vec<f32>,
        rows: usize,
        dense: bool,
        pool: &Pool,
    ) -> Result<Vec<f32>, EngineError> {
        match (&self.dense, dense) {
            (Some(d), true) => {
                let t = Tensor::from_vec(x, (rows, self.inp), &Device::Cpu)?;
                Ok(d.forward(&t)?.flatten_all()?.to_vec1::<f32>()?)
            }
            _ => Ok(self.quant.matmul(&x, rows, pool)),
        }
    }
}

struct Layer {
    attn_norm: Vec<f32>,
    qkv: Linear,
    wo: Linear,
    ffn_norm: Vec<f32>,
    gate_up: Linear,
    down: Linear,
}

/// A loaded Llama.
pub(crate) struct Model {
    pub(crate) cfg: Config,
    embed: Vec<f32>,
    layers: Vec<Layer>,
    out_norm: Vec<f32>,
    lm_head: Linear,
    /// `[positions, rope_dims / 2]`.
    rope_cos: Vec<f32>,
    rope_sin: Vec<f32>,
    max_pos: usize,
    /// Threads of the quantized matmuls.
    pool: Pool,
}

/// One sequence's part of a forward pass: new tokens appended to its cache.
pub(crate) struct SeqStep<'a> {
    pub(crate) tokens: &'a [u32],
    pub(crate) cache: &'a mut SeqCache,
}

fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if crate::qgemm::has_fma() {
        // SAFETY: the CPU has AVX2 and FMA (detected just above).
        return unsafe { rms_norm_fma(x, w, eps, out) };
    }
    rms_norm_impl(x, w, eps, out)
}

/// [`rms_norm`] compiled with FMA instructions: the same results (`mul_add`
/// rounds once either way), without a libm call per element.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn rms_norm_fma(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    rms_norm_impl(x, w, eps, out)
}

#[inline(always)]
fn rms_norm_impl(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let n = w.len();
    for (row, o) in x.chunks_exact(n).zip(out.chunks_exact_mut(n)) {
        let mut ss = 0f32;
        for v in row {
            ss = v.mul_add(*v, ss);
        }
        let scale = 1.0 / (ss / n as f32 + eps).sqrt();
        for ((o, v), w) in o.iter_mut().zip(row).zip(w) {
            *o = v * scale * w;
        }
    }
}

impl Model {
    /// Builds the model from f32 tensors found by name (GGUF names: `token_embd.weight`,
    /// `blk.N.attn_q.weight`, …). `max_pos` bounds the RoPE table.
    pub(crate) fn build(
        mut cfg: Config,
        mut get: impl FnMut(&str) -> Result<Option<Tensor>, EngineError>,
        max_pos: usize,
        keep_dense: bool,
    ) -> Result<Model, EngineError> {
        let mut need = |name: &str| -> Result<Tensor, EngineError> {
            get(name)?.ok_or_else(|| EngineError::Other(format!("tensor `{name}` is missing")))
        };
        let embed_t = need("token_embd.weight")?;
        let (vocab, hidden) = embed_t.dims2()?;
        if hidden != cfg.hidden {
            return Err(EngineError::Other(format!(
                "token_embd has width {hidden}, the metadata says {}",
                cfg.hidden
            )));
        }
        cfg.vocab = vocab;
        let vec1 =
            |t: Tensor| -> Result<Vec<f32>, EngineError> { Ok(t.flatten_all()?.to_vec1::<f32>()?) };
        let mut layers = Vec::with_capacity(cfg.layers);
        for i in 0..cfg.layers {
            let p = |n: &str| format!("blk.{i}.{n}.weight");
            let q = need(&p("attn_q"))?;
            let k = need(&p("attn_k"))?;
            let v = need(&p("attn_v"))?;
            let qkv = Tensor::cat(&[&q, &k, &v], 0)?;
            let expect = (cfg.heads + 2 * cfg.kv_heads) * cfg.head_dim;
            if qkv.dims2()? != (expect, cfg.hidden) {
                return Err(EngineError::Other(format!(
                    "layer {i}: q/k/v shapes {:?} {:?} {:?} do not match the metadata",
                    q.dims(),
                    k.dims(),
                    v.dims()
                )));
            }
            let gate = need(&p("ffn_gate"))?;
            let up = need(&p("ffn_up"))?;
            let gate_up = Tensor::cat(&[&gate, &up], 0)?;
            layers.push(Layer {
                attn_norm: vec1(need(&p("attn_norm"))?)?,
                qkv: Linear::new(&qkv, keep_dense)?,
                wo: Linear::new(&need(&p("attn_output"))?, keep_dense)?,
                ffn_norm: vec1(need(&p("ffn_norm"))?)?,
                gate_up: Linear::new(&gate_up, keep_dense)?,
                down: Linear::new(&need(&p("ffn_down"))?, keep_dense)?,
            });
        }
        let out_norm = vec1(need("output_norm.weight")?)?;
        let lm_head = match get("output.weight")? {
            Some(w) => Linear::new(&w, false)?,
            None => Linear::new(&embed_t, false)?,
        };
        let embed = vec1(embed_t)?;
        let half = cfg.rope_dims / 2;
        let mut rope_cos = Vec::with_capacity(max_pos * half);
        let mut rope_sin = Vec::with_capacity(max_pos * half);
        for pos in 0..max_pos {
            for i in 0..half {
                let freq = (cfg.rope_base as f64).powf(-((2 * i) as f64) / cfg.rope_dims as f64);
                let theta = pos as f64 * freq;
                rope_cos.push(theta.cos() as f32);
                rope_sin.push(theta.sin() as f32);
            }
        }
        Ok(Model {
            cfg,
            embed,
            layers,
            out_norm,
            lm_head,
            rope_cos,
            rope_sin,
            max_pos,
            pool: Pool::new(candle_core::utils::get_num_threads())?,
        })
    }

    /// Loads a GGUF Llama.
    pub(crate) fn load_gguf(
        path: &Path,
        max_pos: usize,
        keep_dense: bool,
    ) -> Result<(Model, crate::tokenizer::Tokenizer), EngineError> {
        let (content, mut file) = crate::tokenizer::read_gguf_header(path)?;
        let meta = Meta {
            map: &content.metadata,
            path,
        };
        let cfg = Config::from_meta(&meta)?;
        let tokenizer = crate::tokenizer::Tokenizer::from_metadata(&content.metadata, path)?;
        let invalid =
            |reason: String, source: Option<candle_core::Error>| EngineError::InvalidModel {
                path: path.to_path_buf(),
                reason,
                source: source.map(Box::new),
            };
        let model = Model::build(
            cfg,
            |name| {
                if !content.tensor_infos.contains_key(name) {
                    return Ok(None);
                }
                let q = content
                    .tensor(&mut file, name, &Device::Cpu)
                    .map_err(|e| invalid(format!("reading tensor `{name}`"), Some(e)))?;
                let t = q
                    .dequantize(&Device::Cpu)
                    .map_err(|e| invalid(format!("dequantizing tensor `{name}`"), Some(e)))?;
                Ok(Some(t))
            },
            max_pos,
            keep_dense,
        )
        .map_err(|e| match e {
            EngineError::Other(reason) => invalid(reason, None),
            e => e,
        })?;
        if model.cfg.vocab != tokenizer.vocab_size() {
            return Err(invalid(
                format!(
                    "the tokenizer has {} tokens but the embedding table {} rows",
                    tokenizer.vocab_size(),
                    model.cfg.vocab
                ),
                None,
            ));
        }
        Ok((model, tokenizer))
    }

    /// Sizes the quantized matmuls' thread pool.
    pub(crate) fn set_threads(&mut self, threads: usize) -> Result<(), EngineError> {
        if threads != self.pool.threads() {
            self.pool = Pool::new(threads)?;
        }
        Ok(())
    }

    /// Threads of the quantized matmuls.
    pub(crate) fn threads(&self) -> usize {
        self.pool.threads()
    }

    /// Applies RoPE (adjacent pairs, GGUF llama convention) to `n_heads` heads of `x` at `pos`.
    fn rope(&self, x: &mut [f32], n_heads: usize, pos: usize) {
        let half = self.cfg.rope_dims / 2;
        let cos = &self.rope_cos[pos * half..(pos + 1) * half];
        let sin = &self.rope_sin[pos * half..(pos + 1) * half];
        for h in 0..n_heads {
            let head = &mut x[h * self.cfg.head_dim..(h + 1) * self.cfg.head_dim];
            for i in 0..half {
                let (a, b) = (head[2 * i], head[2 * i + 1]);
                head[2 * i] = a * cos[i] - b * sin[i];
                head[2 * i + 1] = a * sin[i] + b * cos[i];
            }
        }
    }

    /// Runs new tokens of each sequence through the model, appending their K/V to the
    /// sequences' caches; returns the logits of each sequence's last new token.
    /// `dense` uses the f32 weights (if loaded) for the projections.
    pub(crate) fn forward(
        &self,
        seqs: &mut [SeqStep<'_>],
        dense: bool,
    ) -> Result<Vec<Vec<f32>>, EngineError> {
        if dense {
            // candle's f32 GEMM schedules its own threads.
            self.forward_on(seqs, true)
        } else {
            // The whole step on one pool worker: its matmuls then split
            // columns over the pool without a hand-off from this thread each.
            self.pool.install(|| self.forward_on(seqs, false))
        }
    }

    fn forward_on(
        &self,
        seqs: &mut [SeqStep<'_>],
        dense: bool,
    ) -> Result<Vec<Vec<f32>>, EngineError> {
        let c = &self.cfg;
        let d = c.hidden;
        let hd = c.head_dim;
        let q_width = c.heads * hd;
        let kv_width = c.kv_heads * hd;
        let group = c.heads / c.kv_heads;
        let rows: usize = seqs.iter().map(|s| s.tokens.len()).sum();
        for s in seqs.iter() {
            if s.tokens.is_empty() {
                return Err(EngineError::InvalidRequest(
                    "a forward step with no tokens".into(),
                ));
            }
            let end = s.cache.tokens + s.tokens.len();
            if end > s.cache.layout.seq_len || end > self.max_pos {
                return Err(EngineError::InvalidRequest(format!(
                    "position {end} is past the context length {}",
                    s.cache.layout.seq_len
                )));
            }
            if let Some(t) = s.tokens.iter().find(|t| **t as usize >= c.vocab) {
                return Err(EngineError::InvalidRequest(format!(
                    "token id {t} is outside the vocabulary of {}",
                    c.vocab
                )));
            }
        }
        let mut x = Vec::with_capacity(rows * d);
        for s in seqs.iter() {
            for t in s.tokens {
                x.extend_from_slice(&self.embed[*t as usize * d..(*t as usize + 1) * d]);
            }
        }
        let scale = 1.0 / (hd as f32).sqrt();
        let mut k = vec![0f32; kv_width];
        for (li, layer) in self.layers.iter().enumerate() {
            let mut h = vec![0f32; rows * d];
            rms_norm(&x, &layer.attn_norm, c.eps, &mut h);
            let qkv = layer.qkv.forward(h, rows, dense, &self.pool)?;
            let mut attn = vec![0f32; rows * q_width];
            let mut qs = vec![0f32; rows * q_width];
            let width = q_width + 2 * kv_width;
            // Write the new K/V first: position t attends to 0..=start+t.
            let mut row = 0;
            for s in seqs.iter_mut() {
                let start = s.cache.tokens;
                for t in 0..s.tokens.len() {
                    let r = &qkv[(row + t) * width..(row + t + 1) * width];
                    let q = &mut qs[(row + t) * q_width..(row + t + 1) * q_width];
                    q.copy_from_slice(&r[..q_width]);
                    k.copy_from_slice(&r[q_width..q_width + kv_width]);
                    self.rope(q, c.heads, start + t);
                    self.rope(&mut k, c.kv_heads, start + t);
                    s.cache.write(li, start + t, &k, &r[q_width + kv_width..]);
                }
                row += s.tokens.len();
            }
            drop(qkv);
            // Attention, one task per row (all its heads), over the pool.
            let mut tasks: Vec<(&SeqCache, usize)> = Vec::with_capacity(rows);
            for s in seqs.iter() {
                let start = s.cache.tokens;
                tasks.extend((0..s.tokens.len()).map(|t| (&*s.cache, start + t + 1)));
            }
            let head_task = |scores: &mut Vec<f32>, ((q, out), (cache, n)): AttnTask<'_, '_>| {
                for (head, out) in out.chunks_exact_mut(hd).enumerate() {
                    let qh = &q[head * hd..(head + 1) * hd];
                    let (kc, vc) = (&cache.k[li], &cache.v[li]);
                    attend(
                        qh,
                        kc,
                        vc,
                        cache.layout,
                        head / group,
                        *n,
                        scale,
                        scores,
                        out,
                    );
                }
            };
            self.pool.install(|| {
                qs.par_chunks(q_width)
                    .zip(attn.par_chunks_mut(q_width))
                    .zip(tasks.par_iter())
                    .for_each_init(Vec::new, head_task)
            });
            drop(tasks);
            let o = layer.wo.forward(attn, rows, dense, &self.pool)?;
            for (x, o) in x.iter_mut().zip(&o) {
                *x += o;
            }
            let mut h = vec![0f32; rows * d];
            rms_norm(&x, &layer.ffn_norm, c.eps, &mut h);
            let gu = layer.gate_up.forward(h, rows, dense, &self.pool)?;
            let mut act = vec![0f32; rows * c.ffn];
            // SwiGLU in pieces of 256 values over the pool.
            let ffn = c.ffn;
            let swiglu = |(i, a): (usize, &mut [f32])| {
                for (e, a) in (i * 256..).zip(a) {
                    let (r, j) = (e / ffn, e % ffn);
                    let (g, u) = (gu[r * 2 * ffn + j], gu[r * 2 * ffn + ffn + j]);
                    *a = g / (1.0 + (-g).exp()) * u;
                }
            };
            self.pool
                .install(|| act.par_chunks_mut(256).enumerate().for_each(swiglu));
            drop(gu);
            let down = layer.down.forward(act, rows, dense, &self.pool)?;
            for (x, o) in x.iter_mut().zip(&down) {
                *x += o;
            }
        }
        // Final norm and head for the last new row of each sequence.
        let mut last = Vec::with_capacity(seqs.len() * d);
        let mut row = 0;
        for s in seqs.iter_mut() {
            row += s.tokens.len();
            last.extend_from_slice(&x[(row - 1) * d..row * d]);
            s.cache.tokens += s.tokens.len();
        }
        let mut h = vec![0f32; last.len()];
        rms_norm(&last, &self.out_norm, c.eps, &mut h);
        let logits = self.lm_head.forward(h, seqs.len(), false, &self.pool)?;
        Ok(logits.chunks_exact(c.vocab).map(<[f32]>::to_vec).collect())
    }
}

/// One row's attention work: (its query, its output), (its cache, positions).
type AttnTask<'a, 'c> = ((&'a [f32], &'a mut [f32]), &'a (&'c SeqCache, usize));

/// Attention of one query head over positions `0..n` of KV head `g`.
///
/// The cache is bf16 in the wire layout (K `[head_dim, S]`, V `[S, head_dim]`
/// per head), widened as it is read. Each score `q · k_s` is a `mul_add`
/// over the dimensions in order: one order for every query, whether it came
/// from a prefill or a decode step, and whatever else shares its batch.
#[allow(clippy::too_many_arguments)]
fn attend(
    q: &[f32],
    kc: &[u16],
    vc: &[u16],
    layout: rngd_kv_wire::KvLayout,
    g: usize,
    n: usize,
    scale: f32,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if crate::qgemm::has_fma() {
        // SAFETY: the CPU has AVX2 and FMA (detected just above).
        return unsafe { attend_fma(q, kc, vc, layout, g, n, scale, scores, out) };
    }
    attend_impl(q, kc, vc, layout, g, n, scale, scores, out)
}

/// [`attend`] compiled with FMA instructions: bit-identical (each `mul_add` is
/// one rounding either way, and vectorizing over positions or dimensions
/// keeps every element's operation order).
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma")]
fn attend_fma(
    q: &[f32],
    kc: &[u16],
    vc: &[u16],
    layout: rngd_kv_wire::KvLayout,
    g: usize,
    n: usize,
    scale: f32,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    attend_impl(q, kc, vc, layout, g, n, scale, scores, out)
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn attend_impl(
    q: &[f32],
    kc: &[u16],
    vc: &[u16],
    layout: rngd_kv_wire::KvLayout,
    g: usize,
    n: usize,
    scale: f32,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    let hd = layout.head_dim;
    scores.clear();
    scores.resize(n, 0.0);
    // K is `[head_dim, S]` per head: each dimension adds its contiguous row
    // of positions to the scores (vectorized over positions; every score sees
    // the dimensions in order, one `mul_add` each).
    for (dim, qd) in q.iter().enumerate() {
        let at = layout.k_offset(g, dim, 0);
        for (s, k) in scores.iter_mut().zip(&kc[at..at + n]) {
            *s = from_bf16(*k).mul_add(*qd, *s);
        }
    }
    let mut max = f32::NEG_INFINITY;
    for s in scores.iter_mut() {
        *s *= scale;
        max = max.max(*s);
    }
    let mut sum = 0f32;
    for s in scores.iter_mut() {
        *s = (*s - max).exp();
        sum += *s;
    }
    let inv = 1.0 / sum;
    out.fill(0.0);
    for (pos, p) in scores.iter().enumerate() {
        let w = p * inv;
        let at = layout.v_offset(g, pos, 0);
        for (o, v) in out.iter_mut().zip(&vc[at..at + hd]) {
            *o = from_bf16(*v).mul_add(w, *o);
        }
    }
}
