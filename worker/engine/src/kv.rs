//! One sequence's KV cache, held exactly as the NPU wire format carries it:
//! per layer K `[kv_heads, head_dim, S]` and V `[kv_heads, S, head_dim]`, bf16.
//!
//! Every value is rounded to bf16 when it is written, so exporting the cache is
//! a copy of its valid positions, and a decode that starts from imported bytes
//! sees exactly the values of one that continues in place. The attention
//! kernel widens bf16 to f32 as it reads (a shift: exact).

use bytes::Bytes;
use half::bf16;
use rngd_kv_wire::{BlobKind, Crc32, Dtype, KvLayout, KvSink, WIRE_FULL, WIRE_TRIMMED};

use crate::{EngineError, KvCache};

/// Rounds to the nearest bf16 (ties to even), as its bits.
#[inline]
pub(crate) fn to_bf16(x: f32) -> u16 {
    bf16::from_f32(x).to_bits()
}

/// Widens bf16 bits to f32 (exact).
#[inline(always)]
pub(crate) fn from_bf16(x: u16) -> f32 {
    f32::from_bits(u32::from(x) << 16)
}

/// Writes bf16 values as little-endian bytes (`out` is twice as long).
#[inline]
fn put(out: &mut [u8], src: &[u16]) {
    for (o, x) in out.chunks_exact_mut(2).zip(src) {
        o.copy_from_slice(&x.to_le_bytes());
    }
}

/// A sequence's cache: `tokens` valid positions out of `layout.seq_len`.
#[derive(Debug, Clone)]
pub(crate) struct SeqCache {
    pub(crate) layout: KvLayout,
    /// Valid positions.
    pub(crate) tokens: usize,
    /// Per layer, K `[kv_heads, head_dim, S]` as bf16 bits (the wire layout).
    pub(crate) k: Vec<Vec<u16>>,
    /// Per layer, V `[kv_heads, S, head_dim]` as bf16 bits (the wire layout).
    pub(crate) v: Vec<Vec<u16>>,
}

impl SeqCache {
    /// An empty cache.
    pub(crate) fn new(layout: KvLayout) -> Self {
        let n = layout.blob_elems();
        SeqCache {
            layout,
            tokens: 0,
            k: (0..layout.layers).map(|_| vec![0; n]).collect(),
            v: (0..layout.layers).map(|_| vec![0; n]).collect(),
        }
    }

    /// Forgets the contents (the buffers are reused; stale values past `tokens` are never read).
    pub(crate) fn reset(&mut self) {
        self.tokens = 0;
    }

    /// Stores key and value vectors (`[kv_heads * head_dim]` each) of `layer` at `pos`.
    pub(crate) fn write(&mut self, layer: usize, pos: usize, k: &[f32], v: &[f32]) {
        let l = self.layout;
        let (kc, vc) = (&mut self.k[layer], &mut self.v[layer]);
        // The K values land in `kv_heads · head_dim` rows 1 KB apart (at
        // S = 512): ask for all their lines before the first store waits.
        #[cfg(target_arch = "x86_64")]
        for row in 0..l.kv_heads * l.head_dim {
            let at = &kc[row * l.seq_len + pos];
            // SAFETY: SSE is part of the x86-64 baseline, and a prefetch only
            // hints (the address is an element of the slice).
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                    (at as *const u16).cast(),
                )
            };
        }
        for h in 0..l.kv_heads {
            let at = l.v_offset(h, pos, 0);
            for d in 0..l.head_dim {
                kc[l.k_offset(h, d, pos)] = to_bf16(k[h * l.head_dim + d]);
                vc[at + d] = to_bf16(v[h * l.head_dim + d]);
            }
        }
    }

    /// The cache as wire blobs in the trimmed wire (`K0, V0, K1, V1, …`,
    /// bf16 little-endian, only the valid positions of each row:
    /// [`WIRE_TRIMMED`]): what a prefill hands over.
    pub(crate) fn export(&self) -> KvCache {
        self.export_as(WIRE_TRIMMED)
    }

    /// The cache's description without its blobs (what a prefill answers
    /// once [`SeqCache::export_into`] wrote them elsewhere).
    pub(crate) fn export_none(&self) -> KvCache {
        KvCache {
            layout: self.layout,
            tokens: self.tokens,
            wire: WIRE_TRIMMED,
            blobs: Vec::new(),
        }
    }

    /// The cache as wire blobs in wire version `wire`: [`WIRE_TRIMMED`], or
    /// [`WIRE_FULL`] (S-wide, padded with zeros: a reused buffer may hold
    /// stale values of an earlier request there).
    pub(crate) fn export_as(&self, wire: u32) -> KvCache {
        let l = self.layout;
        let mut blobs = Vec::with_capacity(l.blob_count());
        for i in 0..l.blob_count() {
            let (layer, kind) = KvLayout::blob_of(i);
            let src = match kind {
                BlobKind::K => &self.k[layer],
                BlobKind::V => &self.v[layer],
            };
            let out = if wire == WIRE_FULL {
                let mut out = vec![0u8; src.len() * 2];
                for r in l.wire_rows(kind, self.tokens) {
                    put(&mut out[2 * r.start..2 * r.end], &src[r]);
                }
                out
            } else {
                let mut out = vec![0u8; l.kv_heads * l.head_dim * self.tokens * 2];
                let mut at = 0;
                for r in l.wire_rows(kind, self.tokens) {
                    let n = 2 * r.len();
                    put(&mut out[at..at + n], &src[r]);
                    at += n;
                }
                out
            };
            blobs.push(Bytes::from(out));
        }
        KvCache {
            layout: l,
            tokens: self.tokens,
            wire: if wire == WIRE_FULL {
                WIRE_FULL
            } else {
                WIRE_TRIMMED
            },
            blobs,
        }
    }

    /// Writes the cache straight into `sink` in the sink's wire version
    /// (what [`SeqCache::export_as`] would give), each row checksummed right
    /// after it is written, and seals every blob: the one copy between this
    /// cache and a transport's room. The sink must be made for this cache's
    /// layout and valid positions.
    pub(crate) fn export_into(&self, sink: &mut dyn KvSink) -> Result<(), EngineError> {
        let l = self.layout;
        let shape = sink.shape();
        if shape.layout != l || shape.tokens != self.tokens {
            return Err(EngineError::InvalidRequest(format!(
                "a KV sink for {} positions of {:?} cannot take this cache of {} positions of {:?}",
                shape.tokens, shape.layout, self.tokens, l
            )));
        }
        let want = shape
            .blob_bytes()
            .map_err(|e| EngineError::InvalidRequest(e.to_string()))?;
        for i in 0..l.blob_count() {
            let (layer, kind) = KvLayout::blob_of(i);
            let src = match kind {
                BlobKind::K => &self.k[layer],
                BlobKind::V => &self.v[layer],
            };
            let out = sink.blob_mut(i);
            if out.len() != want {
                return Err(EngineError::InvalidRequest(format!(
                    "KV sink blob {i} has {} bytes, the wire needs {want}",
                    out.len()
                )));
            }
            let mut crc = Crc32::new();
            let mut at = 0;
            for r in l.wire_rows(kind, self.tokens) {
                let n = 2 * r.len();
                let row = &mut out[at..at + n];
                put(row, &src[r.clone()]);
                crc.update(row);
                at += n;
                if shape.wire == WIRE_FULL {
                    // The S-wide row's padding: zeros (stale values never travel).
                    let pad = 2
                        * (l.seq_len - self.tokens)
                        * if kind == BlobKind::V { l.head_dim } else { 1 };
                    let zeros = &mut out[at..at + pad];
                    zeros.fill(0);
                    crc.update(zeros);
                    at += pad;
                }
            }
            sink.seal(i, crc.finish());
        }
        Ok(())
    }

    /// Loads wire blobs into this cache (whose layout must match). Only the
    /// valid positions are read: past them a decode writes before it reads.
    pub(crate) fn import(&mut self, kv: &KvCache) -> Result<(), EngineError> {
        let l = self.layout;
        if kv.layout != l {
            return Err(EngineError::InvalidRequest(format!(
                "KV layout {:?} does not match this engine's {:?}",
                kv.layout, l
            )));
        }
        if kv.layout.dtype != Dtype::Bf16 {
            return Err(EngineError::InvalidRequest(
                "only bf16 KV caches are supported".into(),
            ));
        }
        if kv.blobs.len() != l.blob_count() {
            return Err(EngineError::InvalidRequest(format!(
                "expected {} KV blobs, got {}",
                l.blob_count(),
                kv.blobs.len()
            )));
        }
        if kv.tokens > l.seq_len {
            return Err(EngineError::InvalidRequest(format!(
                "KV cache claims {} tokens, more than S = {}",
                kv.tokens, l.seq_len
            )));
        }
        let want = l
            .wire_blob_bytes(kv.wire, kv.tokens)
            .map_err(|e| EngineError::InvalidRequest(e.to_string()))?;
        for (i, blob) in kv.blobs.iter().enumerate() {
            if blob.len() != want {
                return Err(EngineError::InvalidRequest(format!(
                    "KV blob {i} has {} bytes, wire version {} of this layout needs {want}",
                    blob.len(),
                    kv.wire
                )));
            }
        }
        for (i, blob) in kv.blobs.iter().enumerate() {
            let (layer, kind) = KvLayout::blob_of(i);
            let dst = match kind {
                BlobKind::K => &mut self.k[layer],
                BlobKind::V => &mut self.v[layer],
            };
            // The trimmed wire carries the rows back to back; the S-wide one
            // at their places.
            let mut at = 0;
            for r in l.wire_rows(kind, kv.tokens) {
                let src = if kv.wire == WIRE_FULL {
                    &blob[2 * r.start..2 * r.end]
                } else {
                    let n = 2 * r.len();
                    at += n;
                    &blob[at - n..at]
                };
                for (d, c) in dst[r].iter_mut().zip(src.chunks_exact(2)) {
                    *d = u16::from_le_bytes([c[0], c[1]]);
                }
            }
        }
        self.tokens = kv.tokens;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> KvLayout {
        KvLayout {
            layers: 2,
            kv_heads: 2,
            head_dim: 4,
            seq_len: 8,
            dtype: Dtype::Bf16,
        }
    }

    #[test]
    fn export_import_round_trips_and_pads_with_zeros() {
        let mut c = SeqCache::new(layout());
        for pos in 0..3 {
            for layer in 0..2 {
                let k: Vec<f32> = (0..8)
                    .map(|i| (pos * 100 + layer * 10 + i) as f32 * 0.013)
                    .collect();
                let v: Vec<f32> = k.iter().map(|x| -x).collect();
                c.write(layer, pos, &k, &v);
            }
        }
        c.tokens = 3;
        let wire = c.export_as(WIRE_FULL);
        assert_eq!(wire.blobs.len(), 4);
        assert!(wire.blobs.iter().all(|b| b.len() == layout().blob_bytes()));
        // K layout: element (head 1, dim 2, pos 1) of layer 0.
        let l = layout();
        let at = l.k_offset(1, 2, 1) * 2;
        let got = bf16::from_le_bytes([wire.blobs[0][at], wire.blobs[0][at + 1]]).to_f32();
        assert_eq!(got, from_bf16(to_bf16((100 + 4 + 2) as f32 * 0.013)));
        // Padding positions are zero.
        let pad = l.k_offset(0, 0, 5) * 2;
        assert_eq!(&wire.blobs[0][pad..pad + 2], &[0, 0]);
        let mut d = SeqCache::new(layout());
        d.import(&wire).unwrap();
        assert_eq!(d.tokens, 3);
        assert_eq!(d.export_as(WIRE_FULL), wire);
        // A reused buffer: the stale third position must not reach the wire.
        c.reset();
        c.tokens = 2;
        let wire = c.export_as(WIRE_FULL);
        for (i, blob) in wire.blobs.iter().enumerate() {
            for h in 0..l.kv_heads {
                for pos in 2..l.seq_len {
                    for dim in 0..l.head_dim {
                        let at = match KvLayout::blob_of(i).1 {
                            BlobKind::K => l.k_offset(h, dim, pos),
                            BlobKind::V => l.v_offset(h, pos, dim),
                        } * 2;
                        assert_eq!(&blob[at..at + 2], &[0, 0], "blob {i} h {h} pos {pos}");
                    }
                }
            }
        }
    }

    /// A cache with distinct values at every valid position.
    fn filled(tokens: usize) -> SeqCache {
        let mut c = SeqCache::new(layout());
        for pos in 0..tokens {
            for layer in 0..2 {
                let k: Vec<f32> = (0..8)
                    .map(|i| (pos * 100 + layer * 10 + i) as f32 * 0.017 + 0.5)
                    .collect();
                let v: Vec<f32> = k.iter().map(|x| -2.0 * x).collect();
                c.write(layer, pos, &k, &v);
            }
        }
        c.tokens = tokens;
        c
    }

    #[test]
    fn the_trimmed_wire_restores_the_s_wide_cache_exactly() {
        let l = layout();
        // 1, S/2, S-1 and S valid positions.
        for tokens in [1, l.seq_len / 2, l.seq_len - 1, l.seq_len] {
            let c = filled(tokens);
            let full = c.export_as(WIRE_FULL);
            let trimmed = c.export();
            assert_eq!(trimmed.wire, WIRE_TRIMMED);
            let per_blob = l.kv_heads * l.head_dim * tokens * 2;
            assert!(
                trimmed.blobs.iter().all(|b| b.len() == per_blob),
                "{tokens}"
            );
            // What a decode worker holds after either wire is the same, and
            // it reads back as the same S-wide blobs.
            let (mut a, mut b) = (SeqCache::new(l), SeqCache::new(l));
            a.import(&full).unwrap();
            b.import(&trimmed).unwrap();
            assert_eq!(a.tokens, b.tokens);
            assert_eq!(a.export_as(WIRE_FULL), full, "{tokens}");
            assert_eq!(b.export_as(WIRE_FULL), full, "{tokens}");
            assert_eq!(b.export(), trimmed, "{tokens}");
        }
    }

    #[test]
    fn a_wire_blob_of_the_wrong_size_or_version_is_refused() {
        let c = filled(3);
        let mut d = SeqCache::new(layout());
        let mut wrong = c.export();
        wrong.wire = 3;
        let e = d.import(&wrong).unwrap_err().to_string();
        assert!(e.contains("version 3"), "{e}");
        // Trimmed bytes labelled S-wide (and the reverse) do not fit.
        let mut mislabelled = c.export();
        mislabelled.wire = WIRE_FULL;
        assert!(d.import(&mislabelled).is_err());
        let mut mislabelled = c.export_as(WIRE_FULL);
        mislabelled.wire = WIRE_TRIMMED;
        assert!(d.import(&mislabelled).is_err());
    }

    #[test]
    fn import_rejects_a_foreign_layout() {
        let c = SeqCache::new(layout());
        let mut wire = c.export();
        wire.layout.seq_len = 16;
        let mut d = SeqCache::new(layout());
        assert!(matches!(
            d.import(&wire),
            Err(EngineError::InvalidRequest(_))
        ));
    }
}
