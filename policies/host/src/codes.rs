//! The numeric codes of the proxy-wasm ABI 0.2.1 this host speaks: status
//! codes, header map and buffer types. Shared by the wasm hostcalls, the
//! request state and a native run of a module (the policy benchmark's).

/// Status codes (`proxy_status_t`).
pub mod status {
    /// Success.
    pub const OK: u32 = 0;
    /// No such header, property or buffer.
    pub const NOT_FOUND: u32 = 1;
    /// An argument the host refuses (unknown map type, not UTF-8, too large).
    pub const BAD_ARGUMENT: u32 = 2;
    /// A pointer or length outside guest memory.
    pub const INVALID_MEMORY_ACCESS: u32 = 6;
    /// A compare-and-swap version that is not the current one.
    pub const CAS_MISMATCH: u32 = 8;
    /// The host could not complete the call.
    pub const INTERNAL_FAILURE: u32 = 10;
}

/// Header map type: the request headers.
pub const MAP_REQUEST_HEADERS: u32 = 0;
/// Buffer type: the request body.
pub const BUFFER_REQUEST_BODY: u32 = 0;
/// Buffer type: the VM configuration.
pub const BUFFER_VM_CONFIGURATION: u32 = 6;
/// Buffer type: the plugin configuration.
pub const BUFFER_PLUGIN_CONFIGURATION: u32 = 7;
