//! Tests of the JSON reader (`super`): it accepts and rejects what
//! `serde_json` does for the endpoint snapshot and the configuration.

use super::*;

fn ep(i: usize) -> Endpoint {
    Endpoint {
        address: format!("10.0.{}.{}:80{:02}", i / 7, i % 250, i % 100),
        role: [Role::Prefill, Role::Decode, Role::Solo][i % 3],
        vendor: [Vendor::Rngd, Vendor::Atom, Vendor::Cpu][i % 3],
        node: if i.is_multiple_of(4) {
            String::new()
        } else {
            format!("node-\"{i}\"\\é\u{1F600}\t")
        },
        seq_len: (i as u32).wrapping_mul(2_654_435_761),
        queue_depth: i as u32 % 9,
        running: u32::MAX - i as u32,
        kv_usage: (i as f64) * 0.013_7 + 1e-9 * i as f64,
        healthy: !i.is_multiple_of(5),
        transports: (0..i % 3)
            .map(|t| ["shm", "tcp", "nixl-ucx"][t].into())
            .collect(),
        weight_version: (!i.is_multiple_of(3)).then(|| format!("{:016x}", i * 7919)),
    }
}

/// Both readers on one document: the same value, or both an error.
fn agree_endpoints(doc: &str) {
    let ours = endpoints(doc.as_bytes());
    let theirs = serde_json::from_str::<Vec<Endpoint>>(doc);
    match (&ours, &theirs) {
        (Ok(a), Ok(b)) => assert_eq!(a, b, "{doc}"),
        (Err(_), Err(_)) => {}
        _ => panic!("disagree on {doc}: ours {ours:?}, serde_json {theirs:?}"),
    }
}

fn agree_config(doc: &str) {
    let ours = config(doc.as_bytes());
    let theirs = serde_json::from_str::<PolicyConfig>(doc);
    match (&ours, &theirs) {
        (Ok(a), Ok(b)) => assert_eq!(a, b, "{doc}"),
        (Err(_), Err(_)) => {}
        _ => panic!("disagree on {doc}: ours {ours:?}, serde_json {theirs:?}"),
    }
}

#[test]
fn strings_written_and_read_as_serde_json_does() {
    for s in [
        "",
        "plain",
        "quote \" backslash \\ slash /",
        "\n\r\t\u{8}\u{c}\u{0}\u{1f}\u{7f}",
        "é ü 字 \u{1F600}",
        "prompt_tokens (500) + max_tokens (64) exceeds 512",
    ] {
        let mut ours = Vec::new();
        write_string(&mut ours, s);
        assert_eq!(ours, serde_json::to_vec(s).unwrap(), "{s:?}");
        assert_eq!(string(&ours).unwrap(), s);
    }
    for doc in [
        r#""\u00e9\ud83d\ude00\/""#,
        r#""a\"b""#,
        r#""\ud800""#,
        r#""x"#,
        "\"\t\"",
    ] {
        assert_eq!(
            string(doc.as_bytes()).ok(),
            serde_json::from_str::<String>(doc).ok(),
            "{doc}"
        );
    }
}

#[test]
fn reads_serialized_snapshots_as_serde_json_does() {
    for n in [0, 1, 2, 7, 64] {
        let eps: Vec<Endpoint> = (0..n).map(ep).collect();
        let compact = serde_json::to_string(&eps).unwrap();
        let pretty = serde_json::to_string_pretty(&eps).unwrap();
        assert_eq!(endpoints(compact.as_bytes()).unwrap(), eps);
        assert_eq!(endpoints(pretty.as_bytes()).unwrap(), eps);
    }
}

#[test]
fn endpoint_documents_accepted_and_refused_alike() {
    let base = r#""address":"a:1","role":"decode","vendor":"cpu","seq_len":512"#;
    let mut docs = vec![
        format!("[{{{base}}}]"),
        format!(" [ {{ {base} , \"node\" : \"n\\u00e9\\ud83d\\ude00\" }} ] "),
        format!("[{{{base},\"kv_usage\":1}}]"),
        format!("[{{{base},\"kv_usage\":0.1}}]"),
        format!("[{{{base},\"kv_usage\":-2.5e-3}}]"),
        format!("[{{{base},\"kv_usage\":1E2}}]"),
        format!("[{{{base},\"extra\":{{\"x\":[1,2,{{\"y\":null}}],\"z\":\"\\\"\"}}}}]"),
        format!("[{{{base},\"healthy\":false,\"transports\":[]}}]"),
        format!("[{{{base},\"transports\":[\"shm\",\"tcp\"]}}]"),
        format!("[{{{base},\"weight_version\":\"99dda3c02b151cb8\"}}]"),
        format!("[{{{base},\"weight_version\":null}}]"),
        format!("[{{{base},\"weight_version\" : null , \"node\":\"n\"}}]"),
        format!("[{{{base}}},{{{base}}}]"),
        "[]".into(),
        // refused:
        "[".into(),
        "{}".into(),
        format!("[{{{base}}}] x"),
        format!("[{{{base}}},]"),
        format!("[{{{base},}}]"),
        format!("[{{{base},\"seq_len\":1}}]"),
        r#"[{"address":"a:1","role":"decode","vendor":"cpu"}]"#.into(),
        r#"[{"role":"decode","vendor":"cpu","seq_len":1}]"#.into(),
        r#"[{"address":"a:1","role":"Decode","vendor":"cpu","seq_len":1}]"#.into(),
        r#"[{"address":"a:1","role":"decode","vendor":"gpu","seq_len":1}]"#.into(),
        r#"[{"address":"a:1","role":"decode","vendor":"cpu","seq_len":-1}]"#.into(),
        r#"[{"address":"a:1","role":"decode","vendor":"cpu","seq_len":1.0}]"#.into(),
        r#"[{"address":"a:1","role":"decode","vendor":"cpu","seq_len":4294967296}]"#.into(),
        r#"[{"address":"a:1","role":"decode","vendor":"cpu","seq_len":4294967295}]"#.into(),
        r#"[{"address":"a:1","role":"decode","vendor":"cpu","seq_len":01}]"#.into(),
        r#"[{"address":"a:1","role":"decode","vendor":"cpu","seq_len":-0}]"#.into(),
        r#"[{"address":"a:1","role":"decode","vendor":"cpu","seq_len":-0.0}]"#.into(),
        r#"[{"address":"a:1","role":"decode","vendor":"cpu","seq_len":1e2}]"#.into(),
        r#"[{"address":"a:1","role":"decode","vendor":"cpu","seq_len":null}]"#.into(),
        r#"[{"address":null,"role":"decode","vendor":"cpu","seq_len":1}]"#.into(),
        format!("[{{{base},\"healthy\":1}}]"),
        format!("[{{{base},\"kv_usage\":1e400}}]"),
        format!("[{{{base},\"kv_usage\":.5}}]"),
        format!("[{{{base},\"kv_usage\":1.}}]"),
        format!("[{{{base},\"node\":\"\\ud800\"}}]"),
        format!("[{{{base},\"node\":\"\\udc00\"}}]"),
        format!("[{{{base},\"node\":\"\\x\"}}]"),
        format!("[{{{base},\"node\":\"tab\there\"}}]"),
        format!("[{{{base},\"transports\":[\"shm\",1]}}]"),
        format!("[{{{base},\"weight_version\":1}}]"),
        format!("[{{{base},\"weight_version\":nul}}]"),
        format!("[{{{base},\"weight_version\":\"a\",\"weight_version\":\"b\"}}]"),
        format!("[{{{base},\"extra\":[1,}}]"),
    ];
    docs.push(format!(
        "[{{{base},\"extra\":{}1{}}}]",
        "[".repeat(100),
        "]".repeat(100)
    ));
    for d in &docs {
        agree_endpoints(d);
    }
    // Deeper than 128 levels: refused here (see the module docs).
    let deep = format!("[{{{base},\"x\":{}1{}}}]", "[".repeat(200), "]".repeat(200));
    assert!(endpoints(deep.as_bytes()).is_err());
    // Invalid UTF-8 inside a string.
    let mut bad = format!("[{{{base},\"node\":\"xx\"}}]").into_bytes();
    let at = bad.len() - 5;
    bad[at] = 0xff;
    assert!(endpoints(&bad).is_err());
    assert!(serde_json::from_slice::<Vec<Endpoint>>(&bad).is_err());
}

#[test]
fn configurations_accepted_and_refused_alike() {
    let eps = serde_json::to_string(&(0..3).map(ep).collect::<Vec<_>>()).unwrap();
    for d in [
        "{}".to_string(),
        r#"{"disaggregation_threshold_tokens":0,"same_node_transport":"nixl-ucx","cross_node_transport":"tcp"}"#.into(),
        r#"{"max_queue_depth":null}"#.into(),
        r#"{"max_queue_depth":8,"default_max_tokens":64,"estimate_bytes_per_token":0}"#.into(),
        r#"{"queue_weight":0.5,"running_weight":2,"kv_usage_weight":1e1}"#.into(),
        format!(r#"{{"static_endpoints":{eps}}}"#),
        // refused:
        r#"{"unknown":1}"#.into(),
        r#"{"max_queue_depth":-1}"#.into(),
        r#"{"max_queue_depth":4294967296}"#.into(),
        r#"{"default_max_tokens":18446744073709551616}"#.into(),
        r#"{"default_max_tokens":"16"}"#.into(),
        r#"{"queue_weight":null}"#.into(),
        r#"{"queue_weight":1,"queue_weight":2}"#.into(),
        r#"{"static_endpoints":{}}"#.into(),
        "{".into(),
        r#"{"same_node_transport":"shm"} {}"#.into(),
    ] {
        agree_config(&d);
    }
    // An array is not a configuration here (see the module docs).
    assert!(config(b"[]").is_err());
    let c = config(br#"{"default_max_tokens":18446744073709551615}"#).unwrap();
    assert_eq!(c.default_max_tokens, u64::MAX);
}
