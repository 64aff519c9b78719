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
#[derive(Clone, PartialEq)]
pub(crate) struct QWeights {
    n: usize,
    k: usize,
    /// Blocks per column (`k` rounded up to 32).
    blocks: usize,
    /// `[panel][block]`; columns past `n` are zero.
    panels: Vec<PanelBlock>,
    /// `[panel][block]` offsets; empty when every block has `m = 0`.
    mins: Vec<MinBlock>,
    /// Per weight row (output column): every block of it gives the f32
    /// weights it was made from back, bit for bit (the file's Q4_1 or Q8_0
    /// values). Where all are, the kernel computes with the weights
    /// themselves and only the activations are rounded.
    exact: Vec<bool>,
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
        let mut exact = vec![true; n];
        for (col, row) in w.chunks_exact(k).enumerate() {
            let (p, c) = (col / PANEL, col % PANEL);
            for b in 0..blocks {
                let pb = &mut panels[p * blocks + b];
                let x = block_of(row, b, &mut buf);
                (pb.d[c], mins[p * blocks + b].0[c]) = match offset_block(x, &mut q) {
                    Some(dm) => dm,
                    None => {
                        let d = quantize_block(x, &mut q);
                        exact[col] &= x.iter().zip(&q).all(|(v, q)| f32::from(*q) * d == *v);
                        (d, 0.0)
                    }
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
            exact,
        })
    }

    /// Output columns (rows of the weights).
    pub(crate) fn out(&self) -> usize {
        self.n
    }

    /// Whether every block holds its f32 weights exactly (Q4_1 and Q8_0
    /// files' values do; F16 or F32 ones mostly not).
    pub(crate) fn is_exact(&self) -> bool {
        self.exact.iter().all(|e| *e)
    }

    /// The f32 weights `[n, k]` these blocks stand for (`q · d + m`, the
    /// product and sum [`offset_block`] checks): for exact weights, the
    /// weights they were quantized from, bit for bit.
    pub(crate) fn dequantize(&self) -> Vec<f32> {
        let mut w = vec![0f32; self.n * self.k];
        for (col, row) in w.chunks_exact_mut(self.k).enumerate() {
            let (p, c) = (col / PANEL, col % PANEL);
            for (b, part) in row.chunks_mut(BLOCK).enumerate() {
                let pb = &self.panels[p * self.blocks + b];
                let m = self.mins.get(p * self.blocks + b).map_or(0.0, |m| m.0[c]);
                for (i, v) in part.iter_mut().enumerate() {
                    let q = f32::from(pb.q[i / 4][4 * c + i % 4].wrapping_sub(128) as i8);
                    *v = if self.mins.is_empty() {
                        q * pb.d[c]
                    } else {
                        q * pb.d[c] + m
                    };
                }
            }
        }
        w
    }

    /// These weights with rows `at..at + part.n` replaced by `part`'s (same
    /// `k`). Every row is quantized on its own, so splicing the quantized
    /// rows of a tensor gives what quantizing the spliced f32 rows would.
    pub(crate) fn splice(&self, at: usize, part: &QWeights) -> Result<QWeights, EngineError> {
        if part.k != self.k || at + part.n > self.n {
            return Err(EngineError::Other(format!(
                "cannot put [{}, {}] weights at row {at} of [{}, {}]",
                part.n, part.k, self.n, self.k
            )));
        }
        let mut out = self.clone();
        out.exact[at..at + part.n].copy_from_slice(&part.exact);
        let with_mins = !self.mins.is_empty() || !part.mins.is_empty();
        if with_mins && out.mins.is_empty() {
            out.mins = vec![MinBlock([0.0; PANEL]); out.panels.len()];
        }
        let blocks = self.blocks;
        for r in 0..part.n {
            let (sp, sc) = (r / PANEL, r % PANEL);
            let (dp, dc) = ((at + r) / PANEL, (at + r) % PANEL);
            for b in 0..blocks {
                let src = &part.panels[sp * blocks + b];
                let dst = &mut out.panels[dp * blocks + b];
                dst.d[dc] = src.d[sc];
                for j in 0..BLOCK / 4 {
                    dst.q[j][4 * dc..4 * dc + 4].copy_from_slice(&src.q[j][4 * sc..4 * sc + 4]);
                }
                if with_mins {
                    out.mins[dp * blocks + b].0[dc] =
                        part.mins.get(sp * blocks + b).map_or(0.0, |m| m.0[sc]);
                }
            }
        }
        if out.mins.iter().all(|m| m.0.iter().all(|v| *v == 0.0)) {
            out.mins = Vec::new();
        }
        Ok(out)
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
mod x86;

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
mod tests;
