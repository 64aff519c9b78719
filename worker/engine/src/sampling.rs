//! Token choice, the logit processors, log-probabilities and stop handling.
//!
//! [`sample`] picks token `i` of a generation from its raw logits:
//!
//! 1. the processors, on a copy and only when one is on: `min_tokens` masks
//!    the stop tokens while fewer than `min_tokens` tokens were generated;
//!    `repetition_penalty` (vLLM/HF: every token of prompt + output, a
//!    positive logit divided by it, a negative one multiplied);
//!    `frequency_penalty` × count and `presence_penalty` once, over the output
//!    only (OpenAI); `logit_bias` added;
//! 2. greedy (temperature 0) is the arg-max (lowest id on ties); otherwise
//!    divide by the temperature, cut to the top-k, softmax, drop what is
//!    below `min_p` × the top probability, cut to the top-p nucleus, and draw
//!    with a uniform number that is a pure function of `(seed, i)`
//!    (SplitMix64).
//!
//! Nothing else feeds the choice, so a prefill on one machine and a decode on
//! another pick the same tokens as one machine doing both, given the same
//! [`History`]. Log-probabilities ([`logprobs`]) are the log-softmax, in f64,
//! of the **raw** logits (the model's own distribution, before temperature,
//! penalties and bias; vLLM's default), rounded to f32.
//!
//! [`StopScanner`] finds stop sequences in the streamed text and holds back
//! text that may be the start of one.

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};

use crate::{SamplingParams, TokenLogprobs};

/// The tokens a stream has seen, as the penalties need them: what the
/// prompt and the output contain (repetition) and how often each token was
/// generated (frequency, presence). Empty unless a penalty is on.
#[derive(Debug, Clone, Default)]
pub struct History {
    generated: HashMap<u32, u32>,
    seen: HashSet<u32>,
    count: usize,
    repetition: bool,
    counted: bool,
    mask: Vec<u32>,
}

impl History {
    /// The history of a stream that starts after `prompt`. `stop_ids`: the
    /// model's own stop tokens, masked (with `stop_token_ids`) while fewer
    /// than `min_tokens` were generated.
    /// The last [`SamplingParams::resumed`] tokens of `prompt` are counted
    /// as generated ones.
    pub fn new(prompt: &[u32], params: &SamplingParams, stop_ids: &HashSet<u32>) -> Self {
        let repetition = params.repetition_penalty != 1.0;
        let counted = params.frequency_penalty != 0.0 || params.presence_penalty != 0.0;
        let mut mask = Vec::new();
        if params.min_tokens > 0 {
            mask.extend(stop_ids.iter().copied());
            mask.extend(params.stop_token_ids.iter().copied());
            mask.sort_unstable();
            mask.dedup();
        }
        let resumed = params.resumed.min(prompt.len());
        let (prompt, output) = prompt.split_at(prompt.len() - resumed);
        let mut h = History {
            generated: HashMap::new(),
            seen: if repetition {
                prompt.iter().copied().collect()
            } else {
                HashSet::new()
            },
            count: 0,
            repetition,
            counted,
            mask,
        };
        for &id in output {
            h.push(id);
        }
        h
    }

    /// Records a generated token.
    pub fn push(&mut self, id: u32) {
        self.count += 1;
        if self.repetition {
            self.seen.insert(id);
        }
        if self.counted {
            *self.generated.entry(id).or_insert(0) += 1;
        }
    }

    /// Tokens generated so far.
    pub fn generated(&self) -> usize {
        self.count
    }
}

/// What [`sample`] chose.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    /// The token.
    pub id: u32,
    /// Its log-probability and the top alternatives, when asked for.
    pub logprobs: Option<TokenLogprobs>,
}

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

/// Whether any processor changes the logits of token number `index`.
fn processing(params: &SamplingParams, history: &History, index: u64) -> bool {
    params.repetition_penalty != 1.0
        || params.frequency_penalty != 0.0
        || params.presence_penalty != 0.0
        || !params.logit_bias.is_empty()
        || (index < params.min_tokens as u64 && !history.mask.is_empty())
}

/// The logits after the processors (see the module docs).
pub fn process<'a>(
    logits: &'a [f32],
    params: &SamplingParams,
    history: &History,
    index: u64,
) -> Cow<'a, [f32]> {
    if !processing(params, history, index) {
        return Cow::Borrowed(logits);
    }
    let mut l = logits.to_vec();
    if index < params.min_tokens as u64 {
        for &id in &history.mask {
            if let Some(x) = l.get_mut(id as usize) {
                *x = f32::NEG_INFINITY;
            }
        }
    }
    let r = params.repetition_penalty;
    if r != 1.0 {
        for &id in &history.seen {
            if let Some(x) = l.get_mut(id as usize) {
                *x = if *x > 0.0 { *x / r } else { *x * r };
            }
        }
    }
    if params.frequency_penalty != 0.0 || params.presence_penalty != 0.0 {
        for (&id, &n) in &history.generated {
            if let Some(x) = l.get_mut(id as usize) {
                *x -= params.frequency_penalty * n as f32 + params.presence_penalty;
            }
        }
    }
    for &(id, b) in &params.logit_bias {
        if let Some(x) = l.get_mut(id as usize) {
            *x += b;
        }
    }
    Cow::Owned(l)
}

/// Picks generated token number `index` (0 = the token the prefill
/// produces) from the raw `logits`, after the processors; with
/// `params.logprobs`, the log-probabilities of the raw logits too.
pub fn sample(logits: &[f32], params: &SamplingParams, index: u64, history: &History) -> Sampled {
    let processed = process(logits, params, history, index);
    let id = choose(&processed, params, index);
    Sampled {
        id,
        logprobs: params.logprobs.map(|n| logprobs(logits, id, n)),
    }
}

/// The log-softmax (f64) of `logits` at `chosen`, and the `top` most likely
/// tokens (descending, lowest id on ties) with theirs. One pass for the
/// maximum, one for the sum of exponentials, one for the top-N (a running
/// list of N, no sort of the vocabulary).
pub fn logprobs(logits: &[f32], chosen: u32, top: usize) -> TokenLogprobs {
    let max = logits
        .iter()
        .filter(|v| v.is_finite())
        .fold(f32::NEG_INFINITY, |m, v| m.max(*v));
    let max = f64::from(max);
    let sum: f64 = logits
        .iter()
        .filter(|v| v.is_finite())
        .map(|v| (f64::from(*v) - max).exp())
        .sum();
    let lse = max + sum.ln();
    let lp = |id: u32| {
        let v = logits
            .get(id as usize)
            .copied()
            .unwrap_or(f32::NEG_INFINITY);
        (f64::from(v) - lse) as f32
    };
    let mut best: Vec<(u32, f32)> = Vec::with_capacity(top + 1);
    if top > 0 {
        for (i, v) in logits.iter().enumerate() {
            if !v.is_finite() || (best.len() == top && *v <= best[top - 1].1) {
                continue;
            }
            let at = best.partition_point(|(_, b)| *b >= *v);
            best.insert(at, (i as u32, *v));
            best.truncate(top);
        }
    }
    TokenLogprobs {
        logprob: lp(chosen),
        top: best.into_iter().map(|(i, _)| (i, lp(i))).collect(),
    }
}

/// The choice itself, on processed logits.
fn choose(logits: &[f32], params: &SamplingParams, index: u64) -> u32 {
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
    normalize(&mut probs);
    if params.min_p > 0.0 {
        let floor = f64::from(params.min_p) * probs[0];
        let keep = probs.iter().take_while(|p| **p >= floor).count().max(1);
        probs.truncate(keep);
        normalize(&mut probs);
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
        normalize(&mut probs);
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

fn normalize(probs: &mut [f64]) {
    let total: f64 = probs.iter().sum();
    for p in probs.iter_mut() {
        *p /= total;
    }
}

/// Finds stop sequences in streamed text.
#[derive(Debug, Clone)]
pub struct StopScanner {
    stops: Vec<String>,
    held: String,
    matched: Option<String>,
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
            matched: None,
        }
    }

    /// The stop sequence that ended the text, once one did.
    pub fn matched(&self) -> Option<&str> {
        self.matched.as_deref()
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
            .filter_map(|s| self.held.find(s.as_str()).map(|at| (at, s)))
            .min_by_key(|(at, _)| *at);
        if let Some((at, s)) = first {
            self.matched = Some(s.clone());
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
            ..SamplingParams::default()
        }
    }

    fn pick(logits: &[f32], p: &SamplingParams, index: u64) -> u32 {
        sample(logits, p, index, &History::new(&[], p, &HashSet::new())).id
    }

    /// A continued generation's history holds its resumed tokens as output:
    /// the same penalties and `min_tokens` mask as the uninterrupted one
    /// after those tokens.
    #[test]
    fn resumed_tokens_count_as_output() {
        let stop: HashSet<u32> = [0].into();
        let p = SamplingParams {
            frequency_penalty: 1.0,
            min_tokens: 3,
            ..params(0.0, 0, 1.0, 0)
        };
        let mut whole = History::new(&[5, 6], &p, &stop);
        whole.push(7);
        whole.push(7);
        let resumed = History::new(
            &[5, 6, 7, 7],
            &SamplingParams {
                resumed: 2,
                ..p.clone()
            },
            &stop,
        );
        assert_eq!(resumed.generated(), 2);
        // Token 7 was generated twice: penalized the same in both; the stop
        // token still masked (2 < min_tokens 3) in both.
        let logits = [10.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 2.5];
        for h in [&whole, &resumed] {
            assert_eq!(sample(&logits, &p, 2, h).id, 1);
        }
    }

    #[test]
    fn greedy_is_argmax_with_lowest_index_on_ties() {
        assert_eq!(pick(&[0.1, 3.0, 3.0, -1.0], &params(0.0, 0, 1.0, 0), 0), 1);
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
        let a: Vec<u32> = (0..50).map(|i| pick(&logits, &p, i)).collect();
        let b: Vec<u32> = (0..50).map(|i| pick(&logits, &p, i)).collect();
        assert_eq!(a, b);
        let c: Vec<u32> = (0..50)
            .map(|i| pick(&logits, &params(1.0, 0, 1.0, 43), i))
            .collect();
        assert_ne!(a, c);
        // Sampling really samples: more than one distinct token over 50 draws.
        assert!(a.iter().collect::<HashSet<_>>().len() > 1);
    }

    #[test]
    fn top_k_top_p_and_min_p_restrict_the_choice() {
        let logits = [5.0, 4.9, 0.0, -1.0, 4.8];
        let mut min_p = params(1.0, 0, 1.0, 7);
        // p ∝ e^5, e^4.9, e^0, e^-1, e^4.8: min_p 0.5 keeps ids 0, 1, 4
        // (e^-0.2 = 0.82 ≥ 0.5) and drops 2, 3 (e^-5 < 0.5).
        min_p.min_p = 0.5;
        let mut seen = HashSet::new();
        for i in 0..300 {
            let t = pick(&logits, &params(1.0, 2, 1.0, 7), i);
            assert!(t == 0 || t == 1, "top-k 2 picked {t}");
            let t = pick(&logits, &params(1.0, 0, 0.3, 7), i);
            assert_eq!(t, 0, "top-p 0.3 keeps only the first token");
            seen.insert(pick(&logits, &min_p, i));
        }
        assert_eq!(seen, HashSet::from([0, 1, 4]));
        // min_p 0.95: only the top token (the next is e^-0.1 = 0.905 of it).
        min_p.min_p = 0.95;
        assert!((0..100).all(|i| pick(&logits, &min_p, i) == 0));
    }

    #[test]
    fn penalties_follow_their_definitions() {
        let logits = [2.0f32, -1.0, 1.0, 0.5];
        let mut p = SamplingParams::greedy(4);
        p.repetition_penalty = 2.0;
        p.frequency_penalty = 0.25;
        p.presence_penalty = 0.5;
        let mut h = History::new(&[1], &p, &HashSet::new());
        h.push(0);
        h.push(0);
        h.push(3);
        let l = process(&logits, &p, &h, 3);
        // id 0: generated twice: 2/2 - 0.25*2 - 0.5 = 0.0
        // id 1: prompt only, negative: -1*2 = -2 (no frequency/presence: not generated)
        // id 2: never seen: unchanged
        // id 3: generated once: 0.5/2 - 0.25 - 0.5 = -0.5
        assert_eq!(&*l, &[0.0, -2.0, 1.0, -0.5]);
        assert_eq!(sample(&logits, &p, 3, &h).id, 2);
        // Off: the logits are not even copied.
        let off = SamplingParams::greedy(4);
        assert!(matches!(
            process(&logits, &off, &History::new(&[1], &off, &HashSet::new()), 0),
            Cow::Borrowed(_)
        ));
    }

    #[test]
    fn logit_bias_moves_the_choice_and_min_tokens_masks_the_stops() {
        let logits = [1.0f32, 3.0, 2.0];
        let mut p = SamplingParams::greedy(4);
        p.logit_bias = vec![(2, 1.5)];
        let h = History::new(&[], &p, &HashSet::new());
        assert_eq!(sample(&logits, &p, 0, &h).id, 2);
        p.logit_bias = vec![(1, -100.0)];
        assert_eq!(sample(&logits, &p, 0, &h).id, 2);
        // Token 1 is the model's stop, token 2 a stop_token_id: both masked
        // for indices 0 and 1, allowed from index 2 on.
        let mut p = SamplingParams::greedy(4);
        p.min_tokens = 2;
        p.stop_token_ids = vec![2];
        let h = History::new(&[], &p, &HashSet::from([1]));
        assert_eq!(sample(&logits, &p, 0, &h).id, 0);
        assert_eq!(sample(&logits, &p, 1, &h).id, 0);
        assert_eq!(sample(&logits, &p, 2, &h).id, 1);
    }

    #[test]
    fn logprobs_are_the_raw_log_softmax() {
        let logits = [1.0f32, 3.0, 2.0, 3.0, -0.5];
        // Hand-computed in f64: log p_i = x_i - ln Σ e^x.
        let lse = logits.iter().map(|x| f64::from(*x).exp()).sum::<f64>().ln();
        let want = |i: usize| (f64::from(logits[i]) - lse) as f32;
        let close = |a: f32, b: f32| (a - b).abs() <= 1e-6;
        let lp = logprobs(&logits, 2, 3);
        assert!(close(lp.logprob, want(2)), "{} vs {}", lp.logprob, want(2));
        // Top 3: the tie 1/3 by lowest id first, then 2.
        let ids: Vec<u32> = lp.top.iter().map(|t| t.0).collect();
        assert_eq!(ids, vec![1, 3, 2]);
        assert!(lp.top.iter().all(|(i, l)| close(*l, want(*i as usize))));
        let total: f64 = (0..logits.len()).map(|i| f64::from(want(i)).exp()).sum();
        assert!((total - 1.0).abs() < 1e-6, "{total}");
        assert!(logprobs(&logits, 0, 0).top.is_empty());
        // Computed from the raw logits: a bias changes the choice, not the numbers.
        let mut p = SamplingParams::greedy(1);
        p.logprobs = Some(2);
        p.logit_bias = vec![(4, 50.0)];
        let s = sample(&logits, &p, 0, &History::new(&[], &p, &HashSet::new()));
        assert_eq!(s.id, 4);
        assert!(close(s.logprobs.unwrap().logprob, want(4)));
        // A large vocabulary: the top list equals a full sort's.
        let long: Vec<f32> = (0..5000)
            .map(|i| ((i * 7919) % 1009) as f32 * 0.01)
            .collect();
        let mut sorted: Vec<u32> = (0..5000).collect();
        sorted.sort_by(|a, b| {
            long[*b as usize]
                .total_cmp(&long[*a as usize])
                .then(a.cmp(b))
        });
        let got: Vec<u32> = logprobs(&long, 0, 20).top.iter().map(|t| t.0).collect();
        assert_eq!(got, sorted[..20]);
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
        let mut s = StopScanner::new(&["END".to_string(), "Dx".to_string()]);
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
        assert_eq!(s.matched(), Some("END"), "the earliest match wins");
        let mut s = StopScanner::new(&["END".to_string()]);
        assert_eq!(s.push("E").text, "");
        assert_eq!(s.push("x").text, "Ex");
        assert_eq!(s.push("E").text, "");
        assert_eq!(s.finish(), "E");
        assert_eq!(s.matched(), None);
    }
}
