//! The worker sidecar: prefill / decode / solo roles over HTTP, the PD protocol and model-server metrics
