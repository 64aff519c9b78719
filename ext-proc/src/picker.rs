//! One pick: parse the body, count the prompt, apply the subset hint, ask the
//! policy, and map every failure to GIE's status codes.
//!
//! | condition                                   | status |
//! |---------------------------------------------|--------|
//! | body not JSON / not an object / no `model`  | 400    |
//! | subset hint empty or matching no endpoint   | 503    |
//! | policy reject (`LocalResponse`)             | the policy's status and body (429/503/400 …) |
//! | policy failure, tokenizer failure           | 500    |

use std::sync::Arc;
use std::time::Instant;

use async_trait::async_trait;
use rngd_api::headers;
use rngd_api::openai::ErrorBody;
use rngd_policy_core::{Decision, LocalResponse, Route};
use rngd_policy_host::PolicyRequest;
use serde_json::Value;

use crate::endpoints::EndpointSource;
use crate::metrics::EppMetrics;
use crate::{BoxError, ExtProcError};

/// Makes the routing decision for one request (the policy module).
#[async_trait]
pub trait Decider: Send + Sync + 'static {
    /// Decides where `req` goes.
    async fn decide(&self, req: PolicyRequest) -> Result<Decision, ExtProcError>;
}

/// Counts the tokens of a prompt text (the model's tokenizer).
pub trait PromptCounter: Send + Sync + 'static {
    /// Number of tokens `text` encodes to.
    fn count(&self, text: &str) -> Result<usize, BoxError>;
}

/// The outcome of a pick.
#[derive(Debug, Clone, PartialEq)]
pub enum Pick {
    /// Send the request to the route's endpoint(s).
    Route(Route),
    /// Answer locally.
    Reject(LocalResponse),
}

/// Everything known about a request when the pick runs.
#[derive(Debug, Clone, Default)]
pub struct PickInput {
    /// Request headers including pseudo-headers.
    pub headers: Vec<(String, String)>,
    /// The complete body, or `None` for a request without one.
    pub body: Option<Vec<u8>>,
    /// Subset hint (`ip:port` list) from filter metadata or header; `None` = no hint.
    pub subset: Option<Vec<String>>,
}

/// Combines the endpoint source, the tokenizer and the policy.
pub struct Picker {
    decider: Arc<dyn Decider>,
    endpoints: Arc<dyn EndpointSource>,
    counter: Option<Arc<dyn PromptCounter>>,
    metrics: EppMetrics,
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
    LocalResponse {
        status,
        body: serde_json::to_vec(&body).unwrap_or_default(),
        headers: vec![("content-type".to_string(), "application/json".to_string())],
    }
}

fn bad_request(code: &str, message: impl Into<String>) -> Pick {
    Pick::Reject(error_response(400, "invalid_request_error", code, message))
}

/// The text whose tokens make the prompt of an OpenAI body, or token ids.
enum PromptText {
    Text(String),
    Tokens(usize),
    None,
}

fn prompt_text(body: &Value) -> PromptText {
    if let Some(p) = body.get("prompt") {
        return match p {
            Value::String(s) => PromptText::Text(s.clone()),
            Value::Array(items) => {
                if items.iter().all(Value::is_number) {
                    PromptText::Tokens(items.len())
                } else if items.iter().all(Value::is_array) {
                    PromptText::Tokens(items.iter().filter_map(Value::as_array).map(Vec::len).sum())
                } else {
                    PromptText::Text(
                        items
                            .iter()
                            .filter_map(Value::as_str)
                            .collect::<Vec<_>>()
                            .join(""),
                    )
                }
            }
            _ => PromptText::None,
        };
    }
    if let Some(Value::Array(messages)) = body.get("messages") {
        // ChatML rendering (the SmolLM2 template): an estimate of what the worker prefills.
        let mut text = String::new();
        for m in messages {
            let role = m.get("role").and_then(Value::as_str).unwrap_or("user");
            let content = match m.get("content") {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Array(parts)) => parts
                    .iter()
                    .filter_map(|p| p.get("text").and_then(Value::as_str))
                    .collect::<Vec<_>>()
                    .join(""),
                _ => String::new(),
            };
            text.push_str(&format!("<|im_start|>{role}\n{content}<|im_end|>\n"));
        }
        text.push_str("<|im_start|>assistant\n");
        return PromptText::Text(text);
    }
    PromptText::None
}

impl Picker {
    /// A picker over these parts; `counter = None` leaves `rngd_pd.prompt_tokens` unset.
    pub fn new(
        decider: Arc<dyn Decider>,
        endpoints: Arc<dyn EndpointSource>,
        counter: Option<Arc<dyn PromptCounter>>,
        metrics: EppMetrics,
    ) -> Self {
        Picker {
            decider,
            endpoints,
            counter,
            metrics,
        }
    }

    /// The metrics this picker records into.
    pub fn metrics(&self) -> &EppMetrics {
        &self.metrics
    }

    /// Picks for one request; never fails (failures become local responses).
    pub async fn pick(&self, input: PickInput) -> Pick {
        let start = Instant::now();
        let pick = self.pick_inner(input).await;
        self.metrics
            .pick_us
            .observe(start.elapsed().as_secs_f64() * 1e6);
        let result = match &pick {
            Pick::Route(_) => "route".to_string(),
            Pick::Reject(r) => format!("reject_{}", r.status),
        };
        self.metrics.picks.with_label_values(&[&result]).inc();
        pick
    }

    async fn pick_inner(&self, input: PickInput) -> Pick {
        let mut prompt_tokens = None;
        if let Some(body) = &input.body {
            if body.is_empty() {
                return bad_request("empty_body", "request body is empty");
            }
            let json: Value = match serde_json::from_slice(body) {
                Ok(v) => v,
                Err(e) => {
                    return bad_request(
                        "invalid_json",
                        format!("request body is not valid JSON: {e}"),
                    );
                }
            };
            if !json.is_object() {
                return bad_request("invalid_json", "request body must be a JSON object");
            }
            match json.get("model") {
                Some(Value::String(m)) if !m.is_empty() => {}
                _ => return bad_request("missing_model", "request body has no \"model\""),
            }
            if let Some(counter) = &self.counter {
                prompt_tokens = match prompt_text(&json) {
                    PromptText::Text(t) => match counter.count(&t) {
                        Ok(n) => Some(n),
                        Err(source) => {
                            let e = ExtProcError::Count { source };
                            tracing::error!(error = %e, "prompt count failed");
                            return Pick::Reject(error_response(
                                500,
                                "server_error",
                                "internal",
                                e.to_string(),
                            ));
                        }
                    },
                    PromptText::Tokens(n) => Some(n),
                    PromptText::None => None,
                };
            }
        }
        let mut endpoints = self.endpoints.snapshot();
        if let Some(subset) = &input.subset {
            endpoints = endpoints
                .iter()
                .filter(|e| subset.iter().any(|s| s == &e.address))
                .cloned()
                .collect();
            if endpoints.is_empty() {
                return Pick::Reject(error_response(
                    503,
                    "service_unavailable",
                    "no_endpoint_in_subset",
                    "no endpoint is eligible under the subset hint",
                ));
            }
        }
        let req = PolicyRequest {
            headers: input.headers,
            body: input.body.unwrap_or_default(),
            endpoints: Some(endpoints),
            prompt_tokens,
        };
        match self.decider.decide(req).await {
            Ok(Decision::Route(route)) => {
                if route.decode.is_empty() {
                    return Pick::Reject(error_response(
                        500,
                        "server_error",
                        "internal",
                        "policy routed to an empty destination",
                    ));
                }
                Pick::Route(route)
            }
            Ok(Decision::Reject(local)) => Pick::Reject(local),
            Err(e) => {
                tracing::error!(error = %e, "policy failed");
                let status = match &e {
                    ExtProcError::Decide { status, .. } => *status,
                    _ => 500,
                };
                Pick::Reject(error_response(
                    status,
                    "server_error",
                    "policy_error",
                    e.to_string(),
                ))
            }
        }
    }
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
