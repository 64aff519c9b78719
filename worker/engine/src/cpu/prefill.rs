//! Prefills on the CPU engine's scheduler thread: the one in progress,
//! computed in chunks under a per-iteration token budget (vLLM's chunked
//! prefill and `max_num_batched_tokens`), and the short ones packed beside
//! it in the same forward.
//!
//! Prefills begin in arrival order. Each scheduler iteration computes one
//! chunk of the prefill in progress and steps the running decode streams
//! (in the same forward when the scheduler mixes them, `cpu.rs`), so a long
//! prompt no longer holds every running stream for its whole length. A
//! chunk is the budget less the tokens of this iteration's decode step,
//! never fewer than [`MIN_ROWS`] rows, and the rest of the prompt whenever
//! fewer than [`MIN_ROWS`] would be left for the next one.
//!
//! Under a budget, when the scheduler mixes (every projection on the int8
//! kernel), the prefills waiting behind it join that forward whole, in
//! arrival order, while their rows (the prompt less what the prefix cache
//! holds) fit what the budget leaves, at most [`MAX_PACKED_PREFILLS`] in
//! all, as vLLM fills its token budget: a burst of short prefills (the new
//! turns of cached conversations) is one pass over the weights and one
//! stall of the running streams instead of one each, and its requests'
//! second tokens are not held behind each other's prefills (measured:
//! `docs/engine.md`, "Packed prefills"). The first that does not fit waits
//! at the queue's front. Unchunked, a prefill has its forward to itself.
//! Prefills packed together do not see each other's blocks in the prefix
//! cache (each reads it when it begins).
//!
//! Chunked equals unchunked, and packed equals alone, bit for bit (first
//! token, log-probabilities, every KV value): each row's projections and
//! attention do not depend on the other rows of its step as long as a step
//! has at least [`MIN_ROWS`] rows (candle's f32 GEMM sums very few rows in
//! another order; the int8 kernel of a packed forward never does), the K/V
//! a row attends to is the same stored bf16 whichever step wrote it, and
//! the whole prompt keeps one projection path (dense for a prompt of more
//! than one token). The prefix cache's warm == cold rests on the same
//! facts.

use std::time::Instant;

use crate::kv::SeqCache;
use crate::model::SeqStep;
use crate::prefix::BlockHash;
use crate::sampling::{History, sample};
use crate::{EngineError, Prefilled};

use super::{MIN_ROWS, PrefillJob, Scheduler, lock};

/// Most prefills one forward computes (each holds a sequence cache of
/// its own while it runs): the one in progress and up to this many less one
/// packed beside it.
pub const MAX_PACKED_PREFILLS: usize = 8;

/// A prefill begun: its prompt partly in its own sequence cache.
pub(super) struct Partial {
    job: PrefillJob,
    /// The prompt's full-block hashes (empty with the prefix cache off).
    hashes: Vec<BlockHash>,
    /// Prompt tokens read from the prefix cache.
    cached: usize,
    /// Prompt tokens whose K/V is in `cache`.
    pub(super) done: usize,
    /// Its K/V so far (taken from the scheduler's spares, given back when
    /// the prefill ends).
    cache: SeqCache,
    started: Instant,
    span: tracing::Span,
}

/// What [`Scheduler::begin`] made of a prefill job.
pub(super) enum Begun {
    /// Started: the prefix cache's run is in its cache.
    Started(Partial),
    /// Its requester is gone; nothing started.
    Gone,
    /// More rows to compute than the room it was offered; nothing started.
    TooLong(PrefillJob),
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

/// Rows a forward of `used` rows (the decode step's and the first
/// prefill chunk's) leaves for whole prefills packed beside them: the
/// budget less `used`; none unchunked (`budget` `None`), where a prefill
/// has its forward to itself.
pub(super) fn pack_room(budget: Option<usize>, used: usize) -> usize {
    budget.map_or(0, |b| b.saturating_sub(used))
}

// === impl Scheduler (prefill) ===

impl Scheduler {
    /// Starts a prefill: the prefix cache's longest usable run into a
    /// sequence cache of its own. Nothing starts when its requester is gone,
    /// or when `room` is given and the rows left to compute exceed it (the
    /// job is handed back, the prefix cache untouched).
    pub(super) fn begin(&mut self, job: PrefillJob, room: Option<usize>) -> Begun {
        if job.reply.is_closed() {
            return Begun::Gone;
        }
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
        if let Some(room) = room {
            let hit = if prefix.enabled() {
                prefix.matched(&job.prompt, &hashes, most) * b
            } else {
                0
            };
            if n - hit > room {
                return Begun::TooLong(job);
            }
        }
        let mut cache = self
            .spare
            .pop()
            .unwrap_or_else(|| SeqCache::new(self.layout));
        cache.reset();
        let cached = if prefix.enabled() {
            prefix.load(&job.prompt, &hashes, most, &mut cache)
        } else {
            0
        };
        drop(prefix);
        let span = tracing::debug_span!("prefill", tokens = job.prompt.len(), cached);
        Begun::Started(Partial {
            job,
            hashes,
            cached,
            done: cached,
            cache,
            started: Instant::now(),
            span,
        })
    }

    /// Starts `job` as the prefill in progress (nothing when its requester
    /// is gone).
    pub(super) fn begin_prefill(&mut self, job: PrefillJob) {
        if let Begun::Started(p) = self.begin(job, None) {
            self.partial = Some(p);
        }
    }

    /// Begins, in arrival order, the `waiting` prefills whose whole rest
    /// fits in `room` rows together, and returns them as chunks to compute
    /// beside the prefill in progress. The first that does not fit goes
    /// back to the front of the queue with every one after it (order kept,
    /// none passed over).
    pub(super) fn pack(&mut self, waiting: Vec<PrefillJob>, mut room: usize) -> Vec<Chunk> {
        let mut chunks = Vec::new();
        let mut jobs = waiting.into_iter();
        while let Some(job) = jobs.next() {
            match self.begin(job, Some(room)) {
                Begun::Started(p) => {
                    let rows = p.job.prompt.len() - p.done;
                    room -= rows;
                    chunks.push(Chunk { p, rows });
                }
                Begun::Gone => {}
                Begun::TooLong(job) => {
                    self.requeue(std::iter::once(job).chain(jobs).collect());
                    break;
                }
            }
        }
        chunks
    }

    /// Puts `jobs` (taken from the queue's front, in order) back there.
    pub(super) fn requeue(&self, jobs: Vec<PrefillJob>) {
        if jobs.is_empty() {
            return;
        }
        let mut st = self.shared.lock();
        for job in jobs.into_iter().rev() {
            st.prefills.push_front(job);
        }
        self.shared.publish_waiting(&st);
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
    pub(super) fn run_chunk(&mut self, mut chunk: Chunk) -> usize {
        // The projections' path is the whole prompt's, so every chunk (and
        // a warm prefill) computes its rows as a cold one does.
        let dense = chunk.p.job.prompt.len() > 1;
        let logits = self.model.forward(&mut [chunk.step()], dense);
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
            self.spare.push(p.cache);
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
                self.spare.push(p.cache);
                return 0;
            }
        };
        let n = p.job.prompt.len();
        p.done += rows;
        if p.done < n {
            tracing::trace!(rows, done = p.done, "prefill chunk");
            self.partial = Some(p);
            return rows;
        }
        let Partial {
            mut job,
            hashes,
            cached,
            cache,
            started,
            ..
        } = p;
        let history = History::new(&job.prompt, &job.params, self.tokenizer.stop_ids());
        // Token `resumed` of the generation (0 unless it continues one).
        let first = sample(logits, &job.params, job.params.resumed as u64, &history);
        // With a sink the cache goes straight into it (the one copy) and
        // the answer carries no blobs.
        let kv = match job.sink.take() {
            Some(mut sink) => match cache.export_into(sink.as_mut()) {
                Ok(()) => cache.export_none(),
                Err(e) => {
                    let _ = job.reply.send(Err(e));
                    self.spare.push(cache);
                    return rows;
                }
            },
            None => cache.export(),
        };
        let done = Prefilled {
            first_token: first.id,
            first_logprobs: first.logprobs,
            kv,
            elapsed: started.elapsed(),
            cached_tokens: cached,
        };
        if !hashes.is_empty() {
            lock(&self.prefix).store(
                &job.prompt,
                &hashes,
                &cache,
                job.params.cache_salt.as_deref(),
            );
        }
        self.spare.push(cache);
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
    pub(super) rows: usize,
}

impl Chunk {
    /// The chunk's part of a forward, appending to its prefill's cache.
    pub(super) fn step(&mut self) -> SeqStep<'_> {
        let p = &mut self.p;
        let tokens = &p.job.prompt[p.done..p.done + self.rows];
        SeqStep {
            tokens,
            cache: &mut p.cache,
        }
    }
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

    #[test]
    fn packed_prefills_fill_what_the_budget_leaves_and_only_under_one() {
        assert_eq!(pack_room(Some(64), 31), 33);
        assert_eq!(pack_room(Some(64), 70), 0);
        assert_eq!(pack_room(None, 1), 0);
    }
}
