//! Faults during a `--spawn-up` replay and what the clients saw of them:
//! one worker of the stack killed with SIGKILL every `--kill-every-s`
//! seconds (`rngd-pd up` restarts it), the answers' texts written out
//! (`--texts-out`) and held against another run's (`--texts-against`, the
//! same trace without faults: greedy requests, so every text must be equal),
//! and the router's cache predictions against what the engines served
//! (`rngd_pd_router_{predicted,served}_cached_tokens_total` on the
//! gateway), overall and outside the seconds after each kill.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::Mutex;

use crate::Error;
use crate::procs;

/// After a kill, the predictions of this long are counted apart (the
/// router learns of the restart from its next scrape).
pub const SETTLE_AFTER_KILL: Duration = Duration::from_secs(2);

/// What the faults did and what the clients saw.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct Chaos {
    /// The worker killed (`decode-1`, …), when faults were injected.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub killed_worker: Option<String>,
    /// SIGKILLs sent.
    pub kills: u64,
    /// Answers compared with `--texts-against` (both runs completed them).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub texts_compared: Option<u64>,
    /// Of those, answers whose text differs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub texts_differ: Option<u64>,
    /// Requests the other run completed and this one did not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub texts_missing: Option<u64>,
    /// Cached prompt tokens the router predicted where it routed (gateway
    /// counters, the whole run).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub predicted_cached_tokens: Option<f64>,
    /// Cached prompt tokens the engines reported for those requests.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub served_cached_tokens: Option<f64>,
    /// `predicted / served` over the run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub predicted_over_served: Option<f64>,
    /// The same outside the [`SETTLE_AFTER_KILL`] after each kill (the
    /// counters sampled each second; a second that overlaps a kill's
    /// window is left out).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub predicted_over_served_settled: Option<f64>,
}

/// One answer's text, as written by `--texts-out`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Text {
    /// The request's index in the replayed window.
    pub i: usize,
    /// Whether it completed (2xx, whole stream).
    pub ok: bool,
    /// The streamed text.
    pub text: String,
}

/// Writes `texts` as JSON lines.
pub fn write_texts(path: &Path, texts: &[Text]) -> Result<(), Error> {
    let mut out = String::new();
    for t in texts {
        out.push_str(&serde_json::to_string(t).map_err(|e| Error::Options(e.to_string()))?);
        out.push('\n');
    }
    std::fs::write(path, out).map_err(|e| Error::Options(format!("{}: {e}", path.display())))
}

/// Compares `texts` with the file another run wrote: (compared, differ,
/// missing here).
pub fn compare_texts(path: &Path, texts: &[Text]) -> Result<(u64, u64, u64), Error> {
    let raw = std::fs::read_to_string(path)
        .map_err(|e| Error::Options(format!("{}: {e}", path.display())))?;
    let theirs: BTreeMap<usize, Text> = raw
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str::<Text>(l).map(|t| (t.i, t)))
        .collect::<Result<_, _>>()
        .map_err(|e| Error::Options(format!("{}: {e}", path.display())))?;
    let ours: BTreeMap<usize, &Text> = texts.iter().map(|t| (t.i, t)).collect();
    let (mut compared, mut differ, mut missing) = (0, 0, 0);
    for (i, t) in theirs.iter().filter(|(_, t)| t.ok) {
        match ours.get(i) {
            Some(o) if o.ok => {
                compared += 1;
                if o.text != t.text {
                    differ += 1;
                }
            }
            _ => missing += 1,
        }
    }
    Ok((compared, differ, missing))
}

/// The pid of `up_pid`'s child serving `url`: the one that holds the
/// socket listening on its port (`up` starts workers on port 0, so the
/// command line names the port only after a restart).
pub fn worker_pid(up_pid: u32, url: &str) -> Option<u32> {
    let port: u16 = url.rsplit(':').next()?.trim_end_matches('/').parse().ok()?;
    let socket = format!("socket:[{}]", listening_inode(port)?);
    procs::children(up_pid).into_iter().find(|&pid| {
        std::fs::read_dir(format!("/proc/{pid}/fd")).is_ok_and(|fds| {
            fds.flatten().any(|fd| {
                std::fs::read_link(fd.path()).is_ok_and(|l| l.to_string_lossy() == socket)
            })
        })
    })
}

/// The inode of the TCP socket listening on `port` (`/proc/net/tcp{,6}`).
fn listening_inode(port: u16) -> Option<u64> {
    const LISTEN: &str = "0A";
    ["/proc/net/tcp", "/proc/net/tcp6"].iter().find_map(|f| {
        let table = std::fs::read_to_string(f).ok()?;
        table.lines().skip(1).find_map(|line| {
            let cols: Vec<&str> = line.split_whitespace().collect();
            let local_port = cols.get(1)?.rsplit(':').next()?;
            (u16::from_str_radix(local_port, 16).ok()? == port && *cols.get(3)? == LISTEN)
                .then(|| cols.get(9)?.parse().ok())
                .flatten()
        })
    })
}

/// Sums the samples of the counter `name` in a Prometheus text.
pub fn counter(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|r| r.starts_with('{') || r.starts_with(' '))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The kill loop and the per-second samples of the gateway's counters.
#[derive(Debug, Default)]
pub struct Injector {
    kills: AtomicU64,
    /// (seconds since the start, predicted, served, a kill within the
    /// settle window of this sample or the previous one).
    samples: Mutex<Vec<(f64, f64, f64, bool)>>,
}

impl Injector {
    /// Runs until dropped: every `every`, SIGKILLs the child of `up_pid`
    /// serving `worker_url`; every second, samples the gateway's counters.
    pub async fn run(
        self: Arc<Self>,
        client: reqwest::Client,
        gateway: String,
        up_pid: u32,
        worker_url: Option<String>,
        every: Option<Duration>,
    ) {
        let start = tokio::time::Instant::now();
        let mut last_kill: Option<tokio::time::Instant> = None;
        let mut next_kill = every.map(|e| start + e);
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tick.tick().await;
            let now = tokio::time::Instant::now();
            if let (Some(at), Some(url), Some(e)) = (next_kill, &worker_url, every)
                && now >= at
            {
                next_kill = Some(at + e);
                match worker_pid(up_pid, url).and_then(|p| rustix::process::Pid::from_raw(p as i32))
                {
                    Some(pid) => {
                        let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
                        self.kills.fetch_add(1, Ordering::SeqCst);
                        last_kill = Some(now);
                        eprintln!("replay: SIGKILL {url} (pid {pid:?})");
                    }
                    // Not running (being restarted): the next period.
                    None => eprintln!("replay: {url} not running, no kill"),
                }
            }
            let Ok(r) = client.get(format!("{gateway}/metrics")).send().await else {
                continue;
            };
            let Ok(text) = r.text().await else { continue };
            let disturbed = last_kill.is_some_and(|k| {
                now.saturating_duration_since(k) < SETTLE_AFTER_KILL + Duration::from_secs(1)
            });
            self.samples.lock().await.push((
                now.duration_since(start).as_secs_f64(),
                counter(&text, "rngd_pd_router_predicted_cached_tokens_total"),
                counter(&text, "rngd_pd_router_served_cached_tokens_total"),
                disturbed,
            ));
        }
    }

    /// The kills so far and the predicted/served ratios (whole run,
    /// settled seconds only), from the final counters `end`.
    pub async fn summary(&self, end: Option<(f64, f64)>) -> (u64, Option<(f64, f64)>, Option<f64>) {
        let samples = self.samples.lock().await;
        let (mut p, mut s) = (0.0, 0.0);
        for w in samples.windows(2) {
            if !w[1].3 {
                p += w[1].1 - w[0].1;
                s += w[1].2 - w[0].2;
            }
        }
        let settled = (s > 0.0).then(|| p / s);
        (self.kills.load(Ordering::SeqCst), end, settled)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_sum_their_labelled_samples() {
        let text = "# HELP x\nrngd_pd_router_served_cached_tokens_total{endpoint=\"a\"} 10\n\
                    rngd_pd_router_served_cached_tokens_total{endpoint=\"b\"} 5.5\n\
                    rngd_pd_router_served_cached_tokens_totalx 100\n";
        assert_eq!(
            counter(text, "rngd_pd_router_served_cached_tokens_total"),
            15.5
        );
        assert_eq!(counter(text, "absent"), 0.0);
    }

    #[test]
    fn a_listening_socket_is_found_by_its_port() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let inode = listening_inode(port).expect("the listener is in /proc/net/tcp");
        let me = std::process::id();
        let holds = std::fs::read_dir(format!("/proc/{me}/fd"))
            .unwrap()
            .flatten()
            .any(|fd| {
                std::fs::read_link(fd.path())
                    .is_ok_and(|l| l.to_string_lossy() == format!("socket:[{inode}]"))
            });
        assert!(holds);
        drop(l);
        assert_eq!(listening_inode(port), None);
    }

    #[test]
    fn texts_are_held_against_the_other_run() {
        let dir = std::env::temp_dir().join(format!("chaos-texts-{}", std::process::id()));
        let t = |i, ok, text: &str| Text {
            i,
            ok,
            text: text.into(),
        };
        write_texts(
            &dir,
            &[
                t(0, true, "a"),
                t(1, true, "b"),
                t(2, true, "c"),
                t(3, false, ""),
            ],
        )
        .unwrap();
        let got =
            compare_texts(&dir, &[t(0, true, "a"), t(1, true, "B"), t(3, true, "d")]).unwrap();
        // 0 equal, 1 differs, 2 missing here, 3 not completed there.
        assert_eq!(got, (2, 1, 1));
        std::fs::remove_file(&dir).unwrap();
    }
}
