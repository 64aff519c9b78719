//! Unit tests of the index: keys, chains, match, removal, clear, the LRU
//! cap, unknown parents, ignored blocks.

use std::time::Instant;

use super::*;
use crate::decode::Event;
use crate::keys::block_keys;

fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32], bs: u32) -> Event {
    Event::BlockStored {
        block_hashes: hashes.to_vec(),
        parent_block_hash: parent,
        token_ids: tokens.to_vec(),
        block_size: bs,
        medium: Some("GPU".into()),
        lora: false,
        extra_keys: false,
        salt: None,
    }
}

fn removed(hashes: &[u64]) -> Event {
    Event::BlockRemoved {
        block_hashes: hashes.to_vec(),
        medium: Some("GPU".into()),
    }
}

fn batch(events: Vec<Event>) -> Batch {
    Batch {
        ts: 0.0,
        events: events.into_iter().map(Ok).collect(),
        data_parallel_rank: Some(0),
    }
}

fn live(idx: &mut Index, id: &str) -> u32 {
    let slot = idx.add_endpoint(id);
    idx.set_health(slot, Health::Live);
    slot
}

fn apply(idx: &mut Index, slot: u32, events: Vec<Event>) -> Applied {
    idx.apply_batch(slot, &batch(events), Instant::now())
}

#[test]
fn a_stored_chain_matches_by_tokens_whatever_the_engine_hashes() {
    let mut idx = Index::new(100);
    let a = live(&mut idx, "a");
    let tokens: Vec<u32> = (1..=10).collect();
    // Engine hashes are arbitrary: the match uses the router's keys.
    apply(
        &mut idx,
        a,
        vec![stored(&[900, 901], None, &tokens[..8], 4)],
    );
    assert_eq!(idx.match_prefix("a", &tokens), Some(8));
    assert_eq!(
        idx.match_prefix("a", &tokens[..7]),
        Some(4),
        "a partial block never matches"
    );
    assert_eq!(idx.match_prefix("a", &[1, 2, 3, 5, 5, 6, 7, 8]), Some(0));
    assert_eq!(idx.match_prefix("nobody", &tokens), None);
    // A continuation through the parent's engine hash.
    apply(
        &mut idx,
        a,
        vec![stored(&[902], Some(901), &[9, 10, 11, 12], 4)],
    );
    let longer: Vec<u32> = (1..=13).collect();
    assert_eq!(idx.match_prefix("a", &longer), Some(12));
    assert_eq!(idx.len(), 3);
    // The key chain is the one `block_keys` computes.
    let keys = block_keys(4, &longer);
    for k in &keys {
        assert_eq!(idx.holders[k].as_slice(), [a]);
    }
}

#[test]
fn the_match_runs_from_token_0_only() {
    let mut idx = Index::new(100);
    let a = live(&mut idx, "a");
    let tokens: Vec<u32> = (1..=12).collect();
    apply(&mut idx, a, vec![stored(&[1, 2, 3], None, &tokens, 4)]);
    apply(&mut idx, a, vec![removed(&[1])]);
    assert_eq!(
        idx.match_prefix("a", &tokens),
        Some(0),
        "block 0 gone: no prefix"
    );
    assert_eq!(idx.len(), 2);
}

#[test]
fn removal_and_clear() {
    let mut idx = Index::new(100);
    let a = live(&mut idx, "a");
    let tokens: Vec<u32> = (1..=12).collect();
    apply(&mut idx, a, vec![stored(&[1, 2, 3], None, &tokens, 4)]);
    apply(&mut idx, a, vec![removed(&[3, 77])]);
    assert_eq!(idx.match_prefix("a", &tokens), Some(8));
    assert_eq!(idx.len(), 2);
    apply(&mut idx, a, vec![Event::AllBlocksCleared]);
    assert_eq!(idx.match_prefix("a", &tokens), Some(0));
    assert!(idx.is_empty() && idx.holders.is_empty());
    // Another tier's events do not touch the engine's own cache.
    apply(&mut idx, a, vec![stored(&[1], None, &tokens[..4], 4)]);
    idx.apply_event(
        a,
        &Event::BlockRemoved {
            block_hashes: vec![1],
            medium: Some("CPU".into()),
        },
    );
    assert_eq!(idx.match_prefix("a", &tokens), Some(4));
}

#[test]
fn two_endpoints_and_the_batch_form() {
    let mut idx = Index::new(100);
    let a = live(&mut idx, "a");
    let b = live(&mut idx, "b");
    let c = live(&mut idx, "c");
    let d = idx.add_endpoint("d"); // no information yet
    let tokens: Vec<u32> = (1..=16).collect();
    apply(&mut idx, a, vec![stored(&[1, 2], None, &tokens[..8], 4)]);
    apply(&mut idx, b, vec![stored(&[5, 6, 7, 8], None, &tokens, 4)]);
    // c uses blocks of 8 (its own key chain).
    apply(&mut idx, c, vec![stored(&[9], None, &tokens[..8], 8)]);
    let _ = d;
    let all = idx.match_all(&tokens);
    assert_eq!(
        all,
        vec![
            ("a".to_string(), Some(8)),
            ("b".to_string(), Some(16)),
            ("c".to_string(), Some(8)),
            ("d".to_string(), None),
        ]
    );
    for (id, m) in &all {
        assert_eq!(idx.match_prefix(id, &tokens), *m, "{id}");
    }
    // Shared keys: block 0 is held by a and b.
    assert_eq!(idx.holders[&block_keys(4, &tokens)[0]].as_slice().len(), 2);
    assert!(idx.remove_endpoint("b"));
    assert_eq!(idx.holders[&block_keys(4, &tokens)[0]].as_slice(), [a]);
    assert_eq!(idx.match_prefix("b", &tokens), None);
    assert_eq!(idx.len(), 3);
}

#[test]
fn an_unknown_parent_is_counted_and_leaves_no_information() {
    let mut idx = Index::new(100);
    let a = live(&mut idx, "a");
    let r = apply(&mut idx, a, vec![stored(&[2], Some(1), &[5, 6], 2)]);
    assert_eq!(r.unknown_parents, 1);
    assert_eq!(idx.health(a), Some(Health::UnknownParent));
    assert_eq!(idx.match_prefix("a", &[5, 6]), None, "never a silent 0");
    assert_eq!(idx.match_all(&[5, 6]), vec![("a".to_string(), None)]);
    // Its child is not another unknown parent.
    let r = apply(&mut idx, a, vec![stored(&[3], Some(2), &[7, 8], 2)]);
    assert_eq!(r.unknown_parents, 0);
    let st = idx.stats(Instant::now());
    assert_eq!(st.endpoints[0].1.unknown_parents, 1);
    assert_eq!(st.endpoints[0].1.ignored_blocks, 1);
    assert_eq!(st.total.unknown_parents, 1);
    // AllBlocksCleared: the state is known exactly again.
    apply(
        &mut idx,
        a,
        vec![Event::AllBlocksCleared, stored(&[4], None, &[5, 6], 2)],
    );
    assert_eq!(idx.health(a), Some(Health::Live));
    assert_eq!(idx.match_prefix("a", &[5, 6]), Some(2));
}

#[test]
fn the_cap_evicts_the_least_recently_used_chain_tails() {
    let mut idx = Index::new(4);
    let a = live(&mut idx, "a");
    let x: Vec<u32> = (100..106).collect();
    let y: Vec<u32> = (200..206).collect();
    apply(&mut idx, a, vec![stored(&[1, 2, 3], None, &x, 2)]);
    apply(&mut idx, a, vec![stored(&[11, 12], None, &y[..4], 2)]);
    // 5 blocks over a cap of 4: x's tail goes first (x is older; within a
    // chain parents are newer than children).
    assert_eq!(idx.len(), 4);
    assert_eq!(idx.match_prefix("a", &x), Some(4));
    assert_eq!(idx.match_prefix("a", &y), Some(4));
    let st = idx.stats(Instant::now());
    assert_eq!(st.total.evicted, 1);
    assert_eq!(st.endpoints[0].1.blocks, 4);
    // The evicted block's child is not an unknown parent, and is not indexed.
    let r = apply(&mut idx, a, vec![stored(&[4], Some(3), &[1, 1], 2)]);
    assert_eq!(r.unknown_parents, 0);
    assert_eq!(idx.health(a), Some(Health::Live));
    // A match makes its chain recent: y matched last, so x goes next.
    assert_eq!(idx.match_prefix("a", &y), Some(4));
    apply(&mut idx, a, vec![stored(&[13], Some(12), &y[4..6], 2)]);
    assert_eq!(idx.match_prefix("a", &y), Some(6));
    assert_eq!(idx.match_prefix("a", &x), Some(2));
    assert_eq!(idx.len(), 4);
}

#[test]
fn the_cap_counts_across_endpoints() {
    let mut idx = Index::new(3);
    let a = live(&mut idx, "a");
    let b = live(&mut idx, "b");
    apply(&mut idx, a, vec![stored(&[1, 2], None, &[1, 2, 3, 4], 2)]);
    apply(&mut idx, b, vec![stored(&[1, 2], None, &[1, 2, 3, 4], 2)]);
    assert_eq!(idx.len(), 3);
    assert_eq!(idx.match_prefix("a", &[1, 2, 3, 4]), Some(2));
    assert_eq!(idx.match_prefix("b", &[1, 2, 3, 4]), Some(4));
}

#[test]
fn lora_extra_keys_and_bad_lengths_are_not_indexed() {
    let mut idx = Index::new(100);
    let a = live(&mut idx, "a");
    let mut e = stored(&[1], None, &[1, 2], 2);
    if let Event::BlockStored { lora, .. } = &mut e {
        *lora = true;
    }
    apply(&mut idx, a, vec![e]);
    let mut e = stored(&[2], None, &[3, 4], 2);
    if let Event::BlockStored { extra_keys, .. } = &mut e {
        *extra_keys = true;
    }
    apply(&mut idx, a, vec![e]);
    // A child of an ignored block: ignored too, not an unknown parent.
    let r = apply(&mut idx, a, vec![stored(&[3], Some(1), &[5, 6], 2)]);
    assert_eq!(r.unknown_parents, 0);
    assert_eq!(idx.match_prefix("a", &[1, 2]), Some(0));
    assert_eq!(idx.match_prefix("a", &[3, 4]), Some(0));
    // token_ids not block_size per block: counted as undecodable.
    apply(&mut idx, a, vec![stored(&[4], None, &[1, 2, 3], 2)]);
    let st = idx.stats(Instant::now()).endpoints[0].1.clone();
    assert_eq!((st.ignored_blocks, st.undecodable, st.blocks), (3, 1, 0));
    assert_eq!(idx.health(a), Some(Health::Live));
}

#[test]
fn a_block_named_by_two_engine_hashes_stays_until_both_go() {
    let mut idx = Index::new(100);
    let a = live(&mut idx, "a");
    apply(&mut idx, a, vec![stored(&[1], None, &[1, 2], 2)]);
    apply(&mut idx, a, vec![stored(&[2], None, &[1, 2], 2)]);
    assert_eq!(idx.len(), 1);
    apply(&mut idx, a, vec![removed(&[1])]);
    assert_eq!(idx.match_prefix("a", &[1, 2]), Some(2));
    apply(&mut idx, a, vec![removed(&[2])]);
    assert_eq!(idx.match_prefix("a", &[1, 2]), Some(0));
    assert!(idx.is_empty());
}

#[test]
fn a_block_size_change_drops_the_old_entries() {
    let mut idx = Index::new(100);
    let a = live(&mut idx, "a");
    apply(&mut idx, a, vec![stored(&[1], None, &[1, 2], 2)]);
    apply(&mut idx, a, vec![stored(&[2], None, &[1, 2, 3, 4], 4)]);
    assert_eq!(idx.len(), 1);
    assert_eq!(idx.block_size(a), Some(4));
    assert_eq!(idx.match_prefix("a", &[1, 2, 3, 4]), Some(4));
}

#[test]
fn states_without_information_answer_none() {
    let mut idx = Index::new(100);
    let a = idx.add_endpoint("a");
    assert_eq!(
        idx.match_prefix("a", &[1, 2]),
        None,
        "unknown before any batch"
    );
    apply(&mut idx, a, vec![]);
    assert_eq!(idx.match_prefix("a", &[1, 2]), Some(0), "live, empty");
    for h in [
        Health::Replaying,
        Health::Stale,
        Health::MissedBatches,
        Health::Undecodable,
    ] {
        idx.set_health(a, h);
        assert_eq!(idx.match_prefix("a", &[1, 2]), None, "{h:?}");
    }
    // A batch makes a stale endpoint live; a broken one stays broken.
    idx.set_health(a, Health::Stale);
    apply(&mut idx, a, vec![]);
    assert_eq!(idx.health(a), Some(Health::Live));
    idx.set_health(a, Health::MissedBatches);
    apply(&mut idx, a, vec![]);
    assert_eq!(idx.health(a), Some(Health::MissedBatches));
}

#[test]
fn the_names_of_one_block_are_bounded() {
    let mut idx = Index::new(100);
    let a = live(&mut idx, "a");
    for h in 0..(MAX_ENGINE_IDS as u64 + 5) {
        apply(&mut idx, a, vec![stored(&[h], None, &[1, 2], 2)]);
    }
    assert_eq!(idx.len(), 1);
    assert_eq!(idx.endpoints[&a].by_engine.len(), MAX_ENGINE_IDS);
    let st = idx.stats(Instant::now()).endpoints[0].1.clone();
    assert_eq!(st.ignored_blocks, 5);
    // A child of a name not kept is ignored, not an unknown parent.
    let r = apply(
        &mut idx,
        a,
        vec![stored(&[999], Some(MAX_ENGINE_IDS as u64 + 1), &[3, 4], 2)],
    );
    assert_eq!(r.unknown_parents, 0);
    assert_eq!(idx.match_prefix("a", &[1, 2, 3, 4]), Some(2));
}

/// A chain stored under a cache salt matches only prompts sent with the same
/// salt: never an unsalted one, never another salt's (one tenant learns
/// nothing of another's cache from where its prompts are routed); its
/// children (parent given) continue the salted chain.
#[test]
fn a_salted_chain_matches_only_its_own_salt() {
    let mut idx = Index::new(100);
    let a = live(&mut idx, "a");
    let b = live(&mut idx, "b");
    let tokens: Vec<u32> = (1..=8).collect();
    let mut e = stored(&[10], None, &tokens[..4], 4);
    if let Event::BlockStored { salt, .. } = &mut e {
        *salt = Some("tenant-a".into());
    }
    apply(
        &mut idx,
        a,
        vec![e, stored(&[11], Some(10), &tokens[4..], 4)],
    );
    apply(&mut idx, b, vec![stored(&[20], None, &tokens[..4], 4)]);
    assert_eq!(
        idx.match_prefix_salted("a", &tokens, Some("tenant-a")),
        Some(8)
    );
    assert_eq!(
        idx.match_prefix_salted("a", &tokens, Some("tenant-b")),
        Some(0)
    );
    assert_eq!(idx.match_prefix("a", &tokens), Some(0));
    assert_eq!(
        idx.match_all_salted(&tokens, Some("tenant-a")),
        vec![("a".to_string(), Some(8)), ("b".to_string(), Some(0))]
    );
    assert_eq!(
        idx.match_all(&tokens),
        vec![("a".to_string(), Some(0)), ("b".to_string(), Some(4))]
    );
}
