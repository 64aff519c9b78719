//! An answer whose decode worker died (or whose stream broke) moved to
//! another decode-capable worker, at most `--migration-limit` times.
//!
//! A stream continues: the new worker gets the prompt's token ids followed by
//! the tokens already streamed, with `kv_transfer_params.resumed_tokens`
//! saying how many of them are the answer's own, so it samples token `n` as
//! token `n` (the draw is a function of seed and index), counts them against
//! `max_tokens` and `min_tokens` and in the output penalties, and its prefix
//! cache makes the prompt's prefill cheap. The client's stream goes on with
//! no token lost or repeated; the doors rewrite the usage to the original
//! prompt. A whole answer is asked again from the start. The new worker is
//! the policy's pick among the healthy decode-capable endpoints other than
//! the one that failed; it serves the request whole (no remote prefill).

use std::sync::Arc;

use rngd_api::openai::{CompletionRequest, Prompt};
use rngd_api::pd::KvTransferParams;
use rngd_policy_core::Role;
use rngd_pool::{Held, PickRequest};

use super::upstream::send;
use crate::error::{ApiError, Stage};
use crate::state::Gateway;

/// What moving an answer needs: the request as first sent, its prompt's
/// token ids, and the moves left.
#[derive(Debug, Clone)]
pub(super) struct Resume {
    /// The request in the completion form the workers speak.
    pub(super) request: CompletionRequest,
    /// The prompt's token ids, as the engine sees them.
    pub(super) prompt_ids: Vec<u32>,
    /// The request id sent to the workers.
    pub(super) rid: String,
    /// Moves left (`--migration-limit` at the start).
    pub(super) left: u32,
}

/// The answer's new worker: its address, its response, and the request's
/// count on it.
pub(super) struct Moved {
    pub(super) address: String,
    pub(super) response: reqwest::Response,
    pub(super) held: Held,
}

impl Resume {
    /// A resume for `request` whose prompt is `prompt_ids` (taken, not
    /// copied: the request's own); `None` when the ids are unknown or
    /// migration is off.
    pub(super) fn new(
        gw: &Gateway,
        request: CompletionRequest,
        prompt_ids: Vec<u32>,
        rid: &str,
    ) -> Option<Self> {
        (gw.config.migration_limit > 0 && !prompt_ids.is_empty()).then(|| Resume {
            request,
            prompt_ids,
            rid: rid.to_string(),
            left: gw.config.migration_limit,
        })
    }

    /// Moves the answer off `failed`, which streamed `generated` so far:
    /// tries the policy's pick among the other healthy decode-capable
    /// endpoints until one answers or the moves run out. Counted in
    /// `rngd_pd_gateway_migrations_total{outcome}`.
    pub(super) async fn move_off(
        &mut self,
        gw: &Arc<Gateway>,
        failed: &str,
        generated: &[u32],
        why: &str,
    ) -> Option<Moved> {
        let mut failed = vec![failed.to_string()];
        while self.left > 0 {
            self.left -= 1;
            match self.try_once(gw, &failed, generated).await {
                Ok(m) => {
                    gw.metrics.count_migration("continued");
                    tracing::warn!(from = %failed[0], to = %m.address, streamed = generated.len(), %why, "answer moved to another decode worker");
                    return Some(m);
                }
                Err((address, e)) => {
                    tracing::warn!(error = %e, %why, "moving the answer failed");
                    failed.extend(address);
                }
            }
        }
        gw.metrics.count_migration("failed");
        None
    }

    async fn try_once(
        &self,
        gw: &Arc<Gateway>,
        failed: &[String],
        generated: &[u32],
    ) -> Result<Moved, (Option<String>, ApiError)> {
        let candidates: Vec<String> = gw
            .picker
            .endpoints()
            .snapshot()
            .iter()
            .filter(|e| e.healthy && matches!(e.role, Role::Decode | Role::Solo))
            .filter(|e| !failed.contains(&e.address))
            .map(|e| e.address.clone())
            .collect();
        if candidates.is_empty() {
            return Err((
                None,
                ApiError::Internal("no other healthy decode endpoint".into()),
            ));
        }
        let mut ids = self.prompt_ids.clone();
        ids.extend_from_slice(generated);
        let mut req = self.request.clone();
        req.prompt = Prompt::Tokens(ids.clone());
        // The prompt is the door's ids already: nothing to tokenize, so
        // nothing to send beside it.
        req.tokenized_prompt = None;
        req.kv_transfer_params = (!generated.is_empty()).then(|| KvTransferParams {
            resumed_tokens: u32::try_from(generated.len()).unwrap_or(u32::MAX),
            ..KvTransferParams::default()
        });
        // The policy sees what is left to generate (its context check).
        let mut seen = req.clone();
        seen.sampling.max_tokens = seen
            .sampling
            .max_tokens
            .map(|m| m.saturating_sub(generated.len() as u32).max(1));
        seen.kv_transfer_params = None;
        let body =
            serde_json::to_vec(&seen).map_err(|e| (None, ApiError::Internal(e.to_string())))?;
        let picked = gw
            .picker
            .pick_held(PickRequest {
                headers: vec![
                    (":method".into(), "POST".into()),
                    (":path".into(), "/v1/completions".into()),
                ],
                body,
                prompt_tokens: Some(ids.len()),
                subset: Some(candidates),
                cache_salt: req.sampling.cache_salt.clone(),
                prompt_ids: ids,
            })
            .await
            .map_err(|e| (None, ApiError::Policy(e)))?;
        let address = picked.route.decode;
        let response = send(
            gw,
            Stage::Decode,
            &address,
            &req,
            &self.rid,
            gw.config.decode_timeout,
        )
        .await
        .map_err(|e| (Some(address.clone()), e))?;
        Ok(Moved {
            address,
            response,
            held: picked.held,
        })
    }
}
