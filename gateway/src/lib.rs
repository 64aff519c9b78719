//! The OpenAI-compatible gateway: runs the policy, drives prefill, KV handoff and decode
