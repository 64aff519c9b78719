//! Property tests of the ABI's decoders on arbitrary input: the header-map
//! decoder (what a guest passes to `proxy_set_header_map_pairs` and as the
//! headers of `proxy_send_local_response`) never panics and allocates in
//! proportion to its input only, whatever the counts and lengths say; the
//! local-response path built on it refuses what it cannot use.

use proptest::prelude::*;
use rngd_policy_host::{RequestState, decode_header_map, encode_header_map};

/// The checks every decode must pass: what comes out is bounded by what
/// went in (pairs need at least 10 bytes each, strings are slices of it).
fn check_bounded(bytes: &[u8]) {
    let Some(pairs) = decode_header_map(bytes) else {
        return;
    };
    let len = bytes.len();
    assert!(
        pairs.capacity() * 10 + 4 <= len.max(4),
        "{} pairs allocated for {len} bytes",
        pairs.capacity()
    );
    let strings: usize = pairs.iter().map(|(k, v)| k.capacity() + v.capacity()).sum();
    assert!(strings <= len, "{strings} string bytes from {len} bytes");
}

/// A map encoding with arbitrary header words: a count and (key, value)
/// lengths that may lie, then arbitrary string bytes.
fn lying_map() -> impl Strategy<Value = Vec<u8>> {
    (
        prop_oneof![0u32..8, any::<u32>(), Just(u32::MAX), Just(u32::MAX / 8)],
        prop::collection::vec(prop_oneof![0u32..16, any::<u32>(), Just(u32::MAX)], 0..16),
        prop::collection::vec(any::<u8>(), 0..256),
    )
        .prop_map(|(count, lengths, tail)| {
            let mut out = count.to_le_bytes().to_vec();
            for l in lengths {
                out.extend_from_slice(&l.to_le_bytes());
            }
            out.extend_from_slice(&tail);
            out
        })
}

fn header_text() -> impl Strategy<Value = String> {
    // No NUL: the encoding terminates strings with one.
    "[^\u{0}]{0,24}"
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2048))]

    #[test]
    fn arbitrary_bytes_never_panic_and_stay_bounded(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        check_bounded(&bytes);
    }

    #[test]
    fn lying_counts_and_lengths_are_refused_not_allocated(bytes in lying_map()) {
        check_bounded(&bytes);
        // A count the input cannot hold is refused outright.
        let count = u32::from_le_bytes(bytes[..4].try_into().unwrap()) as usize;
        if count.saturating_mul(10).saturating_add(4) > bytes.len() {
            prop_assert!(decode_header_map(&bytes).is_none());
        }
    }

    #[test]
    fn encoded_maps_round_trip(pairs in prop::collection::vec((header_text(), header_text()), 0..12)) {
        let bytes = encode_header_map(&pairs);
        prop_assert_eq!(decode_header_map(&bytes), Some(pairs));
    }

    #[test]
    fn a_cut_encoding_is_refused(
        pairs in prop::collection::vec((header_text(), header_text()), 1..6),
        cut in any::<prop::sample::Index>(),
    ) {
        let bytes = encode_header_map(&pairs);
        let at = cut.index(bytes.len());
        // Every prefix shorter than the whole encoding lacks a NUL-terminated
        // string or a length word (a zero-length prefix is the empty map).
        if at > 0 {
            prop_assert!(decode_header_map(&bytes[..at]).is_none(), "prefix {}", at);
        }
    }

    #[test]
    fn local_responses_from_arbitrary_input(
        code in any::<u32>(),
        body in prop::collection::vec(any::<u8>(), 0..64),
        headers in prop_oneof![lying_map(), prop::collection::vec(any::<u8>(), 0..64)],
    ) {
        let mut st = RequestState::default();
        let r = st.send_local_response(code, body, &headers);
        let valid = (200..=599).contains(&code) && decode_header_map(&headers).is_some();
        prop_assert_eq!(r.is_ok(), valid);
        prop_assert_eq!(st.has_local_response(), valid);
        if r.is_err() {
            prop_assert_eq!(r, Err(rngd_policy_host::codes::status::BAD_ARGUMENT));
        }
    }
}
