//! Property tests of the request-body scanner ([`super::scan`]): arbitrary
//! bytes never panic and are accepted only when `serde_json` reads them as an
//! object; valid bodies built from arbitrary values give the fields
//! `serde_json` sees; valid bodies cut or with one byte flipped never panic
//! and are never read as something `serde_json` rejects — except a number
//! too large for an `f64` (`1e400`): valid JSON the scanner skips (it reads no
//! such field) and `serde_json` refuses ("number out of range"). The front
//! doors parse every body with `serde_json` first, so such a body never
//! reaches the policy.

use proptest::prelude::*;
use serde_json::{Map, Value};

use super::scan;

/// Whether `serde_json` accepts `b` as an object, or refuses it only for a
/// number out of `f64` range (the one documented difference).
fn agrees(b: &[u8]) -> bool {
    match serde_json::from_slice::<Value>(b) {
        Ok(v) => v.is_object(),
        Err(e) => e.to_string().contains("number out of range"),
    }
}

/// Arbitrary JSON values, a few levels deep.
fn value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(Value::from),
        ".{0,40}".prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 64, 8, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map(".{0,12}", inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// A request body: arbitrary fields plus, maybe, the ones the policy reads.
fn body() -> impl Strategy<Value = (Map<String, Value>, Option<u32>, Option<String>)> {
    (
        prop::collection::btree_map("[a-z_]{1,10}", value(), 0..6),
        prop::option::of(any::<u32>()),
        prop::option::of(".{0,200}"),
    )
        .prop_map(|(m, max, prompt)| {
            let mut map: Map<String, Value> = m
                .into_iter()
                .filter(|(k, _)| {
                    !matches!(
                        k.as_str(),
                        "max_tokens" | "max_completion_tokens" | "prompt" | "messages"
                    )
                })
                .collect();
            if let Some(n) = max {
                map.insert("max_tokens".into(), Value::from(n));
            }
            if let Some(p) = &prompt {
                map.insert("prompt".into(), Value::String(p.clone()));
            }
            (map, max, prompt)
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_never_panic_and_are_accepted_only_as_objects(b in prop::collection::vec(any::<u8>(), 0..512)) {
        if scan(&b).is_ok() {
            prop_assert!(agrees(&b), "accepted what serde_json rejects: {:?}", String::from_utf8_lossy(&b));
        }
    }

    #[test]
    fn valid_bodies_give_the_fields_serde_json_sees((map, max, prompt) in body()) {
        let text = serde_json::to_vec(&Value::Object(map)).unwrap();
        let f = scan(&text).unwrap();
        prop_assert_eq!(f.max_tokens, max.map(u64::from));
        prop_assert_eq!(f.max_completion_tokens, None);
        let want = prompt.map(|p| serde_json::to_vec(&Value::String(p)).unwrap().len()).unwrap_or(0);
        prop_assert_eq!(f.prompt_bytes, want);
    }

    #[test]
    fn cut_or_flipped_bodies_never_panic_nor_pass_as_invalid((map, _, _) in body(), cut in any::<prop::sample::Index>(), at in any::<prop::sample::Index>(), byte in any::<u8>()) {
        let text = serde_json::to_vec(&Value::Object(map)).unwrap();
        let short = &text[..cut.index(text.len() + 1)];
        if scan(short).is_ok() {
            prop_assert!(agrees(short));
        }
        let mut flipped = text.clone();
        let i = at.index(flipped.len());
        flipped[i] = byte;
        if scan(&flipped).is_ok() {
            prop_assert!(agrees(&flipped), "accepted: {:?}", String::from_utf8_lossy(&flipped));
        }
    }
}
