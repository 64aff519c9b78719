//! The fields of an OpenAI completions or chat body the policy reads
//! (`max_tokens`, `max_completion_tokens`, and the size of the raw `prompt` /
//! `messages` JSON), found in one validating pass over the bytes.
//!
//! A decision needs four top-level fields of a body that is mostly prompt
//! text. A general JSON deserializer walks the text in several passes (find
//! the string end, then check it is UTF-8) through many small functions; in a
//! wasm guest compiled by Cranelift every call and pass costs more than it
//! does natively. This scanner checks the whole body is one JSON object
//! (strings, escapes, UTF-8, numbers, literals, nesting) and skips string
//! content eight bytes at a time.

use crate::{CoreError, push_digit, same};

/// Nesting deeper than this is refused (as `serde_json` does).
const MAX_DEPTH: usize = 128;

/// The top-level fields read, in the order of `seen` in [`scan`].
const FIELDS: [&[u8]; 4] = [
    b"max_tokens",
    b"max_completion_tokens",
    b"prompt",
    b"messages",
];

/// The open containers of [`Scanner::value`], one bit each (1 = array), in
/// two words: a `u128` shift is a library call in a wasm guest.
#[derive(Default)]
struct Open([u64; 2]);

impl Open {
    fn set(&mut self, depth: usize, array: bool) {
        let (w, bit) = (depth / 64 % 2, 1u64 << (depth % 64));
        if array {
            self.0[w] |= bit;
        } else {
            self.0[w] &= !bit;
        }
    }

    fn is_array(&self, depth: usize) -> bool {
        self.0[depth / 64 % 2] >> (depth % 64) & 1 != 0
    }
}

/// What the policy reads from a request body.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct BodyFields {
    /// `max_tokens` (absent or `null` = `None`).
    pub max_tokens: Option<u64>,
    /// `max_completion_tokens` (absent or `null` = `None`).
    pub max_completion_tokens: Option<u64>,
    /// Bytes of the raw `prompt` plus `messages` JSON values.
    pub prompt_bytes: usize,
    /// Whether the body has `messages` (a chat: without `max_tokens` or
    /// `max_completion_tokens` it may fill the context).
    pub chat: bool,
}

/// Scans a request body (see the module docs). Unknown fields are skipped;
/// any JSON error, a top level that is not an object, a repeated field or a
/// token count that is not a non-negative integer is an error.
pub(crate) fn scan(body: &[u8]) -> Result<BodyFields, CoreError> {
    let mut s = Scanner { b: body, i: 0 };
    let mut out = BodyFields::default();
    let mut seen = [false; 4];
    s.ws();
    s.expect(b'{', "expected a JSON object")?;
    s.ws();
    if s.peek() == Some(b'}') {
        s.i += 1;
    } else {
        loop {
            s.ws();
            let key = s.key()?;
            s.ws();
            s.expect(b':', "expected `:`")?;
            s.ws();
            let name: &[u8] = match &key {
                Key::Raw(raw) => raw,
                Key::Escaped(s) => s.as_bytes(),
            };
            let field = FIELDS.iter().position(|f| same(f, name));
            match field {
                Some(f) if seen[f] => return Err(s.error("duplicate field")),
                Some(f) => seen[f] = true,
                None => {}
            }
            match field {
                Some(0) => out.max_tokens = s.count()?,
                Some(1) => out.max_completion_tokens = s.count()?,
                Some(f) => {
                    out.chat |= f == 3;
                    let start = s.i;
                    s.value()?;
                    out.prompt_bytes += s.i - start;
                }
                None => s.value()?,
            }
            s.ws();
            match s.next() {
                Some(b',') => continue,
                Some(b'}') => break,
                _ => return Err(s.error_at(s.i.saturating_sub(1), "expected `,` or `}`")),
            }
        }
    }
    s.ws();
    if s.i != body.len() {
        return Err(s.error("trailing characters"));
    }
    Ok(out)
}

/// An object key: its raw bytes, or `Escaped` when it contains an escape
/// (never one of the fields the policy reads, unless spelled with escapes).
enum Key<'a> {
    Raw(&'a [u8]),
    Escaped(String),
}

struct Scanner<'a> {
    b: &'a [u8],
    i: usize,
}

/// Eight copies of `x`.
const fn splat(x: u8) -> u64 {
    0x0101_0101_0101_0101u64 * x as u64
}

/// High bit set in each byte of `w` that is below `n` (`n` <= 128); exact in
/// the lowest flagged byte (higher ones may be false positives).
const fn below(w: u64, n: u8) -> u64 {
    w.wrapping_sub(splat(n)) & !w & splat(0x80)
}

/// The index of the first byte at or after `i` that is not plain string
/// content (a quote, a backslash, a control character or non-ASCII), or a
/// point near the end from where bytes go one by one. Sixteen bytes a
/// round, the index kept in a local (in a wasm guest a field would be
/// stored to linear memory every round).
fn skip_plain(b: &[u8], mut i: usize) -> usize {
    let special = |w: u64| {
        below(w ^ splat(b'"'), 1) | below(w ^ splat(b'\\'), 1) | below(w, 0x20) | (w & splat(0x80))
    };
    let word = |c: &[u8]| {
        let mut w = [0u8; 8];
        w.copy_from_slice(c);
        u64::from_le_bytes(w)
    };
    while let Some(chunk) = b.get(i..i + 16) {
        let (lo, hi) = (special(word(&chunk[..8])), special(word(&chunk[8..])));
        if lo != 0 {
            return i + (lo.trailing_zeros() / 8) as usize;
        }
        if hi != 0 {
            return i + 8 + (hi.trailing_zeros() / 8) as usize;
        }
        i += 16;
    }
    i
}

impl<'a> Scanner<'a> {
    fn peek(&self) -> Option<u8> {
        self.b.get(self.i).copied()
    }

    fn next(&mut self) -> Option<u8> {
        let c = self.peek()?;
        self.i += 1;
        Some(c)
    }

    fn error(&self, what: &'static str) -> CoreError {
        self.error_at(self.i, what)
    }

    fn error_at(&self, at: usize, what: &'static str) -> CoreError {
        CoreError::Body { what, at }
    }

    fn expect(&mut self, c: u8, what: &'static str) -> Result<(), CoreError> {
        if self.peek() == Some(c) {
            self.i += 1;
            Ok(())
        } else {
            Err(self.error(what))
        }
    }

    fn ws(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.peek() {
            self.i += 1;
        }
    }

    #[inline(always)]
    fn key(&mut self) -> Result<Key<'a>, CoreError> {
        let b: &'a [u8] = self.b;
        if self.peek() != Some(b'"') {
            return Err(self.error("expected a string key"));
        }
        let start = self.i + 1;
        let escaped = self.string()?;
        let raw = &b[start..self.i - 1];
        if !escaped {
            return Ok(Key::Raw(raw));
        }
        // Rare: decode it (the scan above validated it) to compare by value.
        let quoted = &b[start - 1..self.i];
        crate::json::string(quoted)
            .map(Key::Escaped)
            .map_err(|_| self.error("invalid string"))
    }

    /// Skips a string (at its opening quote), checking escapes, control
    /// characters and UTF-8; returns whether it contained an escape.
    ///
    /// Inlined into its callers, as are `key`, `member_key` and `count`: in
    /// a wasm guest every call costs a stack check, an epoch check and
    /// spills around it, and a body has a call per string (measured: ~6%
    /// of a wasm decision, for ~2 KB of module).
    #[inline(always)]
    fn string(&mut self) -> Result<bool, CoreError> {
        self.i += 1;
        let mut escaped = false;
        loop {
            self.i = skip_plain(self.b, self.i);
            let Some(c) = self.next() else {
                return Err(self.error("EOF while parsing a string"));
            };
            match c {
                b'"' => return Ok(escaped),
                b'\\' => {
                    escaped = true;
                    match self.next() {
                        Some(b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't') => {}
                        Some(b'u') => {
                            let hex = self.b.get(self.i..self.i + 4);
                            if !hex.is_some_and(|h| h.iter().all(u8::is_ascii_hexdigit)) {
                                return Err(self.error("invalid \\u escape"));
                            }
                            self.i += 4;
                        }
                        _ => return Err(self.error_at(self.i - 1, "invalid escape")),
                    }
                }
                0..0x20 => return Err(self.error_at(self.i - 1, "control character in string")),
                0x80.. => {
                    // A run of non-ASCII bytes is whole characters if valid.
                    let start = self.i - 1;
                    while self.peek().is_some_and(|c| c >= 0x80) {
                        self.i += 1;
                    }
                    if std::str::from_utf8(&self.b[start..self.i]).is_err() {
                        return Err(self.error_at(start, "invalid UTF-8 in string"));
                    }
                }
                _ => {}
            }
        }
    }

    /// A token count: a non-negative integer or `null`.
    #[inline(always)]
    fn count(&mut self) -> Result<Option<u64>, CoreError> {
        if self.at(b"null") {
            self.i += 4;
            return Ok(None);
        }
        let start = self.i;
        let mut n: u64 = 0;
        while let Some(d @ b'0'..=b'9') = self.peek() {
            n = push_digit(n, d - b'0').ok_or_else(|| self.error("token count out of range"))?;
            self.i += 1;
        }
        let digits = self.i - start;
        if digits == 0
            || (digits > 1 && self.b[start] == b'0')
            || matches!(self.peek(), Some(b'.' | b'e' | b'E'))
        {
            return Err(self.error_at(start, "expected a non-negative integer token count"));
        }
        Ok(Some(n))
    }

    /// Skips one JSON value (a field of the top-level object), nested
    /// containers included. Iterative, with the open containers in a bit set
    /// (1 = array): one call per field instead of one per nested value.
    fn value(&mut self) -> Result<(), CoreError> {
        let mut open = 0usize;
        let mut arrays = Open::default();
        loop {
            // A value starts here, inside `open` containers.
            if open >= MAX_DEPTH {
                return Err(self.error("recursion limit exceeded"));
            }
            let container = match self.peek() {
                Some(b'"') => {
                    self.string()?;
                    None
                }
                Some(b'{') => Some(false),
                Some(b'[') => Some(true),
                Some(b't') => self.literal(b"true").map(|()| None)?,
                Some(b'f') => self.literal(b"false").map(|()| None)?,
                Some(b'n') => self.literal(b"null").map(|()| None)?,
                Some(b'-' | b'0'..=b'9') => self.number().map(|()| None)?,
                Some(_) => return Err(self.error("expected a value")),
                None => return Err(self.error("EOF while parsing a value")),
            };
            if let Some(is_array) = container {
                self.i += 1;
                self.ws();
                let close = if is_array { b']' } else { b'}' };
                if self.peek() == Some(close) {
                    self.i += 1;
                } else {
                    arrays.set(open, is_array);
                    if !is_array {
                        self.member_key()?;
                    }
                    open += 1;
                    continue;
                }
            }
            // After a value: separators and closing brackets.
            loop {
                if open == 0 {
                    return Ok(());
                }
                let is_array = arrays.is_array(open - 1);
                self.ws();
                match self.next() {
                    Some(b',') => {
                        self.ws();
                        if !is_array {
                            self.member_key()?;
                        }
                        break;
                    }
                    Some(b']') if is_array => open -= 1,
                    Some(b'}') if !is_array => open -= 1,
                    _ if is_array => return Err(self.error_at(self.i - 1, "expected `,` or `]`")),
                    _ => return Err(self.error_at(self.i - 1, "expected `,` or `}`")),
                }
            }
        }
    }

    /// An object member's key and colon, up to its value.
    #[inline(always)]
    fn member_key(&mut self) -> Result<(), CoreError> {
        if self.peek() != Some(b'"') {
            return Err(self.error("expected a string key"));
        }
        self.string()?;
        self.ws();
        self.expect(b':', "expected `:`")?;
        self.ws();
        Ok(())
    }

    /// Whether `word` comes next.
    fn at(&self, word: &[u8]) -> bool {
        self.b
            .get(self.i..self.i + word.len())
            .is_some_and(|w| same(w, word))
    }

    fn literal(&mut self, word: &[u8]) -> Result<(), CoreError> {
        if self.at(word) {
            self.i += word.len();
            Ok(())
        } else {
            Err(self.error("invalid literal"))
        }
    }

    /// `-? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)?`
    fn number(&mut self) -> Result<(), CoreError> {
        if self.peek() == Some(b'-') {
            self.i += 1;
        }
        match self.next() {
            Some(b'0') => {}
            Some(b'1'..=b'9') => {
                self.digits();
            }
            _ => return Err(self.error("invalid number")),
        }
        if self.peek() == Some(b'.') {
            self.i += 1;
            if self.digits() == 0 {
                return Err(self.error("invalid number"));
            }
        }
        if let Some(b'e' | b'E') = self.peek() {
            self.i += 1;
            if let Some(b'+' | b'-') = self.peek() {
                self.i += 1;
            }
            if self.digits() == 0 {
                return Err(self.error("invalid number"));
            }
        }
        Ok(())
    }

    fn digits(&mut self) -> usize {
        let start = self.i;
        while self.peek().is_some_and(|c| c.is_ascii_digit()) {
            self.i += 1;
        }
        self.i - start
    }
}

#[cfg(test)]
mod props;

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(body: &str) -> BodyFields {
        scan(body.as_bytes()).unwrap_or_else(|e| panic!("{body}: {e}"))
    }

    #[test]
    fn reads_the_fields_and_sizes_the_prompt() {
        let b = r#"{"model":"m","messages":[{"role":"user","content":"héllo \"x\" \u00e9"}],"max_tokens":128,"stream":true,"temperature":-0.5e-3,"stop":null}"#;
        let f = ok(b);
        assert_eq!(f.max_tokens, Some(128));
        assert_eq!(f.max_completion_tokens, None);
        let raw = r#"[{"role":"user","content":"héllo \"x\" \u00e9"}]"#;
        assert_eq!(f.prompt_bytes, raw.len());
        assert!(f.chat);
        let f = ok(
            " { \"prompt\" : \"abc\" , \"max_completion_tokens\" : 7 , \"max_tokens\": null } \n",
        );
        assert_eq!(
            f,
            BodyFields {
                max_tokens: None,
                max_completion_tokens: Some(7),
                prompt_bytes: 5,
                chat: false,
            }
        );
        assert_eq!(ok("{}"), BodyFields::default());
        // A key spelled with an escape is still that key.
        assert_eq!(ok(r#"{"max\u005ftokens":3}"#).max_tokens, Some(3));
    }

    /// Agrees with `serde_json` on what is valid JSON, over bodies that are
    /// long enough to take the eight-byte path.
    #[test]
    fn accepts_what_serde_json_accepts() {
        let cases = [
            r#"{"prompt":"a long enough plain ASCII prompt to skip in chunks"}"#,
            r#"{"prompt":"tab	inside"}"#,
            r#"{"prompt":"bad \x escape in a long enough string"}"#,
            r#"{"prompt":"unterminated string that is long enough"#,
            r#"{"prompt":"ok"} trailing"#,
            r#"{"prompt":"ok",}"#,
            r#"{"prompt":[1,2,]}"#,
            r#"{"prompt":01}"#,
            r#"{"prompt":1.}"#,
            r#"{"prompt":-}"#,
            r#"{"prompt":1e}"#,
            r#"{"prompt":tru}"#,
            r#"{"prompt":{"a":{"b":[true,false,null,-1.5E+3,"\ud83d\ude00"]}}}"#,
            r#"{"prompt" "x"}"#,
            r#"{"prompt":[{}, [], {"a":[1,{"b":null}]}, "s"],"n":{"x":{}}}"#,
            r#"{"prompt":{"a" 1}}"#,
            r#"{"prompt":{"a":1,}}"#,
            r#"{"prompt":[1 2]}"#,
            r#"{"prompt":{1:2}}"#,
            r#"{"prompt":[1,{"a":2]}]}"#,
            r#"{"prompt":[[[]]}"#,
            r#"{prompt:"x"}"#,
            r#"["prompt"]"#,
            "",
            "{",
        ];
        for c in cases {
            let ours = scan(c.as_bytes()).is_ok();
            let theirs = serde_json::from_str::<serde_json::Value>(c).is_ok_and(|v| v.is_object());
            assert_eq!(ours, theirs, "{c}");
        }
        assert!(scan(&[b'{', b'"', b'p', 0xff, 0xfe, b'"', b':', b'1', b'}']).is_err());
        let deep = format!("{{\"p\":{}{}}}", "[".repeat(200), "]".repeat(200));
        assert!(scan(deep.as_bytes()).is_err());
    }

    #[test]
    fn refuses_bad_token_counts_and_repeats() {
        for b in [
            r#"{"max_tokens":-1}"#,
            r#"{"max_tokens":1.5}"#,
            r#"{"max_tokens":1e3}"#,
            r#"{"max_tokens":"5"}"#,
            r#"{"max_tokens":99999999999999999999}"#,
            r#"{"max_tokens":1,"max_tokens":2}"#,
            r#"{"prompt":"a","prompt":"b"}"#,
        ] {
            assert!(scan(b.as_bytes()).is_err(), "{b}");
        }
    }
}
