//! A KV-event publisher driven line by line on stdin, for the independent
//! consumer test (`tests/python/test_kv_events.py`).
//!
//! Usage: `scripted_publisher CONFIG_JSON` (vLLM's `--kv-events-config`
//! value; endpoints like `tcp://127.0.0.1:*` bind a free loopback port).
//! Prints `pub ENDPOINT` and `replay ENDPOINT`, then reads commands:
//!
//! - `stored PARENT|- BLOCK_SIZE H1,H2,… T1,T2,…`, `removed H1,H2,…`,
//!   `cleared`: queue one event;
//! - `end`: close the batch (the events queued so far are one batch);
//! - `sync N`: wait until N batches were published, then print `synced N`;
//! - `stats`: print `stats batches=… events=… dropped=… replays=…`.

use std::io::{BufRead, Write};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use rngd_kv_events::{KvEventPublisher, KvEventsConfig};

fn list(s: &str) -> Vec<u64> {
    s.split(',')
        .filter(|x| !x.is_empty())
        .map(|x| x.parse().expect("a number"))
        .collect()
}

fn main() {
    let arg = std::env::args()
        .nth(1)
        .expect("usage: scripted_publisher CONFIG_JSON");
    let config = match KvEventsConfig::parse(&arg) {
        Ok(c) => c,
        Err(e) => {
            let mut msg = e.to_string();
            let mut src = std::error::Error::source(&e);
            while let Some(s) = src {
                msg.push_str(&format!(": {s}"));
                src = s.source();
            }
            eprintln!("error: {msg}");
            std::process::exit(2);
        }
    };
    let publisher = KvEventPublisher::start(&config)
        .expect("starting the publisher")
        .expect("events enabled");
    let mut out = std::io::stdout().lock();
    writeln!(out, "pub {}", publisher.endpoint()).unwrap();
    writeln!(out, "replay {}", publisher.replay_endpoint().unwrap_or("-")).unwrap();
    out.flush().unwrap();
    for line in std::io::stdin().lock().lines() {
        let line = line.expect("stdin");
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["stored", parent, bs, hashes, tokens] => publisher.stored(
                list(hashes),
                (*parent != "-").then(|| parent.parse().expect("a parent hash")),
                list(tokens).into_iter().map(|t| t as u32).collect(),
                bs.parse().expect("a block size"),
            ),
            ["removed", hashes] => publisher.removed(list(hashes)),
            ["cleared"] => publisher.all_cleared(),
            ["end"] => publisher.end_step(),
            ["sync", n] => {
                let n: u64 = n.parse().expect("a count");
                let deadline = Instant::now() + Duration::from_secs(10);
                while publisher.stats().batches.load(Ordering::Relaxed) < n {
                    assert!(
                        Instant::now() < deadline,
                        "{n} batches not published in 10 s"
                    );
                    std::thread::sleep(Duration::from_millis(1));
                }
                writeln!(out, "synced {n}").unwrap();
            }
            ["stats"] => {
                let s = publisher.stats();
                writeln!(
                    out,
                    "stats batches={} events={} dropped={} replays={}",
                    s.batches.load(Ordering::Relaxed),
                    s.events.load(Ordering::Relaxed),
                    s.dropped_events.load(Ordering::Relaxed),
                    s.replays.load(Ordering::Relaxed)
                )
                .unwrap();
            }
            [] => {}
            _ => panic!("unknown command: {line}"),
        }
        out.flush().unwrap();
    }
    publisher.shutdown();
}
