//! `rngd-pd bench kv`: KV transport throughput against memcpy / raw TCP in the same run
