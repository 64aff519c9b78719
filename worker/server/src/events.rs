//! The bridge from the engine's prefix cache to the KV-event publisher: each
//! [`PrefixEvent`] becomes the vLLM event of the same meaning
//! (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`) on the worker's
//! `--kv-events-config` publisher.

use std::sync::Arc;

use rngd_engine::prefix::{PrefixEvent, PrefixEventSink};
use rngd_kv_events::KvEventPublisher;

/// Publishes the prefix cache's events.
#[derive(Debug, Clone)]
pub struct PublisherSink(pub Arc<KvEventPublisher>);

// === impl PublisherSink ===

impl PrefixEventSink for PublisherSink {
    fn publish(&self, event: PrefixEvent) {
        match event {
            PrefixEvent::BlockStored {
                hashes,
                parent,
                token_ids,
                block_size,
                salt,
            } => self.0.stored_salted(
                hashes,
                parent,
                token_ids,
                u32::try_from(block_size).unwrap_or(u32::MAX),
                salt,
            ),
            PrefixEvent::BlockRemoved { hashes } => self.0.removed(hashes),
            PrefixEvent::AllCleared => self.0.all_cleared(),
        }
    }
}
