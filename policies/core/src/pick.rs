//! The default PD decision: admission, decode and prefill choice by load
//! (with the cache credit, or in turn: `routing` in [`PolicyConfig`]),
//! conditional disaggregation, transport choice, subset hints. Runs the same
//! inside the proxy-wasm guest and natively.

use rngd_api::headers;
use rngd_api::openai::{CONTEXT_LENGTH_CODE, context_length_message};

use crate::{CoreError, Decision, Endpoint, LocalResponse, PolicyConfig, Role, Route, Routing};

/// What the decision reads from one request.
#[derive(Debug, Clone, Copy, Default)]
pub struct RequestInput<'a> {
    /// Request body (JSON), possibly empty; `None` = not available to the
    /// policy (Envoy does not deliver it before the headers go upstream).
    pub body: Option<&'a [u8]>,
    /// `content-length` of the request, used for the prompt estimate when the
    /// body is not available.
    pub content_length: Option<u64>,
    /// Prompt tokens counted by the host, if it passed them.
    pub prompt_tokens: Option<u64>,
    /// The subset hint header (comma-separated `ip:port`), if present.
    pub subset: Option<&'a str>,
    /// `rngd_pd.prefix_cache` as the host passed it (`ADDRESS=TOKENS,…`);
    /// `None` = no cache information: the decision is on load alone.
    pub prefix_cache: Option<&'a [u8]>,
    /// This request's TTFT goal, ms (`x-llm-d-slo-ttft-ms`); `None` = the
    /// configuration's `ttft_goal_ms`.
    pub ttft_goal_ms: Option<f64>,
}

/// The prompt tokens `address` holds in a `rngd_pd.prefix_cache` value;
/// `None` when it is not listed or listed as unknown (`ADDRESS=?`).
pub fn cached_tokens(list: &[u8], address: &str) -> Option<u64> {
    list.split(|&c| c == b',').find_map(|entry| {
        let eq = entry.iter().rposition(|&c| c == b'=')?;
        let (name, value) = (&entry[..eq], &entry[eq + 1..]);
        (crate::same(trim(name), address.as_bytes()))
            .then(|| parse_decimal(value))
            .flatten()
    })
}

/// Whether a `rngd_pd.prefix_cache` value lists any endpoint with a
/// non-zero count (else the decision is the load-only one, whose pick
/// order is precomputed).
fn any_cached(list: &[u8]) -> bool {
    list.split(|&c| c == b',').any(|entry| {
        entry
            .iter()
            .rposition(|&c| c == b'=')
            .and_then(|eq| parse_decimal(&entry[eq + 1..]))
            .is_some_and(|n| n > 0)
    })
}

fn trim(b: &[u8]) -> &[u8] {
    let start = b
        .iter()
        .position(|c| !c.is_ascii_whitespace())
        .unwrap_or(b.len());
    let end = b
        .iter()
        .rposition(|c| !c.is_ascii_whitespace())
        .map_or(start, |i| i + 1);
    &b[start..end]
}

/// Estimated prompt tokens of a body when the host counted none:
/// ⌈bytes of the raw `prompt` / `messages` JSON / `bytes_per_token`⌉;
/// `None` when `bytes_per_token` is 0 (estimation off).
pub fn estimate_prompt_tokens(prompt_json_bytes: usize, bytes_per_token: u64) -> Option<u64> {
    if bytes_per_token == 0 {
        return None;
    }
    Some((prompt_json_bytes as u64).div_ceil(bytes_per_token))
}

/// Whether `address` passes the subset hint (no hint: every address does).
#[inline(always)]
fn in_subset(subset: Option<&str>, address: &str) -> bool {
    subset.is_none_or(|s| listed(s, address))
}

/// Whether `address` is one of the comma-separated `list`.
fn listed(list: &str, address: &str) -> bool {
    list.split(',').any(|a| a.trim() == address)
}

fn supports(e: &Endpoint, transport: &str) -> bool {
    e.transports.is_empty()
        || e.transports
            .iter()
            .any(|t| crate::same(t.as_bytes(), transport.as_bytes()))
}

/// Keeps the better of `best` and `e`: lowest score first, ties broken by
/// address so a decision is deterministic.
fn better<'e>(
    best: Option<(&'e Endpoint, f64)>,
    e: &'e Endpoint,
    s: f64,
) -> Option<(&'e Endpoint, f64)> {
    match best {
        Some((b, bs)) if bs < s || (bs == s && b.address <= e.address) => Some((b, bs)),
        _ => Some((e, s)),
    }
}

/// A decision that borrows its addresses from the snapshot and its transport
/// from the configuration, so a route costs no allocation. The guest writes
/// it straight into request headers; [`Outcome::into_decision`] makes the
/// owned [`Decision`] a host returns.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome<'a> {
    /// Send the request on.
    Route(RouteRef<'a>),
    /// Answer locally (reject).
    Reject(LocalResponse),
}

/// A route borrowing from the snapshot and configuration (see [`Outcome`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RouteRef<'a> {
    /// Decode (or only) endpoint `ip:port`.
    pub decode: &'a str,
    /// Remote prefill endpoint `ip:port` and the KV transport to it; `None` =
    /// prefill on the decode endpoint.
    pub prefill: Option<(&'a str, &'a str)>,
    /// Why (`x-rngd-pd-route-reason`; the values are listed in
    /// `docs/policy-abi.md`).
    pub reason: &'static str,
}

impl<'a> RouteRef<'a> {
    /// The request headers this route sets, in order: decode, then (when the
    /// prefill is remote) prefill and transport, then the reason.
    pub fn headers(&self) -> impl Iterator<Item = (&'static str, &'a str)> + use<'a> {
        let decode = [(headers::DESTINATION_ENDPOINT, self.decode)];
        let prefill = self.prefill.map(|(p, t)| {
            [
                (headers::PREFILLER_HOST_PORT, p),
                (headers::KV_TRANSPORT, t),
            ]
        });
        let reason: &'a str = self.reason;
        decode
            .into_iter()
            .chain(prefill.into_iter().flatten())
            .chain([(headers::ROUTE_REASON, reason)])
    }

    /// The owned [`Route`].
    pub fn to_route(&self) -> Route {
        Route {
            decode: self.decode.to_string(),
            prefill: self.prefill.map(|(p, _)| p.to_string()),
            kv_transport: self.prefill.map(|(_, t)| t.to_string()),
            headers: self
                .headers()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        }
    }
}

impl Outcome<'_> {
    /// The owned [`Decision`].
    pub fn into_decision(self) -> Decision {
        match self {
            Outcome::Route(r) => Decision::Route(r.to_route()),
            Outcome::Reject(l) => Decision::Reject(l),
        }
    }
}

/// Decides one request against an endpoint set (the default policy).
pub fn decide(config: &PolicyConfig, endpoints: &[Endpoint], input: &RequestInput<'_>) -> Decision {
    choose(config, endpoints, input).into_decision()
}

/// [`decide`] without allocating for a route: the result borrows from
/// `config` and `endpoints`. Stateless: with `routing: "round_robin"` it
/// takes the first eligible endpoint each time ([`PdPolicy`] keeps the turn).
pub fn choose<'a>(
    config: &'a PolicyConfig,
    endpoints: &'a [Endpoint],
    input: &RequestInput<'_>,
) -> Outcome<'a> {
    match parse(config, input) {
        Ok(req) => pick(config, endpoints, None, input, req, &mut Turns::default()),
        Err(reject) => reject,
    }
}

/// Whose turn it is with `routing: "round_robin"`: how many decisions took a
/// decode endpoint, and how many a remote prefill, through one policy object.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Turns {
    decode: u64,
    prefill: u64,
}

/// The `turn`-th (modulo their number) of the endpoints `keep` accepts, in
/// snapshot order; `None` when it accepts none.
fn in_turn(
    endpoints: &[Endpoint],
    turn: u64,
    keep: impl Fn(&Endpoint) -> bool,
) -> Option<&Endpoint> {
    let n = endpoints.iter().filter(|e| keep(e)).count() as u64;
    if n == 0 {
        return None;
    }
    endpoints
        .iter()
        .filter(|e| keep(e))
        .nth((turn % n) as usize)
}

/// What the decision needs from the request besides the endpoints.
#[derive(Debug, Clone, Copy)]
struct Parsed {
    max_tokens: u64,
    /// Prompt tokens, counted by the host or estimated; `None` = unknown.
    prompt: Option<u64>,
}

/// Reads `max_tokens` and the prompt size from the request; an invalid body
/// is the 400 rejection. `max_completion_tokens` wins over `max_tokens`; a
/// chat with neither counts one token (it fills the rest of the context).
fn parse(config: &PolicyConfig, input: &RequestInput<'_>) -> Result<Parsed, Outcome<'static>> {
    let (max_tokens, prompt_bytes) = match input.body {
        None => (
            config.default_max_tokens,
            input.content_length.unwrap_or(0) as usize,
        ),
        Some(body) if body.iter().all(u8::is_ascii_whitespace) => (config.default_max_tokens, 0),
        Some(body) => match crate::body::scan(body) {
            // `max_completion_tokens` over `max_tokens` (OpenAI's and vLLM's
            // precedence, as every door applies it); a chat naming neither may
            // fill the context, so only its first token must fit.
            Ok(b) => (
                b.max_completion_tokens
                    .or(b.max_tokens)
                    .unwrap_or(if b.chat { 1 } else { config.default_max_tokens }),
                b.prompt_bytes,
            ),
            Err(e) => {
                return Err(Outcome::Reject(LocalResponse::error(
                    400,
                    format!("request body is not a valid completion request: {e}"),
                    None,
                )));
            }
        },
    };
    let prompt = input
        .prompt_tokens
        .or_else(|| estimate_prompt_tokens(prompt_bytes, config.estimate_bytes_per_token));
    Ok(Parsed { max_tokens, prompt })
}

impl Parsed {
    /// Whether prompt + `max_tokens` exceed the endpoint's context length.
    fn too_long(&self, e: &Endpoint) -> bool {
        self.prompt
            .is_some_and(|p| p + self.max_tokens > u64::from(e.seq_len))
    }

    /// Whether the endpoint is at the configured queue limit.
    fn queue_full(&self, config: &PolicyConfig, e: &Endpoint) -> bool {
        config.max_queue_depth.is_some_and(|q| e.queue_depth >= q)
    }
}

/// The healthy decode-capable and prefill endpoints of a snapshot, each list
/// in pick order (score, then address, then position: the order [`better`]
/// prefers), so a decision walks to the first one that qualifies instead of
/// scoring the whole snapshot. Computed once per snapshot and weights.
#[derive(Debug, Clone, Default)]
struct Ranking {
    /// The score weights it was computed with (bit patterns).
    weights: [u64; 3],
    decode: Vec<u32>,
    prefill: Vec<u32>,
}

impl Ranking {
    fn weights(config: &PolicyConfig) -> [u64; 3] {
        [
            config.queue_weight.to_bits(),
            config.running_weight.to_bits(),
            config.kv_usage_weight.to_bits(),
        ]
    }

    /// `None` when a score is NaN (extreme weights): the scan decides then,
    /// since NaN has no place in an order.
    fn new(config: &PolicyConfig, endpoints: &[Endpoint]) -> Option<Ranking> {
        let scores: Vec<f64> = endpoints.iter().map(|e| config.score(e)).collect();
        if scores.iter().any(|s| s.is_nan()) || u32::try_from(endpoints.len()).is_err() {
            return None;
        }
        let ranked = |keep: &dyn Fn(&Endpoint) -> bool| {
            let before = |a: u32, b: u32| {
                let (a, b) = (a as usize, b as usize);
                scores[a]
                    .partial_cmp(&scores[b])
                    .unwrap_or(std::cmp::Ordering::Equal)
                    .then_with(|| endpoints[a].address.cmp(&endpoints[b].address))
                    .is_lt()
            };
            // Binary insertion after every equal one, so fully equal endpoints
            // stay in snapshot order as in `better` (a library sort would add
            // kilobytes to the module for a list sorted once per snapshot).
            let mut ids: Vec<u32> = Vec::new();
            for i in 0..endpoints.len() as u32 {
                if keep(&endpoints[i as usize]) {
                    let at = ids.partition_point(|&j| !before(i, j));
                    ids.insert(at, i);
                }
            }
            ids
        };
        Some(Ranking {
            weights: Ranking::weights(config),
            decode: ranked(&|e| e.healthy && matches!(e.role, Role::Decode | Role::Solo)),
            prefill: ranked(&|e| e.healthy && e.role == Role::Prefill),
        })
    }
}

/// The decision for a parsed request. With a `ranking` of `endpoints` the
/// first qualifying endpoint in pick order is taken; without one, or to
/// explain a rejection, every endpoint is scanned. Both give the same answer.
/// With cache information (`input.prefix_cache` naming a cached prefix,
/// `routing: "cache"`) the scores carry the cache credit, so the snapshot is
/// scanned; `routing: "load"` ignores that information, and
/// `routing: "round_robin"` takes the endpoints in `turns` (and ignores it).
fn pick<'a>(
    config: &'a PolicyConfig,
    endpoints: &'a [Endpoint],
    ranking: Option<&Ranking>,
    input: &RequestInput<'_>,
    req: Parsed,
    turns: &mut Turns,
) -> Outcome<'a> {
    let prompt = req.prompt;
    let round_robin = config.routing == Routing::RoundRobin;
    let cache = input.prefix_cache.filter(|c| {
        config.routing == Routing::Cache && config.prefix_weight != 0.0 && any_cached(c)
    });
    let ranking = if cache.is_some() || round_robin {
        None
    } else {
        ranking
    };
    let cached = |e: &Endpoint| {
        cache
            .and_then(|c| cached_tokens(c, &e.address))
            .map_or(0, |n| prompt.map_or(n, |p| n.min(p)))
    };
    let ranked = ranking.map(|r| {
        r.decode.iter().map(|&i| &endpoints[i as usize]).find(|e| {
            in_subset(input.subset, &e.address) && !req.too_long(e) && !req.queue_full(config, e)
        })
    });
    let decode = match ranked {
        Some(Some(e)) => e,
        _ => match scan_decode(config, endpoints, input, req, &cached) {
            Ok(e) if round_robin => {
                let e = in_turn(endpoints, turns.decode, |e| {
                    decode_capable(input, e) && !req.too_long(e) && !req.queue_full(config, e)
                })
                .unwrap_or(e);
                turns.decode = turns.decode.wrapping_add(1);
                e
            }
            Ok(e) => e,
            Err(reject) => return Outcome::Reject(reject),
        },
    };

    let mut route = RouteRef {
        decode: &decode.address,
        prefill: None,
        reason: "solo",
    };
    if decode.role != Role::Decode {
        return Outcome::Route(route);
    }
    // Tokens the decode endpoint would prefill itself (what its cache lacks).
    let uncached = prompt.map(|p| p - cached(decode));
    if let Some(u) = uncached
        && u < config.disaggregation_threshold_tokens
    {
        route.reason = if cached(decode) > 0 {
            "cached"
        } else {
            "short_prompt"
        };
        return Outcome::Route(route);
    }
    let fits = |e: &Endpoint| {
        e.role == Role::Prefill
            && e.healthy
            && in_subset(input.subset, &e.address)
            && prompt.is_none_or(|p| p <= u64::from(e.seq_len))
            && config.max_queue_depth.is_none_or(|q| e.queue_depth < q)
    };
    // KV made by other weights is refused by the decode worker (409): such a
    // pair is never made.
    let eligible = |e: &Endpoint| fits(e) && same_weights(e, decode);
    let prefill = match ranking {
        None if round_robin => in_turn(endpoints, turns.prefill, eligible),
        Some(r) => r
            .prefill
            .iter()
            .map(|&i| &endpoints[i as usize])
            .find(|e| eligible(e)),
        None => endpoints
            .iter()
            .filter(|e| eligible(e))
            .fold(None, |b, e| better(b, e, config.score_cached(e, cached(e))))
            .map(|(e, _)| e),
    };
    let Some(prefill) = prefill else {
        route.reason = if endpoints.iter().any(fits) {
            "no_prefill_same_weights"
        } else {
            "no_prefill_endpoint"
        };
        return Outcome::Route(route);
    };
    if let (Some(p), Some(u)) = (prompt, uncached) {
        // The TTFT each way: prefilled here, or on the prefill endpoint
        // (what its own cache lacks).
        let local = config.predicted_ttft_ms(decode, u);
        let remote = config.predicted_ttft_ms(prefill, p - cached(prefill));
        if input
            .ttft_goal_ms
            .or(config.ttft_goal_ms)
            .is_some_and(|goal| local <= goal)
        {
            route.reason = "ttft_goal_met_locally";
            return Outcome::Route(route);
        }
        // What a local prefill costs the streams running there.
        let harm = u as f64
            * config.prefill_ms_per_token
            * f64::from(decode.running)
            * config.decode_interference;
        if remote > local + harm {
            route.reason = "faster_locally";
            return Outcome::Route(route);
        }
    }
    let same_node =
        !prefill.node.is_empty() && crate::same(prefill.node.as_bytes(), decode.node.as_bytes());
    let same = same_node.then_some(config.same_node_transport.as_str());
    let cross = Some(config.cross_node_transport.as_str());
    match [same, cross]
        .into_iter()
        .flatten()
        .find(|t| supports(prefill, t) && supports(decode, t))
    {
        Some(t) => {
            route.prefill = Some((&prefill.address, t));
            if round_robin {
                turns.prefill = turns.prefill.wrapping_add(1);
            }
            route.reason = if prompt.is_some() {
                "disaggregated"
            } else {
                "unknown_prompt"
            };
        }
        None => route.reason = "no_common_transport",
    }
    Outcome::Route(route)
}

/// Whether KV that `prefill` computes can continue on `decode`: the same
/// `weight_version`, or one of them unknown (an endpoint nobody scraped yet,
/// or a model server that does not say; the decode worker still checks the
/// signed version and refuses a mismatch).
fn same_weights(prefill: &Endpoint, decode: &Endpoint) -> bool {
    match (&prefill.weight_version, &decode.weight_version) {
        (Some(p), Some(d)) => crate::same(p.as_bytes(), d.as_bytes()),
        _ => true,
    }
}

/// A healthy decode or solo endpoint the subset hint allows.
fn decode_capable(input: &RequestInput<'_>, e: &Endpoint) -> bool {
    matches!(e.role, Role::Decode | Role::Solo) && e.healthy && in_subset(input.subset, &e.address)
}

/// One pass over the snapshot, no allocation: is there a decode endpoint at
/// all, which fit the request, and the best of those under the queue limit;
/// the rejection when there is none.
fn scan_decode<'a>(
    config: &PolicyConfig,
    endpoints: &'a [Endpoint],
    input: &RequestInput<'_>,
    req: Parsed,
    cached: &dyn Fn(&Endpoint) -> u64,
) -> Result<&'a Endpoint, LocalResponse> {
    let mut decoders = 0usize;
    let mut max_seq_len = 0u32;
    let mut fitting = 0usize;
    let mut best_decode: Option<(&Endpoint, f64)> = None;
    for e in endpoints {
        if !decode_capable(input, e) {
            continue;
        }
        decoders += 1;
        max_seq_len = max_seq_len.max(e.seq_len);
        if req.too_long(e) {
            continue;
        }
        fitting += 1;
        if req.queue_full(config, e) {
            continue;
        }
        best_decode = better(best_decode, e, config.score_cached(e, cached(e)));
    }
    if decoders == 0 {
        let why = if input.subset.is_some() {
            " in the requested subset"
        } else {
            ""
        };
        return Err(LocalResponse::error(
            503,
            format!("no healthy decode endpoint{why} is available"),
            None,
        ));
    }
    if fitting == 0 {
        // The same `param` as every other door's context-length refusal.
        return Err(LocalResponse::error_on(
            400,
            context_length_message(
                req.prompt.unwrap_or(0) as usize,
                req.max_tokens as usize,
                max_seq_len as usize,
            ),
            Some(CONTEXT_LENGTH_CODE),
            Some("max_tokens"),
        ));
    }
    match best_decode {
        Some((e, _)) => Ok(e),
        None => Err(LocalResponse::error(
            429,
            format!(
                "all {fitting} eligible decode endpoints are at the queue limit ({})",
                config.max_queue_depth.unwrap_or(0)
            ),
            None,
        )),
    }
}

/// The endpoint snapshot a policy instance parsed last, keyed by the host's
/// `rngd_pd.endpoints_version`.
#[derive(Debug, Default)]
pub struct SnapshotCache {
    version: Vec<u8>,
    endpoints: Vec<Endpoint>,
    valid: bool,
    /// Pick order of `endpoints`, made on first use after each fetch.
    ranking: Option<Ranking>,
}

impl SnapshotCache {
    /// The endpoints for this request: the cached ones when `version` matches,
    /// otherwise `fetch()` parsed (and cached when a version is given).
    /// `Ok(None)` = the host passed no snapshot.
    pub fn get(
        &mut self,
        version: Option<&[u8]>,
        fetch: impl FnOnce() -> Option<Vec<u8>>,
    ) -> Result<Option<&[Endpoint]>, CoreError> {
        if let Some(v) = version
            && self.valid
            && crate::same(&self.version, v)
        {
            return Ok(Some(&self.endpoints));
        }
        let Some(json) = fetch() else {
            return Ok(None);
        };
        self.ranking = None;
        self.endpoints =
            crate::json::endpoints(&json).map_err(|source| CoreError::Snapshot { source })?;
        match version {
            Some(v) => {
                self.version.clear();
                self.version.extend_from_slice(v);
                self.valid = true;
            }
            None => self.valid = false,
        }
        Ok(Some(&self.endpoints))
    }

    /// The cached endpoints with their pick order for `config`'s weights
    /// (made now if missing or made for other weights); `None` when no order
    /// exists (see [`Ranking::new`]).
    fn ranked(&mut self, config: &PolicyConfig) -> (&[Endpoint], Option<&Ranking>) {
        let fresh = self
            .ranking
            .as_ref()
            .is_some_and(|r| r.weights == Ranking::weights(config));
        if !fresh {
            self.ranking = Ranking::new(config, &self.endpoints);
        }
        (&self.endpoints, self.ranking.as_ref())
    }
}

/// The default policy with its configuration and snapshot cache: what the
/// guest keeps in its root context, and the native baseline.
#[derive(Debug, Default)]
pub struct PdPolicy {
    /// The configuration.
    pub config: PolicyConfig,
    cache: SnapshotCache,
    /// The round-robin turn (`routing: "round_robin"`), this object's own.
    turns: Turns,
}

impl PdPolicy {
    /// A policy with this configuration.
    pub fn new(config: PolicyConfig) -> Self {
        PdPolicy {
            config,
            cache: SnapshotCache::default(),
            turns: Turns::default(),
        }
    }

    /// Decides one request from what the host passed ([`RequestProps`]):
    /// `version` is the snapshot version property, `fetch_endpoints` reads
    /// the snapshot property (called only when the version changed or is
    /// absent). No snapshot → the configured static pool.
    pub fn decide(
        &mut self,
        props: &RequestProps<'_>,
        version: Option<&[u8]>,
        fetch_endpoints: impl FnOnce() -> Option<Vec<u8>>,
    ) -> Decision {
        self.outcome(props, version, fetch_endpoints)
            .into_decision()
    }

    /// [`PdPolicy::decide`] without allocating for a route (see [`Outcome`]).
    pub fn outcome(
        &mut self,
        props: &RequestProps<'_>,
        version: Option<&[u8]>,
        fetch_endpoints: impl FnOnce() -> Option<Vec<u8>>,
    ) -> Outcome<'_> {
        let prompt_tokens = match props.prompt_tokens.map(parse_decimal) {
            None => None,
            Some(Some(n)) => Some(n),
            Some(None) => {
                return Outcome::Reject(LocalResponse::error(
                    500,
                    format!(
                        "property {} is not a decimal number",
                        crate::PROP_PROMPT_TOKENS
                    ),
                    None,
                ));
            }
        };
        let ttft_goal_ms = match props.ttft_goal_ms.map(|v| parse_decimal(v.as_bytes())) {
            None => None,
            Some(Some(ms)) => Some(ms as f64),
            Some(None) => {
                return Outcome::Reject(LocalResponse::error(
                    400,
                    format!(
                        "header {} must be a whole number of milliseconds",
                        headers::SLO_TTFT_MS
                    ),
                    None,
                ));
            }
        };
        let input = RequestInput {
            body: props.body,
            content_length: props.content_length,
            prompt_tokens,
            subset: props.subset,
            prefix_cache: props.prefix_cache,
            ttft_goal_ms,
        };
        let snapshot = match self.cache.get(version, fetch_endpoints) {
            Ok(eps) => eps.is_some(),
            Err(e) => return Outcome::Reject(LocalResponse::error(500, e.to_string(), None)),
        };
        let req = match parse(&self.config, &input) {
            Ok(req) => req,
            Err(reject) => return reject,
        };
        if snapshot {
            let (eps, ranking) = self.cache.ranked(&self.config);
            pick(&self.config, eps, ranking, &input, req, &mut self.turns)
        } else {
            pick(
                &self.config,
                &self.config.static_endpoints,
                None,
                &input,
                req,
                &mut self.turns,
            )
        }
    }
}

/// What a host hands the default policy for one request, as a guest reads
/// it: header values and raw property bytes, parsed by the policy.
#[derive(Debug, Clone, Copy, Default)]
pub struct RequestProps<'a> {
    /// The subset hint header (comma-separated `ip:port`).
    pub subset: Option<&'a str>,
    /// Request body; `None` = decide without it (estimate from
    /// `content_length`).
    pub body: Option<&'a [u8]>,
    /// `content-length`, for the estimate without the body.
    pub content_length: Option<u64>,
    /// `rngd_pd.prompt_tokens` (decimal text).
    pub prompt_tokens: Option<&'a [u8]>,
    /// `rngd_pd.prefix_cache` (`ADDRESS=TOKENS,…`).
    pub prefix_cache: Option<&'a [u8]>,
    /// `x-llm-d-slo-ttft-ms` (whole milliseconds).
    pub ttft_goal_ms: Option<&'a str>,
}

/// A decimal property value: digits with an optional `+`, surrounding
/// whitespace allowed (as `str::parse::<u64>` after `trim`, without its
/// 128-bit overflow check, a library call on wasm32).
fn parse_decimal(b: &[u8]) -> Option<u64> {
    // Digits and `+` are valid UTF-8 with nothing to trim: the usual value
    // skips the UTF-8 check and the Unicode-aware trim (two calls in wasm).
    let plain = b.iter().all(|&c| c.is_ascii_digit() || c == b'+');
    let s = if plain {
        b
    } else {
        std::str::from_utf8(b).ok()?.trim().as_bytes()
    };
    let digits = s.strip_prefix(b"+").unwrap_or(s);
    if digits.is_empty() {
        return None;
    }
    digits.iter().try_fold(0u64, |n, &c| {
        c.is_ascii_digit()
            .then(|| crate::push_digit(n, c - b'0'))
            .flatten()
    })
}

#[cfg(test)]
mod tests;
