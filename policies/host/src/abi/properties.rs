//! Properties: `proxy_get_property` reads the request's properties (the
//! endpoint snapshot, its version, the prompt token count, … the table
//! [`PROPERTIES`]); `proxy_set_property` is refused.

use super::memory::{give_from, with_guest};
use super::{Cx, ENV, Hostcall, R};
use crate::codes::status;
use crate::request::PROPERTIES;

/// The property hostcalls.
pub(super) const HOSTCALLS: &[Hostcall] = hostcalls![ENV => proxy_get_property, proxy_set_property];

fn proxy_get_property(mut cx: Cx<'_>, pp: u32, pl: u32, rp: u32, rl: u32) -> R {
    let row = match with_guest(&cx, pp, pl, |path, _| {
        PROPERTIES.iter().find(|row| row.path == path)
    }) {
        Ok(Some(row)) => row,
        Ok(None) => return Ok(status::NOT_FOUND),
        Err(s) => return Ok(s),
    };
    give_from(&mut cx, rp, rl, |st| (row.value)(&st.req))
}

fn proxy_set_property(_: Cx<'_>, _: u32, _: u32, _: u32, _: u32) -> R {
    Ok(status::BAD_ARGUMENT)
}
