//! A tiny tmpfs mounted for a test ([`TinyTmpfs`]): a real ENOSPC without a
//! full disk. Mounting needs root (CI runs as root); without it the test
//! fails with a message saying so.

use std::path::Path;
use std::process::Command;

/// A tmpfs of `size` mounted on a temporary directory, unmounted on drop
/// (also when the test fails).
pub struct TinyTmpfs {
    dir: tempfile::TempDir,
}

impl TinyTmpfs {
    /// Mounts a tmpfs of `size` (as `mount -o size=`, e.g. `1m`), mode 0700.
    pub fn mount(size: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size},mode=0700")])
            .arg("tmpfs")
            .arg(dir.path())
            .output()
            .expect("running mount");
        assert!(
            out.status.success(),
            "this test mounts a {size} tmpfs to provoke a real ENOSPC and needs root (CI runs as root): {}",
            String::from_utf8_lossy(&out.stderr)
        );
        TinyTmpfs { dir }
    }

    /// The mount point.
    pub fn path(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for TinyTmpfs {
    fn drop(&mut self) {
        let ok = Command::new("umount")
            .arg(self.dir.path())
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        if !ok {
            eprintln!("umount {} failed", self.dir.path().display());
        }
    }
}
