//! The weights' identity: a `weight_version` computed from the bytes of every
//! tensor at load, so two engines agree on it exactly when they hold the same
//! weights, whatever their files are called.
//!
//! Each tensor contributes its name, storage type, dimensions and the SHA-256
//! of its stored bytes (quantized blocks as they are in the file); the
//! version is the first 64 bits of the SHA-256 over those records in name
//! order, as 16 lower-case hex digits. A decode worker compares it with the
//! one a prefill worker signed into its KV handle before it pulls anything.

use std::collections::BTreeMap;

use sha2::{Digest, Sha256};

/// Hex digits of a [`WeightDigest::finish`] version.
pub const WEIGHT_VERSION_HEX: usize = 16;

/// Collects the tensors of one model and yields its `weight_version`.
#[derive(Debug, Default, Clone)]
pub struct WeightDigest {
    tensors: BTreeMap<String, [u8; 32]>,
}

impl WeightDigest {
    /// An empty digest.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds one tensor: its name, storage type (e.g. `q4_1`, `f32`),
    /// dimensions and stored bytes. A name added twice keeps the last.
    pub fn add(&mut self, name: &str, dtype: &str, dims: &[usize], bytes: &[u8]) {
        let mut h = Sha256::new();
        h.update((dtype.len() as u64).to_le_bytes());
        h.update(dtype.as_bytes());
        h.update((dims.len() as u64).to_le_bytes());
        for d in dims {
            h.update((*d as u64).to_le_bytes());
        }
        h.update(bytes);
        self.tensors.insert(name.to_string(), h.finalize().into());
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
        for (name, d) in &self.tensors {
            h.update((name.len() as u64).to_le_bytes());
            h.update(name.as_bytes());
            h.update(d);
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
