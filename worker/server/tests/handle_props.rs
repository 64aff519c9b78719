//! Property tests of the KV handle edge of a decode worker: arbitrary bytes
//! as `kv_transfer_params` never panic the parser; arbitrary handles (any
//! blob count, lengths, layout, tokens) never panic the shape check or the
//! signature check, a made-up signature never verifies, and a signed handle
//! verifies only unchanged.

use proptest::prelude::*;
use rngd_api::pd::KvTransferParams;
use rngd_kv_wire::{BlobMeta, Dtype, KvHandle, KvLayout};
use rngd_worker::handles::{HandleError, HandleSigner, check_shape};

fn layout() -> impl Strategy<Value = KvLayout> {
    (0usize..64, 0usize..16, 0usize..256, 0usize..4096).prop_map(
        |(layers, kv_heads, head_dim, seq_len)| KvLayout {
            layers,
            kv_heads,
            head_dim,
            seq_len,
            dtype: Dtype::Bf16,
        },
    )
}

fn handle() -> impl Strategy<Value = KvHandle> {
    (
        "[0-9a-f]{0,40}",
        "[a-z-]{0,10}",
        ".{0,40}",
        layout(),
        any::<usize>(),
        prop::collection::vec((any::<u64>(), any::<u32>()), 0..300),
    )
        .prop_map(
            |(key, transport, location, layout, tokens, blobs)| KvHandle {
                request_id: key,
                transport,
                location,
                layout,
                tokens,
                wire: if tokens % 2 == 0 {
                    rngd_kv_wire::WIRE_FULL
                } else {
                    rngd_kv_wire::WIRE_TRIMMED
                },
                blobs: blobs
                    .into_iter()
                    .map(|(len, crc32)| BlobMeta { len, crc32 })
                    .collect(),
            },
        )
}

const MODEL: KvLayout = KvLayout {
    layers: 30,
    kv_heads: 3,
    head_dim: 64,
    seq_len: 512,
    dtype: Dtype::Bf16,
};

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_as_kv_transfer_params_never_panic(b in prop::collection::vec(any::<u8>(), 0..600)) {
        let _ = serde_json::from_slice::<KvTransferParams>(&b);
    }

    #[test]
    fn arbitrary_handles_never_pass_a_check_they_should_not(h in handle(), prompt in prop::collection::vec(any::<u32>(), 0..64), first in any::<u32>(), sig in "[0-9a-f]{0,140}", expires in any::<u64>(), now in any::<u64>()) {
        let shape = check_shape(&h, &MODEL, prompt.len());
        if shape.is_ok() {
            prop_assert_eq!(h.layout, MODEL);
            prop_assert_eq!(h.blobs.len(), MODEL.blob_count());
            prop_assert!(h.blobs.iter().all(|b| b.len == MODEL.blob_bytes() as u64));
            prop_assert_eq!(h.tokens, prompt.len());
        }
        let s = HandleSigner::new(b"property-test-secret-0123456789");
        let r = s.verify(&h, first, &prompt, expires, &sig, now);
        prop_assert!(matches!(r, Err(HandleError::BadSignature)), "a made-up signature verified: {:?}", r);
    }

    #[test]
    fn a_signed_handle_verifies_only_unchanged(h in handle(), prompt in prop::collection::vec(any::<u32>(), 1..64), first in any::<u32>(), flip in any::<prop::sample::Index>()) {
        let s = HandleSigner::new(b"property-test-secret-0123456789");
        let sig = s.sign(&h, first, &prompt, 1_000);
        prop_assert!(s.verify(&h, first, &prompt, 1_000, &sig, 0).is_ok());
        let mut p2 = prompt.clone();
        let i = flip.index(p2.len());
        p2[i] ^= 1;
        prop_assert_eq!(s.verify(&h, first, &p2, 1_000, &sig, 0), Err(HandleError::BadSignature));
        let mut h2 = h.clone();
        h2.tokens ^= 1;
        prop_assert_eq!(s.verify(&h2, first, &prompt, 1_000, &sig, 0), Err(HandleError::BadSignature));
    }
}
