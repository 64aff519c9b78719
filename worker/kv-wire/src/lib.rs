//! The KV-cache wire format shared by every rngd-pd component.
//!
//! This crate owns four things and nothing else:
//! - [`KvLayout`]: the shape of one request's KV cache as the NPU graphs lay it
//!   out: K as `[layers, kv_heads, head_dim, S]`, V as
//!   `[layers, kv_heads, S, head_dim]`, one blob per layer per K/V, where `S`
//!   is the compiled context length;
//! - [`KvHandle`]: what a prefill worker hands to a decode worker so that it can
//!   find and verify the blobs (serde, so it travels inside JSON), with the
//!   wire version its blobs are in ([`WIRE_FULL`]: S positions per row;
//!   [`WIRE_TRIMMED`]: only the valid ones, [`KvLayout::wire_rows`]);
//! - checksums ([`crc32`]) and bf16/f16 conversion helpers;
//! - [`sink`]: the seam through which a producer writes blobs in place into
//!   a transport's room.
//!
//! The normative description is `docs/kv-wire.md`.

use serde::{Deserialize, Serialize};

pub mod sink;
pub use sink::{KvSink, SinkShape};

/// Element type of the cache on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    /// bfloat16, the default (what the engines keep internally too).
    Bf16,
    /// IEEE half precision.
    F16,
}

impl Dtype {
    /// Bytes per element.
    pub const fn size(self) -> usize {
        2
    }
}

/// Which half of a layer's cache a blob holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BlobKind {
    /// Keys, laid out `[kv_heads, head_dim, S]` within the layer.
    K,
    /// Values, laid out `[kv_heads, S, head_dim]` within the layer.
    V,
}

/// Shape of one request's KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct KvLayout {
    /// Transformer layers.
    pub layers: usize,
    /// Key/value heads per layer (grouped-query attention).
    pub kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// Compiled context length `S`: positions per sequence, valid or not.
    pub seq_len: usize,
    /// Element type.
    pub dtype: Dtype,
}

/// Wire version 1: every blob holds all `S` positions of each row (the
/// NPU's layout as is; past `tokens` it is padding). A handle without a
/// `wire` field is in this version.
pub const WIRE_FULL: u32 = 1;
/// Wire version 2: every blob holds only the valid positions, each row of
/// the S-wide layout cut to its first `tokens` positions (K: rows of
/// `tokens` values per (head, dim); V: the first `tokens × head_dim` values
/// per head), rows back to back in layout order. The receiver restores the
/// S-wide layout. Bytes per blob: `kv_heads × head_dim × tokens × 2`.
pub const WIRE_TRIMMED: u32 = 2;

/// Errors of this crate.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum WireError {
    /// A layout with a zero dimension.
    #[error("invalid KV layout: {0}")]
    InvalidLayout(String),
    /// A blob whose length does not match the layout.
    #[error("blob {index} has {actual} bytes, the layout needs {expected}")]
    BlobSize {
        /// Blob index.
        index: usize,
        /// Length the layout requires.
        expected: u64,
        /// Length found.
        actual: u64,
    },
    /// Wrong number of blobs.
    #[error("expected {expected} blobs, got {actual}")]
    BlobCount {
        /// Number the layout requires.
        expected: usize,
        /// Number found.
        actual: usize,
    },
    /// A wire version this build does not read.
    #[error(
        "KV wire version {0} is not one this worker reads (1: S-wide blobs, 2: trimmed to the valid positions)"
    )]
    UnknownWire(u32),
    /// A blob whose checksum does not match the handle.
    #[error("CRC-32 mismatch on blob {index}: expected {expected:08x}, got {actual:08x}")]
    Crc {
        /// Blob index.
        index: usize,
        /// Checksum in the handle.
        expected: u32,
        /// Checksum of the bytes received.
        actual: u32,
    },
}

impl KvLayout {
    /// Llama-3.1-8B at S = 512: 32 layers, 8 KV heads, head_dim 128 (64 blobs of 1 MiB).
    pub const LLAMA31_8B_S512: KvLayout = KvLayout {
        layers: 32,
        kv_heads: 8,
        head_dim: 128,
        seq_len: 512,
        dtype: Dtype::Bf16,
    };

    /// Checks that no dimension is zero.
    pub fn validate(&self) -> Result<(), WireError> {
        if self.layers == 0 || self.kv_heads == 0 || self.head_dim == 0 || self.seq_len == 0 {
            return Err(WireError::InvalidLayout(format!("{self:?}")));
        }
        Ok(())
    }

    /// Elements in one blob (one layer's K or V).
    pub const fn blob_elems(&self) -> usize {
        self.kv_heads * self.head_dim * self.seq_len
    }

    /// Bytes in one blob. K and V blobs have the same size.
    pub const fn blob_bytes(&self) -> usize {
        self.blob_elems() * self.dtype.size()
    }

    /// Number of blobs per request: one K and one V per layer.
    pub const fn blob_count(&self) -> usize {
        2 * self.layers
    }

    /// Bytes per request (all blobs).
    pub const fn request_bytes(&self) -> usize {
        self.blob_bytes() * self.blob_count()
    }

    /// Bytes of cache one token occupies (K and V over all layers).
    pub const fn bytes_per_token(&self) -> usize {
        2 * self.layers * self.kv_heads * self.head_dim * self.dtype.size()
    }

    /// Blob order on the wire: `K0, V0, K1, V1, …`.
    pub const fn blob_index(layer: usize, kind: BlobKind) -> usize {
        2 * layer
            + match kind {
                BlobKind::K => 0,
                BlobKind::V => 1,
            }
    }

    /// Inverse of [`KvLayout::blob_index`].
    pub const fn blob_of(index: usize) -> (usize, BlobKind) {
        (
            index / 2,
            if index.is_multiple_of(2) {
                BlobKind::K
            } else {
                BlobKind::V
            },
        )
    }

    /// The rows of a blob of `kind` as element ranges of the S-wide blob,
    /// each cut to the first `tokens` positions: what wire version 2 carries,
    /// back to back, in this order.
    pub fn wire_rows(
        &self,
        kind: BlobKind,
        tokens: usize,
    ) -> impl Iterator<Item = std::ops::Range<usize>> + use<> {
        // K: one row of `S` values per (head, dim); V: one row of
        // `S × head_dim` values per head.
        let (rows, stride, len) = match kind {
            BlobKind::K => (self.kv_heads * self.head_dim, self.seq_len, tokens),
            BlobKind::V => (
                self.kv_heads,
                self.seq_len * self.head_dim,
                tokens * self.head_dim,
            ),
        };
        (0..rows).map(move |r| r * stride..r * stride + len)
    }

    /// Bytes of one blob in wire version `wire` for `tokens` valid
    /// positions (K and V alike).
    pub fn wire_blob_bytes(&self, wire: u32, tokens: usize) -> Result<usize, WireError> {
        match wire {
            WIRE_FULL => Ok(self.blob_bytes()),
            WIRE_TRIMMED => Ok(self.kv_heads * self.head_dim * tokens * self.dtype.size()),
            other => Err(WireError::UnknownWire(other)),
        }
    }

    /// Element offset of `(head, dim, pos)` inside a K blob (`[kv_heads, head_dim, S]`).
    pub const fn k_offset(&self, head: usize, dim: usize, pos: usize) -> usize {
        (head * self.head_dim + dim) * self.seq_len + pos
    }

    /// Element offset of `(head, pos, dim)` inside a V blob (`[kv_heads, S, head_dim]`).
    pub const fn v_offset(&self, head: usize, pos: usize, dim: usize) -> usize {
        (head * self.seq_len + pos) * self.head_dim + dim
    }
}

/// Size and checksum of one blob.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlobMeta {
    /// Length in bytes.
    pub len: u64,
    /// CRC-32 (IEEE, as `crc32fast`) of the bytes.
    pub crc32: u32,
}

/// Everything a decode worker needs to fetch and verify one request's cache.
///
/// Serialized inside `kv_transfer_params` of the PD protocol.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvHandle {
    /// Request id (sanitized by the transports before use in a path or key).
    pub request_id: String,
    /// Transport name from the registry (`shm`, `tcp`, `nixl-ucx`).
    pub transport: String,
    /// Transport-specific location: a directory for `shm`, `host:port` for `tcp`.
    pub location: String,
    /// Shape of the cache.
    pub layout: KvLayout,
    /// Valid positions (prompt tokens whose K/V were computed); the rest of `S` is padding.
    pub tokens: usize,
    /// Wire version of the blobs ([`WIRE_FULL`], [`WIRE_TRIMMED`]). Absent
    /// in JSON means [`WIRE_FULL`], and a version-1 handle is written
    /// without it, exactly as before versions existed (so its signature
    /// does not change).
    #[serde(default = "wire_full", skip_serializing_if = "is_wire_full")]
    pub wire: u32,
    /// One entry per blob, in wire order (`K0, V0, K1, V1, …`).
    pub blobs: Vec<BlobMeta>,
}

fn wire_full() -> u32 {
    WIRE_FULL
}

fn is_wire_full(wire: &u32) -> bool {
    *wire == WIRE_FULL
}

impl KvHandle {
    /// Total payload bytes.
    pub fn total_bytes(&self) -> u64 {
        self.blobs.iter().map(|b| b.len).sum()
    }

    /// Checks that `blob` is blob `index` of this handle: length and CRC-32.
    pub fn verify(&self, index: usize, blob: &[u8]) -> Result<(), WireError> {
        let meta = self.blobs.get(index).ok_or(WireError::BlobCount {
            expected: self.blobs.len(),
            actual: index + 1,
        })?;
        if meta.len != blob.len() as u64 {
            return Err(WireError::BlobSize {
                index,
                expected: meta.len,
                actual: blob.len() as u64,
            });
        }
        let actual = crc32(blob);
        if actual != meta.crc32 {
            return Err(WireError::Crc {
                index,
                expected: meta.crc32,
                actual,
            });
        }
        Ok(())
    }
}

/// Builds the blob table for a set of blobs.
pub fn describe<B: AsRef<[u8]>>(blobs: &[B]) -> Vec<BlobMeta> {
    blobs
        .iter()
        .map(|b| BlobMeta {
            len: b.as_ref().len() as u64,
            crc32: crc32(b.as_ref()),
        })
        .collect()
}

/// CRC-32 (IEEE) of `bytes`.
pub fn crc32(bytes: &[u8]) -> u32 {
    crc32fast::hash(bytes)
}

/// Incremental CRC-32 (IEEE), for checking a blob chunk by chunk while it
/// arrives (the bytes are still in cache). Same result as [`crc32`] over the
/// concatenated chunks.
#[derive(Debug, Clone, Default)]
pub struct Crc32(crc32fast::Hasher);

impl Crc32 {
    /// A fresh checksum.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `bytes`.
    pub fn update(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }

    /// The checksum of everything added.
    pub fn finish(self) -> u32 {
        self.0.finalize()
    }
}

/// Converts f32 values to little-endian bf16 bytes (round to nearest even).
pub fn f32_to_bf16_bytes(values: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() * 2);
    for v in values {
        out.extend_from_slice(&half::bf16::from_f32(*v).to_le_bytes());
    }
    out
}

/// Converts little-endian bf16 bytes to f32 values. A trailing odd byte is ignored.
pub fn bf16_bytes_to_f32(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(2)
        .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama_8b_request_is_64_blobs_of_1_mib() {
        let l = KvLayout::LLAMA31_8B_S512;
        assert_eq!(l.blob_count(), 64);
        assert_eq!(l.blob_bytes(), 1 << 20);
        assert_eq!(l.request_bytes(), 67_108_864);
    }

    #[test]
    fn smollm2_bytes_per_token() {
        let l = KvLayout {
            layers: 30,
            kv_heads: 3,
            head_dim: 64,
            seq_len: 512,
            dtype: Dtype::Bf16,
        };
        assert_eq!(l.bytes_per_token(), 23_040);
    }

    #[test]
    fn blob_order_round_trips() {
        for i in 0..10 {
            let (layer, kind) = KvLayout::blob_of(i);
            assert_eq!(KvLayout::blob_index(layer, kind), i);
        }
    }

    /// One layer, 2 heads of 3 dims, S = 4.
    fn small() -> KvLayout {
        KvLayout {
            layers: 1,
            kv_heads: 2,
            head_dim: 3,
            seq_len: 4,
            dtype: Dtype::Bf16,
        }
    }

    #[test]
    fn offsets_follow_npu_layout() {
        let l = small();
        assert_eq!(l.k_offset(1, 2, 3), 23);
        assert_eq!(l.v_offset(1, 3, 2), 23);
        assert_eq!(l.k_offset(0, 1, 0), 4);
        assert_eq!(l.v_offset(0, 1, 0), 3);
    }

    #[test]
    fn verify_catches_a_flipped_byte() {
        let blobs = vec![vec![1u8; 64], vec![2u8; 64]];
        let handle = KvHandle {
            request_id: "r".into(),
            transport: "shm".into(),
            location: "/x".into(),
            layout: KvLayout::LLAMA31_8B_S512,
            tokens: 1,
            wire: WIRE_FULL,
            blobs: describe(&blobs),
        };
        handle.verify(1, &blobs[1]).unwrap();
        let mut bad = blobs[1].clone();
        bad[7] ^= 1;
        assert!(matches!(
            handle.verify(1, &bad),
            Err(WireError::Crc { index: 1, .. })
        ));
        assert!(matches!(
            handle.verify(0, &bad[..3]),
            Err(WireError::BlobSize { .. })
        ));
        let json = serde_json::to_string(&handle).unwrap();
        let back: KvHandle = serde_json::from_str(&json).unwrap();
        assert_eq!(back, handle);
        // Version 1 is written as before versions existed; 2 says so.
        assert!(!json.contains("wire"), "{json}");
        let trimmed = KvHandle {
            wire: WIRE_TRIMMED,
            ..handle
        };
        let json = serde_json::to_string(&trimmed).unwrap();
        assert!(json.contains(r#""wire":2"#), "{json}");
        assert_eq!(serde_json::from_str::<KvHandle>(&json).unwrap(), trimmed);
    }

    #[test]
    fn trimmed_rows_are_the_valid_positions_of_each_row() {
        let l = small();
        let k: Vec<_> = l.wire_rows(BlobKind::K, 2).collect();
        assert_eq!(k, vec![0..2, 4..6, 8..10, 12..14, 16..18, 20..22]);
        let v: Vec<_> = l.wire_rows(BlobKind::V, 2).collect();
        assert_eq!(v, vec![0..6, 12..18]);
        for tokens in [0, 1, 2, 4] {
            for kind in [BlobKind::K, BlobKind::V] {
                let elems: usize = l.wire_rows(kind, tokens).map(|r| r.len()).sum();
                assert_eq!(elems * 2, l.wire_blob_bytes(WIRE_TRIMMED, tokens).unwrap());
            }
        }
        assert_eq!(l.wire_blob_bytes(WIRE_FULL, 1).unwrap(), l.blob_bytes());
        assert_eq!(l.wire_blob_bytes(WIRE_TRIMMED, 4).unwrap(), l.blob_bytes());
        assert_eq!(l.wire_blob_bytes(3, 1), Err(WireError::UnknownWire(3)));
        assert!(WireError::UnknownWire(3).to_string().contains("version 3"));
    }

    #[test]
    fn incremental_crc_matches_one_shot() {
        let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let mut c = Crc32::new();
        for chunk in data.chunks(333) {
            c.update(chunk);
        }
        assert_eq!(c.finish(), crc32(&data));
        assert_eq!(
            crc32(b"123456789"),
            0xCBF4_3926,
            "the CRC-32/IEEE check value"
        );
    }

    #[test]
    fn bf16_round_trip() {
        let v = [0.0f32, 1.0, -2.5, 1e-3, 65504.0];
        let back = bf16_bytes_to_f32(&f32_to_bf16_bytes(&v));
        for (a, b) in v.iter().zip(&back) {
            assert!((a - b).abs() <= a.abs() / 128.0);
        }
    }
}
