//! Python's formatting, as HF chat templates see it: `json.dumps` (the
//! `tojson` filter) and `datetime.strftime` (the `strftime_now` function).

use minijinja::value::{Value, ValueKind};
use minijinja::{Error, ErrorKind};

/// The `json.dumps` arguments `tojson` takes.
#[derive(Debug, Clone, Default)]
pub(crate) struct JsonOptions {
    /// `indent`: the text of one level (`None` = all on one line).
    pub(crate) indent: Option<String>,
    /// `separators`: (item, key) separators; default `(", ", ": ")`, or
    /// `(",", ": ")` with an indent.
    pub(crate) separators: Option<(String, String)>,
    /// `sort_keys`.
    pub(crate) sort_keys: bool,
    /// `ensure_ascii`: non-ASCII characters as `\uXXXX`.
    pub(crate) ensure_ascii: bool,
}

fn err(msg: impl Into<String>) -> Error {
    Error::new(ErrorKind::InvalidOperation, msg.into())
}

/// `json.dumps(value, …)` as Python writes it.
pub(crate) fn dumps(value: &Value, opts: &JsonOptions) -> Result<String, Error> {
    let (item_sep, key_sep) = match (&opts.separators, &opts.indent) {
        (Some((a, b)), _) => (a.clone(), b.clone()),
        (None, Some(_)) => (",".to_string(), ": ".to_string()),
        (None, None) => (", ".to_string(), ": ".to_string()),
    };
    let mut out = String::new();
    let w = Writer {
        opts,
        item_sep: &item_sep,
        key_sep: &key_sep,
    };
    w.value(value, 0, &mut out)?;
    Ok(out)
}

struct Writer<'a> {
    opts: &'a JsonOptions,
    item_sep: &'a str,
    key_sep: &'a str,
}

impl Writer<'_> {
    fn newline(&self, level: usize, out: &mut String) {
        if let Some(ind) = &self.opts.indent {
            out.push('\n');
            for _ in 0..level {
                out.push_str(ind);
            }
        }
    }

    fn value(&self, v: &Value, level: usize, out: &mut String) -> Result<(), Error> {
        match v.kind() {
            ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
            ValueKind::Number => out.push_str(&number(v)?),
            ValueKind::String => {
                string(v.as_str().unwrap_or_default(), self.opts.ensure_ascii, out)
            }
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = v.try_iter()?.collect();
                self.seq(&items, level, out)?;
            }
            ValueKind::Map => {
                let mut pairs = Vec::new();
                for key in v.try_iter()? {
                    let item = v.get_item(&key)?;
                    pairs.push((key_text(&key)?, item));
                }
                if self.opts.sort_keys {
                    pairs.sort_by(|a, b| a.0.cmp(&b.0));
                }
                if pairs.is_empty() {
                    out.push_str("{}");
                    return Ok(());
                }
                out.push('{');
                for (i, (k, item)) in pairs.iter().enumerate() {
                    if i > 0 {
                        out.push_str(self.item_sep);
                    }
                    self.newline(level + 1, out);
                    string(k, self.opts.ensure_ascii, out);
                    out.push_str(self.key_sep);
                    self.value(item, level + 1, out)?;
                }
                self.newline(level, out);
                out.push('}');
            }
            ValueKind::Undefined => return Err(err("tojson: the value is undefined")),
            other => return Err(err(format!("tojson: a {other} is not JSON serializable"))),
        }
        Ok(())
    }

    fn seq(&self, items: &[Value], level: usize, out: &mut String) -> Result<(), Error> {
        if items.is_empty() {
            out.push_str("[]");
            return Ok(());
        }
        out.push('[');
        for (i, item) in items.iter().enumerate() {
            if i > 0 {
                out.push_str(self.item_sep);
            }
            self.newline(level + 1, out);
            self.value(item, level + 1, out)?;
        }
        self.newline(level, out);
        out.push(']');
        Ok(())
    }
}

/// A dict key as Python's `json.dumps` turns it into a string.
fn key_text(key: &Value) -> Result<String, Error> {
    Ok(match key.kind() {
        ValueKind::String => key.as_str().unwrap_or_default().to_string(),
        ValueKind::None => "null".into(),
        ValueKind::Bool => (if key.is_true() { "true" } else { "false" }).into(),
        ValueKind::Number => number(key)?,
        other => return Err(err(format!("tojson: keys must be strings, not a {other}"))),
    })
}

/// An int as Python prints it; a float as `repr(float)`.
fn number(v: &Value) -> Result<String, Error> {
    if v.is_integer() {
        return Ok(v.to_string());
    }
    let f = f64::try_from(v.clone())?;
    Ok(float_repr(f))
}

/// Python's `repr` of a float: the shortest digits that round-trip,
/// positional for exponents -4..16, else `d.ddde+XX`.
pub(crate) fn float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    if (-4..16).contains(&exp) {
        let s = format!("{f}");
        if s.contains('.') { s } else { format!("{s}.0") }
    } else {
        let sign = if exp < 0 { '-' } else { '+' };
        format!("{mantissa}e{sign}{:02}", exp.abs())
    }
}

/// A JSON string literal as Python's `json.dumps` writes it.
fn string(s: &str, ensure_ascii: bool, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ensure_ascii && !c.is_ascii()) => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const DAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// `(year, month 1..=12, day 1..=31)` of a day count since 1970-01-01.
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

fn is_leap(y: i64) -> bool {
    (y % 4 == 0 && y % 100 != 0) || y % 400 == 0
}

/// `datetime.fromtimestamp(unix_secs, UTC).strftime(fmt)` for the common
/// directives (`%Y %y %m %d %e %j %B %b %h %A %a %H %I %M %S %p %%`); any
/// other directive is an error naming it.
pub(crate) fn strftime(fmt: &str, unix_secs: i64) -> Result<String, String> {
    let days = unix_secs.div_euclid(86_400);
    let secs = unix_secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let (hour, minute, second) = (secs / 3600, secs / 60 % 60, secs % 60);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday.
    let cumulative = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = cumulative[month as usize - 1] + day + u32::from(month > 2 && is_leap(year));
    let month_name = MONTHS[month as usize - 1];
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('e') => out.push_str(&format!("{day:>2}")),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('B') => out.push_str(month_name),
            Some('b') | Some('h') => out.push_str(&month_name[..3]),
            Some('A') => out.push_str(DAYS[weekday]),
            Some('a') => out.push_str(&DAYS[weekday][..3]),
            Some('H') => out.push_str(&format!("{hour:02}")),
            Some('I') => out.push_str(&format!("{:02}", (hour + 11) % 12 + 1)),
            Some('M') => out.push_str(&format!("{minute:02}")),
            Some('S') => out.push_str(&format!("{second:02}")),
            Some('p') => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            Some('%') => out.push('%'),
            Some(d) => return Err(format!("strftime_now: the directive %{d} is not supported")),
            None => return Err("strftime_now: the format ends with a lone %".into()),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strftime_of_known_instants() {
        // 2024-07-26 13:25:09 UTC, a Friday, day 208 of a leap year.
        let t = 1_722_000_309;
        assert_eq!(
            strftime("%d %b %Y|%A %a %B|%H:%M:%S %I%p|%j %y %e%%", t).unwrap(),
            "26 Jul 2024|Friday Fri July|13:25:09 01PM|208 24 26%"
        );
        assert_eq!(strftime("%Y-%m-%d", 0).unwrap(), "1970-01-01");
        assert!(strftime("%Q", 0).unwrap_err().contains("%Q"));
    }

    #[test]
    fn floats_print_as_python_repr() {
        for (f, s) in [
            (1.0, "1.0"),
            (0.5, "0.5"),
            (1e16, "1e+16"),
            (1.5e-5, "1.5e-05"),
            (0.0001, "0.0001"),
            (123456.789, "123456.789"),
            (-2.0, "-2.0"),
        ] {
            assert_eq!(float_repr(f), s, "{f}");
        }
    }

    #[test]
    fn dumps_matches_python() {
        let v = Value::from_iter([
            (
                "b",
                Value::from(vec![Value::from(1), Value::from("x\"é\n")]),
            ),
            ("a", Value::from(())),
        ]);
        let plain = JsonOptions::default();
        assert_eq!(
            dumps(&v, &plain).unwrap(),
            r#"{"b": [1, "x\"é\n"], "a": null}"#
        );
        let indented = JsonOptions {
            indent: Some("  ".into()),
            sort_keys: true,
            ensure_ascii: true,
            ..JsonOptions::default()
        };
        assert_eq!(
            dumps(&v, &indented).unwrap(),
            "{\n  \"a\": null,\n  \"b\": [\n    1,\n    \"x\\\"\\u00e9\\n\"\n  ]\n}"
        );
    }
}
