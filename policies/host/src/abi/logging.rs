//! Guest logging: `proxy_log` (into `tracing`, target `policy_guest`; error
//! lines are also kept for reports) and `proxy_get_log_level`.

use super::memory::{read, write};
use super::{Cx, ENV, Hostcall, R};
use crate::codes::status;

/// The logging hostcalls.
pub(super) const HOSTCALLS: &[Hostcall] = hostcalls![ENV => proxy_log, proxy_get_log_level];

/// Error lines kept per instance for reports.
pub(super) const MAX_KEPT_ERRORS: usize = 16;

fn proxy_log(mut cx: Cx<'_>, level: u32, p: u32, l: u32) -> R {
    let msg = match read(&cx, p, l) {
        Ok(m) => String::from_utf8_lossy(&m).into_owned(),
        Err(s) => return Ok(s),
    };
    match level {
        0 => tracing::trace!(target: "policy_guest", "{msg}"),
        1 => tracing::debug!(target: "policy_guest", "{msg}"),
        2 => tracing::info!(target: "policy_guest", "{msg}"),
        3 => tracing::warn!(target: "policy_guest", "{msg}"),
        _ => {
            tracing::error!(target: "policy_guest", "{msg}");
            let errors = &mut cx.data_mut().errors;
            if errors.len() < MAX_KEPT_ERRORS {
                errors.push(msg);
            }
        }
    }
    Ok(status::OK)
}

fn proxy_get_log_level(mut cx: Cx<'_>, ret: u32) -> R {
    Ok(write(&mut cx, ret, &2u32.to_le_bytes()).map_or_else(|s| s, |_| status::OK))
}
