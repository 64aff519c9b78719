//! Our own 8-bit quantized matmul for decode steps and the output head.
//!
//! Weights `[n, k]` are quantized once at load to 32-value blocks of int8 with
//! one f32 scale per block (`d = max|w| / 127`, `q = round(w / d)`, the same
//! rule as ggml's Q8_0) and repacked into *panels* of 16 output columns. A
//! panel is streamed block by block: per block, eight 64-byte chunks, chunk
//! `j` holding values `4j..4j + 4` of the block for each of the 16 columns
//! (column `c` in 32-bit lane `c`, the layout `vpdpbusd` wants), then the 16
//! columns' scales. So one 512-bit `vpdpbusd` adds four products to each of
//! 16 columns, with the activation's four values broadcast from memory, and a
//! panel's result is a vector of 16 columns: no horizontal sums. Weights are
//! stored offset by 128 (as `u8`, `vpdpbusd`'s unsigned operand).
//!
//! Activation rows are quantized per matmul the same way ([`QActs`]), laid
//! out `[block][row]` so a tile of rows is addressed from one base, with a
//! per-(block, row) correction `-128 · Σ q` that turns the offset weights'
//! dot product back into the exact integer `Σ q_w · q_a`.
//!
//! Blocks whose values are exactly `d · q + m` with `q` in `0..=15` (a GGUF
//! Q4_1 block as it dequantizes: found by [`offset_block`], which checks
//! every value) are not re-quantized: the kernel gets those `q`, `d` and
//! `m`, so it sees the file's weights exactly. `m` is kept per (panel,
//! block) apart from the panel (weights with no such block have none); its
//! term is `m · d_a · Σ q_a`, the quantized activations' sum, so the block
//! is `Σ w · â` with `â` the 8-bit activations (the same product ggml's
//! Q4_1 × Q8_1 forms; an exact f32 `Σ a` there measured worse: larger KL to
//! the float64 reference, `tests/python/test_numerics.py`).
//!
//! Per (row, column) every path computes, block after block in order,
//! `acc = fma(float(Σ q_w q_a), d_w · d_a, acc)`, then, when the weights have
//! offsets, `acc = fma(m_w, Σ a, acc)`: one fixed sequence of f32
//! operations that does not depend on the batch size, the row's place in the
//! batch or the thread split (threads split panels, never `k`). The AVX-512
//! VNNI, AVX2 and scalar paths compute it bit-identically (tested).
//!
//! The kernel loads a panel's block once and applies it to up to 8 rows
//! (accumulators stay in registers); more rows are tiled by 8.
//!
//! Threads: a small rayon pool ([`Pool`]) owned by the model; panels are
//! split into chunks that its workers take.

use std::ops::Range;
use std::sync::OnceLock;

use rayon::prelude::*;

use crate::EngineError;

/// Values per quantization block.
const BLOCK: usize = 32;
/// Output columns per panel (one 512-bit vector of f32).
const PANEL: usize = 16;
/// Largest row tile (accumulators kept in registers).
const TILE: usize = 8;

/// One block of a panel: 32 values of 16 columns and their scales, 576
/// bytes aligned to a cache line.
#[derive(Clone, Copy, Debug, PartialEq)]
#[repr(C, align(64))]
struct PanelBlock {
    /// `q[j][4c + t]` = value `4j + t` of the block for column `c`, int8 + 128.
    q: [[u8; 64]; BLOCK / 4],
    /// Scale of each column's block.
    d: [f32; PANEL],
}

/// The offsets `m` of one block of a panel's 16 columns (zero for blocks
/// quantized by the Q8_0 rule).
#[derive(Clone, Copy, Debug, PartialEq)]
#[repr(C, align(64))]
struct MinBlock([f32; PANEL]);

const EMPTY_BLOCK: PanelBlock = PanelBlock {
    q: [[128; 64]; BLOCK / 4],
    d: [0.0; PANEL],
};

/// Quantizes one block of 32 values: returns the scale, writes `q` (|q| ≤ 127).
#[inline(always)]
fn quantize_block(x: &[f32; BLOCK], q: &mut [i8; BLOCK]) -> f32 {
    // max is order-independent: eight running maxima vectorize.
    let mut m = [0f32; 8];
    for part in x.chunks_exact(8) {
        for (m, v) in m.iter_mut().zip(part) {
            *m = m.max(v.abs());
        }
    }
    let amax = m.iter().fold(0f32, |a, b| a.max(*b));
    let d = amax / 127.0;
    let id = if d > 0.0 { 1.0 / d } else { 0.0 };
    for (q, v) in q.iter_mut().zip(x) {
        // In range after the clamp: the i32 conversion vectorizes, the i8 one does not.
        *q = (v * id).round().clamp(-127.0, 127.0) as i32 as i8;
    }
    d
}

/// A block that is exactly `d · q + m` (`q` in `0..=15`, each value computed
/// as `(q as f32) · d + m`, how GGUF Q4_1 dequantizes): `(d, m)`, with `q`
/// written. `None` when no such `d` reproduces every value bit for bit.
fn offset_block(x: &[f32; BLOCK], q: &mut [i8; BLOCK]) -> Option<(f32, f32)> {
    let lo = x.iter().fold(f32::INFINITY, |a, v| a.min(*v));
    let hi = x.iter().fold(f32::NEG_INFINITY, |a, v| a.max(*v));
    if !lo.is_finite() || !hi.is_finite() {
        return None;
    }
    if lo == hi {
        *q = [0; BLOCK];
        return Some((0.0, lo));
    }
    // The block's top value is `15 · d + lo` rounded, so `d` is within a
    // few ulps of this quotient; each candidate is checked value by value.
    let base = ((hi - lo) / 15.0).to_bits();
    for delta in [0i32, 1, -1, 2, -2, 3, -3] {
        let d = f32::from_bits(base.wrapping_add_signed(delta));
        if !(d > 0.0 && d.is_finite()) {
            continue;
        }
        let fits = x.iter().zip(q.iter_mut()).all(|(v, q)| {
            let r = ((v - lo) / d).round();
            *q = r as i8;
            (0.0..=15.0).contains(&r) && r * d + lo == *v
        });
        if fits {
            return Some((d, lo));
        }
    }
    None
}

/// Block `b` of `x`, zero-padded past its end.
#[inline(always)]
fn block_of<'a>(x: &'a [f32], b: usize, buf: &'a mut [f32; BLOCK]) -> &'a [f32; BLOCK] {
    let lo = (b * BLOCK).min(x.len());
    let hi = ((b + 1) * BLOCK).min(x.len());
    match x[lo..hi].try_into() {
        Ok(full) => full,
        Err(_) => {
            *buf = [0.0; BLOCK];
            buf[..hi - lo].copy_from_slice(&x[lo..hi]);
            buf
        }
    }
}

/// Quantized weights `[n, k]` in the kernel's layout (see the module docs).
pub(crate) struct QWeights {
    n: usize,
    k: usize,
    /// Blocks per column (`k` rounded up to 32).
    blocks: usize,
    /// `[panel][block]`; columns past `n` are zero.
    panels: Vec<PanelBlock>,
    /// `[panel][block]` offsets; empty when every block has `m = 0`.
    mins: Vec<MinBlock>,
}

impl std::fmt::Debug for QWeights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QWeights")
            .field("n", &self.n)
            .field("k", &self.k)
            .finish()
    }
}

impl QWeights {
    /// Quantizes row-major f32 weights `[n, k]`: blocks that are exactly
    /// Q4_1 values are kept exactly ([`offset_block`]), the others get the
    /// Q8_0 rule.
    pub(crate) fn quantize(w: &[f32], n: usize, k: usize) -> Result<QWeights, EngineError> {
        if k == 0 || w.len() != n * k {
            return Err(EngineError::Other(format!(
                "weights of {} values are not [{n}, {k}]",
                w.len()
            )));
        }
        let blocks = k.div_ceil(BLOCK);
        let mut panels = vec![EMPTY_BLOCK; n.div_ceil(PANEL) * blocks];
        let mut mins = vec![MinBlock([0.0; PANEL]); panels.len()];
        let mut buf = [0f32; BLOCK];
        let mut q = [0i8; BLOCK];
        for (col, row) in w.chunks_exact(k).enumerate() {
            let (p, c) = (col / PANEL, col % PANEL);
            for b in 0..blocks {
                let pb = &mut panels[p * blocks + b];
                let x = block_of(row, b, &mut buf);
                (pb.d[c], mins[p * blocks + b].0[c]) = match offset_block(x, &mut q) {
                    Some(dm) => dm,
                    None => (quantize_block(x, &mut q), 0.0),
                };
                for (j, four) in q.chunks_exact(4).enumerate() {
                    for (t, v) in four.iter().enumerate() {
                        pb.q[j][4 * c + t] = (*v as u8).wrapping_add(128);
                    }
                }
            }
        }
        if mins.iter().all(|m| m.0.iter().all(|v| *v == 0.0)) {
            mins = Vec::new();
        }
        Ok(QWeights {
            n,
            k,
            blocks,
            panels,
            mins,
        })
    }

    fn panel_count(&self) -> usize {
        self.n.div_ceil(PANEL)
    }

    /// `rows` input rows `x` (`[rows, k]`) → `[rows, n]`, on `pool`.
    pub(crate) fn matmul(&self, x: &[f32], rows: usize, pool: &Pool) -> Vec<f32> {
        self.matmul_with(Isa::detect(), x, rows, pool)
    }

    /// [`QWeights::matmul`] on a chosen instruction set.
    fn matmul_with(&self, isa: Isa, x: &[f32], rows: usize, pool: &Pool) -> Vec<f32> {
        assert_eq!(x.len(), rows * self.k, "input is not [rows, k]");
        let mut out = vec![0f32; rows * self.n];
        if rows == 0 || self.n == 0 {
            return out;
        }
        let acts = QActs::quantize(x, rows, self.k, !self.mins.is_empty());
        // Each part: a range of panels and, per row, its slice of the output.
        let ranges = panel_chunks(self.panel_count(), pool.threads);
        let mut parts: Vec<(Range<usize>, Vec<&mut [f32]>)> = ranges
            .iter()
            .map(|r| (r.clone(), Vec::with_capacity(rows)))
            .collect();
        for row in out.chunks_exact_mut(self.n) {
            let mut rest = row;
            for (range, part) in parts.iter_mut() {
                let cols = (range.end * PANEL).min(self.n) - range.start * PANEL;
                let (a, b) = rest.split_at_mut(cols);
                part.push(a);
                rest = b;
            }
        }
        let work = |(panels, mut outs): (Range<usize>, Vec<&mut [f32]>)| {
            for (t, tile) in outs.chunks_mut(TILE).enumerate() {
                self.tile(isa, &acts, t * TILE, panels.clone(), tile);
            }
        };
        if parts.len() > 1 {
            pool.pool.install(|| parts.into_par_iter().for_each(work))
        } else {
            parts.into_iter().for_each(work)
        }
        out
    }

    /// Rows `row0..row0 + outs.len()` (≤ 8) × `panels` into `outs` (each the
    /// row's output columns from `panels.start · 16`).
    fn tile(
        &self,
        isa: Isa,
        a: &QActs,
        row0: usize,
        panels: Range<usize>,
        outs: &mut [&mut [f32]],
    ) {
        assert!(panels.end <= self.panel_count() && a.blocks == self.blocks);
        assert!(row0 + outs.len() <= a.rows);
        let cols = (panels.end * PANEL).min(self.n) - panels.start * PANEL;
        assert!(outs.iter().all(|o| o.len() == cols));
        macro_rules! dispatch {
            ($f:ident) => {
                match outs.len() {
                    1 => $f::<1>(self, a, row0, panels, outs),
                    2 => $f::<2>(self, a, row0, panels, outs),
                    3 => $f::<3>(self, a, row0, panels, outs),
                    4 => $f::<4>(self, a, row0, panels, outs),
                    5 => $f::<5>(self, a, row0, panels, outs),
                    6 => $f::<6>(self, a, row0, panels, outs),
                    7 => $f::<7>(self, a, row0, panels, outs),
                    8 => $f::<8>(self, a, row0, panels, outs),
                    _ => unreachable!("row tiles have 1..=8 rows"),
                }
            };
        }
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Vnni => {
                assert!(has_vnni());
                // SAFETY: the CPU has AVX-512 F/BW/VNNI, AVX2 and FMA, and the
                // panels, rows and output slices are in bounds (asserted above).
                unsafe { dispatch!(x86_tile_avx512) }
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                assert!(has_fma());
                // SAFETY: the CPU has AVX2 and FMA, and the panels, rows and
                // output slices are in bounds (asserted above).
                unsafe { dispatch!(x86_tile_avx2) }
            }
            Isa::Scalar => dispatch!(tile_scalar),
        }
    }
}

#[cfg(target_arch = "x86_64")]
use x86::{tile_avx2 as x86_tile_avx2, tile_avx512 as x86_tile_avx512};

/// Splits `0..panels` into chunks for `threads` workers (a few per worker,
/// so a busy core does not hold up the step).
fn panel_chunks(panels: usize, threads: usize) -> Vec<Range<usize>> {
    let per = if threads <= 1 {
        panels.max(1)
    } else {
        panels.div_ceil(4 * threads).max(4)
    };
    (0..panels.div_ceil(per))
        .map(|i| i * per..((i + 1) * per).min(panels))
        .collect()
}

/// Activation rows quantized for the kernel, `[block][row]`.
struct QActs {
    rows: usize,
    blocks: usize,
    /// Signed int8 values of each (block, row).
    quants: Vec<[i8; BLOCK]>,
    /// Scale of each (block, row).
    scales: Vec<f32>,
    /// `-128 · Σ q` of each (block, row): the offset weights' excess.
    corr: Vec<i32>,
    /// `d · Σ q` of each (block, row), the quantized block's sum, when asked
    /// for (weights with offsets `m`); else empty.
    sums: Vec<f32>,
}

impl QActs {
    /// Quantizes `rows` rows of `x` (`[rows, k]`), with the blocks' sums
    /// if `sums`.
    fn quantize(x: &[f32], rows: usize, k: usize, sums: bool) -> QActs {
        #[cfg(target_arch = "x86_64")]
        if has_fma() {
            // SAFETY: the CPU has AVX2 and FMA (detected just above).
            return unsafe { x86::quantize_acts(x, rows, k, sums) };
        }
        QActs::quantize_impl(x, rows, k, sums)
    }

    /// The scalar path.
    fn quantize_impl(x: &[f32], rows: usize, k: usize, sums: bool) -> QActs {
        QActs::quantize_with(x, rows, k, sums, |block, q| {
            let d = quantize_block(block, q);
            (d, q.iter().map(|v| i32::from(*v)).sum())
        })
    }

    /// Quantizes with `block` (zero-padded block → scale and `Σ q`, writes `q`).
    #[inline(always)]
    fn quantize_with(
        x: &[f32],
        rows: usize,
        k: usize,
        sums: bool,
        mut block: impl FnMut(&[f32; BLOCK], &mut [i8; BLOCK]) -> (f32, i32),
    ) -> QActs {
        let blocks = k.div_ceil(BLOCK);
        let mut acts = QActs {
            rows,
            blocks,
            quants: vec![[0; BLOCK]; rows * blocks],
            scales: vec![0.0; rows * blocks],
            corr: vec![0; rows * blocks],
            sums: if sums {
                vec![0.0; rows * blocks]
            } else {
                Vec::new()
            },
        };
        let mut buf = [0f32; BLOCK];
        for (r, row) in x.chunks_exact(k).enumerate() {
            for b in 0..blocks {
                let i = b * rows + r;
                let (d, sum) = block(block_of(row, b, &mut buf), &mut acts.quants[i]);
                acts.scales[i] = d;
                acts.corr[i] = -128 * sum;
                if sums {
                    // |Σ q| ≤ 32 · 127: exact in f32.
                    acts.sums[i] = d * sum as f32;
                }
            }
        }
        acts
    }
}

/// The reference path: the kernels' arithmetic, in plain Rust.
fn tile_scalar<const R: usize>(
    w: &QWeights,
    a: &QActs,
    row0: usize,
    panels: Range<usize>,
    outs: &mut [&mut [f32]],
) {
    let p0 = panels.start;
    let has_min = !w.mins.is_empty();
    for p in panels {
        let mut acc = [[0f32; PANEL]; R];
        for b in 0..w.blocks {
            let pb = &w.panels[p * w.blocks + b];
            for (r, acc) in acc.iter_mut().enumerate() {
                let i = b * a.rows + row0 + r;
                let (aq, da) = (&a.quants[i], a.scales[i]);
                for (c, acc) in acc.iter_mut().enumerate() {
                    let mut dot = 0i32;
                    for (j, four) in aq.chunks_exact(4).enumerate() {
                        for (t, av) in four.iter().enumerate() {
                            let wv = (pb.q[j][4 * c + t] ^ 0x80) as i8;
                            dot += i32::from(wv) * i32::from(*av);
                        }
                    }
                    *acc = (dot as f32).mul_add(pb.d[c] * da, *acc);
                    if has_min {
                        *acc = w.mins[p * w.blocks + b].0[c].mul_add(a.sums[i], *acc);
                    }
                }
            }
        }
        let at = (p - p0) * PANEL;
        for (out, acc) in outs.iter_mut().zip(&acc) {
            let n = out.len().min(at + PANEL) - at;
            out[at..at + n].copy_from_slice(&acc[..n]);
        }
    }
}

/// Instruction sets of the kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Isa {
    /// AVX-512 F/BW + VNNI (`vpdpbusd`).
    #[cfg(target_arch = "x86_64")]
    Avx512Vnni,
    /// AVX2 + FMA (`vpmaddubsw` on |w| and sign-adjusted activations).
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// Plain Rust.
    Scalar,
}

impl Isa {
    /// The best path this CPU has (detected once).
    fn detect() -> Isa {
        static ISA: OnceLock<Isa> = OnceLock::new();
        *ISA.get_or_init(|| {
            #[cfg(target_arch = "x86_64")]
            {
                if has_vnni() {
                    return Isa::Avx512Vnni;
                }
                if has_fma() {
                    return Isa::Avx2;
                }
            }
            Isa::Scalar
        })
    }

    /// Every path this CPU can run (for tests).
    #[cfg(test)]
    fn available() -> Vec<Isa> {
        let mut v = vec![Isa::Scalar];
        #[cfg(target_arch = "x86_64")]
        {
            if has_fma() {
                v.push(Isa::Avx2);
            }
            if has_vnni() {
                v.push(Isa::Avx512Vnni);
            }
        }
        v
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    //! The SIMD kernels. [`QWeights::tile`] checks the bounds once; inside,
    //! blocks, activations and outputs are read through pointers derived
    //! from those checked slices.

    use std::arch::x86_64::*;
    use std::ops::Range;

    use super::{BLOCK, MinBlock, PANEL, PanelBlock, QActs, QWeights};

    /// Activation quantization with AVX2: the same values as the scalar
    /// [`super::quantize_block`] for finite inputs (the maximum is
    /// order-independent; `round` is computed as LLVM lowers it, truncating
    /// `t + copysign(0.5 - 2⁻²⁵, t)`, which is exact).
    #[target_feature(enable = "avx2,fma")]
    pub(super) fn quantize_acts(x: &[f32], rows: usize, k: usize, sums: bool) -> QActs {
        QActs::quantize_with(x, rows, k, sums, |block, q| quantize_block_avx2(block, q))
    }

    /// One block: returns the scale and `Σ q`, writes `q`.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn quantize_block_avx2(x: &[f32; BLOCK], q: &mut [i8; BLOCK]) -> (f32, i32) {
        let sign = _mm256_set1_ps(-0.0);
        let p = x.as_ptr();
        // SAFETY: `x` holds 32 floats: four unaligned loads of 8.
        let v: [__m256; 4] = std::array::from_fn(|i| unsafe { _mm256_loadu_ps(p.add(8 * i)) });
        let a: [__m256; 4] = v.map(|v| _mm256_andnot_ps(sign, v));
        let m = _mm256_max_ps(_mm256_max_ps(a[0], a[1]), _mm256_max_ps(a[2], a[3]));
        let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let m = _mm_max_ss(m, _mm_shuffle_ps::<1>(m, m));
        let d = _mm_cvtss_f32(m) / 127.0;
        let id = _mm256_set1_ps(if d > 0.0 { 1.0 / d } else { 0.0 });
        let half = _mm256_set1_ps(f32::from_bits(0x3EFF_FFFF));
        let (lo, hi) = (_mm256_set1_ps(-127.0), _mm256_set1_ps(127.0));
        let ints: [__m256i; 4] = v.map(|v| {
            let t = _mm256_mul_ps(v, id);
            let r = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(_mm256_add_ps(
                t,
                _mm256_or_ps(_mm256_and_ps(t, sign), half),
            ));
            _mm256_cvttps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi))
        });
        let s = _mm256_add_epi32(
            _mm256_add_epi32(ints[0], ints[1]),
            _mm256_add_epi32(ints[2], ints[3]),
        );
        let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s));
        let s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<1>(s));
        // packs work within 128-bit lanes: undo their interleaving.
        let w = _mm256_packs_epi16(
            _mm256_packs_epi32(ints[0], ints[1]),
            _mm256_packs_epi32(ints[2], ints[3]),
        );
        let w = _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        // SAFETY: `q` holds 32 bytes.
        unsafe { _mm256_storeu_si256(q.as_mut_ptr().cast(), w) };
        (d, _mm_cvtsi128_si32(s))
    }

    /// Stores a panel's 16 results into `out[at..]` (fewer at the last,
    /// partial panel).
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn store16(out: &mut [f32], at: usize, v: __m512) {
        if out.len() >= at + PANEL {
            // SAFETY: 16 floats from `at` are inside `out` (checked just above).
            unsafe { _mm512_storeu_ps(out.as_mut_ptr().add(at), v) }
        } else {
            let mut tmp = [0f32; PANEL];
            // SAFETY: `tmp` holds 16 floats.
            unsafe { _mm512_storeu_ps(tmp.as_mut_ptr(), v) }
            let n = out.len() - at;
            out[at..].copy_from_slice(&tmp[..n]);
        }
    }

    /// Blocks ahead whose weights are prefetched (8 measured a little better
    /// than 2, 4 or 16 for 8-row tiles; none was clearly worse at 1 row).
    const PREFETCH: usize = 8;

    /// See [`QWeights::tile`].
    ///
    /// # Safety
    /// The CPU has AVX-512 F/BW/VNNI, AVX2 and FMA; `panels` are panels of
    /// `w`; rows `row0..row0 + R` exist in `a`, which has `w`'s block count;
    /// `outs` has `R` slices of the panels' columns.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma")]
    pub(super) unsafe fn tile_avx512<const R: usize>(
        w: &QWeights,
        a: &QActs,
        row0: usize,
        panels: Range<usize>,
        outs: &mut [&mut [f32]],
    ) {
        let nb = w.blocks;
        let rows = a.rows;
        let last = w.panels.as_ptr_range().end;
        // Offsets: `[panel][block]` like the panels, or none.
        let has_min = !w.mins.is_empty();
        for p in panels.clone() {
            // Bounds of all pointer arithmetic below: panel `p` exists, so its
            // `nb` blocks are in `w.panels`; activation index `b·rows + row0 +
            // r` < `nb·rows` for b < nb and row0 + r < rows.
            // SAFETY: block `p · nb` is in `w.panels` (above).
            let wp = unsafe { w.panels.as_ptr().add(p * nb) };
            let (aq, asc, acr) = (a.quants.as_ptr(), a.scales.as_ptr(), a.corr.as_ptr());
            let mut acc = [_mm512_setzero_ps(); R];
            for b in 0..nb {
                // SAFETY: b < nb: the panel's block `b` (above).
                let blk: *const PanelBlock = unsafe { wp.add(b) };
                let ahead = blk.wrapping_add(PREFETCH);
                if PREFETCH > 0 && ahead < last {
                    for line in 0..size_of::<PanelBlock>() / 64 {
                        _mm_prefetch::<_MM_HINT_T0>(ahead.cast::<i8>().wrapping_add(64 * line));
                    }
                }
                let mut wv = [_mm512_setzero_si512(); BLOCK / 4];
                for (j, wv) in wv.iter_mut().enumerate() {
                    // SAFETY: `blk` is a valid, 64-aligned block; chunk `j` is 64 bytes.
                    *wv = unsafe { _mm512_load_si512((*blk).q[j].as_ptr().cast()) };
                }
                // SAFETY: as above; the 16 scales are 64 aligned bytes.
                let wd = unsafe { _mm512_load_ps((*blk).d.as_ptr()) };
                let wm = if has_min {
                    let m: &MinBlock = &w.mins[p * nb + b];
                    // SAFETY: a MinBlock is 16 floats, 64-aligned.
                    unsafe { _mm512_load_ps(m.0.as_ptr()) }
                } else {
                    _mm512_setzero_ps()
                };
                let i0 = b * rows + row0;
                for (r, acc) in acc.iter_mut().enumerate() {
                    // SAFETY: index i0 + r is in bounds (see above).
                    let (q, da, corr) = unsafe {
                        (
                            aq.add(i0 + r).cast::<i32>(),
                            *asc.add(i0 + r),
                            *acr.add(i0 + r),
                        )
                    };
                    let mut dot = _mm512_set1_epi32(corr);
                    for (j, wv) in wv.iter().enumerate() {
                        // SAFETY: four of the row's 32 values, read unaligned.
                        let four = unsafe { q.add(j).read_unaligned() };
                        dot = _mm512_dpbusd_epi32(dot, *wv, _mm512_set1_epi32(four));
                    }
                    let s = _mm512_mul_ps(wd, _mm512_set1_ps(da));
                    *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, *acc);
                    if has_min {
                        *acc = _mm512_fmadd_ps(wm, _mm512_set1_ps(a.sums[i0 + r]), *acc);
                    }
                }
            }
            let at = (p - panels.start) * PANEL;
            for (out, acc) in outs.iter_mut().zip(acc) {
                store16(out, at, acc);
            }
        }
    }

    /// See [`QWeights::tile`]: the same integers and f32 operations as the
    /// other paths, 8 columns per 256-bit vector.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA; otherwise as [`tile_avx512`].
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn tile_avx2<const R: usize>(
        w: &QWeights,
        a: &QActs,
        row0: usize,
        panels: Range<usize>,
        outs: &mut [&mut [f32]],
    ) {
        let nb = w.blocks;
        let rows = a.rows;
        let flip = _mm256_set1_epi8(0x80u8 as i8);
        let ones = _mm256_set1_epi16(1);
        let has_min = !w.mins.is_empty();
        for p in panels.clone() {
            // SAFETY: as in `tile_avx512`.
            let wp = unsafe { w.panels.as_ptr().add(p * nb) };
            let mut acc = [[_mm256_setzero_ps(); 2]; R];
            for b in 0..nb {
                // SAFETY: block `b` of panel `p` exists.
                let blk: &PanelBlock = unsafe { &*wp.add(b) };
                // Signed weights and their absolute values, per chunk and half.
                let mut sw = [[_mm256_setzero_si256(); 2]; BLOCK / 4];
                let mut aw = [[_mm256_setzero_si256(); 2]; BLOCK / 4];
                for j in 0..BLOCK / 4 {
                    let ptr = blk.q[j].as_ptr().cast::<__m256i>();
                    for h in 0..2 {
                        // SAFETY: each 64-aligned chunk holds two aligned 32-byte halves.
                        let v = unsafe { _mm256_load_si256(ptr.add(h)) };
                        sw[j][h] = _mm256_xor_si256(v, flip);
                        aw[j][h] = _mm256_sign_epi8(sw[j][h], sw[j][h]);
                    }
                }
                let i0 = b * rows + row0;
                for (r, acc) in acc.iter_mut().enumerate() {
                    let q = &a.quants[i0 + r];
                    let da = a.scales[i0 + r];
                    let mut dot = [_mm256_setzero_si256(); 2];
                    for j in 0..BLOCK / 4 {
                        let four = i32::from_le_bytes(std::array::from_fn(|t| q[4 * j + t] as u8));
                        let av = _mm256_set1_epi32(four);
                        for h in 0..2 {
                            let prod =
                                _mm256_maddubs_epi16(aw[j][h], _mm256_sign_epi8(av, sw[j][h]));
                            dot[h] = _mm256_add_epi32(dot[h], _mm256_madd_epi16(prod, ones));
                        }
                    }
                    for h in 0..2 {
                        // SAFETY: the block's 16 scales; half `h` is 8 of them.
                        let wd = unsafe { _mm256_load_ps(blk.d.as_ptr().add(8 * h)) };
                        let s = _mm256_mul_ps(wd, _mm256_set1_ps(da));
                        acc[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[h]), s, acc[h]);
                        if has_min {
                            let m: &MinBlock = &w.mins[p * nb + b];
                            // SAFETY: a MinBlock is 16 floats, 64-aligned; half `h` is 8.
                            let wm = unsafe { _mm256_load_ps(m.0.as_ptr().add(8 * h)) };
                            let sum = _mm256_set1_ps(a.sums[i0 + r]);
                            acc[h] = _mm256_fmadd_ps(wm, sum, acc[h]);
                        }
                    }
                }
            }
            let at = (p - panels.start) * PANEL;
            for (out, acc) in outs.iter_mut().zip(&acc) {
                let mut tmp = [0f32; PANEL];
                // SAFETY: `tmp` holds 16 floats.
                unsafe {
                    _mm256_storeu_ps(tmp.as_mut_ptr(), acc[0]);
                    _mm256_storeu_ps(tmp.as_mut_ptr().add(8), acc[1]);
                }
                let n = out.len().min(at + PANEL) - at;
                out[at..at + n].copy_from_slice(&tmp[..n]);
            }
        }
    }
}

/// Whether the CPU has AVX-512 F/BW + VNNI, AVX2 and FMA (detected once).
#[cfg(target_arch = "x86_64")]
fn has_vnni() -> bool {
    static VNNI: OnceLock<bool> = OnceLock::new();
    *VNNI.get_or_init(|| {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vnni")
            && has_fma()
    })
}

/// Whether the CPU has AVX2 and FMA (detected once).
#[cfg(target_arch = "x86_64")]
pub(crate) fn has_fma() -> bool {
    static FMA: OnceLock<bool> = OnceLock::new();
    *FMA.get_or_init(|| {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
    })
}

/// The compute threads of the quantized matmul.
pub(crate) struct Pool {
    threads: usize,
    pool: rayon::ThreadPool,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("threads", &self.threads)
            .finish()
    }
}

impl Pool {
    /// A pool of `threads` workers. One worker is a pool too: the forward
    /// pass's parallel iterators then run inside it, one after the other,
    /// instead of falling through to rayon's global pool.
    pub(crate) fn new(threads: usize) -> Result<Pool, EngineError> {
        let threads = threads.max(1);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("rngd-gemm-{i}"))
            .build()
            .map_err(|e| EngineError::Other(format!("starting the matmul threads: {e}")))?;
        Ok(Pool { threads, pool })
    }

    /// Workers.
    pub(crate) fn threads(&self) -> usize {
        self.threads
    }

    /// Runs `f` on one of the pool's workers (so the parallel work inside
    /// needs no further hand-off).
    pub(crate) fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.pool.install(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic pseudo-random values in [-1, 1).
    fn random(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// Pseudo-random weights made of Q4_1 blocks as GGUF dequantizes them:
    /// `(q as f32) · d + m`, `d` and `m` f16-like (11 significant bits). A
    /// block may straddle two columns when `k` is not a multiple of 32.
    fn q4_1_values(n: usize, seed: u64) -> Vec<f32> {
        let r = random(n + 2 * n.div_ceil(BLOCK), seed);
        let f16ish = |v: f32| f32::from_bits(v.to_bits() & !0x1FFF);
        let mut out = Vec::with_capacity(n);
        for (b, block) in r[..n].chunks(BLOCK).enumerate() {
            let d = f16ish(0.01 + 0.02 * r[n + 2 * b].abs());
            let m = f16ish(-8.0 * d * (1.0 + 0.1 * r[n + 2 * b + 1]));
            // Each block has its minimum (q = 0) and maximum (q = 15), as the
            // Q4_1 rule (d = (max - min) / 15, m = min) gives.
            out.extend(block.iter().enumerate().map(|(i, v)| {
                let q = match i {
                    0 => 0.0,
                    1 => 15.0,
                    _ => ((v + 1.0) * 7.99).floor(),
                };
                q * d + m
            }));
        }
        out
    }

    /// Column `c` of the weights as the kernel sees them: `(q · d, m)` per
    /// value in order (padded to whole blocks).
    fn weight_column(w: &QWeights, c: usize) -> Vec<(f64, f64)> {
        let (p, cc) = (c / PANEL, c % PANEL);
        let mut out = Vec::new();
        for b in 0..w.blocks {
            let pb = &w.panels[p * w.blocks + b];
            let m = w.mins.get(p * w.blocks + b).map_or(0.0, |m| m.0[cc]);
            for i in 0..BLOCK {
                let q = (pb.q[i / 4][4 * cc + i % 4] ^ 0x80) as i8;
                out.push((f64::from(q) * f64::from(pb.d[cc]), f64::from(m)));
            }
        }
        out
    }

    /// The exact value the kernel approximates: dequantized weights and
    /// activations, f64 dot products; the offsets' term with the quantized sums.
    fn reference(w: &QWeights, x: &[f32], rows: usize) -> Vec<f64> {
        let acts = QActs::quantize(x, rows, w.k, !w.mins.is_empty());
        let mut out = vec![0f64; rows * w.n];
        for r in 0..rows {
            let mut ad = Vec::new();
            for b in 0..acts.blocks {
                let i = b * rows + r;
                assert_eq!(
                    acts.corr[i],
                    -128 * acts.quants[i].iter().map(|v| i32::from(*v)).sum::<i32>()
                );
                ad.extend(
                    acts.quants[i]
                        .iter()
                        .map(|q| f64::from(*q) * f64::from(acts.scales[i])),
                );
            }
            for c in 0..w.n {
                let wd = weight_column(w, c);
                let mut v: f64 = wd.iter().zip(&ad).map(|((a, _), b)| a * b).sum();
                if !w.mins.is_empty() {
                    for b in 0..acts.blocks {
                        v += wd[b * BLOCK].1 * f64::from(acts.sums[b * rows + r]);
                    }
                }
                out[r * w.n + c] = v;
            }
        }
        out
    }

    #[test]
    fn quantized_values_round_trip_within_half_a_step() {
        let (n, k) = (21, 100);
        let wf = random(n * k, 7);
        let w = QWeights::quantize(&wf, n, k).unwrap();
        assert_eq!((w.blocks, w.panel_count()), (4, 2));
        assert!(w.mins.is_empty(), "random weights are not Q4_1 blocks");
        for c in 0..n {
            let col: Vec<f64> = weight_column(&w, c).iter().map(|v| v.0).collect();
            // Padding past k is zero.
            assert!(col[k..].iter().all(|v| *v == 0.0));
            let d = w.panels[(c / PANEL) * w.blocks].d[c % PANEL];
            for (i, v) in col[..k].iter().enumerate() {
                let exact = f64::from(wf[c * k + i]);
                let step = f64::from(w.panels[(c / PANEL) * w.blocks + i / BLOCK].d[c % PANEL]);
                assert!((v - exact).abs() <= 0.5 * step + 1e-7, "c={c} i={i}");
            }
            assert!(d > 0.0);
        }
        // Columns past n in the last panel are zero weights.
        for c in n..2 * PANEL {
            assert!(weight_column(&w, c).iter().all(|v| v.0 == 0.0));
        }
    }

    /// Q4_1 blocks are kept exactly: `q · d + m` gives back every value bit
    /// for bit; a block off the 16-level grid falls back to the Q8_0 rule.
    #[test]
    fn q4_1_blocks_are_kept_exactly() {
        let (n, k) = (19, 96);
        let mut wf = q4_1_values(n * k, 11);
        // Column 3's second block: one value off the grid.
        wf[3 * k + 40] += 1e-4;
        let w = QWeights::quantize(&wf, n, k).unwrap();
        assert!(!w.mins.is_empty());
        for c in 0..n {
            let col = weight_column(&w, c);
            for (i, (qd, m)) in col[..k].iter().enumerate() {
                let exact = f64::from(wf[c * k + i]);
                if c == 3 && i / BLOCK == 1 {
                    assert_eq!(*m, 0.0);
                    let step = f64::from(w.panels[i / BLOCK].d[3]);
                    assert!((qd - exact).abs() <= 0.5 * step + 1e-7);
                } else {
                    let d = f64::from(w.panels[(c / PANEL) * w.blocks + i / BLOCK].d[c % PANEL]);
                    let q = (qd / d).round();
                    assert!((0.0..=15.0).contains(&q), "c={c} i={i}: q {q}");
                    let (d, m) = (d as f32, *m as f32);
                    assert_eq!(q as f32 * d + m, wf[c * k + i], "c={c} i={i}");
                }
            }
        }
        // The detection itself is bit-exact: q · d + m gives every value.
        let mut q = [0i8; BLOCK];
        for block in wf.chunks_exact(BLOCK).take(20) {
            let x: &[f32; BLOCK] = block.try_into().unwrap();
            if let Some((d, m)) = offset_block(x, &mut q) {
                assert!(x.iter().zip(&q).all(|(v, q)| f32::from(*q) * d + m == *v));
            }
        }
        // A constant block is exact too (d = 0).
        assert_eq!(offset_block(&[0.375; BLOCK], &mut q), Some((0.0, 0.375)));
    }

    #[test]
    fn matches_the_dequantized_f64_reference_and_the_f32_product() {
        let pool = Pool::new(2).unwrap();
        for (k, n, rows) in [
            (64, 37, 3),
            (576, 70, 9),
            (1536, 33, 8),
            (100, 19, 2),
            (448, 21, 5),
        ] {
            for wf in [random(n * k, k as u64), q4_1_values(n * k, k as u64)] {
                let x = random(rows * k, n as u64 + 1);
                let w = QWeights::quantize(&wf, n, k).unwrap();
                let want = reference(&w, &x, rows);
                for isa in Isa::available() {
                    let got = w.matmul_with(isa, &x, rows, &pool);
                    for (i, (g, e)) in got.iter().zip(&want).enumerate() {
                        assert!(
                            (f64::from(*g) - e).abs() <= 1e-4 * (1.0 + e.abs()),
                            "{isa:?} k={k} n={n} [{i}]: {g} vs {e}"
                        );
                    }
                    // And close to the unquantized product (8-bit quantization error).
                    for r in 0..rows {
                        for c in 0..n {
                            let exact: f32 = (0..k).map(|i| wf[c * k + i] * x[r * k + i]).sum();
                            let g = got[r * n + c];
                            assert!(
                                (g - exact).abs() < 0.02 * (k as f32).sqrt(),
                                "{g} vs {exact}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn every_path_and_batch_size_gives_the_same_bits() {
        let pools = [Pool::new(1).unwrap(), Pool::new(2).unwrap()];
        for (k, n, q4) in [
            (64, 37, false),
            (576, 131, false),
            (1536, 45, false),
            (448, 17, false),
            (100, 300, false),
            (576, 131, true),
            (1536, 45, true),
        ] {
            let wf = if q4 {
                q4_1_values(n * k, 3 * k as u64)
            } else {
                random(n * k, 3 * k as u64)
            };
            let w = QWeights::quantize(&wf, n, k).unwrap();
            assert_eq!(w.mins.is_empty(), !q4);
            let x = random(11 * k, 5);
            let all = w.matmul_with(Isa::Scalar, &x, 11, &pools[0]);
            for isa in Isa::available() {
                for pool in &pools {
                    assert_eq!(
                        w.matmul_with(isa, &x, 11, pool),
                        all,
                        "{isa:?} k={k} batch 11"
                    );
                    for r in [0, 5, 7, 10] {
                        let alone = w.matmul_with(isa, &x[r * k..(r + 1) * k], 1, pool);
                        assert_eq!(alone[..], all[r * n..(r + 1) * n], "{isa:?} k={k} row {r}");
                    }
                    // Row 3 as the last row of a batch of 4 and the first of a batch of 8.
                    let four = w.matmul_with(isa, &x[..4 * k], 4, pool);
                    assert_eq!(four[3 * n..], all[3 * n..4 * n]);
                    let eight = w.matmul_with(isa, &x[3 * k..11 * k], 8, pool);
                    assert_eq!(eight[..n], all[3 * n..4 * n]);
                }
            }
        }
    }

    #[test]
    fn every_path_quantizes_activations_alike() {
        // Ties (x.5 after scaling) round away from zero on every path.
        let mut x = vec![127.0f32, 0.5, 1.5, 2.5, -0.5, -2.5, 126.5, -126.5];
        x.extend(random(3 * 576 - x.len(), 17));
        x.extend([0.0; 32]);
        x.extend(random(8, 3).iter().map(|v| v * 1e-30));
        x.extend(random(24, 4).iter().map(|v| v * 1e30));
        let (rows, k) = (4, 8 * 32 + 3);
        x.resize(rows * k, 0.25);
        let want = QActs::quantize_impl(&x, rows, k, true);
        assert_eq!(&want.quants[0][..8], &[127, 1, 2, 3, -1, -3, 127, -127]);
        let got = QActs::quantize(&x, rows, k, true);
        assert_eq!(got.quants, want.quants);
        assert_eq!(got.scales, want.scales);
        assert_eq!(got.corr, want.corr);
        assert_eq!(got.sums, want.sums);
        assert_eq!(want.sums.len(), rows * want.blocks);
        assert!(QActs::quantize(&x, rows, k, false).sums.is_empty());
    }

    #[test]
    fn panel_chunks_cover_every_panel_once() {
        for n in [1, 15, 16, 64, 577, 3072] {
            for t in [1, 2, 3, 8] {
                let ch = panel_chunks(n, t);
                assert_eq!(ch.first().unwrap().start, 0);
                assert_eq!(ch.last().unwrap().end, n);
                assert!(ch.windows(2).all(|w| w[0].end == w[1].start));
            }
        }
    }

    /// Kernel timings on this machine:
    /// `cargo test --release -p rngd-engine --lib qgemm_speed -- --ignored --nocapture`
    #[test]
    #[ignore = "timing, not a check"]
    fn qgemm_speed() {
        // One SmolLM2-135M decode step's projections (30 layers, each its own
        // weights as in the model, so they stream from memory) and its head.
        let shapes = [(576, 960), (576, 576), (576, 3072), (1536, 576)];
        let layers: Vec<Vec<_>> = (0..30)
            .map(|l| {
                shapes
                    .iter()
                    .map(|(k, n)| {
                        let w = random(n * k, 1 + l);
                        (*k, QWeights::quantize(&w, *n, *k).unwrap())
                    })
                    .collect()
            })
            .collect();
        let head = QWeights::quantize(&random(49152 * 576, 2), 49152, 576).unwrap();
        {
            // Cache-resident weights: the kernel's compute rate alone.
            let small = QWeights::quantize(&random(256 * 576, 9), 256, 576).unwrap();
            let pool = Pool::new(1).unwrap();
            for rows in [1, 8] {
                let x = random(rows * 576, 3);
                let t0 = std::time::Instant::now();
                for _ in 0..5000 {
                    std::hint::black_box(QActs::quantize(&x, rows, 576, false));
                }
                let ns = t0.elapsed().as_secs_f64() * 1e9 / 5000.0 / (576.0 * rows as f64);
                println!("quantize rows {rows}: {ns:.2} ns per value");
                for _ in 0..2 {
                    for isa in Isa::available().into_iter().skip(1) {
                        let t0 = std::time::Instant::now();
                        for _ in 0..5000 {
                            std::hint::black_box(small.matmul_with(isa, &x, rows, &pool));
                        }
                        let ns = t0.elapsed().as_secs_f64() * 1e9 / 5000.0 / (256.0 * rows as f64);
                        println!("cache-resident {isa:?} rows {rows}: {ns:.2} ns per column-row");
                    }
                }
            }
        }
        for threads in [1, 2] {
            let pool = Pool::new(threads).unwrap();
            for rows in [1, 2, 4, 8] {
                let xs: Vec<Vec<f32>> = [576, 1536].iter().map(|k| random(rows * k, 3)).collect();
                let x = |k: usize| if k == 576 { &xs[0] } else { &xs[1] };
                let mut best = f64::MAX;
                for _ in 0..5 {
                    let t0 = std::time::Instant::now();
                    pool.install(|| {
                        for layer in &layers {
                            for (k, w) in layer {
                                std::hint::black_box(w.matmul(x(*k), rows, &pool));
                            }
                        }
                        std::hint::black_box(head.matmul(x(576), rows, &pool));
                    });
                    best = best.min(t0.elapsed().as_secs_f64() * 1e3);
                }
                println!("threads {threads} rows {rows}: {best:.2} ms per step (best of 5)");
            }
        }
    }

    #[test]
    fn bad_shapes_are_refused() {
        assert!(QWeights::quantize(&[0.0; 10], 3, 4).is_err());
        assert!(QWeights::quantize(&[], 3, 0).is_err());
    }
}
