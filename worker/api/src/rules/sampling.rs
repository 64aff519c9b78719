//! The ranges of the sampling fields both APIs share, and the conversions
//! every door and worker apply the same way (`top_k`'s "off" values, the
//! seed's int64 → u64, `logit_bias`'s keys).

use super::{MAX_TEMPERATURE, RuleError};
use crate::openai::SamplingFields;

/// Most log-probability alternatives a request may ask for (vLLM's bound).
pub const MAX_LOGPROBS: u32 = 20;

/// Most `stop` sequences a request may give (OpenAI allows 4, vLLM sets no
/// bound; stop matching runs on the engine's scheduler thread for every
/// generated token, so the list is bounded).
pub const MAX_STOP: usize = 64;

/// Longest `stop` sequence, in bytes.
pub const MAX_STOP_BYTES: usize = 256;

/// Most `stop_token_ids` a request may give (vLLM sets no bound).
pub const MAX_STOP_TOKEN_IDS: usize = 1024;

/// Most `logit_bias` entries a request may give (OpenAI documents 300).
pub const MAX_LOGIT_BIAS: usize = 1024;

/// The list fields' caps ([`MAX_STOP`], [`MAX_STOP_BYTES`],
/// [`MAX_STOP_TOKEN_IDS`], [`MAX_LOGIT_BIAS`]): an over-cap list is a 400
/// naming its field.
fn check_lists(s: &SamplingFields) -> Result<(), RuleError> {
    if let Some(stop) = &s.stop {
        let stop = stop.to_vec();
        if stop.len() > MAX_STOP {
            return Err(RuleError::param(
                "stop",
                format!(
                    "stop has {} sequences; at most {MAX_STOP} are served",
                    stop.len()
                ),
            ));
        }
        if let Some(long) = stop.iter().find(|x| x.len() > MAX_STOP_BYTES) {
            return Err(RuleError::param(
                "stop",
                format!(
                    "a stop sequence is {} bytes long; at most {MAX_STOP_BYTES} are served",
                    long.len()
                ),
            ));
        }
        if stop.iter().any(String::is_empty) {
            return Err(RuleError::param("stop", "stop sequences must not be empty"));
        }
    }
    if let Some(ids) = &s.stop_token_ids
        && ids.len() > MAX_STOP_TOKEN_IDS
    {
        return Err(RuleError::param(
            "stop_token_ids",
            format!(
                "stop_token_ids has {} entries; at most {MAX_STOP_TOKEN_IDS} are served",
                ids.len()
            ),
        ));
    }
    if let Some(map) = &s.logit_bias
        && map.len() > MAX_LOGIT_BIAS
    {
        return Err(RuleError::param(
            "logit_bias",
            format!(
                "logit_bias has {} entries; at most {MAX_LOGIT_BIAS} are served",
                map.len()
            ),
        ));
    }
    Ok(())
}

fn range(
    name: &'static str,
    v: Option<f32>,
    lo: f32,
    hi: f32,
    open_lo: bool,
) -> Result<(), RuleError> {
    if let Some(x) = v {
        let ok = x.is_finite() && x <= hi && if open_lo { x > lo } else { x >= lo };
        if !ok {
            let l = if open_lo { "(" } else { "[" };
            return Err(RuleError::param(
                name,
                format!("{name} {x} is outside {l}{lo}, {hi}]"),
            ));
        }
    }
    Ok(())
}

/// The sampling rules shared by completions and chat.
pub fn check_sampling(s: &SamplingFields) -> Result<(), RuleError> {
    if let Some(n) = s.n
        && n != 1
    {
        return Err(RuleError::param(
            "n",
            format!(
                "n = {n} reached a single-choice path: the door that receives a request splits n > 1 into single-choice parts (rngd_api::fanout)"
            ),
        ));
    }
    if s.stream_options.is_some() && !s.stream {
        return Err(RuleError::param(
            "stream_options",
            "stream_options is only allowed with stream: true",
        ));
    }
    if s.max_tokens == Some(0) {
        return Err(RuleError::param(
            "max_tokens",
            "max_tokens must be at least 1",
        ));
    }
    range("temperature", s.temperature, 0.0, MAX_TEMPERATURE, false)?;
    range("top_p", s.top_p, 0.0, 1.0, true)?;
    range("min_p", s.min_p, 0.0, 1.0, false)?;
    range("presence_penalty", s.presence_penalty, -2.0, 2.0, false)?;
    range("frequency_penalty", s.frequency_penalty, -2.0, 2.0, false)?;
    range("repetition_penalty", s.repetition_penalty, 0.0, 2.0, true)?;
    if let Some(k) = s.top_k
        && k < -1
    {
        return Err(RuleError::param(
            "top_k",
            format!("top_k {k} is not -1 (off), 0 (off) or a positive count"),
        ));
    }
    check_lists(s)?;
    logit_bias(s)?;
    Ok(())
}

/// `min_tokens` ≤ the request's `max_tokens` (named `name`).
pub(super) fn check_min_tokens(
    s: &SamplingFields,
    name: &str,
    max_tokens: u32,
) -> Result<(), RuleError> {
    match s.min_tokens {
        Some(m) if m > max_tokens => Err(RuleError::param(
            "min_tokens",
            format!("min_tokens {m} is more than {name} {max_tokens}"),
        )),
        _ => Ok(()),
    }
}

/// A log-probability count (`logprobs`, `top_logprobs`) in `0..=20`.
pub(super) fn check_logprobs(n: Option<u32>, name: &'static str) -> Result<(), RuleError> {
    match n {
        Some(n) if n > MAX_LOGPROBS => Err(RuleError {
            param: Some(name),
            field: None,
            code: Some("unsupported_parameter"),
            message: format!("{name} = {n}: at most {MAX_LOGPROBS} alternatives are served"),
        }),
        _ => Ok(()),
    }
}

/// `logit_bias` as (token id, bias) pairs, ascending id: every key a
/// decimal token id, every bias in `[-100, 100]` (the vocabulary is checked
/// by the worker, which knows it).
pub fn logit_bias(s: &SamplingFields) -> Result<Vec<(u32, f32)>, RuleError> {
    let Some(map) = &s.logit_bias else {
        return Ok(Vec::new());
    };
    let mut out = Vec::with_capacity(map.len());
    for (k, b) in map {
        let id: u32 = k.trim().parse().map_err(|_| {
            let shown: String = k.chars().take(20).collect();
            RuleError::param(
                "logit_bias",
                format!("logit_bias key '{shown}' is not a token id"),
            )
        })?;
        if !(b.is_finite() && (-100.0..=100.0).contains(b)) {
            return Err(RuleError::param(
                "logit_bias",
                format!("logit_bias[{id}] = {b} is outside [-100, 100]"),
            ));
        }
        out.push((id, *b));
    }
    out.sort_by_key(|(id, _)| *id);
    out.dedup_by_key(|(id, _)| *id);
    Ok(out)
}

/// `top_k` as the engine takes it: -1, 0 and absent are off (0).
pub fn top_k(s: &SamplingFields) -> usize {
    s.top_k.filter(|k| *k > 0).unwrap_or(0) as usize
}

/// A client seed (any int64) as the engine's `u64`: its two's complement
/// (`-1` → `u64::MAX`), so every int64 names one distinct stream.
pub fn seed_bits(seed: i64) -> u64 {
    seed as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(json: &str) -> SamplingFields {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn the_new_fields_have_their_ranges() {
        for (json, param) in [
            (r#"{"min_p":1.5}"#, "min_p"),
            (r#"{"min_p":-0.1}"#, "min_p"),
            (r#"{"presence_penalty":2.5}"#, "presence_penalty"),
            (r#"{"frequency_penalty":-3}"#, "frequency_penalty"),
            (r#"{"repetition_penalty":0}"#, "repetition_penalty"),
            (r#"{"repetition_penalty":2.5}"#, "repetition_penalty"),
            (r#"{"top_k":-2}"#, "top_k"),
            (r#"{"logit_bias":{"x":1}}"#, "logit_bias"),
            (r#"{"logit_bias":{"5":101}}"#, "logit_bias"),
        ] {
            assert_eq!(
                check_sampling(&fields(json)).unwrap_err().param,
                Some(param),
                "{json}"
            );
        }
        for json in [
            r#"{"min_p":0}"#,
            r#"{"min_p":1}"#,
            r#"{"presence_penalty":-2,"frequency_penalty":2}"#,
            r#"{"repetition_penalty":2}"#,
            r#"{"top_k":-1}"#,
            r#"{"top_k":0}"#,
            r#"{"logit_bias":{"5":-100,"7":100}}"#,
        ] {
            assert!(check_sampling(&fields(json)).is_ok(), "{json}");
        }
        assert_eq!(top_k(&fields(r#"{"top_k":-1}"#)), 0);
        assert_eq!(top_k(&fields(r#"{"top_k":40}"#)), 40);
        assert_eq!(
            logit_bias(&fields(r#"{"logit_bias":{"9":1,"3":-2}}"#)).unwrap(),
            vec![(3, -2.0), (9, 1.0)]
        );
        assert_eq!(seed_bits(-1), u64::MAX);
        assert_eq!(seed_bits(i64::MIN), 1 << 63);
        assert_eq!(seed_bits(7), 7);
    }

    #[test]
    fn list_fields_are_capped_by_name() {
        let stops = |n: usize, len: usize| {
            let v: Vec<String> = (0..n).map(|_| "x".repeat(len)).collect();
            serde_json::json!({ "stop": v }).to_string()
        };
        let ids = |n: usize| serde_json::json!({ "stop_token_ids": vec![1u32; n] }).to_string();
        let bias = |n: usize| {
            let m: serde_json::Map<String, serde_json::Value> =
                (0..n).map(|i| (i.to_string(), 1.into())).collect();
            serde_json::json!({ "logit_bias": m }).to_string()
        };
        for (json, param) in [
            (stops(MAX_STOP + 1, 1), "stop"),
            (stops(1, MAX_STOP_BYTES + 1), "stop"),
            (ids(MAX_STOP_TOKEN_IDS + 1), "stop_token_ids"),
            (bias(MAX_LOGIT_BIAS + 1), "logit_bias"),
        ] {
            assert_eq!(
                check_sampling(&fields(&json)).unwrap_err().param,
                Some(param),
                "{json}"
            );
        }
        for json in [
            stops(MAX_STOP, MAX_STOP_BYTES),
            ids(MAX_STOP_TOKEN_IDS),
            bias(MAX_LOGIT_BIAS),
        ] {
            assert!(check_sampling(&fields(&json)).is_ok());
        }
    }
}
