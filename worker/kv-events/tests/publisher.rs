//! The publisher on real sockets: three frames per batch, sequence numbers
//! one apart, one batch per step, replay from a sequence with vLLM's end
//! marker, the replay buffer's bound, the drop counter.

use std::sync::atomic::Ordering;
use std::time::Duration;

use rngd_kv_events::{END_SEQ, KvEventPublisher, KvEventsConfig};

fn publisher(extra: &str) -> KvEventPublisher {
    let json = format!(
        r#"{{"enable_kv_cache_events":true,"endpoint":"tcp://127.0.0.1:*","replay_endpoint":"tcp://127.0.0.1:*","topic":"kv@test"{extra}}}"#
    );
    KvEventPublisher::start(&KvEventsConfig::parse(&json).unwrap())
        .unwrap()
        .unwrap()
}

fn sub(ctx: &zmq::Context, p: &KvEventPublisher) -> zmq::Socket {
    let s = ctx.socket(zmq::SUB).unwrap();
    s.set_subscribe(b"kv@").unwrap();
    s.set_rcvtimeo(10_000).unwrap();
    s.connect(p.endpoint()).unwrap();
    s
}

fn recv3(s: &zmq::Socket) -> (Vec<u8>, u64, Vec<u8>) {
    let f = s.recv_multipart(0).expect("a message within 10 s");
    assert_eq!(f.len(), 3, "topic, sequence, payload");
    let seq = u64::from_be_bytes(f[1].as_slice().try_into().expect("8 bytes"));
    (f[0].clone(), seq, f[2].clone())
}

fn wait_batches(p: &KvEventPublisher, n: u64) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while p.stats().batches.load(Ordering::Relaxed) < n {
        assert!(
            std::time::Instant::now() < deadline,
            "{n} batches not published"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Replays from `start`: the (seq, payload) pairs before the end marker. A
/// DEALER with REQ's envelope (an empty delimiter frame): a REQ socket takes
/// only the first reply of the stream.
fn replay(ctx: &zmq::Context, p: &KvEventPublisher, start: u64) -> Vec<(u64, Vec<u8>)> {
    let r = ctx.socket(zmq::DEALER).unwrap();
    r.set_rcvtimeo(10_000).unwrap();
    r.connect(p.replay_endpoint().unwrap()).unwrap();
    let req: [&[u8]; 2] = [b"", &start.to_be_bytes()];
    r.send_multipart(req, 0).unwrap();
    let mut out = Vec::new();
    loop {
        let f = r.recv_multipart(0).expect("a replay frame within 10 s");
        assert_eq!(f.len(), 3, "delimiter, sequence, payload");
        assert!(f[0].is_empty());
        if f[2].is_empty() {
            assert_eq!(f[1], END_SEQ, "the end marker is sequence -1");
            return out;
        }
        out.push((
            u64::from_be_bytes(f[1].as_slice().try_into().unwrap()),
            f[2].clone(),
        ));
    }
}

#[test]
fn a_req_client_gets_the_first_reply_of_a_replay() {
    // vLLM's subscriber example asks with REQ: it reads the first batch.
    let ctx = zmq::Context::new();
    let p = publisher("");
    p.all_cleared();
    p.end_step();
    p.all_cleared();
    p.end_step();
    wait_batches(&p, 2);
    let r = ctx.socket(zmq::REQ).unwrap();
    r.set_rcvtimeo(10_000).unwrap();
    r.connect(p.replay_endpoint().unwrap()).unwrap();
    r.send(&1u64.to_be_bytes()[..], 0).unwrap();
    let f = r.recv_multipart(0).unwrap();
    assert_eq!(f.len(), 2);
    assert_eq!(f[0], 1u64.to_be_bytes());
}

#[test]
fn batches_carry_the_topic_and_consecutive_sequence_numbers_and_replay_serves_them() {
    let ctx = zmq::Context::new();
    let p = publisher("");
    let s = sub(&ctx, &p);
    // The subscription is live once a batch gets through; until then each
    // probe is only in the replay buffer.
    let mut seen = None;
    for i in 0..1000u64 {
        p.all_cleared();
        p.end_step();
        wait_batches(&p, i + 1);
        s.set_rcvtimeo(20).unwrap();
        if let Ok(f) = s.recv_multipart(0) {
            seen = Some(u64::from_be_bytes(f[1].as_slice().try_into().unwrap()));
            break;
        }
    }
    let first = seen.expect("the subscription became live");
    s.set_rcvtimeo(10_000).unwrap();
    let before = p.stats().batches.load(Ordering::Relaxed);
    // Drain probes published after the first one seen.
    for _ in first + 1..before {
        recv3(&s);
    }
    p.stored(vec![11, 12], None, (0..8).collect(), 4);
    p.removed(vec![11]);
    p.end_step();
    p.stored(vec![13], Some(12), (8..12).collect(), 4);
    p.end_step();
    let (topic, seq_a, payload_a) = recv3(&s);
    let (_, seq_b, _) = recv3(&s);
    assert_eq!(topic, b"kv@test");
    assert_eq!(seq_a, before, "numbers continue after the probes");
    assert_eq!(seq_b, seq_a + 1, "one apart");
    // Two events in the first batch: the array header of the events list.
    assert_eq!(payload_a[10], 0x92, "[ts, [2 events], rank]");

    let all = replay(&ctx, &p, 0);
    let seqs: Vec<u64> = all.iter().map(|(s, _)| *s).collect();
    assert_eq!(seqs, (0..=seq_b).collect::<Vec<_>>());
    assert_eq!(
        all[seq_a as usize].1, payload_a,
        "replay sends the published bytes"
    );
    let tail = replay(&ctx, &p, seq_b);
    assert_eq!(tail.len(), 1);
    assert!(
        replay(&ctx, &p, seq_b + 1).is_empty(),
        "nothing after the last: only the end marker"
    );
    assert_eq!(p.stats().replays.load(Ordering::Relaxed), 3);
}

#[test]
fn the_replay_buffer_keeps_the_last_buffer_steps_batches() {
    let ctx = zmq::Context::new();
    let p = publisher(r#","buffer_steps":5"#);
    for _ in 0..12 {
        p.all_cleared();
        p.end_step();
    }
    wait_batches(&p, 12);
    let seqs: Vec<u64> = replay(&ctx, &p, 0).into_iter().map(|(s, _)| s).collect();
    assert_eq!(seqs, vec![7, 8, 9, 10, 11]);
}

#[test]
fn a_full_queue_drops_and_counts_and_never_blocks() {
    let p = publisher(r#","max_queue_size":1"#);
    let started = std::time::Instant::now();
    let pushed = 20_000u64;
    for i in 0..pushed {
        p.removed(vec![i]);
    }
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "pushing never waits"
    );
    let stats = p.stats();
    // Every event is either published or counted as dropped.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let done =
            stats.events.load(Ordering::Relaxed) + stats.dropped_events.load(Ordering::Relaxed);
        if done == pushed {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{done} of {pushed} accounted for"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(
        stats.dropped_events.load(Ordering::Relaxed) > 0,
        "a queue of one overflows"
    );
}
