//! Shared data: a per-instance key/value store with compare-and-swap
//! versions (`proxy_get_shared_data`, `proxy_set_shared_data`). Shared
//! queues are not offered (their hostcalls answer `BadArgument` or
//! `NotFound`).

use super::memory::{give, read, read_str, write};
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
    let key = match read_str(&cx, kp, kl) {
        Ok(k) => k,
        Err(s) => return Ok(s),
    };
    let Some((v, cas)) = cx.data().shared.get(&key).cloned() else {
        return Ok(status::NOT_FOUND);
    };
    if let Err(s) = write(&mut cx, rc, &cas.to_le_bytes()) {
        return Ok(s);
    }
    give(&mut cx, v, rp, rl)
}

fn proxy_set_shared_data(mut cx: Cx<'_>, kp: u32, kl: u32, vp: u32, vl: u32, cas: u32) -> R {
    if vl as usize > cx.data().max_header_bytes {
        return Ok(status::BAD_ARGUMENT);
    }
    let (k, v) = match read_str(&cx, kp, kl).and_then(|k| read(&cx, vp, vl).map(|v| (k, v))) {
        Ok(kv) => kv,
        Err(s) => return Ok(s),
    };
    let shared = &mut cx.data_mut().shared;
    let current = shared.get(&k).map_or(0, |(_, c)| *c);
    if cas != 0 && cas != current {
        return Ok(8); // CasMismatch
    }
    shared.insert(k, (v, current.wrapping_add(1)));
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
