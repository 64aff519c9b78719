//! The in-place seam: a producer (the engine's export) writes one request's
//! wire blobs straight into memory a transport owns (`shm`: the mapped
//! request file), checksumming each stretch while it is still in cache, so
//! the bytes are copied once between the engine's cache and the reader.

use crate::{Crc32, KvLayout, WireError};

/// What a sink has room for: the blobs of `tokens` valid positions of
/// `layout` in wire version `wire` (`layout.blob_count()` blobs of
/// [`KvLayout::wire_blob_bytes`] each).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SinkShape {
    /// Shape of the cache.
    pub layout: KvLayout,
    /// Valid positions.
    pub tokens: usize,
    /// Wire version the blobs are written in.
    pub wire: u32,
}

impl SinkShape {
    /// Bytes of each blob (all blobs have the same size).
    pub fn blob_bytes(&self) -> Result<usize, WireError> {
        self.layout.wire_blob_bytes(self.wire, self.tokens)
    }
}

/// Room for one request's blobs, written in place. A producer writes every
/// byte of every blob ([`KvSink::blob_mut`]) and then seals it with the
/// CRC-32 of what it wrote, computed in the same pass
/// ([`KvSink::seal`]); the owner publishes only a sink whose blobs are all
/// sealed. Dropping an unsealed sink loses nothing but the room.
pub trait KvSink: Send {
    /// What the sink was made for.
    fn shape(&self) -> SinkShape;
    /// Blob `i`, to be written whole. Panics if `i` is out of range.
    fn blob_mut(&mut self, i: usize) -> &mut [u8];
    /// Records blob `i` as written, with the CRC-32 of its bytes.
    fn seal(&mut self, i: usize, crc: u32);
}

/// Bytes copied (and checksummed) per stretch by [`fill_from`]: small
/// enough that the checksum reads them from the first-level caches.
const STRETCH: usize = 16 * 1024;

/// Fills `sink` from blobs already in memory, copying and checksumming
/// stretch by stretch (one pass over the source): the producer for a
/// cache that exists as blobs. The count and every size must match the
/// sink's shape.
pub fn fill_from<B: AsRef<[u8]>>(sink: &mut dyn KvSink, blobs: &[B]) -> Result<(), WireError> {
    let shape = sink.shape();
    let want = shape.blob_bytes()?;
    if blobs.len() != shape.layout.blob_count() {
        return Err(WireError::BlobCount {
            expected: shape.layout.blob_count(),
            actual: blobs.len(),
        });
    }
    for (index, b) in blobs.iter().enumerate() {
        let src = b.as_ref();
        if src.len() != want {
            return Err(WireError::BlobSize {
                index,
                expected: want as u64,
                actual: src.len() as u64,
            });
        }
        let dst = sink.blob_mut(index);
        let mut crc = Crc32::new();
        for (d, s) in dst.chunks_mut(STRETCH).zip(src.chunks(STRETCH)) {
            d.copy_from_slice(s);
            crc.update(d);
        }
        sink.seal(index, crc.finish());
    }
    Ok(())
}

/// A sink in ordinary memory: the test double, and what a caller without a
/// transport's room writes into.
#[derive(Debug, Clone)]
pub struct VecSink {
    shape: SinkShape,
    /// The blobs as written.
    pub blobs: Vec<Vec<u8>>,
    /// The seal of each blob, `None` until sealed.
    pub crcs: Vec<Option<u32>>,
}

impl VecSink {
    /// Room for `shape`, zero-filled.
    pub fn new(shape: SinkShape) -> Result<Self, WireError> {
        let n = shape.blob_bytes()?;
        let count = shape.layout.blob_count();
        Ok(VecSink {
            shape,
            blobs: vec![vec![0; n]; count],
            crcs: vec![None; count],
        })
    }
}

impl KvSink for VecSink {
    fn shape(&self) -> SinkShape {
        self.shape
    }
    fn blob_mut(&mut self, i: usize) -> &mut [u8] {
        &mut self.blobs[i]
    }
    fn seal(&mut self, i: usize, crc: u32) {
        self.crcs[i] = Some(crc);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Dtype, WIRE_TRIMMED, crc32};

    fn shape(tokens: usize) -> SinkShape {
        SinkShape {
            layout: KvLayout {
                layers: 2,
                kv_heads: 2,
                head_dim: 4,
                seq_len: 8,
                dtype: Dtype::Bf16,
            },
            tokens,
            wire: WIRE_TRIMMED,
        }
    }

    #[test]
    fn fill_copies_every_byte_and_seals_with_the_checksum_of_the_bytes() {
        let s = shape(3);
        let n = s.blob_bytes().unwrap();
        let blobs: Vec<Vec<u8>> = (0..4)
            .map(|i| (0..n).map(|j| (i * 31 + j) as u8).collect())
            .collect();
        let mut sink = VecSink::new(s).unwrap();
        fill_from(&mut sink, &blobs).unwrap();
        assert_eq!(sink.blobs, blobs);
        let want: Vec<Option<u32>> = blobs.iter().map(|b| Some(crc32(b))).collect();
        assert_eq!(sink.crcs, want);
    }

    #[test]
    fn fill_refuses_a_wrong_count_or_size_before_sealing_it() {
        let s = shape(3);
        let n = s.blob_bytes().unwrap();
        let mut sink = VecSink::new(s).unwrap();
        assert_eq!(
            fill_from(&mut sink, &vec![vec![0u8; n]; 3]),
            Err(WireError::BlobCount {
                expected: 4,
                actual: 3
            })
        );
        let mut bad = vec![vec![0u8; n]; 4];
        bad[2].push(0);
        assert!(matches!(
            fill_from(&mut sink, &bad),
            Err(WireError::BlobSize { index: 2, .. })
        ));
        assert_eq!(sink.crcs[2], None);
    }
}
