//! The clock (`proxy_get_current_time_nanoseconds`) and timers
//! (`proxy_set_tick_period_milliseconds`, refused: this host delivers no
//! ticks).

use std::time::{SystemTime, UNIX_EPOCH};

use super::memory::write;
use super::{Cx, ENV, Hostcall, R};
use crate::codes::status;

/// The clock and timer hostcalls.
pub(super) const HOSTCALLS: &[Hostcall] = hostcalls![ENV =>
    proxy_get_current_time_nanoseconds,
    proxy_set_tick_period_milliseconds,
];

/// Wall-clock time in nanoseconds since the Unix epoch (0 before it).
pub(super) fn now_nanos() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

fn proxy_get_current_time_nanoseconds(mut cx: Cx<'_>, ret: u32) -> R {
    Ok(write(&mut cx, ret, &now_nanos().to_le_bytes()).map_or_else(|s| s, |_| status::OK))
}

fn proxy_set_tick_period_milliseconds(_: Cx<'_>, _period: u32) -> R {
    // Ticks are never delivered by this host.
    Ok(status::BAD_ARGUMENT)
}
