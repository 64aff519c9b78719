//! `rngd-pd bench epp`: latency Envoy + the endpoint picker add over Envoy routing directly
