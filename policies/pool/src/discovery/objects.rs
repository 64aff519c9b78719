//! The Kubernetes objects discovery reads and what it makes of them: the
//! `InferencePool` resource (`inference.networking.k8s.io/v1`, the fields a
//! picker needs), its selector as a label-selector string, and
//! [`endpoint_of`], which turns one Pod into one [`Endpoint`] (or says why it
//! is not one), and [`kv_stream_of`], its KV-event stream. Pure functions:
//! the watch in `super::watch` calls them.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::net::IpAddr;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use rngd_policy_core::{Endpoint, Role, Vendor};
use serde::{Deserialize, Serialize};

use crate::source::KvStream;

/// Pod label naming the llm-d role of a model server: `prefill`, `decode` or
/// `both` (absent = `both`).
pub const ROLE_LABEL: &str = "llm-d.ai/role";
/// Pod label naming the accelerator vendor: `furiosa`, `rebellions` or `cpu`
/// (absent: the pod's device resource limits decide, else `cpu`).
pub const ACCELERATOR_LABEL: &str = "ai-rm.io/accelerator";
/// Pod annotation with the worker's compiled context length (required).
pub const SEQ_LEN_ANNOTATION: &str = "rngd-pd.io/seq-len";
/// Pod annotation listing the KV transports the worker speaks, comma
/// separated (absent = [`DEFAULT_TRANSPORTS`]).
pub const TRANSPORTS_ANNOTATION: &str = "rngd-pd.io/transports";
/// Pod annotation with the port of the worker's KV-event publisher (PUB);
/// the router subscribes at `tcp://POD_IP:PORT` (never another host).
pub const KV_EVENTS_PORT_ANNOTATION: &str = "rngd-pd.io/kv-events-port";
/// Pod annotation with the port of its replay (ROUTER) socket.
pub const KV_EVENTS_REPLAY_PORT_ANNOTATION: &str = "rngd-pd.io/kv-events-replay-port";
/// Transports of a pod without [`TRANSPORTS_ANNOTATION`].
pub const DEFAULT_TRANSPORTS: &[&str] = &["shm", "tcp"];
/// Transport names [`TRANSPORTS_ANNOTATION`] may list (`nixl`, RNGD → ATOM
/// over NIXL's HETERO_NPU backend, is a known name; this build's workers
/// refuse to run it).
pub const KNOWN_TRANSPORTS: &[&str] = &["shm", "tcp", "nixl-ucx", "nixl"];
/// Extended resource of a FuriosaAI RNGD card.
pub const RNGD_RESOURCE: &str = "furiosa.ai/rngd";
/// Extended resource of a Rebellions ATOM card.
pub const ATOM_RESOURCE: &str = "rebellions.ai/ATOM";

// === impl InferencePool ===

/// An `InferencePool` (`inference.networking.k8s.io/v1`): the fields the
/// picker reads. Unknown fields (status, `endpointPickerRef`, ...) are ignored.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct InferencePool {
    /// Standard object metadata.
    #[serde(default)]
    pub metadata: ObjectMeta,
    /// The pool's desired state.
    #[serde(default)]
    pub spec: InferencePoolSpec,
}

/// `spec` of an [`InferencePool`].
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct InferencePoolSpec {
    /// Which pods of the pool's namespace are its members.
    #[serde(default)]
    pub selector: PoolSelector,
    /// The model servers' port (the API admits exactly one).
    #[serde(default)]
    pub target_ports: Vec<PoolPort>,
}

/// `spec.selector`: labels a member pod carries, all of them.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PoolSelector {
    /// Label key → value.
    #[serde(default)]
    pub match_labels: BTreeMap<String, String>,
}

/// One of `spec.targetPorts`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PoolPort {
    /// Port number on the member pods.
    pub number: i32,
}

impl kube::Resource for InferencePool {
    type DynamicType = ();
    type Scope = k8s_openapi::NamespaceResourceScope;

    fn kind(_: &()) -> Cow<'_, str> {
        "InferencePool".into()
    }
    fn group(_: &()) -> Cow<'_, str> {
        "inference.networking.k8s.io".into()
    }
    fn version(_: &()) -> Cow<'_, str> {
        "v1".into()
    }
    fn plural(_: &()) -> Cow<'_, str> {
        "inferencepools".into()
    }
    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

/// What discovery takes from a pool: the pod selector and the port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolTarget {
    /// `spec.selector.matchLabels` as a label-selector string (`k=v,k2=v2`).
    pub selector: String,
    /// `spec.targetPorts[0].number`.
    pub port: u16,
}

/// The selector and port of `pool`, or why the pool cannot be used.
pub fn pool_target(pool: &InferencePool) -> Result<PoolTarget, String> {
    let labels = &pool.spec.selector.match_labels;
    if labels.is_empty() {
        // An empty selector would select every pod of the namespace.
        return Err("spec.selector.matchLabels is empty".into());
    }
    let port = match pool.spec.target_ports.as_slice() {
        [p] => u16::try_from(p.number)
            .ok()
            .filter(|n| *n > 0)
            .ok_or_else(|| format!("spec.targetPorts[0].number {} is not a port", p.number))?,
        [] => return Err("spec.targetPorts is empty".into()),
        more => {
            return Err(format!(
                "spec.targetPorts has {} ports; one is supported",
                more.len()
            ));
        }
    };
    for (k, v) in labels {
        if !label_text_ok(k, true) || !label_text_ok(v, false) {
            return Err(format!(
                "spec.selector.matchLabels {k:?}={v:?} is not a label"
            ));
        }
    }
    let selector = labels
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",");
    Ok(PoolTarget { selector, port })
}

/// Characters a label key (with its `prefix/`) or value may hold; nothing that
/// would change the meaning of a selector string (`,`, `=`, `!`, spaces).
fn label_text_ok(s: &str, key: bool) -> bool {
    !(key && s.is_empty())
        && s.len() <= 317
        && s.bytes().all(|b| {
            b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.') || key && b == b'/'
        })
}

// === pods → endpoints ===

/// Why a pod of the pool is not an endpoint now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Skip {
    /// Not (yet, or any more) serving: not Running, not Ready, terminating,
    /// or without an IP. Normal; not logged.
    NotReady,
    /// Ready but unusable: its labels or annotations are wrong (logged).
    Invalid(String),
}

/// The endpoint `pod` is at `port`, or why it is none.
pub fn endpoint_of(pod: &Pod, port: u16) -> Result<Endpoint, Skip> {
    let meta = &pod.metadata;
    if meta.deletion_timestamp.is_some() {
        return Err(Skip::NotReady);
    }
    let status = pod.status.as_ref().ok_or(Skip::NotReady)?;
    if status.phase.as_deref() != Some("Running") {
        return Err(Skip::NotReady);
    }
    let ready = status
        .conditions
        .iter()
        .flatten()
        .any(|c| c.type_ == "Ready" && c.status == "True");
    if !ready {
        return Err(Skip::NotReady);
    }
    let ip: IpAddr = match status.pod_ip.as_deref() {
        None | Some("") => return Err(Skip::NotReady),
        Some(s) => s
            .parse()
            .map_err(|_| Skip::Invalid(format!("status.podIP {s:?} is not an IP address")))?,
    };
    let labels = meta.labels.as_ref();
    let annotations = meta.annotations.as_ref();
    let label = |k: &str| labels.and_then(|l| l.get(k)).map(String::as_str);
    let annotation = |k: &str| annotations.and_then(|a| a.get(k)).map(String::as_str);

    let role = match label(ROLE_LABEL) {
        None | Some("both") => Role::Solo,
        Some("prefill") => Role::Prefill,
        Some("decode") => Role::Decode,
        Some(other) => {
            return Err(Skip::Invalid(format!(
                "label {ROLE_LABEL}={other:?} (expected prefill, decode or both)"
            )));
        }
    };
    let vendor = match label(ACCELERATOR_LABEL) {
        Some("furiosa") => Vendor::Rngd,
        Some("rebellions") => Vendor::Atom,
        Some("cpu") => Vendor::Cpu,
        Some(other) => {
            return Err(Skip::Invalid(format!(
                "label {ACCELERATOR_LABEL}={other:?} (expected furiosa, rebellions or cpu)"
            )));
        }
        None => vendor_from_resources(pod),
    };
    let seq_len = match annotation(SEQ_LEN_ANNOTATION) {
        None => {
            return Err(Skip::Invalid(format!(
                "annotation {SEQ_LEN_ANNOTATION} is missing"
            )));
        }
        Some(s) => s
            .trim()
            .parse::<u32>()
            .ok()
            .filter(|n| *n > 0)
            .ok_or_else(|| {
                Skip::Invalid(format!(
                    "annotation {SEQ_LEN_ANNOTATION}={s:?} is not a positive integer"
                ))
            })?,
    };
    let transports = match annotation(TRANSPORTS_ANNOTATION) {
        None => DEFAULT_TRANSPORTS.iter().map(|s| s.to_string()).collect(),
        Some(list) => {
            let t: Vec<String> = list
                .split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(String::from)
                .collect();
            if let Some(bad) = t.iter().find(|s| !KNOWN_TRANSPORTS.contains(&s.as_str())) {
                return Err(Skip::Invalid(format!(
                    "annotation {TRANSPORTS_ANNOTATION} names {bad:?} (known: {})",
                    KNOWN_TRANSPORTS.join(", ")
                )));
            }
            t
        }
    };
    let node = pod
        .spec
        .as_ref()
        .and_then(|s| s.node_name.clone())
        .unwrap_or_default();
    Ok(Endpoint {
        address: std::net::SocketAddr::new(ip, port).to_string(),
        role,
        vendor,
        node,
        seq_len,
        queue_depth: 0,
        running: 0,
        kv_usage: 0.0,
        healthy: true,
        transports,
        weight_version: None,
    })
}

/// The KV-event stream of `endpoint` (a pod [`endpoint_of`] accepted), from
/// its [`KV_EVENTS_PORT_ANNOTATION`] / [`KV_EVENTS_REPLAY_PORT_ANNOTATION`]:
/// always at the pod's own IP. `None` without the annotation.
pub fn kv_stream_of(pod: &Pod, endpoint: &Endpoint) -> Result<Option<KvStream>, Skip> {
    let annotations = pod.metadata.annotations.as_ref();
    let annotation = |k: &str| annotations.and_then(|a| a.get(k)).map(String::as_str);
    let port = |k: &str| -> Result<Option<u16>, Skip> {
        match annotation(k) {
            None => Ok(None),
            Some(s) => s
                .trim()
                .parse::<u16>()
                .ok()
                .filter(|p| *p > 0)
                .map(Some)
                .ok_or_else(|| Skip::Invalid(format!("annotation {k}={s:?} is not a port number"))),
        }
    };
    let publish = port(KV_EVENTS_PORT_ANNOTATION)?;
    let replay = port(KV_EVENTS_REPLAY_PORT_ANNOTATION)?;
    let Some(publish) = publish else {
        if replay.is_some() {
            return Err(Skip::Invalid(format!(
                "annotation {KV_EVENTS_REPLAY_PORT_ANNOTATION} without {KV_EVENTS_PORT_ANNOTATION}"
            )));
        }
        return Ok(None);
    };
    let addr: std::net::SocketAddr = endpoint
        .address
        .parse()
        .map_err(|_| Skip::Invalid(format!("address {:?} is not ip:port", endpoint.address)))?;
    let at = |p: u16| format!("tcp://{}", std::net::SocketAddr::new(addr.ip(), p));
    Ok(Some(KvStream {
        id: endpoint.address.clone(),
        endpoint: at(publish),
        replay_endpoint: replay.map(at),
        topic: String::new(),
    }))
}

/// The vendor a pod's device resource limits name (cpu when none).
fn vendor_from_resources(pod: &Pod) -> Vendor {
    let asks = |name: &str| {
        pod.spec.iter().flat_map(|s| &s.containers).any(|c| {
            c.resources
                .as_ref()
                .and_then(|r| r.limits.as_ref())
                .is_some_and(|l| l.contains_key(name))
        })
    };
    if asks(RNGD_RESOURCE) {
        Vendor::Rngd
    } else if asks(ATOM_RESOURCE) {
        Vendor::Atom
    } else {
        Vendor::Cpu
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(json: serde_json::Value) -> Pod {
        serde_json::from_value(json).unwrap()
    }

    fn ready_pod(labels: serde_json::Value, annotations: serde_json::Value) -> Pod {
        pod(serde_json::json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "w-0", "namespace": "ai", "uid": "u-1",
                          "labels": labels, "annotations": annotations},
            "spec": {"nodeName": "node-a", "containers": [{"name": "worker", "image": "i"}]},
            "status": {"phase": "Running", "podIP": "10.1.2.3",
                        "conditions": [{"type": "Ready", "status": "True"}]}
        }))
    }

    #[test]
    fn a_ready_pod_is_an_endpoint_with_its_labels_and_annotations() {
        let p = ready_pod(
            serde_json::json!({"llm-d.ai/role": "prefill", "ai-rm.io/accelerator": "furiosa"}),
            serde_json::json!({"rngd-pd.io/seq-len": "512", "rngd-pd.io/transports": "shm, tcp,nixl-ucx, nixl"}),
        );
        let e = endpoint_of(&p, 8000).unwrap();
        assert_eq!(e.address, "10.1.2.3:8000");
        assert_eq!(e.role, Role::Prefill);
        assert_eq!(e.vendor, Vendor::Rngd);
        assert_eq!(e.node, "node-a");
        assert_eq!(e.seq_len, 512);
        assert_eq!(e.transports, ["shm", "tcp", "nixl-ucx", "nixl"]);
        assert!(e.healthy);
    }

    #[test]
    fn defaults_role_both_transports_and_vendor_from_resources() {
        let mut p = ready_pod(
            serde_json::json!({}),
            serde_json::json!({"rngd-pd.io/seq-len": "256"}),
        );
        p.spec.as_mut().unwrap().containers[0].resources = Some(
            serde_json::from_value(serde_json::json!({"limits": {"rebellions.ai/ATOM": "1"}}))
                .unwrap(),
        );
        let e = endpoint_of(&p, 9).unwrap();
        assert_eq!(e.role, Role::Solo);
        assert_eq!(e.vendor, Vendor::Atom);
        assert_eq!(e.transports, ["shm", "tcp"]);
    }

    #[test]
    fn ipv6_pods_get_a_bracketed_address() {
        let mut p = ready_pod(
            serde_json::json!({}),
            serde_json::json!({"rngd-pd.io/seq-len": "256"}),
        );
        p.status.as_mut().unwrap().pod_ip = Some("fd00::7".into());
        assert_eq!(endpoint_of(&p, 8000).unwrap().address, "[fd00::7]:8000");
    }

    #[test]
    fn pods_that_do_not_serve_are_not_ready() {
        let base = ready_pod(
            serde_json::json!({}),
            serde_json::json!({"rngd-pd.io/seq-len": "256"}),
        );
        let mut unready = base.clone();
        unready
            .status
            .as_mut()
            .unwrap()
            .conditions
            .as_mut()
            .unwrap()[0]
            .status = "False".into();
        let mut pending = base.clone();
        pending.status.as_mut().unwrap().phase = Some("Pending".into());
        let mut no_ip = base.clone();
        no_ip.status.as_mut().unwrap().pod_ip = None;
        let mut terminating = base.clone();
        terminating.metadata.deletion_timestamp =
            Some(serde_json::from_value(serde_json::json!("2026-12-01T10:00:00Z")).unwrap());
        for p in [unready, pending, no_ip, terminating] {
            assert_eq!(endpoint_of(&p, 8000), Err(Skip::NotReady));
        }
    }

    #[test]
    fn wrong_labels_and_annotations_are_named() {
        let cases = [
            (
                serde_json::json!({"llm-d.ai/role": "router"}),
                serde_json::json!({"rngd-pd.io/seq-len": "1"}),
                "llm-d.ai/role",
            ),
            (
                serde_json::json!({"ai-rm.io/accelerator": "gpu"}),
                serde_json::json!({"rngd-pd.io/seq-len": "1"}),
                "ai-rm.io/accelerator",
            ),
            (
                serde_json::json!({}),
                serde_json::json!({}),
                "seq-len is missing",
            ),
            (
                serde_json::json!({}),
                serde_json::json!({"rngd-pd.io/seq-len": "0"}),
                "positive integer",
            ),
            (
                serde_json::json!({}),
                serde_json::json!({"rngd-pd.io/seq-len": "8", "rngd-pd.io/transports": "rdma"}),
                "\"rdma\"",
            ),
        ];
        for (labels, annotations, needle) in cases {
            match endpoint_of(&ready_pod(labels, annotations), 1) {
                Err(Skip::Invalid(msg)) => assert!(msg.contains(needle), "{msg}"),
                other => panic!("{needle}: {other:?}"),
            }
        }
    }

    #[test]
    fn the_kv_event_stream_is_at_the_pods_own_ip() {
        let p = ready_pod(
            serde_json::json!({}),
            serde_json::json!({SEQ_LEN_ANNOTATION: "512",
                KV_EVENTS_PORT_ANNOTATION: "5557", KV_EVENTS_REPLAY_PORT_ANNOTATION: "5558"}),
        );
        let e = endpoint_of(&p, 8000).expect("endpoint");
        let s = kv_stream_of(&p, &e).expect("ok").expect("a stream");
        assert_eq!(s.id, e.address);
        let ip = e.address.rsplit_once(':').unwrap().0.to_string();
        assert_eq!(s.endpoint, format!("tcp://{ip}:5557"));
        assert_eq!(s.replay_endpoint, Some(format!("tcp://{ip}:5558")));
        let none = ready_pod(
            serde_json::json!({}),
            serde_json::json!({SEQ_LEN_ANNOTATION: "512"}),
        );
        assert_eq!(kv_stream_of(&none, &e).expect("ok"), None);
        for annotations in [
            serde_json::json!({KV_EVENTS_PORT_ANNOTATION: "tcp://evil:1"}),
            serde_json::json!({KV_EVENTS_PORT_ANNOTATION: "0"}),
            serde_json::json!({KV_EVENTS_REPLAY_PORT_ANNOTATION: "5558"}),
        ] {
            let p = ready_pod(serde_json::json!({}), annotations);
            assert!(matches!(kv_stream_of(&p, &e), Err(Skip::Invalid(_))));
        }
    }

    fn pool(json: serde_json::Value) -> InferencePool {
        serde_json::from_value(json).unwrap()
    }

    #[test]
    fn the_pool_gives_a_selector_and_a_port() {
        let p = pool(serde_json::json!({
            "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": "demo", "namespace": "ai"},
            "spec": {"selector": {"matchLabels": {"rngd-pd.io/pool": "demo", "app": "w"}},
                     "targetPorts": [{"number": 8000}],
                     "endpointPickerRef": {"name": "demo-epp", "port": {"number": 9002}}},
            "status": {"parents": []}
        }));
        assert_eq!(
            pool_target(&p),
            Ok(PoolTarget {
                selector: "app=w,rngd-pd.io/pool=demo".into(),
                port: 8000
            })
        );
    }

    #[test]
    fn unusable_pools_are_refused_with_the_field() {
        let cases = [
            (
                serde_json::json!({"selector": {"matchLabels": {}}, "targetPorts": [{"number": 1}]}),
                "matchLabels is empty",
            ),
            (
                serde_json::json!({"selector": {"matchLabels": {"a": "b"}}, "targetPorts": []}),
                "targetPorts is empty",
            ),
            (
                serde_json::json!({"selector": {"matchLabels": {"a": "b"}}, "targetPorts": [{"number": 70000}]}),
                "not a port",
            ),
            (
                serde_json::json!({"selector": {"matchLabels": {"a": "b,c=d"}}, "targetPorts": [{"number": 1}]}),
                "not a label",
            ),
        ];
        for (spec, needle) in cases {
            let err = pool_target(&pool(
                serde_json::json!({"metadata": {"name": "p"}, "spec": spec}),
            ))
            .unwrap_err();
            assert!(err.contains(needle), "{err}");
        }
    }
}
