//! A KV-event indexer driven line by line on stdin, for the independent
//! publisher test (`tests/python/test_kv_index.py`).
//!
//! Usage: `index_probe CONFIG_JSON`, where the JSON is
//! `{"options": {"max_blocks": N, "stale_after_ms": N, "retry_after_ms": N,
//! "replay_timeout_ms": N}, "endpoints": [{"id": …, "endpoint": …,
//! "replay_endpoint": … | null, "topic": …}, …]}` (every key optional).
//! Prints `{"ready": true}`, then answers one JSON line per command:
//!
//! - `match ID T1 T2 …` → `{"match": N}` (`null`: no cache information);
//! - `match_all T1 T2 …` → `{"matches": {"ID": N | null, …}}`;
//! - `stats` → `{"total": {…}, "endpoints": {"ID": {…}, …}}` (every counter,
//!   `blocks`, `health`, `seconds_since_last_event`);
//! - `set ENDPOINTS_JSON` → `{"ok": true}` or `{"error": "…"}` (the new
//!   whole list, as in the config).

use std::io::{BufRead, Write};
use std::time::Duration;

use rngd_kv_index::{EndpointSpec, EndpointStats, KvIndexer, Options};
use serde_json::{Value, json};

fn endpoints(v: &Value) -> Vec<EndpointSpec> {
    v.as_array()
        .map(|a| {
            a.iter()
                .map(|e| EndpointSpec {
                    id: e["id"].as_str().unwrap_or_default().to_owned(),
                    endpoint: e["endpoint"].as_str().unwrap_or_default().to_owned(),
                    replay_endpoint: e["replay_endpoint"].as_str().map(str::to_owned),
                    topic: e["topic"].as_str().unwrap_or_default().to_owned(),
                })
                .collect()
        })
        .unwrap_or_default()
}

fn stats_json(s: &EndpointStats) -> Value {
    json!({
        "events": s.events, "batches": s.batches, "gaps": s.gaps, "replays": s.replays,
        "replay_failures": s.replay_failures, "unknown_parents": s.unknown_parents,
        "undecodable": s.undecodable, "restarts": s.restarts, "stale": s.stale,
        "blocks_indexed": s.blocks_indexed, "evicted": s.evicted,
        "ignored_blocks": s.ignored_blocks, "blocks": s.blocks,
        "seconds_since_last_event": s.seconds_since_last_event,
        "health": s.health.as_str(),
    })
}

fn tokens(words: &[&str]) -> Option<Vec<u32>> {
    words.iter().map(|w| w.parse().ok()).collect()
}

fn main() {
    let arg = std::env::args().nth(1).unwrap_or_else(|| "{}".into());
    let config: Value = match serde_json::from_str(&arg) {
        Ok(v) => v,
        Err(e) => {
            eprintln!("error: the config is not JSON: {e}");
            std::process::exit(2);
        }
    };
    let o = &config["options"];
    let ms = |k: &str, d: Duration| o[k].as_u64().map_or(d, Duration::from_millis);
    let defaults = Options::default();
    let options = Options {
        max_blocks: o["max_blocks"]
            .as_u64()
            .map_or(defaults.max_blocks, |n| n as usize),
        stale_after: ms("stale_after_ms", defaults.stale_after),
        retry_after: ms("retry_after_ms", defaults.retry_after),
        replay_timeout: ms("replay_timeout_ms", defaults.replay_timeout),
        ..defaults
    };
    let indexer = match KvIndexer::start(options) {
        Ok(i) => i,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    };
    let mut out = std::io::stdout().lock();
    if let Err(e) = indexer.set_endpoints(endpoints(&config["endpoints"])) {
        eprintln!("error: {e}");
        std::process::exit(2);
    }
    writeln!(out, "{}", json!({"ready": true})).unwrap();
    out.flush().unwrap();
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        let words: Vec<&str> = line.split_whitespace().collect();
        let answer = match words.as_slice() {
            ["match", id, rest @ ..] => match tokens(rest) {
                Some(t) => json!({"match": indexer.match_prefix(id, &t)}),
                None => json!({"error": "token ids are numbers"}),
            },
            ["match_all", rest @ ..] => match tokens(rest) {
                Some(t) => {
                    let m: serde_json::Map<String, Value> = indexer
                        .match_all(&t)
                        .into_iter()
                        .map(|(id, n)| (id, json!(n)))
                        .collect();
                    json!({"matches": m})
                }
                None => json!({"error": "token ids are numbers"}),
            },
            ["stats"] => {
                let s = indexer.stats();
                let eps: serde_json::Map<String, Value> = s
                    .endpoints
                    .iter()
                    .map(|(id, e)| (id.clone(), stats_json(e)))
                    .collect();
                json!({"total": stats_json(&s.total), "endpoints": eps})
            }
            ["set", ..] => {
                let rest = line.trim_start().strip_prefix("set").unwrap_or("").trim();
                match serde_json::from_str::<Value>(rest) {
                    Ok(v) => match indexer.set_endpoints(endpoints(&v)) {
                        Ok(()) => json!({"ok": true}),
                        Err(e) => json!({"error": e.to_string()}),
                    },
                    Err(e) => json!({"error": format!("not JSON: {e}")}),
                }
            }
            [] => continue,
            _ => json!({"error": format!("unknown command {line:?}")}),
        };
        writeln!(out, "{answer}").unwrap();
        out.flush().unwrap();
    }
    indexer.shutdown();
}
