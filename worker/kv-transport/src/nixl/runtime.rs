//! Finding and loading the NIXL runtime for `nixl-ucx`.
//!
//! The bindings (`nixl-sys`, built without a NIXL install) are stubs that
//! resolve the C API from a library named `libnixl_capi.so` the first time a
//! NIXL function is called. This module finds that library itself and loads
//! it by absolute path before any NIXL call, so the stubs find it already
//! loaded (by its soname) and nothing has to be put in `LD_LIBRARY_PATH`:
//!
//! 1. `AIRM_KV_NIXL_LIB_DIR` (a deployment's own NIXL build: the directory
//!    holding `libnixl_capi.so`, e.g. `$PREFIX/lib/x86_64-linux-gnu`);
//! 2. the installed PyPI wheel `nixl-cu12` (or `nixl-cu13`): its library
//!    directory `.nixl_cu12.mesonpy.libs` in one of the site-packages
//!    directories `python3` reports, then in the usual system ones.
//!
//! The plugin directory (`AIRM_KV_NIXL_PLUGIN_DIR`, default `plugins/` beside
//! the library) must hold the UCX plugin; it is given to NIXL through
//! `NIXL_PLUGIN_DIR` in this process's environment before the first agent is
//! made. The runtime is loaded once per process; what is found is kept for
//! `rngd-pd kv doctor`.

use std::ffi::{CStr, CString};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use crate::{KvError, TransportConfig};

/// The NIXL C API library the bindings resolve their functions from.
pub const CAPI_LIB: &str = "libnixl_capi.so";
/// The UCX backend plugin.
pub const UCX_PLUGIN: &str = "libplugin_UCX.so";
/// Library directories of the NIXL wheels, relative to site-packages.
const WHEEL_LIB_DIRS: &[&str] = &[
    ".nixl_cu12.mesonpy.libs",
    ".nixl_cu13.mesonpy.libs",
    ".nixl.mesonpy.libs",
];
/// Where the wheels keep their bundled third-party libraries (UCX among
/// them), relative to site-packages.
const WHEEL_DEP_DIRS: &[&str] = &["nixl_cu12.libs", "nixl_cu13.libs", "nixl.libs"];

/// What was found: the runtime this process uses (or would use).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Runtime {
    /// Directory holding `libnixl_capi.so`.
    pub lib_dir: PathBuf,
    /// Absolute path of `libnixl_capi.so`.
    pub capi: PathBuf,
    /// The plugin directory given to NIXL.
    pub plugin_dir: PathBuf,
    /// How it was found (`AIRM_KV_NIXL_LIB_DIR`, or the wheel's site-packages).
    pub found_by: String,
    /// Directories searched (for error messages and the doctor).
    pub searched: Vec<PathBuf>,
}

impl Runtime {
    /// The plugins in the plugin directory (`libplugin_X.so` → `X`), sorted.
    pub fn plugins(&self) -> Vec<String> {
        let mut out: Vec<String> = std::fs::read_dir(&self.plugin_dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                name.strip_prefix("libplugin_")?
                    .strip_suffix(".so")
                    .map(str::to_string)
            })
            .collect();
        out.sort();
        out
    }

    /// The UCX library bundled with the runtime (`libucp*.so*` in the
    /// library directory or the wheel's dependency directory), if any.
    pub fn bundled_ucp(&self) -> Option<PathBuf> {
        let mut dirs = vec![self.lib_dir.clone()];
        if let Some(parent) = self.lib_dir.parent() {
            dirs.extend(WHEEL_DEP_DIRS.iter().map(|d| parent.join(d)));
        }
        dirs.iter().find_map(|d| {
            std::fs::read_dir(d).ok()?.flatten().find_map(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                (name.starts_with("libucp") && name.contains(".so")).then(|| e.path())
            })
        })
    }
}

/// The version string of the UCX library at `ucp` (`ucp_get_version_string`),
/// if it loads and has the symbol.
pub fn ucx_version(ucp: &Path) -> Option<String> {
    let c = CString::new(ucp.as_os_str().as_bytes()).ok()?;
    let sym = CString::new("ucp_get_version_string").ok()?;
    // SAFETY: FFI with valid NUL-terminated strings; the library stays
    // loaded (never closed), and `ucp_get_version_string` takes no
    // arguments and returns a static NUL-terminated string.
    unsafe {
        let h = libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL);
        if h.is_null() {
            return None;
        }
        let f = libc::dlsym(h, sym.as_ptr());
        if f.is_null() {
            return None;
        }
        let f: extern "C" fn() -> *const libc::c_char = std::mem::transmute(f);
        let v = f();
        (!v.is_null()).then(|| CStr::from_ptr(v).to_string_lossy().into_owned())
    }
}

fn missing(detail: String) -> KvError {
    KvError::Config {
        detail: format!("transport `nixl-ucx`: {detail}"),
    }
}

/// Site-packages directories: what `python3` reports, then the usual ones.
fn site_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    let script = "import site, sys\n\
        dirs = list(getattr(site, 'getsitepackages', lambda: [])())\n\
        dirs.append(site.getusersitepackages())\n\
        dirs.extend(p for p in sys.path if p)\n\
        print('\\n'.join(dirs))";
    if let Ok(out) = std::process::Command::new("python3")
        .args(["-c", script])
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .output()
        && out.status.success()
    {
        dirs.extend(
            String::from_utf8_lossy(&out.stdout)
                .lines()
                .filter(|l| !l.trim().is_empty())
                .map(PathBuf::from),
        );
    }
    for base in ["/usr/local/lib", "/usr/lib"] {
        if let Ok(entries) = std::fs::read_dir(base) {
            for e in entries.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if name.starts_with("python3") {
                    dirs.push(e.path().join("site-packages"));
                    dirs.push(e.path().join("dist-packages"));
                }
            }
        }
    }
    dirs.push(PathBuf::from("/usr/lib/python3/dist-packages"));
    let mut seen = std::collections::HashSet::new();
    dirs.retain(|d| seen.insert(d.clone()));
    dirs
}

/// Finds the runtime `cfg` points at (see the module docs), without loading it.
pub fn locate(cfg: &TransportConfig) -> Result<Runtime, KvError> {
    let (lib_dir, found_by, searched) = match &cfg.nixl_lib_dir {
        Some(dir) => {
            if !dir.join(CAPI_LIB).is_file() {
                return Err(missing(format!(
                    "the NIXL runtime is missing: {} does not exist \
                     ({} names a directory holding {CAPI_LIB})",
                    dir.join(CAPI_LIB).display(),
                    rngd_api::env::AIRM_KV_NIXL_LIB_DIR
                )));
            }
            (
                dir.clone(),
                rngd_api::env::AIRM_KV_NIXL_LIB_DIR.to_string(),
                vec![dir.clone()],
            )
        }
        None => {
            let mut searched = Vec::new();
            let mut found = None;
            'outer: for site in site_dirs() {
                for sub in WHEEL_LIB_DIRS {
                    let dir = site.join(sub);
                    if dir.join(CAPI_LIB).is_file() {
                        found = Some(dir);
                        break 'outer;
                    }
                    searched.push(dir);
                }
            }
            let Some(dir) = found else {
                return Err(missing(format!(
                    "the NIXL runtime is missing: no {CAPI_LIB} in {} and {} is unset; \
                     install the nixl-cu12 wheel (`pip install nixl-cu12==1.5.1`, as \
                     tests/setup.sh does) or point {} at a NIXL build",
                    searched
                        .iter()
                        .map(|d| d.display().to_string())
                        .collect::<Vec<_>>()
                        .join(", "),
                    rngd_api::env::AIRM_KV_NIXL_LIB_DIR,
                    rngd_api::env::AIRM_KV_NIXL_LIB_DIR
                )));
            };
            searched.push(dir.clone());
            let by = format!(
                "the nixl wheel in {}",
                dir.parent().unwrap_or(&dir).display()
            );
            (dir, by, searched)
        }
    };
    let lib_dir = std::fs::canonicalize(&lib_dir).unwrap_or(lib_dir);
    let plugin_dir = cfg
        .nixl_plugin_dir
        .clone()
        .unwrap_or_else(|| lib_dir.join("plugins"));
    if !plugin_dir.join(UCX_PLUGIN).is_file() {
        return Err(missing(format!(
            "the NIXL UCX plugin is missing: {} does not exist (set {} to NIXL's plugin directory)",
            plugin_dir.join(UCX_PLUGIN).display(),
            rngd_api::env::AIRM_KV_NIXL_PLUGIN_DIR
        )));
    }
    Ok(Runtime {
        capi: lib_dir.join(CAPI_LIB),
        lib_dir,
        plugin_dir,
        found_by,
        searched,
    })
}

/// The runtime loaded in this process, once.
static LOADED: OnceLock<Runtime> = OnceLock::new();
/// Serializes loading attempts.
static LOADING: Mutex<()> = Mutex::new(());

/// The runtime this process loaded, if any.
pub fn loaded() -> Option<&'static Runtime> {
    LOADED.get()
}

/// Locates and loads the runtime (once per process; later calls return the
/// first one, whatever `cfg` says). An error names what is missing.
pub fn load(cfg: &TransportConfig) -> Result<&'static Runtime, KvError> {
    if let Some(rt) = LOADED.get() {
        return Ok(rt);
    }
    let _guard = LOADING.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(rt) = LOADED.get() {
        return Ok(rt);
    }
    let rt = locate(cfg)?;
    if std::env::var_os("NIXL_PLUGIN_DIR").as_deref() != Some(rt.plugin_dir.as_os_str()) {
        // SAFETY: done once, under LOADING, before the first NIXL agent
        // exists (NIXL reads the variable when its plugin manager starts);
        // no other code of this crate reads or writes the environment
        // concurrently.
        unsafe { std::env::set_var("NIXL_PLUGIN_DIR", &rt.plugin_dir) };
    }
    dlopen_abs(&rt.capi)?;
    if nixl_sys::is_stub() {
        return Err(missing(format!(
            "{} was loaded but the NIXL bindings do not see it (a library of \
             another soname?)",
            rt.capi.display()
        )));
    }
    tracing::info!(capi = %rt.capi.display(), plugins = %rt.plugin_dir.display(), found_by = %rt.found_by, "nixl-ucx: NIXL runtime loaded");
    Ok(LOADED.get_or_init(|| rt))
}

/// Loads the library at `path` for the life of the process.
fn dlopen_abs(path: &Path) -> Result<(), KvError> {
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| missing(format!("bad runtime path {}", path.display())))?;
    // SAFETY: FFI call with a valid NUL-terminated path; the handle is never
    // closed (the library stays loaded for the process's life).
    let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if handle.is_null() {
        // SAFETY: dlerror returns NULL or a NUL-terminated string valid
        // until the next dl* call on this thread.
        let err = unsafe {
            let e = libc::dlerror();
            if e.is_null() {
                "unknown error".to_string()
            } else {
                CStr::from_ptr(e).to_string_lossy().into_owned()
            }
        };
        return Err(missing(format!(
            "the NIXL runtime {} cannot be loaded: {err}",
            path.display()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_explicit_directory_without_the_library_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = TransportConfig {
            nixl_lib_dir: Some(dir.path().to_path_buf()),
            ..TransportConfig::default()
        };
        let err = locate(&cfg).unwrap_err().to_string();
        assert!(
            err.contains("nixl-ucx")
                && err.contains(CAPI_LIB)
                && err.contains("AIRM_KV_NIXL_LIB_DIR"),
            "{err}"
        );
        // The library without the UCX plugin: the plugin is named.
        std::fs::write(dir.path().join(CAPI_LIB), b"").unwrap();
        let err = locate(&cfg).unwrap_err().to_string();
        assert!(
            err.contains(UCX_PLUGIN) && err.contains("AIRM_KV_NIXL_PLUGIN_DIR"),
            "{err}"
        );
        std::fs::create_dir(dir.path().join("plugins")).unwrap();
        std::fs::write(dir.path().join("plugins").join(UCX_PLUGIN), b"").unwrap();
        let rt = locate(&cfg).unwrap();
        assert_eq!(rt.plugins(), vec!["UCX".to_string()]);
        assert_eq!(rt.found_by, "AIRM_KV_NIXL_LIB_DIR");
    }
}
