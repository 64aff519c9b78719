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
                        let prod = _mm256_maddubs_epi16(aw[j][h], _mm256_sign_epi8(av, sw[j][h]));
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
