//! Header maps: the request-header hostcalls (get, set, add, replace, remove, whole-map
//! get and set), in the map encoding of [`crate::map`]. Only the request headers exist; the other maps are empty
//! (reads) or refused (writes). Edits overlay the passed headers (see
//! [`RequestState`](crate::RequestState)). What a guest sets in one
//! decision is capped in count and bytes
//! ([`SandboxLimits::max_set_headers`](crate::SandboxLimits::max_set_headers),
//! [`SandboxLimits::max_set_header_bytes`](crate::SandboxLimits::max_set_header_bytes)):
//! past them a set is `BadArgument` and nothing changes.

use super::memory::{give, give_from, range, read, with_guest};
use super::{Cx, ENV, HostCaps, Hostcall, R};
use crate::codes::{MAP_REQUEST_HEADERS, status};
use crate::map::{decode_map, encode_map};
use crate::request::RequestState;

/// The header-map hostcalls.
pub(super) const HOSTCALLS: &[Hostcall] = hostcalls![ENV =>
    proxy_get_header_map_pairs,
    proxy_set_header_map_pairs,
    proxy_get_header_map_value,
    proxy_remove_header_map_value,
    proxy_replace_header_map_value,
    proxy_add_header_map_value,
];

/// Whether setting `key` to a value of `value_len` bytes keeps the headers
/// the guest set within the caps.
fn set_fits(req: &RequestState, caps: &HostCaps, key: &str, value_len: usize) -> bool {
    // The others: the one set under `key` (if any) is replaced.
    let (mut count, mut bytes) = (0, 0);
    for (k, v) in req.set.iter().filter(|(k, _)| !k.eq_ignore_ascii_case(key)) {
        count += 1;
        bytes += k.len() + v.len();
    }
    count < caps.set_headers && bytes + key.len() + value_len <= caps.set_header_bytes
}

/// Sets (`add`: appends to) a request header, reading name and value in
/// place from guest memory.
fn header_replace(cx: &mut Cx<'_>, map: u32, kp: u32, kl: u32, vp: u32, vl: u32, add: bool) -> R {
    if map != MAP_REQUEST_HEADERS {
        return Ok(status::BAD_ARGUMENT);
    }
    let max = cx.data().max_header_bytes;
    if kl as usize + vl as usize > max {
        tracing::warn!(
            bytes = kl as u64 + vl as u64,
            max,
            "policy guest set an oversized header; refused"
        );
        return Ok(status::BAD_ARGUMENT);
    }
    let Some(mem) = cx.data().memory else {
        return Ok(status::INTERNAL_FAILURE);
    };
    let (data, st) = mem.data_and_store_mut(&mut *cx);
    let (Some(kr), Some(vr)) = (range(data.len(), kp, kl), range(data.len(), vp, vl)) else {
        return Ok(status::INVALID_MEMORY_ACCESS);
    };
    let (Ok(k), Ok(v)) = (
        std::str::from_utf8(&data[kr]),
        std::str::from_utf8(&data[vr]),
    ) else {
        return Ok(status::BAD_ARGUMENT);
    };
    // `add` appends to what the guest sees (`old,value`); only it looks the
    // old value up (a replace, the routing path, does not).
    let value_len = match add.then(|| st.req.header(k)).flatten() {
        Some(old) if !old.is_empty() => old.len() + 1 + v.len(),
        _ => v.len(),
    };
    if !set_fits(&st.req, &st.caps, k, value_len) {
        st.env.caps.headers.inc();
        tracing::debug!(
            headers = st.req.set.len(),
            "policy guest set headers over their cap; refused"
        );
        return Ok(status::BAD_ARGUMENT);
    }
    st.req.set_header(k, v, add);
    Ok(status::OK)
}

fn proxy_get_header_map_pairs(mut cx: Cx<'_>, map: u32, rp: u32, rl: u32) -> R {
    if map != MAP_REQUEST_HEADERS {
        return give(&mut cx, Vec::new(), rp, rl);
    }
    let bytes = encode_map(&cx.data().req.view());
    give(&mut cx, bytes, rp, rl)
}

fn proxy_set_header_map_pairs(mut cx: Cx<'_>, map: u32, p: u32, l: u32) -> R {
    if map != MAP_REQUEST_HEADERS {
        return Ok(status::BAD_ARGUMENT);
    }
    if l as usize > cx.data().max_header_bytes {
        return Ok(status::BAD_ARGUMENT);
    }
    let bytes = match read(&cx, p, l) {
        Ok(b) => b,
        Err(s) => return Ok(s),
    };
    let Some(pairs) = decode_map(&bytes) else {
        return Ok(status::BAD_ARGUMENT);
    };
    let caps = cx.data().caps;
    let set_bytes: usize = pairs.iter().map(|(k, v)| k.len() + v.len()).sum();
    if pairs.len() > caps.set_headers || set_bytes > caps.set_header_bytes {
        cx.data().env.caps.headers.inc();
        return Ok(status::BAD_ARGUMENT);
    }
    // The whole map is replaced: passed headers missing from it are
    // removed, and every pair counts as set.
    let req = &mut cx.data_mut().req;
    req.set.clear();
    req.removed.clear();
    for i in 0..req.headers.len() {
        let k = &req.headers[i].0;
        if !pairs.iter().any(|(n, _)| n.eq_ignore_ascii_case(k)) && !req.is_removed(k) {
            let k = k.to_ascii_lowercase();
            req.removed.push(k);
        }
    }
    for (k, v) in &pairs {
        req.set_header(k, v, false);
    }
    Ok(status::OK)
}

fn proxy_get_header_map_value(mut cx: Cx<'_>, map: u32, kp: u32, kl: u32, rp: u32, rl: u32) -> R {
    if map != MAP_REQUEST_HEADERS {
        return Ok(match with_guest(&cx, kp, kl, |_, _| ()) {
            Err(s) => s,
            Ok(()) if map <= 7 => status::NOT_FOUND,
            Ok(()) => status::BAD_ARGUMENT,
        });
    }
    // The key is copied out (headers names are short) so the value can
    // be selected again after the guest's allocator ran.
    let key = match with_guest(&cx, kp, kl, |key, st| {
        let key = std::str::from_utf8(key).map_err(|_| status::BAD_ARGUMENT)?;
        Ok::<_, u32>(st.req.header(key).map(|_| key.to_string()))
    }) {
        Ok(Ok(Some(key))) => key,
        Ok(Ok(None)) => return Ok(status::NOT_FOUND),
        Ok(Err(s)) | Err(s) => return Ok(s),
    };
    give_from(&mut cx, rp, rl, |st| st.req.header(&key).map(str::as_bytes))
}

fn proxy_remove_header_map_value(mut cx: Cx<'_>, map: u32, kp: u32, kl: u32) -> R {
    if map != MAP_REQUEST_HEADERS {
        return Ok(status::BAD_ARGUMENT);
    }
    let Some(mem) = cx.data().memory else {
        return Ok(status::INTERNAL_FAILURE);
    };
    let (data, st) = mem.data_and_store_mut(&mut cx);
    let Some(kr) = range(data.len(), kp, kl) else {
        return Ok(status::INVALID_MEMORY_ACCESS);
    };
    let Ok(key) = std::str::from_utf8(&data[kr]) else {
        return Ok(status::BAD_ARGUMENT);
    };
    st.req.remove_header(key);
    Ok(status::OK)
}

fn proxy_replace_header_map_value(
    mut cx: Cx<'_>,
    map: u32,
    kp: u32,
    kl: u32,
    vp: u32,
    vl: u32,
) -> R {
    header_replace(&mut cx, map, kp, kl, vp, vl, false)
}

fn proxy_add_header_map_value(mut cx: Cx<'_>, map: u32, kp: u32, kl: u32, vp: u32, vl: u32) -> R {
    header_replace(&mut cx, map, kp, kl, vp, vl, true)
}

#[cfg(test)]
mod tests {
    use crate::request::RequestState;

    fn state() -> RequestState {
        RequestState {
            headers: vec![
                (":path".into(), "/v1/completions".into()),
                ("Accept".into(), "text/plain".into()),
                ("x-prefiller-host-port".into(), "10.0.0.9:80".into()),
            ],
            ..RequestState::default()
        }
    }

    #[test]
    fn edits_overlay_the_passed_headers() {
        let mut st = state();
        assert_eq!(st.header("accept"), Some("text/plain"));
        st.set_header("ACCEPT", "application/json", false);
        assert_eq!(st.header("accept"), Some("application/json"));
        st.set_header("accept", "text/html", true);
        assert_eq!(st.header("Accept"), Some("application/json,text/html"));
        st.remove_header("x-prefiller-host-port");
        assert_eq!(st.header("x-prefiller-host-port"), None);
        st.set_header("x-prefiller-host-port", "10.0.0.1:80", false);
        assert_eq!(st.header("x-prefiller-host-port"), Some("10.0.0.1:80"));
        st.remove_header("accept");
        assert_eq!(st.header("accept"), None);
        // The passed headers are never edited; the view merges the edits.
        assert_eq!(st.headers, state().headers);
        assert_eq!(
            st.view(),
            vec![
                (":path".to_string(), "/v1/completions".to_string()),
                (
                    "x-prefiller-host-port".to_string(),
                    "10.0.0.1:80".to_string()
                ),
            ]
        );
        assert_eq!(
            st.set,
            vec![(
                "x-prefiller-host-port".to_string(),
                "10.0.0.1:80".to_string()
            )]
        );
        assert_eq!(st.removed, vec!["accept".to_string()]);
    }
}
