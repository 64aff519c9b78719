//! Envoy ext_proc endpoint picker (Gateway API Inference Extension) driven by the policy module
