//! Buffers: the request body and the plugin configuration, read-only
//! (`proxy_get_buffer_bytes`; `proxy_set_buffer_bytes` is refused: policies
//! decide, they do not rewrite bodies).

use super::memory::give_from;
use super::{Cx, ENV, Hostcall, R};
use crate::codes::{
    BUFFER_PLUGIN_CONFIGURATION, BUFFER_REQUEST_BODY, BUFFER_VM_CONFIGURATION, status,
};

/// The buffer hostcalls.
pub(super) const HOSTCALLS: &[Hostcall] =
    hostcalls![ENV => proxy_get_buffer_bytes, proxy_set_buffer_bytes];

fn proxy_get_buffer_bytes(mut cx: Cx<'_>, kind: u32, start: u32, max: u32, rp: u32, rl: u32) -> R {
    if !matches!(
        kind,
        BUFFER_REQUEST_BODY | BUFFER_PLUGIN_CONFIGURATION | BUFFER_VM_CONFIGURATION
    ) {
        return Ok(status::NOT_FOUND);
    }
    give_from(&mut cx, rp, rl, |st| {
        let whole: &[u8] = match kind {
            BUFFER_REQUEST_BODY => &st.req.body,
            BUFFER_PLUGIN_CONFIGURATION => &st.plugin_config,
            _ => &[],
        };
        let s = (start as usize).min(whole.len());
        let e = s.saturating_add(max as usize).min(whole.len());
        Some(&whole[s..e])
    })
}

fn proxy_set_buffer_bytes(_: Cx<'_>, _: u32, _: u32, _: u32, _: u32, _: u32) -> R {
    // Policies decide; they do not rewrite bodies.
    Ok(status::BAD_ARGUMENT)
}
