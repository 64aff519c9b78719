//! The reader for the two JSON documents a policy parses besides the body:
//! the endpoint snapshot (`rngd_pd.endpoints`) and the plugin configuration.
//!
//! Both are small and have a fixed shape, so a direct reader fills the
//! structs field by field. Inside the wasm module this replaces a general
//! deserializer (about a quarter of the module's code); it accepts and
//! rejects what `serde_json` does for these types (tests compare the two):
//! defaults for absent fields, unknown fields skipped in an endpoint and
//! refused in the configuration, duplicates refused, integers that must fit
//! their type, the full string grammar (escapes, surrogate pairs, UTF-8).
//! Two deliberate differences: an unknown field's value nested deeper than
//! 128 levels is refused (the reader recurses; `serde_json` skips any depth),
//! and a configuration must be an object (serde also takes a struct written
//! as an array of its fields in order).

use std::fmt;

use crate::{CoreError, Endpoint, PolicyConfig, Role, Vendor, push_digit};

/// Nesting deeper than this is refused (as `serde_json` does).
const MAX_DEPTH: usize = 128;

/// What is wrong with a document, and where.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JsonError {
    /// What is wrong.
    pub what: String,
    /// Byte offset in the document.
    pub at: usize,
}

impl fmt::Display for JsonError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} at byte {}", self.what, self.at)
    }
}

impl std::error::Error for JsonError {}

/// Parses an endpoint snapshot: a JSON array of endpoints.
pub(crate) fn endpoints(doc: &[u8]) -> Result<Vec<Endpoint>, JsonError> {
    let mut r = Reader { b: doc, i: 0 };
    let mut out = Vec::new();
    r.ws();
    r.array(|r| {
        out.push(r.endpoint()?);
        Ok(())
    })?;
    r.end()?;
    Ok(out)
}

impl PolicyConfig {
    /// Parses a plugin configuration; empty or whitespace-only means defaults.
    pub fn from_json(bytes: &[u8]) -> Result<Self, CoreError> {
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Ok(PolicyConfig::default());
        }
        config(bytes).map_err(|source| CoreError::Config { source })
    }
}

/// Parses a plugin configuration object (absent fields take their defaults,
/// unknown fields are refused).
pub(crate) fn config(doc: &[u8]) -> Result<PolicyConfig, JsonError> {
    let mut r = Reader { b: doc, i: 0 };
    let mut c = PolicyConfig::default();
    let mut seen = Seen::default();
    r.ws();
    r.object(|r, key| {
        match key.as_str() {
            "disaggregation_threshold_tokens" => {
                seen.once(r, 0, &key)?;
                c.disaggregation_threshold_tokens = r.u64()?;
            }
            "same_node_transport" => {
                seen.once(r, 1, &key)?;
                c.same_node_transport = r.string()?;
            }
            "cross_node_transport" => {
                seen.once(r, 2, &key)?;
                c.cross_node_transport = r.string()?;
            }
            "max_queue_depth" => {
                seen.once(r, 3, &key)?;
                c.max_queue_depth = if r.null() { None } else { Some(r.u32()?) };
            }
            "default_max_tokens" => {
                seen.once(r, 4, &key)?;
                c.default_max_tokens = r.u64()?;
            }
            "estimate_bytes_per_token" => {
                seen.once(r, 5, &key)?;
                c.estimate_bytes_per_token = r.u64()?;
            }
            "queue_weight" => {
                seen.once(r, 6, &key)?;
                c.queue_weight = r.f64()?;
            }
            "running_weight" => {
                seen.once(r, 7, &key)?;
                c.running_weight = r.f64()?;
            }
            "kv_usage_weight" => {
                seen.once(r, 8, &key)?;
                c.kv_usage_weight = r.f64()?;
            }
            "static_endpoints" => {
                seen.once(r, 9, &key)?;
                let mut eps = Vec::new();
                r.array(|r| {
                    eps.push(r.endpoint()?);
                    Ok(())
                })?;
                c.static_endpoints = eps;
            }
            "prefix_weight" => {
                seen.once(r, 10, &key)?;
                c.prefix_weight = r.f64()?;
            }
            "prefill_ms_per_token" => {
                seen.once(r, 11, &key)?;
                c.prefill_ms_per_token = r.f64()?;
            }
            "queue_ms_per_request" => {
                seen.once(r, 12, &key)?;
                c.queue_ms_per_request = r.f64()?;
            }
            "decode_interference" => {
                seen.once(r, 14, &key)?;
                c.decode_interference = r.f64()?;
            }
            "ttft_goal_ms" => {
                seen.once(r, 13, &key)?;
                c.ttft_goal_ms = if r.null() { None } else { Some(r.f64()?) };
            }
            "routing" => {
                seen.once(r, 15, &key)?;
                let name = r.string().map_err(|e| JsonError {
                    what: format!("field `routing`: {}", e.what),
                    at: e.at,
                })?;
                c.routing = crate::config::Routing::from_name(&name).ok_or_else(|| {
                    r.error(format!(
                        "field `routing`: unknown value {name:?}, expected one of {}",
                        crate::config::Routing::NAMES
                    ))
                })?;
            }
            _ => return Err(r.error(format!("unknown field `{key}`"))),
        }
        Ok(())
    })?;
    r.end()?;
    Ok(c)
}

/// Decodes one JSON string (quotes included in `doc`).
pub(crate) fn string(doc: &[u8]) -> Result<String, JsonError> {
    let mut r = Reader { b: doc, i: 0 };
    let s = r.string()?;
    r.end()?;
    Ok(s)
}

/// Appends `s` as a JSON string, escaped as `serde_json` writes it.
pub(crate) fn write_string(out: &mut Vec<u8>, s: &str) {
    out.push(b'"');
    let mut start = 0;
    for (i, &c) in s.as_bytes().iter().enumerate() {
        let short = match c {
            b'"' => b'"',
            b'\\' => b'\\',
            b'\n' => b'n',
            b'\r' => b'r',
            b'\t' => b't',
            0x08 => b'b',
            0x0c => b'f',
            0x00..=0x1f => b'u',
            _ => continue,
        };
        out.extend_from_slice(&s.as_bytes()[start..i]);
        out.push(b'\\');
        out.push(short);
        if short == b'u' {
            const HEX: &[u8; 16] = b"0123456789abcdef";
            out.extend_from_slice(&[
                b'0',
                b'0',
                HEX[usize::from(c >> 4)],
                HEX[usize::from(c & 15)],
            ]);
        }
        start = i + 1;
    }
    out.extend_from_slice(&s.as_bytes()[start..]);
    out.push(b'"');
}

/// Which fields of an object were read (duplicates are refused).
#[derive(Default)]
struct Seen(u32);

impl Seen {
    fn once(&mut self, r: &Reader<'_>, bit: u32, key: &str) -> Result<(), JsonError> {
        if self.0 & (1 << bit) != 0 {
            return Err(r.error(format!("duplicate field `{key}`")));
        }
        self.0 |= 1 << bit;
        Ok(())
    }

    fn has(&self, bit: u32) -> bool {
        self.0 & (1 << bit) != 0
    }
}

struct Reader<'a> {
    b: &'a [u8],
    i: usize,
}

impl Reader<'_> {
    fn error(&self, what: impl Into<String>) -> JsonError {
        JsonError {
            what: what.into(),
            at: self.i,
        }
    }

    fn peek(&self) -> Option<u8> {
        self.b.get(self.i).copied()
    }

    fn ws(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.peek() {
            self.i += 1;
        }
    }

    fn expect(&mut self, c: u8, what: &str) -> Result<(), JsonError> {
        if self.peek() == Some(c) {
            self.i += 1;
            Ok(())
        } else {
            Err(self.error(format!("expected {what}")))
        }
    }

    /// Only whitespace may follow the document.
    fn end(&mut self) -> Result<(), JsonError> {
        self.ws();
        if self.i == self.b.len() {
            Ok(())
        } else {
            Err(self.error("trailing characters"))
        }
    }

    fn literal(&mut self, word: &[u8]) -> bool {
        if self
            .b
            .get(self.i..self.i + word.len())
            .is_some_and(|w| crate::same(w, word))
        {
            self.i += word.len();
            true
        } else {
            false
        }
    }

    /// Reads `null` if it comes next.
    fn null(&mut self) -> bool {
        self.literal(b"null")
    }

    /// `[ value, ... ]`, calling `each` at every value (whitespace skipped).
    fn array(
        &mut self,
        mut each: impl FnMut(&mut Self) -> Result<(), JsonError>,
    ) -> Result<(), JsonError> {
        self.expect(b'[', "an array")?;
        self.ws();
        if self.peek() == Some(b']') {
            self.i += 1;
            return Ok(());
        }
        loop {
            self.ws();
            each(self)?;
            self.ws();
            match self.peek() {
                Some(b',') => self.i += 1,
                Some(b']') => {
                    self.i += 1;
                    return Ok(());
                }
                _ => return Err(self.error("expected `,` or `]`")),
            }
        }
    }

    /// `{ "key": value, ... }`, calling `each` with every key, positioned at
    /// its value (whitespace skipped); `each` must read the value.
    fn object(
        &mut self,
        mut each: impl FnMut(&mut Self, String) -> Result<(), JsonError>,
    ) -> Result<(), JsonError> {
        self.expect(b'{', "an object")?;
        self.ws();
        if self.peek() == Some(b'}') {
            self.i += 1;
            return Ok(());
        }
        loop {
            self.ws();
            let key = self.string()?;
            self.ws();
            self.expect(b':', "`:`")?;
            self.ws();
            each(self, key)?;
            self.ws();
            match self.peek() {
                Some(b',') => self.i += 1,
                Some(b'}') => {
                    self.i += 1;
                    return Ok(());
                }
                _ => return Err(self.error("expected `,` or `}`")),
            }
        }
    }

    /// A string, decoded.
    fn string(&mut self) -> Result<String, JsonError> {
        self.expect(b'"', "a string")?;
        let mut out = String::new();
        loop {
            let start = self.i;
            while let Some(c) = self.peek() {
                if c == b'"' || c == b'\\' || c < 0x20 {
                    break;
                }
                self.i += 1;
            }
            let run = std::str::from_utf8(&self.b[start..self.i]).map_err(|e| JsonError {
                what: "invalid UTF-8 in a string".into(),
                at: start + e.valid_up_to(),
            })?;
            out.push_str(run);
            match self.peek() {
                Some(b'"') => {
                    self.i += 1;
                    return Ok(out);
                }
                Some(b'\\') => {
                    self.i += 1;
                    self.escape(&mut out)?;
                }
                Some(_) => return Err(self.error("control character in a string")),
                None => return Err(self.error("EOF while parsing a string")),
            }
        }
    }

    /// One escape (after its backslash), appended to `out`.
    fn escape(&mut self, out: &mut String) -> Result<(), JsonError> {
        let c = self.peek().ok_or_else(|| self.error("EOF in an escape"))?;
        self.i += 1;
        let ch = match c {
            b'"' => '"',
            b'\\' => '\\',
            b'/' => '/',
            b'b' => '\u{8}',
            b'f' => '\u{c}',
            b'n' => '\n',
            b'r' => '\r',
            b't' => '\t',
            b'u' => {
                let hi = self.hex4()?;
                let code = if (0xD800..0xDC00).contains(&hi) {
                    // A leading surrogate needs its trailing half.
                    if !self.literal(b"\\u") {
                        return Err(self.error("lone leading surrogate"));
                    }
                    let lo = self.hex4()?;
                    if !(0xDC00..0xE000).contains(&lo) {
                        return Err(self.error("invalid trailing surrogate"));
                    }
                    0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00)
                } else if (0xDC00..0xE000).contains(&hi) {
                    return Err(self.error("lone trailing surrogate"));
                } else {
                    hi
                };
                char::from_u32(code).ok_or_else(|| self.error("invalid unicode escape"))?
            }
            _ => return Err(self.error("invalid escape")),
        };
        out.push(ch);
        Ok(())
    }

    fn hex4(&mut self) -> Result<u32, JsonError> {
        let digits = self
            .b
            .get(self.i..self.i + 4)
            .ok_or_else(|| self.error("EOF in a unicode escape"))?;
        let mut v = 0u32;
        for &d in digits {
            let x = char::from(d)
                .to_digit(16)
                .ok_or_else(|| self.error("invalid unicode escape"))?;
            v = v * 16 + x;
        }
        self.i += 4;
        Ok(v)
    }

    /// The text of a JSON number (grammar checked), and whether it is a
    /// plain non-negative integer.
    fn number(&mut self) -> Result<(&[u8], bool), JsonError> {
        let start = self.i;
        let digits = |r: &mut Self| {
            let s = r.i;
            while let Some(b'0'..=b'9') = r.peek() {
                r.i += 1;
            }
            r.i - s
        };
        let negative = self.peek() == Some(b'-');
        if negative {
            self.i += 1;
        }
        let int_start = self.i;
        let n = digits(self);
        if n == 0 {
            self.i = start;
            return Err(self.error("expected a number"));
        }
        if n > 1 && self.b[int_start] == b'0' {
            return Err(self.error("invalid number (leading zero)"));
        }
        let mut integer = !negative;
        if self.peek() == Some(b'.') {
            self.i += 1;
            integer = false;
            if digits(self) == 0 {
                return Err(self.error("invalid number"));
            }
        }
        if let Some(b'e' | b'E') = self.peek() {
            self.i += 1;
            integer = false;
            if let Some(b'+' | b'-') = self.peek() {
                self.i += 1;
            }
            if digits(self) == 0 {
                return Err(self.error("invalid number"));
            }
        }
        Ok((&self.b[start..self.i], integer))
    }

    fn u64(&mut self) -> Result<u64, JsonError> {
        let at = self.i;
        let (text, integer) = self.number()?;
        if !integer {
            return Err(JsonError {
                what: "expected a non-negative integer".into(),
                at,
            });
        }
        text.iter()
            .try_fold(0u64, |n, &d| push_digit(n, d - b'0'))
            .ok_or(JsonError {
                what: "integer out of range".into(),
                at,
            })
    }

    fn u32(&mut self) -> Result<u32, JsonError> {
        let at = self.i;
        u32::try_from(self.u64()?).map_err(|_| JsonError {
            what: "integer out of range for u32".into(),
            at,
        })
    }

    fn f64(&mut self) -> Result<f64, JsonError> {
        let at = self.i;
        let (text, _) = self.number()?;
        // The grammar above is a subset of what `f64::from_str` accepts.
        let v: f64 = std::str::from_utf8(text)
            .ok()
            .and_then(|t| t.parse().ok())
            .ok_or(JsonError {
                what: "invalid number".into(),
                at,
            })?;
        if v.is_finite() {
            Ok(v)
        } else {
            Err(JsonError {
                what: "number out of range".into(),
                at,
            })
        }
    }

    fn bool(&mut self) -> Result<bool, JsonError> {
        if self.literal(b"true") {
            Ok(true)
        } else if self.literal(b"false") {
            Ok(false)
        } else {
            Err(self.error("expected a boolean"))
        }
    }

    /// Skips any value (an unknown endpoint field).
    fn skip(&mut self, depth: usize) -> Result<(), JsonError> {
        if depth >= MAX_DEPTH {
            return Err(self.error("recursion limit exceeded"));
        }
        match self.peek() {
            Some(b'"') => self.string().map(drop),
            Some(b'[') => self.array(|r| r.skip(depth + 1)),
            Some(b'{') => self.object(|r, _| r.skip(depth + 1)),
            Some(b't' | b'f') => self.bool().map(drop),
            Some(b'n') if self.null() => Ok(()),
            _ => self.number().map(drop),
        }
    }

    fn endpoint(&mut self) -> Result<Endpoint, JsonError> {
        let start = self.i;
        let mut e = Endpoint {
            address: String::new(),
            role: Role::Decode,
            vendor: Vendor::Cpu,
            node: String::new(),
            seq_len: 0,
            queue_depth: 0,
            running: 0,
            kv_usage: 0.0,
            healthy: true,
            transports: Vec::new(),
            weight_version: None,
        };
        let mut seen = Seen::default();
        self.object(|r, key| {
            let bit = match key.as_str() {
                "address" => 0,
                "role" => 1,
                "vendor" => 2,
                "node" => 3,
                "seq_len" => 4,
                "queue_depth" => 5,
                "running" => 6,
                "kv_usage" => 7,
                "healthy" => 8,
                "transports" => 9,
                "weight_version" => 10,
                _ => return r.skip(0),
            };
            seen.once(r, bit, &key)?;
            match bit {
                0 => e.address = r.string()?,
                1 => {
                    let at = r.i;
                    e.role = match r.string()?.as_str() {
                        "prefill" => Role::Prefill,
                        "decode" => Role::Decode,
                        "solo" => Role::Solo,
                        other => {
                            return Err(JsonError {
                                what: format!("unknown variant `{other}` of role"),
                                at,
                            });
                        }
                    }
                }
                2 => {
                    let at = r.i;
                    e.vendor = match r.string()?.as_str() {
                        "rngd" => Vendor::Rngd,
                        "atom" => Vendor::Atom,
                        "cpu" => Vendor::Cpu,
                        other => {
                            return Err(JsonError {
                                what: format!("unknown variant `{other}` of vendor"),
                                at,
                            });
                        }
                    }
                }
                3 => e.node = r.string()?,
                4 => e.seq_len = r.u32()?,
                5 => e.queue_depth = r.u32()?,
                6 => e.running = r.u32()?,
                7 => e.kv_usage = r.f64()?,
                8 => e.healthy = r.bool()?,
                10 => {
                    e.weight_version = if r.null() { None } else { Some(r.string()?) };
                }
                _ => {
                    let mut ts = Vec::new();
                    r.array(|r| {
                        ts.push(r.string()?);
                        Ok(())
                    })?;
                    e.transports = ts;
                }
            }
            Ok(())
        })?;
        for (bit, name) in [(0, "address"), (1, "role"), (2, "vendor"), (4, "seq_len")] {
            if !seen.has(bit) {
                return Err(JsonError {
                    what: format!("missing field `{name}`"),
                    at: start,
                });
            }
        }
        Ok(e)
    }
}

#[cfg(test)]
mod tests;
