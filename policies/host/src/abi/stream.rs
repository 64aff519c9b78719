//! Stream control: `proxy_send_local_response` (the policy's reject), and
//! the calls that have nothing to act on in a synchronous decision
//! (`proxy_continue_stream`, `proxy_close_stream`, `proxy_done`,
//! `proxy_set_effective_context`).

use super::memory::read;
use super::{Cx, ENV, Hostcall, R};
use crate::codes::status;

/// The stream-control hostcalls.
pub(super) const HOSTCALLS: &[Hostcall] = hostcalls![ENV =>
    proxy_continue_stream,
    proxy_close_stream,
    proxy_send_local_response,
    proxy_set_effective_context,
    proxy_done,
];

fn proxy_continue_stream(_: Cx<'_>, _: u32) -> R {
    // Decisions are synchronous: there is nothing paused to resume.
    Ok(status::OK)
}

fn proxy_close_stream(_: Cx<'_>, _: u32) -> R {
    Ok(status::BAD_ARGUMENT)
}

#[expect(clippy::too_many_arguments, reason = "the ABI's signature")]
fn proxy_send_local_response(
    mut cx: Cx<'_>,
    code: u32,
    dp: u32,
    dl: u32,
    bp: u32,
    bl: u32,
    hp: u32,
    hl: u32,
    _grpc: i32,
) -> R {
    let max = cx.data().max_header_bytes;
    if hl as usize > max || bl as usize > max.saturating_mul(16) {
        return Ok(status::BAD_ARGUMENT);
    }
    let (details, body, hdrs) = match (read(&cx, dp, dl), read(&cx, bp, bl), read(&cx, hp, hl)) {
        (Ok(d), Ok(b), Ok(h)) => (d, b, h),
        (Err(s), _, _) | (_, Err(s), _) | (_, _, Err(s)) => return Ok(s),
    };
    tracing::debug!(status = code, details = %String::from_utf8_lossy(&details), "policy sent a local response");
    Ok(cx
        .data_mut()
        .req
        .send_local_response(code, body, &hdrs)
        .map_or_else(|s| s, |()| status::OK))
}

fn proxy_set_effective_context(_: Cx<'_>, _: u32) -> R {
    Ok(status::OK)
}

fn proxy_done(_: Cx<'_>) -> R {
    Ok(status::OK)
}
