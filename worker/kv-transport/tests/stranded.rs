//! Stranded KV: bytes a transport holds for a handle no decode claimed
//! (pulled or released) although published longer ago than the claim
//! window. On `shm` (a pushed file and a request written in place into an
//! arena slot) and in the relay of `tcp`: KV left unclaimed shows up after
//! the window with its payload's size (never the pointer file's), KV pulled
//! at once never does, and the figure drops to 0 once the TTL sweep has
//! freed it. Every wait polls with a deadline.

mod common;

use std::path::Path;
use std::time::Duration;

use common::{TestRelay, eventually, ttl_cfg};
use rngd_kv_transport::relay::RelayConfig;
use rngd_kv_transport::shm::ShmTransport;
use rngd_kv_transport::{
    KvHandle, KvLayout, KvTransport, Reserved, SinkShape, TransportConfig, conformance,
};
use rngd_kv_wire::WIRE_TRIMMED;
use rngd_kv_wire::sink::fill_from;

const PULL_TIMEOUT: Duration = Duration::from_secs(10);
const TTL: Duration = Duration::from_secs(3);
const WINDOW: Duration = Duration::from_secs(1);
/// Generous bound of every poll (the window and the TTL plus a loaded machine).
const WITHIN: Duration = Duration::from_secs(20);

fn shm_cfg(root: &Path, slots: usize) -> TransportConfig {
    TransportConfig {
        shm_root: root.to_path_buf(),
        shm_ttl: TTL,
        claim_window: WINDOW,
        shm_slots: slots,
        ..TransportConfig::default()
    }
}

/// Sweeps `t` until `done(stranded bytes, files held)` holds; panics after [`WITHIN`].
async fn shm_until(t: &ShmTransport, what: &str, done: impl Fn(u64, usize) -> bool) {
    let until = tokio::time::Instant::now() + WITHIN;
    loop {
        t.sweep().unwrap();
        let (stranded, held) = (t.stranded_bytes(), t.held_files().unwrap());
        if done(stranded, held) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < until,
            "{what}: not within {WITHIN:?} (stranded {stranded} bytes, {held} files)"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// One request left unclaimed by `left`, one pulled at once by the decode
/// side: the left one's bytes are stranded after the window, then freed.
async fn left_and_taken(
    prefill: &ShmTransport,
    decode: &ShmTransport,
    left: KvHandle,
    taken: KvHandle,
) {
    let bytes = left.total_bytes();
    assert!(bytes > 0);
    decode.pull(&taken, PULL_TIMEOUT).await.unwrap();
    // Fresh: nothing stranded yet (the window has not passed).
    prefill.sweep().unwrap();
    assert_eq!(prefill.stranded_bytes(), 0, "younger than the window");
    assert_eq!(KvTransport::stranded_bytes(prefill), Some(0));
    shm_until(prefill, "the unclaimed request stranded", |s, _| s == bytes).await;
    // Both sides of the root see the same files.
    decode.sweep().unwrap();
    assert_eq!(KvTransport::stranded_bytes(decode), Some(bytes));
    shm_until(prefill, "the TTL sweep freed it", |s, held| {
        s == 0 && held == 0
    })
    .await;
    assert_eq!(prefill.busy_slots(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unclaimed_shm_push_is_stranded_after_the_window_until_the_ttl() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("kv");
    let (a, b) = (
        ShmTransport::new(&shm_cfg(&root, 0)).unwrap(),
        ShmTransport::new(&shm_cfg(&root, 0)).unwrap(),
    );
    let left = a
        .push(conformance::payload("left", 1, 3, 100_000))
        .await
        .unwrap();
    let taken = a
        .push(conformance::payload("taken", 2, 2, 70_000))
        .await
        .unwrap();
    assert_eq!(left.total_bytes(), 300_000);
    left_and_taken(&a, &b, left, taken).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unclaimed_shm_slot_counts_its_blobs_not_its_pointer_file() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("kv");
    let (a, b) = (
        ShmTransport::new(&shm_cfg(&root, 2)).unwrap(),
        ShmTransport::new(&shm_cfg(&root, 2)).unwrap(),
    );
    let shape = SinkShape {
        layout: KvLayout::LLAMA31_8B_S512,
        tokens: 3,
        wire: WIRE_TRIMMED,
    };
    let mut handles = Vec::new();
    for (n, id) in ["left-in-place", "taken-in-place"].into_iter().enumerate() {
        let len = shape.blob_bytes().unwrap();
        let blobs: Vec<_> = (0..shape.layout.blob_count())
            .map(|i| conformance::pattern(n as u64 * 1000 + i as u64, len))
            .collect();
        let Reserved { mut sink, slot } = a.reserve(id, shape).await.unwrap().expect("a free slot");
        fill_from(sink.as_mut(), &blobs).unwrap();
        drop(sink);
        handles.push(slot.publish().await.unwrap());
    }
    let pointer = std::fs::metadata(a.path_of("left-in-place").unwrap())
        .unwrap()
        .len();
    assert!(
        handles[0].total_bytes() > pointer,
        "the slot's bytes, not the pointer's"
    );
    let taken = handles.pop().unwrap();
    let left = handles.pop().unwrap();
    left_and_taken(&a, &b, left, taken).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_counts_blobs_nobody_took_after_the_window_until_the_ttl() {
    let relay = TestRelay::start(RelayConfig {
        claim_window: WINDOW,
        ..ttl_cfg(TTL)
    })
    .await;
    let t = relay.authed();
    assert_eq!(KvTransport::stranded_bytes(&t), None, "the relay holds it");
    let left = t
        .push(conformance::payload("left", 1, 3, 100_000))
        .await
        .unwrap();
    let taken = t
        .push(conformance::payload("taken", 2, 2, 70_000))
        .await
        .unwrap();
    t.pull(&taken, PULL_TIMEOUT).await.unwrap();
    t.release(&taken).await.unwrap();
    let s = relay.stats().await;
    assert_eq!((s.keys, s.stranded_bytes), (1, 0), "{s:?}");
    let bytes = left.total_bytes();
    eventually(&relay, WITHIN, "the unclaimed request stranded", |s| {
        s.stranded_bytes == bytes
    })
    .await;
    let s = eventually(&relay, WITHIN, "the TTL sweep freed it", |s| {
        s.stranded_bytes == 0 && s.keys == 0
    })
    .await;
    assert_eq!(s.expired, 1, "{s:?}");
    relay.stop().await;
}

#[test]
fn a_relay_window_is_never_longer_than_its_ttl() {
    let cfg = rngd_kv_transport::relay::RelayOptions {
        ttl_s: 2.0,
        claim_window_s: 30.0,
        insecure_no_auth: true,
        ..Default::default()
    }
    .config()
    .unwrap();
    assert_eq!(cfg.claim_window, Duration::from_secs(2));
    let bad = rngd_kv_transport::relay::RelayOptions {
        claim_window_s: 0.0,
        insecure_no_auth: true,
        ..Default::default()
    }
    .config()
    .unwrap_err()
    .to_string();
    assert!(bad.contains("--claim-window-s"), "{bad}");
}
