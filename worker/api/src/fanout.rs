//! `n > 1` and prompt lists: one client request split into single-choice
//! requests (one prompt, `n` absent), and their answers merged back into one
//! OpenAI answer, whole or streamed.
//!
//! Every door serves a request with several choices this way: each part is
//! an ordinary request (validated, routed and, on the PD path, prefilled and
//! decoded as any other), so nothing downstream knows about `n`. Choice `j`
//! of prompt `i` is part `i * n + j` and carries that `index` in the answer
//! (vLLM's order). Usage counts each prompt once (the `n` choices of a
//! prompt share its prefill, as in vLLM) and every choice's tokens.
//!
//! The parts of one prompt are independent sequences: with a `seed`, choice
//! `j` samples with `seed + j` (so choice 0 is what the same request with
//! `n = 1` returns). A fan-out has at most [`MAX_CHOICES`] parts; the PD
//! protocol's own requests (`kv_transfer_params`) are never split.

use serde_json::{Map, Value, json};

use crate::rules::RuleError;

/// The most choices (prompts × `n`) one request may ask for.
pub const MAX_CHOICES: usize = 16;

/// A request split into its single-choice parts.
#[derive(Debug, Clone, PartialEq)]
pub struct Split {
    /// Prompts in the request (1 for a chat).
    pub prompts: usize,
    /// Choices per prompt.
    pub n: usize,
    /// The parts' bodies, part `i * n + j` being choice `j` of prompt `i`.
    pub parts: Vec<Vec<u8>>,
    /// Whether the client asked for a stream.
    pub stream: bool,
    /// The request's `seed`, if any.
    pub seed: Option<i64>,
}

impl Split {
    /// Whether `part` is the first choice of its prompt (the one whose
    /// prefill the prompt's other choices may reuse).
    pub fn is_first_of_prompt(&self, part: usize) -> bool {
        part.is_multiple_of(self.n)
    }

    /// The `seed` of `part`: the request's plus the part's choice number.
    pub fn seed_of(&self, part: usize) -> Option<i64> {
        self.seed.map(|s| s.wrapping_add((part % self.n) as i64))
    }
}

/// Splits `body` when it asks for more than one choice; `Ok(None)` for a
/// request with one choice, or a body this cannot read (the single path then
/// gives its own error). `chat`: the body is a chat (no `prompt` list).
pub fn split(body: &[u8], chat: bool) -> Result<Option<Split>, RuleError> {
    // A body that is no JSON object (or repeats a key) is not split: the
    // request rules refuse it whole, with their message.
    let Ok(Value::Object(obj)) = crate::rules::parse_json(body) else {
        return Ok(None);
    };
    let n = match obj.get("n") {
        None | Some(Value::Null) => 1,
        Some(v) => match v.as_f64() {
            Some(f) if f >= 1.0 && f.fract() == 0.0 && v.is_number() => f.min(1e6) as usize,
            _ => {
                return Err(RuleError::param(
                    "n",
                    format!("n must be an integer of at least 1, not {v}"),
                ));
            }
        },
    };
    let prompts: Vec<Value> = match (chat, obj.get("prompt")) {
        (false, Some(Value::Array(items)))
            if !items.is_empty() && items.iter().all(|p| p.is_string() || p.is_array()) =>
        {
            items.clone()
        }
        _ => Vec::new(),
    };
    let k = prompts.len().max(1);
    if n == 1 && k == 1 {
        return Ok(None);
    }
    if k.saturating_mul(n) > MAX_CHOICES {
        return Err(RuleError::param(
            if k > 1 { "prompt" } else { "n" },
            format!(
                "{k} prompt(s) x n = {n} asks for {} choices; at most {MAX_CHOICES} are served per request",
                k.saturating_mul(n)
            ),
        ));
    }
    // `best_of` more than `n` would rank extra candidates, which is not
    // served; less than `n` is vLLM's error too.
    if let Some(b) = obj.get("best_of").filter(|b| !b.is_null())
        && b.as_f64() != Some(n as f64)
    {
        return Err(RuleError::param(
            "best_of",
            format!(
                "best_of ({b}) must be null or equal to n ({n}): ranking extra candidates is not served"
            ),
        ));
    }
    if obj.get("kv_transfer_params").is_some_and(|v| !v.is_null()) {
        return Err(RuleError::param(
            "kv_transfer_params",
            "a request of the PD protocol (kv_transfer_params) has one prompt and n = 1",
        ));
    }
    let seed = obj.get("seed").and_then(Value::as_i64);
    let stream = obj.get("stream").and_then(Value::as_bool) == Some(true);
    let mut parts = Vec::with_capacity(k * n);
    for i in 0..k {
        for _ in 0..n {
            let mut o: Map<String, Value> = obj.clone();
            o.remove("n");
            if n > 1 {
                o.remove("best_of");
            }
            if let Some(p) = prompts.get(i) {
                o.insert("prompt".into(), p.clone());
            }
            parts.push(o);
        }
    }
    let mut split = Split {
        prompts: k,
        n,
        parts: Vec::with_capacity(parts.len()),
        stream,
        seed,
    };
    for (g, mut o) in parts.into_iter().enumerate() {
        if let Some(s) = split.seed_of(g) {
            o.insert("seed".into(), json!(s));
        }
        split
            .parts
            .push(serde_json::to_vec(&Value::Object(o)).unwrap_or_default());
    }
    Ok(Some(split))
}

// === impl usage ===

/// The request's usage from its parts' (`None`: a part without one): each
/// prompt counted once (from its first choice), every choice's tokens.
fn total_usage(n: usize, usages: &[Option<Value>]) -> Option<Value> {
    let get = |u: &Value, k: &str| u.get(k).and_then(Value::as_u64).unwrap_or(0);
    let (mut prompt, mut completion, mut cached, mut any_cached) = (0, 0, 0, false);
    let mut seen = false;
    for (p, u) in usages.iter().enumerate() {
        let Some(u) = u else { continue };
        seen = true;
        completion += get(u, "completion_tokens");
        if p % n == 0 {
            prompt += get(u, "prompt_tokens");
            if let Some(c) = u
                .get("prompt_tokens_details")
                .and_then(|d| d.get("cached_tokens"))
                .and_then(Value::as_u64)
            {
                cached += c;
                any_cached = true;
            }
        }
    }
    if !seen {
        return None;
    }
    let mut u = json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    });
    if any_cached {
        u["prompt_tokens_details"] = json!({ "cached_tokens": cached });
    }
    Some(u)
}

// === impl merge_whole ===

/// One answer from the parts' whole answers (in part order): the first
/// part's envelope (`id`, `created`, `model`, ...), every part's choice with
/// its index, and the total usage.
pub fn merge_whole(split: &Split, answers: Vec<Value>) -> Value {
    let usages: Vec<Option<Value>> = answers.iter().map(|a| a.get("usage").cloned()).collect();
    let mut choices = Vec::with_capacity(answers.len());
    let mut base = None;
    for (g, mut a) in answers.into_iter().enumerate() {
        if let Some(Value::Array(cs)) = a.get_mut("choices") {
            for mut c in cs.drain(..) {
                c["index"] = json!(g);
                choices.push(c);
            }
        }
        if base.is_none() {
            base = Some(a);
        }
    }
    let mut out = base.unwrap_or_else(|| json!({}));
    out["choices"] = Value::Array(choices);
    if let Some(u) = total_usage(split.n, &usages) {
        out["usage"] = u;
    }
    out
}

// === impl StreamMerge ===

/// The merged stream of the parts' streams: each part's chunks pass through
/// with the request's `id` and the part's `index`; the parts' usage chunks
/// and `[DONE]`s are held, and the end brings one usage chunk (when the parts
/// sent usage, i.e. the client asked) and one `[DONE]`.
#[derive(Debug)]
pub struct StreamMerge {
    n: usize,
    id: Option<Value>,
    envelope: Option<Value>,
    usages: Vec<Option<Value>>,
    done: Vec<bool>,
}

/// What one event of a part makes of the merged stream.
#[derive(Debug, PartialEq)]
pub enum Merged {
    /// Events to send now (SSE `data:` payloads).
    Send(Vec<String>),
    /// The part reported an error: send this event, then end the stream.
    Failed(String),
}

impl StreamMerge {
    /// A merge of `split`'s parts.
    pub fn new(split: &Split) -> Self {
        StreamMerge {
            n: split.n,
            id: None,
            envelope: None,
            usages: vec![None; split.parts.len()],
            done: vec![false; split.parts.len()],
        }
    }

    /// One `data:` payload of `part`.
    pub fn event(&mut self, part: usize, data: &str) -> Merged {
        if data.trim() == "[DONE]" {
            if let Some(d) = self.done.get_mut(part) {
                *d = true;
            }
            return Merged::Send(Vec::new());
        }
        let Ok(mut v) = serde_json::from_str::<Value>(data) else {
            return Merged::Failed(error_event("a choice's stream sent an unreadable event"));
        };
        if v.get("error").is_some() {
            return Merged::Failed(data.to_string());
        }
        let Some(slot) = self.usages.get_mut(part) else {
            return Merged::Send(Vec::new());
        };
        if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
            *slot = Some(u.clone());
        }
        let empty = v
            .get("choices")
            .and_then(Value::as_array)
            .is_none_or(Vec::is_empty);
        if empty {
            // A usage-only chunk: the total comes at the end.
            return Merged::Send(Vec::new());
        }
        if let Some(Value::Array(cs)) = v.get_mut("choices") {
            for c in cs {
                c["index"] = json!(part);
            }
        }
        let id = self.id.get_or_insert_with(|| v["id"].clone()).clone();
        v["id"] = id;
        if v.get("usage").is_some_and(|u| !u.is_null())
            && let Some(u) = total_usage(self.n, &self.usages)
        {
            v["usage"] = u;
        }
        if self.envelope.is_none() {
            self.envelope = Some(v.clone());
        }
        Merged::Send(vec![v.to_string()])
    }

    /// Whether `part` sent its `[DONE]`.
    pub fn part_done(&self, part: usize) -> bool {
        self.done.get(part).copied().unwrap_or(false)
    }

    /// Whether every part sent its `[DONE]`.
    pub fn all_done(&self) -> bool {
        self.done.iter().all(|d| *d)
    }

    /// The end of the merged stream: the total usage (if the parts sent
    /// usage) and `[DONE]`.
    pub fn finish(&self) -> Vec<String> {
        let mut out = Vec::new();
        if let Some(u) = total_usage(self.n, &self.usages) {
            let env = self.envelope.clone().unwrap_or_else(|| json!({}));
            let mut chunk = json!({
                "id": self.id.clone().unwrap_or(Value::Null),
                "object": env.get("object").cloned().unwrap_or(Value::Null),
                "created": env.get("created").cloned().unwrap_or(Value::Null),
                "model": env.get("model").cloned().unwrap_or(Value::Null),
                "choices": [],
            });
            chunk["usage"] = u;
            out.push(chunk.to_string());
        }
        out.push("[DONE]".into());
        out
    }
}

/// An in-stream error event (OpenAI's error body) with `message`.
pub fn error_event(message: &str) -> String {
    json!({
        "error": {
            "message": message,
            "type": "internal_server_error",
            "param": null,
            "code": 500,
        }
    })
    .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(s: &Split) -> Vec<Value> {
        s.parts
            .iter()
            .map(|p| serde_json::from_slice(p).unwrap())
            .collect()
    }

    #[test]
    fn one_choice_is_not_split() {
        for body in [
            r#"{"model":"m","prompt":"a"}"#,
            r#"{"model":"m","prompt":["a"],"n":1}"#,
            r#"{"model":"m","prompt":[1,2,3]}"#,
            r#"{"model":"m","prompt":[[1,2,3]]}"#,
            r#"not json"#,
        ] {
            assert_eq!(split(body.as_bytes(), false).unwrap(), None, "{body}");
        }
    }

    #[test]
    fn prompts_and_choices_split_in_vllm_order_with_seeds_apart() {
        let s = split(
            br#"{"model":"m","prompt":["a","b"],"n":2,"seed":7,"stream":true}"#,
            false,
        )
        .unwrap()
        .unwrap();
        assert_eq!((s.prompts, s.n, s.stream), (2, 2, true));
        let p = parts(&s);
        let got: Vec<(&str, i64)> = p
            .iter()
            .map(|v| (v["prompt"].as_str().unwrap(), v["seed"].as_i64().unwrap()))
            .collect();
        assert_eq!(got, [("a", 7), ("a", 8), ("b", 7), ("b", 8)]);
        assert!(p.iter().all(|v| v.get("n").is_none()));
        assert!(s.is_first_of_prompt(2) && !s.is_first_of_prompt(3));
        assert_eq!((s.seed_of(2), s.seed_of(3)), (Some(7), Some(8)));
        let t = split(br#"{"model":"m","prompt":[[1,2],[3]]}"#, false)
            .unwrap()
            .unwrap();
        assert_eq!(parts(&t)[1]["prompt"], json!([3]));
        // A chat's `prompt` is nobody's business: only `n` splits it.
        let c = split(br#"{"model":"m","messages":[],"n":3}"#, true)
            .unwrap()
            .unwrap();
        assert_eq!((c.prompts, c.parts.len()), (1, 3));
    }

    #[test]
    fn bad_fan_outs_name_their_field() {
        for (body, param) in [
            (r#"{"prompt":"a","n":0}"#, "n"),
            (r#"{"prompt":"a","n":1.5}"#, "n"),
            (r#"{"prompt":"a","n":"2"}"#, "n"),
            (r#"{"prompt":"a","n":17}"#, "n"),
            (r#"{"prompt":["a","b","c","d","e","f"],"n":3}"#, "prompt"),
            (r#"{"prompt":"a","n":2,"best_of":1}"#, "best_of"),
            (r#"{"prompt":"a","n":2,"best_of":3}"#, "best_of"),
            (
                r#"{"prompt":"a","n":2,"kv_transfer_params":{"do_remote_decode":true}}"#,
                "kv_transfer_params",
            ),
        ] {
            let e = split(body.as_bytes(), false).unwrap_err();
            assert_eq!(e.param, Some(param), "{body}: {e:?}");
        }
    }

    #[test]
    fn whole_answers_merge_with_indices_and_usage_once_per_prompt() {
        let s = split(br#"{"prompt":["a","b"],"n":2}"#, false)
            .unwrap()
            .unwrap();
        let answer = |id: &str, text: &str, p: u64, c: u64, cached: u64| {
            json!({"id": id, "object": "text_completion", "choices": [{"index": 0, "text": text}],
                   "usage": {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                             "prompt_tokens_details": {"cached_tokens": cached}}})
        };
        let m = merge_whole(
            &s,
            vec![
                answer("x0", "A0", 5, 3, 0),
                answer("x1", "A1", 5, 4, 4),
                answer("x2", "B0", 7, 2, 0),
                answer("x3", "B1", 7, 1, 6),
            ],
        );
        assert_eq!(m["id"], "x0");
        let texts: Vec<(u64, &str)> = m["choices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| (c["index"].as_u64().unwrap(), c["text"].as_str().unwrap()))
            .collect();
        assert_eq!(texts, [(0, "A0"), (1, "A1"), (2, "B0"), (3, "B1")]);
        assert_eq!(
            m["usage"],
            json!({"prompt_tokens": 12, "completion_tokens": 10, "total_tokens": 22,
                   "prompt_tokens_details": {"cached_tokens": 0}})
        );
    }

    #[test]
    fn streams_merge_with_one_id_one_usage_and_one_done() {
        let s = split(br#"{"prompt":"a","n":2,"stream":true}"#, false)
            .unwrap()
            .unwrap();
        let mut m = StreamMerge::new(&s);
        let chunk = |id: &str, t: &str| {
            json!({"id": id, "object": "text_completion", "created": 1, "model": "m",
                   "choices": [{"index": 0, "text": t}]})
            .to_string()
        };
        let usage = |p: u64, c: u64| {
            json!({"id": "z", "object": "text_completion", "created": 1, "model": "m", "choices": [],
                   "usage": {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}})
            .to_string()
        };
        let Merged::Send(a) = m.event(1, &chunk("b", "x")) else {
            panic!()
        };
        let a: Value = serde_json::from_str(&a[0]).unwrap();
        assert_eq!(
            (a["id"].as_str(), a["choices"][0]["index"].as_u64()),
            (Some("b"), Some(1))
        );
        let Merged::Send(b) = m.event(0, &chunk("a", "y")) else {
            panic!()
        };
        let b: Value = serde_json::from_str(&b[0]).unwrap();
        assert_eq!(
            (b["id"].as_str(), b["choices"][0]["index"].as_u64()),
            (Some("b"), Some(0))
        );
        assert_eq!(m.event(0, &usage(5, 2)), Merged::Send(vec![]));
        assert_eq!(m.event(1, &usage(5, 3)), Merged::Send(vec![]));
        assert_eq!(m.event(0, "[DONE]"), Merged::Send(vec![]));
        assert!(!m.all_done());
        assert_eq!(m.event(1, " [DONE]"), Merged::Send(vec![]));
        assert!(m.all_done());
        let end = m.finish();
        assert_eq!(end.len(), 2);
        let u: Value = serde_json::from_str(&end[0]).unwrap();
        assert_eq!(u["usage"]["prompt_tokens"], 5);
        assert_eq!(u["usage"]["completion_tokens"], 5);
        assert_eq!(u["id"], "b");
        assert_eq!(end[1], "[DONE]");
        // An error event ends the merge with it.
        let err = error_event("boom");
        assert_eq!(m.event(0, &err), Merged::Failed(err.clone()));
    }
}
