//! Processes to watch, read from `/proc`: resident memory (`VmRSS` of
//! `/proc/PID/status`), the children of a process, processes whose command
//! line contains a pattern, and a label for each; and [`interrupt_and_wait`],
//! how the harness stops a child it started.

use std::collections::BTreeMap;
use std::path::Path;

/// A process to sample, with the key it has in the JSON line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Watched {
    /// Key in `rss_mb_start` / `rss_mb_end`.
    pub label: String,
    /// Process id.
    pub pid: u32,
}

/// `VmRSS` of `/proc/PID/status`, MB (10^6 bytes); `None` if the process is
/// gone or the field is missing.
pub fn rss_mb(pid: u32) -> Option<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    parse_vm_rss_kb(&status).map(|kb| kb as f64 * 1024.0 / 1e6)
}

/// The `VmRSS:` value of a `/proc/PID/status` text, kB.
pub fn parse_vm_rss_kb(status: &str) -> Option<u64> {
    status.lines().find_map(|l| {
        l.strip_prefix("VmRSS:")?
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()
            .ok()
    })
}

/// RSS of each watched process, MB, keyed by label (a process that is gone
/// is `null`).
pub fn sample(watched: &[Watched]) -> BTreeMap<String, Option<f64>> {
    watched
        .iter()
        .map(|w| (w.label.clone(), rss_mb(w.pid)))
        .collect()
}

/// The parent pid from a `/proc/PID/stat` text (the field after the
/// parenthesized command name, which may itself contain spaces or parentheses).
pub fn parse_ppid(stat: &str) -> Option<u32> {
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(1)?.parse().ok()
}

/// Every pid under `/proc`.
fn pids() -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect()
}

/// The command line of `pid` as its arguments (empty if gone).
pub fn cmdline(pid: u32) -> Vec<String> {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| {
            b.split(|&c| c == 0)
                .filter(|a| !a.is_empty())
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// The direct children of `parent`.
pub fn children(parent: u32) -> Vec<u32> {
    let mut out: Vec<u32> = pids()
        .into_iter()
        .filter(|p| {
            std::fs::read_to_string(format!("/proc/{p}/stat"))
                .ok()
                .and_then(|s| parse_ppid(&s))
                == Some(parent)
        })
        .collect();
    out.sort_unstable();
    out
}

/// The label of an `rngd-pd` child from its arguments: the subcommand, with
/// a worker's `--role` (`relay`, `prefill`, `decode`, `gateway`, `ext-proc`);
/// else the executable's file name.
pub fn rngd_label(args: &[String]) -> String {
    let sub = args.get(1).map(String::as_str).unwrap_or("");
    if sub == "worker"
        && let Some(i) = args.iter().position(|a| a == "--role")
        && let Some(role) = args.get(i + 1)
    {
        return role.clone();
    }
    if !sub.is_empty() && !sub.starts_with('-') {
        return sub.to_string();
    }
    args.first()
        .and_then(|a| Path::new(a).file_name())
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// `up` itself (label `up`) and its children labelled by [`rngd_label`]
/// (a repeated label gets `-PID` appended).
pub fn up_stack(up_pid: u32) -> Vec<Watched> {
    let mut out = vec![Watched {
        label: "up".into(),
        pid: up_pid,
    }];
    for pid in children(up_pid) {
        let mut label = rngd_label(&cmdline(pid));
        if out.iter().any(|w| w.label == label) {
            label = format!("{label}-{pid}");
        }
        out.push(Watched { label, pid });
    }
    out
}

/// Processes (other than this one) whose command line contains `pattern`,
/// labelled `pattern:PID`.
pub fn by_name(pattern: &str) -> Vec<Watched> {
    let me = std::process::id();
    let mut out: Vec<Watched> = pids()
        .into_iter()
        .filter(|&p| p != me && cmdline(p).join(" ").contains(pattern))
        .map(|pid| Watched {
            label: format!("{pattern}:{pid}"),
            pid,
        })
        .collect();
    out.sort_by_key(|w| w.pid);
    out
}

/// SIGINT to `child` (process `pid`), then waits up to `grace` for it to
/// exit, else kills it. The error says which of the two went wrong.
pub async fn interrupt_and_wait(
    child: &mut tokio::process::Child,
    pid: u32,
    grace: std::time::Duration,
) -> Result<(), String> {
    if let Some(p) = rustix::process::Pid::from_raw(pid as i32) {
        let _ = rustix::process::kill_process(p, rustix::process::Signal::INT);
    }
    match tokio::time::timeout(grace, child.wait()).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => Err(format!("waiting for it to stop: {e}")),
        Err(_) => {
            let _ = child.kill().await;
            Err(format!(
                "did not stop within {} s of SIGINT; killed",
                grace.as_secs()
            ))
        }
    }
}
