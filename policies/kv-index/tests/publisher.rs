//! The indexer against the real publisher crate (`rngd-kv-events`): stored,
//! removed, cleared, a late join recovered by replay, a publisher restarted
//! (the sequence goes back), an unknown parent, an endpoint removed, the
//! block cap. Every wait polls a condition under a deadline.

use std::time::{Duration, Instant};

use rngd_kv_events::{KvEventPublisher, KvEventsConfig};
use rngd_kv_index::{EndpointSpec, Health, KvIndexer, Options};

const TOPIC: &str = "kv@test";

fn publisher_on(endpoint: &str, replay: &str) -> KvEventPublisher {
    let config = KvEventsConfig {
        enable_kv_cache_events: true,
        endpoint: endpoint.into(),
        replay_endpoint: Some(replay.into()),
        topic: TOPIC.into(),
        buffer_steps: 1000,
        ..KvEventsConfig::default()
    };
    KvEventPublisher::start(&config).unwrap().unwrap()
}

fn publisher() -> KvEventPublisher {
    publisher_on("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
}

fn spec(id: &str, p: &KvEventPublisher) -> EndpointSpec {
    EndpointSpec {
        id: id.into(),
        endpoint: p.endpoint().into(),
        replay_endpoint: p.replay_endpoint().map(str::to_owned),
        topic: TOPIC.into(),
    }
}

/// Short retries, and a short silence before a probe: a batch published
/// before the SUB socket's subscription reached the publisher (libzmq's slow
/// joiner) is then brought by the probe within half a second.
fn options() -> Options {
    Options {
        retry_after: Duration::from_millis(100),
        stale_after: Duration::from_millis(500),
        ..Options::default()
    }
}

/// Polls `f` until it is true; panics with `what` after 15 s.
fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(15);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn toks(r: std::ops::Range<u32>) -> Vec<u32> {
    r.collect()
}

#[test]
fn stored_removed_and_cleared_show_in_the_match() {
    let p = publisher();
    let ix = KvIndexer::start(options()).unwrap();
    ix.set_endpoints(vec![spec("w0", &p)]).unwrap();
    wait_until("w0 live", || ix.health("w0") == Some(Health::Live));
    let prompt = toks(0..13);
    assert_eq!(
        ix.match_prefix("w0", &prompt),
        Some(0),
        "live and empty: 0, not None"
    );
    p.stored(vec![11, 12, 13], None, toks(0..12), 4);
    p.end_step();
    wait_until("3 blocks", || ix.match_prefix("w0", &prompt) == Some(12));
    p.stored(vec![14], Some(13), toks(12..16), 4);
    p.end_step();
    let longer = toks(0..16);
    wait_until("4 blocks", || ix.match_prefix("w0", &longer) == Some(16));
    p.removed(vec![13, 14]);
    p.end_step();
    wait_until("removal", || ix.match_prefix("w0", &longer) == Some(8));
    p.all_cleared();
    p.end_step();
    wait_until("clear", || ix.match_prefix("w0", &longer) == Some(0));
    let st = ix.endpoint_stats("w0").unwrap();
    assert_eq!(
        (st.events, st.batches, st.blocks, st.blocks_indexed),
        (4, 4, 0, 4)
    );
    assert_eq!((st.gaps, st.unknown_parents, st.undecodable), (0, 0, 0));
    assert_eq!(st.health, Health::Live);
    assert!(st.seconds_since_last_event.unwrap() < 10.0);
    assert_eq!(ix.match_all(&longer), vec![("w0".to_string(), Some(0))]);
}

#[test]
fn a_late_join_is_recovered_by_replay() {
    let p = publisher();
    p.stored(vec![1, 2], None, toks(0..8), 4);
    p.end_step();
    p.stored(vec![3], Some(2), toks(8..12), 4);
    p.end_step();
    p.removed(vec![3]);
    p.stored(vec![21], None, toks(100..104), 4);
    p.end_step();
    wait_until("3 batches out", || {
        p.stats().batches.load(std::sync::atomic::Ordering::Relaxed) == 3
    });
    let ix = KvIndexer::start(options()).unwrap();
    ix.set_endpoints(vec![spec("w0", &p)]).unwrap();
    wait_until("history replayed", || {
        ix.match_prefix("w0", &toks(0..12)) == Some(8)
    });
    assert_eq!(ix.match_prefix("w0", &toks(100..104)), Some(4));
    let st = ix.endpoint_stats("w0").unwrap();
    assert!(st.replays >= 1, "{st:?}");
    assert_eq!(st.batches, 3);
    // Live batches keep coming after the replay.
    p.stored(vec![4], Some(2), toks(8..12), 4);
    p.end_step();
    wait_until("live after replay", || {
        ix.match_prefix("w0", &toks(0..12)) == Some(12)
    });
}

#[test]
fn a_restarted_publisher_clears_the_endpoint_and_is_replayed() {
    let p = publisher();
    let (pub_ep, replay_ep) = (
        p.endpoint().to_owned(),
        p.replay_endpoint().unwrap().to_owned(),
    );
    let ix = KvIndexer::start(Options {
        stale_after: Duration::from_millis(300),
        ..options()
    })
    .unwrap();
    ix.set_endpoints(vec![spec("w0", &p)]).unwrap();
    wait_until("w0 live", || ix.health("w0") == Some(Health::Live));
    for i in 0..3u64 {
        p.stored(
            vec![100 + i],
            None,
            toks(i as u32 * 10..i as u32 * 10 + 4),
            4,
        );
        p.end_step();
    }
    wait_until("old blocks", || {
        ix.match_prefix("w0", &toks(20..24)) == Some(4)
    });
    p.shutdown();
    // The same addresses, a new publisher: its sequence starts at 0 again.
    let p2 = publisher_on(&pub_ep, &replay_ep);
    p2.stored(vec![500], None, toks(1000..1004), 4);
    p2.end_step();
    wait_until("the restart seen and replayed", || {
        ix.match_prefix("w0", &toks(1000..1004)) == Some(4)
    });
    assert_eq!(
        ix.match_prefix("w0", &toks(0..4)),
        Some(0),
        "the old entries are gone"
    );
    assert_eq!(ix.match_prefix("w0", &toks(20..24)), Some(0));
    let st = ix.endpoint_stats("w0").unwrap();
    assert!(st.restarts >= 1, "{st:?}");
    assert_eq!(st.blocks, 1);
}

#[test]
fn an_unknown_parent_is_counted_and_reported_as_no_information() {
    let p = publisher();
    let ix = KvIndexer::start(options()).unwrap();
    ix.set_endpoints(vec![spec("w0", &p)]).unwrap();
    wait_until("w0 live", || ix.health("w0") == Some(Health::Live));
    p.stored(vec![2], Some(999), toks(4..8), 4);
    p.end_step();
    wait_until("unknown parent", || {
        ix.endpoint_stats("w0").unwrap().unknown_parents >= 1
    });
    assert_eq!(ix.match_prefix("w0", &toks(0..8)), None, "never a silent 0");
    assert_eq!(ix.match_all(&toks(0..8)), vec![("w0".to_string(), None)]);
    // The rebuild replays the same history: still no information.
    wait_until("a recovery replay", || {
        ix.endpoint_stats("w0").unwrap().replays >= 2
    });
    assert_eq!(ix.match_prefix("w0", &toks(0..8)), None);
    // A reset makes the state known again.
    p.all_cleared();
    p.stored(vec![1], None, toks(0..4), 4);
    p.end_step();
    wait_until("live again", || {
        ix.match_prefix("w0", &toks(0..8)) == Some(4)
    });
}

#[test]
fn a_removed_endpoint_is_forgotten() {
    let (a, b) = (publisher(), publisher());
    let ix = KvIndexer::start(options()).unwrap();
    ix.set_endpoints(vec![spec("a", &a), spec("b", &b)])
        .unwrap();
    a.stored(vec![1], None, toks(0..4), 4);
    a.end_step();
    b.stored(vec![1, 2], None, toks(0..8), 4);
    b.end_step();
    wait_until("both indexed", || {
        ix.match_all(&toks(0..8)) == vec![("a".to_string(), Some(4)), ("b".to_string(), Some(8))]
    });
    ix.set_endpoints(vec![spec("a", &a)]).unwrap();
    assert_eq!(ix.match_prefix("b", &toks(0..8)), None);
    assert_eq!(ix.health("b"), None);
    let st = ix.stats();
    assert_eq!(st.endpoints.len(), 1);
    assert_eq!(st.total.blocks, 1, "b's blocks left the index");
    assert_eq!(
        st.total.blocks_indexed, 3,
        "the total keeps counting what b did"
    );
    // b's later events are not read any more.
    b.stored(vec![9], None, toks(50..54), 4);
    b.end_step();
    a.stored(vec![2], Some(1), toks(4..8), 4);
    a.end_step();
    wait_until("a goes on", || ix.match_prefix("a", &toks(0..8)) == Some(8));
    assert_eq!(ix.stats().total.blocks, 2);
    // Added back: subscribed anew, history replayed.
    ix.set_endpoints(vec![spec("a", &a), spec("b", &b)])
        .unwrap();
    wait_until("b back", || ix.match_prefix("b", &toks(50..54)) == Some(4));
}

#[test]
fn the_block_cap_bounds_the_index() {
    let p = publisher();
    let ix = KvIndexer::start(Options {
        max_blocks: 8,
        ..options()
    })
    .unwrap();
    ix.set_endpoints(vec![spec("w0", &p)]).unwrap();
    wait_until("w0 live", || ix.health("w0") == Some(Health::Live));
    for c in 0..5u32 {
        let base = c * 100;
        p.stored(
            vec![
                u64::from(base) + 1,
                u64::from(base) + 2,
                u64::from(base) + 3,
            ],
            None,
            toks(base..base + 12),
            4,
        );
        p.end_step();
    }
    wait_until("15 blocks seen", || {
        ix.endpoint_stats("w0").unwrap().blocks_indexed == 15
    });
    let st = ix.endpoint_stats("w0").unwrap();
    assert_eq!((st.blocks, st.evicted), (8, 7));
    // The newest chains are whole, the oldest gone, one cut at its tail.
    assert_eq!(ix.match_prefix("w0", &toks(400..412)), Some(12));
    assert_eq!(ix.match_prefix("w0", &toks(300..312)), Some(12));
    assert_eq!(ix.match_prefix("w0", &toks(200..212)), Some(8));
    assert_eq!(ix.match_prefix("w0", &toks(0..12)), Some(0));
    assert_eq!(ix.health("w0"), Some(Health::Live));
}

#[test]
fn a_publisher_that_is_not_there_leaves_no_information_and_drop_is_prompt() {
    let ix = KvIndexer::start(Options {
        replay_timeout: Duration::from_millis(200),
        ..options()
    })
    .unwrap();
    ix.set_endpoints(vec![EndpointSpec {
        id: "gone".into(),
        endpoint: "tcp://127.0.0.1:1".into(),
        replay_endpoint: Some("tcp://127.0.0.1:2".into()),
        topic: String::new(),
    }])
    .unwrap();
    wait_until("a failed replay", || {
        ix.endpoint_stats("gone").unwrap().replay_failures >= 1
    });
    assert_eq!(ix.match_prefix("gone", &[1, 2, 3]), None);
    // Between two failed replays the endpoint is MissedBatches, during the
    // next try Replaying: never Live, and nothing to match either way.
    assert!(
        matches!(
            ix.health("gone"),
            Some(Health::MissedBatches | Health::Replaying)
        ),
        "{:?}",
        ix.health("gone")
    );
    let t = Instant::now();
    drop(ix);
    assert!(
        t.elapsed() < Duration::from_secs(2),
        "drop took {:?}",
        t.elapsed()
    );
}

#[test]
fn bad_endpoint_lists_and_options_are_refused_by_name() {
    let ix = KvIndexer::start(options()).unwrap();
    let e = |id: &str, ep: &str| EndpointSpec {
        id: id.into(),
        endpoint: ep.into(),
        replay_endpoint: None,
        topic: String::new(),
    };
    let err = ix
        .set_endpoints(vec![e("", "tcp://127.0.0.1:5")])
        .unwrap_err();
    assert!(err.to_string().contains("empty"), "{err}");
    let err = ix
        .set_endpoints(vec![
            e("a", "tcp://127.0.0.1:5"),
            e("a", "tcp://127.0.0.1:6"),
        ])
        .unwrap_err();
    assert!(err.to_string().contains("twice"), "{err}");
    // An address libzmq cannot parse: reported, the other endpoint applied.
    let err = ix
        .set_endpoints(vec![e("bad", "nonsense://x"), e("ok", "tcp://127.0.0.1:5")])
        .unwrap_err();
    assert!(err.to_string().contains("nonsense://x"), "{err}");
    assert_eq!(ix.health("ok"), Some(Health::Unknown));
    assert_eq!(ix.health("bad"), None);
    for (o, field) in [
        (
            Options {
                max_blocks: 0,
                ..Options::default()
            },
            "max_blocks",
        ),
        (
            Options {
                replay_timeout: Duration::ZERO,
                ..Options::default()
            },
            "replay_timeout",
        ),
        (
            Options {
                max_batches_per_turn: 0,
                ..Options::default()
            },
            "max_batches_per_turn",
        ),
    ] {
        let err = KvIndexer::start(o).unwrap_err();
        assert!(err.to_string().contains(field), "{err}");
    }
}
