//! The one routing call both front doors make: [`Picker::pick`] takes the
//! current endpoint snapshot (narrowed by a subset hint), asks the [`Policy`]
//! and checks what it answers. Every way it can fail is a [`PickError`]; each
//! door maps those to its own wire (HTTP status, ext_proc immediate response)
//! in one place.
//!
//! Clients never steer routing: the headers handed to the policy never carry
//! a client-sent `x-gateway-destination-endpoint*`, `x-prefiller-host-port`
//! or `x-rngd-pd-kv-transport` ([`is_steering_header`]). A subset hint
//! reaches the policy only as [`PickRequest::subset`], which a door fills
//! from a trusted source (the picker: Envoy's filter metadata; the gateway:
//! never); the policy then sees it as `x-gateway-destination-endpoint-subset`
//! and only the endpoints it names.

use std::sync::Arc;

use async_trait::async_trait;
use rngd_api::headers;
use rngd_policy_core::{Decision, Endpoint, LocalResponse, Route};
use rngd_policy_host::{PolicyRequest, PolicyRuntime};

use crate::BoxError;
use crate::source::EndpointSource;

/// A policy that could not decide (trap, timeout, bad output, unavailable).
#[derive(Debug, thiserror::Error)]
#[error("{source}")]
pub struct PolicyFailure {
    /// The HTTP status a client gets for it (500 for a guest fault, 503 when
    /// no instance is available, …).
    pub status: u16,
    /// Cause.
    #[source]
    pub source: BoxError,
}

/// Decides where a request goes (or rejects it): the routing policy.
#[async_trait]
pub trait Policy: Send + Sync + 'static {
    /// Runs the policy on one request.
    async fn decide(&self, req: PolicyRequest) -> Result<Decision, PolicyFailure>;
}

/// The real policy: a proxy-wasm module run sandboxed by `rngd-policy-host`.
#[async_trait]
impl Policy for PolicyRuntime {
    async fn decide(&self, req: PolicyRequest) -> Result<Decision, PolicyFailure> {
        PolicyRuntime::decide(self, req)
            .await
            .map_err(|e| PolicyFailure {
                status: e.http_status(),
                source: Box::new(e),
            })
    }
}

/// The default policy's logic (`rngd_policy_core::decide`) run natively,
/// without a sandbox: the stand-in for the wasm module in tests and
/// benchmarks that are not about the module.
#[cfg(feature = "test-util")]
#[derive(Debug, Default)]
pub struct NativePolicy {
    /// The policy configuration.
    pub config: rngd_policy_core::PolicyConfig,
}

#[cfg(feature = "test-util")]
#[async_trait]
impl Policy for NativePolicy {
    async fn decide(&self, req: PolicyRequest) -> Result<Decision, PolicyFailure> {
        let header = |name: &str| {
            req.headers
                .iter()
                .find(|(k, _)| k.eq_ignore_ascii_case(name))
                .map(|(_, v)| v.as_str())
        };
        let input = rngd_policy_core::RequestInput {
            body: Some(&req.body),
            content_length: Some(req.body.len() as u64),
            prompt_tokens: req.prompt_tokens.map(|n| n as u64),
            subset: header(headers::DESTINATION_ENDPOINT_SUBSET),
            prefix_cache: req.prefix_cache.as_deref().map(str::as_bytes),
            ttft_goal_ms: header(headers::SLO_TTFT_MS)
                .and_then(|v| v.trim().parse::<u64>().ok())
                .map(|ms| ms as f64),
        };
        let endpoints: &[Endpoint] = req.endpoints.as_deref().unwrap_or(&[]);
        Ok(rngd_policy_core::decide(&self.config, endpoints, &input))
    }
}

/// Why a pick produced no route.
#[derive(Debug, thiserror::Error)]
pub enum PickError {
    /// The policy answered locally: its status and body go to the client.
    #[error("the policy rejected the request with status {}", .0.status)]
    Rejected(LocalResponse),
    /// The subset hint names no endpoint of the pool (503).
    #[error("no endpoint is eligible under the subset hint")]
    NoEndpointInSubset,
    /// The policy failed.
    #[error("routing policy failed: {0}")]
    Policy(#[source] PolicyFailure),
    /// The policy routed to an address that is not in the endpoint snapshot
    /// (500; nothing is connected to).
    #[error("the policy chose {address}, which is not an endpoint of the pool")]
    OffTable {
        /// The address it chose.
        address: String,
    },
}

impl PickError {
    /// The HTTP status a client gets.
    pub fn status(&self) -> u16 {
        match self {
            PickError::Rejected(l) => l.status,
            PickError::NoEndpointInSubset => 503,
            PickError::Policy(f) => f.status,
            PickError::OffTable { .. } => 500,
        }
    }
}

/// Whether a request header is one that steers routing
/// (`x-gateway-destination-endpoint` and every `x-gateway-destination-endpoint-*`,
/// `x-prefiller-host-port`, `x-rngd-pd-kv-transport`,
/// `x-rngd-pd-route-reason`), which only a pick may
/// set: a client's is dropped before the policy runs and before the request
/// is forwarded. `name` is compared case-insensitively.
pub fn is_steering_header(name: &str) -> bool {
    let n = name.to_ascii_lowercase();
    n.starts_with(headers::DESTINATION_ENDPOINT)
        || n == headers::PREFILLER_HOST_PORT
        || n == headers::KV_TRANSPORT
        || n == headers::ROUTE_REASON
}

/// The reason the policy gave for `route` (`x-rngd-pd-route-reason`:
/// `cached`, `short_prompt`, `disaggregated`, …), if it gave one.
pub fn route_reason(route: &Route) -> Option<&str> {
    route
        .headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case(headers::ROUTE_REASON))
        .map(|(_, v)| v.as_str())
}

/// Longest route reason counted under its own label (a policy's own
/// reasons are free text; longer or non-`[a-z0-9_]` ones count as `other`).
const MAX_REASON_LABEL: usize = 32;

/// The `reason` label of `rngd_pd_route_decisions_total` for a route.
fn reason_label(route: &Route) -> &str {
    match route_reason(route) {
        None => "none",
        Some(r)
            if r.len() <= MAX_REASON_LABEL
                && !r.is_empty()
                && r.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_') =>
        {
            r
        }
        Some(_) => "other",
    }
}

/// The headers the policy sees: `client`'s without the steering headers
/// ([`is_steering_header`]), plus the trusted subset hint, if any, as
/// `x-gateway-destination-endpoint-subset`.
fn policy_headers(
    mut client: Vec<(String, String)>,
    subset: Option<&[String]>,
) -> Vec<(String, String)> {
    client.retain(|(k, _)| !is_steering_header(k));
    if let Some(s) = subset {
        client.push((
            headers::DESTINATION_ENDPOINT_SUBSET.to_string(),
            s.join(","),
        ));
    }
    client
}

/// One request as a front door hands it to [`Picker::pick`].
#[derive(Debug, Clone, Default)]
pub struct PickRequest {
    /// Request headers including the pseudo-headers `:method`, `:path`,
    /// `:authority`, as the client sent them (steering headers are dropped
    /// by the pick).
    pub headers: Vec<(String, String)>,
    /// The body the policy reads.
    pub body: Vec<u8>,
    /// Prompt tokens counted by [`crate::prompt::prepare`].
    pub prompt_tokens: Option<usize>,
    /// Subset hint (`ip:port` list) from a trusted source only (the picker:
    /// Envoy's filter metadata; never a client header); `None` = no hint.
    pub subset: Option<Vec<String>>,
    /// The prompt's token ids as the engine will see them (from
    /// [`crate::prompt::prepare`]); empty = unknown, then the policy gets no
    /// `rngd_pd.prefix_cache`.
    pub prompt_ids: Vec<u32>,
    /// vLLM's `cache_salt` of the request: its prefix matches only blocks
    /// stored under the same salt (none: only unsalted blocks).
    pub cache_salt: Option<String>,
}

/// The endpoint pool and the policy that routes over it.
pub struct Picker {
    policy: Arc<dyn Policy>,
    endpoints: Arc<dyn EndpointSource>,
    prefix: Option<Arc<dyn crate::prefix::PrefixSource>>,
    in_flight: Arc<crate::InFlight>,
    decisions: prometheus::IntCounterVec,
    check: Arc<crate::predicted::CacheCheck>,
    tokenizers: Arc<crate::tokenizers::TokenizerCheck>,
}

/// One routed request: its route, its count on its decode endpoint
/// ([`crate::Held`], kept until the answer ends) and, when the index had
/// information on the endpoint that prefills it, the cached tokens it
/// predicted there ([`crate::predicted::Expected`], handed back with the
/// answer's `cached_tokens`).
#[derive(Debug)]
pub struct Picked {
    /// Where the request goes.
    pub route: Route,
    /// Its count on the decode endpoint.
    pub held: crate::Held,
    /// The cache prediction for the prefilling endpoint.
    pub expected: Option<crate::predicted::Expected>,
}

impl std::fmt::Debug for Picker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Picker").finish_non_exhaustive()
    }
}

fn listed(snapshot: &[Endpoint], address: &str) -> bool {
    snapshot.iter().any(|e| e.address == address)
}

impl Picker {
    /// A picker routing over `endpoints` with `policy`.
    pub fn new(policy: Arc<dyn Policy>, endpoints: Arc<dyn EndpointSource>) -> Self {
        Picker {
            policy,
            endpoints,
            prefix: None,
            in_flight: Arc::default(),
            decisions: prometheus::IntCounterVec::new(
                prometheus::Opts::new(
                    rngd_telemetry::names::ROUTE_DECISIONS_TOTAL,
                    "Routes chosen, by the policy's reason (x-rngd-pd-route-reason).",
                ),
                &["reason"],
            )
            .expect("a valid metric definition"),
            check: Arc::new(
                crate::predicted::CacheCheck::new(Default::default(), None)
                    .expect("valid metric definitions"),
            ),
            tokenizers: Arc::new(
                crate::tokenizers::TokenizerCheck::new(None).expect("valid metric definitions"),
            ),
        }
    }

    /// The same picker for a door whose tokenizer has the digest `digest`
    /// (`PromptCounter::digest`): each endpoint's digest is held against it
    /// (`crate::tokenizers`), and an endpoint that differs gets no
    /// prefix-cache credit. Call it before [`Picker::register_metrics`].
    pub fn with_tokenizer_digest(mut self, digest: Option<String>) -> Self {
        self.tokenizers = Arc::new(
            crate::tokenizers::TokenizerCheck::new(digest).expect("valid metric definitions"),
        );
        self
    }

    /// The tokenizer check (`crate::tokenizers`).
    pub fn tokenizer_check(&self) -> &Arc<crate::tokenizers::TokenizerCheck> {
        &self.tokenizers
    }

    /// Brings the tokenizer gauges up to the endpoints' last scrape (a
    /// door calls it before rendering its `/metrics`; every pick does too).
    pub fn follow_tokenizers(&self) {
        let snapshot = self.endpoints.snapshot();
        self.tokenizers.follow(self.endpoints.as_ref(), &snapshot);
    }

    /// Registers the picker's own metrics (`rngd_pd_route_decisions_total`,
    /// the tokenizer digests, `crate::tokenizers`, and the cache-prediction
    /// checks, `crate::predicted`) in `r`.
    pub fn register_metrics(&self, r: &prometheus::Registry) -> Result<(), crate::PoolError> {
        r.register(Box::new(self.decisions.clone())).map_err(|e| {
            crate::PoolError::Config(format!(
                "metric {}: {e}",
                rngd_telemetry::names::ROUTE_DECISIONS_TOTAL
            ))
        })?;
        self.tokenizers.register(r)?;
        self.check.register(r)
    }

    /// The same picker telling the policy where each endpoint holds a
    /// request's prefix (`rngd_pd.prefix_cache`), from `source`, whose
    /// predictions are checked against the engines' reports with the
    /// default miss budget.
    pub fn with_prefix_source(self, source: Arc<dyn crate::prefix::PrefixSource>) -> Self {
        self.with_prefix_check(source, crate::predicted::CheckOptions::default())
    }

    /// [`Picker::with_prefix_source`] with the miss budget `options`.
    pub fn with_prefix_check(
        mut self,
        source: Arc<dyn crate::prefix::PrefixSource>,
        options: crate::predicted::CheckOptions,
    ) -> Self {
        self.check = Arc::new(
            crate::predicted::CacheCheck::new(options, Some(Arc::clone(&source)))
                .expect("valid metric definitions"),
        );
        self.prefix = Some(source);
        self
    }

    /// The cache-prediction checks (`crate::predicted`).
    pub fn cache_check(&self) -> &Arc<crate::predicted::CacheCheck> {
        &self.check
    }

    /// The endpoint source.
    pub fn endpoints(&self) -> &Arc<dyn EndpointSource> {
        &self.endpoints
    }

    /// The requests routed through this picker and not finished, per decode
    /// endpoint (`crate::inflight`).
    pub fn in_flight(&self) -> &Arc<crate::InFlight> {
        &self.in_flight
    }

    /// Routes one request whose answer nobody waits for (tests, probes):
    /// [`Picker::pick_held`] with the hold given back at once.
    pub async fn pick(&self, req: PickRequest) -> Result<Route, PickError> {
        self.pick_held(req).await.map(|p| p.route)
    }

    /// Routes one request and counts it against its decode endpoint until
    /// the returned [`crate::Held`] is dropped: a door keeps it until the
    /// answer ends, so the picks after this one see it as running there
    /// before any scrape does (`crate::inflight`). The snapshot `Arc` is
    /// passed on unchanged when neither a subset hint nor a count changes
    /// it, so the policy host's same-snapshot shortcut hits.
    pub async fn pick_held(&self, req: PickRequest) -> Result<Picked, PickError> {
        let mut snapshot = self.in_flight.apply(self.endpoints.snapshot());
        // A restarted endpoint's entries go before anything reads them.
        if self.prefix.is_some() {
            self.check
                .follow_restarts(self.endpoints.as_ref(), &snapshot);
        }
        self.tokenizers.follow(self.endpoints.as_ref(), &snapshot);
        if let Some(subset) = &req.subset {
            snapshot = snapshot
                .iter()
                .filter(|e| subset.iter().any(|s| s == &e.address))
                .cloned()
                .collect();
            if snapshot.is_empty() {
                return Err(PickError::NoEndpointInSubset);
            }
        }
        // Without a prefix source (or the prompt's ids) the property is
        // absent and the policy routes on load (docs/policy-abi.md).
        let counts: Option<Vec<Option<usize>>> = self
            .prefix
            .as_deref()
            .filter(|src| !req.prompt_ids.is_empty() && src.active())
            .map(|src| {
                let addresses: Vec<&str> = snapshot.iter().map(|e| e.address.as_str()).collect();
                let mut counts =
                    src.cached_all(&addresses, &req.prompt_ids, req.cache_salt.as_deref());
                // An endpoint with another tokenizer holds blocks of other
                // ids: no information, rather than a false match or miss.
                if self.tokenizers.any_mismatch() {
                    for (c, e) in counts.iter_mut().zip(snapshot.iter()) {
                        if self.tokenizers.is_mismatched(&e.address) {
                            *c = None;
                        }
                    }
                }
                counts
            });
        let prefix_cache = counts.as_deref().map(|counts| {
            let addresses: Vec<&str> = snapshot.iter().map(|e| e.address.as_str()).collect();
            crate::prefix::property_of(&addresses, counts)
        });
        let preq = PolicyRequest {
            headers: policy_headers(req.headers, req.subset.as_deref()),
            body: req.body,
            endpoints: Some(Arc::clone(&snapshot)),
            prompt_tokens: req.prompt_tokens,
            prefix_cache,
        };
        let route = match self.policy.decide(preq).await {
            Ok(Decision::Route(r)) => r,
            Ok(Decision::Reject(local)) => return Err(PickError::Rejected(local)),
            Err(f) => return Err(PickError::Policy(f)),
        };
        for address in std::iter::once(&route.decode).chain(route.prefill.as_ref()) {
            if !listed(&snapshot, address) {
                return Err(PickError::OffTable {
                    address: address.chars().take(200).collect(),
                });
            }
        }
        if let Some(src) = &self.prefix
            && !req.prompt_ids.is_empty()
        {
            src.routed(&route, &req.prompt_ids, req.cache_salt.as_deref());
        }
        // The endpoint that prefills the prompt is the one whose cache the
        // answer's `cached_tokens` reports (the PD path carries the
        // prefill worker's figure).
        let prefills = route.prefill.as_deref().unwrap_or(&route.decode);
        let expected = counts.as_deref().and_then(|counts| {
            let at = snapshot.iter().position(|e| e.address == prefills)?;
            counts
                .get(at)
                .copied()
                .flatten()
                .map(|n| self.check.expect(prefills, n))
        });
        let held = self.in_flight.hold(&route.decode);
        self.decisions
            .with_label_values(&[reason_label(&route)])
            .inc();
        Ok(Picked {
            route,
            held,
            expected,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::{StaticEndpoints, local_endpoint};
    use rngd_policy_core::Role;

    struct Fixed(Decision);

    #[async_trait]
    impl Policy for Fixed {
        async fn decide(&self, _req: PolicyRequest) -> Result<Decision, PolicyFailure> {
            Ok(self.0.clone())
        }
    }

    fn route(decode: &str, prefill: Option<&str>) -> Decision {
        Decision::Route(Route {
            decode: decode.into(),
            prefill: prefill.map(String::from),
            kv_transport: None,
            headers: vec![],
        })
    }

    fn pool() -> Arc<StaticEndpoints> {
        StaticEndpoints::new(vec![
            local_endpoint("10.0.0.1:1".into(), Role::Decode, 512, &[]),
            local_endpoint("10.0.0.2:2".into(), Role::Prefill, 512, &[]),
        ])
    }

    #[tokio::test]
    async fn routes_inside_the_table_only() {
        let ok = Picker::new(
            Arc::new(Fixed(route("10.0.0.1:1", Some("10.0.0.2:2")))),
            pool(),
        );
        assert!(ok.pick(PickRequest::default()).await.is_ok());
        for d in [
            route("10.9.9.9:1", None),
            route("10.0.0.1:1", Some("127.0.0.1:22")),
        ] {
            let p = Picker::new(Arc::new(Fixed(d)), pool());
            let e = p.pick(PickRequest::default()).await.unwrap_err();
            assert!(matches!(e, PickError::OffTable { .. }), "{e}");
            assert_eq!(e.status(), 500);
        }
    }

    #[tokio::test]
    async fn subset_hint_narrows_the_pool() {
        let p = Picker::new(Arc::new(Fixed(route("10.0.0.1:1", None))), pool());
        let e = p
            .pick(PickRequest {
                subset: Some(vec!["10.0.0.7:7".into()]),
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(e.status(), 503);
        // A hint that excludes the chosen address makes the choice off-table.
        let e = p
            .pick(PickRequest {
                subset: Some(vec!["10.0.0.2:2".into()]),
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert!(matches!(e, PickError::OffTable { .. }));
    }

    /// Records the headers and endpoints the policy was given; routes to the first endpoint.
    #[derive(Default)]
    struct Recording(std::sync::Mutex<Vec<PolicyRequest>>);

    #[async_trait]
    impl Policy for Recording {
        async fn decide(&self, req: PolicyRequest) -> Result<Decision, PolicyFailure> {
            let first = req.endpoints.as_deref().unwrap_or(&[])[0].address.clone();
            self.0.lock().unwrap().push(req);
            Ok(route(&first, None))
        }
    }

    fn client_headers() -> Vec<(String, String)> {
        [
            (":path", "/v1/completions"),
            ("x-gateway-destination-endpoint-subset", "10.0.0.2:2"),
            ("X-Gateway-Destination-Endpoint", "10.0.0.2:2"),
            ("x-gateway-destination-endpoint-served", "10.0.0.2:2"),
            ("x-prefiller-host-port", "127.0.0.1:22"),
            ("X-Rngd-Pd-Kv-Transport", "tcp"),
            ("x-request-id", "r1"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
    }

    #[test]
    fn route_reasons_label_their_decisions_boundedly() {
        let with = |v: &str| Route {
            decode: "a:1".into(),
            prefill: None,
            kv_transport: None,
            headers: vec![("X-Rngd-Pd-Route-Reason".into(), v.into())],
        };
        assert_eq!(route_reason(&with("cached")), Some("cached"));
        assert_eq!(
            reason_label(&with("ttft_goal_met_locally")),
            "ttft_goal_met_locally"
        );
        assert_eq!(reason_label(&with("Not A Label")), "other");
        assert_eq!(reason_label(&with(&"x".repeat(40))), "other");
        let none = Route {
            headers: vec![],
            ..with("")
        };
        assert_eq!(reason_label(&none), "none");
    }

    #[test]
    fn steering_headers_are_recognised() {
        for h in [
            "x-gateway-destination-endpoint",
            "x-gateway-destination-endpoint-subset",
            "X-GATEWAY-DESTINATION-ENDPOINT-anything",
            "x-prefiller-host-port",
            "x-rngd-pd-kv-transport",
        ] {
            assert!(is_steering_header(h), "{h}");
        }
        for h in [
            "x-request-id",
            "x-gateway-model-name",
            ":path",
            "x-prefiller",
        ] {
            assert!(!is_steering_header(h), "{h}");
        }
    }

    /// The gateway's path: client headers, no subset. Nothing the client
    /// sent to steer reaches the policy, and the whole pool is eligible.
    #[tokio::test]
    async fn client_steering_headers_never_reach_the_policy() {
        let policy = Arc::new(Recording::default());
        let p = Picker::new(policy.clone(), pool());
        p.pick(PickRequest {
            headers: client_headers(),
            ..Default::default()
        })
        .await
        .expect("route");
        let seen = policy.0.lock().unwrap();
        let names: Vec<&str> = seen[0].headers.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(names, [":path", "x-request-id"], "{:?}", seen[0].headers);
        assert_eq!(seen[0].endpoints.as_deref().unwrap().len(), 2);
    }

    /// The picker's path: client headers plus the subset hint it read from
    /// Envoy's filter metadata. The policy sees that hint, once, and only
    /// its endpoints; never the client's.
    #[tokio::test]
    async fn only_the_trusted_subset_reaches_the_policy() {
        let policy = Arc::new(Recording::default());
        let p = Picker::new(policy.clone(), pool());
        let r = p
            .pick(PickRequest {
                headers: client_headers(),
                subset: Some(vec!["10.0.0.1:1".into()]),
                ..Default::default()
            })
            .await
            .expect("route");
        assert_eq!(r.decode, "10.0.0.1:1");
        let seen = policy.0.lock().unwrap();
        let subset: Vec<&str> = seen[0]
            .headers
            .iter()
            .filter(|(k, _)| is_steering_header(k))
            .map(|(k, v)| {
                assert_eq!(k, headers::DESTINATION_ENDPOINT_SUBSET);
                v.as_str()
            })
            .collect();
        assert_eq!(subset, ["10.0.0.1:1"]);
        let eps: Vec<&str> = seen[0]
            .endpoints
            .as_deref()
            .unwrap()
            .iter()
            .map(|e| e.address.as_str())
            .collect();
        assert_eq!(eps, ["10.0.0.1:1"]);
    }

    /// The default policy's logic reads the subset header: a client's hint
    /// naming a loaded decode endpoint does not pin it.
    #[tokio::test]
    async fn a_client_subset_header_does_not_pin_an_endpoint() {
        let mut busy = local_endpoint("10.0.0.1:1".into(), Role::Decode, 512, &[]);
        busy.queue_depth = 50;
        let idle = local_endpoint("10.0.0.3:3".into(), Role::Decode, 512, &[]);
        let p = Picker::new(
            Arc::new(NativePolicy::default()),
            StaticEndpoints::new(vec![busy, idle]),
        );
        let body = br#"{"model":"m","prompt":"hi","max_tokens":4}"#.to_vec();
        let mut headers = client_headers();
        headers.push((
            "x-gateway-destination-endpoint-subset".into(),
            "10.0.0.1:1".into(),
        ));
        let r = p
            .pick(PickRequest {
                headers,
                body: body.clone(),
                prompt_tokens: Some(2),
                subset: None,
                prompt_ids: Vec::new(),
                cache_salt: None,
            })
            .await
            .expect("route");
        assert_eq!(r.decode, "10.0.0.3:3", "the client's hint was ignored");
        // The same hint from the trusted source does narrow the choice.
        let r = p
            .pick(PickRequest {
                body,
                prompt_tokens: Some(2),
                subset: Some(vec!["10.0.0.1:1".into()]),
                ..Default::default()
            })
            .await
            .expect("route");
        assert_eq!(r.decode, "10.0.0.1:1");
    }

    #[tokio::test]
    async fn native_policy_routes_over_the_snapshot() {
        let p = Picker::new(Arc::new(NativePolicy::default()), pool());
        let r = p
            .pick(PickRequest {
                body: br#"{"model":"m","prompt":"hi","max_tokens":4}"#.to_vec(),
                prompt_tokens: Some(2),
                ..Default::default()
            })
            .await
            .expect("route");
        assert_eq!(r.decode, "10.0.0.1:1");
    }

    /// A burst routed within one scrape period spreads over idle decode
    /// endpoints: each pick sees the requests held by the picks before it
    /// as running; a hold given back stops counting.
    #[tokio::test]
    async fn held_picks_spread_a_burst_before_any_scrape() {
        let p = Picker::new(
            Arc::new(NativePolicy::default()),
            StaticEndpoints::new(vec![
                local_endpoint("10.0.0.1:1".into(), Role::Decode, 512, &[]),
                local_endpoint("10.0.0.3:3".into(), Role::Decode, 512, &[]),
            ]),
        );
        let req = || PickRequest {
            body: br#"{"model":"m","prompt":"hi","max_tokens":4}"#.to_vec(),
            prompt_tokens: Some(2),
            ..Default::default()
        };
        let mut held = Vec::new();
        for _ in 0..4 {
            held.push(p.pick_held(req()).await.expect("route"));
        }
        let on = |a: &str| held.iter().filter(|p| p.route.decode == a).count();
        assert_eq!((on("10.0.0.1:1"), on("10.0.0.3:3")), (2, 2), "{held:?}");
        assert_eq!(p.in_flight().count("10.0.0.1:1"), 2);
        // Unheld picks (nobody waits for their answer) leave no count.
        let first = p.pick(req()).await.expect("route");
        assert_eq!(p.in_flight().count(&first.decode), 2);
        // The holds on one endpoint given back: the next pick goes there.
        held.retain(|p| p.route.decode != "10.0.0.3:3");
        assert_eq!(p.pick(req()).await.expect("route").decode, "10.0.0.3:3");
        drop(held);
        assert_eq!(p.in_flight().tracked(), 0);
    }

    /// A prefix source answering each address by a function of it and the
    /// prompt's ids.
    struct ByAddress(fn(&str, &[u32]) -> Option<usize>);

    impl crate::prefix::PrefixSource for ByAddress {
        fn cached_all(
            &self,
            addresses: &[&str],
            ids: &[u32],
            _salt: Option<&str>,
        ) -> Vec<Option<usize>> {
            addresses.iter().map(|a| (self.0)(a, ids)).collect()
        }
    }

    /// Where a prefix source says a prompt is cached, the default policy
    /// routes there and says why; without the prompt's ids (or a source)
    /// the pick is on load alone.
    #[tokio::test]
    async fn the_prefix_source_steers_the_pick_to_the_cached_endpoint() {
        let a = local_endpoint("10.0.0.1:1".into(), Role::Decode, 512, &[]);
        let b = local_endpoint("10.0.0.2:2".into(), Role::Decode, 512, &[]);
        let pf = local_endpoint("10.0.0.9:9".into(), Role::Prefill, 512, &[]);
        let p = Picker::new(
            Arc::new(NativePolicy::default()),
            StaticEndpoints::new(vec![a, b, pf]),
        )
        .with_prefix_source(Arc::new(ByAddress(|a, ids| {
            Some(if a == "10.0.0.2:2" { ids.len() - 8 } else { 0 })
        })));
        let body = br#"{"model":"m","prompt":"hi","max_tokens":4}"#.to_vec();
        let req = |ids: Vec<u32>| PickRequest {
            body: body.clone(),
            prompt_tokens: Some(300),
            prompt_ids: ids,
            ..Default::default()
        };
        let r = p.pick(req(vec![1; 300])).await.expect("route");
        assert_eq!(r.decode, "10.0.0.2:2");
        assert_eq!(r.prefill, None, "8 tokens left to prefill: local");
        assert!(
            r.headers
                .iter()
                .any(|(k, v)| k == headers::ROUTE_REASON && v == "cached"),
            "{:?}",
            r.headers
        );
        // Unknown ids: load alone (the lowest address), disaggregated.
        let r = p.pick(req(Vec::new())).await.expect("route");
        assert_eq!(r.decode, "10.0.0.1:1");
        assert_eq!(r.prefill.as_deref(), Some("10.0.0.9:9"));
    }

    /// A pick keeps the index's prediction for the endpoint that prefills
    /// the request (the decode endpoint of a local route, the prefill
    /// endpoint of a disaggregated one); with no information there, none.
    #[tokio::test]
    async fn a_pick_keeps_the_prediction_for_its_prefilling_endpoint() {
        let p = Picker::new(
            Arc::new(NativePolicy::default()),
            StaticEndpoints::new(vec![
                local_endpoint("10.0.0.1:1".into(), Role::Decode, 512, &[]),
                local_endpoint("10.0.0.2:2".into(), Role::Decode, 512, &[]),
                local_endpoint("10.0.0.9:9".into(), Role::Prefill, 512, &[]),
            ]),
        )
        .with_prefix_source(Arc::new(ByAddress(|a, ids| match a {
            "10.0.0.2:2" => Some(ids.len() - 8),
            "10.0.0.9:9" => Some(16),
            _ => None,
        })));
        let req = |ids: Vec<u32>| PickRequest {
            body: br#"{"model":"m","prompt":"hi","max_tokens":4}"#.to_vec(),
            prompt_tokens: Some(ids.len()),
            prompt_ids: ids,
            ..Default::default()
        };
        let local = p.pick_held(req(vec![1; 300])).await.expect("route");
        assert_eq!(local.route.prefill, None);
        let e = local.expected.expect("a prediction");
        assert_eq!((e.endpoint(), e.predicted()), ("10.0.0.2:2", 292));
        let reg = prometheus::Registry::new();
        p.register_metrics(&reg).expect("register");
        e.served(280);
        let text = rngd_telemetry::render(&reg);
        for line in [
            r#"rngd_pd_router_predicted_cached_tokens_total{endpoint="10.0.0.2:2"} 292"#,
            r#"rngd_pd_router_served_cached_tokens_total{endpoint="10.0.0.2:2"} 280"#,
        ] {
            assert!(text.contains(line), "{line} in\n{text}");
        }
        // No ids: no property, no prediction.
        let blind = p.pick_held(req(Vec::new())).await.expect("route");
        assert!(blind.expected.is_none());
    }
}
