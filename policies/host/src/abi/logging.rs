//! Guest logging: `proxy_log` (into `tracing`, target `policy_guest`; error
//! lines are also kept for reports) and `proxy_get_log_level`. A message
//! over [`SandboxLimits::max_log_bytes`](crate::SandboxLimits::max_log_bytes)
//! or past the runtime's line rate
//! ([`SandboxLimits::log_lines_per_second`](crate::SandboxLimits::log_lines_per_second))
//! is `BadArgument` and not logged.

use super::memory::{with_guest, write};
use super::{Cx, ENV, Hostcall, R};
use crate::codes::status;

/// The logging hostcalls.
pub(super) const HOSTCALLS: &[Hostcall] = hostcalls![ENV => proxy_log, proxy_get_log_level];

/// Error lines kept per instance for reports.
pub(super) const MAX_KEPT_ERRORS: usize = 16;

fn proxy_log(mut cx: Cx<'_>, level: u32, p: u32, l: u32) -> R {
    // Bounds first (a bad pointer is InvalidMemoryAccess at any length),
    // then the size cap, before anything is copied.
    let msg = match with_guest(&cx, p, l, |m, st| {
        (m.len() <= st.caps.log_bytes).then(|| String::from_utf8_lossy(m).into_owned())
    }) {
        Ok(Some(m)) => m,
        Ok(None) => {
            cx.data().env.caps.log_size.inc();
            return Ok(status::BAD_ARGUMENT);
        }
        Err(s) => return Ok(s),
    };
    let logged = cx.data().env.log_bucket.take();
    if !logged {
        cx.data().env.caps.log_rate.inc();
    }
    if level >= 4 {
        // Kept for the error report even when over the rate (bounded).
        let errors = &mut cx.data_mut().errors;
        if errors.len() < MAX_KEPT_ERRORS {
            errors.push(msg.clone());
        }
    }
    if !logged {
        return Ok(status::BAD_ARGUMENT);
    }
    match level {
        0 => tracing::trace!(target: "policy_guest", "{msg}"),
        1 => tracing::debug!(target: "policy_guest", "{msg}"),
        2 => tracing::info!(target: "policy_guest", "{msg}"),
        3 => tracing::warn!(target: "policy_guest", "{msg}"),
        _ => tracing::error!(target: "policy_guest", "{msg}"),
    }
    Ok(status::OK)
}

fn proxy_get_log_level(mut cx: Cx<'_>, ret: u32) -> R {
    Ok(write(&mut cx, ret, &2u32.to_le_bytes()).map_or_else(|s| s, |_| status::OK))
}
