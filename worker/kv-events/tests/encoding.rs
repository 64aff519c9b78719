//! The MessagePack payload byte for byte against fixtures encoded by
//! `msgspec` 0.23 from vLLM's current structs (`EventBatch` array-like,
//! `KVCacheEvent` a tagged map with `omit_defaults`): the generator is in
//! `docs/engine.md`, "KV events".

use rngd_kv_events::{KvEvent, KvEventBatch, MEDIUM_GPU};

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn stored(hashes: Vec<u64>, parent: Option<u64>, tokens: Vec<u32>, bs: u32) -> KvEvent {
    KvEvent::BlockStored {
        block_hashes: hashes,
        parent_block_hash: parent,
        token_ids: tokens,
        block_size: bs,
        medium: Some(MEDIUM_GPU.into()),
        salt: None,
    }
}

/// Every integer width, a 34-token list (array16), a parent and none, all
/// three event types.
const FULL: &str = "93cb41daa8dbe0359fe79488a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392cfdab89baa7b5857c007b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473dc00220102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f20cd012cce00011170aa626c6f636b5f73697a6511a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c088a474797065ab426c6f636b53746f726564ac626c6f636b5f686173686573912ab1706172656e745f626c6f636b5f6861736807a9746f6b656e5f696473dc0010cdc000cdc000cdc000cdc000cdc000cdc000cdc000cdc000cdc000cdc000cdc000cdc000cdc000cdc000cdc000cdc000aa626c6f636b5f73697a6510a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c083a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657394cfdab89baa7b5857c0ccffce00010000cf0000000100000000a66d656469756da347505581a474797065b0416c6c426c6f636b73436c656172656400";

#[test]
fn a_batch_of_every_event_is_msgspecs_bytes() {
    let mut tokens: Vec<u32> = (1..=32).collect();
    tokens.extend([300, 70000]);
    let batch = KvEventBatch {
        ts: 1789095808.8378847,
        events: vec![
            stored(vec![15760518052499183552, 7], None, tokens, 17),
            stored(vec![42], Some(7), vec![49152; 16], 16),
            KvEvent::BlockRemoved {
                block_hashes: vec![15760518052499183552, 255, 65536, 4294967296],
                medium: Some(MEDIUM_GPU.into()),
            },
            KvEvent::AllBlocksCleared,
        ],
        data_parallel_rank: Some(0),
    };
    assert_eq!(batch.encode(), hex(FULL));
}

#[test]
fn a_small_batch_is_msgspecs_bytes() {
    let batch = KvEventBatch {
        ts: 1.5,
        events: vec![stored(vec![1], None, vec![1, 2], 2)],
        data_parallel_rank: Some(0),
    };
    let want = "93cb3ff80000000000009188a474797065ab426c6f636b53746f726564ac626c6f636b5f6861736865739101b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473920102aa626c6f636b5f73697a6502a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c000";
    assert_eq!(batch.encode(), hex(want));
}

#[test]
fn an_unset_rank_is_nil_as_msgspec_writes_every_field_of_an_array_like_struct() {
    let batch = KvEventBatch {
        ts: 1.5,
        events: vec![KvEvent::AllBlocksCleared],
        data_parallel_rank: None,
    };
    // [1.5, [{"type": "AllBlocksCleared"}], null]
    let want = "93cb3ff80000000000009181a474797065b0416c6c426c6f636b73436c6561726564c0";
    assert_eq!(batch.encode(), hex(want));
}
