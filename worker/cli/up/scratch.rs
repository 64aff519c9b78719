//! `rngd-pd up`'s scratch directory (the policy configuration and the
//! endpoints file it writes for its children): created fresh and private, as
//! `mkdtemp` does — a name no one can predict, mode 0700, and never an
//! existing path (a directory or a symlink someone planted is refused, not
//! reused or followed). `Stack` removes it at exit.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::io;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

/// Attempts at a fresh name before giving up (each name is 64 random bits).
const ATTEMPTS: usize = 16;

/// Creates `path` as a new directory with mode 0700; an existing path of any
/// kind (a symlink included, which `mkdir` does not follow) is an error.
pub(super) fn create_private(path: &Path) -> io::Result<()> {
    std::fs::DirBuilder::new().mode(0o700).create(path)
}

/// A fresh private directory `<parent>/<prefix><random>`.
pub(super) fn fresh_private_dir(parent: &Path, prefix: &str) -> io::Result<PathBuf> {
    for _ in 0..ATTEMPTS {
        // `RandomState` is seeded from the OS's randomness, per instance.
        let mut h = RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        let path = parent.join(format!("{prefix}{:016x}", h.finish()));
        match create_private(&path) {
            Ok(()) => return Ok(path),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e),
        }
    }
    Err(io::Error::new(
        io::ErrorKind::AlreadyExists,
        format!(
            "no fresh name under {} after {ATTEMPTS} attempts",
            parent.display()
        ),
    ))
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    #[test]
    fn a_planted_symlink_or_directory_is_refused_and_not_followed() {
        let root = tempfile::tempdir().unwrap();
        let target = root.path().join("target");
        std::fs::create_dir(&target).unwrap();
        let planted = root.path().join("rngd_pd_up_planted");
        std::os::unix::fs::symlink(&target, &planted).unwrap();
        let e = create_private(&planted).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::AlreadyExists);
        assert!(
            std::fs::symlink_metadata(&planted)
                .unwrap()
                .file_type()
                .is_symlink()
        );
        assert_eq!(std::fs::read_dir(&target).unwrap().count(), 0);
        assert_eq!(
            create_private(&target).unwrap_err().kind(),
            io::ErrorKind::AlreadyExists
        );
    }

    #[test]
    fn fresh_directories_are_private_and_distinct() {
        let root = tempfile::tempdir().unwrap();
        let a = fresh_private_dir(root.path(), "rngd_pd_up_").unwrap();
        let b = fresh_private_dir(root.path(), "rngd_pd_up_").unwrap();
        assert_ne!(a, b);
        for d in [&a, &b] {
            let m = std::fs::symlink_metadata(d).unwrap();
            assert!(m.is_dir());
            assert_eq!(m.permissions().mode() & 0o777, 0o700);
        }
    }
}
