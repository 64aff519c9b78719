//! A Kubernetes API server for the discovery tests. No real API server can run
//! on the machines these tests run on, so this serves the parts of the API the
//! picker uses, the way the real one answers them:
//!
//! - list (`GET .../pods?labelSelector=…`, `GET .../inferencepools?fieldSelector=metadata.name=…`)
//!   answering a `PodList` / `InferencePoolList` with `metadata.resourceVersion`;
//! - watch (`?watch=true&resourceVersion=N&allowWatchBookmarks=true`): a chunked
//!   stream of `{"type": ADDED|MODIFIED|DELETED|BOOKMARK|ERROR, "object": …}`
//!   lines, every change after `N` in order; an object that stops (starts)
//!   matching the selector is `DELETED` (`ADDED`), as the watch cache does;
//! - `410 Gone` as an `ERROR` event carrying a `Status` (reason `Expired`)
//!   when `N` is older than the compacted history;
//! - bookmarks with the current resource version, so an idle watch resumes
//!   from a fresh version.
//!
//! Objects start from the recorded shapes in `tests/fixtures/kube/`. The test
//! drives it: add, change and delete objects, drop every open watch, compact
//! the history, take the server down.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::http::{StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use tokio::sync::{Notify, mpsc};

/// The two kinds the picker reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    /// `inference.networking.k8s.io/v1` `InferencePool`.
    Pool,
    /// `v1` `Pod`.
    Pod,
}

#[derive(Debug, Clone)]
struct Change {
    rv: u64,
    kind: Kind,
    before: Option<Value>,
    after: Option<Value>,
}

#[derive(Debug, Default)]
struct Store {
    rv: u64,
    objects: BTreeMap<(Kind, String), Value>,
    history: Vec<Change>,
    /// Watches from a version below this get `410 Gone`.
    compacted_below: u64,
    /// Every request is answered 503 while set.
    down: bool,
    /// Bumped to end every open watch.
    generation: u64,
    /// `(kind, resourceVersion)` of every watch request.
    watches: Vec<(Kind, u64)>,
    /// `(kind, resourceVersion)` of every bookmark sent.
    bookmarks: Vec<(Kind, u64)>,
    /// List requests per kind.
    lists: BTreeMap<Kind, u32>,
    /// `410 Gone` answers per kind.
    gone: BTreeMap<Kind, u32>,
}

/// The running fake API server.
pub struct KubeApi {
    /// Bound address (`http://{addr}` is the server URL).
    pub addr: SocketAddr,
    store: Arc<Mutex<Store>>,
    changed: Arc<Notify>,
    _task: tokio::task::JoinHandle<()>,
}

#[derive(Clone)]
struct Shared {
    store: Arc<Mutex<Store>>,
    changed: Arc<Notify>,
    bookmark_every: Duration,
}

fn fixture(name: &str) -> Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/kube")
        .join(name);
    serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap()
}

/// A pod in the recorded shape: `name`, `ip`, the llm-d role label (`None` =
/// no label), Ready or not, and the pool label `rngd-pd.io/pool=pool`.
pub fn pod(name: &str, ip: &str, role: Option<&str>, pool: &str, ready: bool) -> Value {
    let mut p = fixture("pod.json");
    p["metadata"]["name"] = json!(name);
    p["metadata"]["uid"] = json!(format!("uid-{name}"));
    let labels = p["metadata"]["labels"].as_object_mut().unwrap();
    labels.insert("rngd-pd.io/pool".into(), json!(pool));
    match role {
        Some(r) => {
            labels.insert("llm-d.ai/role".into(), json!(r));
        }
        None => {
            labels.remove("llm-d.ai/role");
        }
    }
    p["status"]["podIP"] = json!(ip);
    p["status"]["podIPs"] = json!([{ "ip": ip }]);
    set_ready(&mut p, ready);
    p
}

/// Sets the pod's `Ready` and `ContainersReady` conditions.
pub fn set_ready(pod: &mut Value, ready: bool) {
    let s = if ready { "True" } else { "False" };
    for c in pod["status"]["conditions"].as_array_mut().unwrap() {
        if c["type"] == "Ready" || c["type"] == "ContainersReady" {
            c["status"] = json!(s);
        }
    }
    pod["status"]["containerStatuses"][0]["ready"] = json!(ready);
}

/// The InferencePool in the recorded shape, selecting `matchLabels` on `port`.
pub fn pool(name: &str, match_labels: Value, port: u16) -> Value {
    let mut p = fixture("inferencepool.json");
    p["metadata"]["name"] = json!(name);
    p["spec"]["selector"]["matchLabels"] = match_labels;
    p["spec"]["targetPorts"] = json!([{ "number": port }]);
    p
}

impl KubeApi {
    /// Starts the server on `127.0.0.1:0`, bookmarks every `bookmark_every`.
    pub async fn start(bookmark_every: Duration) -> KubeApi {
        let store = Arc::new(Mutex::new(Store {
            rv: 1000,
            ..Store::default()
        }));
        let changed = Arc::new(Notify::new());
        let shared = Shared {
            store: store.clone(),
            changed: changed.clone(),
            bookmark_every,
        };
        let app = axum::Router::new().fallback(handle).with_state(shared);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        KubeApi {
            addr,
            store,
            changed,
            _task: task,
        }
    }

    /// A kubeconfig pointing at this server (plain http, no credentials).
    pub fn kubeconfig(&self, dir: &std::path::Path) -> PathBuf {
        let path = dir.join("kubeconfig");
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: http://{}\ncontexts:\n- name: fake\n  context:\n    cluster: fake\n    user: nobody\n    namespace: ai\ncurrent-context: fake\nusers:\n- name: nobody\n  user: {{}}\n",
            self.addr
        );
        std::fs::write(&path, text).unwrap();
        path
    }

    fn store(&self) -> std::sync::MutexGuard<'_, Store> {
        self.store.lock().unwrap()
    }

    /// Creates or replaces an object (named by its `metadata.name`).
    pub fn put(&self, kind: Kind, obj: Value) {
        let name = obj["metadata"]["name"].as_str().unwrap().to_string();
        {
            let mut s = self.store();
            s.rv += 1;
            let rv = s.rv;
            let mut after = obj;
            after["metadata"]["resourceVersion"] = json!(rv.to_string());
            let before = s.objects.insert((kind, name), after.clone());
            s.history.push(Change {
                rv,
                kind,
                before,
                after: Some(after),
            });
        }
        self.changed.notify_waiters();
    }

    /// Deletes an object.
    pub fn delete(&self, kind: Kind, name: &str) {
        {
            let mut s = self.store();
            let Some(before) = s.objects.remove(&(kind, name.to_string())) else {
                return;
            };
            s.rv += 1;
            let rv = s.rv;
            s.history.push(Change {
                rv,
                kind,
                before: Some(before),
                after: None,
            });
        }
        self.changed.notify_waiters();
    }

    /// The object now (to change and `put` back).
    pub fn get(&self, kind: Kind, name: &str) -> Value {
        self.store().objects[&(kind, name.to_string())].clone()
    }

    /// Ends every open watch stream (as a connection reset or the server's
    /// watch timeout would).
    pub fn drop_watches(&self) {
        self.store().generation += 1;
        self.changed.notify_waiters();
    }

    /// Forgets the history: watches resuming from an earlier version get
    /// `410 Gone` and must list again.
    pub fn compact(&self) {
        let mut s = self.store();
        s.compacted_below = s.rv;
        s.history.clear();
    }

    /// Takes the server down (503 to everything, open watches end) or up.
    pub fn set_down(&self, down: bool) {
        {
            let mut s = self.store();
            s.down = down;
            s.generation += 1;
        }
        self.changed.notify_waiters();
    }

    /// The current resource version.
    pub fn resource_version(&self) -> u64 {
        self.store().rv
    }

    /// The `resourceVersion` of every watch request of `kind`, in order.
    pub fn watch_versions(&self, kind: Kind) -> Vec<u64> {
        self.store()
            .watches
            .iter()
            .filter(|(k, _)| *k == kind)
            .map(|(_, rv)| *rv)
            .collect()
    }

    /// How many bookmarks of `kind` carried a version of at least `rv`.
    pub fn bookmarks_at_least(&self, kind: Kind, rv: u64) -> usize {
        self.store()
            .bookmarks
            .iter()
            .filter(|(k, v)| *k == kind && *v >= rv)
            .count()
    }

    /// `410 Gone` answers to watches of `kind` so far.
    pub fn gone(&self, kind: Kind) -> u32 {
        self.store().gone.get(&kind).copied().unwrap_or(0)
    }

    /// List requests of `kind` so far.
    pub fn lists(&self, kind: Kind) -> u32 {
        self.store().lists.get(&kind).copied().unwrap_or(0)
    }
}

// === request handling ===

fn status(code: u16, reason: &str, message: &str) -> Value {
    json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {},
        "status": "Failure", "message": message, "reason": reason, "code": code
    })
}

fn answer(code: StatusCode, body: Value) -> Response {
    (
        code,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

/// Selector of a request: `k=v,k2=v2` (labels) or `metadata.name=x` (fields).
#[derive(Debug, Default, Clone)]
struct Selector {
    labels: Vec<(String, String)>,
    name: Option<String>,
}

impl Selector {
    fn matches(&self, obj: &Value) -> bool {
        if let Some(n) = &self.name
            && obj["metadata"]["name"].as_str() != Some(n)
        {
            return false;
        }
        self.labels
            .iter()
            .all(|(k, v)| obj["metadata"]["labels"][k].as_str() == Some(v))
    }
}

fn pairs(s: &str) -> Vec<(String, String)> {
    s.split(',')
        .filter(|p| !p.is_empty())
        .filter_map(|p| {
            p.split_once('=')
                .map(|(k, v)| (k.to_string(), v.to_string()))
        })
        .collect()
}

fn decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' if i + 2 < b.len() => {
                let h = std::str::from_utf8(&b[i + 1..i + 3]).unwrap();
                out.push(u8::from_str_radix(h, 16).unwrap());
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8(out).unwrap()
}

async fn handle(State(api): State<Shared>, uri: Uri) -> Response {
    let path = uri.path();
    let query: BTreeMap<String, String> = uri
        .query()
        .unwrap_or("")
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_string(), decode(v)))
        .collect();
    let kind = if path == "/api/v1/namespaces/ai/pods" {
        Kind::Pod
    } else if path == "/apis/inference.networking.k8s.io/v1/namespaces/ai/inferencepools" {
        Kind::Pool
    } else {
        return answer(
            StatusCode::NOT_FOUND,
            status(
                404,
                "NotFound",
                &format!("the server could not find the requested resource ({path})"),
            ),
        );
    };
    if api.store.lock().unwrap().down {
        return answer(
            StatusCode::SERVICE_UNAVAILABLE,
            status(
                503,
                "ServiceUnavailable",
                "the server is currently unable to handle the request",
            ),
        );
    }
    let mut sel = Selector::default();
    if let Some(l) = query.get("labelSelector") {
        sel.labels = pairs(l);
    }
    if let Some(f) = query.get("fieldSelector") {
        for (k, v) in pairs(f) {
            assert_eq!(k, "metadata.name", "unsupported field selector");
            sel.name = Some(v);
        }
    }
    if query.get("watch").map(String::as_str) == Some("true") {
        let rv: u64 = query
            .get("resourceVersion")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let bookmarks = query.get("allowWatchBookmarks").map(String::as_str) == Some("true");
        watch(api, kind, sel, rv, bookmarks)
    } else {
        list(&api, kind, &sel)
    }
}

fn list(api: &Shared, kind: Kind, sel: &Selector) -> Response {
    let mut s = api.store.lock().unwrap();
    *s.lists.entry(kind).or_default() += 1;
    let items: Vec<Value> = s
        .objects
        .iter()
        .filter(|((k, _), o)| *k == kind && sel.matches(o))
        .map(|(_, o)| {
            // Items of a list carry no kind/apiVersion.
            let mut o = o.clone();
            let m = o.as_object_mut().unwrap();
            m.remove("kind");
            m.remove("apiVersion");
            o
        })
        .collect();
    let (api_version, list_kind) = match kind {
        Kind::Pod => ("v1", "PodList"),
        Kind::Pool => ("inference.networking.k8s.io/v1", "InferencePoolList"),
    };
    answer(
        StatusCode::OK,
        json!({
            "kind": list_kind, "apiVersion": api_version,
            "metadata": {"resourceVersion": s.rv.to_string()},
            "items": items
        }),
    )
}

/// The watch event a change is for a watcher with `sel`, if any.
fn event(c: &Change, sel: &Selector) -> Option<Value> {
    let was = c.before.as_ref().is_some_and(|o| sel.matches(o));
    let is = c.after.as_ref().is_some_and(|o| sel.matches(o));
    let (kind, obj) = match (was, is, &c.after) {
        (false, false, _) => return None,
        (true, true, Some(a)) => ("MODIFIED", a.clone()),
        (false, true, Some(a)) => ("ADDED", a.clone()),
        (true, false, Some(a)) => ("DELETED", a.clone()),
        (true, false, None) => {
            let mut b = c.before.clone().unwrap();
            b["metadata"]["resourceVersion"] = json!(c.rv.to_string());
            ("DELETED", b)
        }
        _ => return None,
    };
    Some(json!({"type": kind, "object": obj}))
}

fn watch(api: Shared, kind: Kind, sel: Selector, from: u64, bookmarks: bool) -> Response {
    // No buffer to speak of: an event is sent once the one before was taken.
    let (tx, rx) = mpsc::channel::<Result<String, std::convert::Infallible>>(1);
    {
        let mut s = api.store.lock().unwrap();
        s.watches.push((kind, from));
    }
    tokio::spawn(async move {
        let line = |v: Value| Ok(format!("{v}\n"));
        let (generation, expired) = {
            let mut s = api.store.lock().unwrap();
            let expired = from < s.compacted_below;
            if expired {
                *s.gone.entry(kind).or_default() += 1;
            }
            (s.generation, expired)
        };
        if expired {
            let msg = format!("too old resource version: {from}");
            let _ = tx
                .send(line(
                    json!({"type": "ERROR", "object": status(410, "Expired", &msg)}),
                ))
                .await;
            return;
        }
        let mut cursor = from;
        let mut tick = tokio::time::interval(api.bookmark_every);
        tick.tick().await;
        loop {
            let notified = api.changed.notified();
            let (lines, now, ended) = {
                let s = api.store.lock().unwrap();
                let lines: Vec<Value> = s
                    .history
                    .iter()
                    .filter(|c| c.kind == kind && c.rv > cursor)
                    .filter_map(|c| event(c, &sel))
                    .collect();
                (lines, s.rv, s.generation != generation || s.down)
            };
            if ended {
                return;
            }
            cursor = now;
            for l in lines {
                if tx.send(line(l)).await.is_err() {
                    return;
                }
            }
            tokio::select! {
                _ = notified => {}
                _ = tick.tick(), if bookmarks => {
                    let (k, av) = match kind {
                        Kind::Pod => ("Pod", "v1"),
                        Kind::Pool => ("InferencePool", "inference.networking.k8s.io/v1"),
                    };
                    let rv = api.store.lock().unwrap().rv;
                    // Events up to `rv` not yet sent are sent first by the next round.
                    if rv == cursor {
                        let bm = json!({"type": "BOOKMARK", "object": {
                            "kind": k, "apiVersion": av,
                            "metadata": {"resourceVersion": rv.to_string()}
                        }});
                        if tx.send(line(bm)).await.is_err() {
                            return;
                        }
                        api.store.lock().unwrap().bookmarks.push((kind, rv));
                    }
                }
                _ = tx.closed() => return,
            }
        }
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from_stream(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        ))
        .unwrap()
}
