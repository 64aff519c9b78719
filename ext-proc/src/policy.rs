//! The wasm policy runtime (`rngd-policy-host`) as the picker's [`Decider`].

use std::sync::Arc;

use async_trait::async_trait;
use rngd_policy_core::Decision;
use rngd_policy_host::{PolicyRequest, PolicyRuntime};

use crate::ExtProcError;
use crate::picker::Decider;

/// Decides with a [`PolicyRuntime`] (hot-swappable module).
#[derive(Clone)]
pub struct RuntimeDecider(pub Arc<PolicyRuntime>);

impl std::fmt::Debug for RuntimeDecider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("RuntimeDecider").finish_non_exhaustive()
    }
}

#[async_trait]
impl Decider for RuntimeDecider {
    async fn decide(&self, req: PolicyRequest) -> Result<Decision, ExtProcError> {
        self.0.decide(req).await.map_err(|e| ExtProcError::Decide {
            status: e.http_status(),
            source: Box::new(e),
        })
    }
}
