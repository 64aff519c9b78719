//! A measurement probe: the CPU engine's raw logits at every position of a
//! token sequence, through the prefill path and through the decode path.
//!
//! It is not a serving path. It exists so the numerics of the engine can be
//! compared with a float64 reference forward and with llama.cpp
//! (`tests/python/test_numerics.py`, through `rngd-pd-bench logits`). It runs
//! the same [`Model`] code the scheduler runs, with the same choice of kernels:
//!
//! - [`LogitsProbe::prefill_logits`]: row `i` is the logits a prefill of the
//!   prefix `ids[..=i]` samples its first token from (the projections on
//!   the kernels [`PrefillProjections`] chose when the prefix is longer
//!   than one token, as the scheduler does; the output head always through
//!   the int8 kernel).
//! - [`LogitsProbe::decode_logits`]: a prefill of `ids[..k]`, its cache
//!   exported and imported as a PD split carries it, then `ids[k..]` fed
//!   one token per decode step (teacher-forced); row `j` is the logits at
//!   position `k - 1 + j`, the first row the prefill's.

use std::path::Path;

use rngd_kv_wire::{Dtype, KvLayout};

use crate::EngineError;
use crate::dense::PrefillProjections;
use crate::kv::SeqCache;
use crate::model::{Model, SeqStep};

/// A loaded model that answers logits instead of tokens. See the module docs.
pub struct LogitsProbe {
    model: Model,
    layout: KvLayout,
}

impl std::fmt::Debug for LogitsProbe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LogitsProbe")
            .field("layout", &self.layout)
            .finish()
    }
}

impl LogitsProbe {
    /// Loads a GGUF model as [`crate::cpu::CpuEngine::load`] does, its
    /// prefills' projections as `prefill` chooses, with context length
    /// `seq_len` and `threads` decode-matmul threads (`None` = candle's count).
    pub fn load(
        path: &Path,
        seq_len: usize,
        threads: Option<usize>,
        prefill: PrefillProjections,
    ) -> Result<LogitsProbe, EngineError> {
        if seq_len == 0 {
            return Err(EngineError::InvalidRequest(
                "seq_len must be at least 1".into(),
            ));
        }
        let (mut model, _tokenizer) = Model::load_gguf(path, seq_len, prefill)?;
        if let Some(t) = threads {
            model.set_threads(t)?;
        }
        Ok(LogitsProbe::from_model(model, seq_len))
    }

    fn from_model(model: Model, seq_len: usize) -> LogitsProbe {
        let c = &model.cfg;
        let layout = KvLayout {
            layers: c.layers,
            kv_heads: c.kv_heads,
            head_dim: c.head_dim,
            seq_len,
            dtype: Dtype::Bf16,
        };
        LogitsProbe { model, layout }
    }

    /// Vocabulary size: the width of every logits row.
    pub fn vocab(&self) -> usize {
        self.model.cfg.vocab
    }

    /// One prefill of `prompt` into `cache` (reset first): its last row's logits.
    fn prefill(&self, prompt: &[u32], cache: &mut SeqCache) -> Result<Vec<f32>, EngineError> {
        cache.reset();
        // The scheduler's rule: a one-token prompt runs the decode kernels.
        let dense = prompt.len() > 1;
        self.model.forward(
            &mut [SeqStep {
                tokens: prompt,
                cache,
            }],
            dense,
        )
    }

    /// Rows `[ids.len(), vocab]`: row `i` from a prefill of `ids[..=i]`.
    pub fn prefill_logits(&self, ids: &[u32]) -> Result<Vec<f32>, EngineError> {
        self.check(ids)?;
        let mut cache = SeqCache::new(self.layout);
        let mut out = Vec::with_capacity(ids.len() * self.vocab());
        for end in 1..=ids.len() {
            out.extend(self.prefill(&ids[..end], &mut cache)?);
        }
        Ok(out)
    }

    /// Rows `[ids.len() - prefill_len + 1, vocab]`: the prefill of
    /// `ids[..prefill_len]`, then one decode step per remaining id.
    pub fn decode_logits(&self, ids: &[u32], prefill_len: usize) -> Result<Vec<f32>, EngineError> {
        self.check(ids)?;
        if prefill_len == 0 || prefill_len > ids.len() {
            return Err(EngineError::InvalidRequest(format!(
                "prefill length {prefill_len} is not in 1..={}",
                ids.len()
            )));
        }
        let mut prefill_cache = SeqCache::new(self.layout);
        let mut out = self.prefill(&ids[..prefill_len], &mut prefill_cache)?;
        // The cache crosses to the decoder as the wire carries it.
        let mut cache = SeqCache::new(self.layout);
        cache.import(&prefill_cache.export())?;
        drop(prefill_cache);
        for id in &ids[prefill_len..] {
            let step = [*id];
            out.extend(self.model.forward(
                &mut [SeqStep {
                    tokens: &step,
                    cache: &mut cache,
                }],
                false,
            )?);
        }
        Ok(out)
    }

    fn check(&self, ids: &[u32]) -> Result<(), EngineError> {
        if ids.is_empty() {
            return Err(EngineError::InvalidRequest("no token ids".into()));
        }
        if ids.len() > self.layout.seq_len {
            return Err(EngineError::InvalidRequest(format!(
                "{} ids do not fit the context length {}",
                ids.len(),
                self.layout.seq_len
            )));
        }
        Ok(())
    }
}

#[cfg(all(test, feature = "test-util"))]
mod tests {
    use super::*;
    use crate::{Engine, GenEvent, SamplingParams};

    fn tiny_probe(seq_len: usize) -> LogitsProbe {
        let model = crate::tiny::model(&crate::tiny::TinyConfig::default(), seq_len).expect("tiny");
        LogitsProbe::from_model(model, seq_len)
    }

    /// The greedy rule: the highest logit, the lowest id on ties.
    fn argmax(row: &[f32]) -> u32 {
        let mut best = 0;
        for (i, x) in row.iter().enumerate() {
            if *x > row[best] {
                best = i;
            }
        }
        best as u32
    }

    /// The probe computes what the engine samples from: fed the prompt and
    /// the engine's own greedy tokens, the arg-max of each decode row is the
    /// next token the engine generated, and the decode path's first row is
    /// bit for bit the prefill path's row at that position.
    #[test]
    fn decode_rows_give_the_engines_greedy_tokens() {
        let prompt: Vec<u32> = (0..9).map(|i| 40 + 13 * i).collect();
        let engine = crate::tiny::engine(64, 1).expect("tiny engine");
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        let generated: Vec<u32> = rt.block_on(async {
            let mut rx = engine
                .generate(&prompt, &SamplingParams::greedy(12))
                .await
                .expect("generate");
            let mut ids = Vec::new();
            while let Some(ev) = rx.recv().await {
                match ev {
                    GenEvent::Token { id, .. } => ids.push(id),
                    GenEvent::Done { .. } => break,
                    GenEvent::Error(e) => panic!("{e}"),
                }
            }
            ids
        });
        assert!(generated.len() >= 2, "{generated:?}");
        let probe = tiny_probe(64);
        let v = probe.vocab();
        let mut ids = prompt.clone();
        ids.extend(&generated);
        let dec = probe.decode_logits(&ids, prompt.len()).expect("decode");
        assert_eq!(dec.len(), (generated.len() + 1) * v);
        let got: Vec<u32> = dec.chunks_exact(v).map(argmax).collect();
        assert_eq!(&got[..generated.len()], &generated[..]);
        let pre = probe.prefill_logits(&ids).expect("prefill");
        assert_eq!(pre.len(), ids.len() * v);
        let at = prompt.len() - 1;
        assert_eq!(&pre[at * v..(at + 1) * v], &dec[..v]);
    }

    /// The two paths compute the same function with different kernels: close,
    /// not equal; one-token prefixes run the same int8 kernels in both.
    #[test]
    fn the_paths_agree_closely_and_one_token_prefills_exactly() {
        let probe = tiny_probe(32);
        let v = probe.vocab();
        let ids: Vec<u32> = (0..20).map(|i| (7 + 31 * i) % 250).collect();
        let pre = probe.prefill_logits(&ids).expect("prefill");
        let dec = probe.decode_logits(&ids, 1).expect("decode");
        assert_eq!(pre.len(), dec.len());
        assert_eq!(&pre[..v], &dec[..v]);
        let scale = pre.iter().fold(0f32, |m, x| m.max(x.abs()));
        let err = pre
            .iter()
            .zip(&dec)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(err > 0.0, "the dense and int8 paths are different kernels");
        assert!(
            err < 0.05 * scale,
            "max error {err} against logits up to {scale}"
        );
    }

    #[test]
    fn bad_lengths_are_refused() {
        let probe = tiny_probe(8);
        assert!(probe.prefill_logits(&[]).is_err());
        assert!(probe.prefill_logits(&[1; 9]).is_err());
        assert!(probe.decode_logits(&[1, 2, 3], 0).is_err());
        assert!(probe.decode_logits(&[1, 2, 3], 4).is_err());
    }
}
