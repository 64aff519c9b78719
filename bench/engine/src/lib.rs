//! `rngd-pd bench engine`: the CPU engine's prefill and decode timings (the llama.cpp comparison wraps it)
