//! `rngd-pd bench policy`: policy decision cost in wasm against the same logic compiled natively
