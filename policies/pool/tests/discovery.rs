//! Pool discovery against a Kubernetes API served by the test
//! (`common/kube_api.rs`: no API server can run on these machines; the objects
//! are the recorded shapes of `tests/fixtures/kube/`). The real `kube` client
//! lists and watches it; each test changes the cluster a step at a time and
//! waits (bounded) for the snapshot to follow.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::kube_api::{Kind, KubeApi, pod, pool, set_ready};
use rngd_policy_core::{Endpoint, Role, Vendor};
use rngd_pool::EndpointSource;
use rngd_pool::discovery::{self, Discovery, KubeOptions};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(15);

async fn start(api: &KubeApi, dir: &std::path::Path, stale_after: Duration) -> Discovery {
    let mut opts = KubeOptions::new("demo", "ai");
    opts.kubeconfig = Some(api.kubeconfig(dir));
    opts.stale_after = stale_after;
    discovery::start(&opts).await.expect("discovery starts")
}

/// Waits until `f` holds (polling; bounded by [`WAIT`]).
async fn until(what: &str, mut f: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < WAIT, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn view(list: &[Endpoint]) -> Vec<(String, Role)> {
    let mut v: Vec<_> = list.iter().map(|e| (e.address.clone(), e.role)).collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

fn eps(items: &[(&str, Role)]) -> Vec<(String, Role)> {
    let mut v: Vec<_> = items.iter().map(|(a, r)| (a.to_string(), *r)).collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

async fn expect(d: &Discovery, what: &str, want: &[(&str, Role)]) {
    let want = eps(want);
    let src = Arc::clone(&d.source);
    let mut last = Vec::new();
    let t0 = Instant::now();
    loop {
        let now = view(&src.snapshot());
        if now == want {
            return;
        }
        if now != last {
            last = now;
        }
        assert!(
            t0.elapsed() < WAIT,
            "{what}: the snapshot stayed {last:?}, expected {want:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn demo_pool() -> serde_json::Value {
    pool("demo", json!({"rngd-pd.io/pool": "demo"}), 8000)
}

#[tokio::test]
async fn the_snapshot_follows_pods_and_the_pool() {
    let dir = tempfile::tempdir().unwrap();
    let api = KubeApi::start(Duration::from_millis(100)).await;
    api.put(Kind::Pool, demo_pool());
    api.put(
        Kind::Pod,
        pod("p1", "10.0.0.1", Some("prefill"), "demo", true),
    );
    api.put(
        Kind::Pod,
        pod("d1", "10.0.0.2", Some("decode"), "demo", true),
    );
    api.put(Kind::Pod, pod("s1", "10.0.0.3", None, "demo", false));
    api.put(
        Kind::Pod,
        pod("x1", "10.0.0.9", Some("decode"), "other", true),
    );
    let mut bad = pod("bad", "10.0.0.8", Some("decode"), "demo", true);
    bad["metadata"]["annotations"] = json!({});
    api.put(Kind::Pod, bad);

    let d = start(&api, dir.path(), Duration::from_secs(30)).await;
    let registry = prometheus::Registry::new();
    d.source.register_metrics(&registry).unwrap();
    expect(
        &d,
        "the first list",
        &[
            ("10.0.0.1:8000", Role::Prefill),
            ("10.0.0.2:8000", Role::Decode),
        ],
    )
    .await;
    until("synced", || d.source.synced()).await;
    let snap = d.source.snapshot();
    let p1 = snap.iter().find(|e| e.address == "10.0.0.1:8000").unwrap();
    assert_eq!(p1.node, "node-a");
    assert_eq!(p1.seq_len, 512);
    assert_eq!(p1.vendor, Vendor::Cpu);
    assert_eq!(p1.transports, ["shm", "tcp"]);
    let text = rngd_telemetry::render(&registry);
    assert!(text.contains("rngd_pd_discovery_endpoints 2"), "{text}");
    assert!(
        text.contains("rngd_pd_discovery_skipped_pods{reason=\"invalid\"} 1"),
        "the pod without its seq-len annotation is counted: {text}"
    );
    assert!(
        text.contains("rngd_pd_discovery_skipped_pods{reason=\"not_ready\"} 1"),
        "{text}"
    );

    // An unready pod turns ready: it joins, as a solo worker (no role label).
    let mut s1 = api.get(Kind::Pod, "s1");
    set_ready(&mut s1, true);
    api.put(Kind::Pod, s1);
    expect(
        &d,
        "s1 turned ready",
        &[
            ("10.0.0.1:8000", Role::Prefill),
            ("10.0.0.2:8000", Role::Decode),
            ("10.0.0.3:8000", Role::Solo),
        ],
    )
    .await;

    // A ready pod turns unready: it leaves at once.
    let mut d1 = api.get(Kind::Pod, "d1");
    set_ready(&mut d1, false);
    api.put(Kind::Pod, d1);
    expect(
        &d,
        "d1 turned unready",
        &[
            ("10.0.0.1:8000", Role::Prefill),
            ("10.0.0.3:8000", Role::Solo),
        ],
    )
    .await;

    // A terminating pod leaves before it is gone.
    let mut p1 = api.get(Kind::Pod, "p1");
    p1["metadata"]["deletionTimestamp"] = json!("2026-12-01T12:00:00Z");
    api.put(Kind::Pod, p1);
    expect(&d, "p1 terminating", &[("10.0.0.3:8000", Role::Solo)]).await;
    api.delete(Kind::Pod, "p1");
    api.delete(Kind::Pod, "s1");
    expect(&d, "p1 and s1 deleted", &[]).await;

    // A new pod appears.
    api.put(
        Kind::Pod,
        pod("d2", "10.0.0.4", Some("decode"), "demo", true),
    );
    expect(&d, "d2 added", &[("10.0.0.4:8000", Role::Decode)]).await;

    // The pool's selector changes: the other pool's pods, not ours.
    api.put(
        Kind::Pool,
        pool("demo", json!({"rngd-pd.io/pool": "other"}), 8000),
    );
    expect(&d, "selector changed", &[("10.0.0.9:8000", Role::Decode)]).await;

    // A pod that leaves the selector leaves the snapshot.
    let mut x1 = api.get(Kind::Pod, "x1");
    x1["metadata"]["labels"]["rngd-pd.io/pool"] = json!("demo");
    api.put(Kind::Pod, x1);
    expect(&d, "x1 relabelled out", &[]).await;

    // The port changes: same pods, new addresses.
    api.put(
        Kind::Pool,
        pool("demo", json!({"rngd-pd.io/pool": "demo"}), 9000),
    );
    expect(
        &d,
        "port changed",
        &[
            ("10.0.0.4:9000", Role::Decode),
            ("10.0.0.9:9000", Role::Decode),
        ],
    )
    .await;

    // The pool is deleted: nothing to route to.
    api.delete(Kind::Pool, "demo");
    expect(&d, "pool deleted", &[]).await;
    api.put(Kind::Pool, demo_pool());
    expect(
        &d,
        "pool re-created",
        &[
            ("10.0.0.4:8000", Role::Decode),
            ("10.0.0.9:8000", Role::Decode),
        ],
    )
    .await;
}

#[tokio::test]
async fn a_dropped_watch_resumes_and_a_too_old_version_relists() {
    let dir = tempfile::tempdir().unwrap();
    let api = KubeApi::start(Duration::from_millis(100)).await;
    api.put(Kind::Pool, demo_pool());
    api.put(
        Kind::Pod,
        pod("d1", "10.0.0.2", Some("decode"), "demo", true),
    );
    let d = start(&api, dir.path(), Duration::from_millis(300)).await;
    let registry = prometheus::Registry::new();
    d.source.register_metrics(&registry).unwrap();
    expect(&d, "first list", &[("10.0.0.2:8000", Role::Decode)]).await;
    let lists = api.lists(Kind::Pod);
    let watches = api.watch_versions(Kind::Pod).len();

    // The watch drops (server timeout, connection reset): it resumes from
    // where it was, without a new list, and sees what happens next.
    api.drop_watches();
    until("the watch is resumed", || {
        api.watch_versions(Kind::Pod).len() > watches
    })
    .await;
    api.put(
        Kind::Pod,
        pod("d2", "10.0.0.3", Some("decode"), "demo", true),
    );
    expect(
        &d,
        "d2 after the resume",
        &[
            ("10.0.0.2:8000", Role::Decode),
            ("10.0.0.3:8000", Role::Decode),
        ],
    )
    .await;
    assert_eq!(
        api.lists(Kind::Pod),
        lists,
        "a resumed watch does not list again"
    );

    // The API goes down: the last good snapshot is served, marked stale
    // after the bound; the failures are counted.
    api.set_down(true);
    api.delete(Kind::Pod, "d1");
    api.put(
        Kind::Pod,
        pod("d3", "10.0.0.4", Some("decode"), "demo", true),
    );
    until("stale", || d.source.is_stale()).await;
    assert_eq!(
        view(&d.source.snapshot()),
        eps(&[
            ("10.0.0.2:8000", Role::Decode),
            ("10.0.0.3:8000", Role::Decode)
        ]),
        "the last good snapshot is served while the API is down"
    );
    let text = rngd_telemetry::render(&registry);
    assert!(text.contains("rngd_pd_discovery_stale 1"), "{text}");
    assert!(
        text.contains("rngd_pd_discovery_watch_errors_total{resource=\"pods\"}"),
        "{text}"
    );

    // The history the watch would resume from is compacted meanwhile: back
    // up, the watch gets 410 Gone, lists again, and the snapshot has the
    // changes made while it was away.
    api.compact();
    api.set_down(false);
    expect(
        &d,
        "relisted after 410",
        &[
            ("10.0.0.3:8000", Role::Decode),
            ("10.0.0.4:8000", Role::Decode),
        ],
    )
    .await;
    assert!(api.gone(Kind::Pod) >= 1, "the resumed watch got 410 Gone");
    assert!(
        api.lists(Kind::Pod) > lists,
        "410 Gone makes the watcher list again"
    );
    until("no longer stale", || !d.source.is_stale()).await;
    assert!(rngd_telemetry::render(&registry).contains("rngd_pd_discovery_stale 0"));
}

#[tokio::test]
async fn bookmarks_keep_the_resume_version_fresh() {
    let dir = tempfile::tempdir().unwrap();
    let api = KubeApi::start(Duration::from_millis(50)).await;
    api.put(Kind::Pool, demo_pool());
    api.put(
        Kind::Pod,
        pod("d1", "10.0.0.2", Some("decode"), "demo", true),
    );
    let d = start(&api, dir.path(), Duration::from_secs(30)).await;
    expect(&d, "first list", &[("10.0.0.2:8000", Role::Decode)]).await;
    let lists = api.lists(Kind::Pod);

    // Writes the pool's pod watch does not see (another pool's pods) move
    // the resource version on; only bookmarks tell the watcher.
    for i in 0..5 {
        api.put(
            Kind::Pod,
            pod(
                &format!("x{i}"),
                &format!("10.0.1.{i}"),
                Some("decode"),
                "other",
                true,
            ),
        );
    }
    let now = api.resource_version();
    // The watch stream has no buffer (one event in flight): the third
    // bookmark at `now` is sent only after the first was taken by the client.
    until("three bookmarks at the current version", || {
        api.bookmarks_at_least(Kind::Pod, now) >= 3
    })
    .await;

    // History compacted up to now, then the watch drops: resuming from the
    // bookmark's version needs no relist; from the list's version it would.
    api.compact();
    let before = api.watch_versions(Kind::Pod).len();
    api.drop_watches();
    until("the pod watch resumed", || {
        api.watch_versions(Kind::Pod).len() > before
    })
    .await;
    let resumed = *api.watch_versions(Kind::Pod).last().unwrap();
    assert!(
        resumed >= now,
        "resumed from {resumed}, older than the bookmarked version {now}"
    );
    api.put(
        Kind::Pod,
        pod("d2", "10.0.0.3", Some("prefill"), "demo", true),
    );
    expect(
        &d,
        "d2 after the resume",
        &[
            ("10.0.0.2:8000", Role::Decode),
            ("10.0.0.3:8000", Role::Prefill),
        ],
    )
    .await;
    assert_eq!(api.lists(Kind::Pod), lists, "no relist was needed");
    assert_eq!(api.gone(Kind::Pod), 0);
}

#[tokio::test]
async fn a_missing_pool_gives_no_endpoints_until_it_is_created() {
    let dir = tempfile::tempdir().unwrap();
    let api = KubeApi::start(Duration::from_millis(100)).await;
    api.put(
        Kind::Pod,
        pod("d1", "10.0.0.2", Some("decode"), "demo", true),
    );
    let d = start(&api, dir.path(), Duration::from_secs(30)).await;
    until("synced", || d.source.synced()).await;
    assert!(d.source.snapshot().is_empty());
    api.put(Kind::Pool, demo_pool());
    expect(&d, "pool created", &[("10.0.0.2:8000", Role::Decode)]).await;
}

#[test]
fn names_are_checked_without_connecting() {
    let ok = KubeOptions::new("demo-pool.v1", "ai-serving");
    ok.check().unwrap();
    for (name, ns, needle) in [
        ("Demo", "ai", "--pool-name"),
        ("demo", "a.b", "--pool-namespace"),
        ("-demo", "ai", "--pool-name"),
        ("demo", "", "--pool-namespace"),
    ] {
        let err = KubeOptions::new(name, ns).check().unwrap_err().to_string();
        assert!(err.contains(needle), "{name}/{ns}: {err}");
    }
    let mut missing = KubeOptions::new("demo", "ai");
    missing.kubeconfig = Some("/nonexistent/kubeconfig".into());
    let err = missing.check().unwrap_err().to_string();
    assert!(err.contains("/nonexistent/kubeconfig"), "{err}");
}
