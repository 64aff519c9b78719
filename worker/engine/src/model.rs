//! The Llama forward pass: our int8 matmuls (candle's f32 GEMM for prefill),
//! with attention over the wire-layout cache written out by hand.
//!
//! One function, [`Model::forward`], serves prefill (one sequence, many
//! positions) and decode (many sequences, one position each): the rows of all
//! sequences are stacked and go through each projection as one matmul, while
//! RoPE and the cache writes run per sequence and attention per (row, KV
//! head), all on the model's thread pool. Every operation is
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

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use candle_core::{Device, Tensor};

mod config;
mod rope;

use crate::EngineError;
use crate::dense::{DenseWeights, PrefillProjections};
use crate::kv::{SeqCache, from_bf16};
use crate::qgemm::{Pool, QWeights};
use crate::tokenizer::Meta;
pub(crate) use config::Config;
use rayon::prelude::*;
use rope::Rope;

/// A projection `y = x · Wᵀ` with `W` `[out, inp]`.
pub(crate) struct Linear {
    /// 8-bit weights for our kernel.
    quant: QWeights,
    /// f32 weights for multi-row matmuls, when `prefill` keeps them.
    dense: Option<DenseWeights>,
    inp: usize,
    /// The choice this projection was built (and is patched) under.
    prefill: PrefillProjections,
}

impl Linear {
    /// Builds from f32 weights `[out, inp]`; f32 copies for prefills as
    /// `prefill` decides from the int8 blocks' exactness.
    fn new(w: &Tensor, prefill: PrefillProjections) -> Result<Linear, EngineError> {
        let (out, inp) = w.dims2()?;
        let data = w.flatten_all()?.to_vec1::<f32>()?;
        let quant = QWeights::quantize(&data, out, inp)?;
        let dense = if prefill.keeps_f32(quant.is_exact()) {
            Some(DenseWeights::new(data, out, inp)?)
        } else {
            None
        };
        Ok(Linear {
            quant,
            dense,
            inp,
            prefill,
        })
    }

    /// Whether prefills of more than one row take the f32 GEMM here.
    fn prefills_f32(&self) -> bool {
        self.dense.is_some()
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
            (Some(d), true) => d.matmul(&x, rows),
            _ => Ok(self.quant.matmul(&x, rows, pool)),
        }
    }

    /// This projection with row ranges replaced: each `(at, w)` puts the
    /// f32 rows `w` (`[n, inp]`) at row `at`. Rows are quantized one by one,
    /// so the result is the projection a fresh build from the patched
    /// weights gives, bit for bit; the other rows are copied, never re-read.
    fn patched(&self, parts: &[(usize, &Tensor)]) -> Result<Linear, EngineError> {
        let mut quant = None;
        let mut dense = self.dense.clone();
        for (at, w) in parts {
            let (n, inp) = w.dims2()?;
            if inp != self.inp {
                return Err(EngineError::Other(format!(
                    "a patch of width {inp} for a projection of width {}",
                    self.inp
                )));
            }
            let data = w.flatten_all()?.to_vec1::<f32>()?;
            let part = QWeights::quantize(&data, n, inp)?;
            quant = Some(quant.as_ref().unwrap_or(&self.quant).splice(*at, &part)?);
            if let Some(d) = &dense {
                dense = Some(d.splice(*at, &data)?);
            }
        }
        let quant = quant.unwrap_or_else(|| self.quant.clone());
        // What a fresh build from the patched weights keeps: the f32 copy
        // follows the patched blocks' exactness. A projection without one
        // was exact, so its int8 blocks give its f32 weights back.
        let dense = match (self.prefill.keeps_f32(quant.is_exact()), dense) {
            (false, _) => None,
            (true, Some(d)) => Some(d),
            (true, None) => {
                let mut d = DenseWeights::new(self.quant.dequantize(), self.quant.out(), self.inp)?;
                for (at, w) in parts {
                    let (n, inp) = w.dims2()?;
                    let data = w.flatten_all()?.to_vec1::<f32>()?;
                    debug_assert_eq!(data.len(), n * inp);
                    d = d.splice(*at, &data)?;
                }
                Some(d)
            }
        };
        Ok(Linear {
            quant,
            dense,
            inp: self.inp,
            prefill: self.prefill,
        })
    }
}

/// One block. Projections are shared (`Arc`) between a model and the one a
/// weight update derives from it when their tensors did not change.
#[derive(Clone)]
struct Layer {
    attn_norm: Vec<f32>,
    qkv: Arc<Linear>,
    wo: Arc<Linear>,
    ffn_norm: Vec<f32>,
    gate_up: Arc<Linear>,
    down: Arc<Linear>,
}

/// A loaded Llama.
pub(crate) struct Model {
    pub(crate) cfg: Config,
    embed: Arc<[f32]>,
    layers: Vec<Layer>,
    out_norm: Vec<f32>,
    lm_head: Arc<Linear>,
    /// Whether the output head is the embedding table (no `output.weight`).
    tied_head: bool,
    rope: Rope,
    /// `rope_freqs.weight`, when the file has it (a variant rebuilds the
    /// table from it).
    freq_factors: Option<Vec<f32>>,
    max_pos: usize,
    /// Threads of the quantized matmuls.
    pool: Pool,
    /// The weights' identity ([`crate::identity`]); set by whoever built
    /// the model from its tensors.
    pub(crate) weight_version: String,
    /// Every tensor's record (empty for a model not built from a file).
    pub(crate) tensors: crate::identity::WeightDigest,
    /// The digest of the file's tokenizer metadata
    /// ([`crate::manifest::tokenizer_digest`]; zero when not from a file).
    pub(crate) tokenizer_digest: [u8; 32],
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
        prefill: PrefillProjections,
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
                qkv: Arc::new(Linear::new(&qkv, prefill)?),
                wo: Arc::new(Linear::new(&need(&p("attn_output"))?, prefill)?),
                ffn_norm: vec1(need(&p("ffn_norm"))?)?,
                gate_up: Arc::new(Linear::new(&gate_up, prefill)?),
                down: Arc::new(Linear::new(&need(&p("ffn_down"))?, prefill)?),
            });
        }
        let out_norm = vec1(need("output_norm.weight")?)?;
        let (lm_head, tied_head) = match get("output.weight")? {
            Some(w) => (Linear::new(&w, PrefillProjections::Int8)?, false),
            None => (Linear::new(&embed_t, PrefillProjections::Int8)?, true),
        };
        let embed: Arc<[f32]> = vec1(embed_t)?.into();
        let freq_factors = get("rope_freqs.weight")?.map(vec1).transpose()?;
        let rope = Rope::new(
            cfg.rope_dims,
            cfg.rope_base,
            cfg.rope_freq_scale,
            freq_factors.as_deref(),
            max_pos,
        )?;
        Ok(Model {
            cfg,
            embed,
            layers,
            out_norm,
            lm_head: Arc::new(lm_head),
            tied_head,
            rope,
            freq_factors,
            max_pos,
            pool: Pool::new(candle_core::utils::get_num_threads())?,
            weight_version: String::new(),
            tensors: Default::default(),
            tokenizer_digest: [0; 32],
        })
    }

    /// This model for `max_pos` positions: every weight shared, the RoPE
    /// table rebuilt (a position's entries do not depend on the table's
    /// length).
    pub(crate) fn with_max_pos(&self, max_pos: usize) -> Result<Model, EngineError> {
        let mut m = self.patched(&HashMap::new())?;
        if max_pos != self.max_pos {
            let c = &self.cfg;
            m.rope = Rope::new(
                c.rope_dims,
                c.rope_base,
                c.rope_freq_scale,
                self.freq_factors.as_deref(),
                max_pos,
            )?;
            m.max_pos = max_pos;
        }
        m.weight_version = self.weight_version.clone();
        m.tensors = self.tensors.clone();
        Ok(m)
    }

    /// A model with the tensors in `changed` (f32, by GGUF name, each the
    /// shape of the one it replaces) and every other weight shared with
    /// this one: what [`Model::build`] gives from the patched tensors, bit
    /// for bit (`tests`: a patched model's logits equal a fresh build's).
    /// Its `weight_version` and records are the caller's to set.
    pub(crate) fn patched(&self, changed: &HashMap<String, Tensor>) -> Result<Model, EngineError> {
        let c = &self.cfg;
        let vec1 = |t: &Tensor| -> Result<Vec<f32>, EngineError> {
            Ok(t.flatten_all()?.to_vec1::<f32>()?)
        };
        let norm = |name: String, old: &Vec<f32>| -> Result<Vec<f32>, EngineError> {
            match changed.get(&name) {
                Some(t) => {
                    let v = vec1(t)?;
                    if v.len() != old.len() {
                        return Err(EngineError::Other(format!(
                            "tensor `{name}` has {} values, the running model's {}",
                            v.len(),
                            old.len()
                        )));
                    }
                    Ok(v)
                }
                None => Ok(old.clone()),
            }
        };
        // A projection fused from `members` (name, rows), rebuilt only where
        // a member changed.
        let fused =
            |old: &Arc<Linear>, members: &[(String, usize)]| -> Result<Arc<Linear>, EngineError> {
                let mut parts = Vec::new();
                let mut at = 0;
                for (name, rows) in members {
                    if let Some(t) = changed.get(name) {
                        if t.dims2()?.0 != *rows {
                            return Err(EngineError::Other(format!(
                                "tensor `{name}` has {:?} rows, the running model's {rows}",
                                t.dims()
                            )));
                        }
                        parts.push((at, t));
                    }
                    at += rows;
                }
                if parts.is_empty() {
                    Ok(old.clone())
                } else {
                    Ok(Arc::new(old.patched(&parts)?))
                }
            };
        let (q_rows, kv_rows) = (c.heads * c.head_dim, c.kv_heads * c.head_dim);
        let mut layers = Vec::with_capacity(self.layers.len());
        for (i, l) in self.layers.iter().enumerate() {
            let p = |n: &str| format!("blk.{i}.{n}.weight");
            layers.push(Layer {
                attn_norm: norm(p("attn_norm"), &l.attn_norm)?,
                qkv: fused(
                    &l.qkv,
                    &[
                        (p("attn_q"), q_rows),
                        (p("attn_k"), kv_rows),
                        (p("attn_v"), kv_rows),
                    ],
                )?,
                wo: fused(&l.wo, &[(p("attn_output"), c.hidden)])?,
                ffn_norm: norm(p("ffn_norm"), &l.ffn_norm)?,
                gate_up: fused(&l.gate_up, &[(p("ffn_gate"), c.ffn), (p("ffn_up"), c.ffn)])?,
                down: fused(&l.down, &[(p("ffn_down"), c.hidden)])?,
            });
        }
        let out_norm = norm("output_norm.weight".into(), &self.out_norm)?;
        let embed: Arc<[f32]> = match changed.get("token_embd.weight") {
            Some(t) => {
                if t.dims2()? != (c.vocab, c.hidden) {
                    return Err(EngineError::Other(format!(
                        "token_embd has shape {:?}, the running model's [{}, {}]",
                        t.dims(),
                        c.vocab,
                        c.hidden
                    )));
                }
                vec1(t)?.into()
            }
            None => self.embed.clone(),
        };
        let head_source = if self.tied_head {
            "token_embd.weight"
        } else {
            "output.weight"
        };
        let lm_head = fused(&self.lm_head, &[(head_source.to_string(), c.vocab)])?;
        let (rope, freq_factors) = match changed.get("rope_freqs.weight") {
            Some(t) => {
                let f = vec1(t)?;
                let rope = Rope::new(
                    c.rope_dims,
                    c.rope_base,
                    c.rope_freq_scale,
                    Some(&f),
                    self.max_pos,
                )?;
                (rope, Some(f))
            }
            None => (self.rope.clone(), self.freq_factors.clone()),
        };
        Ok(Model {
            cfg: self.cfg.clone(),
            embed,
            layers,
            out_norm,
            lm_head,
            tied_head: self.tied_head,
            rope,
            freq_factors,
            max_pos: self.max_pos,
            pool: Pool::new(self.pool.threads())?,
            weight_version: String::new(),
            tensors: Default::default(),
            tokenizer_digest: self.tokenizer_digest,
        })
    }

    /// Loads a GGUF Llama.
    pub(crate) fn load_gguf(
        path: &Path,
        max_pos: usize,
        prefill: PrefillProjections,
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
        let mut names: Vec<&String> = content.tensor_infos.keys().collect();
        names.sort();
        if let Some(name) = names
            .iter()
            .find(|n| !config::is_known_tensor(n, cfg.layers))
        {
            return Err(invalid(config::unknown_tensor_reason(name), None));
        }
        // Every tensor's stored bytes go into the weights' identity, read
        // once: those the model uses as it loads them, any other after.
        let mut digest = crate::identity::WeightDigest::new();
        let read = |name: &str,
                    file: &mut std::io::BufReader<std::fs::File>,
                    digest: &mut crate::identity::WeightDigest|
         -> Result<candle_core::quantized::QTensor, EngineError> {
            let q = content
                .tensor(file, name, &Device::Cpu)
                .map_err(|e| invalid(format!("reading tensor `{name}`"), Some(e)))?;
            let bytes = q
                .data()
                .map_err(|e| invalid(format!("reading tensor `{name}`"), Some(e)))?;
            digest.add(name, &format!("{:?}", q.dtype()), q.shape().dims(), &bytes);
            Ok(q)
        };
        let mut model = Model::build(
            cfg,
            |name| {
                if !content.tensor_infos.contains_key(name) {
                    return Ok(None);
                }
                let q = read(name, &mut file, &mut digest)?;
                let t = q
                    .dequantize(&Device::Cpu)
                    .map_err(|e| invalid(format!("dequantizing tensor `{name}`"), Some(e)))?;
                Ok(Some(t))
            },
            max_pos,
            prefill,
        )
        .map_err(|e| match e {
            EngineError::Other(reason) => invalid(reason, None),
            e => e,
        })?;
        for name in names {
            if !digest.contains(name) {
                read(name, &mut file, &mut digest)?;
            }
        }
        model.weight_version = digest.finish();
        model.tensors = digest;
        model.tokenizer_digest = crate::manifest::tokenizer_digest(&content.metadata);
        if let Some(n) = meta.opt_uint("llama.vocab_size")
            && n as usize != model.cfg.vocab
        {
            return Err(invalid(
                format!(
                    "metadata key `llama.vocab_size` is {n} but the embedding table has {} rows",
                    model.cfg.vocab
                ),
                None,
            ));
        }
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

    /// One row of the fused Q/K/V output (`row`): its query with RoPE into
    /// `q`, its key with RoPE (in `k`) and its value into `cache` at `pos`.
    fn rope_and_store(
        &self,
        li: usize,
        cache: &mut SeqCache,
        pos: usize,
        row: &[f32],
        q: &mut [f32],
        k: &mut [f32],
    ) {
        let c = &self.cfg;
        let (qw, kw) = (c.heads * c.head_dim, c.kv_heads * c.head_dim);
        q.copy_from_slice(&row[..qw]);
        k.copy_from_slice(&row[qw..qw + kw]);
        self.rope.apply(q, c.heads, c.head_dim, pos);
        self.rope.apply(k, c.kv_heads, c.head_dim, pos);
        cache.write(li, pos, k, &row[qw + kw..qw + 2 * kw]);
    }

    /// One decode position per sequence: RoPE, the cache write and attention
    /// of each sequence in one task (see `forward_on`).
    fn attend_sequences(
        &self,
        li: usize,
        seqs: &mut [SeqStep<'_>],
        qkv: &[f32],
        attn: &mut [f32],
        scale: f32,
    ) {
        let c = &self.cfg;
        let hd = c.head_dim;
        let (q_width, kv_width) = (c.heads * hd, c.kv_heads * hd);
        let width = q_width + 2 * kv_width;
        let span = (c.heads / c.kv_heads) * hd;
        let task = |buf: &mut AttnBuf, ((s, r), out): ((&mut SeqStep<'_>, &[f32]), &mut [f32])| {
            let pos = s.cache.tokens;
            let layout = s.cache.layout;
            for g in 0..c.kv_heads {
                prefetch_kv(&s.cache.k[li], &s.cache.v[li], layout, g, pos + 1);
            }
            let mut q = std::mem::take(&mut buf.q);
            let mut k = std::mem::take(&mut buf.k);
            q.resize(q_width, 0.0);
            k.resize(kv_width, 0.0);
            self.rope_and_store(li, s.cache, pos, r, &mut q, &mut k);
            for (g, out) in out.chunks_exact_mut(span).enumerate() {
                attend(
                    &q[g * span..(g + 1) * span],
                    &s.cache.k[li],
                    &s.cache.v[li],
                    layout,
                    g,
                    pos + 1,
                    scale,
                    buf,
                    out,
                );
            }
            (buf.q, buf.k) = (q, k);
        };
        self.pool.install(|| {
            seqs.par_iter_mut()
                .zip(qkv.par_chunks(width))
                .zip(attn.par_chunks_mut(q_width))
                .for_each_init(AttnBuf::default, task)
        });
    }

    /// Weights each token is multiplied by: every layer's projections and
    /// the output head.
    pub(crate) fn matmul_weights(&self) -> u64 {
        let size = |l: &Linear| (l.quant.out() * l.inp) as u64;
        let layers: u64 = self
            .layers
            .iter()
            .map(|l| size(&l.qkv) + size(&l.wo) + size(&l.gate_up) + size(&l.down))
            .sum();
        layers + size(&self.lm_head)
    }

    /// Whether prefill rows and decode rows may share a forward: no
    /// projection prefills on the f32 GEMM, so every row takes the int8
    /// kernel and computes as it would alone.
    pub(crate) fn mixes_prefill_and_decode(&self) -> bool {
        self.f32_prefill_projections().0 == 0
    }

    /// How many of the layers' projections prefill on the f32 GEMM, of how
    /// many (the rest take the int8 kernel): [`PrefillProjections`] as
    /// resolved at load.
    pub(crate) fn f32_prefill_projections(&self) -> (usize, usize) {
        let all = self
            .layers
            .iter()
            .flat_map(|l| [&l.qkv, &l.wo, &l.gate_up, &l.down]);
        let total = self.layers.len() * 4;
        (all.filter(|p| p.prefills_f32()).count(), total)
    }

    /// Runs new tokens of each sequence through the model, appending their K/V to the
    /// sequences' caches; returns the logits of each sequence's last new token,
    /// `[sequences, vocab]` in one buffer.
    /// `dense` uses the f32 weights (if loaded) for the projections.
    pub(crate) fn forward(
        &self,
        seqs: &mut [SeqStep<'_>],
        dense: bool,
    ) -> Result<Vec<f32>, EngineError> {
        if dense {
            // candle's f32 GEMM schedules its own threads.
            self.forward_on(seqs, true)
        } else {
            // The whole step on one pool worker: its matmuls then split
            // columns over the pool without a hand-off from this thread each.
            self.pool.install(|| self.forward_on(seqs, false))
        }
    }

    fn forward_on(&self, seqs: &mut [SeqStep<'_>], dense: bool) -> Result<Vec<f32>, EngineError> {
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
        for (li, layer) in self.layers.iter().enumerate() {
            let mut h = vec![0f32; rows * d];
            rms_norm(&x, &layer.attn_norm, c.eps, &mut h);
            let qkv = layer.qkv.forward(h, rows, dense, &self.pool)?;
            let mut attn = vec![0f32; rows * q_width];
            let width = q_width + 2 * kv_width;
            if seqs.len() >= self.pool.threads() && seqs.iter().all(|s| s.tokens.len() == 1) {
                // Decode with a sequence per thread or more: one task per
                // sequence does RoPE, writes its K/V and runs its attention
                // (all heads), so the cache lines the write needs are the
                // ones attention reads, asked for once. The same operations
                // per head as the phases below.
                self.attend_sequences(li, seqs, &qkv, &mut attn, scale);
                drop(qkv);
            } else {
                let mut qs = vec![0f32; rows * q_width];
                // RoPE and the new K/V into each sequence's cache first (position
                // t attends to 0..=start+t), sequences in parallel: each writes
                // only its own cache.
                let mut jobs: Vec<(&mut SeqStep<'_>, &[f32], &mut [f32])> =
                    Vec::with_capacity(seqs.len());
                {
                    let (mut qkv_rest, mut q_rest) = (&qkv[..], &mut qs[..]);
                    for s in seqs.iter_mut() {
                        let n = s.tokens.len();
                        let (a, b) = qkv_rest.split_at(n * width);
                        let (qa, qb) = std::mem::take(&mut q_rest).split_at_mut(n * q_width);
                        jobs.push((s, a, qa));
                        (qkv_rest, q_rest) = (b, qb);
                    }
                }
                let write = |(s, r, q): (&mut SeqStep<'_>, &[f32], &mut [f32])| {
                    let start = s.cache.tokens;
                    let mut k = vec![0f32; kv_width];
                    for (t, (r, q)) in r
                        .chunks_exact(width)
                        .zip(q.chunks_exact_mut(q_width))
                        .enumerate()
                    {
                        self.rope_and_store(li, s.cache, start + t, r, q, &mut k);
                    }
                };
                self.pool.install(|| jobs.into_par_iter().for_each(write));
                drop(qkv);
                // Attention, one task per (row, KV head): the head's query heads
                // together, so its K/V rows are read once for all of them.
                let mut tasks: Vec<(&SeqCache, usize)> = Vec::with_capacity(rows);
                for s in seqs.iter() {
                    let start = s.cache.tokens;
                    tasks.extend((0..s.tokens.len()).map(|t| (&*s.cache, start + t + 1)));
                }
                let span = group * hd;
                // Each worker takes runs of consecutive tasks and asks for the
                // next task's K/V lines before computing the current one, so the
                // cache reads of one overlap the arithmetic of the other.
                let count = rows * c.kv_heads;
                let run = count.div_ceil(2 * self.pool.threads()).max(1);
                let kv_of = |i: usize| {
                    let (cache, n) = tasks[i / c.kv_heads];
                    (cache, n, i % c.kv_heads)
                };
                let prefetch = |i: usize| {
                    let (cache, n, g) = kv_of(i);
                    prefetch_kv(&cache.k[li], &cache.v[li], cache.layout, g, n);
                };
                let head_run = |buf: &mut AttnBuf, (r, outs): (usize, &mut [f32])| {
                    let first = r * run;
                    prefetch(first);
                    for (j, out) in outs.chunks_exact_mut(span).enumerate() {
                        let i = first + j;
                        if i + 1 < count {
                            prefetch(i + 1);
                        }
                        let (cache, n, g) = kv_of(i);
                        let q = &qs[i * span..(i + 1) * span];
                        attend(
                            q,
                            &cache.k[li],
                            &cache.v[li],
                            cache.layout,
                            g,
                            n,
                            scale,
                            buf,
                            out,
                        );
                    }
                };
                self.pool.install(|| {
                    attn.par_chunks_mut(run * span)
                        .enumerate()
                        .for_each_init(AttnBuf::default, head_run)
                });
                drop(tasks);
            }
            let o = layer.wo.forward(attn, rows, dense, &self.pool)?;
            for (x, o) in x.iter_mut().zip(&o) {
                *x += o;
            }
            let mut h = vec![0f32; rows * d];
            rms_norm(&x, &layer.ffn_norm, c.eps, &mut h);
            let gu = layer.gate_up.forward(h, rows, dense, &self.pool)?;
            let mut act = vec![0f32; rows * c.ffn];
            // SwiGLU, each row's gate and up halves in pieces over the pool.
            let ffn = c.ffn;
            let piece = ffn.div_ceil(4).max(64);
            let swiglu = |r: usize, j: usize, a: &mut [f32]| {
                let gate = &gu[r * 2 * ffn + j..r * 2 * ffn + j + a.len()];
                let up = &gu[r * 2 * ffn + ffn + j..r * 2 * ffn + ffn + j + a.len()];
                crate::vmath::swiglu(gate, up, a);
            };
            self.pool.install(|| {
                act.par_chunks_mut(ffn).enumerate().for_each(|(r, row)| {
                    row.par_chunks_mut(piece)
                        .enumerate()
                        .for_each(|(i, a)| swiglu(r, i * piece, a))
                })
            });
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
        Ok(logits)
    }
}

/// Scratch space of an attention task.
#[derive(Default)]
struct AttnBuf {
    /// `[group][positions]` scores, then probabilities.
    scores: Vec<f32>,
    /// A row's queries and new keys, for RoPE (per-sequence tasks).
    q: Vec<f32>,
    k: Vec<f32>,
}

/// Asks for every cache line of KV head `g`'s positions `0..n`: the K rows
/// are 1 KB apart (`[head_dim, S]`), a pattern the hardware prefetchers do
/// not follow, so without this each row's lines are waited for one after
/// the other.
#[inline(always)]
fn prefetch_kv(kc: &[u16], vc: &[u16], layout: rngd_kv_wire::KvLayout, g: usize, n: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        const LINE: usize = 64 / size_of::<u16>();
        for dim in 0..layout.head_dim {
            let row = &kc[layout.k_offset(g, dim, 0)..][..n];
            for line in row.chunks(LINE) {
                // SAFETY: SSE is part of the x86-64 baseline, and a prefetch
                // only hints (the address is in the slice anyway).
                unsafe { _mm_prefetch::<_MM_HINT_T0>(line.as_ptr().cast()) };
            }
        }
        let v = &vc[layout.v_offset(g, 0, 0)..][..n * layout.head_dim];
        for line in v.chunks(LINE) {
            // SAFETY: as above.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(line.as_ptr().cast()) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (kc, vc, layout, g, n);
}

/// Attention of the query heads `q` (`[group, head_dim]`) that share KV head
/// `g`, over positions `0..n`, into `out` (`[group, head_dim]`).
///
/// The cache is bf16 in the wire layout (K `[head_dim, S]`, V `[S, head_dim]`
/// per head); each K and V row is widened once and used by every query head
/// of the group. Each score `q · k_s` is a `mul_add` over the dimensions in
/// order: one order for every query, whether it came from a prefill or a
/// decode step, and whatever else shares its batch.
#[allow(clippy::too_many_arguments)]
fn attend(
    q: &[f32],
    kc: &[u16],
    vc: &[u16],
    layout: rngd_kv_wire::KvLayout,
    g: usize,
    n: usize,
    scale: f32,
    buf: &mut AttnBuf,
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if crate::qgemm::has_fma() {
        // SAFETY: the CPU has AVX2 and FMA (detected just above).
        return unsafe { attend_fma(q, kc, vc, layout, g, n, scale, buf, out) };
    }
    attend_impl(q, kc, vc, layout, g, n, scale, buf, out)
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
    buf: &mut AttnBuf,
    out: &mut [f32],
) {
    attend_impl(q, kc, vc, layout, g, n, scale, buf, out)
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
    buf: &mut AttnBuf,
    out: &mut [f32],
) {
    let hd = layout.head_dim;
    let heads = q.len() / hd;
    let scores = &mut buf.scores;
    scores.clear();
    scores.resize(heads * n, 0.0);
    // K is `[head_dim, S]` per head. Scores are made 8 positions at a time
    // for up to 4 query heads, accumulators in registers: each dimension's
    // 8 keys are widened once and added to every head's scores. Every score
    // sees the dimensions in order, one `mul_add` each.
    for s0 in (0..n).step_by(8) {
        let len = (n - s0).min(8);
        for h0 in (0..heads).step_by(4) {
            let qh = &q[h0 * hd..];
            let sc = &mut scores[h0 * n..];
            match (heads - h0).min(4) {
                1 => score_block::<1>(qh, kc, layout, g, s0, len, n, sc),
                2 => score_block::<2>(qh, kc, layout, g, s0, len, n, sc),
                3 => score_block::<3>(qh, kc, layout, g, s0, len, n, sc),
                _ => score_block::<4>(qh, kc, layout, g, s0, len, n, sc),
            }
        }
    }
    let mut inv = [0f32; 16];
    let mut inv_big = Vec::new();
    let inv: &mut [f32] = if heads <= inv.len() {
        &mut inv[..heads]
    } else {
        inv_big.resize(heads, 0.0);
        &mut inv_big
    };
    for (sc, inv) in scores.chunks_exact_mut(n).zip(inv.iter_mut()) {
        let mut max = f32::NEG_INFINITY;
        for s in sc.iter_mut() {
            *s *= scale;
            max = max.max(*s);
        }
        for s in sc.iter_mut() {
            *s -= max;
        }
        crate::vmath::exp_in_place(sc);
        let sum = sc.iter().fold(0f32, |a, s| a + s);
        *inv = 1.0 / sum;
    }
    // V is `[S, head_dim]` per head: 16 dimensions at a time for up to 4
    // query heads, each position's values widened once. Every output sums
    // the positions in order, one `mul_add` each.
    for d0 in (0..hd).step_by(16) {
        let len = (hd - d0).min(16);
        for h0 in (0..heads).step_by(4) {
            let (p, inv) = (&scores[h0 * n..], &inv[h0..]);
            let o = &mut out[h0 * hd..];
            match (heads - h0).min(4) {
                1 => value_block::<1>(p, inv, vc, layout, g, n, d0, len, o),
                2 => value_block::<2>(p, inv, vc, layout, g, n, d0, len, o),
                3 => value_block::<3>(p, inv, vc, layout, g, n, d0, len, o),
                _ => value_block::<4>(p, inv, vc, layout, g, n, d0, len, o),
            }
        }
    }
}

/// Up to `N` bf16 values widened to f32, zeros past the end of `x`. A full
/// block takes the fixed-length path, which vectorizes.
#[inline(always)]
fn widen<const N: usize>(x: &[u16]) -> [f32; N] {
    let mut out = [0f32; N];
    match <&[u16; N]>::try_from(x) {
        Ok(full) => {
            for (o, x) in out.iter_mut().zip(full) {
                *o = from_bf16(*x);
            }
        }
        Err(_) => {
            for (o, x) in out.iter_mut().zip(x) {
                *o = from_bf16(*x);
            }
        }
    }
    out
}

/// Scores of `H` query heads (`q`: `[H, head_dim]`) for positions `s0..s0 +
/// len` (len ≤ 8) into `scores` (`[H, n]`).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn score_block<const H: usize>(
    q: &[f32],
    kc: &[u16],
    layout: rngd_kv_wire::KvLayout,
    g: usize,
    s0: usize,
    len: usize,
    n: usize,
    scores: &mut [f32],
) {
    let hd = layout.head_dim;
    let mut acc = [[0f32; 8]; H];
    for dim in 0..hd {
        let at = layout.k_offset(g, dim, s0);
        let k = widen::<8>(&kc[at..at + len]);
        for (h, acc) in acc.iter_mut().enumerate() {
            let qd = q[h * hd + dim];
            for (a, k) in acc.iter_mut().zip(&k) {
                *a = k.mul_add(qd, *a);
            }
        }
    }
    for (h, acc) in acc.iter().enumerate() {
        scores[h * n + s0..h * n + s0 + len].copy_from_slice(&acc[..len]);
    }
}

/// Outputs of `H` query heads for dimensions `d0..d0 + len` (len ≤ 16):
/// `Σ_pos p[h][pos] · inv[h] · v[pos]`, into `out` (`[H, head_dim]`).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn value_block<const H: usize>(
    p: &[f32],
    inv: &[f32],
    vc: &[u16],
    layout: rngd_kv_wire::KvLayout,
    g: usize,
    n: usize,
    d0: usize,
    len: usize,
    out: &mut [f32],
) {
    let hd = layout.head_dim;
    let mut acc = [[0f32; 16]; H];
    for pos in 0..n {
        let at = layout.v_offset(g, pos, d0);
        let v = widen::<16>(&vc[at..at + len]);
        for (h, acc) in acc.iter_mut().enumerate() {
            let w = p[h * n + pos] * inv[h];
            for (a, v) in acc.iter_mut().zip(&v) {
                *a = v.mul_add(w, *a);
            }
        }
    }
    for (h, acc) in acc.iter().enumerate() {
        out[h * hd + d0..h * hd + d0 + len].copy_from_slice(&acc[..len]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rngd_kv_wire::{Dtype, KvLayout};

    /// `[out, inp]` weights made of Q4_1 blocks (`q · d + m`): exact int8 blocks.
    fn q4_1_weights(out: usize, inp: usize) -> Vec<f32> {
        (0..out * inp)
            .map(|i| ((i * 7 + i / inp) % 16) as f32 * 0.03125 - 0.25)
            .collect()
    }

    /// Auto keeps f32 weights only for inexact blocks; a patch that makes
    /// an exact projection inexact gets what a fresh build of the patched
    /// weights has (the f32 copy rebuilt from the int8 blocks), bit for bit,
    /// and one that makes it exact again drops the copy.
    #[test]
    fn prefill_kernels_follow_the_weights_exactness_through_a_patch() {
        let (out, inp, rows) = (48, 64, 9);
        let exact = q4_1_weights(out, inp);
        let t = |w: &[f32], n: usize| Tensor::from_slice(w, (n, inp), &Device::Cpu).unwrap();
        let auto = PrefillProjections::Auto;
        let lin = Linear::new(&t(&exact, out), auto).unwrap();
        assert!(!lin.prefills_f32());
        assert!(
            Linear::new(&t(&exact, out), PrefillProjections::F32)
                .unwrap()
                .prefills_f32()
        );
        let noisy: Vec<f32> = (0..8 * inp)
            .map(|i| ((i * 37) % 101) as f32 / 97.0 - 0.5)
            .collect();
        let patched = lin.patched(&[(16, &t(&noisy, 8))]).unwrap();
        let mut spliced = exact.clone();
        spliced[16 * inp..24 * inp].copy_from_slice(&noisy);
        let fresh = Linear::new(&t(&spliced, out), auto).unwrap();
        assert!(patched.prefills_f32() && fresh.prefills_f32());
        let pool = Pool::new(1).unwrap();
        let x: Vec<f32> = (0..rows * inp)
            .map(|i| ((i * 13) % 29) as f32 / 29.0 - 0.5)
            .collect();
        let a = patched.forward(x.clone(), rows, true, &pool).unwrap();
        let b = fresh.forward(x.clone(), rows, true, &pool).unwrap();
        assert!(a.iter().zip(&b).all(|(a, b)| a.to_bits() == b.to_bits()));
        // Patched back to exact weights: the int8 kernel again, as fresh.
        let back = patched
            .patched(&[(16, &t(&exact[16 * inp..24 * inp], 8))])
            .unwrap();
        assert!(!back.prefills_f32());
        let c = back.forward(x.clone(), rows, true, &pool).unwrap();
        let d = lin.forward(x, rows, true, &pool).unwrap();
        assert!(c.iter().zip(&d).all(|(a, b)| a.to_bits() == b.to_bits()));
    }

    /// Attention written the plain way: one head at a time, one position or
    /// dimension at a time, the same operation order the blocked kernel
    /// promises.
    fn attend_reference(
        q: &[f32],
        c: &SeqCache,
        layer: usize,
        g: usize,
        n: usize,
        scale: f32,
    ) -> Vec<f32> {
        let l = c.layout;
        let hd = l.head_dim;
        let mut out = vec![0f32; q.len()];
        for (qh, out) in q.chunks_exact(hd).zip(out.chunks_exact_mut(hd)) {
            let mut sc = vec![0f32; n];
            for (dim, qd) in qh.iter().enumerate() {
                for (pos, s) in sc.iter_mut().enumerate() {
                    *s = from_bf16(c.k[layer][l.k_offset(g, dim, pos)]).mul_add(*qd, *s);
                }
            }
            let max = sc
                .iter()
                .map(|s| s * scale)
                .fold(f32::NEG_INFINITY, f32::max);
            let p: Vec<f32> = sc
                .iter()
                .map(|s| crate::vmath::exp(s * scale - max))
                .collect();
            let inv = 1.0 / p.iter().fold(0f32, |a, s| a + s);
            for (pos, p) in p.iter().enumerate() {
                let w = p * inv;
                for (dim, o) in out.iter_mut().enumerate() {
                    *o = from_bf16(c.v[layer][l.v_offset(g, pos, dim)]).mul_add(w, *o);
                }
            }
        }
        out
    }

    #[test]
    fn blocked_attention_gives_the_plain_loops_bits() {
        let l = KvLayout {
            layers: 2,
            kv_heads: 2,
            head_dim: 24,
            seq_len: 40,
            dtype: Dtype::Bf16,
        };
        let mut c = SeqCache::new(l);
        let val = |i: usize| ((i * 7919) % 1009) as f32 / 1009.0 - 0.5;
        for pos in 0..l.seq_len {
            for layer in 0..l.layers {
                let k: Vec<f32> = (0..48).map(|i| val(i + 48 * pos + 3 * layer)).collect();
                let v: Vec<f32> = (0..48).map(|i| val(5 * i + pos + layer)).collect();
                c.write(layer, pos, &k, &v);
            }
        }
        let mut buf = AttnBuf::default();
        // 1..=6 query heads per KV head (chunks of 4 and a rest), every tail
        // length of the position and dimension blocks.
        for heads in 1..=6 {
            let q: Vec<f32> = (0..heads * 24).map(|i| val(31 * i + heads)).collect();
            for n in [1, 7, 8, 9, 17, 40] {
                for g in 0..2 {
                    let mut out = vec![0f32; q.len()];
                    attend(&q, &c.k[1], &c.v[1], l, g, n, 0.2, &mut buf, &mut out);
                    let want = attend_reference(&q, &c, 1, g, n, 0.2);
                    assert_eq!(out, want, "heads {heads} n {n} g {g}");
                }
            }
        }
    }
}
