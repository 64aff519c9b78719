//! Benchmark harnesses behind `rngd-pd bench`
