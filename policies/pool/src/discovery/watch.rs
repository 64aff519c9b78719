//! The watch loop of pool discovery: one watcher on the `InferencePool` (by
//! name), one on the pods its selector selects (restarted when the selector
//! changes), and the snapshot recomputed after every event. A relist
//! (`Init` … `InitDone`) replaces the pod set atomically at its end, so pods
//! deleted while the watch was down leave the snapshot then.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::stream::BoxStream;
use futures::{StreamExt, TryStreamExt as _};
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client};

use super::objects::{InferencePool, PoolTarget, Skip, endpoint_of, kv_stream_of, pool_target};
use super::{KubeEndpoints, KubeOptions};

type Events<K> = BoxStream<'static, Result<Event<K>, watcher::Error>>;

/// The pods of the pool as last listed/watched, by name.
#[derive(Default)]
struct Pods {
    live: BTreeMap<String, Pod>,
    /// Pods of a relist in progress (between `Init` and `InitDone`).
    relist: Option<BTreeMap<String, Pod>>,
    /// The last reason logged per invalid pod (each logged once).
    warned: BTreeMap<String, String>,
}

fn pod_name(p: &Pod) -> String {
    p.metadata.name.clone().unwrap_or_default()
}

/// Applies a pod event; returns whether the live set changed.
fn apply(pods: &mut Pods, ev: Event<Pod>) -> bool {
    match ev {
        Event::Init => {
            pods.relist = Some(BTreeMap::new());
            false
        }
        Event::InitApply(p) => {
            pods.relist
                .get_or_insert_with(BTreeMap::new)
                .insert(pod_name(&p), p);
            false
        }
        Event::InitDone => {
            pods.live = pods.relist.take().unwrap_or_default();
            true
        }
        Event::Apply(p) => {
            pods.live.insert(pod_name(&p), p);
            true
        }
        Event::Delete(p) => {
            pods.live.remove(&pod_name(&p));
            true
        }
    }
}

/// The live pods as the source publishes them.
pub(super) struct Listed {
    /// Their endpoints at the pool's port.
    pub endpoints: Vec<rngd_policy_core::Endpoint>,
    /// The KV-event streams of those that announce one.
    pub streams: Vec<crate::source::KvStream>,
    /// Skip counts by reason.
    pub skipped: [(&'static str, i64); 2],
}

/// The endpoints (and KV-event streams) of the live pods at `port`, and the
/// skip counts by reason.
fn endpoints(pods: &mut Pods, port: u16) -> Listed {
    let mut list = Vec::new();
    let mut streams = Vec::new();
    let (mut not_ready, mut invalid) = (0, 0);
    let mut warned = BTreeMap::new();
    for (name, pod) in &pods.live {
        match endpoint_of(pod, port).and_then(|e| Ok((kv_stream_of(pod, &e)?, e))) {
            Ok((stream, e)) => {
                streams.extend(stream);
                list.push(e);
            }
            Err(Skip::NotReady) => not_ready += 1,
            Err(Skip::Invalid(why)) => {
                invalid += 1;
                if pods.warned.get(name) != Some(&why) {
                    tracing::warn!(pod = %name, reason = %why, "pod of the pool skipped");
                }
                warned.insert(name.clone(), why);
            }
        }
    }
    pods.warned = warned;
    Listed {
        endpoints: list,
        streams,
        skipped: [("not_ready", not_ready), ("invalid", invalid)],
    }
}

fn pod_watch(api: &Api<Pod>, target: &PoolTarget) -> Events<Pod> {
    watcher(
        api.clone(),
        watcher::Config::default().labels(&target.selector),
    )
}

fn watcher<K>(api: Api<K>, cfg: watcher::Config) -> Events<K>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
    K::DynamicType: Default,
{
    watcher::watcher(api, cfg)
        .default_backoff()
        .map_err(|e| e)
        .boxed()
}

/// Next event of an optional stream (pending forever when there is none).
async fn next<K>(s: &mut Option<Events<K>>) -> Option<Result<Event<K>, watcher::Error>> {
    match s {
        Some(s) => s.next().await,
        None => std::future::pending().await,
    }
}

/// Runs until the source is dropped by everyone else or both watches end.
pub(super) async fn run(client: Client, opts: KubeOptions, out: Arc<KubeEndpoints>) {
    let pools: Api<InferencePool> = Api::namespaced(client.clone(), &opts.namespace);
    let pod_api: Api<Pod> = Api::namespaced(client, &opts.namespace);
    let by_name = watcher::Config::default().fields(&format!("metadata.name={}", opts.pool_name));
    let mut pool_events = watcher(pools, by_name);
    let mut pod_events: Option<Events<Pod>> = None;
    let mut target: Option<PoolTarget> = None;
    // During a relist of the pool: what the relist has found so far.
    let mut pool_relist: Option<Option<PoolTarget>> = None;
    let mut pods = Pods::default();
    let mut pool_synced = false;
    let mut pods_synced = false;
    let mut tick = tokio::time::interval(
        (opts.stale_after / 4).clamp(Duration::from_millis(50), Duration::from_secs(1)),
    );
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);

    loop {
        // Only this task and its owner hold the source: the owner is gone.
        if Arc::strong_count(&out) == 1 {
            return;
        }
        let mut changed = false;
        tokio::select! {
            ev = pool_events.next() => {
                let Some(ev) = ev else { return };
                let new_target = match ev {
                    Err(e) => { out.watch_failed("inferencepools", &e); continue; }
                    Ok(ev) => {
                        // `Init` comes before the list call: no proof the API answers.
                        if !matches!(ev, Event::Init) {
                            out.watch_ok();
                        }
                        match ev {
                            Event::Init => { pool_relist = Some(None); continue; }
                            Event::InitApply(p) => { pool_relist = Some(usable(&p, &opts)); continue; }
                            Event::InitDone => { pool_synced = true; pool_relist.take().flatten() }
                            Event::Apply(p) => usable(&p, &opts),
                            Event::Delete(_) => {
                                tracing::warn!(pool = %opts.pool_name, "the InferencePool was deleted");
                                None
                            }
                        }
                    }
                };
                if new_target.is_none() && pool_synced && target.is_some() {
                    tracing::warn!(pool = %opts.pool_name, namespace = %opts.namespace, "no usable InferencePool: no endpoints");
                }
                let selector_changed = new_target.as_ref().map(|t| &t.selector) != target.as_ref().map(|t| &t.selector);
                if selector_changed {
                    pods = Pods::default();
                    pods_synced = false;
                    pod_events = new_target.as_ref().map(|t| pod_watch(&pod_api, t));
                    if let Some(t) = &new_target {
                        tracing::info!(selector = %t.selector, port = t.port, "watching the pool's pods");
                    }
                }
                changed = selector_changed || new_target != target || pool_synced && new_target.is_none();
                target = new_target;
            }
            ev = next(&mut pod_events) => {
                match ev {
                    None => { pod_events = None; }
                    Some(Err(e)) => out.watch_failed("pods", &e),
                    Some(Ok(ev)) => {
                        if !matches!(ev, Event::Init) {
                            out.watch_ok();
                        }
                        if matches!(ev, Event::InitDone) {
                            pods_synced = true;
                        }
                        changed = apply(&mut pods, ev);
                    }
                }
            }
            _ = tick.tick() => out.check_stale(Instant::now()),
        }
        if changed {
            match &target {
                Some(t) => {
                    let listed = endpoints(&mut pods, t.port);
                    out.publish(listed.endpoints, listed.streams, &listed.skipped);
                }
                None => out.publish(Vec::new(), Vec::new(), &[("not_ready", 0), ("invalid", 0)]),
            }
        }
        if pool_synced && (target.is_none() || pods_synced) {
            out.mark_synced();
        }
    }
}

/// The pool's target, or `None` (logged) when the pool cannot be used.
fn usable(pool: &InferencePool, opts: &KubeOptions) -> Option<PoolTarget> {
    match pool_target(pool) {
        Ok(t) => Some(t),
        Err(why) => {
            tracing::warn!(pool = %opts.pool_name, reason = %why, "the InferencePool cannot be used");
            None
        }
    }
}
