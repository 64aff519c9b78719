//! Where a policy module is found on disk: one search, used by every component
//! that loads the default module (`rngd-pd gateway`, `rngd-pd up`, the
//! benchmarks in `rngd-pd-bench`), and by tests for the other built guests.
//!
//! Nothing here depends on where the source tree was when the binary was
//! built: a binary copied to another checkout, machine or image finds the
//! module the same way. [`default_module`] looks, in order, at:
//!
//! 1. the path given explicitly (a `--policy` flag), else `$RNGD_PD_POLICY`;
//!    a path named this way must exist (no silent fallback to another module);
//! 2. next to the executable: `<exe dir>/pd_default.wasm`, then the cargo
//!    target directory the executable sits in,
//!    `<target>/wasm32-unknown-unknown/release/pd_default.wasm` (for
//!    `<target>/<profile>/rngd-pd`, and for test and example binaries one
//!    level deeper in `deps/` or `examples/`);
//! 3. the path in the container image the Helm chart uses,
//!    [`IMAGE_MODULE`] (`deploy/helm/rngd-pd/values.yaml`, `policy.module`);
//! 4. `$CARGO_TARGET_DIR/wasm32-unknown-unknown/release/pd_default.wasm`.
//!
//! When nothing is found, the error lists every place it looked and says how
//! to build the module or name one.

use std::path::{Path, PathBuf};

/// Environment variable naming the policy module (the constant is owned by
/// `worker/api/src/env.rs`).
pub const POLICY_ENV: &str = rngd_api::env::RNGD_PD_POLICY;

/// File name of the default module as `policies/build.sh` writes it.
pub const DEFAULT_MODULE_FILE: &str = "pd_default.wasm";

/// Where the container image carries the default module (the Helm chart's
/// `policy.module` default in `deploy/helm/rngd-pd/values.yaml`).
pub const IMAGE_MODULE: &str = "/opt/rngd-pd/policies/pd_default.wasm";

/// The target the default module is built for (`policies/build.sh`).
pub const DEFAULT_MODULE_TARGET: &str = "wasm32-unknown-unknown";

/// A module could not be located.
#[derive(Debug, thiserror::Error)]
pub enum LocateError {
    /// A module named by a flag or by `$RNGD_PD_POLICY` does not exist.
    #[error("policy module {} (from {from}) does not exist", path.display())]
    Missing {
        /// The path given.
        path: PathBuf,
        /// Where it came from: `the command line` or `$RNGD_PD_POLICY`.
        from: &'static str,
    },
    /// No candidate place holds the module.
    #[error(
        "policy module {file} not found; looked at: {}. Build it with `bash policies/build.sh` \
         (it writes to $CARGO_TARGET_DIR, by default <workspace>/target), or name one with \
         --policy PATH.wasm (--module in `rngd-pd-bench policy`) or ${POLICY_ENV}",
        list(tried)
    )]
    NotFound {
        /// The file looked for.
        file: String,
        /// Every path looked at, in order.
        tried: Vec<PathBuf>,
    },
}

fn list(paths: &[PathBuf]) -> String {
    if paths.is_empty() {
        return "nowhere (no executable path, no CARGO_TARGET_DIR)".into();
    }
    paths
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// The default policy module: `explicit` (a flag) if given, else
/// `$RNGD_PD_POLICY`, else the first existing file of: next to the
/// executable, the image path ([`IMAGE_MODULE`]), `$CARGO_TARGET_DIR` (see
/// the [module docs](self) for the exact paths).
pub fn default_module(explicit: Option<&Path>) -> Result<PathBuf, LocateError> {
    Search::from_process().default_module(explicit)
}

/// A guest built by `policies/build.sh` for `target`, by crate name (`-`
/// becomes `_`): `$CARGO_TARGET_DIR/<target>/release/<name>.wasm`, else the
/// same path under the cargo target directory the executable sits in. For
/// tests and tools that need a specific guest (the fault guest, the
/// `wasm32-wasip1` build); serving code uses [`default_module`].
pub fn built_guest(name: &str, target: &str) -> Result<PathBuf, LocateError> {
    Search::from_process().built_guest(name, target)
}

/// The inputs of a search: the process's own, or a test's.
#[derive(Debug, Clone, Default)]
struct Search {
    /// `$RNGD_PD_POLICY`, when set and not empty.
    env_module: Option<PathBuf>,
    /// The running executable.
    exe: Option<PathBuf>,
    /// The image path ([`IMAGE_MODULE`]).
    image_module: PathBuf,
    /// `$CARGO_TARGET_DIR`, when set and not empty.
    cargo_target_dir: Option<PathBuf>,
}

fn non_empty(v: Option<std::ffi::OsString>) -> Option<PathBuf> {
    v.filter(|v| !v.is_empty()).map(PathBuf::from)
}

impl Search {
    fn from_process() -> Search {
        Search {
            env_module: non_empty(std::env::var_os(POLICY_ENV)),
            exe: std::env::current_exe().ok(),
            image_module: PathBuf::from(IMAGE_MODULE),
            cargo_target_dir: non_empty(std::env::var_os("CARGO_TARGET_DIR")),
        }
    }

    /// The cargo target directory the executable sits in:
    /// `<target>/<profile>/exe`, or `<target>/<profile>/{deps,examples}/exe`.
    fn exe_target_dir(&self) -> Option<&Path> {
        let dir = self.exe.as_deref()?.parent()?;
        let profile = match dir.file_name().and_then(|n| n.to_str()) {
            Some("deps" | "examples") => dir.parent()?,
            _ => dir,
        };
        profile.parent()
    }

    fn default_module(&self, explicit: Option<&Path>) -> Result<PathBuf, LocateError> {
        let named = explicit
            .map(|p| (p.to_path_buf(), "the command line"))
            .or_else(|| self.env_module.clone().map(|p| (p, "$RNGD_PD_POLICY")));
        if let Some((path, from)) = named {
            return if path.is_file() {
                Ok(path)
            } else {
                Err(LocateError::Missing { path, from })
            };
        }
        let in_target = |t: &Path| {
            t.join(DEFAULT_MODULE_TARGET)
                .join("release")
                .join(DEFAULT_MODULE_FILE)
        };
        let mut candidates = Vec::new();
        if let Some(dir) = self.exe.as_deref().and_then(Path::parent) {
            candidates.push(dir.join(DEFAULT_MODULE_FILE));
        }
        candidates.extend(self.exe_target_dir().map(in_target));
        candidates.push(self.image_module.clone());
        candidates.extend(self.cargo_target_dir.as_deref().map(in_target));
        first_file(DEFAULT_MODULE_FILE, candidates)
    }

    fn built_guest(&self, name: &str, target: &str) -> Result<PathBuf, LocateError> {
        let file = format!("{}.wasm", name.replace('-', "_"));
        let in_target = |t: &Path| t.join(target).join("release").join(&file);
        let candidates = [self.cargo_target_dir.as_deref(), self.exe_target_dir()]
            .into_iter()
            .flatten()
            .map(in_target)
            .collect();
        first_file(&file, candidates)
    }
}

/// The first candidate that is a file, or the error listing them all (each once).
fn first_file(file: &str, candidates: Vec<PathBuf>) -> Result<PathBuf, LocateError> {
    let mut tried: Vec<PathBuf> = Vec::new();
    for c in candidates {
        if tried.contains(&c) {
            continue;
        }
        if c.is_file() {
            return Ok(c);
        }
        tried.push(c);
    }
    Err(LocateError::NotFound {
        file: file.to_string(),
        tried,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake filesystem layout: `<root>/target/release/rngd-pd`, an image
    /// path and a separate `$CARGO_TARGET_DIR`, none holding a module yet.
    struct Layout {
        root: tempfile::TempDir,
    }

    impl Layout {
        fn new() -> Layout {
            let root = tempfile::tempdir().unwrap();
            std::fs::create_dir_all(root.path().join("target/release/deps")).unwrap();
            Layout { root }
        }

        fn path(&self, rel: &str) -> PathBuf {
            self.root.path().join(rel)
        }

        fn put(&self, rel: &str) -> PathBuf {
            let p = self.path(rel);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(&p, b"\0asm").unwrap();
            p
        }

        fn search(&self) -> Search {
            Search {
                env_module: None,
                exe: Some(self.path("target/release/rngd-pd")),
                image_module: self.path("image/opt/rngd-pd/policies/pd_default.wasm"),
                cargo_target_dir: Some(self.path("other-target")),
            }
        }
    }

    const IN_EXE_TARGET: &str = "target/wasm32-unknown-unknown/release/pd_default.wasm";
    const IN_IMAGE: &str = "image/opt/rngd-pd/policies/pd_default.wasm";
    const IN_CARGO_TARGET: &str = "other-target/wasm32-unknown-unknown/release/pd_default.wasm";

    #[test]
    fn missing_everywhere_lists_every_place_in_order() {
        let l = Layout::new();
        let err = l.search().default_module(None).unwrap_err();
        let LocateError::NotFound { file, tried } = &err else {
            panic!("{err:?}");
        };
        assert_eq!(file, "pd_default.wasm");
        assert_eq!(
            tried,
            &[
                l.path("target/release/pd_default.wasm"),
                l.path(IN_EXE_TARGET),
                l.path(IN_IMAGE),
                l.path(IN_CARGO_TARGET),
            ]
        );
        let msg = err.to_string();
        for p in tried {
            assert!(msg.contains(&p.display().to_string()), "{msg}");
        }
        assert!(
            msg.contains("policies/build.sh") && msg.contains("--policy"),
            "{msg}"
        );
    }

    #[test]
    fn explicit_path_wins_over_everything() {
        let l = Layout::new();
        for rel in [
            "target/release/pd_default.wasm",
            IN_EXE_TARGET,
            IN_IMAGE,
            IN_CARGO_TARGET,
        ] {
            l.put(rel);
        }
        let mut s = l.search();
        s.env_module = Some(l.put("env.wasm"));
        let flag = l.put("flag.wasm");
        assert_eq!(s.default_module(Some(&flag)).unwrap(), flag);
        // Without the flag, the environment variable wins.
        assert_eq!(s.default_module(None).unwrap(), l.path("env.wasm"));
    }

    #[test]
    fn a_named_module_that_does_not_exist_is_an_error_not_a_fallback() {
        let l = Layout::new();
        l.put(IN_IMAGE);
        let mut s = l.search();
        let gone = l.path("gone.wasm");
        let err = s.default_module(Some(&gone)).unwrap_err();
        assert!(
            matches!(&err, LocateError::Missing { path, from: "the command line" } if *path == gone),
            "{err:?}"
        );
        s.env_module = Some(gone.clone());
        let err = s.default_module(None).unwrap_err();
        assert!(
            matches!(
                &err,
                LocateError::Missing {
                    from: "$RNGD_PD_POLICY",
                    ..
                }
            ),
            "{err:?}"
        );
        assert!(err.to_string().contains("gone.wasm"), "{err}");
    }

    #[test]
    fn search_order_after_the_explicit_path() {
        let l = Layout::new();
        let s = l.search();
        let cargo_target = l.put(IN_CARGO_TARGET);
        assert_eq!(s.default_module(None).unwrap(), cargo_target);
        let image = l.put(IN_IMAGE);
        assert_eq!(s.default_module(None).unwrap(), image);
        let exe_target = l.put(IN_EXE_TARGET);
        assert_eq!(s.default_module(None).unwrap(), exe_target);
        let beside = l.put("target/release/pd_default.wasm");
        assert_eq!(s.default_module(None).unwrap(), beside);
    }

    #[test]
    fn test_and_example_binaries_find_their_target_dir() {
        let l = Layout::new();
        let module = l.put(IN_EXE_TARGET);
        for exe in [
            "target/release/deps/runtime-0123abcd",
            "target/release/examples/policy_bench",
            "target/debug/rngd-pd",
        ] {
            let s = Search {
                exe: Some(l.path(exe)),
                cargo_target_dir: None,
                ..l.search()
            };
            assert_eq!(s.default_module(None).unwrap(), module, "{exe}");
        }
    }

    #[test]
    fn no_inputs_at_all_still_looks_at_the_image_path() {
        let s = Search {
            image_module: PathBuf::from("/nonexistent/rngd-pd/pd_default.wasm"),
            ..Search::default()
        };
        let err = s.default_module(None).unwrap_err();
        let LocateError::NotFound { tried, .. } = &err else {
            panic!("{err:?}");
        };
        assert_eq!(
            tried,
            &[PathBuf::from("/nonexistent/rngd-pd/pd_default.wasm")]
        );
    }

    #[test]
    fn built_guest_prefers_cargo_target_dir_then_the_exe_target_dir() {
        let l = Layout::new();
        let s = l.search();
        let err = s.built_guest("fault-guest", "wasm32-wasip1").unwrap_err();
        let LocateError::NotFound { file, tried } = &err else {
            panic!("{err:?}");
        };
        assert_eq!(file, "fault_guest.wasm");
        assert_eq!(
            tried,
            &[
                l.path("other-target/wasm32-wasip1/release/fault_guest.wasm"),
                l.path("target/wasm32-wasip1/release/fault_guest.wasm"),
            ]
        );
        let in_exe = l.put("target/wasm32-wasip1/release/fault_guest.wasm");
        assert_eq!(
            s.built_guest("fault-guest", "wasm32-wasip1").unwrap(),
            in_exe
        );
        let in_cargo = l.put("other-target/wasm32-wasip1/release/fault_guest.wasm");
        assert_eq!(
            s.built_guest("fault-guest", "wasm32-wasip1").unwrap(),
            in_cargo
        );
    }

    #[test]
    fn the_same_place_is_listed_once() {
        let l = Layout::new();
        let s = Search {
            cargo_target_dir: Some(l.path("target")),
            ..l.search()
        };
        let Err(LocateError::NotFound { tried, .. }) = s.default_module(None) else {
            panic!("nothing is there");
        };
        assert_eq!(tried.len(), 3, "{tried:?}");
    }
}
