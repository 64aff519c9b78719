//! `rngd_pool::PrefixCache` against the real publisher crate
//! (`rngd-kv-events`): the streams an endpoints file names are followed
//! (and a flag's wins), a stream that goes down answers "no information"
//! with its gauge, counter and fault, an endpoint that leaves the file is
//! forgotten, speculative entries bridge a pick until events arrive, and
//! approximate mode credits endpoints without a stream. Every wait polls a
//! condition under a deadline.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rngd_kv_events::{KvEventPublisher, KvEventsConfig};
use rngd_kv_index::Health;
use rngd_policy_core::Route;
use rngd_pool::prefix::PrefixSource;
use rngd_pool::{CacheOptions, EndpointSource, FileEndpoints, KvStream, PrefixCache};

fn publisher() -> KvEventPublisher {
    let config = KvEventsConfig {
        enable_kv_cache_events: true,
        endpoint: "tcp://127.0.0.1:*".into(),
        replay_endpoint: Some("tcp://127.0.0.1:*".into()),
        buffer_steps: 1000,
        ..KvEventsConfig::default()
    };
    KvEventPublisher::start(&config).unwrap().unwrap()
}

fn entry(address: &str, stream: Option<(&str, &str)>) -> serde_json::Value {
    let mut e = serde_json::json!({
        "address": address, "role": "decode", "vendor": "cpu", "seq_len": 512,
    });
    if let Some((publ, replay)) = stream {
        e["kv_events"] = publ.into();
        e["kv_events_replay"] = replay.into();
    }
    e
}

fn stream_of(p: &KvEventPublisher) -> (&str, &str) {
    (p.endpoint(), p.replay_endpoint().unwrap())
}

fn options() -> CacheOptions {
    let mut o = CacheOptions {
        sync_every: Duration::from_millis(20),
        ..CacheOptions::default()
    };
    o.index.retry_after = Duration::from_millis(100);
    o.index.stale_after = Duration::from_millis(500);
    o.index.replay_timeout = Duration::from_millis(300);
    o
}

async fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(15);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn toks(n: u32) -> Vec<u32> {
    (0..n).collect()
}

fn route(decode: &str) -> Route {
    Route {
        decode: decode.into(),
        prefill: None,
        kv_transport: None,
        headers: vec![],
    }
}

fn metric(r: &prometheus::Registry, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let text = rngd_telemetry::render(r);
    let want: Vec<String> = labels.iter().map(|(k, v)| format!("{k}=\"{v}\"")).collect();
    let prefix = format!("{name}{{{}}} ", want.join(","));
    text.lines()
        .find(|l| l.starts_with(&prefix))
        .map(|l| l.rsplit(' ').next().unwrap().parse().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn follows_the_files_streams_and_says_when_one_is_down() {
    let (a, b) = (publisher(), publisher());
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("endpoints.json");
    let write = |list: Vec<serde_json::Value>| {
        std::fs::write(&path, serde_json::to_vec(&list).unwrap()).unwrap()
    };
    write(vec![
        entry("10.0.0.1:1", Some(stream_of(&a))),
        entry("10.0.0.2:2", Some(stream_of(&b))),
        entry("10.0.0.3:3", None),
    ]);
    let file = FileEndpoints::load(&path).unwrap();
    let _watch = file.watch(Duration::from_millis(10));
    let source: Arc<dyn EndpointSource> = file.clone();
    let running = PrefixCache::start(options(), source).await.unwrap();
    let cache = running.cache.clone();
    let registry = prometheus::Registry::new();
    cache.register_metrics(&registry).unwrap();
    assert!(cache.active());
    let ix = cache.indexer();
    wait_until("both streams live", || {
        ix.health("10.0.0.1:1") == Some(Health::Live)
            && ix.health("10.0.0.2:2") == Some(Health::Live)
    })
    .await;
    assert_eq!(ix.health("10.0.0.3:3"), None, "no stream, not indexed");

    // Endpoint 1 stores two blocks of 16; the lookup sees them.
    a.stored(vec![1, 2], None, toks(32), 16);
    a.end_step();
    let addrs = ["10.0.0.1:1", "10.0.0.2:2", "10.0.0.3:3"];
    let prompt = toks(40);
    wait_until("two blocks on 1", || {
        cache.cached_all(&addrs, &prompt, None) == vec![Some(32), Some(0), None]
    })
    .await;
    assert!(
        metric(
            &registry,
            "rngd_pd_prefix_lookups_total",
            &[("result", "indexed")]
        )
        .unwrap()
            >= 2.0
    );
    assert!(
        metric(
            &registry,
            "rngd_pd_prefix_lookups_total",
            &[("result", "no_stream")]
        )
        .unwrap()
            >= 1.0
    );
    wait_until("metrics refreshed", || {
        metric(
            &registry,
            "rngd_pd_kv_index_blocks",
            &[("endpoint", "10.0.0.1:1")],
        ) == Some(2.0)
            && metric(
                &registry,
                "rngd_pd_kv_index_stream_up",
                &[("endpoint", "10.0.0.2:2")],
            ) == Some(1.0)
    })
    .await;

    // Endpoint 2's stream moves to a publisher that never answers: no
    // information for it (never 0), its gauge drops, a fault is counted.
    let nobody = |port: u16| format!("tcp://127.0.0.1:{port}");
    let dead = (nobody(free_port()), nobody(free_port()));
    write(vec![
        entry("10.0.0.1:1", Some(stream_of(&a))),
        entry("10.0.0.2:2", Some((&dead.0, &dead.1))),
        entry("10.0.0.3:3", None),
    ]);
    wait_until("2 down", || {
        metric(
            &registry,
            "rngd_pd_kv_index_stream_up",
            &[("endpoint", "10.0.0.2:2")],
        ) == Some(0.0)
    })
    .await;
    let before = metric(
        &registry,
        "rngd_pd_prefix_lookups_total",
        &[("result", "stream_down")],
    )
    .unwrap();
    assert_eq!(
        cache.cached_all(&addrs, &prompt, None),
        vec![Some(32), None, None]
    );
    assert_eq!(
        metric(
            &registry,
            "rngd_pd_prefix_lookups_total",
            &[("result", "stream_down")]
        )
        .unwrap(),
        before + 1.0
    );
    wait_until("a replay failure counted", || {
        metric(
            &registry,
            "rngd_pd_kv_index_stream_faults_total",
            &[("endpoint", "10.0.0.2:2"), ("fault", "replay_failed")],
        )
        .is_some_and(|n| n >= 1.0)
    })
    .await;

    // Endpoint 1 leaves the file: forgotten, its series gone.
    write(vec![entry("10.0.0.3:3", None)]);
    wait_until("1 forgotten", || ix.health("10.0.0.1:1").is_none()).await;
    wait_until("its series removed", || {
        metric(
            &registry,
            "rngd_pd_kv_index_blocks",
            &[("endpoint", "10.0.0.1:1")],
        )
        .is_none()
    })
    .await;
    assert!(
        !cache.active(),
        "no stream left and no estimates: nothing to say"
    );
    drop(b);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flag_wins_and_speculative_entries_bridge_a_pick() {
    let (real, other) = (publisher(), publisher());
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("endpoints.json");
    // The file names the other publisher for the address; the flag the real one.
    std::fs::write(
        &path,
        serde_json::to_vec(&vec![entry("10.0.0.1:1", Some(stream_of(&other)))]).unwrap(),
    )
    .unwrap();
    let source: Arc<dyn EndpointSource> = FileEndpoints::load(&path).unwrap();
    let mut o = options();
    o.streams = vec![KvStream {
        id: "10.0.0.1:1".into(),
        endpoint: real.endpoint().into(),
        replay_endpoint: real.replay_endpoint().map(String::from),
        topic: String::new(),
    }];
    o.estimate.speculative_ttl = Duration::from_millis(300);
    let running = PrefixCache::start(o, source).await.unwrap();
    let cache = running.cache.clone();
    wait_until("live", || {
        cache.indexer().health("10.0.0.1:1") == Some(Health::Live)
    })
    .await;
    let prompt = toks(48);
    other.stored(vec![9], None, toks(16), 16);
    other.end_step();
    real.stored(vec![1], None, toks(16), 16);
    real.end_step();
    wait_until("the flag's stream indexed", || {
        cache.cached_all(&["10.0.0.1:1"], &prompt, None) == vec![Some(16)]
    })
    .await;
    // A pick of the whole prompt counts as cached until its lifetime ends.
    cache.routed(&route("10.0.0.1:1"), &prompt, None);
    assert_eq!(
        cache.cached_all(&["10.0.0.1:1"], &prompt, None),
        vec![Some(48)]
    );
    wait_until("the speculative entry expired", || {
        cache.cached_all(&["10.0.0.1:1"], &prompt, None) == vec![Some(16)]
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn approximate_mode_credits_endpoints_without_a_stream() {
    let source: Arc<dyn EndpointSource> = rngd_pool::StaticEndpoints::new(vec![
        rngd_pool::source::local_endpoint(
            "10.0.0.1:1".into(),
            rngd_policy_core::Role::Decode,
            512,
            &[],
        ),
        rngd_pool::source::local_endpoint(
            "10.0.0.2:2".into(),
            rngd_policy_core::Role::Decode,
            512,
            &[],
        ),
    ]);
    let mut o = options();
    o.estimate.approximate = true;
    let running = PrefixCache::start(o, source).await.unwrap();
    let cache = running.cache.clone();
    let registry = prometheus::Registry::new();
    cache.register_metrics(&registry).unwrap();
    assert!(cache.active());
    let prompt = toks(40);
    let addrs = ["10.0.0.1:1", "10.0.0.2:2"];
    assert_eq!(
        cache.cached_all(&addrs, &prompt, None),
        vec![Some(0), Some(0)]
    );
    cache.routed(&route("10.0.0.2:2"), &prompt, None);
    // A longer prompt sharing the first 40 tokens: two whole blocks.
    assert_eq!(
        cache.cached_all(&addrs, &toks(64), None),
        vec![Some(0), Some(32)]
    );
    assert!(
        metric(
            &registry,
            "rngd_pd_prefix_lookups_total",
            &[("result", "estimated")]
        )
        .unwrap()
            >= 4.0
    );
    wait_until("the gauge counts them", || {
        metric(
            &registry,
            "rngd_pd_prefix_estimated_blocks",
            &[("kind", "approximate")],
        ) == Some(2.0)
    })
    .await;
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}
