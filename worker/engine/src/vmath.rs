//! `exp` for the forward pass (softmax and SwiGLU), vectorized.
//!
//! One function, computed by the same sequence of IEEE operations on every
//! path: clamp to the range where the result is a normal float, `n =
//! round_ties_even(x · log₂e)`, a two-step Cody–Waite reduction `r = x − n ·
//! ln 2` with fused multiply-adds, a degree-5 polynomial (the Cephes `expf`
//! coefficients, about 1 ulp), and a scale by `2ⁿ` built from its exponent
//! bits. The AVX2 path does eight at a time and gives bit-identical results
//! to the scalar one (tested), so a token does not depend on which path or
//! batch computed it. libm's `expf` is not used: it is a call per element.

/// Inputs are clamped to `[LO, HI]`: there `n` stays in -126..=127 and the
/// result is a normal float (e⁻⁸⁷ ≈ 1.6e-38, e⁸⁸ ≈ 1.7e38).
const LO: f32 = -87.0;
const HI: f32 = 88.0;
const LOG2E: f32 = std::f32::consts::LOG2_E;
/// `ln 2` split in two: the high part has few mantissa bits, so `n · LN2_HI`
/// is exact.
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// Polynomial for `(eʳ − 1 − r) / r²` on |r| ≤ ln 2 / 2, highest degree first.
const P: [f32; 6] = [
    1.987_569_1e-4,
    1.398_2e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    0.166_666_65,
    0.5,
];

/// `eˣ` (one element).
#[inline(always)]
// `max` then `min`, not `clamp`: a NaN becomes `LO`, as on the AVX2 path.
#[allow(clippy::manual_clamp)]
pub(crate) fn exp(x: f32) -> f32 {
    let x = x.max(LO).min(HI);
    let n = (x * LOG2E).round_ties_even();
    let r = n.mul_add(-LN2_HI, x);
    let r = n.mul_add(-LN2_LO, r);
    let mut y = P[0];
    for p in &P[1..] {
        y = y.mul_add(r, *p);
    }
    let y = y.mul_add(r * r, r) + 1.0;
    y * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// `x ← eˣ` for every element.
pub(crate) fn exp_in_place(xs: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if crate::qgemm::has_fma() {
        // SAFETY: the CPU has AVX2 and FMA (detected just above).
        return unsafe { x86::exp_in_place(xs) };
    }
    for x in xs {
        *x = exp(*x);
    }
}

/// SwiGLU: `out = g · σ(g) · u`, i.e. `g / (1 + e⁻ᵍ) · u`, element-wise.
pub(crate) fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
    assert!(gate.len() == out.len() && up.len() == out.len());
    #[cfg(target_arch = "x86_64")]
    if crate::qgemm::has_fma() {
        // SAFETY: the CPU has AVX2 and FMA (detected just above).
        return unsafe { x86::swiglu(gate, up, out) };
    }
    for ((o, g), u) in out.iter_mut().zip(gate).zip(up) {
        *o = swiglu1(*g, *u);
    }
}

#[inline(always)]
fn swiglu1(g: f32, u: f32) -> f32 {
    g / (1.0 + exp(-g)) * u
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    //! The AVX2 path: eight lanes of [`super::exp`], operation for operation.

    use std::arch::x86_64::*;

    use super::{HI, LN2_HI, LN2_LO, LO, LOG2E, P};

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn exp8(x: __m256) -> __m256 {
        // max/min return their second operand for a NaN, as f32::max/min
        // return the non-NaN one: NaN becomes LO on both paths.
        let x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(LO)), _mm256_set1_ps(HI));
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_mul_ps(x, _mm256_set1_ps(LOG2E)),
        );
        let r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_HI), x);
        let r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_LO), r);
        let mut y = _mm256_set1_ps(P[0]);
        for p in &P[1..] {
            y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(*p));
        }
        let y = _mm256_add_ps(
            _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), r),
            _mm256_set1_ps(1.0),
        );
        let bits = _mm256_slli_epi32::<23>(_mm256_add_epi32(
            _mm256_cvtps_epi32(n),
            _mm256_set1_epi32(127),
        ));
        _mm256_mul_ps(y, _mm256_castsi256_ps(bits))
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) fn exp_in_place(xs: &mut [f32]) {
        let mut chunks = xs.chunks_exact_mut(8);
        for c in &mut chunks {
            let p = c.as_mut_ptr();
            // SAFETY: `c` holds 8 floats; unaligned load and store.
            unsafe { _mm256_storeu_ps(p, exp8(_mm256_loadu_ps(p))) };
        }
        for x in chunks.into_remainder() {
            *x = super::exp(*x);
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
        let n = out.len() / 8 * 8;
        let one = _mm256_set1_ps(1.0);
        let zero = _mm256_setzero_ps();
        for i in (0..n).step_by(8) {
            // SAFETY: i + 8 ≤ n ≤ each slice's length (asserted by the caller).
            unsafe {
                let g = _mm256_loadu_ps(gate.as_ptr().add(i));
                let u = _mm256_loadu_ps(up.as_ptr().add(i));
                let e = exp8(_mm256_sub_ps(zero, g));
                let a = _mm256_div_ps(g, _mm256_add_ps(one, e));
                _mm256_storeu_ps(out.as_mut_ptr().add(i), _mm256_mul_ps(a, u));
            }
        }
        for i in n..out.len() {
            out[i] = super::swiglu1(gate[i], up[i]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inputs() -> Vec<f32> {
        let mut v: Vec<f32> = (-2000..=2000).map(|i| i as f32 * 0.0625).collect();
        v.extend([
            0.0,
            -0.0,
            1e-30,
            -1e-30,
            87.0,
            88.3,
            88.4,
            89.0,
            1000.0,
            -87.0,
            -87.4,
            -100.0,
            -1e30,
            f32::INFINITY,
            f32::NEG_INFINITY,
            0.346_573_6,
            -0.346_573_6,
        ]);
        let mut s = 0x1234_5678u32;
        for _ in 0..5000 {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            v.push((s as f32 / u32::MAX as f32 - 0.5) * 180.0);
        }
        v
    }

    #[test]
    fn close_to_the_true_exponential() {
        for x in inputs() {
            let got = f64::from(exp(x));
            let want = f64::from(x.clamp(LO, HI)).exp();
            assert!(
                (got - want).abs() <= 4e-7 * want,
                "exp({x}) = {got}, want {want}"
            );
        }
        assert_eq!(exp(0.0), 1.0);
        assert!(exp(f32::NAN).is_finite());
    }

    #[test]
    fn every_path_gives_the_same_bits() {
        let xs = inputs();
        let mut v = xs.clone();
        exp_in_place(&mut v);
        for (x, got) in xs.iter().zip(&v) {
            assert_eq!(got.to_bits(), exp(*x).to_bits(), "exp({x})");
        }
        let up: Vec<f32> = xs.iter().map(|x| x * 0.5 - 1.0).collect();
        let mut out = vec![0f32; xs.len()];
        swiglu(&xs, &up, &mut out);
        for ((g, u), got) in xs.iter().zip(&up).zip(&out) {
            assert_eq!(got.to_bits(), swiglu1(*g, *u).to_bits(), "swiglu({g}, {u})");
        }
        // Every tail length of the vector loop.
        for len in 0..20 {
            let mut v = xs[..len].to_vec();
            exp_in_place(&mut v);
            assert!(
                v.iter()
                    .zip(&xs)
                    .all(|(a, x)| a.to_bits() == exp(*x).to_bits())
            );
        }
    }
}
