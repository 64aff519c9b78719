//! The `shm` transport: the conformance suite on a real tmpfs (`/dev/shm`),
//! plus a real ENOSPC on a tiny tmpfs mounted for the test (needs root, as in CI).

use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

mod common;

use common::tmpfs::TinyTmpfs;
use rngd_kv_transport::conformance::{self, Harness};
use rngd_kv_transport::shm::{self, ShmTransport};
use rngd_kv_transport::{KvError, KvHandle, KvTransport, TransportConfig};

struct ShmHarness {
    cfg: TransportConfig,
    probe: ShmTransport,
}

impl ShmHarness {
    fn new(root: PathBuf, ttl: Duration) -> Self {
        let cfg = TransportConfig {
            shm_root: root,
            shm_ttl: ttl,
            ..TransportConfig::default()
        };
        let probe = ShmTransport::new(&cfg).expect("shm transport");
        ShmHarness { cfg, probe }
    }
}

#[async_trait::async_trait]
impl Harness for ShmHarness {
    fn make(&self) -> Arc<dyn KvTransport> {
        Arc::new(ShmTransport::new(&self.cfg).expect("shm transport"))
    }

    async fn held(&self) -> Result<usize, KvError> {
        self.probe.held_files()
    }

    async fn corrupt(&self, handle: &KvHandle, index: usize) -> Result<(), KvError> {
        let path = self.probe.path_of(&handle.request_id)?;
        let offset = shm::data_offset(handle.blobs.len())
            + handle.blobs[..index].iter().map(|b| b.len).sum::<u64>()
            + handle.blobs[index].len / 2;
        let io = |source| KvError::Io {
            transport: "shm",
            context: format!("corrupting {}", path.display()),
            source,
        };
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(io)?;
        let mut byte = [0u8; 1];
        file.read_exact_at(&mut byte, offset).map_err(io)?;
        byte[0] ^= 0x40;
        file.write_all_at(&byte, offset).map_err(io)?;
        Ok(())
    }

    fn ttl(&self) -> Duration {
        self.cfg.shm_ttl
    }

    async fn restart(&self) -> Result<bool, KvError> {
        Ok(false)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_passes_the_conformance_suite() {
    let dir = tempfile::tempdir_in("/dev/shm").expect("/dev/shm must be writable");
    let h = ShmHarness::new(dir.path().join("kv"), Duration::from_millis(400));
    let report = conformance::run_all(&h)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    for (check, note) in &report.passed {
        eprintln!("shm conformance: {check}: {note}");
    }
    assert_eq!(report.passed.len(), 8, "{report:?}");
    assert_eq!(h.probe.held_files().unwrap(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sweeper_leaves_fresh_files_alone() {
    let dir = tempfile::tempdir_in("/dev/shm").expect("/dev/shm must be writable");
    let cfg = TransportConfig {
        shm_root: dir.path().join("kv"),
        shm_ttl: Duration::from_secs(30),
        ..TransportConfig::default()
    };
    let t = ShmTransport::new(&cfg).unwrap();
    let handle = t
        .push(conformance::payload("fresh", 1, 2, 100))
        .await
        .unwrap();
    assert_eq!(t.sweep().unwrap(), 0);
    assert_eq!(t.held_files().unwrap(), 1);
    t.release(&handle).await.unwrap();
    assert_eq!(t.held_files().unwrap(), 0);
}

#[tokio::test]
async fn full_tmpfs_is_a_capacity_error_without_partial_files() {
    let fs = TinyTmpfs::mount("1m");
    let cfg = TransportConfig {
        shm_root: fs.path().join("kv"),
        ..TransportConfig::default()
    };
    let t = ShmTransport::new(&cfg).unwrap();
    let err = t
        .push(conformance::payload("too-big", 3, 4, 512 * 1024))
        .await
        .expect_err("2 MiB cannot fit a 1 MiB tmpfs");
    assert!(matches!(err, KvError::Capacity { .. }), "{err}");
    assert!(
        std::error::Error::source(&err).is_some(),
        "keeps the OS error"
    );
    assert_eq!(t.held_files().unwrap(), 0, "no partial file left");
    // The space is back: a small request still fits.
    let p = conformance::payload("small", 4, 2, 64 * 1024);
    let want = p.blobs.clone();
    let handle = t.push(p).await.unwrap();
    let got = t.pull(&handle, Duration::from_secs(5)).await.unwrap();
    assert_eq!(got, want);
    assert_eq!(t.held_files().unwrap(), 0);
}
