//! Token choice and stop handling.
//!
//! [`sample`] picks token `i` of a generation from its logits. Greedy
//! (temperature 0) is the arg-max (lowest id on ties). Otherwise the logits are
//! divided by the temperature, cut to the top-k, softmaxed, cut to the top-p
//! nucleus, and one token is drawn with a uniform number that is a pure
//! function of `(seed, i)` (SplitMix64). Nothing else feeds the choice, so a
//! prefill on one machine and a decode on another pick the same tokens as one
//! machine doing both.
//!
//! [`StopScanner`] finds stop sequences in the streamed text and holds back
//! text that may be the start of one.

use crate::SamplingParams;

/// SplitMix64 step: a well-mixed 64-bit function of its input.
fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The uniform number in `[0, 1)` used for token `index` under `seed`.
pub fn uniform(seed: u64, index: u64) -> f64 {
    let bits = splitmix64(splitmix64(seed) ^ index.wrapping_mul(0xD1B5_4A32_D192_ED03));
    (bits >> 11) as f64 / (1u64 << 53) as f64
}

/// Index of the largest logit (the lowest index among equals; NaNs never
/// win, and a NaN first logit gives 0).
pub fn argmax(logits: &[f32]) -> u32 {
    let Some(first) = logits.first() else {
        return 0;
    };
    if first.is_nan() {
        return 0;
    }
    // Two passes that vectorize: the maximum (a NaN never compares greater),
    // then its first position.
    let max = logits
        .iter()
        .fold(*first, |m, v| if *v > m { *v } else { m });
    logits.iter().position(|v| *v == max).unwrap_or(0) as u32
}

/// Picks generated token number `index` (0 = the token the prefill produces).
pub fn sample(logits: &[f32], params: &SamplingParams, index: u64) -> u32 {
    if params.temperature <= 0.0 || params.top_k == 1 {
        return argmax(logits);
    }
    let t = params.temperature;
    let mut cand: Vec<(u32, f32)> = logits
        .iter()
        .enumerate()
        .filter(|(_, v)| v.is_finite())
        .map(|(i, v)| (i as u32, v / t))
        .collect();
    if cand.is_empty() {
        return argmax(logits);
    }
    // Descending by logit, ascending id on ties: a total, deterministic order.
    cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    if params.top_k > 0 && params.top_k < cand.len() {
        cand.truncate(params.top_k);
    }
    let max = cand[0].1;
    let mut probs: Vec<f64> = cand.iter().map(|(_, v)| f64::from(v - max).exp()).collect();
    let total: f64 = probs.iter().sum();
    for p in probs.iter_mut() {
        *p /= total;
    }
    if params.top_p > 0.0 && params.top_p < 1.0 {
        let mut cum = 0.0;
        let mut keep = probs.len();
        for (i, p) in probs.iter().enumerate() {
            cum += p;
            if cum >= f64::from(params.top_p) {
                keep = i + 1;
                break;
            }
        }
        probs.truncate(keep);
        let total: f64 = probs.iter().sum();
        for p in probs.iter_mut() {
            *p /= total;
        }
    }
    let u = uniform(params.seed, index);
    let mut cum = 0.0;
    for (i, p) in probs.iter().enumerate() {
        cum += p;
        if u < cum {
            return cand[i].0;
        }
    }
    cand[probs.len() - 1].0
}

/// Finds stop sequences in streamed text.
#[derive(Debug, Clone)]
pub struct StopScanner {
    stops: Vec<String>,
    held: String,
}

/// What to do with a piece of streamed text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scanned {
    /// Text safe to send now.
    pub text: String,
    /// A stop sequence was found; `text` ends right before it.
    pub stopped: bool,
}

impl StopScanner {
    /// A scanner for `stops` (empty strings are ignored).
    pub fn new(stops: &[String]) -> Self {
        StopScanner {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            held: String::new(),
        }
    }

    /// Adds new text; returns what can be sent and whether a stop sequence ended it.
    pub fn push(&mut self, text: &str) -> Scanned {
        if self.stops.is_empty() {
            return Scanned {
                text: text.to_string(),
                stopped: false,
            };
        }
        self.held.push_str(text);
        let first = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()))
            .min();
        if let Some(at) = first {
            let text = self.held[..at].to_string();
            self.held.clear();
            return Scanned {
                text,
                stopped: true,
            };
        }
        // Hold back the longest suffix that is a proper prefix of a stop sequence.
        let mut keep = 0;
        for s in &self.stops {
            for (len, _) in s.char_indices().skip(1) {
                if len > keep && self.held.ends_with(&s[..len]) {
                    keep = len;
                }
            }
        }
        let cut = self.held.len() - keep;
        let text = self.held[..cut].to_string();
        self.held.drain(..cut);
        Scanned {
            text,
            stopped: false,
        }
    }

    /// Whether text is held back.
    pub fn is_holding(&self) -> bool {
        !self.held.is_empty()
    }

    /// The end of the stream without a stop: the held-back text.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_k: usize, top_p: f32, seed: u64) -> SamplingParams {
        SamplingParams {
            max_tokens: 1,
            temperature,
            top_k,
            top_p,
            seed,
            stop: vec![],
        }
    }

    #[test]
    fn greedy_is_argmax_with_lowest_index_on_ties() {
        assert_eq!(
            sample(&[0.1, 3.0, 3.0, -1.0], &params(0.0, 0, 1.0, 0), 0),
            1
        );
        // NaNs never win; a NaN first logit gives 0; empty gives 0.
        assert_eq!(argmax(&[0.5, f32::NAN, 2.0, f32::NAN, 2.0]), 2);
        assert_eq!(argmax(&[f32::NAN, 1.0, 2.0]), 0);
        assert_eq!(argmax(&[-0.0, 0.0]), 0);
        assert_eq!(argmax(&[]), 0);
        let long: Vec<f32> = (0..49_152).map(|i| ((i * 7919) % 10_007) as f32).collect();
        let want = long
            .iter()
            .enumerate()
            .fold(0, |b, (i, v)| if *v > long[b] { i } else { b });
        assert_eq!(argmax(&long) as usize, want);
    }

    #[test]
    fn same_seed_and_index_give_the_same_token_and_seeds_differ() {
        let logits: Vec<f32> = (0..100).map(|i| ((i * 37) % 17) as f32 * 0.1).collect();
        let p = params(1.0, 0, 1.0, 42);
        let a: Vec<u32> = (0..50).map(|i| sample(&logits, &p, i)).collect();
        let b: Vec<u32> = (0..50).map(|i| sample(&logits, &p, i)).collect();
        assert_eq!(a, b);
        let c: Vec<u32> = (0..50)
            .map(|i| sample(&logits, &params(1.0, 0, 1.0, 43), i))
            .collect();
        assert_ne!(a, c);
        // Sampling really samples: more than one distinct token over 50 draws.
        assert!(a.iter().collect::<std::collections::HashSet<_>>().len() > 1);
    }

    #[test]
    fn top_k_and_top_p_restrict_the_choice() {
        let logits = [5.0, 4.9, 0.0, -1.0, 4.8];
        for i in 0..200 {
            let t = sample(&logits, &params(1.0, 2, 1.0, 7), i);
            assert!(t == 0 || t == 1, "top-k 2 picked {t}");
            let t = sample(&logits, &params(1.0, 0, 0.3, 7), i);
            assert_eq!(t, 0, "top-p 0.3 keeps only the first token");
        }
    }

    #[test]
    fn uniform_is_in_range_and_spread() {
        let xs: Vec<f64> = (0..1000).map(|i| uniform(1, i)).collect();
        assert!(xs.iter().all(|x| (0.0..1.0).contains(x)));
        let mean = xs.iter().sum::<f64>() / xs.len() as f64;
        assert!((mean - 0.5).abs() < 0.05, "mean {mean}");
    }

    #[test]
    fn stop_scanner_holds_back_partial_matches_and_cuts_at_the_stop() {
        let mut s = StopScanner::new(&["END".to_string()]);
        assert_eq!(s.push("hello E").text, "hello ");
        let r = s.push("N");
        assert_eq!(r.text, "");
        assert!(!r.stopped);
        let r = s.push("Dx");
        assert_eq!(
            r,
            Scanned {
                text: String::new(),
                stopped: true
            }
        );
        let mut s = StopScanner::new(&["END".to_string()]);
        assert_eq!(s.push("E").text, "");
        assert_eq!(s.push("x").text, "Ex");
        assert_eq!(s.push("E").text, "");
        assert_eq!(s.finish(), "E");
    }
}
