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
    Decision, PROP_ENDPOINTS, PROP_ENDPOINTS_VERSION, PROP_PROMPT_TOKENS, PdPolicy, PolicyConfig,
};

/// The module entry point (`_initialize`), registering the root context.
mod entry {
    use super::*;

    proxy_wasm::main! {{
        proxy_wasm::set_log_level(LogLevel::Info);
        proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> {
            Box::new(Root { policy: Rc::new(RefCell::new(PdPolicy::default())) })
        });
    }}
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

/// A property path (`rngd_pd.x` → `["rngd_pd", "x"]`) without splitting per call.
fn path(p: &'static str) -> Vec<&'static str> {
    match p.split_once('.') {
        Some((a, b)) => vec![a, b],
        None => vec![p],
    }
}

impl Request {
    fn decide_and_apply(&mut self, body: Option<&[u8]>) -> Action {
        self.decided = true;
        let subset = self.get_http_request_header(headers::DESTINATION_ENDPOINT_SUBSET);
        let prompt_tokens = self.get_property(path(PROP_PROMPT_TOKENS));
        // Only an absent body makes the policy estimate from content-length.
        let content_length = match body {
            Some(_) => None,
            None => self
                .get_http_request_header("content-length")
                .and_then(|v| v.trim().parse().ok()),
        };
        let decision = self.policy.borrow_mut().decide(
            subset.as_deref(),
            body,
            content_length,
            prompt_tokens.as_deref(),
            self.version.as_deref(),
            || self.get_property(path(PROP_ENDPOINTS)),
        );
        match decision {
            Decision::Route(route) => {
                if route.prefill.is_none() {
                    self.set_http_request_header(headers::PREFILLER_HOST_PORT, None);
                    self.set_http_request_header(headers::KV_TRANSPORT, None);
                }
                for (name, value) in &route.headers {
                    self.set_http_request_header(name, Some(value));
                }
                Action::Continue
            }
            Decision::Reject(local) => {
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
        self.version = self.get_property(path(PROP_ENDPOINTS_VERSION));
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
