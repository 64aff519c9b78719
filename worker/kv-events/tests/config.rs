//! `--kv-events-config`: vLLM's keys and defaults, unknown keys refused by
//! name, the bind-or-connect rule.

use rngd_kv_events::config::binds;
use rngd_kv_events::{KvEventPublisher, KvEventsConfig, PublisherKind};

fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(x) = src {
        s.push_str(": ");
        s.push_str(&x.to_string());
        src = x.source();
    }
    s
}

#[test]
fn vllms_example_parses_with_vllms_defaults_for_the_rest() {
    let c = KvEventsConfig::parse(
        r#"{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5558","topic":"kv@pod-a@SmolLM2","buffer_steps":64,"hwm":500}"#,
    )
    .unwrap();
    assert!(c.enable_kv_cache_events);
    assert_eq!(c.effective_publisher(), PublisherKind::Zmq);
    assert_eq!(c.endpoint, "tcp://*:5557");
    assert_eq!(c.replay_endpoint.as_deref(), Some("tcp://*:5558"));
    assert_eq!(c.topic, "kv@pod-a@SmolLM2");
    assert_eq!(
        (c.buffer_steps, c.hwm, c.max_queue_size),
        (64, 500, 100_000)
    );

    let d = KvEventsConfig::parse(r#"{"enable_kv_cache_events":true}"#).unwrap();
    assert_eq!(
        d.effective_publisher(),
        PublisherKind::Zmq,
        "unset publisher means zmq when enabled"
    );
    assert_eq!(
        (d.endpoint.as_str(), d.buffer_steps, d.hwm),
        ("tcp://*:5557", 10_000, 100_000)
    );
    assert_eq!(d.replay_endpoint, None);
    assert_eq!(d.topic, "");
}

#[test]
fn disabled_or_null_publishes_nothing() {
    for json in [
        r#"{}"#,
        r#"{"enable_kv_cache_events":false,"publisher":"zmq"}"#,
        r#"{"enable_kv_cache_events":true,"publisher":"null"}"#,
    ] {
        let c = KvEventsConfig::parse(json).unwrap();
        assert_eq!(c.effective_publisher(), PublisherKind::Null, "{json}");
        assert!(KvEventPublisher::start(&c).unwrap().is_none(), "{json}");
    }
}

#[test]
fn an_unknown_key_is_refused_by_name() {
    let e = KvEventsConfig::parse(r#"{"enable_kv_cache_events":true,"endpiont":"tcp://*:1"}"#)
        .unwrap_err();
    let msg = chain(&e);
    assert!(msg.contains("--kv-events-config"), "{msg}");
    assert!(msg.contains("`endpiont`"), "{msg}");
}

#[test]
fn bad_values_are_refused_by_name() {
    for (json, key) in [
        (r#"{"publisher":"kafka"}"#, "kafka"),
        (r#"{"buffer_steps":0}"#, "buffer_steps"),
        (r#"{"max_queue_size":0}"#, "max_queue_size"),
        (r#"{"hwm":-1}"#, "hwm"),
        (r#"{"endpoint":""}"#, "endpoint"),
        (r#"{"topic":5}"#, "string"),
        (r#"not json"#, "expected"),
    ] {
        let e = KvEventsConfig::parse(json).unwrap_err();
        let msg = chain(&e);
        assert!(msg.contains(key), "{json}: {msg}");
    }
}

#[test]
fn star_double_colon_ipc_and_inproc_bind_other_endpoints_connect() {
    assert!(binds("tcp://*:5557"));
    assert!(binds("tcp://127.0.0.1:*"));
    assert!(binds("tcp://[::1]:5557"));
    assert!(binds("ipc:///tmp/kv"));
    assert!(binds("inproc://kv"));
    assert!(!binds("tcp://127.0.0.1:5557"));
    assert!(!binds("tcp://collector.example:5557"));
}

#[test]
fn a_port_in_use_fails_at_start_naming_the_endpoint() {
    let c =
        KvEventsConfig::parse(r#"{"enable_kv_cache_events":true,"endpoint":"tcp://127.0.0.1:*"}"#)
            .unwrap();
    let first = KvEventPublisher::start(&c).unwrap().unwrap();
    // The bound endpoint names the real port.
    assert!(
        first.endpoint().starts_with("tcp://127.0.0.1:"),
        "{}",
        first.endpoint()
    );
    assert!(!first.endpoint().ends_with(":*"), "{}", first.endpoint());
    // The replay socket always binds: on the PUB socket's port it fails.
    let clash = KvEventsConfig {
        replay_endpoint: Some(first.endpoint().to_string()),
        ..c
    };
    let e = KvEventPublisher::start(&clash).unwrap_err();
    let msg = chain(&e);
    assert!(
        msg.contains(&format!("binding {}", first.endpoint())),
        "{msg}"
    );
}
