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
        weight_version: None,
    }
}

fn weights(e: Endpoint, version: Option<&str>) -> Endpoint {
    Endpoint {
        weight_version: version.map(String::from),
        ..e
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
            ..Default::default()
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
            ..Default::default()
        },
    ));
    assert_eq!(short.prefill, None);
    // The decode endpoint and the reason.
    assert_eq!(short.headers.len(), 2);
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
            ..Default::default()
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
            ..Default::default()
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
            ..Default::default()
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
            ..Default::default()
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
            ..Default::default()
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
            ..Default::default()
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
                subset: None,
                ..Default::default()
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
            ..Default::default()
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
            ..Default::default()
        };
        let outcome = choose(&cfg, &eps, &input);
        assert_eq!(outcome.clone().into_decision(), decide(&cfg, &eps, &input));
        let Outcome::Route(r) = outcome else {
            panic!("rejected")
        };
        let hdrs: Vec<_> = r.headers().collect();
        if prompt < cfg.disaggregation_threshold_tokens {
            assert_eq!(
                hdrs,
                vec![
                    (headers::DESTINATION_ENDPOINT, "d:1"),
                    (headers::ROUTE_REASON, "short_prompt")
                ]
            );
        } else {
            assert_eq!(
                hdrs,
                vec![
                    (headers::DESTINATION_ENDPOINT, "d:1"),
                    (headers::PREFILLER_HOST_PORT, "p:1"),
                    (headers::KV_TRANSPORT, "shm"),
                    (headers::ROUTE_REASON, "disaggregated"),
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
        // Cache information: none, or a random count (or `?`) for some addresses.
        let cache: Option<String> = if next(2) == 0 {
            let mut entries = Vec::new();
            for i in 1..=6 {
                if next(2) == 0 {
                    entries.push(match next(4) {
                        0 => format!("10.0.0.{i}:1=?"),
                        k => format!("10.0.0.{i}:1={}", [0, 32, 280][k as usize - 1]),
                    });
                }
            }
            Some(entries.join(","))
        } else {
            None
        };
        let input = RequestInput {
            content_length: None,
            body: Some(&b),
            prompt_tokens: prompt,
            subset: (!subset.is_empty()).then_some(subset),
            prefix_cache: cache.as_deref().map(str::as_bytes),
            ..Default::default()
        };
        let scanned = decide(&cfg, &eps, &input);
        let json = serde_json::to_vec(&eps).unwrap();
        let mut policy = PdPolicy::new(cfg);
        let prompt_text = prompt.map(|p| p.to_string());
        let props = RequestProps {
            subset: input.subset,
            body: input.body,
            prompt_tokens: prompt_text.as_deref().map(str::as_bytes),
            prefix_cache: input.prefix_cache,
            ..Default::default()
        };
        let walked = policy.decide(&props, Some(b"v"), || Some(json));
        assert_eq!(walked, scanned, "round {round}: {eps:?} {input:?}");
        seen[match &scanned {
            Decision::Route(r) if r.prefill.is_some() => 0,
            Decision::Route(_) => 1,
            Decision::Reject(_) => 2,
        }] += 1;
    }
    assert!(seen.iter().all(|&n| n > 50), "{seen:?}");
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
    let props = RequestProps {
        body: Some(b""),
        ..Default::default()
    };
    let r = route(p.decide(&props, None, || None));
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
                ..Default::default()
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

// === cache-aware routing and the PD decision ===

/// Decides a request of `prompt` tokens with `cache` as `rngd_pd.prefix_cache`.
fn cached_route(
    cfg: &PolicyConfig,
    eps: &[Endpoint],
    prompt: u64,
    cache: Option<&str>,
    goal: Option<f64>,
) -> Route {
    let b = body(10, 16);
    route(decide(
        cfg,
        eps,
        &RequestInput {
            body: Some(&b),
            prompt_tokens: Some(prompt),
            prefix_cache: cache.map(str::as_bytes),
            ttft_goal_ms: goal,
            ..Default::default()
        },
    ))
}

fn reason(r: &Route) -> &str {
    r.headers
        .iter()
        .find(|(k, _)| k == headers::ROUTE_REASON)
        .map(|(_, v)| v.as_str())
        .expect("a route reason")
}

#[test]
fn the_cached_endpoint_wins_unless_overloaded() {
    let cfg = PolicyConfig::default();
    let eps = vec![
        ep("a:1", Role::Decode, "", 0),
        ep("b:1", Role::Decode, "", 0),
        ep("p:1", Role::Prefill, "", 0),
    ];
    // Equal load: without cache information the address breaks the tie (a);
    // b holding the prompt's prefix wins.
    assert_eq!(cached_route(&cfg, &eps, 420, None, None).decode, "a:1");
    let r = cached_route(&cfg, &eps, 420, Some("a:1=0,b:1=400"), None);
    assert_eq!(r.decode, "b:1");
    // 20 tokens left to prefill there: no disaggregation.
    assert_eq!((r.prefill.as_deref(), reason(&r)), (None, "cached"));
    // b with three queued requests (score 12) loses its 8-point credit.
    let busy = vec![
        ep("a:1", Role::Decode, "", 0),
        ep("b:1", Role::Decode, "", 3),
    ];
    assert_eq!(
        cached_route(&cfg, &busy, 420, Some("b:1=400"), None).decode,
        "a:1"
    );
    // Unknown (`?`) and unlisted endpoints count as nothing cached; a
    // prefix_weight of 0 is load-only.
    assert_eq!(
        cached_route(&cfg, &eps, 420, Some("a:1=?,b:1=?"), None).decode,
        "a:1"
    );
    let load_only = PolicyConfig {
        prefix_weight: 0.0,
        ..PolicyConfig::default()
    };
    assert_eq!(
        cached_route(&load_only, &eps, 420, Some("b:1=400"), None).decode,
        "a:1"
    );
}

/// (what, prompt, cache, goal ms, prefill queue, expected prefill, reason)
type Row = (
    &'static str,
    u64,
    Option<&'static str>,
    Option<f64>,
    u32,
    Option<&'static str>,
    &'static str,
);

#[test]
fn pd_decision_rows() {
    let cfg = PolicyConfig::default();
    let eps = vec![
        ep("d:1", Role::Decode, "", 0),
        ep("p:1", Role::Prefill, "", 0),
    ];
    // (what, prompt, cache, goal ms, prefill queue, expected prefill, reason)
    let rows: [Row; 8] = [
        ("short prompt", 20, None, None, 0, None, "short_prompt"),
        (
            "few non-cached tokens",
            300,
            Some("d:1=288"),
            None,
            0,
            None,
            "cached",
        ),
        (
            "long cold prompt",
            300,
            None,
            None,
            0,
            Some("p:1"),
            "disaggregated",
        ),
        (
            "cached here: fewer tokens to compute than there",
            300,
            Some("d:1=160"),
            None,
            0,
            None,
            "faster_locally",
        ),
        (
            "TTFT goal met locally",
            300,
            None,
            Some(1000.0),
            0,
            None,
            "ttft_goal_met_locally",
        ),
        (
            "TTFT goal unmet locally",
            300,
            None,
            Some(100.0),
            0,
            Some("p:1"),
            "disaggregated",
        ),
        (
            "prefill pool busier",
            300,
            None,
            None,
            5,
            None,
            "faster_locally",
        ),
        (
            "prefill pool busier but cached there",
            300,
            Some("p:1=288"),
            None,
            2,
            Some("p:1"),
            "disaggregated",
        ),
    ];
    for (what, prompt, cache, goal, pq, want, why) in rows {
        let eps = vec![eps[0].clone(), ep("p:1", Role::Prefill, "", pq)];
        let r = cached_route(&cfg, &eps, prompt, cache, goal);
        assert_eq!(r.prefill.as_deref(), want, "{what}");
        assert_eq!(reason(&r), why, "{what}");
    }
    // Streams running on the decode endpoint make a local prefill costly:
    // with 4 running, the busier prefill endpoint still takes it.
    let running = vec![
        Endpoint {
            running: 4,
            ..ep("d:1", Role::Decode, "", 0)
        },
        ep("p:1", Role::Prefill, "", 5),
    ];
    let r = cached_route(&cfg, &running, 300, None, None);
    assert_eq!(
        (r.prefill.as_deref(), reason(&r)),
        (Some("p:1"), "disaggregated")
    );
    // A prefill endpoint's running requests are prefills still being
    // computed: five of them count as five ahead, the same as queued ones.
    let prefilling = vec![
        ep("d:1", Role::Decode, "", 0),
        Endpoint {
            running: 5,
            ..ep("p:1", Role::Prefill, "", 0)
        },
    ];
    let r = cached_route(&cfg, &prefilling, 300, None, None);
    assert_eq!((r.prefill.as_deref(), reason(&r)), (None, "faster_locally"));
    // The configured goal applies when the request names none.
    let with_goal = PolicyConfig {
        ttft_goal_ms: Some(1000.0),
        ..PolicyConfig::default()
    };
    let r = cached_route(&with_goal, &eps, 300, None, None);
    assert_eq!(
        (r.prefill.as_deref(), reason(&r)),
        (None, "ttft_goal_met_locally")
    );
    // A solo endpoint never disaggregates.
    let solo = vec![
        ep("s:1", Role::Solo, "", 0),
        ep("p:1", Role::Prefill, "", 0),
    ];
    assert_eq!(reason(&cached_route(&cfg, &solo, 300, None, None)), "solo");
    // No prefill endpoint: local, said so.
    let alone = vec![ep("d:1", Role::Decode, "", 0)];
    assert_eq!(
        reason(&cached_route(&cfg, &alone, 300, None, None)),
        "no_prefill_endpoint"
    );
}

#[test]
fn the_prefill_endpoint_with_the_longest_cached_prefix_is_chosen() {
    let cfg = PolicyConfig::default();
    let eps = vec![
        ep("d:1", Role::Decode, "", 0),
        ep("p:1", Role::Prefill, "", 0),
        ep("p:2", Role::Prefill, "", 1),
    ];
    assert_eq!(
        cached_route(&cfg, &eps, 400, None, None).prefill.as_deref(),
        Some("p:1")
    );
    assert_eq!(
        cached_route(&cfg, &eps, 400, Some("p:2=320"), None)
            .prefill
            .as_deref(),
        Some("p:2")
    );
}

#[test]
fn cache_property_and_goal_header_parsing() {
    assert_eq!(cached_tokens(b"a:1=5, b:1=16 ,c:1=?", "b:1"), Some(16));
    assert_eq!(cached_tokens(b"a:1=5,b:1=16,c:1=?", "c:1"), None);
    assert_eq!(cached_tokens(b"a:1=5", "x:1"), None);
    assert_eq!(cached_tokens(b"[::1]:8000=48", "[::1]:8000"), Some(48));
    assert_eq!(cached_tokens(b"garbage,,=", "a:1"), None);
    let json = serde_json::to_vec(&vec![ep("d:1", Role::Decode, "", 0)]).unwrap();
    let mut p = PdPolicy::new(PolicyConfig::default());
    let props = RequestProps {
        body: Some(br#"{"prompt":"hi","max_tokens":1}"#),
        prompt_tokens: Some(b"2"),
        ttft_goal_ms: Some("fast"),
        ..Default::default()
    };
    let d = p.decide(&props, None, || Some(json.clone()));
    let l = d.rejection().expect("an unreadable goal is refused");
    assert_eq!(l.status, 400);
    assert!(l.message().unwrap().contains(headers::SLO_TTFT_MS));
    let props = RequestProps {
        ttft_goal_ms: Some("250"),
        ..props
    };
    assert!(p.decide(&props, None, || Some(json)).route().is_some());
}

// === the routing strategy (`routing`) ===

fn routing(r: Routing) -> PolicyConfig {
    PolicyConfig {
        routing: r,
        ..PolicyConfig::default()
    }
}

#[test]
fn routing_is_read_from_the_configuration() {
    assert_eq!(PolicyConfig::default().routing, Routing::Cache);
    for (json, want) in [
        (r#"{}"#, Routing::Cache),
        (r#"{"routing":"cache"}"#, Routing::Cache),
        (r#"{"routing":"load"}"#, Routing::Load),
        (r#"{"routing":"round_robin"}"#, Routing::RoundRobin),
    ] {
        let c = PolicyConfig::from_json(json.as_bytes()).expect(json);
        assert_eq!(c.routing, want, "{json}");
        // The direct reader and serde agree.
        let serde: PolicyConfig = serde_json::from_str(json).expect(json);
        assert_eq!(serde, c, "{json}");
    }
    for bad in [
        r#"{"routing":"Load"}"#,
        r#"{"routing":"round-robin"}"#,
        r#"{"routing":""}"#,
        r#"{"routing":1}"#,
        r#"{"routing":null}"#,
        r#"{"routing":"load","routing":"cache"}"#,
    ] {
        let e = PolicyConfig::from_json(bad.as_bytes()).expect_err(bad);
        assert!(e.to_string().contains("routing"), "{bad}: {e}");
        assert!(serde_json::from_str::<PolicyConfig>(bad).is_err(), "{bad}");
    }
    let e = PolicyConfig::from_json(br#"{"routing":"lru"}"#).unwrap_err();
    assert!(
        e.to_string().contains(r#""cache", "load", "round_robin""#),
        "{e}"
    );
}

/// (what, routing, cache, expected decode, expected prefill, reason)
type RoutingRow = (
    &'static str,
    Routing,
    Option<&'static str>,
    &'static str,
    Option<&'static str>,
    &'static str,
);

#[test]
fn routing_rows() {
    let eps = vec![
        ep("a:1", Role::Decode, "", 0),
        ep("b:1", Role::Decode, "", 0),
        ep("p:1", Role::Prefill, "", 0),
    ];
    let rows: [RoutingRow; 6] = [
        (
            "cache: the cached endpoint, its few uncached tokens locally",
            Routing::Cache,
            Some("a:1=0,b:1=400"),
            "b:1",
            None,
            "cached",
        ),
        (
            "cache: no information, the load order",
            Routing::Cache,
            None,
            "a:1",
            Some("p:1"),
            "disaggregated",
        ),
        (
            "load: the cached endpoint is ignored, the whole prompt prefilled remotely",
            Routing::Load,
            Some("a:1=0,b:1=400"),
            "a:1",
            Some("p:1"),
            "disaggregated",
        ),
        (
            "load: a prefill endpoint's cache is ignored too",
            Routing::Load,
            Some("a:1=400,p:1=400"),
            "a:1",
            Some("p:1"),
            "disaggregated",
        ),
        (
            "load: as with no information",
            Routing::Load,
            None,
            "a:1",
            Some("p:1"),
            "disaggregated",
        ),
        (
            "round robin (stateless: the first): the cache is ignored",
            Routing::RoundRobin,
            Some("a:1=0,b:1=400"),
            "a:1",
            Some("p:1"),
            "disaggregated",
        ),
    ];
    for (what, r, cache, decode, prefill, why) in rows {
        let got = cached_route(&routing(r), &eps, 420, cache, None);
        assert_eq!(got.decode, decode, "{what}");
        assert_eq!(got.prefill.as_deref(), prefill, "{what}");
        assert_eq!(reason(&got), why, "{what}");
    }
    // Cache mode is the default configuration's decision.
    for cache in [None, Some("a:1=0,b:1=400"), Some("b:1=64,p:1=320")] {
        for prompt in [20, 300, 420] {
            assert_eq!(
                cached_route(&routing(Routing::Cache), &eps, prompt, cache, None),
                cached_route(&PolicyConfig::default(), &eps, prompt, cache, None),
                "{cache:?} {prompt}"
            );
        }
    }
}

#[test]
fn round_robin_takes_the_endpoints_in_turn() {
    let eps = vec![
        ep("a:1", Role::Decode, "", 3),
        ep("b:1", Role::Decode, "", 0),
        Endpoint {
            healthy: false,
            ..ep("c:1", Role::Decode, "", 0)
        },
        ep("p:1", Role::Prefill, "", 0),
        ep("p:2", Role::Prefill, "", 0),
    ];
    let json = serde_json::to_vec(&eps).unwrap();
    let mut p = PdPolicy::new(routing(Routing::RoundRobin));
    let b = body(10, 16);
    let decide = |p: &mut PdPolicy, tokens: &[u8], cache: Option<&[u8]>| {
        let props = RequestProps {
            body: Some(&b),
            prompt_tokens: Some(tokens),
            prefix_cache: cache,
            ..Default::default()
        };
        route(p.decide(&props, Some(&b"1"[..]), || Some(json.clone())))
    };
    // Load and cache make no difference; the unhealthy endpoint is skipped.
    let got: Vec<(String, Option<String>)> = (0..4)
        .map(|_| {
            let r = decide(&mut p, b"300", Some(&b"b:1=300,p:2=300"[..]));
            (r.decode, r.prefill)
        })
        .collect();
    let want = [
        ("a:1", "p:1"),
        ("b:1", "p:2"),
        ("a:1", "p:1"),
        ("b:1", "p:2"),
    ];
    for (g, (d, pf)) in got.iter().zip(want) {
        assert_eq!((g.0.as_str(), g.1.as_deref()), (d, Some(pf)));
    }
    // A short prompt takes a decode turn but no prefill turn.
    let r = decide(&mut p, b"5", None);
    assert_eq!((r.decode.as_str(), r.prefill), ("a:1", None));
    let r = decide(&mut p, b"300", None);
    assert_eq!(
        (r.decode.as_str(), r.prefill.as_deref()),
        ("b:1", Some("p:1"))
    );
    // Each policy object counts for itself.
    let mut fresh = PdPolicy::new(routing(Routing::RoundRobin));
    assert_eq!(decide(&mut fresh, b"300", None).decode, "a:1");
    // The queue limit still excludes an endpoint from the rotation.
    let mut limited = PdPolicy::new(PolicyConfig {
        max_queue_depth: Some(3),
        ..routing(Routing::RoundRobin)
    });
    for _ in 0..3 {
        assert_eq!(decide(&mut limited, b"300", None).decode, "b:1");
    }
}

#[test]
fn prefill_and_decode_are_paired_only_on_the_same_weights() {
    let d = |v| weights(ep("d:1", Role::Decode, "", 0), v);
    let p = |addr, queue, v| weights(ep(addr, Role::Prefill, "", queue), v);
    let (a, b) = (Some("aaaaaaaaaaaaaaaa"), Some("bbbbbbbbbbbbbbbb"));
    let load = PolicyConfig::default();
    let rr = PolicyConfig {
        routing: crate::config::Routing::RoundRobin,
        ..PolicyConfig::default()
    };
    // (case, endpoints, prefill chosen, reason)
    let table: Vec<(&str, Vec<Endpoint>, Option<&str>, &str)> = vec![
        (
            "same weights",
            vec![d(a), p("p:1", 0, a)],
            Some("p:1"),
            "disaggregated",
        ),
        (
            "other weights only: served locally, said so",
            vec![d(a), p("p:1", 0, b)],
            None,
            "no_prefill_same_weights",
        ),
        (
            "the matching one, though the other wins the tie",
            vec![d(a), p("p:1", 0, b), p("p:2", 0, a)],
            Some("p:2"),
            "disaggregated",
        ),
        (
            "the prefill's version unknown",
            vec![d(a), p("p:1", 0, None)],
            Some("p:1"),
            "disaggregated",
        ),
        (
            "the decode's version unknown",
            vec![d(None), p("p:1", 0, b)],
            Some("p:1"),
            "disaggregated",
        ),
        ("no prefill at all", vec![d(a)], None, "no_prefill_endpoint"),
    ];
    for (cfg_name, cfg) in [("load", &load), ("round robin", &rr)] {
        for (case, eps, prefill, why) in &table {
            let r = cached_route(cfg, eps, 400, None, None);
            assert_eq!(
                (r.prefill.as_deref(), reason(&r)),
                (*prefill, *why),
                "{cfg_name}: {case}"
            );
            assert_eq!(r.decode, "d:1", "{cfg_name}: {case}");
        }
    }
}
