//! The relay's figures on Prometheus: each scrape renders one
//! [`RelayStats`] (the STATS reply's figures) as `rngd_pd_relay_*` gauges
//! and counters (names from `rngd_telemetry::names`), with the process
//! families. The CLI serves the page on `--metrics-listen`.

use rngd_telemetry::{TelemetryError, names};

use crate::frame::RelayStats;

/// The Prometheus text page of `stats` for a relay capped at `max_bytes`.
pub fn render(stats: &RelayStats, max_bytes: u64) -> Result<String, TelemetryError> {
    let r = rngd_telemetry::registry()?;
    for (name, help, v) in [
        (
            names::RELAY_BYTES,
            "Bytes counted against the memory cap (blobs held, PUT bodies being received, a fixed overhead per blob)",
            stats.bytes as f64,
        ),
        (
            names::RELAY_MAX_BYTES,
            "The memory cap, bytes (--max-bytes)",
            max_bytes as f64,
        ),
        (
            names::RELAY_KEYS,
            "Requests with at least one blob held",
            stats.keys as f64,
        ),
        (names::RELAY_BLOBS, "Blobs held", stats.blobs as f64),
        (
            names::RELAY_WAITERS,
            "GETs waiting for a blob",
            stats.waiters as f64,
        ),
        (
            names::RELAY_CONNECTIONS,
            "Open authenticated connections",
            stats.connections as f64,
        ),
        (
            names::RELAY_HANDSHAKES,
            "Sockets in the handshake now, under the pre-auth cap",
            stats.handshakes as f64,
        ),
        (
            names::RELAY_PUTS_IN_PROGRESS,
            "PUT bodies being received",
            stats.puts_in_progress as f64,
        ),
        (
            names::RELAY_STRANDED_BYTES,
            "Bytes of blobs older than the claim window that no decode took (pulled and deleted), as of the last TTL sweep",
            stats.stranded_bytes as f64,
        ),
    ] {
        rngd_telemetry::gauge(&r, name, help)?.set(v);
    }
    rngd_telemetry::counter(
        &r,
        names::RELAY_EXPIRED_TOTAL,
        "Requests expired by the TTL",
    )?
    .inc_by(stats.expired);
    rngd_telemetry::counter(
        &r,
        names::RELAY_WARNINGS_HELD_BACK_TOTAL,
        "Warnings of failed handshakes and accepts the log rate limit held back",
    )?
    .inc_by(stats.warnings_held_back);
    for (name, help, by) in [
        (
            names::RELAY_REJECTIONS_TOTAL,
            "Refusals and forced closes, by reason",
            &stats.rejections,
        ),
        (
            names::RELAY_HANDSHAKE_FAILURES_TOTAL,
            "Sockets that failed the handshake, by reason",
            &stats.handshake_failures,
        ),
    ] {
        let c = rngd_telemetry::counter_vec(&r, name, help, &["reason"])?;
        for (reason, n) in by {
            c.with_label_values(&[reason.as_str()]).inc_by(*n);
        }
    }
    Ok(rngd_telemetry::render(&r))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_figure_is_on_the_page_with_its_reason_labels() {
        let stats = RelayStats {
            epoch: 1,
            keys: 2,
            blobs: 6,
            bytes: 4096,
            waiters: 1,
            connections: 3,
            handshakes: 0,
            handshake_failures: [("refused".to_string(), 4)].into(),
            warnings_held_back: 2,
            puts_in_progress: 1,
            expired: 5,
            stranded_bytes: 1024,
            rejections: [("memory_cap".to_string(), 7)].into(),
        };
        let page = render(&stats, 1 << 30).unwrap();
        for line in [
            "rngd_pd_relay_bytes 4096",
            "rngd_pd_relay_max_bytes 1073741824",
            "rngd_pd_relay_blobs 6",
            "rngd_pd_relay_connections 3",
            "rngd_pd_relay_expired_total 5",
            "rngd_pd_relay_stranded_bytes 1024",
            "rngd_pd_relay_rejections_total{reason=\"memory_cap\"} 7",
            "rngd_pd_relay_handshake_failures_total{reason=\"refused\"} 4",
        ] {
            assert!(
                page.contains(&format!("{line}\n")),
                "{line} missing:\n{page}"
            );
        }
    }
}
