//! A misbehaving proxy-wasm module for sandbox tests (loops, memory bombs, bad pointers, panics)
