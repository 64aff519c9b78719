//! The policy decision contract (`docs/policy-abi.md`) and the default PD
//! routing logic, with no dependency on any host: the same code runs inside the
//! proxy-wasm module and natively (for the benchmark baseline).

mod body;
mod config;
mod json;
mod pick;

pub use config::{PolicyConfig, Routing};
pub use json::JsonError;
pub use pick::{
    Outcome, PdPolicy, RequestInput, RequestProps, RouteRef, SnapshotCache, cached_tokens, choose,
    decide, estimate_prompt_tokens,
};

use serde::{Deserialize, Serialize};

/// Property path (NUL-joined in the ABI) carrying the endpoint snapshot as JSON.
pub const PROP_ENDPOINTS: &str = "rngd_pd.endpoints";
/// Property path carrying the prompt token count (decimal text).
pub const PROP_PROMPT_TOKENS: &str = "rngd_pd.prompt_tokens";
/// Property path carrying an opaque version of the endpoint snapshot: while it
/// stays the same, a guest may reuse the snapshot it parsed before.
pub const PROP_ENDPOINTS_VERSION: &str = "rngd_pd.endpoints_version";
/// Property path carrying, per endpoint, the prompt tokens already in its
/// prefix cache: `ADDRESS=TOKENS` entries joined by `,` (`ADDRESS=?`: that
/// endpoint's cache is unknown). Absent: no cache information at all (the
/// policy routes on load alone).
pub const PROP_PREFIX_CACHE: &str = "rngd_pd.prefix_cache";
/// [`PROP_PREFIX_CACHE`] as `proxy_get_property` takes it.
pub const PROP_PREFIX_CACHE_PATH: &[u8] = b"rngd_pd\0prefix_cache";
/// [`PROP_ENDPOINTS`] as `proxy_get_property` takes it (tokens joined by NUL).
pub const PROP_ENDPOINTS_PATH: &[u8] = b"rngd_pd\0endpoints";
/// [`PROP_PROMPT_TOKENS`] as `proxy_get_property` takes it.
pub const PROP_PROMPT_TOKENS_PATH: &[u8] = b"rngd_pd\0prompt_tokens";
/// [`PROP_ENDPOINTS_VERSION`] as `proxy_get_property` takes it.
pub const PROP_ENDPOINTS_VERSION_PATH: &[u8] = b"rngd_pd\0endpoints_version";

/// Byte-string equality without a `memcmp` call. In a wasm guest `memcmp` is
/// an out-of-line byte loop (natively it is expanded inline for short
/// constants); the strings a decision compares (field names, versions, node
/// names, transports) are short, so this is a word or two.
#[inline]
pub(crate) fn same(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let (mut x, mut y) = (a, b);
    // Whole words by value (no variable-length copy: in a wasm guest that
    // is a `memory.copy`, a call out of the guest).
    while let (Some((xw, xr)), Some((yw, yr))) =
        (x.split_first_chunk::<8>(), y.split_first_chunk::<8>())
    {
        if u64::from_le_bytes(*xw) != u64::from_le_bytes(*yw) {
            return false;
        }
        (x, y) = (xr, yr);
    }
    x.iter().zip(y).all(|(p, q)| p == q)
}

/// `n * 10 + digit`, or `None` past `u64::MAX`. Comparisons only: a checked
/// 64-bit multiply is a 128-bit library call on wasm32.
#[inline]
pub(crate) fn push_digit(n: u64, digit: u8) -> Option<u64> {
    const LIMIT: u64 = u64::MAX / 10;
    let d = u64::from(digit);
    if n > LIMIT || (n == LIMIT && d > u64::MAX % 10) {
        None
    } else {
        Some(n * 10 + d)
    }
}

/// Errors of the policy logic.
#[derive(Debug, thiserror::Error)]
pub enum CoreError {
    /// The plugin configuration is not valid JSON for [`PolicyConfig`].
    #[error("invalid policy configuration: {source}")]
    Config {
        /// Cause.
        #[source]
        source: JsonError,
    },
    /// The request body is not a JSON object, or a token count in it is not
    /// a non-negative integer.
    #[error("{what} at byte {at}")]
    Body {
        /// What is wrong.
        what: &'static str,
        /// Byte offset in the body.
        at: usize,
    },
    /// The endpoint snapshot is not a JSON array of [`Endpoint`].
    #[error("invalid endpoint snapshot ({PROP_ENDPOINTS}): {source}")]
    Snapshot {
        /// Cause.
        #[source]
        source: JsonError,
    },
}

/// What an endpoint can do: the one worker-role type, owned by `rngd-api`.
pub use rngd_api::Role;

/// Accelerator vendor of an endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Vendor {
    /// FuriosaAI RNGD.
    Rngd,
    /// Rebellions ATOM.
    Atom,
    /// The embedded CPU engine.
    Cpu,
}

/// One endpoint of the snapshot the host passes in `rngd_pd.endpoints`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Endpoint {
    /// `ip:port` of the worker.
    pub address: String,
    /// Role.
    pub role: Role,
    /// Vendor.
    pub vendor: Vendor,
    /// Node name (same node → `shm`).
    #[serde(default)]
    pub node: String,
    /// Compiled context length.
    pub seq_len: u32,
    /// Requests waiting (`vllm:num_requests_waiting`).
    #[serde(default)]
    pub queue_depth: u32,
    /// Requests running (`vllm:num_requests_running`).
    #[serde(default)]
    pub running: u32,
    /// KV cache usage 0..1 (`vllm:kv_cache_usage_perc`).
    #[serde(default)]
    pub kv_usage: f64,
    /// Whether the endpoint is healthy and its data fresh.
    #[serde(default = "yes")]
    pub healthy: bool,
    /// KV transports the endpoint supports.
    #[serde(default)]
    pub transports: Vec<String>,
    /// The weights the endpoint serves (its `weight_version`, scraped from
    /// `rngd_pd_worker_weight_info`); `None`: unknown. A prefill endpoint is
    /// paired only with a decode endpoint of the same weights.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight_version: Option<String>,
}

fn yes() -> bool {
    true
}

/// What a policy decided for one request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Decision {
    /// Send the request on.
    Route(Route),
    /// Answer locally (reject).
    Reject(LocalResponse),
}

/// A routing decision.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Route {
    /// Decode (or only) endpoint `ip:port` (`x-gateway-destination-endpoint`).
    pub decode: String,
    /// Prefill endpoint (`x-prefiller-host-port`); `None` = prefill on the decode endpoint.
    pub prefill: Option<String>,
    /// KV transport (`x-rngd-pd-kv-transport`), when prefill is remote.
    pub kv_transport: Option<String>,
    /// Every header the policy set or replaced, in order (including the three above).
    pub headers: Vec<(String, String)>,
}

impl Decision {
    /// The route, if the decision is one.
    pub fn route(&self) -> Option<&Route> {
        match self {
            Decision::Route(r) => Some(r),
            Decision::Reject(_) => None,
        }
    }

    /// The local response, if the decision is a rejection.
    pub fn rejection(&self) -> Option<&LocalResponse> {
        match self {
            Decision::Route(_) => None,
            Decision::Reject(l) => Some(l),
        }
    }
}

impl LocalResponse {
    /// An OpenAI-style JSON error response (`{"error":{...}}`, the bytes
    /// `serde_json` writes for [`rngd_api::openai::ErrorBody`], written
    /// directly: the wasm module carries no serializer).
    pub fn error(status: u16, message: impl Into<String>, code: Option<&str>) -> Self {
        Self::error_on(status, message, code, None)
    }

    /// [`LocalResponse::error`] naming the request parameter at fault
    /// (`error.param`), as a client's error should.
    pub fn error_on(
        status: u16,
        message: impl Into<String>,
        code: Option<&str>,
        param: Option<&str>,
    ) -> Self {
        let message = message.into();
        let kind = rngd_api::openai::ErrorBody::kind_for_status(status);
        let mut body = Vec::with_capacity(message.len() + 96);
        body.extend_from_slice(br#"{"error":{"message":"#);
        json::write_string(&mut body, &message);
        body.extend_from_slice(br#","type":"#);
        json::write_string(&mut body, kind);
        body.extend_from_slice(br#","param":"#);
        match param {
            Some(p) => json::write_string(&mut body, p),
            None => body.extend_from_slice(b"null"),
        }
        body.extend_from_slice(br#","code":"#);
        match code {
            Some(code) => json::write_string(&mut body, code),
            None => body.extend_from_slice(b"null"),
        }
        body.extend_from_slice(b"}}");
        LocalResponse {
            status,
            body,
            headers: vec![("content-type".to_string(), "application/json".to_string())],
        }
    }

    /// The `error.message` of the body, if it is an OpenAI-style error.
    pub fn message(&self) -> Option<String> {
        serde_json::from_slice::<rngd_api::openai::ErrorBody>(&self.body)
            .ok()
            .map(|b| b.error.message)
    }
}

/// A local response the policy sent (status + OpenAI-style JSON error body).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LocalResponse {
    /// HTTP status.
    pub status: u16,
    /// Response body.
    pub body: Vec<u8>,
    /// Extra response headers.
    pub headers: Vec<(String, String)>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_bodies_are_what_serde_json_writes() {
        for (status, message, code) in [
            (
                400,
                "prompt_tokens (500) + max_tokens (64) exceeds seq_len 512",
                Some("context_length_exceeded"),
            ),
            (503, "no endpoint \"qualifies\"\n", None),
            (429, "", None),
            (500, "é \u{1}", Some("x")),
        ] {
            let mut want = rngd_api::openai::ErrorBody::new(
                rngd_api::openai::ErrorBody::kind_for_status(status),
                message,
            );
            if let Some(c) = code {
                want = want.with_code(c);
            }
            let got = LocalResponse::error(status, message, code);
            assert_eq!(got.body, serde_json::to_vec(&want).unwrap());
            assert_eq!(got.message().as_deref(), Some(message));
            for param in ["max_tokens", "a \"quoted\" name"] {
                let got = LocalResponse::error_on(status, message, code, Some(param));
                let want = want.clone().with_param(param);
                assert_eq!(got.body, serde_json::to_vec(&want).unwrap());
            }
        }
    }

    #[test]
    fn same_is_slice_equality() {
        let words: [&[u8]; 9] = [
            b"",
            b"a",
            b"shm",
            b"tcp",
            b"prompt",
            b"messages",
            b"max_tokens",
            b"max_completion_tokens",
            b"max_completion_tokenz",
        ];
        for a in words {
            for b in words {
                assert_eq!(same(a, b), a == b, "{a:?} {b:?}");
            }
        }
    }

    #[test]
    fn push_digit_stops_exactly_past_u64_max() {
        let mut n = 0u64;
        for d in u64::MAX.to_string().bytes() {
            n = push_digit(n, d - b'0').expect("u64::MAX fits");
        }
        assert_eq!(n, u64::MAX);
        assert_eq!(push_digit(u64::MAX / 10, 6), None);
        assert_eq!(push_digit(u64::MAX, 0), None);
        assert_eq!(push_digit(12, 3), Some(123));
    }

    #[test]
    fn property_paths_are_the_names_joined_by_nul() {
        for (name, path) in [
            (PROP_ENDPOINTS, PROP_ENDPOINTS_PATH),
            (PROP_PROMPT_TOKENS, PROP_PROMPT_TOKENS_PATH),
            (PROP_ENDPOINTS_VERSION, PROP_ENDPOINTS_VERSION_PATH),
            (PROP_PREFIX_CACHE, PROP_PREFIX_CACHE_PATH),
        ] {
            assert_eq!(name.replace('.', "\0").as_bytes(), path);
        }
    }
}
