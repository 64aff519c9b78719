//! Tests of the default PD decision (`super`): admission, the decode and
//! prefill choice, disaggregation, transports, subsets, the snapshot cache.

use super::*;
use crate::Vendor;

#[test]
fn parse_decimal_is_trimmed_str_parse() {
    for t in [
        "0",
        "7",
        "210",
        " 42\n",
        "+5",
        "++5",
        "5+",
        "1+2",
        "+0",
        "-1",
        "",
        " ",
        "+",
        "1e3",
        "4.0",
        "12a",
        "18446744073709551615",
        "18446744073709551616",
        "99999999999999999999",
        "\u{a0}9",
    ] {
        let want = t.trim().parse::<u64>().ok();
        assert_eq!(parse_decimal(t.as_bytes()), want, "{t:?}");
    }
}

fn ep(address: &str, role: Role, node: &str, queue: u32) -> Endpoint {
    Endpoint {
        address: address.to_string(),
        role,
        vendor: Vendor::Cpu,
        node: node.to_string(),
        seq_len: 512,
        queue_depth: queue,
        running: 0,
        kv_usage: 0.0,
        healthy: true,
        transports: vec![],
    }
}

fn body(prompt_chars: usize, max_tokens: u32) -> Vec<u8> {
    format!(
        r#"{{"model":"m","prompt":"{}","max_tokens":{max_tokens}}}"#,
        "a".repeat(prompt_chars)
    )
    .into_bytes()
}

fn route(d: Decision) -> Route {
    match d {
        Decision::Route(r) => r,
        Decision::Reject(l) => panic!("rejected: {} {:?}", l.status, l.message()),
    }
}

#[test]
fn picks_least_loaded_and_disaggregates_long_prompts() {
    let eps = vec![
        ep("10.0.0.1:1", Role::Decode, "a", 3),
        ep("10.0.0.2:1", Role::Decode, "b", 0),
        ep("10.0.0.3:1", Role::Prefill, "b", 1),
        ep("10.0.0.4:1", Role::Prefill, "a", 0),
    ];
    let b = body(10, 5);
    let r = route(decide(
        &PolicyConfig::default(),
        &eps,
        &RequestInput {
            content_length: None,
            body: Some(&b),
            prompt_tokens: Some(100),
            subset: None,
        },
    ));
    assert_eq!(r.decode, "10.0.0.2:1");
    assert_eq!(r.prefill.as_deref(), Some("10.0.0.4:1"));
    assert_eq!(r.kv_transport.as_deref(), Some("tcp"));
    let short = route(decide(
        &PolicyConfig::default(),
        &eps,
        &RequestInput {
            content_length: None,
            body: Some(&b),
            prompt_tokens: Some(5),
            subset: None,
        },
    ));
    assert_eq!(short.prefill, None);
    assert_eq!(short.headers.len(), 1);
}

#[test]
fn same_node_uses_shm_and_subset_limits_choice() {
    let eps = vec![
        ep("d:1", Role::Decode, "n1", 0),
        ep("d:2", Role::Decode, "n2", 0),
        ep("p:1", Role::Prefill, "n2", 0),
    ];
    let b = body(10, 5);
    let r = route(decide(
        &PolicyConfig::default(),
        &eps,
        &RequestInput {
            content_length: None,
            body: Some(&b),
            prompt_tokens: Some(100),
            subset: Some("d:2, p:1"),
        },
    ));
    assert_eq!(
        (r.decode.as_str(), r.kv_transport.as_deref()),
        ("d:2", Some("shm"))
    );
}

#[test]
fn rejects_with_the_right_status() {
    let b = body(10, 100);
    let cfg = PolicyConfig {
        max_queue_depth: Some(2),
        ..PolicyConfig::default()
    };
    let eps = vec![ep("d:1", Role::Decode, "", 2), ep("d:2", Role::Solo, "", 5)];
    let too_long = decide(
        &cfg,
        &eps,
        &RequestInput {
            content_length: None,
            body: Some(&b),
            prompt_tokens: Some(450),
            subset: None,
        },
    );
    let l = too_long.rejection().expect("rejects");
    assert_eq!(l.status, 400);
    assert_eq!(l.message().unwrap(), context_length_message(450, 100, 512));
    let full = decide(
        &cfg,
        &eps,
        &RequestInput {
            content_length: None,
            body: Some(&b),
            prompt_tokens: Some(4),
            subset: None,
        },
    );
    assert_eq!(full.rejection().map(|l| l.status), Some(429));
    let none = decide(
        &cfg,
        &eps,
        &RequestInput {
            content_length: None,
            body: Some(&b),
            prompt_tokens: Some(4),
            subset: Some("x:1"),
        },
    );
    assert_eq!(none.rejection().map(|l| l.status), Some(503));
    let bad = decide(
        &cfg,
        &eps,
        &RequestInput {
            content_length: None,
            body: Some(b"{"),
            prompt_tokens: None,
            subset: None,
        },
    );
    assert_eq!(bad.rejection().map(|l| l.status), Some(400));
}

#[test]
fn estimates_from_bytes_when_not_counted() {
    let eps = vec![ep("d:1", Role::Decode, "", 0)];
    // 4100 prompt bytes / 8 ≥ 512 → rejected without a host count.
    let b = body(4100, 16);
    let d = decide(
        &PolicyConfig::default(),
        &eps,
        &RequestInput {
            content_length: None,
            body: Some(&b),
            prompt_tokens: None,
            subset: None,
        },
    );
    assert_eq!(d.rejection().map(|l| l.status), Some(400));
    let off = PolicyConfig {
        estimate_bytes_per_token: 0,
        ..PolicyConfig::default()
    };
    assert!(
        decide(
            &off,
            &eps,
            &RequestInput {
                content_length: None,
                body: Some(&b),
                prompt_tokens: None,
                subset: None
            }
        )
        .route()
        .is_some()
    );
    // Without the body: the estimate comes from content-length.
    let d = decide(
        &PolicyConfig::default(),
        &eps,
        &RequestInput {
            body: None,
            content_length: Some(b.len() as u64),
            prompt_tokens: None,
            subset: None,
        },
    );
    assert_eq!(d.rejection().map(|l| l.status), Some(400));
}

#[test]
fn outcome_borrows_the_same_decision() {
    let eps = vec![
        ep("d:1", Role::Decode, "n1", 0),
        ep("p:1", Role::Prefill, "n1", 0),
    ];
    let b = body(10, 5);
    let cfg = PolicyConfig::default();
    for prompt in [5, 100] {
        let input = RequestInput {
            content_length: None,
            body: Some(&b),
            prompt_tokens: Some(prompt),
            subset: None,
        };
        let outcome = choose(&cfg, &eps, &input);
        assert_eq!(outcome.clone().into_decision(), decide(&cfg, &eps, &input));
        let Outcome::Route(r) = outcome else {
            panic!("rejected")
        };
        let hdrs: Vec<_> = r.headers().collect();
        if prompt < cfg.disaggregation_threshold_tokens {
            assert_eq!(hdrs, vec![(headers::DESTINATION_ENDPOINT, "d:1")]);
        } else {
            assert_eq!(
                hdrs,
                vec![
                    (headers::DESTINATION_ENDPOINT, "d:1"),
                    (headers::PREFILLER_HOST_PORT, "p:1"),
                    (headers::KV_TRANSPORT, "shm"),
                ]
            );
        }
    }
}

/// The ranked walk (a cached snapshot) decides exactly as the full scan
/// (the free `decide`), over random snapshots full of score ties.
#[test]
fn ranked_pick_matches_the_scan() {
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut next = |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    };
    let roles = [Role::Decode, Role::Prefill, Role::Solo];
    // Remote prefill, local prefill, rejected: each must occur.
    let mut seen = [0usize; 3];
    for round in 0..3000 {
        let n = next(12) as usize;
        let eps: Vec<Endpoint> = (0..n)
            .map(|_| Endpoint {
                seq_len: [64, 256, 512][next(3) as usize],
                running: next(3) as u32,
                kv_usage: [0.0, 0.5][next(2) as usize],
                healthy: next(5) != 0,
                transports: if next(3) == 0 {
                    vec!["tcp".into()]
                } else {
                    vec![]
                },
                ..ep(
                    &format!("10.0.0.{}:1", next(6)),
                    roles[next(3) as usize],
                    ["", "a", "b"][next(3) as usize],
                    next(4) as u32,
                )
            })
            .collect();
        let cfg = PolicyConfig {
            max_queue_depth: [None, Some(2)][next(2) as usize],
            running_weight: [1.0, 4.0, 0.0][next(3) as usize],
            ..PolicyConfig::default()
        };
        let subset = ["", "10.0.0.1:1,10.0.0.2:1, 10.0.0.3:1"][next(2) as usize];
        let b = body(10, [5, 100][next(2) as usize]);
        let prompt = [None, Some(4), Some(40), Some(300), Some(600)][next(5) as usize];
        let input = RequestInput {
            content_length: None,
            body: Some(&b),
            prompt_tokens: prompt,
            subset: (!subset.is_empty()).then_some(subset),
        };
        let scanned = decide(&cfg, &eps, &input);
        let json = serde_json::to_vec(&eps).unwrap();
        let mut policy = PdPolicy::new(cfg);
        let prompt_text = prompt.map(|p| p.to_string());
        let walked = policy.decide(
            input.subset,
            input.body,
            None,
            prompt_text.as_deref().map(str::as_bytes),
            Some(b"v"),
            || Some(json),
        );
        assert_eq!(walked, scanned, "round {round}: {eps:?} {input:?}");
        seen[match &scanned {
            Decision::Route(r) if r.prefill.is_some() => 0,
            Decision::Route(_) => 1,
            Decision::Reject(_) => 2,
        }] += 1;
    }
    assert!(seen.iter().all(|&n| n > 100), "{seen:?}");
}

#[test]
fn snapshot_cache_reuses_by_version() {
    let json = serde_json::to_vec(&vec![ep("d:1", Role::Decode, "", 0)]).unwrap();
    let mut c = SnapshotCache::default();
    assert_eq!(
        c.get(Some(b"1"), || Some(json.clone()))
            .unwrap()
            .unwrap()
            .len(),
        1
    );
    assert_eq!(
        c.get(Some(b"1"), || panic!("must not refetch"))
            .unwrap()
            .unwrap()
            .len(),
        1
    );
    assert!(
        c.get(Some(b"2"), || Some(b"[]".to_vec()))
            .unwrap()
            .unwrap()
            .is_empty()
    );
    assert!(c.get(None, || None).unwrap().is_none());
    assert!(c.get(Some(b"3"), || Some(b"{".to_vec())).is_err());
}

#[test]
fn static_pool_when_no_snapshot() {
    let cfg = PolicyConfig {
        static_endpoints: vec![ep("s:1", Role::Solo, "", 0)],
        ..PolicyConfig::default()
    };
    let mut p = PdPolicy::new(cfg);
    let r = route(p.decide(None, Some(b""), None, None, None, || None));
    assert_eq!(r.decode, "s:1");
}

/// `max_completion_tokens` wins over `max_tokens` (OpenAI, vLLM and every
/// door), and a chat naming neither only needs its first token to fit (it
/// fills the context), as the gateway and the worker serve it.
#[test]
fn max_completion_tokens_first_and_a_chat_fills_the_context() {
    let eps = vec![ep("d:1", Role::Solo, "", 0)];
    let verdict = |body: &str, prompt: u64| {
        decide(
            &PolicyConfig::default(),
            &eps,
            &RequestInput {
                content_length: None,
                body: Some(body.as_bytes()),
                prompt_tokens: Some(prompt),
                subset: None,
            },
        )
        .rejection()
        .map(|l| (l.status, l.message().unwrap_or_default().to_string()))
    };
    let both = r#"{"model":"m","prompt":"x","max_tokens":400,"max_completion_tokens":8}"#;
    assert_eq!(verdict(both, 500), None, "8 fits after 500 of 512");
    let both = r#"{"model":"m","prompt":"x","max_tokens":8,"max_completion_tokens":400}"#;
    assert_eq!(
        verdict(both, 500),
        Some((400, context_length_message(500, 400, 512)))
    );
    // A chat without either, 500 of 512 tokens: served (the gateway gives it
    // max_tokens 12); a completion is held to the default 16.
    let chat = r#"{"model":"m","messages":[{"role":"user","content":"x"}]}"#;
    assert_eq!(verdict(chat, 500), None);
    assert_eq!(
        verdict(chat, 512),
        Some((400, context_length_message(512, 1, 512)))
    );
    let completion = r#"{"model":"m","prompt":"x"}"#;
    assert_eq!(
        verdict(completion, 500),
        Some((400, context_length_message(500, 16, 512)))
    );
}
