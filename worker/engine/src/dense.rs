//! The f32 projection path of prefills ([`PrefillProjections`]): `y = x · Wᵀ` with
//! the dequantized weights `W` (`[out, inp]`, row-major) read in place by
//! the `gemm` crate's f32 GEMM, the one candle's `matmul` calls.
//!
//! Through candle, a row-major output makes the GEMM compute `yᵀ = W · xᵀ`,
//! where `W` is the operand it copies into packed panels on every call: the
//! whole model's f32 weights rewritten per forward, whatever its row count
//! (about a third of a short prefill here). For a few rows
//! ([`IN_PLACE_MAX_ROWS`]) it is called with a column-major output instead,
//! so the problem keeps `x` as the packed operand and reads `W` where it
//! lies; for more, packing pays off and candle's orientation is kept.
//!
//! Same bits as candle's path: each output is the same sum of the same
//! products in the same order (the GEMM's `k` blocking depends on `k` and
//! the cache sizes only, a product commutes, and one accumulator runs over
//! each `k` block), so tokens, log-probabilities and the KV do not change
//! (`tests::equals_candles_matmul_bit_for_bit`).

use std::sync::Arc;

use crate::EngineError;

/// Which kernel computes a prefill's projections (`--prefill-projections`).
/// Either way a prompt row's result does not depend on the other rows of
/// its forward (from 8 rows on for the f32 GEMM), which warm == cold
/// prefills, chunked == whole prefills and PD == solo rest on; every worker
/// of a PD pair must take the same choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PrefillProjections {
    /// Per projection: the int8 kernel where its int8 blocks hold the
    /// file's weights exactly (Q4_1, Q8_0: activations rounded as llama.cpp
    /// rounds them, weights untouched), the f32 GEMM where they would round
    /// the weights too (F16, BF16, F32, K-quants). Decided at load.
    #[default]
    Auto,
    /// The f32 GEMM on dequantized weights (~4 bytes per parameter more
    /// memory; the lowest error against the model, the slowest prefill).
    F32,
    /// The int8 kernel of the decode path for every projection.
    Int8,
}

impl PrefillProjections {
    /// The flag's spellings, as listed in errors.
    pub const NAMES: &'static str = "auto, f32, int8";

    /// The choice named `name`.
    pub fn from_name(name: &str) -> Option<PrefillProjections> {
        match name {
            "auto" => Some(PrefillProjections::Auto),
            "f32" => Some(PrefillProjections::F32),
            "int8" => Some(PrefillProjections::Int8),
            _ => None,
        }
    }

    /// The flag's spelling of this choice.
    pub fn name(self) -> &'static str {
        match self {
            PrefillProjections::Auto => "auto",
            PrefillProjections::F32 => "f32",
            PrefillProjections::Int8 => "int8",
        }
    }

    /// Whether a projection whose int8 blocks are (or are not) exact keeps
    /// f32 weights for prefills.
    pub(crate) fn keeps_f32(self, exact: bool) -> bool {
        match self {
            PrefillProjections::Auto => !exact,
            PrefillProjections::F32 => true,
            PrefillProjections::Int8 => false,
        }
    }
}

impl std::fmt::Display for PrefillProjections {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for PrefillProjections {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        PrefillProjections::from_name(s)
            .ok_or_else(|| format!("`{s}` is not one of {}", PrefillProjections::NAMES))
    }
}

/// f32 weights `[out, inp]`, row-major, shared between a model and the
/// models derived from it.
#[derive(Clone)]
pub(crate) struct DenseWeights {
    w: Arc<[f32]>,
    out: usize,
    inp: usize,
}

impl DenseWeights {
    /// From `[out, inp]` f32 weights, row-major in `w` (taken, not copied).
    pub(crate) fn new(w: Vec<f32>, out: usize, inp: usize) -> Result<DenseWeights, EngineError> {
        if w.len() != out * inp {
            return Err(EngineError::Other(format!(
                "{} dense weights for {out}×{inp}",
                w.len()
            )));
        }
        Ok(DenseWeights {
            w: w.into(),
            out,
            inp,
        })
    }

    /// These weights with rows `at..` replaced by `rows` (`[n, inp]`,
    /// row-major).
    pub(crate) fn splice(&self, at: usize, rows: &[f32]) -> Result<DenseWeights, EngineError> {
        let inp = self.inp;
        let n = rows.len().checked_div(inp).unwrap_or(0);
        if !rows.len().is_multiple_of(inp) || at + n > self.out {
            return Err(EngineError::Other(format!(
                "a patch of {} values at row {at} for dense weights of {}×{inp}",
                rows.len(),
                self.out
            )));
        }
        let mut w = self.w.to_vec();
        w[at * inp..(at + n) * inp].copy_from_slice(rows);
        Ok(DenseWeights {
            w: w.into(),
            out: self.out,
            inp,
        })
    }

    /// `rows` input rows (row-major in `x`, `[rows, inp]`) → `[rows, out]`.
    pub(crate) fn matmul(&self, x: &[f32], rows: usize) -> Result<Vec<f32>, EngineError> {
        self.matmul_as(x, rows, rows <= IN_PLACE_MAX_ROWS)
    }

    /// [`DenseWeights::matmul`], `in_place` choosing the orientation: `W`
    /// read in place (column-major output, transposed after), or packed by
    /// the GEMM (row-major output, candle's orientation). Same bits either way.
    pub(crate) fn matmul_as(
        &self,
        x: &[f32],
        rows: usize,
        in_place: bool,
    ) -> Result<Vec<f32>, EngineError> {
        let (out, inp) = (self.out, self.inp);
        if x.len() != rows * inp {
            return Err(EngineError::Other(format!(
                "{} inputs for {rows} rows of {inp}",
                x.len()
            )));
        }
        if rows == 0 {
            return Ok(Vec::new());
        }
        let mut y = vec![0f32; rows * out];
        // Column-major (element (r, o) at `o * rows + r`) or row-major.
        let (dst_cs, dst_rs) = if in_place {
            (rows as isize, 1)
        } else {
            (1, out as isize)
        };
        let threads = candle_core::utils::get_num_threads();
        let parallelism = if threads > 1 {
            gemm::Parallelism::Rayon(threads)
        } else {
            gemm::Parallelism::None
        };
        // SAFETY: the GEMM reads `rows × inp` elements of `x` at (r, c) ↦
        // `r * inp + c` (checked length above), `inp × out` elements of `W`
        // as `Wᵀ` at (c, o) ↦ `o * inp + c` (`w.len() == out * inp` by
        // construction), and writes `rows × out` elements of `y` at (r, o) ↦
        // `r * dst_rs + o * dst_cs`, a permutation of `0..rows * out`; `y` is
        // exclusively borrowed and overlaps neither input. `read_dst` is
        // false, so `y`'s contents are not read.
        unsafe {
            gemm::gemm(
                rows,
                out,
                inp,
                y.as_mut_ptr(),
                dst_cs,
                dst_rs,
                false,
                x.as_ptr(),
                1,
                inp as isize,
                self.w.as_ptr(),
                inp as isize,
                1,
                0.0,
                1.0,
                false,
                false,
                false,
                parallelism,
            );
        }
        if !in_place {
            return Ok(y);
        }
        let mut t = vec![0f32; rows * out];
        for (o, col) in y.chunks_exact(rows).enumerate() {
            for (r, v) in col.iter().enumerate() {
                t[r * out + o] = *v;
            }
        }
        Ok(t)
    }
}

/// Most rows for which [`DenseWeights::matmul`] reads `W` in place; above
/// it the GEMM packs `W` (its packed panels pay off over many rows). Set
/// from `tests::orientations` (2026-12-05, fused gate/up, best of 30): in
/// place 0.65–0.76× packed at 4–16 rows, 1.28× at 24, 1.4–2.0× from 32.
pub(crate) const IN_PLACE_MAX_ROWS: usize = 16;

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::QMatMul;
    use candle_core::{Device, Tensor};

    /// A deterministic pseudo-random matrix of values of mixed magnitudes.
    fn matrix(rows: usize, cols: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..rows * cols)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let u = (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                u * if s & 1 == 0 { 3.0 } else { 0.01 }
            })
            .collect()
    }

    #[test]
    fn equals_candles_matmul_bit_for_bit() {
        // The model's projection shapes (SmolLM2: q/k/v fused, wo, gate/up
        // fused, down) and row counts around the GEMM's block sizes.
        for (out, inp) in [(960, 576), (576, 576), (3072, 576), (576, 1536), (40, 70)] {
            let w = matrix(out, inp, (out * 31 + inp) as u64);
            let dense = DenseWeights::new(w.clone(), out, inp).unwrap();
            let t = Tensor::from_vec(w, (out, inp), &Device::Cpu).unwrap();
            let candle = QMatMul::Tensor(t);
            for rows in [1, 2, 5, 7, 8, 9, 16, 17, 33, 64, 65, 130] {
                let x = matrix(rows, inp, rows as u64 + 7);
                let xt = Tensor::from_vec(x.clone(), (rows, inp), &Device::Cpu).unwrap();
                let want: Vec<f32> = candle_core::Module::forward(&candle, &xt)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1()
                    .unwrap();
                for in_place in [true, false] {
                    let got = dense.matmul_as(&x, rows, in_place).unwrap();
                    assert_eq!(want.len(), got.len());
                    let differ = want
                        .iter()
                        .zip(&got)
                        .filter(|(a, b)| a.to_bits() != b.to_bits())
                        .count();
                    assert_eq!(
                        differ, 0,
                        "{out}×{inp}, {rows} rows, in place {in_place}: {differ} values differ"
                    );
                }
            }
        }
    }

    /// `cargo test --release -p rngd-engine --lib dense::tests::orientations
    /// -- --ignored --nocapture`: both orientations' time per row count on
    /// SmolLM2's fused gate/up shape (what sets [`IN_PLACE_MAX_ROWS`]).
    #[test]
    #[ignore = "a timing table, not a check"]
    fn orientations() {
        let (out, inp) = (3072, 576);
        let dense = DenseWeights::new(matrix(out, inp, 3), out, inp).unwrap();
        for rows in [4, 8, 16, 24, 32, 48, 64, 128] {
            let x = matrix(rows, inp, 5);
            let mut best = [f64::MAX; 2];
            for _ in 0..30 {
                for (i, in_place) in [true, false].into_iter().enumerate() {
                    let t0 = std::time::Instant::now();
                    std::hint::black_box(dense.matmul_as(&x, rows, in_place).unwrap());
                    best[i] = best[i].min(t0.elapsed().as_secs_f64() * 1e3);
                }
            }
            println!(
                "rows {rows:4}: in place {:.3} ms, packed {:.3} ms, ratio {:.2}",
                best[0],
                best[1],
                best[0] / best[1]
            );
        }
    }

    #[test]
    fn a_splice_replaces_exactly_its_rows() {
        let (out, inp) = (6, 4);
        let w = matrix(out, inp, 1);
        let d = DenseWeights::new(w.clone(), out, inp).unwrap();
        let patch = vec![9f32; 2 * inp];
        let s = d.splice(3, &patch).unwrap();
        for r in 0..out {
            let row = &s.w[r * inp..(r + 1) * inp];
            if r == 3 || r == 4 {
                assert!(row.iter().all(|v| *v == 9.0));
            } else {
                assert_eq!(row, &w[r * inp..(r + 1) * inp]);
            }
        }
        assert!(d.splice(5, &patch).is_err(), "past the last row");
        assert!(d.splice(0, &[1.0; 3]).is_err(), "not whole rows");
        assert!(
            DenseWeights::new(vec![0.0; 5], 2, 2).is_err(),
            "wrong length"
        );
        assert!(d.matmul(&[0.0; 3], 1).is_err(), "wrong input length");
    }
}
