//! The ext_proc side of a pick: the body goes through the same rules and
//! prompt counting as at the gateway ([`rngd_pool::prepare`]), the route
//! through the same [`rngd_pool::Picker::pick`]; this module only maps the
//! outcome to what the state machine sends Envoy (GIE's status codes).
//!
//! | condition                                          | status |
//! |----------------------------------------------------|--------|
//! | body breaks a request rule (not JSON, no `model`, bad sampling field, …) | 400 (with `param`) |
//! | body names a model the workers do not serve       | 404 `model_not_found` |
//! | the tokenizer fails on the prompt                  | 400    |
//! | subset hint empty or matching no endpoint          | 503    |
//! | policy reject (`LocalResponse`)                    | the policy's status and body (429/503/400 …) |
//! | policy failure                                     | its status (500 guest fault, 503 unavailable) |
//! | policy routes outside the endpoint table           | 500    |
//!
//! It also owns the picker's admission ([`rngd_pool::admission`], the
//! gateway's implementation): a slot per request from its headers to its
//! pick, a bounded waiting room, and the budget of body bytes in flight; a
//! refusal is a 429 with `Retry-After` ([`overloaded_response`]).

use std::sync::Arc;
use std::time::Instant;

use rngd_api::headers;
use rngd_api::models::{ModelNotFound, ServedModels};
use rngd_api::openai::ErrorBody;
use rngd_api::rules::RuleError;
use rngd_policy_core::{Decision, LocalResponse, Route};
use rngd_pool::admission::{Admission, AdmissionOptions, Overloaded};
use rngd_pool::{ApiKind, PickError, PickRequest, PrepareError, PromptCounter};

use crate::metrics::{DEFAULT_POOL_NAME, EppMetrics};

/// Everything known about a request when the pick runs.
#[derive(Debug, Clone, Default)]
pub struct PickInput {
    /// Request headers including pseudo-headers.
    pub headers: Vec<(String, String)>,
    /// The complete body, or `None` for a request without one.
    pub body: Option<Vec<u8>>,
    /// Subset hint (`ip:port` list) from Envoy's filter metadata only (a
    /// client header never sets it); `None` = no hint.
    pub subset: Option<Vec<String>>,
}

/// The picker's bounds shared by all streams (the per-stream ones are
/// [`crate::processor::ProcessorConfig`]'s).
#[derive(Debug, Clone, Default)]
pub struct PickerLimits {
    /// Slots, waiting room and body-byte budget of the request phase
    /// (headers to the pick); the gateway's defaults.
    pub admission: AdmissionOptions,
    /// The model names the workers serve besides the tokenizer's model name
    /// (their extra `--served-model-name` values, else the model file's
    /// stem). A request naming any other model is a 404 `model_not_found`;
    /// each name labels metric series of its own, any other model is
    /// counted as `other`. With no tokenizer and no names the picker cannot
    /// know what is served and lets every model through (it warns once).
    pub served_models: Vec<String>,
}

/// The pool's picker, the prompt counter, the picker's metrics and admission.
pub struct Picker {
    pool: rngd_pool::Picker,
    counter: Option<Arc<dyn PromptCounter>>,
    served: Option<Arc<ServedModels>>,
    metrics: EppMetrics,
    admission: Admission,
}

impl std::fmt::Debug for Picker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Picker")
            .field("tokenizer", &self.counter.is_some())
            .finish_non_exhaustive()
    }
}

/// An OpenAI-style JSON error as a local response.
pub fn error_response(
    status: u16,
    kind: &str,
    code: &str,
    message: impl Into<String>,
) -> LocalResponse {
    let body = ErrorBody::new(kind, message).with_code(code);
    json_response(status, &body)
}

/// The 429 of a request refused for load (slots, queue or body budget), with
/// `Retry-After`.
pub fn overloaded_response(o: &Overloaded) -> LocalResponse {
    let mut local = error_response(
        429,
        ErrorBody::kind_for_status(429),
        "server_overloaded",
        format!(
            "the server is at capacity ({}); retry after {} s",
            o.reason.as_str(),
            o.retry_after_s
        ),
    );
    local
        .headers
        .push(("retry-after".to_string(), o.retry_after_s.to_string()));
    local
}

/// The 413 of a body larger than `limit` bytes (declared or received).
pub fn too_large_response(limit: usize) -> LocalResponse {
    error_response(
        413,
        ErrorBody::kind_for_status(413),
        "request_too_large",
        format!("request body exceeds the limit of {limit} bytes"),
    )
}

fn json_response(status: u16, body: &ErrorBody) -> LocalResponse {
    LocalResponse {
        status,
        body: serde_json::to_vec(body).unwrap_or_default(),
        headers: vec![("content-type".to_string(), "application/json".to_string())],
    }
}

/// The one place a failed pick becomes what Envoy answers the client.
fn reject(e: PrepareOrPick) -> LocalResponse {
    match e {
        PrepareOrPick::NotJson(got) => error_response(
            415,
            ErrorBody::kind_for_status(415),
            "unsupported_media_type",
            format!("the request body must be JSON (Content-Type: application/json), not {got}"),
        ),
        PrepareOrPick::Rule(r) => rule_response(&r),
        PrepareOrPick::ModelNotFound(m) => {
            json_response(ModelNotFound::STATUS, &ErrorBody::from(&m))
        }
        PrepareOrPick::Tokenize(e) => error_response(
            400,
            "invalid_request_error",
            "tokenize_failed",
            e.to_string(),
        ),
        PrepareOrPick::Task(e) => {
            // The cause stays in the log: a panic's text is not the client's.
            tracing::error!(error = %e, "preparing the request failed");
            error_response(
                500,
                "server_error",
                "internal_error",
                "internal error".to_string(),
            )
        }
        PrepareOrPick::Pick(PickError::Rejected(local)) => local,
        PrepareOrPick::Pick(e @ PickError::NoEndpointInSubset) => error_response(
            503,
            "service_unavailable",
            "no_endpoint_in_subset",
            e.to_string(),
        ),
        PrepareOrPick::Pick(e @ PickError::Policy(_)) => {
            tracing::error!(error = %e, "policy failed");
            error_response(e.status(), "server_error", "policy_error", e.to_string())
        }
        PrepareOrPick::Pick(e @ PickError::OffTable { .. }) => {
            tracing::error!(error = %e, "policy routed off the endpoint table");
            error_response(500, "server_error", "policy_error", e.to_string())
        }
    }
}

/// A broken request rule as a 400 with its `param` and code.
pub fn rule_response(r: &RuleError) -> LocalResponse {
    json_response(400, &ErrorBody::from(r))
}

enum PrepareOrPick {
    /// A body whose `Content-Type` is not JSON (the media type as sent).
    NotJson(String),
    Rule(RuleError),
    ModelNotFound(ModelNotFound),
    Tokenize(rngd_pool::BoxError),
    Task(PrepareError),
    Pick(PickError),
}

impl From<PrepareError> for PrepareOrPick {
    fn from(e: PrepareError) -> Self {
        match e {
            PrepareError::Rule(r) => PrepareOrPick::Rule(r),
            PrepareError::ModelNotFound(m) => PrepareOrPick::ModelNotFound(m),
            PrepareError::Tokenize(t) => PrepareOrPick::Tokenize(t),
            e @ PrepareError::Task { .. } => PrepareOrPick::Task(e),
        }
    }
}

fn path_of(headers: &[(String, String)]) -> Option<&str> {
    headers
        .iter()
        .find(|(k, _)| k == ":path")
        .map(|(_, v)| v.as_str())
}

impl Picker {
    /// A picker over these parts with the default limits; `counter = None`
    /// leaves `rngd_pd.prompt_tokens` unset (the request rules still apply).
    pub fn new(
        pool: rngd_pool::Picker,
        counter: Option<Arc<dyn PromptCounter>>,
        metrics: EppMetrics,
    ) -> Self {
        Self::with_limits(pool, counter, metrics, PickerLimits::default())
    }

    /// A picker over these parts with `limits`.
    pub fn with_limits(
        pool: rngd_pool::Picker,
        counter: Option<Arc<dyn PromptCounter>>,
        metrics: EppMetrics,
        limits: PickerLimits,
    ) -> Self {
        metrics.watch_pool(DEFAULT_POOL_NAME, Arc::clone(pool.endpoints()));
        let mut names = limits.served_models.into_iter();
        let primary = match &counter {
            Some(c) => Some(c.model_name().to_string()),
            None => names.next(),
        };
        let served = match primary {
            Some(p) => Some(Arc::new(ServedModels::new(p, names))),
            None => {
                tracing::warn!(
                    "no tokenizer and no --served-model-name: the picker cannot check the model a request names"
                );
                None
            }
        };
        if let Some(s) = &served {
            metrics.set_models(s.names().iter().map(String::as_str));
        }
        let admission = Admission::with_metrics(limits.admission, metrics.admission.clone());
        Picker {
            pool,
            counter,
            served,
            metrics,
            admission,
        }
    }

    /// Counts a request refused before its pick (over-size body, load) in
    /// `rngd_pd_epp_picks_total`; its model is not known yet, so no
    /// per-model family is touched.
    pub fn count_refusal(&self, local: &LocalResponse) {
        let result = format!("reject_{}", local.status);
        self.metrics.picks.with_label_values(&[&result]).inc();
    }

    /// The admission every stream goes through before its body is buffered.
    pub fn admission(&self) -> &Admission {
        &self.admission
    }

    /// Names the pool in the `inference_pool_*` gauges (the InferencePool's name).
    pub fn set_pool_name(&self, name: &str) {
        self.metrics
            .watch_pool(name, Arc::clone(self.pool.endpoints()));
    }

    /// The pool's pick (its endpoints, policy and the requests it holds
    /// in flight).
    pub fn pool(&self) -> &rngd_pool::Picker {
        &self.pool
    }

    /// The metrics this picker records into.
    pub fn metrics(&self) -> &EppMetrics {
        &self.metrics
    }

    /// Picks for one request; never fails (failures become local responses).
    pub async fn pick(&self, input: PickInput) -> Decision {
        self.pick_for(input).await.0
    }

    /// [`Picker::pick`], also returning the request's model name (`None`
    /// when the body names none) for the per-model metrics of the answer.
    pub async fn pick_for(&self, input: PickInput) -> (Decision, Option<String>) {
        let (decision, model, _) = self.pick_held_for(input).await;
        (decision, model)
    }

    /// [`Picker::pick_for`], also returning the route's count on its decode
    /// endpoint (`rngd_pool::inflight`) and the index's cache prediction
    /// for it (`rngd_pool::predicted`): the caller keeps both until the
    /// response has passed, so the picks after this one see the request and
    /// the prediction meets the answer's `cached_tokens`.
    pub async fn pick_held_for(
        &self,
        input: PickInput,
    ) -> (
        Decision,
        Option<String>,
        Option<(rngd_pool::Held, Option<rngd_pool::Expected>)>,
    ) {
        let start = Instant::now();
        let request_bytes = input.body.as_ref().map_or(0, Vec::len);
        let mut seen = Seen::default();
        let (decision, held) = match self.pick_inner(input, &mut seen).await {
            Ok(p) => (Decision::Route(p.route), Some((p.held, p.expected))),
            Err(e) => (Decision::Reject(reject(e)), None),
        };
        let model = seen.model.clone().unwrap_or_default();
        match &decision {
            Decision::Route(_) => self
                .metrics
                .routed(&model, request_bytes, seen.prompt_tokens),
            Decision::Reject(r) => self.metrics.refused(&model, r.status),
        }
        let took = start.elapsed().as_secs_f64();
        self.metrics.pick_seconds.observe(took);
        self.metrics.scheduler_e2e.observe(took);
        let result = match &decision {
            Decision::Route(_) => "route".to_string(),
            Decision::Reject(r) => format!("reject_{}", r.status),
        };
        self.metrics.picks.with_label_values(&[&result]).inc();
        (decision, seen.model, held)
    }

    async fn pick_inner(
        &self,
        input: PickInput,
        seen: &mut Seen,
    ) -> Result<rngd_pool::Picked, PrepareOrPick> {
        let mut prompt_tokens = None;
        let mut prompt_ids = Vec::new();
        let mut cache_salt = None;
        if let Some(body) = &input.body {
            // A body is JSON by its content type, or has none (as at the
            // gateway and the workers).
            if let Some((_, ct)) = input.headers.iter().find(|(k, _)| k == "content-type")
                && !rngd_api::rules::json_content_type(ct)
            {
                return Err(PrepareOrPick::NotJson(ct.chars().take(64).collect()));
            }
            // The OpenAI APIs get the gateway's rules; any other path with a
            // body only needs to be a JSON object naming a model (GIE).
            let kind = path_of(&input.headers).and_then(ApiKind::from_path);
            match (kind, &self.counter) {
                (Some(kind), Some(counter)) => {
                    // A long prompt is tokenized off the async threads.
                    let prepared = rngd_pool::prepare_async(
                        kind,
                        body.clone(),
                        Arc::clone(counter),
                        None,
                        self.served.clone(),
                    )
                    .await;
                    let prepared = match prepared {
                        Ok(p) => p,
                        Err(e) => {
                            seen.model = model_of(body);
                            return Err(e.into());
                        }
                    };
                    seen.model = Some(prepared.client_model);
                    prompt_tokens = Some(prepared.prompt_tokens);
                    prompt_ids = prepared.prompt_ids;
                    cache_salt = prepared.upstream.sampling.cache_salt;
                }
                (Some(kind), None) => {
                    seen.model = model_of(body);
                    rngd_pool::prompt::check(kind, body).map_err(PrepareOrPick::Rule)?;
                    self.check_model(seen.model.as_deref())?;
                }
                (None, _) => {
                    seen.model = model_of(body);
                    rngd_api::rules::parse_body::<serde_json::Value>(body)
                        .map_err(PrepareOrPick::Rule)?;
                    self.check_model(seen.model.as_deref())?;
                }
            }
        }
        seen.prompt_tokens = prompt_tokens;
        let policy = Instant::now();
        let picked = self
            .pool
            .pick_held(PickRequest {
                headers: input.headers,
                body: input.body.unwrap_or_default(),
                prompt_tokens,
                subset: input.subset,
                prompt_ids,
                cache_salt,
            })
            .await;
        self.metrics.policy_step(policy.elapsed());
        picked.map_err(PrepareOrPick::Pick)
    }
}

impl Picker {
    /// `Ok` when the served names are unknown or include `model` (a body
    /// that parsed always names one).
    fn check_model(&self, model: Option<&str>) -> Result<(), PrepareOrPick> {
        match (&self.served, model) {
            (Some(s), Some(m)) => s.check(m).map_err(PrepareOrPick::ModelNotFound),
            _ => Ok(()),
        }
    }
}

/// What a pick learned about the request, for the per-model metrics.
#[derive(Debug, Default)]
struct Seen {
    model: Option<String>,
    prompt_tokens: Option<usize>,
}

/// The `model` of a JSON body, if it names one.
fn model_of(body: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct M {
        model: String,
    }
    serde_json::from_slice::<M>(body).ok().map(|m| m.model)
}

/// The headers a route sets on the request, `x-gateway-destination-endpoint` first,
/// without duplicates (the policy's own headers win over the defaults).
pub fn route_headers(route: &Route) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = vec![(
        headers::DESTINATION_ENDPOINT.to_string(),
        route.decode.clone(),
    )];
    if let Some(p) = &route.prefill {
        out.push((headers::PREFILLER_HOST_PORT.to_string(), p.clone()));
    }
    if let Some(t) = &route.kv_transport {
        out.push((headers::KV_TRANSPORT.to_string(), t.clone()));
    }
    for (k, v) in &route.headers {
        let k = k.to_ascii_lowercase();
        if let Some(slot) = out.iter_mut().find(|(name, _)| *name == k) {
            slot.1 = v.clone();
        } else {
            out.push((k, v.clone()));
        }
    }
    out
}
