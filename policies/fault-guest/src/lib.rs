//! A misbehaving proxy-wasm module for sandbox tests (loops, memory bombs, bad
//! pointers, panics).
//!
//! The misbehaviour is chosen per request by the `x-fault` request header,
//! else by `{"fault": "..."}` in the plugin configuration, else `panic`:
//!
//! | mode | what the guest does |
//! |---|---|
//! | `none` | behaves: routes to `destination` from the configuration (default `127.0.0.9:9`) |
//! | `loop` | spins forever in `on_http_request_headers` |
//! | `memory_bomb` | allocates and leaks 1 MiB blocks until allocation fails |
//! | `bad_pointer` | calls host functions with out-of-bounds / wrapping pointers and lengths, then routes, reporting the statuses it got in `x-fault-statuses` |
//! | `huge_header` | asks the host to set a 4 MiB header value, reports the status, then routes |
//! | `panic` | panics (a wasm `unreachable` trap) |
//!
//! Configuration-time faults: `{"fault": "loop_on_configure"}` spins in
//! `proxy_on_configure`, `{"fault": "reject_configure"}` returns false from it.

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel};

/// The module entry point (`_initialize`), registering the root context.
mod entry {
    use super::*;

    proxy_wasm::main! {{
        proxy_wasm::set_log_level(LogLevel::Info);
        proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> {
            Box::new(Root { mode: "panic".to_string(), destination: "127.0.0.9:9".to_string() })
        });
    }}
}

#[link(wasm_import_module = "env")]
unsafe extern "C" {
    fn proxy_get_header_map_value(
        map_type: u32,
        key_data: *const u8,
        key_size: usize,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
    ) -> u32;
    fn proxy_get_property(
        path_data: *const u8,
        path_size: usize,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
    ) -> u32;
    fn proxy_replace_header_map_value(
        map_type: u32,
        key_data: *const u8,
        key_size: usize,
        value_data: *const u8,
        value_size: usize,
    ) -> u32;
    fn proxy_log(level: u32, message_data: *const u8, message_size: usize) -> u32;
}

struct Root {
    mode: String,
    destination: String,
}

impl Context for Root {}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let bytes = self.get_plugin_configuration().unwrap_or_default();
        let config: serde_json::Value =
            serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null);
        if let Some(m) = config.get("fault").and_then(|v| v.as_str()) {
            self.mode = m.to_string();
        }
        if let Some(d) = config.get("destination").and_then(|v| v.as_str()) {
            self.destination = d.to_string();
        }
        match self.mode.as_str() {
            "loop_on_configure" => spin(),
            "reject_configure" => false,
            _ => true,
        }
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Request {
            mode: self.mode.clone(),
            destination: self.destination.clone(),
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Request {
    mode: String,
    destination: String,
}

fn spin() -> ! {
    let mut x: u64 = 0;
    loop {
        x = std::hint::black_box(x.wrapping_add(1));
    }
}

/// Host calls with pointers no valid guest would pass; returns their statuses.
fn bad_pointer_calls() -> Vec<u32> {
    let key = b"x-fault";
    let mut out_ptr: *mut u8 = std::ptr::null_mut();
    let mut out_len: usize = 0;
    let far = 0xFFFF_FFF0usize as *const u8;
    let far_mut = 0xFFFF_FFF0usize as *mut *mut u8;
    let far_len = 0xFFFF_FFF0usize as *mut usize;
    // SAFETY: these are wasm imports; the host validates every pointer and
    // length against guest memory and writes nothing when they are invalid.
    // The out-pointers that are in bounds point at the locals above.
    unsafe {
        vec![
            // key outside memory
            proxy_get_header_map_value(0, far, 64, &mut out_ptr, &mut out_len),
            // key range wrapping around the address space
            proxy_get_header_map_value(0, key.as_ptr(), usize::MAX, &mut out_ptr, &mut out_len),
            // return slots outside memory
            proxy_get_header_map_value(0, key.as_ptr(), key.len(), far_mut, far_len),
            // property path outside memory
            proxy_get_property(far, 16, &mut out_ptr, &mut out_len),
            // unknown map type
            proxy_get_header_map_value(99, key.as_ptr(), key.len(), &mut out_ptr, &mut out_len),
            // log message outside memory
            proxy_log(2, far, 1 << 20),
        ]
    }
}

fn huge_header_call() -> u32 {
    let key = b"x-huge";
    let value = vec![b'v'; 4 << 20];
    // SAFETY: a wasm import; both ranges are live guest memory.
    unsafe {
        proxy_replace_header_map_value(0, key.as_ptr(), key.len(), value.as_ptr(), value.len())
    }
}

impl Context for Request {}

impl Request {
    fn route(&self, statuses: &[u32]) -> Action {
        if !statuses.is_empty() {
            let s: Vec<String> = statuses.iter().map(u32::to_string).collect();
            self.set_http_request_header("x-fault-statuses", Some(&s.join(",")));
        }
        self.set_http_request_header("x-gateway-destination-endpoint", Some(&self.destination));
        Action::Continue
    }
}

impl HttpContext for Request {
    fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        let mode = self
            .get_http_request_header("x-fault")
            .unwrap_or_else(|| self.mode.clone());
        match mode.as_str() {
            "none" => self.route(&[]),
            "loop" => spin(),
            "memory_bomb" => {
                let mut hoard: Vec<Vec<u8>> = Vec::new();
                loop {
                    let mut block = vec![0u8; 1 << 20];
                    block[0] = 1;
                    hoard.push(std::hint::black_box(block));
                }
            }
            "bad_pointer" => self.route(&bad_pointer_calls()),
            "huge_header" => self.route(&[huge_header_call()]),
            other => panic!("fault-guest: deliberate panic (mode {other})"),
        }
    }
}
