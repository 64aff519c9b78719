//! Prometheus metric names (one module) and the registry helpers every rngd-pd server uses
