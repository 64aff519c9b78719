//! The routing policy seen from the gateway: one trait, [`Policy`], with the
//! real implementation being the sandboxed wasm runtime of `rngd-policy-host`
//! and test fakes elsewhere.

use std::sync::Arc;

pub use rngd_policy_host::{Decision, Endpoint, LocalResponse, PolicyRequest, Route};

use crate::error::BoxError;

/// Decides where a request goes (or rejects it).
#[async_trait::async_trait]
pub trait Policy: Send + Sync + 'static {
    /// Runs the policy on one request.
    async fn decide(&self, req: PolicyRequest) -> Result<Decision, BoxError>;
}

#[async_trait::async_trait]
impl<P: Policy + ?Sized> Policy for Arc<P> {
    async fn decide(&self, req: PolicyRequest) -> Result<Decision, BoxError> {
        (**self).decide(req).await
    }
}

/// The real policy: a proxy-wasm module run sandboxed by `rngd-policy-host`.
#[async_trait::async_trait]
impl Policy for rngd_policy_host::PolicyRuntime {
    async fn decide(&self, req: PolicyRequest) -> Result<Decision, BoxError> {
        rngd_policy_host::PolicyRuntime::decide(self, req)
            .await
            .map_err(|e| Box::new(e) as BoxError)
    }
}
