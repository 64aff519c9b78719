//! One sequence's KV cache, the NPU wire format's numbers.
//!
//! On the wire K is `[layers, kv_heads, head_dim, S]` and V `[layers,
//! kv_heads, S, head_dim]`. In memory both are `[kv_heads, S, head_dim]` per
//! layer (position-major, so attention reads the first `n` positions as one
//! contiguous run); export and import transpose K.
//! Every stored value is rounded to bf16 when it is written, so the cache holds
//! exactly the numbers the bf16 wire format carries: exporting it is lossless,
//! and a decode that starts from imported bytes sees the same values as one
//! that continues in place. The values are kept widened to f32 so that the
//! attention kernel reads them without converting.

use bytes::Bytes;
use half::bf16;
use rngd_kv_wire::{BlobKind, Dtype, KvLayout};

use crate::{EngineError, KvCache};

/// Rounds to the nearest bf16 (ties to even) and widens back.
#[inline]
pub(crate) fn round_bf16(x: f32) -> f32 {
    bf16::from_f32(x).to_f32()
}

/// A sequence's cache: `tokens` valid positions out of `layout.seq_len`.
#[derive(Debug, Clone)]
pub(crate) struct SeqCache {
    pub(crate) layout: KvLayout,
    /// Valid positions.
    pub(crate) tokens: usize,
    /// Per layer, `[kv_heads, S, head_dim]` (not the wire layout: see the module docs).
    pub(crate) k: Vec<Vec<f32>>,
    /// Per layer, `[kv_heads, S, head_dim]`.
    pub(crate) v: Vec<Vec<f32>>,
}

impl SeqCache {
    /// An empty cache.
    pub(crate) fn new(layout: KvLayout) -> Self {
        let n = layout.blob_elems();
        SeqCache {
            layout,
            tokens: 0,
            k: (0..layout.layers).map(|_| vec![0.0; n]).collect(),
            v: (0..layout.layers).map(|_| vec![0.0; n]).collect(),
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
        for h in 0..l.kv_heads {
            let at = l.v_offset(h, pos, 0);
            for d in 0..l.head_dim {
                kc[at + d] = round_bf16(k[h * l.head_dim + d]);
                vc[at + d] = round_bf16(v[h * l.head_dim + d]);
            }
        }
    }

    /// The cache as wire blobs (`K0, V0, K1, V1, …`, bf16 little-endian, padded to `S`).
    pub(crate) fn export(&self) -> KvCache {
        let mut blobs = Vec::with_capacity(self.layout.blob_count());
        let l = self.layout;
        for layer in 0..l.layers {
            // K goes out `[kv_heads, head_dim, S]`.
            // Only the valid positions are converted: the padding past
            // `tokens` goes out as zeros (a reused buffer may hold stale
            // values of an earlier request there).
            let k = &self.k[layer];
            let mut out = vec![0u8; k.len() * 2];
            for h in 0..l.kv_heads {
                for d in 0..l.head_dim {
                    for pos in 0..self.tokens {
                        let at = l.k_offset(h, d, pos) * 2;
                        let x = bf16::from_f32(k[l.v_offset(h, pos, d)]);
                        out[at..at + 2].copy_from_slice(&x.to_le_bytes());
                    }
                }
            }
            blobs.push(Bytes::from(out));
            let v = &self.v[layer];
            let mut out = vec![0u8; v.len() * 2];
            for h in 0..l.kv_heads {
                let (a, b) = (l.v_offset(h, 0, 0), l.v_offset(h, self.tokens, 0));
                for (o, x) in out[2 * a..2 * b].chunks_exact_mut(2).zip(&v[a..b]) {
                    o.copy_from_slice(&bf16::from_f32(*x).to_le_bytes());
                }
            }
            blobs.push(Bytes::from(out));
        }
        KvCache {
            layout: self.layout,
            tokens: self.tokens,
            blobs,
        }
    }

    /// Loads wire blobs into this cache (whose layout must match).
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
        for (i, blob) in kv.blobs.iter().enumerate() {
            if blob.len() != l.blob_bytes() {
                return Err(EngineError::InvalidRequest(format!(
                    "KV blob {i} has {} bytes, the layout needs {}",
                    blob.len(),
                    l.blob_bytes()
                )));
            }
            // Only positions `0..tokens` are read: past them a decode writes
            // before it reads, so the padding is never needed.
            let (layer, kind) = KvLayout::blob_of(i);
            let value = |at: usize| bf16::from_le_bytes([blob[2 * at], blob[2 * at + 1]]).to_f32();
            match kind {
                BlobKind::K => {
                    let dst = &mut self.k[layer];
                    for h in 0..l.kv_heads {
                        for d in 0..l.head_dim {
                            for pos in 0..kv.tokens {
                                dst[l.v_offset(h, pos, d)] = value(l.k_offset(h, d, pos));
                            }
                        }
                    }
                }
                BlobKind::V => {
                    for h in 0..l.kv_heads {
                        let (a, b) = (l.v_offset(h, 0, 0), l.v_offset(h, kv.tokens, 0));
                        for (d, c) in self.v[layer][a..b]
                            .iter_mut()
                            .zip(blob[2 * a..2 * b].chunks_exact(2))
                        {
                            *d = bf16::from_le_bytes([c[0], c[1]]).to_f32();
                        }
                    }
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
        let wire = c.export();
        assert_eq!(wire.blobs.len(), 4);
        assert!(wire.blobs.iter().all(|b| b.len() == layout().blob_bytes()));
        // K layout: element (head 1, dim 2, pos 1) of layer 0.
        let l = layout();
        let at = l.k_offset(1, 2, 1) * 2;
        let got = bf16::from_le_bytes([wire.blobs[0][at], wire.blobs[0][at + 1]]).to_f32();
        assert_eq!(got, round_bf16((100 + 4 + 2) as f32 * 0.013));
        // Padding positions are zero.
        let pad = l.k_offset(0, 0, 5) * 2;
        assert_eq!(&wire.blobs[0][pad..pad + 2], &[0, 0]);
        let mut d = SeqCache::new(layout());
        d.import(&wire).unwrap();
        assert_eq!(d.tokens, 3);
        assert_eq!(d.export(), wire);
        // A reused buffer: the stale third position must not reach the wire.
        c.reset();
        c.tokens = 2;
        let wire = c.export();
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
