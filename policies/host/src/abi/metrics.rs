//! Guest metrics: `proxy_define_metric`, `proxy_get_metric`,
//! `proxy_record_metric`, `proxy_increment_metric`, kept per instance (at
//! most 1024 names of at most 256 bytes: past that a define is `BadArgument`,
//! counted as cap `metrics`); they are not exported anywhere.

use super::memory::{read_str, write};
use super::{Cx, ENV, Hostcall, MAX_METRIC_NAME_BYTES, R};
use crate::codes::status;

/// The metric hostcalls.
pub(super) const HOSTCALLS: &[Hostcall] = hostcalls![ENV =>
    proxy_define_metric,
    proxy_get_metric,
    proxy_record_metric,
    proxy_increment_metric,
];

fn proxy_define_metric(mut cx: Cx<'_>, _kind: u32, np: u32, nl: u32, rid: u32) -> R {
    if nl as usize > MAX_METRIC_NAME_BYTES {
        cx.data().env.caps.metrics.inc();
        return Ok(status::BAD_ARGUMENT);
    }
    let name = match read_str(&cx, np, nl) {
        Ok(n) => n,
        Err(s) => return Ok(s),
    };
    let st = cx.data_mut();
    let known = st
        .metrics
        .iter()
        .find(|(_, (n, _))| *n == name)
        .map(|(id, _)| *id);
    if known.is_none() && st.metrics.len() >= 1024 {
        st.env.caps.metrics.inc();
        return Ok(status::BAD_ARGUMENT);
    }
    let metrics = &mut st.metrics;
    let id = known.unwrap_or(metrics.len() as u32 + 1);
    metrics.entry(id).or_insert((name, 0));
    Ok(write(&mut cx, rid, &id.to_le_bytes()).map_or_else(|s| s, |_| status::OK))
}

fn proxy_get_metric(mut cx: Cx<'_>, id: u32, ret: u32) -> R {
    let Some(v) = cx.data().metrics.get(&id).map(|(_, v)| *v) else {
        return Ok(status::NOT_FOUND);
    };
    Ok(write(&mut cx, ret, &v.to_le_bytes()).map_or_else(|s| s, |_| status::OK))
}

fn proxy_record_metric(mut cx: Cx<'_>, id: u32, value: u64) -> R {
    match cx.data_mut().metrics.get_mut(&id) {
        Some(m) => {
            m.1 = value;
            Ok(status::OK)
        }
        None => Ok(status::NOT_FOUND),
    }
}

fn proxy_increment_metric(mut cx: Cx<'_>, id: u32, offset: i64) -> R {
    match cx.data_mut().metrics.get_mut(&id) {
        Some(m) => {
            m.1 = m.1.wrapping_add_signed(offset);
            Ok(status::OK)
        }
        None => Ok(status::NOT_FOUND),
    }
}
