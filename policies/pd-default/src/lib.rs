//! The default PD routing policy as a proxy-wasm module: a thin adapter that
//! reads the request through the proxy-wasm ABI, runs
//! [`rngd_policy_core::PdPolicy`] and writes the decision back as request
//! headers or a local response (contract: `docs/policy-abi.md`).

use std::cell::RefCell;
use std::rc::Rc;

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel};
use rngd_api::headers;
use rngd_policy_core::{
    Outcome, PROP_ENDPOINTS_PATH, PROP_ENDPOINTS_VERSION_PATH, PROP_PREFIX_CACHE_PATH,
    PROP_PROMPT_TOKENS_PATH, PdPolicy, PolicyConfig, RequestProps,
};

pub mod heap;

/// The module entry point (`_initialize`), registering the root context.
mod entry {
    use super::*;

    proxy_wasm::main! {{
        proxy_wasm::set_log_level(LogLevel::Info);
        proxy_wasm::set_root_context(new_root);
    }}
}

fn new_root(_context_id: u32) -> Box<dyn RootContext> {
    Box::new(Root {
        policy: Rc::new(RefCell::new(PdPolicy::default())),
    })
}

/// Registers the root context on this thread without the wasm entry point's
/// logger and panic hook, which would take over a native process's. This is
/// how the module's code runs natively, in process, through the same
/// proxy-wasm lifecycle (the policy benchmark's baseline, like Envoy's null
/// VM); a wasm host calls `_initialize` instead.
#[cfg(not(target_family = "wasm"))]
pub fn register_native_root() {
    proxy_wasm::set_root_context(new_root);
}

/// The plugin: holds the configured policy and its snapshot cache.
struct Root {
    policy: Rc<RefCell<PdPolicy>>,
}

impl Context for Root {}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let bytes = self.get_plugin_configuration().unwrap_or_default();
        match PolicyConfig::from_json(&bytes) {
            Ok(config) => {
                *self.policy.borrow_mut() = PdPolicy::new(config);
                true
            }
            Err(e) => {
                proxy_wasm::hostcalls::log(LogLevel::Error, &format!("pd-default: {e}")).ok();
                false
            }
        }
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Request {
            policy: Rc::clone(&self.policy),
            decided: false,
            version: None,
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

/// One request.
struct Request {
    policy: Rc<RefCell<PdPolicy>>,
    /// Set once the decision was applied (a later body callback is ignored).
    decided: bool,
    /// `rngd_pd.endpoints_version`, read once in the headers callback.
    version: Option<Vec<u8>>,
}

#[link(wasm_import_module = "env")]
unsafe extern "C" {
    /// The ABI's property read (the SDK's `get_property` builds the path in a
    /// fresh allocation per call; the paths here are constants).
    fn proxy_get_property(
        path_data: *const u8,
        path_size: usize,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
    ) -> u32;
}

/// Reads a property by its NUL-joined path; `None` when absent (or on any
/// other status: the policy then behaves as without it).
fn property(path: &[u8]) -> Option<Vec<u8>> {
    let mut data: *mut u8 = std::ptr::null_mut();
    let mut size: usize = 0;
    // SAFETY: `path` is a live slice; the two out-pointers point to locals.
    let status = unsafe { proxy_get_property(path.as_ptr(), path.len(), &mut data, &mut size) };
    if status != 0 || data.is_null() {
        return None;
    }
    // SAFETY: on success the host returned `size` bytes it wrote into a block
    // it obtained from this module's exported allocator (`malloc` /
    // `proxy_on_memory_allocate`, a boxed slice of exactly `size` bytes), so
    // ownership of that block passes to us; the SDK takes it over the same way.
    Some(unsafe { Vec::from_raw_parts(data, size, size) })
}

impl Request {
    fn decide_and_apply(&mut self, body: Option<&[u8]>) -> Action {
        self.decided = true;
        let subset = self.get_http_request_header(headers::DESTINATION_ENDPOINT_SUBSET);
        let prompt_tokens = property(PROP_PROMPT_TOKENS_PATH);
        // Only an absent body makes the policy estimate from content-length.
        let content_length = match body {
            Some(_) => None,
            None => self
                .get_http_request_header("content-length")
                .and_then(|v| v.trim().parse().ok()),
        };
        let prefix_cache = property(PROP_PREFIX_CACHE_PATH);
        let ttft_goal = self.get_http_request_header(headers::SLO_TTFT_MS);
        let props = RequestProps {
            subset: subset.as_deref(),
            body,
            content_length,
            prompt_tokens: prompt_tokens.as_deref(),
            prefix_cache: prefix_cache.as_deref(),
            ttft_goal_ms: ttft_goal.as_deref(),
        };
        let mut policy = self.policy.borrow_mut();
        let outcome = policy.outcome(&props, self.version.as_deref(), || {
            property(PROP_ENDPOINTS_PATH)
        });
        match outcome {
            Outcome::Route(route) => {
                if route.prefill.is_none() {
                    self.set_http_request_header(headers::PREFILLER_HOST_PORT, None);
                    self.set_http_request_header(headers::KV_TRANSPORT, None);
                }
                // `headers()` ends with the reason, which replaces any a client sent.
                for (name, value) in route.headers() {
                    self.set_http_request_header(name, Some(value));
                }
                Action::Continue
            }
            Outcome::Reject(local) => {
                let hdrs: Vec<(&str, &str)> = local
                    .headers
                    .iter()
                    .map(|(k, v)| (k.as_str(), v.as_str()))
                    .collect();
                self.send_http_response(u32::from(local.status), hdrs, Some(&local.body));
                Action::Pause
            }
        }
    }
}

impl Context for Request {}

impl HttpContext for Request {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        self.version = property(PROP_ENDPOINTS_VERSION_PATH);
        if end_of_stream {
            self.decide_and_apply(Some(&[]))
        } else if self.version.is_some() {
            // An rngd-pd host (it passes a snapshot) delivers the whole body
            // next: hold the headers, the decision reads the body.
            Action::Pause
        } else {
            // Envoy's own wasm filter does not deliver the body to a filter
            // that paused its headers: decide now, estimating from content-length.
            self.decide_and_apply(None)
        }
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if self.decided {
            return Action::Continue;
        }
        if !end_of_stream {
            return Action::Pause;
        }
        let body = self.get_http_request_body(0, body_size).unwrap_or_default();
        self.decide_and_apply(Some(&body))
    }
}
