//! RoPE as GGUF `llama` models use it: adjacent pairs `(2i, 2i+1)` of the
//! first `rope_dims` dimensions of each head rotated by `θ = p·s·b^(−2i/d) / f_i`
//! (position `p`, linear scale `s` = 1/`rope.scaling.factor`, base `b` =
//! `rope.freq_base`, `d` = `rope.dimension_count`, and `f_i` the per-frequency
//! divisors of the optional `rope_freqs.weight` tensor, which is how Llama 3.1's
//! `llama3` scaling reaches a GGUF file). The angles are computed in f64 once
//! per position and frequency at load time.

use crate::EngineError;

/// The cos/sin table for positions `0..max_pos`.
#[derive(Clone)]
pub(crate) struct Rope {
    /// `rope_dims / 2`.
    half: usize,
    /// `[positions, half]`.
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl Rope {
    /// The table for `dims` rotated dimensions. `freq_factors`, when given,
    /// has one positive divisor per frequency (`dims / 2` values).
    pub(crate) fn new(
        dims: usize,
        base: f32,
        freq_scale: f32,
        freq_factors: Option<&[f32]>,
        max_pos: usize,
    ) -> Result<Rope, EngineError> {
        let half = dims / 2;
        if let Some(f) = freq_factors {
            if f.len() != half {
                return Err(EngineError::Other(format!(
                    "tensor `rope_freqs.weight` has {} values, the RoPE has {half} frequencies",
                    f.len()
                )));
            }
            if let Some(bad) = f.iter().find(|x| !(x.is_finite() && **x > 0.0)) {
                return Err(EngineError::Other(format!(
                    "tensor `rope_freqs.weight` holds {bad}, not a positive divisor"
                )));
            }
        }
        let freqs: Vec<f64> = (0..half)
            .map(|i| {
                let f = (base as f64).powf(-((2 * i) as f64) / dims as f64) * freq_scale as f64;
                f / freq_factors.map_or(1.0, |ff| ff[i] as f64)
            })
            .collect();
        let mut cos = Vec::with_capacity(max_pos * half);
        let mut sin = Vec::with_capacity(max_pos * half);
        for pos in 0..max_pos {
            for f in &freqs {
                let theta = pos as f64 * f;
                cos.push(theta.cos() as f32);
                sin.push(theta.sin() as f32);
            }
        }
        Ok(Rope { half, cos, sin })
    }

    /// Rotates `n_heads` heads of `head_dim` values in `x` for position `pos`.
    pub(crate) fn apply(&self, x: &mut [f32], n_heads: usize, head_dim: usize, pos: usize) {
        let half = self.half;
        let cos = &self.cos[pos * half..(pos + 1) * half];
        let sin = &self.sin[pos * half..(pos + 1) * half];
        for head in x.chunks_exact_mut(head_dim).take(n_heads) {
            for i in 0..half {
                let (a, b) = (head[2 * i], head[2 * i + 1]);
                head[2 * i] = a * cos[i] - b * sin[i];
                head[2 * i + 1] = a * sin[i] + b * cos[i];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The angle of frequency `i` at position `p` is `p·s·b^(−2i/d)/f_i`:
    /// checked through the rotation of a unit vector.
    #[test]
    fn angles_follow_base_scale_and_divisors() {
        let (dims, base, pos) = (8, 10_000f32, 37usize);
        let factors = [1.0f32, 2.0, 4.0, 8.0];
        let plain = Rope::new(dims, base, 1.0, None, 64).unwrap();
        let scaled = Rope::new(dims, base, 0.5, Some(&factors), 64).unwrap();
        for i in 0..dims / 2 {
            let angle = |r: &Rope| {
                let mut x = vec![0f32; dims];
                x[2 * i] = 1.0;
                r.apply(&mut x, 1, dims, pos);
                (x[2 * i + 1] as f64).atan2(x[2 * i] as f64)
            };
            let f = (base as f64).powf(-((2 * i) as f64) / dims as f64);
            let wrap = |a: f64| {
                (a + std::f64::consts::PI).rem_euclid(2.0 * std::f64::consts::PI)
                    - std::f64::consts::PI
            };
            assert!(
                (wrap(angle(&plain) - pos as f64 * f)).abs() < 1e-5,
                "plain, i = {i}"
            );
            let want = pos as f64 * 0.5 * f / factors[i] as f64;
            assert!(
                (wrap(angle(&scaled) - want)).abs() < 1e-5,
                "scaled, i = {i}"
            );
        }
    }

    #[test]
    fn refuses_divisors_of_the_wrong_length_or_sign() {
        assert!(Rope::new(8, 1e4, 1.0, Some(&[1.0; 3]), 4).is_err());
        assert!(Rope::new(8, 1e4, 1.0, Some(&[1.0, 0.0, 1.0, 1.0]), 4).is_err());
        assert!(Rope::new(8, 1e4, 1.0, Some(&[1.0, f32::NAN, 1.0, 1.0]), 4).is_err());
    }
}
