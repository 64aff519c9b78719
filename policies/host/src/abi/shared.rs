//! Shared data: a per-instance key/value store with compare-and-swap
//! versions (`proxy_get_shared_data`, `proxy_set_shared_data`), capped in
//! entries and bytes ([`SandboxLimits::max_shared_entries`],
//! [`SandboxLimits::max_shared_bytes`]: past them a set is `BadArgument`
//! and nothing is stored). Shared queues are not offered (their hostcalls
//! answer `BadArgument` or `NotFound`).
//!
//! [`SandboxLimits::max_shared_entries`]: crate::SandboxLimits::max_shared_entries
//! [`SandboxLimits::max_shared_bytes`]: crate::SandboxLimits::max_shared_bytes

use super::memory::{give, read, read_str, with_guest, write};
use super::{Cx, ENV, Hostcall, R};
use crate::codes::status;

/// The shared-data and shared-queue hostcalls.
pub(super) const HOSTCALLS: &[Hostcall] = hostcalls![ENV =>
    proxy_get_shared_data,
    proxy_set_shared_data,
    proxy_register_shared_queue,
    proxy_resolve_shared_queue,
    proxy_dequeue_shared_queue,
    proxy_enqueue_shared_queue,
];

fn proxy_get_shared_data(mut cx: Cx<'_>, kp: u32, kl: u32, rp: u32, rl: u32, rc: u32) -> R {
    // The key is looked up in place (no copy of a guest-sized key).
    let found = with_guest(&cx, kp, kl, |key, st| {
        let key = std::str::from_utf8(key).map_err(|_| status::BAD_ARGUMENT)?;
        Ok::<_, u32>(st.shared.get(key).cloned())
    });
    let (v, cas) = match found {
        Ok(Ok(Some(entry))) => entry,
        Ok(Ok(None)) => return Ok(status::NOT_FOUND),
        Ok(Err(s)) | Err(s) => return Ok(s),
    };
    if let Err(s) = write(&mut cx, rc, &cas.to_le_bytes()) {
        return Ok(s);
    }
    give(&mut cx, v, rp, rl)
}

fn proxy_set_shared_data(mut cx: Cx<'_>, kp: u32, kl: u32, vp: u32, vl: u32, cas: u32) -> R {
    let caps = cx.data().caps;
    let entry_bytes = kl as usize + vl as usize;
    if vl as usize > cx.data().max_header_bytes || entry_bytes > caps.shared_bytes {
        cx.data().env.caps.shared_data.inc();
        return Ok(status::BAD_ARGUMENT);
    }
    let (k, v) = match read_str(&cx, kp, kl).and_then(|k| read(&cx, vp, vl).map(|v| (k, v))) {
        Ok(kv) => kv,
        Err(s) => return Ok(s),
    };
    let st = cx.data_mut();
    let (current, old_bytes) = st
        .shared
        .get(&k)
        .map_or((None, 0), |(v, c)| (Some(*c), k.len() + v.len()));
    if cas != 0 && cas != current.unwrap_or(0) {
        return Ok(status::CAS_MISMATCH);
    }
    let bytes = st.shared_bytes - old_bytes + entry_bytes;
    if (current.is_none() && st.shared.len() >= caps.shared_entries) || bytes > caps.shared_bytes {
        st.env.caps.shared_data.inc();
        tracing::debug!(
            entries = st.shared.len(),
            bytes,
            "policy guest shared data over its cap; refused"
        );
        return Ok(status::BAD_ARGUMENT);
    }
    st.shared_bytes = bytes;
    st.shared
        .insert(k, (v, current.unwrap_or(0).wrapping_add(1)));
    Ok(status::OK)
}

// Shared queues: not offered.

fn proxy_register_shared_queue(_: Cx<'_>, _: u32, _: u32, _: u32) -> R {
    Ok(status::BAD_ARGUMENT)
}

fn proxy_resolve_shared_queue(_: Cx<'_>, _: u32, _: u32, _: u32, _: u32, _: u32) -> R {
    Ok(status::NOT_FOUND)
}

fn proxy_dequeue_shared_queue(_: Cx<'_>, _: u32, _: u32, _: u32) -> R {
    Ok(status::NOT_FOUND)
}

fn proxy_enqueue_shared_queue(_: Cx<'_>, _: u32, _: u32, _: u32) -> R {
    Ok(status::NOT_FOUND)
}
