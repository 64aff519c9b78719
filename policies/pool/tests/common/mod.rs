//! Shared pieces of the pool crate's integration tests.

pub mod kube_api;
