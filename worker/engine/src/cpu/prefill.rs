//! The prefill in progress on the CPU engine's scheduler thread, computed in
//! chunks under a per-iteration token budget (vLLM's chunked prefill and
//! `max_num_batched_tokens`).
//!
//! One prefill is in progress at a time, in arrival order. Each scheduler
//! iteration computes one chunk of it and steps the running decode streams
//! (in the same forward when the scheduler mixes them, `cpu.rs`), so a long
//! prompt no longer holds every running stream for its whole length. A
//! chunk is the budget less the tokens of this iteration's decode step,
//! never fewer than [`MIN_ROWS`] rows, and the rest of the prompt whenever
//! fewer than [`MIN_ROWS`] would be left for the next one.
//!
//! Chunked equals unchunked bit for bit (first token, log-probabilities,
//! every KV value): each row's projections and attention do not depend on
//! the other rows of its step as long as a step has at least [`MIN_ROWS`]
//! rows (candle's f32 GEMM sums very few rows in another order), the K/V a
//! row attends to is the same stored bf16 whichever step wrote it, and the
//! whole prompt keeps one projection path (dense for a prompt of more than
//! one token). The prefix cache's warm == cold rests on the same facts.

use std::time::Instant;

use crate::kv::SeqCache;
use crate::model::SeqStep;
use crate::prefix::BlockHash;
use crate::sampling::{History, sample};
use crate::{EngineError, Prefilled};

use super::{MIN_ROWS, PrefillJob, Scheduler, lock};

/// A prefill whose prompt is partly in the prefill cache.
pub(super) struct Partial {
    job: PrefillJob,
    /// The prompt's full-block hashes (empty with the prefix cache off).
    hashes: Vec<BlockHash>,
    /// Prompt tokens read from the prefix cache.
    cached: usize,
    /// Prompt tokens whose K/V is in the prefill cache.
    pub(super) done: usize,
    started: Instant,
    span: tracing::Span,
}

/// Rows of the next chunk: `rest` tokens are left, `budget` is the
/// iteration's token budget (`None`: unchunked) and `decoding` the streams
/// the same iteration steps.
pub(super) fn chunk_rows(rest: usize, budget: Option<usize>, decoding: usize) -> usize {
    let Some(budget) = budget else {
        return rest;
    };
    let rows = budget.saturating_sub(decoding).max(MIN_ROWS);
    if rest.saturating_sub(rows) < MIN_ROWS {
        rest
    } else {
        rows
    }
}

// === impl Scheduler (prefill) ===

impl Scheduler {
    /// Starts a prefill: the prefix cache's longest usable run into the
    /// prefill cache. Nothing starts when its requester is gone.
    pub(super) fn begin_prefill(&mut self, job: PrefillJob) {
        if job.reply.is_closed() {
            return;
        }
        let span = tracing::debug_span!("prefill", tokens = job.prompt.len());
        let cache = self
            .prefill_cache
            .get_or_insert_with(|| SeqCache::new(self.layout));
        cache.reset();
        let mut prefix = lock(&self.prefix);
        let hashes = if prefix.enabled() {
            prefix.hashes(&job.prompt, job.params.cache_salt.as_deref())
        } else {
            Vec::new()
        };
        // At least the last prompt token is computed: its logits pick the
        // first token. Never fewer than MIN_ROWS: the last cached block is
        // recomputed then, so warm == cold bit for bit.
        let (n, b) = (job.prompt.len(), prefix.block_size());
        let mut most = (n - 1) / b;
        while most > 0 && n - most * b < MIN_ROWS {
            most -= 1;
        }
        let cached = if prefix.enabled() {
            prefix.load(&job.prompt, &hashes, most, cache)
        } else {
            0
        };
        drop(prefix);
        self.partial = Some(Partial {
            job,
            hashes,
            cached,
            done: cached,
            started: Instant::now(),
            span,
        });
    }

    /// Computes the next chunk of the prefill in progress, if any, in a
    /// forward of its own; answers its requester after the last one.
    /// Returns the prompt tokens computed (0 when there is none, its
    /// requester is gone or it failed).
    pub(super) fn prefill_chunk(&mut self, decoding: usize) -> usize {
        match self.next_chunk(decoding) {
            Some(chunk) => self.run_chunk(chunk),
            None => 0,
        }
    }

    /// Computes `chunk` in a forward of its own; see [`Self::finish_chunk`].
    pub(super) fn run_chunk(&mut self, chunk: Chunk) -> usize {
        let logits = match self.prefill_cache.as_mut() {
            Some(cache) => {
                let step = chunk.step(cache);
                // The projections' path is the whole prompt's, so every
                // chunk (and a warm prefill) computes its rows as a cold
                // one does.
                let dense = chunk.p.job.prompt.len() > 1;
                self.model.forward(&mut [step], dense)
            }
            None => Err(gone()),
        };
        match logits {
            Ok(l) => self.finish_chunk(chunk, Ok(&l)),
            Err(e) => self.finish_chunk(chunk, Err(e)),
        }
    }

    /// The next chunk of the prefill in progress, taken out of `partial`:
    /// `None` when there is none or its requester is gone (then dropped).
    pub(super) fn next_chunk(&mut self, decoding: usize) -> Option<Chunk> {
        let p = self.partial.take()?;
        if p.job.reply.is_closed() {
            tracing::debug!(parent: &p.span, done = p.done, "prefill cancelled: requester gone");
            return None;
        }
        let rows = chunk_rows(
            p.job.prompt.len() - p.done,
            self.max_num_batched_tokens,
            decoding,
        );
        Some(Chunk { p, rows })
    }

    /// After `chunk`'s forward (`logits`: its last row's, or the error):
    /// puts the prefill back when rows are left, otherwise samples the
    /// first token, exports the cache and answers the requester. Returns
    /// the prompt tokens computed.
    pub(super) fn finish_chunk(
        &mut self,
        chunk: Chunk,
        logits: Result<&[f32], EngineError>,
    ) -> usize {
        let Chunk { mut p, rows } = chunk;
        let _g = p.span.clone().entered();
        let logits = match logits {
            Ok(l) => l,
            Err(e) => {
                let _ = p.job.reply.send(Err(e));
                return 0;
            }
        };
        let Some(cache) = self.prefill_cache.as_mut() else {
            let _ = p.job.reply.send(Err(gone()));
            return 0;
        };
        let n = p.job.prompt.len();
        p.done += rows;
        if p.done < n {
            tracing::trace!(rows, done = p.done, "prefill chunk");
            self.partial = Some(p);
            return rows;
        }
        let mut job = p.job;
        let history = History::new(&job.prompt, &job.params, self.tokenizer.stop_ids());
        let first = sample(logits, &job.params, 0, &history);
        // With a sink the cache goes straight into it (the one copy) and
        // the answer carries no blobs.
        let kv = match job.sink.take() {
            Some(mut sink) => match cache.export_into(sink.as_mut()) {
                Ok(()) => cache.export_none(),
                Err(e) => {
                    let _ = job.reply.send(Err(e));
                    return rows;
                }
            },
            None => cache.export(),
        };
        let done = Prefilled {
            first_token: first.id,
            first_logprobs: first.logprobs,
            kv,
            elapsed: p.started.elapsed(),
            cached_tokens: p.cached,
        };
        if !p.hashes.is_empty() {
            lock(&self.prefix).store(&job.prompt, &p.hashes, cache);
        }
        tracing::debug!(
            ms = done.elapsed.as_secs_f64() * 1e3,
            first_token = done.first_token,
            cached_tokens = done.cached_tokens,
            "prefill done"
        );
        let _ = job.reply.send(Ok(done));
        rows
    }
}

/// A prefill's next chunk: its rows are `p.job.prompt[p.done..p.done + rows]`.
pub(super) struct Chunk {
    p: Partial,
    rows: usize,
}

impl Chunk {
    /// The chunk's part of a forward, appending to the prefill cache.
    pub(super) fn step<'a>(&'a self, cache: &'a mut SeqCache) -> SeqStep<'a> {
        let tokens = &self.p.job.prompt[self.p.done..self.p.done + self.rows];
        SeqStep { tokens, cache }
    }
}

/// The error of a chunk whose prefill cache is missing (cannot happen: a
/// prefill begins by making it).
fn gone() -> EngineError {
    EngineError::InvalidRequest("the prefill cache is gone".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_follow_the_budget_less_the_decode_step() {
        // Unchunked: the whole rest.
        assert_eq!(chunk_rows(450, None, 8), 450);
        // The budget less one row per decoding stream.
        assert_eq!(chunk_rows(450, Some(128), 8), 120);
        assert_eq!(chunk_rows(450, Some(128), 0), 128);
        // Never fewer than MIN_ROWS, even when the decodes fill the budget.
        assert_eq!(chunk_rows(450, Some(16), 16), MIN_ROWS);
        // A tail shorter than MIN_ROWS joins this chunk.
        assert_eq!(chunk_rows(130, Some(128), 0), 130);
        assert_eq!(chunk_rows(128 + MIN_ROWS, Some(128), 0), 128);
        // A short rest is taken whole.
        assert_eq!(chunk_rows(5, Some(128), 0), 5);
    }
}
