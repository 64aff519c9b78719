//! Kill faults over the tcp relay with real processes (`rngd-pd relay` and
//! `rngd-pd worker`, release build, real model): a decode worker SIGKILLed
//! in the middle of its pull, a prefill worker SIGKILLed in the middle of
//! its push. Each asserts what the client sees (an error, not a hang, within
//! a stated time), that the relay holds nothing once its TTL has passed
//! (read through STATS), that no engine slot stays taken, and that the
//! service still serves a normal PD request.
//!
//! "In the middle" is made deterministic, not timed: the relay is stopped
//! (SIGSTOP) before the transfer starts, the test waits until the transfer
//! has reached it (the decode's GETs queued on the relay's socket, read from
//! `/proc/net/tcp`; the prefill's first blob written, read from its
//! `AIRM_KV_TCP_LOG=1` log), kills the worker and resumes the relay.
//!
//! Needs the model: `RNGD_PD_MODEL`, or the default cache filled by
//! `rngd-pd model fetch`.

mod common;

use std::process::Command;

use common::http::{ids, metric};
use common::{Proc, model};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rngd_kv_transport::frame::{RelayStats, Secret};
use rngd_kv_transport::tcp::TcpTransport;
use rngd_kv_transport::{KvHandle, TransportConfig};
use serde_json::{Value, json};

/// Serializes the tests of this file: each starts model-loading processes.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const TTL_S: &str = "1.5";
const PULL_TIMEOUT_MS: u64 = 3000;
/// Generous bound for anything that should happen within a TTL or a pull timeout.
const BOUND: Duration = Duration::from_secs(30);
/// The test deployment's KV secret.
const KV_SECRET: &str = "kill-faults-test-secret-0123456789";

/// A stopped relay is resumed when this goes (also when the test fails).
struct Stopped<'a>(&'a Proc);

impl<'a> Stopped<'a> {
    fn stop(relay: &'a Proc) -> Self {
        relay.signal("-STOP");
        Stopped(relay)
    }
}

impl Drop for Stopped<'_> {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-CONT", &self.0.child.id().to_string()])
            .status();
    }
}

struct Env {
    dir: tempfile::TempDir,
    envs: Vec<(&'static str, String)>,
}

impl Env {
    fn new() -> Env {
        let dir = tempfile::tempdir().unwrap();
        let envs = vec![
            ("RNGD_PD_MODEL", model().display().to_string()),
            ("PD_SHM_ROOT", dir.path().join("shm").display().to_string()),
            ("AIRM_KV_TCP_TTL_S", TTL_S.to_string()),
            ("RNGD_PD_KV_PULL_TIMEOUT_MS", PULL_TIMEOUT_MS.to_string()),
            ("AIRM_KV_TCP_SECRET", KV_SECRET.to_string()),
            ("RNGD_PD_CHIP", "-1".to_string()),
            (
                "RNGD_PD_KUBELET_CHECKPOINT",
                dir.path().join("no-checkpoint").display().to_string(),
            ),
        ];
        Env { dir, envs }
    }

    fn start_relay(&mut self) -> Proc {
        let relay = Proc::start(
            "relay",
            self.dir.path(),
            &["relay", "--listen", "127.0.0.1:0", "--ttl-s", TTL_S],
            &[("AIRM_KV_TCP_SECRET", KV_SECRET.to_string())],
            "relay listening on ",
        );
        self.envs.push(("AIRM_KV_TCP_ADDR", relay.addr.clone()));
        relay
    }

    fn worker(&self, name: &str, role: &str, extra: &[(&'static str, String)]) -> Proc {
        let mut envs = self.envs.clone();
        envs.extend_from_slice(extra);
        Proc::worker(name, self.dir.path(), role, &envs)
    }
}

/// A STATS client of the relay, configured from the environment a worker
/// gets (the deployment's secret, so TLS keyed by it).
fn stats_client(relay: &Proc) -> TcpTransport {
    let cfg = TransportConfig::from_lookup(|k| match k {
        "AIRM_KV_TCP_ADDR" => Some(relay.addr.clone()),
        "AIRM_KV_TCP_SECRET" => Some(KV_SECRET.to_string()),
        _ => None,
    })
    .unwrap();
    assert!(cfg.tcp_tls.is_some(), "TLS keyed by the secret");
    TcpTransport::new(&cfg).unwrap()
}

async fn stats(t: &TcpTransport) -> RelayStats {
    t.stats()
        .await
        .unwrap_or_else(|e| panic!("relay STATS: {e}"))
}

fn is_empty(s: &RelayStats) -> bool {
    s.keys == 0 && s.blobs == 0 && s.bytes == 0 && s.puts_in_progress == 0 && s.waiters == 0
}

/// Polls STATS until the relay holds nothing, or panics after `limit`.
async fn relay_empties(t: &TcpTransport, limit: Duration, what: &str) -> RelayStats {
    let start = Instant::now();
    loop {
        let s = stats(t).await;
        if is_empty(&s) {
            return s;
        }
        assert!(
            start.elapsed() < limit,
            "{what}: the relay still holds something after {limit:?}: {s:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Polls `cond` until it holds, or panics after `limit`.
async fn eventually(limit: Duration, what: &str, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < limit, "{what}: not within {limit:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn request(prompt: &str) -> Value {
    json!({"model": common::SERVED_MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0})
}

/// A prompt of about 450 tokens: the prefill hands over only the valid
/// positions (the trimmed wire), so a long prompt is what makes a push and a
/// pull big enough (about 10 MB) to be caught halfway by a kill.
static PROMPT: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    "The quick brown fox jumps over the lazy dog near the river bank. ".repeat(34)
});

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(120))
        .build()
        .unwrap()
}

async fn post(url: &str, body: &Value, rid: &str) -> Result<(u16, String), reqwest::Error> {
    let resp = client()
        .post(url)
        .header("x-request-id", rid)
        .json(body)
        .send()
        .await?;
    let status = resp.status().as_u16();
    Ok((status, resp.text().await?))
}

async fn ok_json(w: &Proc, body: &Value, rid: &str) -> Value {
    let (status, text) = post(&w.url("/v1/completions"), body, rid)
        .await
        .unwrap_or_else(|e| panic!("POST to {}: {e}", w.name));
    assert_eq!(status, 200, "{} answered {status}: {text}", w.name);
    serde_json::from_str(&text).unwrap()
}

fn prefill_body() -> Value {
    let mut pre = request(&PROMPT);
    pre["kv_transfer_params"] = json!({"do_remote_decode": true, "kv_transport": "tcp"});
    pre
}

/// The prefill step: the `kv_transfer_params` for the decode worker.
async fn push(prefill: &Proc, rid: &str) -> Value {
    let answer = ok_json(prefill, &prefill_body(), rid).await;
    let params = answer["kv_transfer_params"].clone();
    assert_eq!(params["kv_handle"]["transport"], "tcp", "{answer}");
    let tokens = params["kv_handle"]["tokens"].as_u64().unwrap();
    assert!(
        (400..=500).contains(&tokens),
        "the prompt is about 450 tokens: {tokens}"
    );
    params
}

fn decode_body(params: Value) -> Value {
    let mut dec = request(&PROMPT);
    dec["kv_transfer_params"] = params;
    dec
}

/// A normal PD request; its tokens.
async fn pd(prefill: &Proc, decode: &Proc, rid: &str) -> Vec<u64> {
    let params = push(prefill, &format!("{rid}-prefill")).await;
    let got = ok_json(decode, &decode_body(params), rid).await;
    let t = ids(&got);
    assert!(!t.is_empty(), "{got}");
    t
}

/// No engine slot stays taken on `w` (polled: a slot is freed as its request ends).
async fn no_slot_taken(w: &Proc) {
    let start = Instant::now();
    loop {
        let n = metric(w, "rngd_pd_worker_in_flight").await;
        if n == 0.0 {
            return;
        }
        assert!(
            start.elapsed() < BOUND,
            "{}: {n} requests still in flight",
            w.name
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// TCP sockets of the relay port on this host, from `/proc/net/tcp`:
/// (connections whose remote end is the relay, largest receive queue of the
/// relay's own connections).
fn relay_sockets(relay: &Proc) -> (usize, u64) {
    let port: u16 = relay
        .addr
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .expect("relay port");
    let text = std::fs::read_to_string("/proc/net/tcp").expect("reading /proc/net/tcp");
    let port_of = |a: &str| {
        a.rsplit(':')
            .next()
            .and_then(|p| u16::from_str_radix(p, 16).ok())
    };
    let (mut clients, mut rx_max) = (0, 0);
    for line in text.lines().skip(1) {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 5 || f[3] != "01" {
            continue; // not ESTABLISHED
        }
        let rx = f[4]
            .split(':')
            .nth(1)
            .and_then(|q| u64::from_str_radix(q, 16).ok())
            .unwrap_or(0);
        if port_of(f[1]) == Some(port) {
            rx_max = rx_max.max(rx);
        }
        if port_of(f[2]) == Some(port) {
            clients += 1;
        }
    }
    (clients, rx_max)
}

/// Keys the prefill worker has started pushing blobs of (its `AIRM_KV_TCP_LOG=1` lines).
fn pushed_keys(prefill: &Proc) -> Vec<String> {
    let mut keys = Vec::new();
    for line in prefill.log_text().lines() {
        if !line.contains("tcp: KV blob") || !line.contains("push") {
            continue;
        }
        // The event's own field (the span carries the same value).
        let Some(i) = line.rfind(" request_id=") else {
            continue;
        };
        let key: String = line[i + " request_id=".len()..]
            .trim_start_matches('"')
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '-' || *c == '_')
            .collect();
        if !key.is_empty() && !keys.contains(&key) {
            keys.push(key);
        }
    }
    keys
}

#[tokio::test]
async fn decode_killed_mid_pull_leaves_no_relay_entry_and_a_fresh_decode_serves() {
    let _serial = SERIAL.lock().await;
    let mut env = Env::new();
    let relay = env.start_relay();
    let relay_stats = stats_client(&relay);
    let prefill = env.worker("prefill", "prefill", &[]);
    let decode = env.worker("decode-1", "decode", &[]);

    // Control: a normal request, which also leaves the decode worker a
    // pooled, authenticated relay connection (so its next pull's GETs go
    // straight onto the relay's socket).
    let want = pd(&prefill, &decode, "control-1").await;
    relay_empties(&relay_stats, BOUND, "after the control request").await;
    let before = stats(&relay_stats).await;

    let params = push(&prefill, "pulled-by-a-dying-decode").await;
    assert!(
        stats(&relay_stats).await.keys >= 1,
        "the cache is in the relay"
    );
    let (clients_before, _) = relay_sockets(&relay);
    let stopped = Stopped::stop(&relay);
    let url = decode.url("/v1/completions");
    let body = decode_body(params);
    let pull = tokio::spawn(async move { post(&url, &body, "decode-killed-mid-pull").await });
    eventually(BOUND, "the decode worker's pull reaches the relay", || {
        let (clients, rx) = relay_sockets(&relay);
        rx > 0 || clients > clients_before
    })
    .await;
    decode.kill();
    // The client of the killed worker gets an error at once, not a hang.
    let started = Instant::now();
    let res = tokio::time::timeout(BOUND, pull)
        .await
        .expect("the client of a killed decode worker hung")
        .unwrap();
    assert!(
        res.is_err(),
        "a killed worker cannot have answered: {res:?}"
    );
    eprintln!(
        "client of the killed decode: {} after {:?}",
        res.unwrap_err(),
        started.elapsed()
    );
    drop(stopped);

    // The killed pull released nothing: the cache is still held, then expires.
    let held = stats(&relay_stats).await;
    assert!(
        held.keys >= 1,
        "the decode was killed before its release, so the relay still holds the cache: {held:?}"
    );
    let after = relay_empties(&relay_stats, BOUND, "after the TTL").await;
    assert!(
        after.expired > before.expired,
        "expired by the TTL: {after:?}"
    );

    // A fresh decode worker serves a normal PD request, and nothing leaks.
    let decode = env.worker("decode-2", "decode", &[]);
    assert_eq!(pd(&prefill, &decode, "after-kill").await, want);
    relay_empties(&relay_stats, BOUND, "after the request that follows").await;
    no_slot_taken(&prefill).await;
    no_slot_taken(&decode).await;
}

#[tokio::test]
async fn prefill_killed_mid_push_leaves_no_relay_entry_and_decode_errs_clearly() {
    let _serial = SERIAL.lock().await;
    let mut env = Env::new();
    let relay = env.start_relay();
    let relay_stats = stats_client(&relay);
    let logged = [("AIRM_KV_TCP_LOG", "1".to_string())];
    let prefill = env.worker("prefill-1", "prefill", &logged);
    let decode = env.worker("decode", "decode", &[]);

    // Control, which also warms the prefill worker's relay connection.
    let control = push(&prefill, "control-prefill").await;
    let control_key = control["kv_handle"]["request_id"]
        .as_str()
        .unwrap()
        .to_string();
    let want = ids(&ok_json(&decode, &decode_body(control.clone()), "control").await);
    relay_empties(&relay_stats, BOUND, "after the control request").await;
    assert_eq!(
        pushed_keys(&prefill),
        vec![control_key.clone()],
        "log parsed"
    );

    // Stop the relay, let the prefill run until it is writing blobs, kill it.
    let stopped = Stopped::stop(&relay);
    let url = prefill.url("/v1/completions");
    let push_req =
        tokio::spawn(async move { post(&url, &prefill_body(), "prefill-killed-mid-push").await });
    let mut key = None;
    eventually(BOUND * 4, "the prefill worker starts pushing", || {
        key = pushed_keys(&prefill)
            .into_iter()
            .find(|k| *k != control_key);
        key.is_some()
    })
    .await;
    let key = key.unwrap();
    prefill.kill();
    let res = tokio::time::timeout(BOUND, push_req)
        .await
        .expect("the client of a killed prefill worker hung")
        .unwrap();
    assert!(
        res.is_err(),
        "a killed worker cannot have answered: {res:?}"
    );
    drop(stopped);

    // Whatever of the push reached the relay is gone after the TTL: the
    // partial PUT is discarded, complete blobs expire.
    let s = stats(&relay_stats).await;
    eprintln!("relay right after the killed push: {s:?}");
    let blob_count = control["kv_handle"]["blobs"].as_array().unwrap().len();
    assert!(
        s.blobs < blob_count,
        "the prefill was killed mid-push: the relay never had all {blob_count} blobs: {s:?}"
    );
    relay_empties(&relay_stats, BOUND, "after the TTL").await;

    // The decode side, asked for exactly the cache the dead prefill was
    // pushing (its key, in a handle signed with the deployment key as the
    // prefill would have), finds nothing: a clear error naming the transport
    // and the request, within its pull timeout, not a hang.
    let mut params = control.clone();
    let mut handle: KvHandle = serde_json::from_value(params["kv_handle"].clone()).unwrap();
    handle.request_id = key.clone();
    let first_token = params["first_token"].as_u64().unwrap() as u32;
    let prompt: Vec<u32> = params["prompt_token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect();
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
    let expires = now.as_millis() as u64 + 60_000;
    let secret = Secret::new(KV_SECRET.as_bytes().to_vec()).unwrap();
    let signer = rngd_worker::HandleSigner::new(&secret.derive(b"rngd-pd worker kv handles"));
    params["kv_handle"] = serde_json::to_value(&handle).unwrap();
    params["kv_handle_expires_ms"] = json!(expires);
    // The control answer's seed is signed with it (no logprobs were asked).
    let claims = rngd_worker::handles::Claims {
        seed: params["seed"].as_u64(),
        first_token_logprobs: None,
        cached_tokens: params["cached_tokens"].as_u64().map(|c| c as u32),
        weight_version: params["weight_version"].as_str(),
    };
    params["kv_handle_signature"] =
        json!(signer.sign_with(&handle, first_token, &prompt, expires, &claims));
    let rid = "decode-of-a-dead-push";
    let started = Instant::now();
    let (status, text) = tokio::time::timeout(
        BOUND,
        post(&decode.url("/v1/completions"), &decode_body(params), rid),
    )
    .await
    .expect("the decode of a dead push hung")
    .unwrap();
    let took = started.elapsed();
    eprintln!("decode of the dead push: {status} after {took:?}: {text}");
    assert_eq!(
        status, 410,
        "a cache that never arrived is refused at once (kv_unavailable): {text}"
    );
    assert!(text.contains("kv_unavailable"), "{text}");
    assert!(
        text.contains("tcp") && text.contains(rid),
        "names the transport and the request: {text}"
    );
    assert!(
        took < Duration::from_millis(PULL_TIMEOUT_MS) + Duration::from_secs(10),
        "within the pull timeout ({PULL_TIMEOUT_MS} ms): {took:?}"
    );
    relay_empties(&relay_stats, BOUND, "after the failed decode").await;
    no_slot_taken(&decode).await;

    // A fresh prefill worker and the same decode worker serve a normal request.
    let prefill = env.worker("prefill-2", "prefill", &[]);
    assert_eq!(pd(&prefill, &decode, "after-kill").await, want);
    relay_empties(&relay_stats, BOUND, "after the request that follows").await;
    no_slot_taken(&prefill).await;
    no_slot_taken(&decode).await;
}
