//! A proxy-wasm (ABI 0.2.1) host on wasmtime that runs policy modules sandboxed
//! and swaps them at runtime. Used by the gateway and the ext-proc endpoint picker.

use std::path::PathBuf;

pub use rngd_policy_core::{Decision, Endpoint, LocalResponse, Route};

/// Errors of the policy host.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    /// Placeholder until the host lands.
    #[error("{0}")]
    Other(String),
}

/// One request as the policy sees it.
#[derive(Debug, Clone, Default)]
pub struct PolicyRequest {
    /// Request headers, including the pseudo-headers `:method`, `:path`, `:authority`.
    pub headers: Vec<(String, String)>,
    /// Request body (JSON), possibly empty.
    pub body: Vec<u8>,
    /// Endpoint snapshot (`rngd_pd.endpoints`); `None` = property absent.
    pub endpoints: Option<Vec<Endpoint>>,
    /// Prompt tokens counted by the host (`rngd_pd.prompt_tokens`).
    pub prompt_tokens: Option<usize>,
}

/// Where a runtime loads its module from.
#[derive(Debug, Clone)]
pub struct PolicySource {
    /// Path of the `.wasm` file (watched for changes).
    pub module: PathBuf,
    /// Plugin configuration (JSON) passed to `proxy_on_configure`.
    pub config: Vec<u8>,
}
