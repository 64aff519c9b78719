//! The `process_*` families every Prometheus client exports (CPU seconds,
//! resident and virtual memory, open and maximum file descriptors, threads,
//! start time), read from `/proc/self` at each scrape. Off Linux the
//! collector exports nothing.

use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{Counter, Gauge, IntGauge, Opts, Registry};

use crate::TelemetryError;
use crate::names;

/// The process collector; register it with [`register`].
#[derive(Debug)]
struct Process {
    cpu: Counter,
    resident: IntGauge,
    virtual_bytes: IntGauge,
    open_fds: IntGauge,
    max_fds: IntGauge,
    threads: IntGauge,
    start: Gauge,
    descs: Vec<Desc>,
}

/// Registers the `process_*` families in `registry`.
pub fn register(registry: &Registry) -> Result<(), TelemetryError> {
    let err = |name: &str| {
        let name = name.to_string();
        move |source| TelemetryError::Metric { name, source }
    };
    let int =
        |name: &str, help: &str| IntGauge::with_opts(Opts::new(name, help)).map_err(err(name));
    let p = Process {
        cpu: Counter::with_opts(Opts::new(
            names::PROCESS_CPU_SECONDS_TOTAL,
            "User and system CPU time, seconds",
        ))
        .map_err(err(names::PROCESS_CPU_SECONDS_TOTAL))?,
        resident: int(
            names::PROCESS_RESIDENT_MEMORY_BYTES,
            "Resident memory, bytes",
        )?,
        virtual_bytes: int(names::PROCESS_VIRTUAL_MEMORY_BYTES, "Virtual memory, bytes")?,
        open_fds: int(names::PROCESS_OPEN_FDS, "Open file descriptors")?,
        max_fds: int(
            names::PROCESS_MAX_FDS,
            "Maximum open file descriptors (the soft limit)",
        )?,
        threads: int(names::PROCESS_THREADS, "OS threads")?,
        start: Gauge::with_opts(Opts::new(
            names::PROCESS_START_TIME_SECONDS,
            "Start time since the Unix epoch, seconds",
        ))
        .map_err(err(names::PROCESS_START_TIME_SECONDS))?,
        descs: Vec::new(),
    };
    let descs = [
        p.cpu.desc(),
        p.resident.desc(),
        p.virtual_bytes.desc(),
        p.open_fds.desc(),
        p.max_fds.desc(),
        p.threads.desc(),
        p.start.desc(),
    ]
    .into_iter()
    .flatten()
    .cloned()
    .collect();
    let p = Process { descs, ..p };
    registry
        .register(Box::new(p))
        .map_err(err(names::PROCESS_CPU_SECONDS_TOTAL))
}

impl Collector for Process {
    fn desc(&self) -> Vec<&Desc> {
        self.descs.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let Some(now) = read() else {
            return Vec::new();
        };
        let cpu = now.cpu_seconds - self.cpu.get();
        if cpu > 0.0 {
            self.cpu.inc_by(cpu);
        }
        self.resident.set(now.resident_bytes);
        self.virtual_bytes.set(now.virtual_bytes);
        self.open_fds.set(now.open_fds);
        self.max_fds.set(now.max_fds);
        self.threads.set(now.threads);
        self.start.set(now.start_seconds);
        let mut out = Vec::new();
        out.extend(self.cpu.collect());
        out.extend(self.resident.collect());
        out.extend(self.virtual_bytes.collect());
        out.extend(self.open_fds.collect());
        out.extend(self.max_fds.collect());
        out.extend(self.threads.collect());
        out.extend(self.start.collect());
        out
    }
}

/// One reading of `/proc/self`.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Reading {
    cpu_seconds: f64,
    resident_bytes: i64,
    virtual_bytes: i64,
    open_fds: i64,
    max_fds: i64,
    threads: i64,
    start_seconds: f64,
}

/// Clock ticks per second of `/proc`'s times and bytes per page.
#[derive(Debug, Clone, Copy)]
struct Units {
    ticks: f64,
    page: i64,
}

fn read() -> Option<Reading> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let boot = std::fs::read_to_string("/proc/stat").ok()?;
    let limits = std::fs::read_to_string("/proc/self/limits").unwrap_or_default();
    let open_fds = std::fs::read_dir("/proc/self/fd")
        .map(|d| d.count() as i64)
        .unwrap_or(0);
    let units = Units {
        ticks: rustix::param::clock_ticks_per_second() as f64,
        page: rustix::param::page_size() as i64,
    };
    parse(&stat, &boot, &limits, open_fds, units)
}

/// Parses `/proc/self/stat` (fields after the `)` closing the command
/// name, which may hold spaces), `btime` of `/proc/stat`, and the soft
/// "Max open files" of `/proc/self/limits`.
fn parse(stat: &str, boot: &str, limits: &str, open_fds: i64, u: Units) -> Option<Reading> {
    let rest = &stat[stat.rfind(')')? + 1..];
    // `rest` starts at field 3 (state); field N is index N - 3.
    let f: Vec<&str> = rest.split_whitespace().collect();
    let num = |n: usize| -> Option<f64> { f.get(n - 3)?.parse().ok() };
    let btime: f64 = boot
        .lines()
        .find_map(|l| l.strip_prefix("btime "))?
        .trim()
        .parse()
        .ok()?;
    let max_fds = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .and_then(|l| l.split_whitespace().nth(3))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    Some(Reading {
        cpu_seconds: (num(14)? + num(15)?) / u.ticks,
        threads: num(20)? as i64,
        start_seconds: btime + num(22)? / u.ticks,
        virtual_bytes: num(23)? as i64,
        resident_bytes: num(24)? as i64 * u.page,
        open_fds,
        max_fds,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_proc_stat_line_with_spaces_in_the_name_parses() {
        // Fields 14/15 utime/stime = 250/50 ticks, 20 threads = 7,
        // 22 starttime = 1000 ticks, 23 vsize, 24 rss pages.
        let stat = "1234 (my (odd) name) S 1 1234 1234 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 7 0 1000 123456789 300 18446744073709551615";
        let boot = "cpu  1 2 3\nbtime 1700000000\nprocesses 5\n";
        let limits = "Limit                     Soft Limit           Hard Limit           Units\nMax open files            1024                 524288               files\n";
        let units = Units {
            ticks: 100.0,
            page: 4096,
        };
        let r = parse(stat, boot, limits, 12, units).unwrap();
        assert_eq!(r.cpu_seconds, 3.0);
        assert_eq!(r.threads, 7);
        assert_eq!(r.start_seconds, 1_700_000_010.0);
        assert_eq!(r.virtual_bytes, 123_456_789);
        assert_eq!(r.resident_bytes, 300 * 4096);
        assert_eq!(r.max_fds, 1024);
        assert_eq!(r.open_fds, 12);
    }

    #[test]
    fn this_process_is_read_and_rendered() {
        let r = Registry::new();
        register(&r).unwrap();
        let text = crate::render(&r);
        for name in [
            names::PROCESS_CPU_SECONDS_TOTAL,
            names::PROCESS_RESIDENT_MEMORY_BYTES,
            names::PROCESS_OPEN_FDS,
            names::PROCESS_START_TIME_SECONDS,
        ] {
            assert!(
                text.contains(&format!("\n{name} ")),
                "{name} missing: {text}"
            );
        }
        let rss: f64 = text
            .lines()
            .find_map(|l| l.strip_prefix("process_resident_memory_bytes "))
            .unwrap()
            .parse()
            .unwrap();
        assert!(rss > 1e6, "{rss}");
    }
}
