//! HTTP header names of the routing conventions rngd-pd speaks.

/// Decode (or only) endpoint chosen by the picker, `ip:port` (Gateway API Inference Extension).
pub const DESTINATION_ENDPOINT: &str = "x-gateway-destination-endpoint";
/// Subset hint: endpoints the picker may choose from (comma-separated `ip:port`).
pub const DESTINATION_ENDPOINT_SUBSET: &str = "x-gateway-destination-endpoint-subset";
/// Prefill endpoint `host:port` for the decode worker to call first (llm-d routing sidecar).
pub const PREFILLER_HOST_PORT: &str = "x-prefiller-host-port";
/// KV transport chosen by the policy.
pub const KV_TRANSPORT: &str = "x-rngd-pd-kv-transport";
/// Why the policy routed as it did (`cached`, `short_prompt`,
/// `ttft_goal_met_locally`, `faster_locally`, `disaggregated`,
/// `unknown_prompt`, `no_prefill_endpoint`, `no_prefill_same_weights`,
/// `no_common_transport`, `solo`):
/// set by the policy, never taken from a client. The gateway replaces it
/// with `prefill_context_fallback` when the prefill worker it was sent to
/// refused the prompt as too long and the decode worker prefilled it.
pub const ROUTE_REASON: &str = "x-rngd-pd-route-reason";
/// The client's TTFT goal, ms (llm-d's SLO header).
pub const SLO_TTFT_MS: &str = "x-llm-d-slo-ttft-ms";
/// Request id, propagated end to end.
pub const REQUEST_ID: &str = "x-request-id";
/// Dynamic metadata namespace Envoy's load balancer reads.
pub const ENVOY_LB_NAMESPACE: &str = "envoy.lb";
/// Key of the subset hint inside the `envoy.lb` filter metadata.
pub const ENVOY_LB_SUBSET_HINT: &str = "x-gateway-destination-endpoint-subset";
