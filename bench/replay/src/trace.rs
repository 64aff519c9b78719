//! The trace: parsing the Azure LLM inference trace CSV
//! (`TIMESTAMP,ContextTokens,GeneratedTokens`), turning its timestamps into
//! arrival offsets, scaling its lengths to the compiled context, and the
//! prompt text of a given length.

use std::time::Duration;

use crate::Error;

/// One row of the trace.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Row {
    /// Seconds since the Unix epoch (the trace's timestamps, read as UTC).
    pub timestamp_s: f64,
    /// Prompt tokens of the original request.
    pub context_tokens: u32,
    /// Generated tokens of the original request.
    pub generated_tokens: u32,
}

/// One request to send: when, and how long.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Arrival {
    /// Index of the row in the trace (0 = the first data row).
    pub row: usize,
    /// When to send it, from the start of the run (already divided by the speedup).
    pub offset: Duration,
    /// Prompt length to send, tokens (scaled).
    pub prompt_tokens: u32,
    /// `max_tokens` to send (scaled, at least 1).
    pub max_tokens: u32,
}

/// Parses the CSV text: a header line naming `TIMESTAMP`, `ContextTokens`
/// and `GeneratedTokens` (in any order), then one row per line. Blank lines
/// are skipped; anything else malformed is an error naming the line.
pub fn parse(text: &str) -> Result<Vec<Row>, Error> {
    let mut lines = text.lines().enumerate();
    let (_, header) = lines
        .by_ref()
        .find(|(_, l)| !l.trim().is_empty())
        .ok_or_else(|| Error::Trace("empty trace".into()))?;
    let cols: Vec<&str> = header.split(',').map(str::trim).collect();
    let col = |name: &str| {
        cols.iter()
            .position(|c| c.trim_start_matches('\u{feff}') == name)
            .ok_or_else(|| Error::Trace(format!("header has no {name} column: {header}")))
    };
    let (ts, ctx, gen_) = (
        col("TIMESTAMP")?,
        col("ContextTokens")?,
        col("GeneratedTokens")?,
    );
    let mut rows = Vec::new();
    for (i, line) in lines {
        if line.trim().is_empty() {
            continue;
        }
        let f: Vec<&str> = line.split(',').map(str::trim).collect();
        let bad = |what: &str| Error::Trace(format!("line {}: {what}: {line}", i + 1));
        let get = |k: usize| f.get(k).copied().ok_or_else(|| bad("too few columns"));
        rows.push(Row {
            timestamp_s: parse_timestamp(get(ts)?).ok_or_else(|| bad("bad TIMESTAMP"))?,
            context_tokens: get(ctx)?.parse().map_err(|_| bad("bad ContextTokens"))?,
            generated_tokens: get(gen_)?.parse().map_err(|_| bad("bad GeneratedTokens"))?,
        });
    }
    Ok(rows)
}

/// `YYYY-MM-DD HH:MM:SS[.fraction]` (or with a `T`) as seconds since the
/// Unix epoch, read as UTC; `None` if it is not that shape.
pub fn parse_timestamp(s: &str) -> Option<f64> {
    let (date, time) = s.split_once([' ', 'T'])?;
    let mut d = date.splitn(3, '-');
    let (y, m, day): (i64, u32, u32) = (
        d.next()?.parse().ok()?,
        d.next()?.parse().ok()?,
        d.next()?.parse().ok()?,
    );
    if !(1..=12).contains(&m) || !(1..=31).contains(&day) {
        return None;
    }
    let mut t = time.trim_end_matches('Z').splitn(3, ':');
    let (hh, mm): (u32, u32) = (t.next()?.parse().ok()?, t.next()?.parse().ok()?);
    let ss: f64 = t.next()?.parse().ok()?;
    if hh > 23 || mm > 59 || !(0.0..61.0).contains(&ss) {
        return None;
    }
    let days = days_from_civil(y, m, day);
    Some(days as f64 * 86_400.0 + f64::from(hh * 3600 + mm * 60) + ss)
}

/// Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's algorithm).
fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = i64::from((m + 9) % 12);
    let doy = (153 * mp + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Scales a request's lengths to fit `budget` tokens (prompt + `max_tokens`):
/// unchanged when they fit, else both multiplied by the same factor (rounded
/// down, each at least 1, the prompt trimmed if the two 1s overshoot).
/// Returns `(prompt_tokens, max_tokens)`.
pub fn scale(context_tokens: u32, generated_tokens: u32, budget: u32) -> (u32, u32) {
    let budget = budget.max(2);
    let (c, g) = (context_tokens.max(1), generated_tokens.max(1));
    let total = u64::from(c) + u64::from(g);
    if total <= u64::from(budget) {
        return (c, g);
    }
    let f = f64::from(budget) / total as f64;
    let mut p = ((f64::from(c) * f).floor() as u32).max(1);
    let m = ((f64::from(g) * f).floor() as u32).clamp(1, budget - 1);
    if p + m > budget {
        p = budget - m;
    }
    (p, m)
}

/// The requests of a run: rows from `skip` on, at most `max_requests`, with
/// offsets from row `skip`'s timestamp divided by `speedup`, and only those
/// whose offset is within `duration` (when given). Lengths are scaled to
/// `budget` with [`scale`].
pub fn schedule(
    rows: &[Row],
    skip: usize,
    max_requests: Option<usize>,
    duration: Option<Duration>,
    speedup: f64,
    budget: u32,
) -> Vec<Arrival> {
    // A trace out of order is replayed in file order: a row earlier than
    // the first one fires at once.
    let mut out = Vec::new();
    for (row, r, offset) in window(rows, skip, max_requests, duration, speedup, |r, first| {
        r.timestamp_s - first.timestamp_s
    }) {
        let (prompt_tokens, max_tokens) = scale(r.context_tokens, r.generated_tokens, budget);
        out.push(Arrival {
            row,
            offset,
            prompt_tokens,
            max_tokens,
        });
    }
    out
}

/// The rows a run sends, with their send offsets: from row `skip` on, at
/// most `max_requests`, each at `elapsed(row, first)` seconds after row
/// `skip` divided by `speedup` (a non-positive speedup counts as 1; a row
/// before the first fires at once), stopping at the first past `duration`.
/// Both trace formats schedule with it.
pub fn window<R>(
    rows: &[R],
    skip: usize,
    max_requests: Option<usize>,
    duration: Option<Duration>,
    speedup: f64,
    elapsed: impl Fn(&R, &R) -> f64,
) -> Vec<(usize, &R, Duration)> {
    let Some(first) = rows.get(skip) else {
        return Vec::new();
    };
    let speedup = if speedup > 0.0 { speedup } else { 1.0 };
    let mut out = Vec::new();
    for (i, r) in rows.iter().enumerate().skip(skip) {
        if max_requests.is_some_and(|n| out.len() >= n) {
            break;
        }
        let offset = Duration::from_secs_f64((elapsed(r, first) / speedup).max(0.0));
        if duration.is_some_and(|d| offset > d) {
            break;
        }
        out.push((i, r, offset));
    }
    out
}

/// Common English words; each is one token (with its leading space) in the
/// usual BPE vocabularies, so `n` of them make a prompt of roughly `n` tokens.
const WORDS: &[&str] = &[
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "with", "on", "was", "be",
    "at", "by", "this", "from", "or", "have",
];

/// A prompt of roughly `tokens` tokens: that many common words, starting at
/// a word chosen by `seed` (so neighbouring requests do not share a prefix).
pub fn prompt_text(tokens: u32, seed: usize) -> String {
    let mut s = String::with_capacity(tokens as usize * 5);
    for i in 0..tokens as usize {
        if i > 0 {
            s.push(' ');
        }
        s.push_str(WORDS[(seed + i) % WORDS.len()]);
    }
    s
}
