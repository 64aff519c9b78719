//! The proxy-wasm ABI's map encoding (a u32 pair count, then each pair's key
//! and value lengths as u32s, then each key and value NUL-terminated, all
//! little-endian): how header maps cross the guest boundary, and how a
//! policy's headers are passed in. A leaf: the hostcalls and the request
//! state both use it.

/// Serializes header pairs in the ABI's map encoding (u32 count, then
/// (key length, value length) u32 pairs, then each key and value
/// NUL-terminated, all little-endian).
pub fn encode_map(pairs: &[(String, String)]) -> Vec<u8> {
    let size = 4 + pairs
        .iter()
        .map(|(k, v)| 8 + k.len() + v.len() + 2)
        .sum::<usize>();
    let mut out = Vec::with_capacity(size);
    out.extend_from_slice(&(pairs.len() as u32).to_le_bytes());
    for (k, v) in pairs {
        out.extend_from_slice(&(k.len() as u32).to_le_bytes());
        out.extend_from_slice(&(v.len() as u32).to_le_bytes());
    }
    for (k, v) in pairs {
        out.extend_from_slice(k.as_bytes());
        out.push(0);
        out.extend_from_slice(v.as_bytes());
        out.push(0);
    }
    out
}

/// Parses the ABI's map encoding; `None` if malformed. What it allocates is
/// bounded by the input: the pair count is checked against `bytes.len()`
/// (at most one pair per 10 bytes) before the list is allocated, and every
/// string is a checked slice of `bytes` (about 6 × `bytes.len()` at most).
pub fn decode_map(bytes: &[u8]) -> Option<Vec<(String, String)>> {
    if bytes.is_empty() {
        return Some(Vec::new());
    }
    let word = |at: usize| -> Option<usize> {
        Some(u32::from_le_bytes(bytes.get(at..at + 4)?.try_into().ok()?) as usize)
    };
    let n = word(0)?;
    let mut p = 4usize.checked_add(n.checked_mul(8)?)?;
    // Every pair also needs its two NULs: a count the input cannot hold is
    // refused before anything is allocated for it.
    if p.checked_add(n.checked_mul(2)?)? > bytes.len() {
        return None;
    }
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let kl = word(4 + i * 8)?;
        let vl = word(8 + i * 8)?;
        // Each string is followed by its terminator, which must be there
        // (its value is not checked, as in Envoy).
        let k = bytes.get(p..p.checked_add(kl)?)?;
        p = p.checked_add(kl)?.checked_add(1)?;
        let v = bytes.get(p..p.checked_add(vl)?)?;
        p = p.checked_add(vl)?.checked_add(1)?;
        if p > bytes.len() {
            return None;
        }
        out.push((
            String::from_utf8(k.to_vec()).ok()?,
            String::from_utf8(v.to_vec()).ok()?,
        ));
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn map_encoding_round_trips() {
        let pairs = vec![
            ("content-type".to_string(), "application/json".to_string()),
            ("x-empty".to_string(), String::new()),
        ];
        assert_eq!(decode_map(&encode_map(&pairs)), Some(pairs));
        assert_eq!(decode_map(&encode_map(&[])), Some(Vec::new()));
        assert_eq!(decode_map(&[]), Some(Vec::new()));
        // A pair count the input cannot hold, and a missing terminator.
        assert_eq!(decode_map(&[1, 0, 0, 0, 9, 0, 0, 0]), None);
        let mut cut = encode_map(&[("k".to_string(), "v".to_string())]);
        cut.pop();
        assert_eq!(decode_map(&cut), None);
    }
}
