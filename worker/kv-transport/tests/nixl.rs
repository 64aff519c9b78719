//! The `nixl-ucx` transport against the real NIXL runtime (the `nixl-cu12`
//! wheel `tests/setup.sh` installs; without it these tests fail, they do not
//! skip): the conformance suite with two agents in this process (a prefill
//! and a decode side, UCX between them) and an in-process relay for the
//! descriptors; slots freed by the READ's notification; a slot no decode
//! READ counted as stranded after the claim window until its TTL; a clear
//! error when the runtime is missing.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::{TestRelay, busy, client_cfg, ttl_cfg};
use rngd_kv_transport::conformance::{self, Harness};
use rngd_kv_transport::nixl::descriptor::{self, Location};
use rngd_kv_transport::nixl::{NixlUcxTransport, runtime};
use rngd_kv_transport::{KvError, KvHandle, KvTransport, TransportConfig};

const TTL: Duration = Duration::from_millis(400);

fn cfg() -> TransportConfig {
    TransportConfig {
        tcp_ttl: TTL,
        ucx_pool_mb: 256,
        ..client_cfg()
    }
}

struct NixlHarness {
    relay: Arc<TestRelay>,
    /// The two agents: clients alternate between them, so a push on one is
    /// pulled by the other over UCX.
    sides: [NixlUcxTransport; 2],
    next: AtomicUsize,
}

#[async_trait::async_trait]
impl Harness for NixlHarness {
    fn make(&self) -> Arc<dyn KvTransport> {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % 2;
        Arc::new(self.sides[i].clone())
    }

    async fn held(&self) -> Result<usize, KvError> {
        let relay = busy(&self.relay.authed().stats().await?);
        Ok(relay + self.sides[0].held() + self.sides[1].held())
    }

    async fn corrupt(&self, handle: &KvHandle, index: usize) -> Result<(), KvError> {
        assert!(
            self.sides.iter().any(|s| s.corrupt_slot(handle, index)),
            "no side holds the slot of {}",
            handle.request_id
        );
        Ok(())
    }

    fn ttl(&self) -> Duration {
        TTL
    }

    async fn restart(&self) -> Result<bool, KvError> {
        self.relay.restart().await;
        Ok(true)
    }
}

fn side(relay: &TestRelay) -> NixlUcxTransport {
    NixlUcxTransport::with_relay(relay.addr.to_string(), &cfg())
        .unwrap_or_else(|e| panic!("the nixl-ucx transport must start here: {e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nixl_ucx_passes_the_conformance_suite() {
    let relay = TestRelay::start(ttl_cfg(TTL)).await;
    let h = NixlHarness {
        sides: [side(&relay), side(&relay)],
        relay,
        next: AtomicUsize::new(0),
    };
    let rt = runtime::loaded().expect("runtime loaded");
    eprintln!("nixl-ucx: runtime {} ({})", rt.capi.display(), rt.found_by);
    let report = conformance::run_all(&h)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    for (check, note) in &report.passed {
        eprintln!("nixl-ucx conformance: {check}: {note}");
    }
    assert_eq!(report.passed.len(), 9, "{report:?}");
    assert!(report.not_applicable.is_empty());
    h.relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_read_notification_frees_the_prefill_slot_before_any_release() {
    let relay = TestRelay::start(ttl_cfg(Duration::from_secs(60))).await;
    let cfg = TransportConfig {
        tcp_ttl: Duration::from_secs(60),
        ..cfg()
    };
    let prefill = NixlUcxTransport::with_relay(relay.addr.to_string(), &cfg).unwrap();
    let decode = NixlUcxTransport::with_relay(relay.addr.to_string(), &cfg).unwrap();
    let p = conformance::payload("notif-frees", 3, 6, 100_000);
    let want = p.blobs.clone();
    let handle = prefill.push(p).await.unwrap();
    assert_eq!(prefill.slots(), 1);
    assert!(
        handle.location.starts_with(&relay.addr.to_string()),
        "{}",
        handle.location
    );
    let got = decode.pull(&handle, Duration::from_secs(10)).await.unwrap();
    assert_eq!(got, want);
    // No release yet: only the READ's notification can free the slot.
    let started = Instant::now();
    while prefill.slots() > 0 {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "the prefill slot was not freed by the READ's notification"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    assert_eq!(decode.held(), 0, "the decode side keeps nothing");
    decode.release(&handle).await.unwrap();
    assert_eq!(relay.stats().await.keys, 0, "the descriptor is gone");
    relay.stop().await;
}

/// Polls `t`'s stranded bytes until `done` holds; panics after 20 s.
async fn stranded_until(t: &NixlUcxTransport, what: &str, done: impl Fn(u64) -> bool) {
    let started = Instant::now();
    loop {
        let v = t.stranded_bytes().expect("nixl-ucx counts its slots");
        if done(v) {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "{what}: stranded {v} bytes"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_no_decode_read_is_stranded_after_the_window_until_the_ttl() {
    let ttl = Duration::from_secs(3);
    let relay = TestRelay::start(ttl_cfg(ttl)).await;
    let cfg = TransportConfig {
        tcp_ttl: ttl,
        claim_window: Duration::from_millis(500),
        ..cfg()
    };
    let prefill = NixlUcxTransport::with_relay(relay.addr.to_string(), &cfg).unwrap();
    let decode = NixlUcxTransport::with_relay(relay.addr.to_string(), &cfg).unwrap();
    let taken = prefill
        .push(conformance::payload("stranded-taken", 1, 2, 50_000))
        .await
        .unwrap();
    let left = prefill
        .push(conformance::payload("stranded-left", 2, 3, 100_000))
        .await
        .unwrap();
    decode.pull(&taken, Duration::from_secs(10)).await.unwrap();
    decode.release(&taken).await.unwrap();
    assert_eq!(prefill.stranded_bytes(), Some(0), "younger than the window");
    stranded_until(&prefill, "the unread slot stranded", |v| {
        v == left.total_bytes()
    })
    .await;
    assert_eq!(
        decode.stranded_bytes(),
        Some(0),
        "the decode side holds none"
    );
    stranded_until(&prefill, "the TTL freed it", |v| v == 0).await;
    assert_eq!(prefill.slots(), 0);
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_descriptor_not_named_by_the_handle_is_refused() {
    let relay = TestRelay::start(ttl_cfg(Duration::from_secs(60))).await;
    let a = side(&relay);
    let b = side(&relay);
    let one = a
        .push(conformance::payload("swap-one", 1, 2, 4096))
        .await
        .unwrap();
    let two = a
        .push(conformance::payload("swap-two", 2, 2, 4096))
        .await
        .unwrap();
    // `one`'s handle naming another descriptor (same place and size, other
    // SHA-256): what the relay holds is not what the signed handle names.
    let mut loc = Location::parse(&one.location).expect("a nixl-ucx location");
    loc.sha256 = descriptor::sha256_hex(b"some other descriptor");
    let mut forged = one.clone();
    forged.location = loc.encode();
    let err = b
        .pull(&forged, Duration::from_secs(5))
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("nixl-ucx") && err.contains("signed handle"),
        "{err}"
    );
    // `one`'s handle with `two`'s location: the relay copy's size or CRC-32
    // gives it away.
    let mut swapped = one.clone();
    swapped.location = two.location.clone();
    let err = b.pull(&swapped, Duration::from_secs(5)).await.unwrap_err();
    assert!(
        matches!(err, KvError::Crc { .. } | KvError::Protocol { .. })
            && err.to_string().contains("nixl-ucx"),
        "{err}"
    );
    let got = b.pull(&one, Duration::from_secs(5)).await.unwrap();
    assert_eq!(got.len(), 2);
    for h in [&one, &two] {
        a.release(h).await.unwrap();
    }
    assert_eq!(a.slots(), 0);
    relay.stop().await;
}

#[test]
fn a_missing_runtime_is_named_at_startup() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = TransportConfig {
        nixl_lib_dir: Some(dir.path().to_path_buf()),
        tcp_addr: Some("127.0.0.1:1".into()),
        ..client_cfg()
    };
    let err = runtime::locate(&cfg).unwrap_err().to_string();
    assert!(
        err.contains("nixl-ucx")
            && err.contains("libnixl_capi.so")
            && err.contains(&dir.path().display().to_string()),
        "{err}"
    );
    // And through the registry, as a worker starts it (unless this process
    // already loaded a runtime, which then stays).
    if runtime::loaded().is_none() {
        let err = rngd_kv_transport::registry::by_name("nixl-ucx", &cfg)
            .err()
            .expect("no runtime, no transport")
            .to_string();
        assert!(err.contains("libnixl_capi.so"), "{err}");
    }
    // Without a relay address: named too.
    let err = NixlUcxTransport::new(&TransportConfig::default())
        .expect_err("no relay, no transport")
        .to_string();
    assert!(err.contains("AIRM_KV_TCP_ADDR"), "{err}");
}

const PEER: &str = env!("CARGO_BIN_EXE_rngd-kv-peer");
const PEER_SECRET: &str = "test-relay-secret-0123456789abcdef";

/// `rngd-kv-peer push --transport nixl-ucx` against `relay`: the child
/// (holding its slot until stdin closes) and the handle it printed.
fn peer_push(relay: &TestRelay, id: &str) -> (std::process::Child, KvHandle) {
    use std::io::BufRead;
    let mut child = std::process::Command::new(PEER)
        .args([
            "push",
            "--transport",
            "nixl-ucx",
            "--addr",
            &relay.addr.to_string(),
        ])
        .args([
            "--id",
            id,
            "--seed",
            "5",
            "--blobs",
            "8",
            "--blob-len",
            "65536",
        ])
        .args(["--pool-mb", "16", "--ttl-ms", &TTL.as_millis().to_string()])
        .env("AIRM_KV_TCP_SECRET", PEER_SECRET)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("starting rngd-kv-peer");
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.as_mut().unwrap())
        .read_line(&mut line)
        .unwrap();
    let handle =
        serde_json::from_str(line.trim()).unwrap_or_else(|e| panic!("peer printed {line:?}: {e}"));
    (child, handle)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_killed_after_publishing_is_a_clear_error_and_nothing_leaks() {
    let relay = TestRelay::start(ttl_cfg(TTL)).await;
    assert_eq!(
        common::secret(),
        rngd_kv_transport::relay::Secret::parse(PEER_SECRET).unwrap()
    );
    let decode = side(&relay);
    // Control: a live prefill process is read byte-exact over UCX.
    let (mut live, handle) = peer_push(&relay, "peer-live");
    let got = decode.pull(&handle, Duration::from_secs(10)).await.unwrap();
    assert_eq!(got, conformance::payload("peer-live", 5, 8, 65536).blobs);
    decode.release(&handle).await.unwrap();
    drop(live.stdin.take());
    let out = live.wait_with_output().unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "slots 0",
        "the READ freed the slot"
    );
    // SIGKILLed after publishing: its descriptor is in the relay, its arena gone.
    let (mut dead, handle) = peer_push(&relay, "peer-killed");
    dead.kill().unwrap();
    dead.wait().unwrap();
    let started = Instant::now();
    let err = decode
        .pull(&handle, Duration::from_secs(2))
        .await
        .expect_err("the prefill process is gone");
    assert!(err.to_string().contains("nixl-ucx"), "{err}");
    assert!(
        matches!(
            err,
            KvError::ConnectionLost { .. } | KvError::Timeout { .. }
        ),
        "{err}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "error after {:?}",
        started.elapsed()
    );
    decode.release(&handle).await.unwrap();
    // The decode side keeps nothing (its extent comes back after the quarantine).
    tokio::time::sleep(rngd_kv_transport::nixl::QUARANTINE + Duration::from_millis(100)).await;
    assert_eq!(decode.held(), 0);
    tokio::time::sleep(TTL * 2).await;
    assert_eq!(
        busy(&relay.stats().await),
        0,
        "the relay holds nothing after the TTL"
    );
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_killed_before_its_read_leaks_no_prefill_slot_after_the_ttl() {
    let relay = TestRelay::start(ttl_cfg(TTL)).await;
    let prefill = side(&relay);
    let handle = prefill
        .push(conformance::payload("decode-killed", 9, 4, 100_000))
        .await
        .unwrap();
    assert_eq!(prefill.slots(), 1);
    // A decode process waiting for a descriptor (before any READ), SIGKILLed.
    let mut waiting = handle.clone();
    waiting.request_id = "decode-killed-late".into();
    let mut decode = std::process::Command::new(PEER)
        .args([
            "pull",
            "--transport",
            "nixl-ucx",
            "--addr",
            &relay.addr.to_string(),
        ])
        .args(["--seed", "9", "--pool-mb", "16", "--timeout-ms", "30000"])
        .args(["--handle", &serde_json::to_string(&waiting).unwrap()])
        .env("AIRM_KV_TCP_SECRET", PEER_SECRET)
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    decode.kill().unwrap();
    decode.wait().unwrap();
    let started = Instant::now();
    while prefill.held() > 0 || busy(&relay.stats().await) > 0 {
        assert!(
            started.elapsed() < TTL + Duration::from_secs(10),
            "prefill holds {} slots, relay {} objects after the TTL",
            prefill.held(),
            busy(&relay.stats().await)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let err = side(&relay)
        .pull(&handle, Duration::from_millis(200))
        .await
        .unwrap_err();
    assert!(
        matches!(err, KvError::NotFound { .. }) && err.to_string().contains("nixl-ucx"),
        "{err}"
    );
    relay.stop().await;
}
