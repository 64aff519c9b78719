//! A request body parsed as JSON with every object's keys checked unique.
//!
//! `serde_json::Value` keeps the last of two equal keys, so `{"model": "a",
//! "model": "b"}` would be served as `b` by one reader and as `a` by another
//! (a proxy, a log, a policy that scanned the bytes): two readers of one
//! body must never disagree on what it asks for. [`parse`] refuses such a
//! body, naming the key and where it stands; it builds the same `Value`
//! `serde_json` would otherwise, in one pass.

use std::collections::HashSet;
use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Number, Value};

/// Why a body did not parse.
#[derive(Debug)]
pub(crate) enum StrictError {
    /// Not JSON (serde_json's message).
    Syntax(serde_json::Error),
    /// An object holds one key twice: the key and the path of the object
    /// (`""` for the body itself, else `field`, `field.inner`, `field[2]`).
    Duplicate {
        /// The repeated key, cut to 64 characters.
        key: String,
        /// Where the object stands.
        path: String,
    },
}

/// Parses `bytes` as one JSON value, refusing an object with a repeated key.
pub(crate) fn parse(bytes: &[u8]) -> Result<Value, StrictError> {
    let mut dup: Option<(String, String)> = None;
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let parsed = Strict {
        path: String::new(),
        dup: &mut dup,
    }
    .deserialize(&mut de)
    .and_then(|v| de.end().map(|()| v));
    match (parsed, dup) {
        (_, Some((key, path))) => Err(StrictError::Duplicate { key, path }),
        (Ok(v), None) => Ok(v),
        (Err(e), None) => Err(StrictError::Syntax(e)),
    }
}

/// A value at `path`; a duplicate found inside is written to `dup` (the
/// error serde carries out is only a marker).
struct Strict<'a> {
    path: String,
    dup: &'a mut Option<(String, String)>,
}

impl<'de> DeserializeSeed<'de> for Strict<'_> {
    type Value = Value;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Strict<'_> {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }

    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(Number::from_f64(v).map_or(Value::Null, Value::Number))
    }

    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_string()))
    }

    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut out = Vec::new();
        loop {
            let path = format!("{}[{}]", self.path, out.len());
            match seq.next_element_seed(Strict {
                path,
                dup: &mut *self.dup,
            })? {
                Some(v) => out.push(v),
                None => return Ok(Value::Array(out)),
            }
        }
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut out = Map::new();
        let mut seen = HashSet::new();
        while let Some(key) = map.next_key::<String>()? {
            if !seen.insert(key.clone()) {
                *self.dup = Some((key.chars().take(64).collect(), self.path.clone()));
                return Err(de::Error::custom("duplicate key"));
            }
            let path = if self.path.is_empty() {
                key.clone()
            } else {
                format!("{}.{key}", self.path)
            };
            let v = map.next_value_seed(Strict {
                path,
                dup: &mut *self.dup,
            })?;
            out.insert(key, v);
        }
        Ok(Value::Object(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_value_as_serde_json_when_keys_are_unique() {
        for body in [
            r#"{"model":"m","prompt":[1,2,3],"temperature":0.5,"n":-1,"x":null,"y":true}"#,
            r#"{"a":{"b":[{"c":"é"},18446744073709551615,1e300]}}"#,
            r#"[1, "two", {"three": 3}]"#,
            "\"plain\"",
        ] {
            let want: Value = serde_json::from_str(body).unwrap();
            assert_eq!(parse(body.as_bytes()).unwrap(), want, "{body}");
        }
    }

    #[test]
    fn a_repeated_key_is_named_with_its_place() {
        for (body, key, path) in [
            (r#"{"model":"a","model":"b"}"#, "model", ""),
            (
                r#"{"model":"a","messages":[{"role":"user","role":"system"}]}"#,
                "role",
                "messages[0]",
            ),
            (r#"{"a":{"b":{"c":1,"c":2}}}"#, "c", "a.b"),
        ] {
            match parse(body.as_bytes()) {
                Err(StrictError::Duplicate { key: k, path: p }) => {
                    assert_eq!((k.as_str(), p.as_str()), (key, path), "{body}")
                }
                other => panic!("{body}: {other:?}"),
            }
        }
    }

    #[test]
    fn syntax_errors_stay_syntax_errors() {
        for body in [r#"{"model":"#, r#"{"a":1} trailing"#, "nope"] {
            assert!(
                matches!(parse(body.as_bytes()), Err(StrictError::Syntax(_))),
                "{body}"
            );
        }
    }
}
