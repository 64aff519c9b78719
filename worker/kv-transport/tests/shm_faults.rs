//! Fault rows of the `shm` transport on a real file system: a full tmpfs
//! (a real ENOSPC on a 1 MiB tmpfs mounted for the test), and hostile roots
//! (a symlinked root, a root of another user, a world-writable root without
//! the sticky bit, symlinks, FIFOs and other users' files planted at a key's
//! path). Each asserts the clear error, that nothing is left behind or
//! touched, and that the transport still serves a normal request.
//!
//! Also the transport's basic guarantees (moved from its unit tests): an
//! injected ENOSPC at the disk edge, private modes, foreign handles refused.
//!
//! Mounting and `chown` need root (CI runs as root, as `tests/shm.rs` and
//! `tests/netns.rs` do); without it these tests fail with a message saying so.

mod common;

use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use common::tmpfs::TinyTmpfs;
use rngd_kv_transport::conformance;
use rngd_kv_transport::shm::{ShmTransport, ShmWriter};
use rngd_kv_transport::{KvError, KvLayout, KvPayload, KvTransport, TransportConfig};

/// The uid of "another user" (nobody on this machine has to exist with it).
const OTHER_UID: u32 = 12345;
/// Bound for any one operation: a pull of a hostile entry must fail at once,
/// not after its pull timeout.
const BOUND: Duration = Duration::from_secs(20);
const PULL_TIMEOUT: Duration = Duration::from_secs(30);

fn cfg(root: &Path) -> TransportConfig {
    TransportConfig {
        shm_root: root.to_path_buf(),
        ..TransportConfig::default()
    }
}

/// Every entry of `dir`, hidden ones included, sorted.
fn entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("listing {}: {e}", dir.display()))
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

fn chown_other(path: &Path) {
    if let Err(e) = std::os::unix::fs::lchown(path, Some(OTHER_UID), Some(OTHER_UID)) {
        panic!(
            "chown of {} to uid {OTHER_UID} failed ({e}): the hostile-owner tests need root (CI runs as root)",
            path.display()
        );
    }
}

/// A normal request still round-trips byte-exact, and leaves nothing behind.
async fn still_serves(t: &ShmTransport, id: &str) {
    let p = conformance::payload(id, 11, 4, 64 * 1024);
    let want = p.blobs.clone();
    let handle = t.push(p).await.expect("a normal push after the fault");
    let got = tokio::time::timeout(BOUND, t.pull(&handle, PULL_TIMEOUT))
        .await
        .expect("pull hung")
        .expect("a normal pull after the fault");
    assert_eq!(got, want, "bytes differ");
    assert!(
        !t.path_of(id).unwrap().exists(),
        "the puller removed the file"
    );
}

fn is_mounted(p: &Path) -> bool {
    let mounts = std::fs::read("/proc/self/mounts").unwrap();
    let want = p.as_os_str().as_bytes();
    mounts
        .split(|b| *b == b'\n')
        .any(|l| l.split(|b| *b == b' ').nth(1) == Some(want))
}

#[tokio::test]
async fn enospc_on_a_1mib_tmpfs_is_a_clear_error_and_leaves_no_partial_file() {
    let fs = TinyTmpfs::mount("1m");
    let mount_point = fs.path().to_path_buf();
    assert!(is_mounted(&mount_point), "the tmpfs is mounted");
    let root = fs.path().join("kv");
    let t = ShmTransport::new(&cfg(&root)).unwrap();

    // 4 blobs of 512 KiB: twice the space.
    let started = Instant::now();
    let err = tokio::time::timeout(
        BOUND,
        t.push(conformance::payload("too-big", 3, 4, 512 * 1024)),
    )
    .await
    .expect("a push onto a full tmpfs must fail, not hang")
    .expect_err("2 MiB cannot fit a 1 MiB tmpfs");
    let took = started.elapsed();
    let msg = err.to_string();
    assert!(matches!(err, KvError::Capacity { .. }), "{msg}");
    assert_eq!(err.transport(), Some("shm"), "{msg}");
    assert!(msg.contains("shm"), "names the transport: {msg}");
    assert!(
        msg.contains(&root.display().to_string()),
        "names the root: {msg}"
    );
    assert!(msg.contains("no space"), "says no space: {msg}");
    let os = std::error::Error::source(&err)
        .and_then(|s| s.downcast_ref::<std::io::Error>())
        .and_then(|e| e.raw_os_error());
    assert_eq!(os, Some(libc::ENOSPC), "keeps the OS error: {msg}");
    eprintln!("ENOSPC after {took:?}: {msg}");

    // No partial or temporary file: the directory is empty, hidden names included.
    assert_eq!(entries(&root), Vec::<String>::new(), "partial file left");
    assert_eq!(t.held_files().unwrap(), 0);

    // The space is back: a small push and pull work, and leave nothing.
    still_serves(&t, "small-after-enospc").await;
    assert_eq!(entries(&root), Vec::<String>::new());
    drop(t);
    drop(fs);
    assert!(!is_mounted(&mount_point), "the guard unmounted the tmpfs");
}

#[tokio::test]
async fn a_symlinked_root_is_refused_at_creation() {
    let dir = tempfile::tempdir().unwrap();
    let real = dir.path().join("real");
    std::fs::create_dir(&real).unwrap();
    std::fs::set_permissions(&real, std::fs::Permissions::from_mode(0o755)).unwrap();
    let link = dir.path().join("kv");
    std::os::unix::fs::symlink(&real, &link).unwrap();

    let err = ShmTransport::new(&cfg(&link)).expect_err("a symlinked root is refused");
    let msg = err.to_string();
    assert!(matches!(err, KvError::Config { .. }), "{msg}");
    assert!(
        msg.contains("shm root") && msg.contains(&link.display().to_string()),
        "{msg}"
    );
    assert!(
        msg.contains("symlink") && msg.contains("never followed"),
        "{msg}"
    );
    // The target was not touched: same mode, still empty.
    let m = std::fs::metadata(&real).unwrap();
    assert_eq!(m.mode() & 0o7777, 0o755, "the target's mode was changed");
    assert!(entries(&real).is_empty());

    // A dangling symlink is refused too, and its target is not created.
    let dangling = dir.path().join("dangling");
    let nowhere = dir.path().join("nowhere");
    std::os::unix::fs::symlink(&nowhere, &dangling).unwrap();
    let msg = ShmTransport::new(&cfg(&dangling)).unwrap_err().to_string();
    assert!(msg.contains("symlink"), "{msg}");
    assert!(!nowhere.exists(), "the symlink's target was created");

    // The real directory itself is fine.
    let t = ShmTransport::new(&cfg(&real)).unwrap();
    still_serves(&t, "after-symlink").await;
}

#[tokio::test]
async fn a_root_of_another_user_or_world_writable_without_sticky_is_refused() {
    let dir = tempfile::tempdir().unwrap();

    // Another user's directory.
    let theirs = dir.path().join("theirs");
    std::fs::create_dir(&theirs).unwrap();
    std::fs::set_permissions(&theirs, std::fs::Permissions::from_mode(0o700)).unwrap();
    chown_other(&theirs);
    let err = ShmTransport::new(&cfg(&theirs)).expect_err("another user's root is refused");
    let msg = err.to_string();
    assert!(matches!(err, KvError::Config { .. }), "{msg}");
    assert!(
        msg.contains(&theirs.display().to_string()) && msg.contains(&format!("uid {OTHER_UID}")),
        "{msg}"
    );
    assert_eq!(
        std::fs::symlink_metadata(&theirs).unwrap().uid(),
        OTHER_UID,
        "left as it was"
    );

    // World-writable without the sticky bit: refused, and its mode is not
    // silently changed.
    let open = dir.path().join("open");
    std::fs::create_dir(&open).unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
    let msg = ShmTransport::new(&cfg(&open)).unwrap_err().to_string();
    assert!(
        msg.contains(&open.display().to_string()) && msg.contains("sticky"),
        "{msg}"
    );
    assert_eq!(std::fs::metadata(&open).unwrap().mode() & 0o7777, 0o777);

    // World-writable with the sticky bit (the node directory `rngd-pd kv
    // shm-root` makes, mode 1777): used, and left shared.
    let shared = dir.path().join("shared");
    std::fs::create_dir(&shared).unwrap();
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let t = ShmTransport::new(&cfg(&shared)).unwrap();
    assert_eq!(std::fs::metadata(&shared).unwrap().mode() & 0o7777, 0o1777);
    still_serves(&t, "in-the-shared-root").await;

    // A private root of this user with a loose mode is tightened to 0700.
    let mine = dir.path().join("mine");
    std::fs::create_dir(&mine).unwrap();
    std::fs::set_permissions(&mine, std::fs::Permissions::from_mode(0o755)).unwrap();
    let t = ShmTransport::new(&cfg(&mine)).unwrap();
    assert_eq!(std::fs::metadata(&mine).unwrap().mode() & 0o7777, 0o700);
    still_serves(&t, "in-my-root").await;
}

/// A transport on a fresh root, and a valid handle whose file was published.
async fn published(dir: &Path, id: &str) -> (ShmTransport, rngd_kv_transport::KvHandle, PathBuf) {
    let t = ShmTransport::new(&cfg(&dir.join("kv"))).unwrap();
    let handle = t.push(conformance::payload(id, 5, 3, 8192)).await.unwrap();
    let path = t.path_of(id).unwrap();
    assert!(path.exists());
    (t, handle, path)
}

/// Pulls `handle` and expects a refusal naming `path` and `why`, well
/// before the pull timeout (a hostile entry is not waited on).
async fn refused_pull(
    t: &ShmTransport,
    handle: &rngd_kv_transport::KvHandle,
    path: &Path,
    why: &str,
) {
    let started = Instant::now();
    let err = tokio::time::timeout(BOUND, t.pull(handle, PULL_TIMEOUT))
        .await
        .expect("the pull hung")
        .expect_err("a hostile entry must not be read");
    assert!(
        started.elapsed() < PULL_TIMEOUT / 2,
        "waited for its timeout"
    );
    let msg = err.to_string();
    assert_eq!(err.transport(), Some("shm"), "{msg}");
    assert!(
        msg.contains(&path.display().to_string()) && msg.contains(why),
        "expected `{why}` about {}: {msg}",
        path.display()
    );
}

#[tokio::test]
async fn a_published_file_of_another_user_is_not_read_nor_removed() {
    let dir = tempfile::tempdir().unwrap();
    let (t, handle, path) = published(dir.path(), "foreign-owner").await;
    chown_other(&path);
    refused_pull(&t, &handle, &path, &format!("owned by uid {OTHER_UID}")).await;
    assert_eq!(
        std::fs::symlink_metadata(&path).unwrap().uid(),
        OTHER_UID,
        "the other user's file is left alone"
    );
    // Nor does the sweeper remove it, however old.
    let f = std::fs::File::options().write(true).open(&path).unwrap();
    f.set_modified(SystemTime::now() - Duration::from_secs(3600))
        .unwrap();
    drop(f);
    assert_eq!(t.sweep().unwrap(), 0);
    assert!(path.exists());
    std::fs::remove_file(&path).unwrap();

    // A file of this user that others may write is refused too.
    let h2 = t
        .push(conformance::payload("group-writable", 6, 2, 4096))
        .await
        .unwrap();
    let p2 = t.path_of("group-writable").unwrap();
    std::fs::set_permissions(&p2, std::fs::Permissions::from_mode(0o666)).unwrap();
    refused_pull(&t, &h2, &p2, "writable by group or others").await;
    std::fs::remove_file(&p2).unwrap();
    still_serves(&t, "after-foreign-file").await;
}

#[tokio::test]
async fn a_symlink_or_fifo_at_the_keys_path_is_not_followed_by_the_puller() {
    let dir = tempfile::tempdir().unwrap();
    let (t, handle, path) = published(dir.path(), "planted-link").await;
    // A valid copy of the cache elsewhere: were the symlink followed, the
    // pull would succeed.
    let elsewhere = dir.path().join("elsewhere.kv");
    std::fs::rename(&path, &elsewhere).unwrap();
    std::os::unix::fs::symlink(&elsewhere, &path).unwrap();
    refused_pull(&t, &handle, &path, "symlink").await;
    assert!(elsewhere.exists(), "the symlink's target is untouched");
    assert!(
        std::fs::symlink_metadata(&path)
            .unwrap()
            .file_type()
            .is_symlink()
    );
    std::fs::remove_file(&path).unwrap();

    // A FIFO cannot block the open.
    let h2 = t
        .push(conformance::payload("planted-fifo", 7, 2, 4096))
        .await
        .unwrap();
    let p2 = t.path_of("planted-fifo").unwrap();
    std::fs::remove_file(&p2).unwrap();
    let c = std::ffi::CString::new(p2.as_os_str().as_bytes()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo");
    refused_pull(&t, &h2, &p2, "not a regular file").await;
    std::fs::remove_file(&p2).unwrap();
    still_serves(&t, "after-planted-link").await;
}

#[tokio::test]
async fn a_push_never_follows_or_overwrites_what_is_planted_at_the_keys_path() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("kv");
    let t = ShmTransport::new(&cfg(&root)).unwrap();

    // A symlink planted at the key's path, pointing at a victim file.
    let victim = dir.path().join("victim");
    std::fs::write(&victim, b"precious").unwrap();
    let path = t.path_of("planted").unwrap();
    std::os::unix::fs::symlink(&victim, &path).unwrap();
    let err = tokio::time::timeout(BOUND, t.push(conformance::payload("planted", 1, 2, 4096)))
        .await
        .expect("push hung")
        .expect_err("a push onto a planted symlink is refused");
    let msg = err.to_string();
    assert!(
        msg.contains("shm") && msg.contains(&path.display().to_string()) && msg.contains("symlink"),
        "{msg}"
    );
    assert_eq!(
        std::fs::read(&victim).unwrap(),
        b"precious",
        "written through"
    );
    assert!(
        std::fs::symlink_metadata(&path)
            .unwrap()
            .file_type()
            .is_symlink(),
        "the symlink was replaced"
    );
    assert_eq!(
        entries(&root),
        vec!["planted.kv".to_string()],
        "temporary file left"
    );
    std::fs::remove_file(&path).unwrap();

    // Another user's file at the key's path: not overwritten, not replaced.
    let path = t.path_of("theirs").unwrap();
    std::fs::write(&path, b"their bytes").unwrap();
    chown_other(&path);
    let ino = std::fs::symlink_metadata(&path).unwrap().ino();
    let msg = t
        .push(conformance::payload("theirs", 2, 2, 4096))
        .await
        .expect_err("another user's file is not replaced")
        .to_string();
    assert!(
        msg.contains(&path.display().to_string()) && msg.contains(&format!("uid {OTHER_UID}")),
        "{msg}"
    );
    let m = std::fs::symlink_metadata(&path).unwrap();
    assert_eq!((m.ino(), m.uid()), (ino, OTHER_UID), "replaced");
    assert_eq!(std::fs::read(&path).unwrap(), b"their bytes", "overwritten");
    assert_eq!(
        entries(&root),
        vec!["theirs.kv".to_string()],
        "temporary file left"
    );
    std::fs::remove_file(&path).unwrap();

    // This user's own unread copy of the same key is replaced by a re-push.
    t.push(conformance::payload("again", 3, 2, 4096))
        .await
        .unwrap();
    let p = conformance::payload("again", 4, 2, 4096);
    let want = p.blobs.clone();
    let handle = t.push(p).await.expect("a re-push replaces its own copy");
    let got = t.pull(&handle, PULL_TIMEOUT).await.unwrap();
    assert_eq!(got, want, "the re-pushed bytes are served");
    assert!(entries(&root).is_empty(), "{:?}", entries(&root));
    still_serves(&t, "after-planted-files").await;
}

/// Fails with ENOSPC once `budget` bytes have been written (a fault
/// injected at the disk edge, [`ShmWriter`]).
struct FullDisk {
    budget: u64,
    written: std::sync::Mutex<u64>,
}

impl ShmWriter for FullDisk {
    fn write_all_at(&self, file: &std::fs::File, bytes: &[u8], offset: u64) -> std::io::Result<()> {
        let mut w = self.written.lock().unwrap();
        if *w + bytes.len() as u64 > self.budget {
            return Err(std::io::Error::from_raw_os_error(libc::ENOSPC));
        }
        *w += bytes.len() as u64;
        std::os::unix::fs::FileExt::write_all_at(file, bytes, offset)
    }
}

fn small(id: &str) -> KvPayload {
    KvPayload {
        request_id: id.into(),
        layout: KvLayout::LLAMA31_8B_S512,
        tokens: 3,
        wire: rngd_kv_wire::WIRE_FULL,
        blobs: vec![Bytes::from(vec![7u8; 5000]), Bytes::from(vec![9u8; 3000])],
    }
}

#[tokio::test]
async fn injected_enospc_is_capacity_and_leaves_no_file() {
    let dir = tempfile::tempdir().unwrap();
    let writer = Arc::new(FullDisk {
        budget: 6000,
        written: Default::default(),
    });
    let t = ShmTransport::with_writer(&cfg(&dir.path().join("kv")), writer).unwrap();
    let err = t.push(small("r1")).await.unwrap_err();
    assert!(matches!(err, KvError::Capacity { .. }), "{err}");
    assert!(err.to_string().contains("no space"), "{err}");
    assert_eq!(t.held_files().unwrap(), 0);
}

#[tokio::test]
async fn files_and_dir_are_private() {
    let dir = tempfile::tempdir().unwrap();
    let t = ShmTransport::new(&cfg(&dir.path().join("kv"))).unwrap();
    let h = t.push(small("r/../2")).await.unwrap();
    let mode = std::fs::metadata(t.root()).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o700);
    let path = t.path_of("r/../2").unwrap();
    assert_eq!(path.parent().unwrap(), t.root());
    let mode = std::fs::metadata(&path).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600);
    let blobs = t.pull(&h, Duration::from_secs(1)).await.unwrap();
    assert_eq!(blobs[0], vec![7u8; 5000]);
    assert!(!path.exists(), "the reader unlinks after load");
}

#[tokio::test]
async fn foreign_handles_are_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let t = ShmTransport::new(&cfg(&dir.path().join("kv"))).unwrap();
    let mut h = t.push(small("r3")).await.unwrap();
    h.location = "/etc".into();
    let err = t.pull(&h, Duration::from_millis(10)).await.unwrap_err();
    assert!(matches!(err, KvError::BadRequest { .. }), "{err}");
    h.transport = "tcp".into();
    let err = t.release(&h).await.unwrap_err();
    assert!(matches!(err, KvError::BadRequest { .. }), "{err}");
}
