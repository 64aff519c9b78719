//! Test policy: rejects every request with 418 so a module swap is visible to clients.

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root) });
}}

struct Root;

impl Context for Root {}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        true
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Teapot))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Teapot;

impl Context for Teapot {}

impl HttpContext for Teapot {
    fn on_http_request_headers(&mut self, _n: usize, _end_of_stream: bool) -> Action {
        self.send_http_response(
            418,
            vec![("content-type", "application/json")],
            Some(br#"{"error":{"message":"teapot policy","type":"teapot","param":null,"code":"teapot"}}"#),
        );
        Action::Pause
    }
}
