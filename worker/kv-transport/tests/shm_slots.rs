//! The `shm` transport's slot arena (the one-copy path, `reserve`): a
//! request written in place comes back byte-exact in both wires and frees
//! its slot when its reader lets go; a room given up, published unfinished,
//! released unread or left past its TTL frees its slot and leaves no file;
//! a full arena falls back to a push; a flipped byte in a slot is a CRC
//! error; a stale pointer never reads another request's bytes, and a
//! pointer naming a planted arena (a symlink, a path) is refused; a full
//! tmpfs is found when a slot is taken (the caller pushes, and the push
//! fails clearly), never a fault while writing. The mount needs root (CI
//! runs as root, as `shm_faults.rs`).

mod common;

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use bytes::Bytes;
use common::tmpfs::TinyTmpfs;
use rngd_kv_transport::shm::{ARENA_EXT, ShmTransport};
use rngd_kv_transport::{
    KvError, KvHandle, KvLayout, KvTransport, Reserved, SinkShape, TransportConfig, conformance,
};
use rngd_kv_wire::sink::fill_from;
use rngd_kv_wire::{WIRE_FULL, WIRE_TRIMMED};

const PULL_TIMEOUT: Duration = Duration::from_secs(30);

fn cfg(root: &Path, slots: usize) -> TransportConfig {
    TransportConfig {
        shm_root: root.to_path_buf(),
        shm_slots: slots,
        ..TransportConfig::default()
    }
}

/// A request of `tokens` positions of the Llama-3.1-8B layout in `wire`.
fn shape(tokens: usize, wire: u32) -> SinkShape {
    SinkShape {
        layout: KvLayout::LLAMA31_8B_S512,
        tokens,
        wire,
    }
}

fn blobs_for(s: SinkShape, seed: u64) -> Vec<Bytes> {
    let len = s.blob_bytes().unwrap();
    (0..s.layout.blob_count())
        .map(|i| conformance::pattern(seed * 1000 + i as u64, len))
        .collect()
}

/// A prefill's and a decode's transport on one root, with `slots` slots each.
fn pair(root: &Path, slots: usize) -> (ShmTransport, ShmTransport) {
    (
        ShmTransport::new(&cfg(root, slots)).unwrap(),
        ShmTransport::new(&cfg(root, slots)).unwrap(),
    )
}

async fn room(t: &ShmTransport, id: &str, s: SinkShape) -> Reserved {
    t.reserve(id, s)
        .await
        .expect("reserve")
        .expect("a free slot")
}

/// Writes `blobs` in place under `id` and publishes them.
async fn hand_over(t: &ShmTransport, id: &str, s: SinkShape, blobs: &[Bytes]) -> KvHandle {
    let Reserved { mut sink, slot } = room(t, id, s).await;
    fill_from(sink.as_mut(), blobs).unwrap();
    drop(sink);
    slot.publish().await.expect("publish")
}

/// The arena file of `root` and where its slots start.
fn arena_of(root: &Path) -> (PathBuf, u64) {
    let path = std::fs::read_dir(root)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == ARENA_EXT))
        .expect("an arena file");
    let f = std::fs::File::open(&path).unwrap();
    let mut at = [0u8; 8];
    f.read_exact_at(&mut at, 24).unwrap();
    (path, u64::from_le_bytes(at))
}

#[tokio::test]
async fn requests_written_in_place_round_trip_and_free_their_slots() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("kv");
    let (a, b) = pair(&root, 2);
    for (n, (tokens, wire)) in [(512, WIRE_FULL), (100, WIRE_TRIMMED), (1, WIRE_TRIMMED)]
        .into_iter()
        .enumerate()
    {
        let s = shape(tokens, wire);
        let want = blobs_for(s, n as u64);
        let h = hand_over(&a, &format!("r{n}"), s, &want).await;
        assert_eq!(
            (h.tokens, h.wire, h.transport.as_str()),
            (tokens, wire, "shm")
        );
        assert_eq!(a.busy_slots(), 1, "published");
        let got = b.pull(&h, PULL_TIMEOUT).await.unwrap();
        assert_eq!(got, want, "request {n} byte-exact");
        assert_eq!(a.held_files().unwrap(), 0, "the reader removed the pointer");
        assert_eq!(a.busy_slots(), 1, "still lent to the reader");
        b.release(&h).await.unwrap();
        assert_eq!(
            a.busy_slots(),
            1,
            "a release leaves a slot being read alone"
        );
        drop(got);
        assert_eq!(a.busy_slots(), 0, "freed with the reader's last blob");
    }
    drop((a, b));
    assert_eq!(
        std::fs::read_dir(&root).unwrap().count(),
        0,
        "the arena goes with its owner"
    );
}

#[tokio::test]
async fn rooms_given_up_or_unfinished_free_their_slots() {
    let dir = tempfile::tempdir().unwrap();
    let t = ShmTransport::new(&cfg(&dir.path().join("kv"), 2)).unwrap();
    let s = shape(10, WIRE_TRIMMED);
    // Dropped half-written.
    let Reserved { mut sink, slot } = room(&t, "gone", s).await;
    sink.blob_mut(0).fill(1);
    drop((sink, slot));
    assert_eq!((t.busy_slots(), t.held_files().unwrap()), (0, 0));
    // A blob never sealed.
    let Reserved { mut sink, slot } = room(&t, "unsealed", s).await;
    for i in 1..s.layout.blob_count() {
        sink.seal(i, 0);
    }
    drop(sink);
    let err = slot.publish().await.unwrap_err();
    assert!(
        err.to_string().contains("blob 0 was never written"),
        "{err}"
    );
    assert_eq!((t.busy_slots(), t.held_files().unwrap()), (0, 0));
    // Published while the sink may still write.
    let Reserved { mut sink, slot } = room(&t, "early", s).await;
    fill_from(sink.as_mut(), &blobs_for(s, 3)).unwrap();
    let err = slot.publish().await.unwrap_err();
    assert!(err.to_string().contains("sink may still write"), "{err}");
    drop(sink);
    assert_eq!((t.busy_slots(), t.held_files().unwrap()), (0, 0));
    // A released, unread request frees its slot and its pointer.
    let h = hand_over(&t, "unread", s, &blobs_for(s, 4)).await;
    assert_eq!((t.busy_slots(), t.held_files().unwrap()), (1, 1));
    t.release(&h).await.unwrap();
    assert_eq!((t.busy_slots(), t.held_files().unwrap()), (0, 0));
    let err = t.pull(&h, Duration::from_millis(50)).await.unwrap_err();
    assert!(matches!(err, KvError::NotFound { .. }), "{err}");
}

#[tokio::test]
async fn a_full_arena_falls_back_to_a_push() {
    let dir = tempfile::tempdir().unwrap();
    let t = ShmTransport::new(&cfg(&dir.path().join("kv"), 1)).unwrap();
    let s = shape(10, WIRE_TRIMMED);
    let held = room(&t, "first", s).await;
    assert!(
        t.reserve("second", s).await.unwrap().is_none(),
        "no free slot"
    );
    drop(held);
    assert!(t.reserve("third", s).await.unwrap().is_some());
    // No arena at all with zero slots.
    let none = ShmTransport::new(&cfg(&dir.path().join("kv0"), 0)).unwrap();
    assert!(none.reserve("x", s).await.unwrap().is_none());
}

#[tokio::test]
async fn unread_requests_are_swept_after_the_ttl() {
    let dir = tempfile::tempdir().unwrap();
    let c = TransportConfig {
        shm_ttl: Duration::from_millis(100),
        ..cfg(&dir.path().join("kv"), 2)
    };
    let t = ShmTransport::new(&c).unwrap();
    let s = shape(10, WIRE_TRIMMED);
    hand_over(&t, "left", s, &blobs_for(s, 5)).await;
    assert_eq!(t.busy_slots(), 1);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while t.busy_slots() + t.held_files().unwrap() > 0 {
        assert!(std::time::Instant::now() < deadline, "not swept");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The live arena itself stays (its owner touches it on every sweep).
    tokio::time::sleep(Duration::from_millis(300)).await;
    arena_of(&dir.path().join("kv"));
    assert!(t.reserve("again", s).await.unwrap().is_some());
}

#[tokio::test]
async fn a_flipped_byte_in_a_slot_is_a_crc_error_and_frees_it() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("kv");
    let (a, b) = pair(&root, 1);
    let s = shape(100, WIRE_TRIMMED);
    let h = hand_over(&a, "flip", s, &blobs_for(s, 6)).await;
    let (arena, slots_at) = arena_of(&root);
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&arena)
        .unwrap();
    let at = slots_at + h.blobs[0].len * 3 + 17;
    let mut byte = [0u8; 1];
    f.read_exact_at(&mut byte, at).unwrap();
    byte[0] ^= 0x40;
    f.write_all_at(&byte, at).unwrap();
    let err = b.pull(&h, PULL_TIMEOUT).await.unwrap_err();
    assert!(matches!(err, KvError::Crc { .. }), "{err}");
    assert_eq!(a.busy_slots(), 0, "the bad slot is freed");
    b.release(&h).await.unwrap();
    assert_eq!(a.held_files().unwrap(), 0);
}

#[tokio::test]
async fn a_stale_pointer_never_reads_the_next_request() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("kv");
    let (a, b) = pair(&root, 1);
    let s = shape(10, WIRE_TRIMMED);
    let old = hand_over(&a, "old", s, &blobs_for(s, 7)).await;
    let pointer = std::fs::read(a.path_of("old").unwrap()).unwrap();
    drop(b.pull(&old, PULL_TIMEOUT).await.unwrap());
    // The one slot now holds another request; the old pointer comes back.
    let want = blobs_for(s, 8);
    let new = hand_over(&a, "new", s, &want).await;
    let replay = a.path_of("old").unwrap();
    std::fs::write(&replay, &pointer).unwrap();
    std::fs::set_permissions(&replay, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let err = b.pull(&old, PULL_TIMEOUT).await.unwrap_err();
    assert!(err.to_string().contains("no longer holds"), "{err}");
    b.release(&old).await.unwrap();
    assert_eq!(a.busy_slots(), 1, "a stale release leaves the new request");
    assert_eq!(b.pull(&new, PULL_TIMEOUT).await.unwrap(), want);
}

/// A real ENOSPC: the slot's pages are allocated when it is taken, so a
/// full tmpfs is found there (never a fault while writing through the
/// mapping); the caller pushes, the push fails with a clear error, nothing
/// is left, and small requests still go through a slot.
#[tokio::test]
async fn a_full_tmpfs_is_found_when_a_slot_is_taken() {
    let fs = TinyTmpfs::mount("1m");
    let t = ShmTransport::new(&cfg(&fs.path().join("kv"), 2)).unwrap();
    let s = shape(100, WIRE_TRIMMED); // 6.6 MB
    assert!(
        t.reserve("big", s).await.unwrap().is_none(),
        "no room for the slot: the caller is told to push"
    );
    assert_eq!((t.busy_slots(), t.held_files().unwrap()), (0, 0));
    let err = t
        .push(rngd_kv_transport::KvPayload {
            request_id: "big".into(),
            layout: s.layout,
            tokens: s.tokens,
            wire: s.wire,
            blobs: blobs_for(s, 10),
        })
        .await
        .unwrap_err();
    assert!(matches!(err, KvError::Capacity { .. }), "{err}");
    assert_eq!((t.busy_slots(), t.held_files().unwrap()), (0, 0));
    let small = SinkShape {
        layout: KvLayout {
            layers: 2,
            ..KvLayout::LLAMA31_8B_S512
        },
        tokens: 8,
        wire: WIRE_TRIMMED,
    };
    // A smaller layout than the arena's slots fits one.
    let want = blobs_for(small, 9);
    let h = hand_over(&t, "small", small, &want).await;
    assert_eq!(t.pull(&h, PULL_TIMEOUT).await.unwrap(), want);
    assert_eq!((t.busy_slots(), t.held_files().unwrap()), (0, 0));
}

/// A pointer is read like any request file, and the arena it names like
/// one too: a name outside the root's arenas, or a symlink to the real
/// arena, is refused and nothing is read.
#[tokio::test]
async fn a_pointer_naming_a_planted_arena_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("kv");
    let (a, b) = pair(&root, 1);
    let s = shape(10, WIRE_TRIMMED);
    let h = hand_over(&a, "planted", s, &blobs_for(s, 11)).await;
    let (arena, _) = arena_of(&root);
    let path = a.path_of("planted").unwrap();
    let pointer = std::fs::read(&path).unwrap();
    // Magic, version, count, slot, generation: the name's length is at 32.
    let name_len = u16::from_le_bytes([pointer[32], pointer[33]]) as usize;
    let with_name = |name: &str| {
        let mut p = pointer[..32].to_vec();
        p.extend_from_slice(&(name.len() as u16).to_le_bytes());
        p.extend_from_slice(name.as_bytes());
        p.extend_from_slice(&pointer[34 + name_len..]);
        p
    };
    std::os::unix::fs::symlink(&arena, root.join("arena.0.0.kva")).unwrap();
    for (name, why) in [
        ("arena.0.0.kva", "symlink"),
        ("../arena.0.0.kva", "not an arena"),
    ] {
        std::fs::write(&path, with_name(name)).unwrap();
        let err = b.pull(&h, PULL_TIMEOUT).await.unwrap_err();
        assert!(err.to_string().contains(why), "{name}: {err}");
        assert_eq!(a.busy_slots(), 1, "{name}: the slot was not touched");
    }
    // The genuine pointer still reads.
    std::fs::write(&path, &pointer).unwrap();
    assert_eq!(b.pull(&h, PULL_TIMEOUT).await.unwrap(), blobs_for(s, 11));
}
