//! A proxy-wasm (ABI 0.2.1) host on wasmtime that runs policy modules sandboxed
//! and swaps them at runtime. Used by the gateway and the ext-proc endpoint picker.
//!
//! - [`PolicyRuntime`]: compile, self-test, serve decisions from a pool of warm
//!   instances, hot-swap, watch the module file.
//! - [`admin`]: `GET`/`PUT /admin/policy`, token-guarded, on its own
//!   listener ([`admin::serve`]) or as a router ([`admin_router`]).
//! - [`check`], [`CheckOptions`]: `rngd-pd policy check FILE.wasm`.
//! - [`RequestState`]: one request as a guest sees it through the ABI, and
//!   the decision read back out of it (also used by a native run of a module).
//! - [`codes`]: the ABI's status codes and map and buffer types;
//!   [`decode_header_map`] / [`encode_header_map`]: its header-map encoding.
//!
//! The decision contract is `docs/policy-abi.md`.

mod abi;
pub mod admin;
mod check;
pub mod codes;
mod guest;
pub mod locate;
mod map;
mod request;
mod runtime;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

pub use admin::{AdminOptions, AdminToken, admin_router, admin_router_with};
pub use check::{CheckOptions, check};
pub use map::{decode_map as decode_header_map, encode_map as encode_header_map};
pub use request::RequestState;
pub use rngd_policy_core::{Decision, Endpoint, LocalResponse, Route};
pub use runtime::PolicyRuntime;

/// A boxed error cause (wasmtime's own error type is converted into this).
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Errors of the policy host.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    /// Reading a module file failed.
    #[error("reading policy module {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// The wasmtime engine could not be set up.
    #[error("setting up the wasm engine: {source}")]
    Engine {
        /// Cause.
        #[source]
        source: BoxError,
    },
    /// The bytes are not a valid wasm module.
    #[error("compiling the policy module: {source}")]
    Compile {
        /// Cause.
        #[source]
        source: BoxError,
    },
    /// The module is wasm but not a proxy-wasm 0.2.1 HTTP filter this host can
    /// run (missing export, unknown import, wrong signature).
    #[error("the module is not a usable proxy-wasm 0.2.1 filter: {detail}")]
    Abi {
        /// What is wrong.
        detail: String,
    },
    /// `proxy_on_vm_start` or `proxy_on_configure` returned false.
    #[error("the module rejected its {phase}{}", fmt_guest_log(.guest_log))]
    Rejected {
        /// `vm start` or `plugin configuration`.
        phase: &'static str,
        /// Error lines the guest logged.
        guest_log: Vec<String>,
    },
    /// A canned request failed while a new module was tested; the old module
    /// (if any) stays active.
    #[error("self-test failed on canned request '{request}': {source}")]
    SelfTest {
        /// Name of the canned request.
        request: &'static str,
        /// Cause.
        #[source]
        source: Box<PolicyError>,
    },
    /// The guest trapped (panic, `unreachable`, out-of-bounds access, …). The
    /// instance was discarded.
    #[error("policy guest trapped: {message}{}", fmt_guest_log(.guest_log))]
    GuestTrap {
        /// Trap description.
        message: String,
        /// Error lines the guest logged (a Rust guest's panic message).
        guest_log: Vec<String>,
    },
    /// The guest ran past its time limit (epoch interruption).
    #[error("policy guest exceeded its time limit of {limit:?}")]
    GuestTimeout {
        /// The limit.
        limit: Duration,
    },
    /// One decision's callbacks together ran past
    /// [`SandboxLimits::decision_budget`] (each alone may have been within
    /// `call_timeout`). The instance was discarded.
    #[error(
        "policy decision exceeded its time budget of {budget:?} across callbacks (stopped in {callback} after {spent:?})"
    )]
    DecisionBudget {
        /// The budget.
        budget: Duration,
        /// Time spent when the decision was stopped.
        spent: Duration,
        /// The callback that was running or about to run.
        callback: &'static str,
    },
    /// The guest tried to grow its memory past the cap.
    #[error("policy guest exceeded its memory cap of {limit} bytes")]
    GuestMemory {
        /// The cap in bytes.
        limit: usize,
    },
    /// The guest finished without routing (`x-gateway-destination-endpoint`)
    /// or rejecting (local response).
    #[error("policy made no decision: {detail}")]
    NoDecision {
        /// What it did instead.
        detail: String,
    },
    /// The request is larger than the sandbox accepts.
    #[error("{what} of {size} bytes exceeds the policy input limit of {max} bytes")]
    InputTooLarge {
        /// Which input.
        what: &'static str,
        /// Its size.
        size: usize,
        /// The limit.
        max: usize,
    },
    /// The admin API's listener could not be bound.
    #[error("binding the policy admin listener {addr}: {source}")]
    Listen {
        /// The address.
        addr: std::net::SocketAddr,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// The runtime is shutting down or a worker thread failed.
    #[error("policy runtime unavailable: {detail}")]
    Unavailable {
        /// Why.
        detail: String,
    },
}

fn fmt_guest_log(lines: &[String]) -> String {
    if lines.is_empty() {
        String::new()
    } else {
        format!(" (guest log: {})", lines.join(" | "))
    }
}

impl PolicyError {
    /// Whether the guest misbehaved on a request (trap, timeout, memory cap,
    /// decision budget):
    /// the request fails with a 500-class error and `policy_traps_total` counts it.
    pub fn is_guest_fault(&self) -> bool {
        matches!(
            self,
            PolicyError::GuestTrap { .. }
                | PolicyError::GuestTimeout { .. }
                | PolicyError::GuestMemory { .. }
                | PolicyError::DecisionBudget { .. }
        )
    }

    /// The HTTP status an edge answers with for this error.
    pub fn http_status(&self) -> u16 {
        match self {
            PolicyError::InputTooLarge { .. } => 413,
            PolicyError::Unavailable { .. } => 503,
            PolicyError::Compile { .. }
            | PolicyError::Abi { .. }
            | PolicyError::Rejected { .. }
            | PolicyError::SelfTest { .. } => 422,
            _ => 500,
        }
    }
}

/// One request as the policy sees it.
#[derive(Debug, Clone, Default)]
pub struct PolicyRequest {
    /// Request headers, including the pseudo-headers `:method`, `:path`, `:authority`.
    pub headers: Vec<(String, String)>,
    /// Request body (JSON), possibly empty.
    pub body: Vec<u8>,
    /// Endpoint snapshot (`rngd_pd.endpoints`); `None` = property absent.
    ///
    /// The runtime serializes a snapshot for the guest once and reuses it
    /// while requests carry the same one: passing the same `Arc` is a pointer
    /// comparison, a new `Arc` with equal contents a full comparison. Callers
    /// that keep their snapshot in an `Arc` until it changes pay neither the
    /// copy nor the comparison per request.
    pub endpoints: Option<Arc<[Endpoint]>>,
    /// Prompt tokens counted by the host (`rngd_pd.prompt_tokens`).
    pub prompt_tokens: Option<usize>,
    /// Per endpoint, the prompt tokens already in its prefix cache
    /// (`rngd_pd.prefix_cache`: `ADDRESS=TOKENS` joined by `,`, `ADDRESS=?`
    /// when unknown); `None` = no cache information (property absent).
    pub prefix_cache: Option<String>,
}

/// Where a runtime loads its module from.
#[derive(Debug, Clone)]
pub struct PolicySource {
    /// Path of the `.wasm` file (watched for changes).
    pub module: PathBuf,
    /// Plugin configuration (JSON) passed to `proxy_on_configure`.
    pub config: Vec<u8>,
}

/// Resource limits of the sandbox.
#[derive(Debug, Clone)]
pub struct SandboxLimits {
    /// Linear memory cap per instance. Default 64 MiB.
    pub memory_bytes: usize,
    /// Wall-time cap of one guest call. Default 50 ms. In a decision the
    /// budget across its callbacks (`decision_budget`) is the nearer limit
    /// unless this is shorter; this one alone bounds `_initialize`,
    /// `proxy_on_vm_start` and `proxy_on_configure`.
    pub call_timeout: Duration,
    /// Epoch ticker period (the timeout's resolution: a call is stopped
    /// between `call_timeout` and `call_timeout + epoch_tick`). Default 5 ms,
    /// so an idle host wakes 200 times a second, not 1000.
    pub epoch_tick: Duration,
    /// Warm instances kept per module, and the number of decisions that run
    /// at once (`decide` waits for a slot beyond that). Default 4.
    pub instances: usize,
    /// Largest header map, header value set by the guest, or local response
    /// header block, in bytes. Default 64 KiB.
    pub max_header_bytes: usize,
    /// Largest request body passed to the guest. Default 4 MiB.
    pub max_body_bytes: usize,
    /// Wall-time budget of one decision, across all its callbacks
    /// (`proxy_on_context_create`, request headers, body, done, delete).
    /// Each callback runs for at most what is left of it (and at most
    /// `call_timeout`); a decision that spends it fails with
    /// [`PolicyError::DecisionBudget`]. Enforced by epoch interruption, so a
    /// callback is stopped up to two `epoch_tick`s past it. Default 10 ms.
    pub decision_budget: Duration,
    /// Shared-data entries one instance may hold (`proxy_set_shared_data`
    /// of a new key past it is `BadArgument`). Default 1024.
    pub max_shared_entries: usize,
    /// Bytes (keys plus values) of one instance's shared data. Default 1 MiB.
    pub max_shared_bytes: usize,
    /// Headers a guest may set, replace or add in one decision (distinct
    /// names). Default 64.
    pub max_set_headers: usize,
    /// Bytes (names plus values) of the headers a guest sets in one
    /// decision. Default 64 KiB.
    pub max_set_header_bytes: usize,
    /// Largest guest log message (`proxy_log`, one WASI `fd_write`).
    /// Default 4 KiB.
    pub max_log_bytes: usize,
    /// Guest log lines per second across all instances of a runtime (also
    /// the burst). Default 100.
    pub log_lines_per_second: u32,
    /// Guest faults (trap, timeout, memory cap, decision budget) of a
    /// hot-swapped module within `rollback_window` after which the runtime
    /// goes back to the module active before it. 0 = never. Default 5.
    pub rollback_after: u32,
    /// The window of `rollback_after`. Default 10 s.
    pub rollback_window: Duration,
}

impl Default for SandboxLimits {
    fn default() -> Self {
        SandboxLimits {
            memory_bytes: 64 << 20,
            call_timeout: Duration::from_millis(50),
            epoch_tick: Duration::from_millis(5),
            instances: 4,
            max_header_bytes: 64 << 10,
            max_body_bytes: 4 << 20,
            decision_budget: Duration::from_millis(10),
            max_shared_entries: 1024,
            max_shared_bytes: 1 << 20,
            max_set_headers: 64,
            max_set_header_bytes: 64 << 10,
            max_log_bytes: 4 << 10,
            log_lines_per_second: 100,
            rollback_after: 5,
            rollback_window: Duration::from_secs(10),
        }
    }
}

/// The active module.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ModuleInfo {
    /// SHA-256 of the module bytes, lowercase hex.
    pub sha256: String,
    /// When it became active.
    pub loaded_at: SystemTime,
    /// File it was loaded from; `None` for a module uploaded as bytes.
    pub path: Option<PathBuf>,
}

/// Lowercase hex SHA-256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Path of a guest built by `policies/build.sh`, found by
/// [`locate::built_guest`]: `$CARGO_TARGET_DIR/<target>/release/<name>.wasm`
/// (`-` in `name` becomes `_`), else the same path under the cargo target
/// directory of the running executable. For tests.
///
/// # Panics
/// When the file does not exist, with a message listing where it looked and
/// saying to run `policies/build.sh`.
pub fn built_module(name: &str, target: &str) -> PathBuf {
    match locate::built_guest(name, target) {
        Ok(p) => p,
        Err(e) => panic!("{e}"),
    }
}
