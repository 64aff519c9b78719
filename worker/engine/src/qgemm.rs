//! Our own 8-bit quantized matmul for decode steps and the output head.
//!
//! Weights `[n, k]` are quantized once at load to 32-value blocks of int8 with
//! one f32 scale per block (`d = max|w| / 127`, `q = round(w / d)`, the same
//! rule as ggml's Q8_0) and repacked so that the kernel streams them
//! linearly: per output column, 64-byte, 64-aligned chunks of 64 values, cut
//! into *groups* of 4 chunks (then at most one group of 2 and one of 1 for the
//! rest of `k`, zero-padded to a multiple of 64). In a group of `g` chunks,
//! 32-bit lane `l` of every chunk holds four values of block `l mod 2g`, so
//! `g` `vpdpbusd`s add up one exact integer per lane and block, and the
//! group's 2g scales are a lane vector loaded with one 256-bit broadcast. The
//! int8 weights are stored offset by 128 (as `u8`, `vpdpbusd`'s unsigned
//! operand); each group's scales are 8 f32 (`d[l mod 2g]`).
//!
//! Activation rows are quantized per matmul the same way ([`QActs`]), with
//! per-lane correction terms `-128 · Σ a`, so every path gets the exact
//! integer `Σ q_w · q_a` of each lane.
//!
//! The kernel loads each weight group once and applies it to up to 8 rows
//! (accumulators stay in registers); more rows are tiled by 8. Per lane and
//! group it computes `acc = fma(float(Σ q_w q_a), d_w · d_a, acc)`, then sums
//! the 16 lanes with one fixed tree (`l + l⊕8`, `⊕4`, `⊕2`, `⊕1`). That is one
//! fixed sequence of f32 operations per (row, column): it does not depend on
//! the batch size, the row's place in the batch or the thread split (threads
//! split output columns, never `k`), and the AVX-512 VNNI, AVX2 and scalar
//! paths compute it bit-identically (tested).
//!
//! Threads: a small rayon pool ([`Pool`]) owned by the model; columns are
//! split into chunks that its workers take.

use std::ops::Range;
use std::sync::OnceLock;

use rayon::prelude::*;

use crate::EngineError;

/// Values per quantization block.
const BLOCK: usize = 32;
/// Values per 64-byte chunk (two blocks).
const CHUNK: usize = 64;
/// Largest row tile (accumulators kept in registers).
const TILE: usize = 8;

/// 64 bytes, 64-aligned: 64 quantized values.
#[derive(Clone, Copy, Debug, PartialEq)]
#[repr(C, align(64))]
struct Chunk([u8; CHUNK]);

/// 16 `i32` lanes, 64-aligned.
#[derive(Clone, Copy, Debug, PartialEq)]
#[repr(C, align(64))]
struct I32x16([i32; 16]);

/// A group's 8 scales (lane `l` uses `[l mod 8]`), 32-aligned.
#[derive(Clone, Copy, Debug, PartialEq)]
#[repr(C, align(32))]
struct F32x8([f32; 8]);

/// How a row of `k` values is cut into groups of 4, 2 and 1 chunks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Plan {
    g4: usize,
    g2: usize,
    g1: usize,
}

impl Plan {
    fn new(k: usize) -> Plan {
        let chunks = k.div_ceil(CHUNK);
        Plan {
            g4: chunks / 4,
            g2: (chunks % 4) / 2,
            g1: chunks % 2,
        }
    }

    /// Chunks per row.
    fn chunks(&self) -> usize {
        4 * self.g4 + 2 * self.g2 + self.g1
    }

    /// Groups per row.
    fn groups(&self) -> usize {
        self.g4 + self.g2 + self.g1
    }

    /// Group sizes (in chunks), in order.
    fn sizes(&self) -> impl Iterator<Item = usize> {
        let r = std::iter::repeat;
        r(4).take(self.g4)
            .chain(r(2).take(self.g2))
            .chain(r(1).take(self.g1))
    }
}

/// Byte offset, in a group of `g` chunks, of the group's value `i` (0..64·g).
#[cfg(test)]
fn group_pos(g: usize, i: usize) -> usize {
    let (block, j) = (i / BLOCK, i % BLOCK);
    // Lane l = m·2g + block holds values 4g·m .. 4g·(m+1) of the block,
    // four in each chunk.
    let (m, r) = (j / (4 * g), j % (4 * g));
    let lane = m * 2 * g + block;
    (r / 4) * CHUNK + 4 * lane + r % 4
}

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

/// Quantizes a row (zero-padded to `plan.chunks() · 64` values) into `chunks`
/// (int8 + `offset`) and `scales`; with `corr`, also each group's per-lane
/// corrections `-128 · Σ q`.
#[inline(always)]
fn quantize_row(
    x: &[f32],
    plan: Plan,
    offset: u8,
    chunks: &mut [Chunk],
    scales: &mut [F32x8],
    mut corr: Option<&mut [I32x16]>,
) {
    let mut start = 0;
    let mut ci = 0;
    let mut buf = [[0f32; BLOCK]; 8];
    let mut q = [[0i8; BLOCK]; 8];
    for (gi, g) in plan.sizes().enumerate() {
        let n = g * CHUNK;
        let mut d = [0f32; 8];
        for (b, d) in d.iter_mut().enumerate().take(2 * g) {
            let lo = (start + b * BLOCK).min(x.len());
            let hi = (start + (b + 1) * BLOCK).min(x.len());
            let block: &[f32; BLOCK] = match x[lo..hi].try_into() {
                Ok(full) => full,
                Err(_) => {
                    buf[b] = [0.0; BLOCK];
                    buf[b][..hi - lo].copy_from_slice(&x[lo..hi]);
                    &buf[b]
                }
            };
            *d = quantize_block(block, &mut q[b]);
        }
        let group = &mut chunks[ci..ci + g];
        let mut lanes = [0i32; 16];
        let shift = g.trailing_zeros();
        for (b, q) in q.iter().enumerate().take(2 * g) {
            for (u, src) in q.chunks_exact(4).enumerate() {
                let lane = (u >> shift) * 2 * g + b;
                let dst = &mut group[u & (g - 1)].0[4 * lane..4 * lane + 4];
                for (d, s) in dst.iter_mut().zip(src) {
                    *d = (*s as u8).wrapping_add(offset);
                }
                lanes[lane] += src.iter().map(|v| i32::from(*v)).sum::<i32>();
            }
        }
        if let Some(corr) = corr.as_deref_mut() {
            corr[gi] = I32x16(lanes.map(|s| -128 * s));
        }
        scales[gi] = F32x8(std::array::from_fn(|l| d[l % (2 * g)]));
        start += n;
        ci += g;
    }
}

/// Quantized weights `[n, k]` in the kernel's layout (see the module docs).
pub(crate) struct QWeights {
    n: usize,
    k: usize,
    plan: Plan,
    /// `[n][plan.chunks()]`, int8 + 128.
    quants: Vec<Chunk>,
    /// `[n][plan.groups()]`.
    scales: Vec<F32x8>,
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
    /// Quantizes row-major f32 weights `[n, k]`.
    pub(crate) fn quantize(w: &[f32], n: usize, k: usize) -> Result<QWeights, EngineError> {
        if k == 0 || w.len() != n * k {
            return Err(EngineError::Other(format!(
                "weights of {} values are not [{n}, {k}]",
                w.len()
            )));
        }
        let plan = Plan::new(k);
        let (nc, ng) = (plan.chunks(), plan.groups());
        let mut quants = vec![Chunk([0; CHUNK]); n * nc];
        let mut scales = vec![F32x8([0.0; 8]); n * ng];
        for (row, (qs, ss)) in w
            .chunks_exact(k)
            .zip(quants.chunks_exact_mut(nc).zip(scales.chunks_exact_mut(ng)))
        {
            quantize_row(row, plan, 128, qs, ss, None);
        }
        Ok(QWeights {
            n,
            k,
            plan,
            quants,
            scales,
        })
    }

    /// `rows` input rows `x` (`[rows, k]`) → `[rows, n]`, on `pool`.
    pub(crate) fn matmul(&self, x: &[f32], rows: usize, pool: &Pool) -> Vec<f32> {
        self.matmul_with(Isa::detect(), x, rows, pool)
    }

    /// [`QWeights::matmul`] on a chosen instruction set.
    fn matmul_with(&self, isa: Isa, x: &[f32], rows: usize, pool: &Pool) -> Vec<f32> {
        assert_eq!(x.len(), rows * self.k, "input is not [rows, k]");
        let acts = QActs::quantize(x, rows, self.k, self.plan, pool);
        let mut out = vec![0f32; rows * self.n];
        if rows == 0 || self.n == 0 {
            return out;
        }
        let ranges = column_chunks(self.n, pool.threads);
        let mut parts: Vec<(Range<usize>, Vec<&mut [f32]>)> = ranges
            .iter()
            .map(|r| (r.clone(), Vec::with_capacity(rows)))
            .collect();
        for row in out.chunks_exact_mut(self.n) {
            let mut rest = row;
            for (range, part) in parts.iter_mut() {
                let (a, b) = rest.split_at_mut(range.len());
                part.push(a);
                rest = b;
            }
        }
        let work = |(cols, mut outs): (Range<usize>, Vec<&mut [f32]>)| {
            for (t, tile) in outs.chunks_mut(TILE).enumerate() {
                self.tile(isa, &acts, t * TILE, cols.clone(), tile);
            }
        };
        match &pool.pool {
            Some(p) if parts.len() > 1 => p.install(|| parts.into_par_iter().for_each(work)),
            _ => parts.into_iter().for_each(work),
        }
        out
    }

    /// Rows `row0..row0 + outs.len()` (≤ 8) × columns `cols` into `outs`.
    fn tile(&self, isa: Isa, a: &QActs, row0: usize, cols: Range<usize>, outs: &mut [&mut [f32]]) {
        macro_rules! dispatch {
            ($f:ident) => {
                match outs.len() {
                    1 => $f::<1>(self, a, row0, cols, outs),
                    2 => $f::<2>(self, a, row0, cols, outs),
                    3 => $f::<3>(self, a, row0, cols, outs),
                    4 => $f::<4>(self, a, row0, cols, outs),
                    5 => $f::<5>(self, a, row0, cols, outs),
                    6 => $f::<6>(self, a, row0, cols, outs),
                    7 => $f::<7>(self, a, row0, cols, outs),
                    8 => $f::<8>(self, a, row0, cols, outs),
                    _ => unreachable!("row tiles have 1..=8 rows"),
                }
            };
        }
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Vnni => dispatch!(tile_avx512),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => dispatch!(tile_avx2),
            Isa::Scalar => dispatch!(tile_scalar),
        }
    }
}

/// Splits `0..n` into column chunks for `threads` workers (multiples of 16
/// columns, a few per worker so a busy core does not hold up the step).
fn column_chunks(n: usize, threads: usize) -> Vec<Range<usize>> {
    let per = if threads <= 1 {
        n
    } else {
        n.div_ceil(4 * threads).max(64).next_multiple_of(16)
    };
    (0..n.div_ceil(per))
        .map(|i| i * per..((i + 1) * per).min(n))
        .collect()
}

/// Activation rows quantized for the kernel.
struct QActs {
    plan: Plan,
    /// `[rows][plan.chunks()]`, int8.
    quants: Vec<Chunk>,
    /// `[rows][plan.groups()]`: `-128 ·` the sum of each lane's values in the group.
    corr: Vec<I32x16>,
    /// `[rows][plan.groups()]`.
    scales: Vec<F32x8>,
}

/// One row to quantize: its values, and where its chunks, scales and corrections go.
type RowJob<'a> = (
    &'a [f32],
    ((&'a mut [Chunk], &'a mut [F32x8]), &'a mut [I32x16]),
);

/// One activation row: its chunks, corrections and scales.
type ActRow<'a> = (&'a [Chunk], &'a [I32x16], &'a [F32x8]);

impl QActs {
    /// Quantizes `rows` rows of `x` (`[rows, k]`), rows spread over `pool`.
    fn quantize(x: &[f32], rows: usize, k: usize, plan: Plan, pool: &Pool) -> QActs {
        let (nc, ng) = (plan.chunks(), plan.groups());
        let mut quants = vec![Chunk([0; CHUNK]); rows * nc];
        let mut scales = vec![F32x8([0.0; 8]); rows * ng];
        let mut corr = vec![I32x16([0; 16]); rows * ng];
        let one = |(row, ((qs, ss), cs)): RowJob<'_>| {
            #[cfg(target_arch = "x86_64")]
            if has_fma() {
                // SAFETY: the CPU has AVX2 and FMA (detected just above).
                return unsafe { x86::quantize_acts_row(row, plan, qs, ss, cs) };
            }
            quantize_row(row, plan, 0, qs, ss, Some(cs));
        };
        let items = x.chunks_exact(k).zip(
            quants
                .chunks_exact_mut(nc)
                .zip(scales.chunks_exact_mut(ng))
                .zip(corr.chunks_exact_mut(ng)),
        );
        match &pool.pool {
            Some(p) if rows > 1 => p.install(|| items.par_bridge().for_each(one)),
            _ => items.for_each(one),
        }
        QActs {
            plan,
            quants,
            corr,
            scales,
        }
    }

    fn row(&self, r: usize) -> ActRow<'_> {
        let (nc, ng) = (self.plan.chunks(), self.plan.groups());
        (
            &self.quants[r * nc..(r + 1) * nc],
            &self.corr[r * ng..(r + 1) * ng],
            &self.scales[r * ng..(r + 1) * ng],
        )
    }
}

/// The fixed 16-lane sum: `l + l⊕8`, then `⊕4`, `⊕2`, `⊕1`.
fn reduce16(v: &[f32; 16]) -> f32 {
    let mut s8 = [0f32; 8];
    for i in 0..8 {
        s8[i] = v[i] + v[i + 8];
    }
    let mut s4 = [0f32; 4];
    for i in 0..4 {
        s4[i] = s8[i] + s8[i + 4];
    }
    let s2 = [s4[0] + s4[2], s4[1] + s4[3]];
    s2[0] + s2[1]
}

/// The reference path: the kernels' lane structure, in plain Rust.
fn tile_scalar<const R: usize>(
    w: &QWeights,
    a: &QActs,
    row0: usize,
    cols: Range<usize>,
    outs: &mut [&mut [f32]],
) {
    let (nc, ng) = (w.plan.chunks(), w.plan.groups());
    let acts: [_; R] = std::array::from_fn(|r| a.row(row0 + r));
    for (j, c) in cols.enumerate() {
        let wq = &w.quants[c * nc..(c + 1) * nc];
        let ws = &w.scales[c * ng..(c + 1) * ng];
        for (r, (aq, _, asc)) in acts.iter().enumerate() {
            let mut acc = [0f32; 16];
            let mut ci = 0;
            for (gi, g) in w.plan.sizes().enumerate() {
                for (l, acc) in acc.iter_mut().enumerate() {
                    let mut dot = 0i32;
                    for ch in ci..ci + g {
                        for b in 4 * l..4 * l + 4 {
                            let wv = (wq[ch].0[b] ^ 0x80) as i8 as i32;
                            dot += wv * (aq[ch].0[b] as i8 as i32);
                        }
                    }
                    let s = ws[gi].0[l % 8] * asc[gi].0[l % 8];
                    *acc = (dot as f32).mul_add(s, *acc);
                }
                ci += g;
            }
            outs[r][j] = reduce16(&acc);
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
fn tile_avx512<const R: usize>(
    w: &QWeights,
    a: &QActs,
    row0: usize,
    cols: Range<usize>,
    outs: &mut [&mut [f32]],
) {
    assert!(has_vnni() && outs.len() == R);
    assert!(cols.end <= w.n && outs.iter().all(|o| o.len() >= cols.len()));
    // SAFETY: the CPU has AVX-512 F/BW/VNNI, AVX2 and FMA (asserted just above).
    unsafe { x86::tile_avx512::<R>(w, a, row0, cols, outs) }
}

#[cfg(target_arch = "x86_64")]
fn tile_avx2<const R: usize>(
    w: &QWeights,
    a: &QActs,
    row0: usize,
    cols: Range<usize>,
    outs: &mut [&mut [f32]],
) {
    assert!(has_fma() && outs.len() == R);
    assert!(cols.end <= w.n && outs.iter().all(|o| o.len() >= cols.len()));
    // SAFETY: the CPU has AVX2 and FMA (asserted just above).
    unsafe { x86::tile_avx2::<R>(w, a, row0, cols, outs) }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    //! The SIMD kernels. Every load is of a whole aligned [`Chunk`],
    //! [`I32x16`] or [`F32x8`] taken from a slice by a checked index.

    use std::arch::x86_64::*;
    use std::ops::Range;

    use super::{ActRow, Chunk, F32x8, I32x16, Plan, QActs, QWeights};

    /// One activation row's quantization compiled with AVX2 and FMA: the
    /// same results (`round` has one defined result), vectorized.
    #[target_feature(enable = "avx2,fma")]
    pub(super) fn quantize_acts_row(
        x: &[f32],
        plan: Plan,
        chunks: &mut [Chunk],
        scales: &mut [F32x8],
        corr: &mut [I32x16],
    ) {
        super::quantize_row(x, plan, 0, chunks, scales, Some(corr));
    }

    /// Loads a chunk as 512 bits.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn load512(c: &Chunk) -> __m512i {
        // SAFETY: `c` is a valid, 64-aligned 64-byte value; AVX-512F is enabled here.
        unsafe { _mm512_load_si512((c as *const Chunk).cast()) }
    }

    #[inline]
    #[target_feature(enable = "avx512f")]
    fn load512i(c: &I32x16) -> __m512i {
        // SAFETY: `c` is a valid, 64-aligned 64-byte value; AVX-512F is enabled here.
        unsafe { _mm512_load_si512((c as *const I32x16).cast()) }
    }

    /// A group's 8 scales, repeated in both 256-bit halves.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn bcast8(s: &F32x8) -> __m512 {
        // SAFETY: `s` is a valid, 32-aligned 32-byte value; AVX is enabled here.
        let v = unsafe { _mm256_load_pd((s as *const F32x8).cast()) };
        _mm512_castpd_ps(_mm512_broadcast_f64x4(v))
    }

    /// The two 256-bit halves of a chunk.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn load256x2(c: &Chunk) -> (__m256i, __m256i) {
        let p = (c as *const Chunk).cast::<__m256i>();
        // SAFETY: `c` is 64 valid bytes aligned to 64, so both 32-byte halves are
        // valid and 32-aligned; AVX is enabled here.
        unsafe { (_mm256_load_si256(p), _mm256_load_si256(p.add(1))) }
    }

    #[inline]
    #[target_feature(enable = "avx2")]
    fn load256f(s: &F32x8) -> __m256 {
        // SAFETY: `s` is a valid, 32-aligned 32-byte value; AVX is enabled here.
        unsafe { _mm256_load_ps((s as *const F32x8).cast()) }
    }

    /// The fixed-tree sum of 16 lanes given as halves (lanes 0..8, 8..16).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn reduce_halves(lo: __m256, hi: __m256) -> f32 {
        let s8 = _mm256_add_ps(lo, hi);
        let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps::<1>(s8));
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        let s1 = _mm_add_ss(s2, _mm_shuffle_ps::<1>(s2, s2));
        _mm_cvtss_f32(s1)
    }

    /// One group of `$g` chunks for every row of the tile (AVX-512).
    macro_rules! group512 {
        ($g:literal, $wq:ident, $ws:ident, $acts:ident, $acc:ident, $ci:ident, $gi:ident) => {{
            let dw = bcast8(&$ws[$gi]);
            let mut wv = [_mm512_setzero_si512(); $g];
            for (c, wv) in wv.iter_mut().enumerate() {
                *wv = load512(&$wq[$ci + c]);
            }
            for r in 0..R {
                let (aq, corr, asc): ActRow<'_> = $acts[r];
                let mut dot = load512i(&corr[$gi]);
                for (c, wv) in wv.iter().enumerate() {
                    dot = _mm512_dpbusd_epi32(dot, *wv, load512(&aq[$ci + c]));
                }
                let s = _mm512_mul_ps(dw, bcast8(&asc[$gi]));
                $acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, $acc[r]);
            }
            $ci += $g;
            $gi += 1;
        }};
    }

    /// One group of `$g` chunks for every row of the tile, for two columns
    /// at once (each activation chunk is loaded once for both); per (row,
    /// column) the same operations as `group512`.
    macro_rules! group512x2 {
        ($g:literal, $wq:ident, $ws:ident, $acts:ident, $acc:ident, $ci:ident, $gi:ident) => {{
            let dw = [bcast8(&$ws[0][$gi]), bcast8(&$ws[1][$gi])];
            let mut wv = [[_mm512_setzero_si512(); $g]; 2];
            for (wv, wq) in wv.iter_mut().zip(&$wq) {
                for (c, wv) in wv.iter_mut().enumerate() {
                    *wv = load512(&wq[$ci + c]);
                }
            }
            for r in 0..R {
                let (aq, corr, asc): ActRow<'_> = $acts[r];
                let init = load512i(&corr[$gi]);
                let mut dot = [init, init];
                for c in 0..$g {
                    let av = load512(&aq[$ci + c]);
                    dot[0] = _mm512_dpbusd_epi32(dot[0], wv[0][c], av);
                    dot[1] = _mm512_dpbusd_epi32(dot[1], wv[1][c], av);
                }
                let da = bcast8(&asc[$gi]);
                for h in 0..2 {
                    let s = _mm512_mul_ps(dw[h], da);
                    $acc[h][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[h]), s, $acc[h][r]);
                }
            }
            $ci += $g;
            $gi += 1;
        }};
    }

    /// Columns ahead whose weights are prefetched (measured: ~15% faster
    /// 8-row tiles on streamed weights).
    const PREFETCH: usize = 4;

    /// Prefetches the weights and scales of columns `c..c + count` (those
    /// that exist). A macro so that it is expanded inside the kernel.
    macro_rules! prefetch_columns {
        ($w:expr, $c:expr, $count:expr) => {{
            let (w, c): (&QWeights, usize) = ($w, $c);
            let (nc, ng) = (w.plan.chunks(), w.plan.groups());
            let end = (c + $count).min(w.n);
            if c < end {
                for chunk in &w.quants[c * nc..end * nc] {
                    _mm_prefetch::<_MM_HINT_T0>((chunk as *const Chunk).cast());
                }
                // Two 32-byte scale sets per cache line.
                for s in w.scales[c * ng..end * ng].iter().step_by(2) {
                    _mm_prefetch::<_MM_HINT_T0>((s as *const F32x8).cast());
                }
            }
        }};
    }

    /// The fixed-tree sums of two 512-bit accumulators at once (the same
    /// additions as [`reduce512`] for each).
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn reduce512x2(a: __m512, b: __m512) -> (f32, f32) {
        // [a.q0, a.q1, b.q0, b.q1] + [a.q2, a.q3, b.q2, b.q3]: l + l⊕8 of each.
        let s8 = _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b01_00_01_00>(a, b),
            _mm512_shuffle_f32x4::<0b11_10_11_10>(a, b),
        );
        let s4 = _mm512_add_ps(s8, _mm512_shuffle_f32x4::<0b10_11_00_01>(s8, s8));
        let s2 = _mm512_add_ps(s4, _mm512_permute_ps::<0b01_00_11_10>(s4));
        let s1 = _mm512_add_ps(s2, _mm512_permute_ps::<0b10_11_00_01>(s2));
        (
            _mm512_cvtss_f32(s1),
            _mm_cvtss_f32(_mm512_extractf32x4_ps::<2>(s1)),
        )
    }

    /// The fixed-tree sum of a 512-bit accumulator.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    fn reduce512(v: __m512) -> f32 {
        let lo = _mm512_castps512_ps256(v);
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
        reduce_halves(lo, hi)
    }

    /// See `super::tile_avx512`; the caller checked the CPU features and bounds.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma")]
    pub(super) fn tile_avx512<const R: usize>(
        w: &QWeights,
        a: &QActs,
        row0: usize,
        cols: Range<usize>,
        outs: &mut [&mut [f32]],
    ) {
        let plan = w.plan;
        let (nc, ng) = (plan.chunks(), plan.groups());
        let acts: [ActRow<'_>; R] = std::array::from_fn(|r| a.row(row0 + r));
        let pairs_end = cols.start + (cols.len() & !1);
        for c in (cols.start..pairs_end).step_by(2) {
            prefetch_columns!(w, c + PREFETCH, 2);
            let j = c - cols.start;
            let wq = [
                &w.quants[c * nc..(c + 1) * nc],
                &w.quants[(c + 1) * nc..(c + 2) * nc],
            ];
            let ws = [
                &w.scales[c * ng..(c + 1) * ng],
                &w.scales[(c + 1) * ng..(c + 2) * ng],
            ];
            let mut acc = [[_mm512_setzero_ps(); R]; 2];
            let (mut ci, mut gi) = (0, 0);
            for _ in 0..plan.g4 {
                group512x2!(4, wq, ws, acts, acc, ci, gi);
            }
            if plan.g2 == 1 {
                group512x2!(2, wq, ws, acts, acc, ci, gi);
            }
            if plan.g1 == 1 {
                group512x2!(1, wq, ws, acts, acc, ci, gi);
            }
            let _ = (ci, gi);
            for r in 0..R {
                (outs[r][j], outs[r][j + 1]) = reduce512x2(acc[0][r], acc[1][r]);
            }
        }
        for c in pairs_end..cols.end {
            prefetch_columns!(w, c + PREFETCH, 1);
            let j = c - cols.start;
            let wq = &w.quants[c * nc..(c + 1) * nc];
            let ws = &w.scales[c * ng..(c + 1) * ng];
            let mut acc = [_mm512_setzero_ps(); R];
            let (mut ci, mut gi) = (0, 0);
            for _ in 0..plan.g4 {
                group512!(4, wq, ws, acts, acc, ci, gi);
            }
            if plan.g2 == 1 {
                group512!(2, wq, ws, acts, acc, ci, gi);
            }
            if plan.g1 == 1 {
                group512!(1, wq, ws, acts, acc, ci, gi);
            }
            let _ = (ci, gi);
            for r in 0..R {
                outs[r][j] = reduce512(acc[r]);
            }
        }
    }

    /// One group of `$g` chunks for every row of the tile (AVX2).
    macro_rules! group256 {
        ($g:literal, $wq:ident, $ws:ident, $acts:ident, $acc:ident, $ci:ident, $gi:ident) => {{
            let flip = _mm256_set1_epi8(0x80u8 as i8);
            let ones = _mm256_set1_epi16(1);
            let dw = load256f(&$ws[$gi]);
            // Signed weights (halves of each chunk) and their absolute values.
            let mut sw = [[_mm256_setzero_si256(); 2]; $g];
            for (c, sw) in sw.iter_mut().enumerate() {
                let (w0, w1) = load256x2(&$wq[$ci + c]);
                *sw = [_mm256_xor_si256(w0, flip), _mm256_xor_si256(w1, flip)];
            }
            for r in 0..R {
                let (aq, _, asc): ActRow<'_> = $acts[r];
                let mut dot = [_mm256_setzero_si256(); 2];
                for (c, sw) in sw.iter().enumerate() {
                    let (a0, a1) = load256x2(&aq[$ci + c]);
                    for (h, a) in [a0, a1].into_iter().enumerate() {
                        let prod = _mm256_maddubs_epi16(
                            _mm256_sign_epi8(sw[h], sw[h]),
                            _mm256_sign_epi8(a, sw[h]),
                        );
                        dot[h] = _mm256_add_epi32(dot[h], _mm256_madd_epi16(prod, ones));
                    }
                }
                let s = _mm256_mul_ps(dw, load256f(&asc[$gi]));
                for h in 0..2 {
                    $acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[h]), s, $acc[r][h]);
                }
            }
            $ci += $g;
            $gi += 1;
        }};
    }

    /// See `super::tile_avx2`; the caller checked the CPU features and bounds.
    #[target_feature(enable = "avx2,fma")]
    pub(super) fn tile_avx2<const R: usize>(
        w: &QWeights,
        a: &QActs,
        row0: usize,
        cols: Range<usize>,
        outs: &mut [&mut [f32]],
    ) {
        let plan = w.plan;
        let (nc, ng) = (plan.chunks(), plan.groups());
        let acts: [ActRow<'_>; R] = std::array::from_fn(|r| a.row(row0 + r));
        for (j, c) in cols.enumerate() {
            let wq = &w.quants[c * nc..(c + 1) * nc];
            let ws = &w.scales[c * ng..(c + 1) * ng];
            let mut acc = [[_mm256_setzero_ps(); 2]; R];
            let (mut ci, mut gi) = (0, 0);
            for _ in 0..plan.g4 {
                group256!(4, wq, ws, acts, acc, ci, gi);
            }
            if plan.g2 == 1 {
                group256!(2, wq, ws, acts, acc, ci, gi);
            }
            if plan.g1 == 1 {
                group256!(1, wq, ws, acts, acc, ci, gi);
            }
            let _ = (ci, gi);
            for r in 0..R {
                outs[r][j] = reduce_halves(acc[r][0], acc[r][1]);
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
    pool: Option<rayon::ThreadPool>,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("threads", &self.threads)
            .finish()
    }
}

impl Pool {
    /// A pool of `threads` workers (1 = run on the calling thread).
    pub(crate) fn new(threads: usize) -> Result<Pool, EngineError> {
        let threads = threads.max(1);
        let pool = if threads > 1 {
            Some(
                rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .thread_name(|i| format!("rngd-gemm-{i}"))
                    .build()
                    .map_err(|e| EngineError::Other(format!("starting the matmul threads: {e}")))?,
            )
        } else {
            None
        };
        Ok(Pool { threads, pool })
    }

    /// Workers.
    pub(crate) fn threads(&self) -> usize {
        self.threads
    }

    /// Runs `f` on one of the pool's workers (so the matmuls inside need no
    /// further hand-off), or on the calling thread for a 1-thread pool.
    pub(crate) fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        match &self.pool {
            Some(p) => p.install(f),
            None => f(),
        }
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

    /// The exact value the kernel approximates: dequantized weights and
    /// activations, f64 dot products.
    fn reference(w: &QWeights, x: &[f32], rows: usize) -> Vec<f64> {
        let acts = QActs::quantize(x, rows, w.k, w.plan, &Pool::new(1).unwrap());
        // Dequantizes one row (chunks + scales) back to value order.
        let deq = |chunks: &[Chunk], scales: &[F32x8], offset: u8| -> Vec<f64> {
            let mut out = Vec::new();
            let mut ci = 0;
            for (gi, g) in w.plan.sizes().enumerate() {
                for i in 0..g * CHUNK {
                    let pos = group_pos(g, i);
                    let q = chunks[ci + pos / CHUNK].0[pos % CHUNK].wrapping_sub(offset) as i8;
                    out.push(f64::from(q) * f64::from(scales[gi].0[i / BLOCK]));
                }
                ci += g;
            }
            out
        };
        let (nc, ng) = (w.plan.chunks(), w.plan.groups());
        let mut out = vec![0f64; rows * w.n];
        for r in 0..rows {
            let (aq, _, asc) = acts.row(r);
            let ad = deq(aq, asc, 0);
            for c in 0..w.n {
                let wd = deq(
                    &w.quants[c * nc..(c + 1) * nc],
                    &w.scales[c * ng..(c + 1) * ng],
                    128,
                );
                out[r * w.n + c] = wd.iter().zip(&ad).map(|(a, b)| a * b).sum();
            }
        }
        out
    }

    #[test]
    fn layout_positions_are_a_permutation() {
        for g in [1, 2, 4] {
            let mut seen = vec![false; g * CHUNK];
            for i in 0..g * CHUNK {
                let pos = group_pos(g, i);
                assert!(!seen[pos], "g={g} i={i}");
                seen[pos] = true;
                // Lane l holds values of block l mod 2g.
                assert_eq!((pos % CHUNK) / 4 % (2 * g), i / BLOCK);
            }
        }
        assert_eq!(
            Plan::new(576),
            Plan {
                g4: 2,
                g2: 0,
                g1: 1
            }
        );
        assert_eq!(
            Plan::new(1536),
            Plan {
                g4: 6,
                g2: 0,
                g1: 0
            }
        );
        assert_eq!(
            Plan::new(100),
            Plan {
                g4: 0,
                g2: 1,
                g1: 0
            }
        );
        assert_eq!(
            Plan::new(448),
            Plan {
                g4: 1,
                g2: 1,
                g1: 1
            }
        );
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
            let wf = random(n * k, k as u64);
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

    #[test]
    fn every_path_and_batch_size_gives_the_same_bits() {
        let pools = [Pool::new(1).unwrap(), Pool::new(2).unwrap()];
        for (k, n) in [(64, 37), (576, 131), (1536, 45), (448, 17)] {
            let w = QWeights::quantize(&random(n * k, 3 * k as u64), n, k).unwrap();
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
    fn column_chunks_cover_every_column_once() {
        for n in [1, 15, 16, 64, 577, 49152] {
            for t in [1, 2, 3, 8] {
                let ch = column_chunks(n, t);
                assert_eq!(ch.first().unwrap().start, 0);
                assert_eq!(ch.last().unwrap().end, n);
                assert!(ch.windows(2).all(|w| w[0].end == w[1].start));
            }
        }
    }

    /// `cargo test --release -p rngd-engine --lib qgemm_speed -- --ignored --nocapture`
    #[test]
    #[ignore = "timing, not a check"]
    fn qgemm_speed() {
        // One SmolLM2-135M decode step's projections (30 layers) and its head.
        let shapes = [(576, 960), (576, 576), (576, 3072), (1536, 576)];
        let mats: Vec<_> = shapes
            .iter()
            .map(|(k, n)| (*k, QWeights::quantize(&random(n * k, 1), *n, *k).unwrap()))
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
                    std::hint::black_box(QActs::quantize(&x, rows, 576, small.plan, &pool));
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
                let mut best = f64::MAX;
                for _ in 0..7 {
                    let t0 = std::time::Instant::now();
                    pool.install(|| {
                        for _ in 0..30 {
                            for (k, w) in &mats {
                                std::hint::black_box(w.matmul(&random(rows * k, 3), rows, &pool));
                            }
                        }
                        std::hint::black_box(head.matmul(&random(rows * 576, 4), rows, &pool));
                    });
                    best = best.min(t0.elapsed().as_secs_f64() * 1e3);
                }
                println!("threads {threads} rows {rows}: {best:.2} ms per step (best of 7)");
            }
        }
    }

    #[test]
    fn bad_shapes_are_refused() {
        assert!(QWeights::quantize(&[0.0; 10], 3, 4).is_err());
        assert!(QWeights::quantize(&[], 3, 0).is_err());
    }
}
