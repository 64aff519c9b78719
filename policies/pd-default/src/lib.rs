//! The default PD routing policy as a proxy-wasm module
