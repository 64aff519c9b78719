//! The weights' identity: a `weight_version` computed from the bytes of every
//! tensor at load, so two engines agree on it exactly when they hold the same
//! weights, whatever their files are called.
//!
//! Each tensor contributes its name, storage type, dimensions and the SHA-256
//! of its stored bytes (quantized blocks as they are in the file: what
//! `sha256sum` of the tensor's byte range gives) — a [`TensorRecord`]; the
//! version is the first 64 bits of the SHA-256 over those records in name
//! order, as 16 lower-case hex digits. A decode worker compares it with the
//! one a prefill worker signed into its KV handle before it pulls anything.
//!
//! The records are kept with the model: a weight update compares them with
//! the new file's manifest ([`MANIFEST_KEY`]) to read only the tensors whose
//! bytes changed (`crate::cpu`, `CpuEngine::reload`).

use std::collections::BTreeMap;

use sha2::{Digest, Sha256};

/// Hex digits of a [`WeightDigest::finish`] version.
pub const WEIGHT_VERSION_HEX: usize = 16;

/// The GGUF metadata key of a file's per-tensor manifest: an array of
/// strings `"<tensor name>:<sha256 of its stored bytes, 64 hex digits>"`,
/// one per tensor. With it, a weight update reads only the tensors whose
/// digest differs from the running model's (and checks each one it reads).
pub const MANIFEST_KEY: &str = "rngd_pd.tensor_sha256";

/// What identifies one tensor: storage type, dimensions, content digest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorRecord {
    /// The GGML storage type as the loader names it (`Q4_1`, `F32`, …).
    pub dtype: String,
    /// Dimensions as the file lists them.
    pub dims: Vec<usize>,
    /// SHA-256 of the stored bytes.
    pub sha256: [u8; 32],
}

/// Collects the tensors of one model and yields its `weight_version`.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct WeightDigest {
    tensors: BTreeMap<String, TensorRecord>,
}

/// The SHA-256 of `bytes`.
pub fn sha256(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

/// 64 lower-case hex digits → the 32 bytes, or `None`.
pub fn parse_sha256(hex: &str) -> Option<[u8; 32]> {
    if hex.len() != 64 || !hex.bytes().all(|c| c.is_ascii_hexdigit()) {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

impl WeightDigest {
    /// An empty digest.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds one tensor: its name, storage type (e.g. `q4_1`, `f32`),
    /// dimensions and stored bytes. A name added twice keeps the last.
    pub fn add(&mut self, name: &str, dtype: &str, dims: &[usize], bytes: &[u8]) {
        self.insert(
            name,
            TensorRecord {
                dtype: dtype.to_string(),
                dims: dims.to_vec(),
                sha256: sha256(bytes),
            },
        );
    }

    /// Adds one tensor by its record (its bytes' digest known already).
    pub fn insert(&mut self, name: &str, record: TensorRecord) {
        self.tensors.insert(name.to_string(), record);
    }

    /// The record of `name`.
    pub fn get(&self, name: &str) -> Option<&TensorRecord> {
        self.tensors.get(name)
    }

    /// Every tensor, in name order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &TensorRecord)> {
        self.tensors.iter().map(|(n, r)| (n.as_str(), r))
    }

    /// Whether `name` was added.
    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// Tensors added.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// Whether nothing was added.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// The `weight_version`: 16 hex digits.
    pub fn finish(&self) -> String {
        let mut h = Sha256::new();
        h.update(b"rngd-pd weights v1\n");
        for (name, r) in &self.tensors {
            h.update((name.len() as u64).to_le_bytes());
            h.update(name.as_bytes());
            h.update((r.dtype.len() as u64).to_le_bytes());
            h.update(r.dtype.as_bytes());
            h.update((r.dims.len() as u64).to_le_bytes());
            for d in &r.dims {
                h.update((*d as u64).to_le_bytes());
            }
            h.update(r.sha256);
        }
        let full = h.finalize();
        full.iter()
            .take(WEIGHT_VERSION_HEX / 2)
            .map(|b| format!("{b:02x}"))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn digest(parts: &[(&str, &str, &[usize], &[u8])]) -> String {
        let mut d = WeightDigest::new();
        for (n, t, dims, b) in parts {
            d.add(n, t, dims, b);
        }
        d.finish()
    }

    #[test]
    fn the_version_follows_every_byte_name_type_and_shape() {
        let base = digest(&[("a", "f32", &[2], &[1, 2, 3, 4]), ("b", "q4_1", &[4], &[9])]);
        assert_eq!(base.len(), WEIGHT_VERSION_HEX);
        assert!(base.bytes().all(|c| c.is_ascii_hexdigit()));
        // Order of loading does not matter.
        assert_eq!(
            base,
            digest(&[("b", "q4_1", &[4], &[9]), ("a", "f32", &[2], &[1, 2, 3, 4])])
        );
        for changed in [
            digest(&[("a", "f32", &[2], &[1, 2, 3, 5]), ("b", "q4_1", &[4], &[9])]),
            digest(&[("a", "f16", &[2], &[1, 2, 3, 4]), ("b", "q4_1", &[4], &[9])]),
            digest(&[
                ("a", "f32", &[1, 2], &[1, 2, 3, 4]),
                ("b", "q4_1", &[4], &[9]),
            ]),
            digest(&[("c", "f32", &[2], &[1, 2, 3, 4]), ("b", "q4_1", &[4], &[9])]),
            digest(&[("a", "f32", &[2], &[1, 2, 3, 4])]),
        ] {
            assert_ne!(base, changed);
        }
    }
}
