//! The one reader of a model server's load: the `vllm:*` gauges of a
//! Prometheus text page (`docs/epp.md`, "Load figures").
//!
//! - Gauges are summed over label sets (`kv_cache_usage_perc`: the largest),
//!   as f64, then rounded once; negative sums read as 0.
//! - Name, labels and value may be separated by spaces or tabs; a `}` inside
//!   a quoted label value does not end the label set; a trailing timestamp is
//!   ignored; `NaN` and infinities are skipped.
//! - A page with neither `vllm:num_requests_waiting` nor
//!   `vllm:num_requests_running` is not a model server's: [`parse_load`] says
//!   `None`, and the scraper counts that as a failed scrape (the endpoint
//!   turns unhealthy), the same as an unreachable one.
//! - The weights a worker serves are the `weight_version` label of
//!   `rngd_pd_worker_weight_info` (the first sample with a value of 1 and a
//!   plain `[0-9a-z]` label of at most 64 characters); a model server
//!   without it reads as `None` (unknown weights: the policy pairs it with
//!   anything, and the decode worker's own check still holds).
//! - The tokenizer a worker serves is the `digest` label of
//!   `rngd_pd_worker_tokenizer_info`, read as `weight_version` is; a door
//!   compares it with its own (`crate::tokenizers`).
//! - The context length a worker serves now is the `seq_len` label of
//!   `rngd_pd_worker_variant_info` (value 1, an integer from 1 to
//!   2^31); the scraper makes it the endpoint's `seq_len`, so admission
//!   follows a variant switch (`/switch_variant`) from the next scrape. A
//!   model server without it keeps the `seq_len` its source gave.
//! - A model server whose gauges are named otherwise is read with
//!   [`LoadNames`] (the picker's `--total-queued-requests-metric`,
//!   `--total-running-requests-metric`, `--kv-cache-usage-percentage-metric`,
//!   as the reference picker spells them).

use rngd_telemetry::names;

/// Load figures parsed from one scrape.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct LoadSample {
    /// `vllm:num_requests_waiting` (summed over label sets).
    pub waiting: u32,
    /// `vllm:num_requests_running` (summed over label sets).
    pub running: u32,
    /// `vllm:kv_cache_usage_perc` (largest over label sets), clamped to 0..=1.
    pub kv_usage: f64,
    /// The `weight_version` of `rngd_pd_worker_weight_info`, if on the page.
    pub weight_version: Option<String>,
    /// The `digest` of `rngd_pd_worker_tokenizer_info`, if on the page.
    pub tokenizer_digest: Option<String>,
    /// The `seq_len` of `rngd_pd_worker_variant_info`, if on the page.
    pub seq_len: Option<u32>,
    /// `process_start_time_seconds`, if on the page: a new value on the
    /// same address is a new process (a restart), whose cache is empty.
    pub started: Option<f64>,
}

/// Longest `weight_version` label read.
const MAX_WEIGHT_VERSION: usize = 64;

/// The value of label `label` on a sample line of the info gauge `metric`
/// whose value is 1.
fn info_label<'a>(line: &'a str, metric: &str, label: &str) -> Option<&'a str> {
    let line = line.trim_matches([' ', '\t', '\r']);
    let rest = line.strip_prefix(metric)?.strip_prefix('{')?;
    let (_, value) = sample(line)?;
    if value != 1.0 {
        return None;
    }
    let key = format!("{label}=\"");
    let at = rest.find(&key)?;
    // Only a label name's start: `xweight_version` is another label.
    if at > 0 && !matches!(rest.as_bytes()[at - 1], b',' | b' ' | b'\t') {
        return None;
    }
    let v = &rest[at + key.len()..];
    Some(&v[..v.find('"')?])
}

/// The `seq_len` label of a `rngd_pd_worker_variant_info` sample line whose
/// value is 1: a decimal integer from 1 to 2^31.
fn variant_seq_len(line: &str) -> Option<u32> {
    let v = info_label(line, names::WORKER_VARIANT_INFO, "seq_len")?;
    if v.is_empty() || v.len() > 10 || !v.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    v.parse::<u32>().ok().filter(|n| (1..=1 << 31).contains(n))
}

/// The `weight_version` label of a `rngd_pd_worker_weight_info` sample line
/// whose value is 1.
fn weight_version(line: &str) -> Option<String> {
    plain_label(line, names::WORKER_WEIGHT_INFO, "weight_version")
}

/// The `digest` label of a `rngd_pd_worker_tokenizer_info` sample line
/// whose value is 1.
fn tokenizer_digest(line: &str) -> Option<String> {
    plain_label(line, names::WORKER_TOKENIZER_INFO, "digest")
}

/// A `[0-9a-z]` label of at most [`MAX_WEIGHT_VERSION`] characters of an
/// info gauge's sample line whose value is 1.
fn plain_label(line: &str, metric: &str, label: &str) -> Option<String> {
    let v = info_label(line, metric, label)?;
    let plain = !v.is_empty()
        && v.len() <= MAX_WEIGHT_VERSION
        && v.bytes()
            .all(|b| b.is_ascii_digit() || b.is_ascii_lowercase());
    plain.then(|| v.to_string())
}

/// The names of the three load gauges on a model server's page (default:
/// vLLM's).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadNames {
    /// Requests waiting (`vllm:num_requests_waiting`).
    pub waiting: String,
    /// Requests running (`vllm:num_requests_running`).
    pub running: String,
    /// KV-cache usage, 0..1 (`vllm:kv_cache_usage_perc`).
    pub kv_usage: String,
}

impl Default for LoadNames {
    fn default() -> Self {
        LoadNames {
            waiting: names::VLLM_NUM_REQUESTS_WAITING.into(),
            running: names::VLLM_NUM_REQUESTS_RUNNING.into(),
            kv_usage: names::VLLM_KV_CACHE_USAGE_PERC.into(),
        }
    }
}

impl LoadNames {
    /// Checks each name is a plain metric name: a label selector
    /// (`name{label="v"}`) is refused, not half-read.
    pub fn check(&self) -> Result<(), String> {
        for n in [&self.waiting, &self.running, &self.kv_usage] {
            let plain = !n.is_empty()
                && n.chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
                && !n.starts_with(|c: char| c.is_ascii_digit());
            if !plain {
                return Err(format!(
                    "`{n}` is not a metric name (letters, digits, `_` and `:`; label selectors are not supported)"
                ));
            }
        }
        Ok(())
    }
}

/// The text after a sample's label set, or `None` when the set never closes.
fn after_labels(rest: &str) -> Option<&str> {
    let mut in_quote = false;
    let mut escaped = false;
    for (i, c) in rest.char_indices().skip(1) {
        match c {
            _ if escaped => escaped = false,
            '\\' if in_quote => escaped = true,
            '"' => in_quote = !in_quote,
            '}' if !in_quote => return Some(&rest[i + 1..]),
            _ => {}
        }
    }
    None
}

/// One sample line as `(name, value)`; `None` for comments, blank and
/// malformed lines.
fn sample(line: &str) -> Option<(&str, f64)> {
    let line = line.trim_matches([' ', '\t', '\r']);
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let name_end = line.find(['{', ' ', '\t'])?;
    let (name, rest) = line.split_at(name_end);
    let rest = if rest.starts_with('{') {
        after_labels(rest)?
    } else {
        rest
    };
    let value: f64 = rest
        .split([' ', '\t'])
        .find(|t| !t.is_empty())?
        .parse()
        .ok()?;
    value.is_finite().then_some((name, value))
}

/// Parses the vLLM model-server gauges out of a Prometheus text page;
/// `None` when neither request gauge is on it (see the module docs).
pub fn parse_load(text: &str) -> Option<LoadSample> {
    parse(
        text,
        names::VLLM_NUM_REQUESTS_WAITING,
        names::VLLM_NUM_REQUESTS_RUNNING,
        names::VLLM_KV_CACHE_USAGE_PERC,
    )
}

/// [`parse_load`] for a model server whose gauges are named `names`.
pub fn parse_load_named(text: &str, names: &LoadNames) -> Option<LoadSample> {
    parse(text, &names.waiting, &names.running, &names.kv_usage)
}

fn parse(text: &str, w: &str, r: &str, k: &str) -> Option<LoadSample> {
    let (mut waiting, mut running, mut kv) = (None::<f64>, None::<f64>, 0.0f64);
    let (mut version, mut seq_len, mut started) = (None, None, None);
    let mut digest = None;
    for line in text.lines() {
        if version.is_none() {
            version = weight_version(line);
        }
        if digest.is_none() {
            digest = tokenizer_digest(line);
        }
        if seq_len.is_none() {
            seq_len = variant_seq_len(line);
        }
        let Some((name, value)) = sample(line) else {
            continue;
        };
        if name == w {
            *waiting.get_or_insert(0.0) += value;
        } else if name == r {
            *running.get_or_insert(0.0) += value;
        } else if name == k {
            kv = kv.max(value);
        } else if name == names::PROCESS_START_TIME_SECONDS {
            started = Some(value);
        }
    }
    if waiting.is_none() && running.is_none() {
        return None;
    }
    // `as` saturates: a sum past u32::MAX reads as u32::MAX.
    let count = |v: Option<f64>| v.unwrap_or(0.0).max(0.0).round() as u32;
    Some(LoadSample {
        waiting: count(waiting),
        running: count(running),
        kv_usage: kv.clamp(0.0, 1.0),
        weight_version: version,
        tokenizer_digest: digest,
        seq_len,
        started,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Another model server's names (SGLang's), and the names refused.
    #[test]
    fn other_servers_gauges_are_read_by_their_names() {
        let sglang = LoadNames {
            waiting: "sglang:num_queue_reqs".into(),
            running: "sglang:num_running_reqs".into(),
            kv_usage: "sglang:token_usage".into(),
        };
        sglang.check().unwrap();
        let text = "sglang:num_queue_reqs{model_name=\"m\"} 4\nsglang:num_running_reqs 2\n\
            sglang:token_usage 0.5\nvllm:num_requests_waiting 9\n";
        let s = parse_load_named(text, &sglang).expect("sample");
        assert_eq!((s.waiting, s.running), (4, 2));
        assert!((s.kv_usage - 0.5).abs() < 1e-12);
        // vLLM's names on that page do not count for it, nor its for vLLM.
        assert_eq!(parse_load("sglang:num_queue_reqs 4\n"), None);
        for bad in ["", "q{model=\"m\"}", "9x", "a b"] {
            let names = LoadNames {
                waiting: bad.into(),
                ..LoadNames::default()
            };
            assert!(names.check().is_err(), "{bad:?} accepted");
        }
    }

    /// The gateway's former parser test: labels, a timestamp, other metrics.
    #[test]
    fn parses_vllm_gauges() {
        let text = "# HELP vllm:num_requests_waiting w\n# TYPE vllm:num_requests_waiting gauge\n\
            vllm:num_requests_waiting 3\nvllm:num_requests_running{model_name=\"a b\"} 2\n\
            vllm:num_requests_running{model_name=\"c\"} 1\nvllm:kv_cache_usage_perc 0.25 1700000000\nother 9\n";
        assert_eq!(
            parse_load(text),
            Some(LoadSample {
                waiting: 3,
                running: 3,
                kv_usage: 0.25,
                weight_version: None,
                tokenizer_digest: None,
                seq_len: None,
                started: None,
            })
        );
        let restarted = format!("{text}process_start_time_seconds 1765000000.25\n");
        assert_eq!(
            parse_load(&restarted).and_then(|s| s.started),
            Some(1765000000.25)
        );
    }

    /// The worker's weights, read from the label of its info gauge.
    #[test]
    fn reads_the_variant_seq_len() {
        let page = |info: &str| format!("vllm:num_requests_waiting 0\n{info}\n");
        let read = |info: &str| parse_load(&page(info)).unwrap().seq_len;
        assert_eq!(
            read("rngd_pd_worker_variant_info{model_name=\"m\",seq_len=\"256\",max_batch=\"4\"} 1"),
            Some(256)
        );
        assert_eq!(
            read("rngd_pd_worker_variant_info{max_batch=\"4\", seq_len=\"8192\"} 1 1700000000"),
            Some(8192)
        );
        for refused in [
            "rngd_pd_worker_variant_info{seq_len=\"256\"} 0",
            "rngd_pd_worker_variant_info{xseq_len=\"256\"} 1",
            "rngd_pd_worker_variant_info{seq_len=\"0\"} 1",
            "rngd_pd_worker_variant_info{seq_len=\"-5\"} 1",
            "rngd_pd_worker_variant_info{seq_len=\"99999999999\"} 1",
            "rngd_pd_worker_variant_info{seq_len=\"2147483649\"} 1",
            "rngd_pd_worker_variant_info{seq_len=\"25x\"} 1",
            "rngd_pd_worker_weight_info{seq_len=\"256\"} 1",
        ] {
            assert_eq!(read(refused), None, "{refused}");
        }
        assert_eq!(read(""), None);
    }

    #[test]
    fn reads_the_tokenizer_digest() {
        let page = |info: &str| format!("vllm:num_requests_waiting 0\n{info}\n");
        let read = |info: &str| parse_load(&page(info)).unwrap().tokenizer_digest;
        assert_eq!(
            read("rngd_pd_worker_tokenizer_info{model_name=\"m\",digest=\"0a1b2c3d4e5f6789\"} 1")
                .as_deref(),
            Some("0a1b2c3d4e5f6789")
        );
        for bad in [
            "rngd_pd_worker_tokenizer_info{digest=\"0a1b\"} 0",
            "rngd_pd_worker_tokenizer_info{xdigest=\"0a1b\"} 1",
            "rngd_pd_worker_tokenizer_info{digest=\"A B\"} 1",
            "rngd_pd_worker_weight_info{digest=\"0a1b\"} 1",
        ] {
            assert_eq!(read(bad), None, "{bad}");
        }
    }

    #[test]
    fn reads_the_weight_version() {
        let page = |info: &str| format!("vllm:num_requests_waiting 0\n{info}\n");
        let read = |info: &str| parse_load(&page(info)).unwrap().weight_version;
        assert_eq!(
            read(
                "rngd_pd_worker_weight_info{model_name=\"m\",weight_version=\"99dda3c02b151cb8\"} 1"
            )
            .as_deref(),
            Some("99dda3c02b151cb8")
        );
        assert_eq!(
            read(
                "rngd_pd_worker_weight_info{weight_version=\"abc\", model_name=\"m\"} 1 1700000000"
            )
            .as_deref(),
            Some("abc")
        );
        for none in [
            "",
            "rngd_pd_worker_weight_info{weight_version=\"abc\"} 0",
            "rngd_pd_worker_weight_info{xweight_version=\"abc\"} 1",
            "rngd_pd_worker_weight_info{weight_version=\"\"} 1",
            "rngd_pd_worker_weight_info{weight_version=\"A\\\"B\"} 1",
            "rngd_pd_worker_weight_info{weight_version=\"has space\"} 1",
            "other_info{weight_version=\"abc\"} 1",
            "# rngd_pd_worker_weight_info{weight_version=\"abc\"} 1",
        ] {
            assert_eq!(read(none), None, "{none}");
        }
        let long = format!(
            "rngd_pd_worker_weight_info{{weight_version=\"{}\"}} 1",
            "a".repeat(65)
        );
        assert_eq!(read(&long), None);
    }

    /// The picker's former parser test: sums and maxima over label sets, and
    /// a page that is not a model server's.
    #[test]
    fn parses_vllm_gauges_with_labels() {
        let text = "# HELP vllm:num_requests_waiting x\n# TYPE vllm:num_requests_waiting gauge\n\
            vllm:num_requests_waiting{model_name=\"a\"} 3\nvllm:num_requests_waiting{model_name=\"b\"} 2\n\
            vllm:num_requests_running 4\nvllm:kv_cache_usage_perc{model_name=\"a\"} 0.25\n\
            vllm:kv_cache_usage_perc{model_name=\"b\"} 0.5\nother_metric 9\n";
        let s = parse_load(text).expect("sample");
        assert_eq!(s.waiting, 5);
        assert_eq!(s.running, 4);
        assert!((s.kv_usage - 0.5).abs() < 1e-12);
        assert_eq!(parse_load("other_metric 1\n"), None);
        assert_eq!(parse_load(""), None);
    }

    /// Where the two former parsers disagreed.
    #[test]
    fn tabs_quoted_braces_rounding_and_bad_values() {
        // Tabs as separators.
        let s =
            parse_load("vllm:num_requests_waiting\t2\nvllm:num_requests_running{a=\"x\"}\t\t1\r\n")
                .expect("tabs");
        assert_eq!((s.waiting, s.running), (2, 1));
        // A `}` inside a quoted label value (and an escaped quote).
        let s = parse_load(
            "vllm:num_requests_waiting{model_name=\"a}b\",x=\"q\\\"}\"} 7\nvllm:num_requests_running 0\n",
        )
        .expect("quoted brace");
        assert_eq!(s.waiting, 7);
        // Summed first, rounded once: 0.6 + 0.6 = 1.2 → 1 (not 0 + 0).
        let s = parse_load(
            "vllm:num_requests_waiting{a=\"1\"} 0.6\nvllm:num_requests_waiting{a=\"2\"} 0.6\n",
        )
        .expect("fractions");
        assert_eq!((s.waiting, s.running), (1, 0));
        // NaN and infinities are skipped, negatives clamp, an open label set is dropped.
        let s = parse_load(
            "vllm:num_requests_waiting NaN\nvllm:num_requests_running -3\n\
             vllm:num_requests_waiting{a=\"x\" 9\nvllm:kv_cache_usage_perc +Inf\n",
        )
        .expect("bad values");
        assert_eq!(s, LoadSample::default());
        // Only the waiting gauge present still counts as a model server.
        assert!(parse_load("vllm:num_requests_waiting 0\n").is_some());
        // A name with no value is not a sample.
        assert_eq!(parse_load("vllm:num_requests_waiting\n"), None);
    }
}
