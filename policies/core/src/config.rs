//! The default policy's plugin configuration (JSON), documented field by field
//! in `docs/policy-abi.md`: its fields, defaults and scores. Its reader,
//! `PolicyConfig::from_json`, lives with the other JSON reader in `json`.

use serde::{Deserialize, Serialize};

use crate::Endpoint;

/// Plugin configuration of the default PD policy. Every field has a default,
/// so `{}` (or an empty configuration) is valid.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PolicyConfig {
    /// Prompts with fewer tokens than this prefill on the decode endpoint itself
    /// (no `x-prefiller-host-port`). Default 32.
    pub disaggregation_threshold_tokens: u64,
    /// Transport when prefill and decode share a node. Default `shm`.
    pub same_node_transport: String,
    /// Transport when they do not (or one node is unknown). Default `tcp`.
    pub cross_node_transport: String,
    /// An endpoint whose `queue_depth` is at or above this takes no new
    /// requests; when every candidate is there the answer is 429. Default: no limit.
    pub max_queue_depth: Option<u32>,
    /// `max_tokens` assumed when the body has neither `max_tokens` nor
    /// `max_completion_tokens`. Default 16 (the OpenAI completions default).
    pub default_max_tokens: u64,
    /// When the host gives no `rngd_pd.prompt_tokens` (Envoy's own wasm
    /// filter), the prompt is estimated as ⌈prompt JSON bytes / this⌉, which
    /// under-counts ordinary text (~4 bytes/token) so admission only rejects
    /// prompts that cannot fit. 0 = no estimate: admission is skipped and every
    /// eligible prompt is disaggregated. Default 8.
    pub estimate_bytes_per_token: u64,
    /// Load score weight of `queue_depth`. Default 4.
    pub queue_weight: f64,
    /// Load score weight of `running`. Default 1.
    pub running_weight: f64,
    /// Load score weight of `kv_usage` (0..1). Default 8.
    pub kv_usage_weight: f64,
    /// Endpoints used when the host passes no `rngd_pd.endpoints` property
    /// (inside Envoy's own wasm filter). Default empty.
    pub static_endpoints: Vec<Endpoint>,
    /// Score credit per 100 prompt tokens already cached on an endpoint
    /// (`rngd_pd.prefix_cache`), subtracted from its load score: with the
    /// defaults a 400-token cached prefix outweighs two queued requests. 0 =
    /// route on load alone. Default 2.
    pub prefix_weight: f64,
    /// Predicted prefill cost per token not cached, ms (the TTFT estimate of
    /// the PD decision). Default 1.
    pub prefill_ms_per_token: f64,
    /// Predicted wait per queued request on an endpoint, ms (the TTFT
    /// estimate of the PD decision). Default 100.
    pub queue_ms_per_request: f64,
    /// How much a prefill on a decode endpoint costs its running streams, as
    /// a multiple of the prefill time per running stream (each waits that
    /// long for its next token). The PD decision prefills locally only when
    /// the remote prediction is worse than the local one by more than this
    /// cost. Default 1.
    pub decode_interference: f64,
    /// TTFT goal, ms, when the request carries no `x-llm-d-slo-ttft-ms`:
    /// a prompt whose predicted TTFT prefilled on its decode endpoint meets
    /// it is not disaggregated. Default none.
    pub ttft_goal_ms: Option<f64>,
    /// How the decode and prefill endpoints are chosen ([`Routing`]):
    /// `"cache"` (the cache credit in the scores and the PD decision on the
    /// uncached tokens), `"load"` (`rngd_pd.prefix_cache` ignored: scores
    /// and PD decision as if the host passed none) or `"round_robin"`
    /// (eligible endpoints in turn, the PD decision as with `"load"`). Any
    /// other value is a configuration error. Default `"cache"`.
    pub routing: Routing,
}

/// The routing strategy of the default policy (`routing` in
/// [`PolicyConfig`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Routing {
    /// Load score less the cache credit (`prefix_weight`); the PD decision
    /// weighs the tokens the chosen endpoints do not hold.
    #[default]
    Cache,
    /// Load score alone; the PD decision weighs the whole prompt
    /// (`rngd_pd.prefix_cache` is ignored).
    Load,
    /// The eligible decode endpoints in turn, and the eligible prefill
    /// endpoints in turn; the PD decision as with [`Routing::Load`]. The
    /// turn is counted per policy object ([`crate::PdPolicy`]): each wasm
    /// instance (one per worker thread of a host) counts for itself, so the
    /// rotation is exact per instance, not across a host's threads. The
    /// stateless [`crate::decide`] always takes the first eligible one.
    RoundRobin,
}

impl Routing {
    /// The configuration value's spellings, as listed in errors.
    pub const NAMES: &'static str = "\"cache\", \"load\", \"round_robin\"";

    /// The strategy named `name` (exactly as written in the configuration).
    pub fn from_name(name: &str) -> Option<Routing> {
        match name {
            "cache" => Some(Routing::Cache),
            "load" => Some(Routing::Load),
            "round_robin" => Some(Routing::RoundRobin),
            _ => None,
        }
    }
}

impl Default for PolicyConfig {
    fn default() -> Self {
        PolicyConfig {
            disaggregation_threshold_tokens: 32,
            same_node_transport: "shm".to_string(),
            cross_node_transport: "tcp".to_string(),
            max_queue_depth: None,
            default_max_tokens: 16,
            estimate_bytes_per_token: 8,
            queue_weight: 4.0,
            running_weight: 1.0,
            kv_usage_weight: 8.0,
            static_endpoints: Vec::new(),
            prefix_weight: 2.0,
            prefill_ms_per_token: 1.0,
            queue_ms_per_request: 100.0,
            decode_interference: 1.0,
            ttft_goal_ms: None,
            routing: Routing::Cache,
        }
    }
}

impl PolicyConfig {
    /// Load score of an endpoint: lower is better.
    pub fn score(&self, e: &Endpoint) -> f64 {
        f64::from(e.queue_depth) * self.queue_weight
            + f64::from(e.running) * self.running_weight
            + e.kv_usage * self.kv_usage_weight
    }

    /// Load score less the credit for `cached` prompt tokens on the endpoint.
    pub fn score_cached(&self, e: &Endpoint, cached: u64) -> f64 {
        self.score(e) - self.prefix_weight * cached as f64 / 100.0
    }

    /// Predicted TTFT of prefilling `uncached` tokens on `e`, ms: the
    /// requests ahead of it (those waiting and, on a prefill endpoint, whose
    /// every running request is a prefill still being computed, those
    /// running too) at `queue_ms_per_request` each, then its own tokens.
    pub fn predicted_ttft_ms(&self, e: &Endpoint, uncached: u64) -> f64 {
        let running_prefills = if e.role == crate::Role::Prefill {
            e.running
        } else {
            0
        };
        f64::from(e.queue_depth.saturating_add(running_prefills)) * self.queue_ms_per_request
            + uncached as f64 * self.prefill_ms_per_token
    }
}
