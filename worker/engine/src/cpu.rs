//! The CPU backend: a [`Model`] driven by one scheduler thread.
//!
//! All compute runs on the scheduler thread (candle's matmuls spread over its
//! own worker pool). Each turn of its loop it admits waiting decode streams
//! into free slots (up to `batch`), computes one chunk of the prefill in
//! progress (starting the next waiting one if none is), then steps every
//! running stream by one token in a single batched forward. A chunk is the
//! per-iteration token budget (`max_num_batched_tokens`) less the decode
//! step's tokens (`cpu/prefill.rs`), so a long prompt shares many iterations with
//! the running streams instead of stalling them for its whole length; without
//! a budget (the default) the chunk is the whole prompt.
//! Prefill chunks and decode steps alternate, so neither starves the other.
//! When every projection takes the int8 kernel for prefill rows too (the
//! default on a model whose int8 blocks hold its weights exactly), the chunk
//! and the decode step are one forward (a mixed batch, as vLLM schedules
//! them): the streams wait for one pass over the weights, not two, and each
//! row computes exactly as it would alone. Under a budget, the prefills
//! waiting behind the one in progress then join that forward whole while
//! their rows fit it (packed prefills, `cpu/prefill.rs`).
//! A stream whose receiver was dropped is cancelled before the next step and
//! its slot freed; a prefill whose requester is gone, before its next chunk.
//!
//! [`Engine::generate`] is [`Engine::prefill`] followed by [`Engine::decode`]
//! of the exported bf16 cache, exactly what a prefill/decode split does across
//! two workers, so both give the same tokens by construction.
//!
//! The prefix cache ([`crate::prefix`]): a prefill copies the longest cached
//! run of its prompt's full blocks into its sequence cache and computes the
//! rest (always the last prompt token, whose logits pick the first token),
//! then keeps its full blocks; a decode stream keeps the full blocks of
//! prompt and generated tokens when it ends, so the next turn of a
//! conversation prefilled here hits.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Instant;

use rngd_kv_wire::{Dtype, KvLayout, KvSink};
use tokio::sync::{mpsc, oneshot};

use crate::kv::SeqCache;
use crate::prefix::{PrefixCache, PrefixCacheOptions, PrefixCacheStats, PrefixEventSink};
use stream::Stream;

mod prefill;
pub use prefill::MAX_PACKED_PREFILLS;
mod reload;
mod stream;
pub use crate::dense::PrefillProjections;
use crate::model::{Model, SeqStep};
use crate::sampling::sample;
use crate::tokenizer::Tokenizer;
use crate::{
    Engine, EngineError, FinishReason, GenEvent, ModelInfo, Prefilled, SamplingParams,
    check_context,
};

/// How to load a [`CpuEngine`].
#[derive(Debug, Clone)]
pub struct CpuEngineOptions {
    /// GGUF file of a Llama-architecture model.
    pub model_path: PathBuf,
    /// Compiled context length `S` (positions per sequence); default 512.
    pub seq_len: usize,
    /// Decode streams stepped together; default 8.
    pub batch: usize,
    /// Compute threads of the decode matmuls (the engine's own pool).
    /// `None` = candle's count. candle's f32 prefill GEMM is sized once per
    /// process from `CANDLE_NUM_THREADS` / `RAYON_NUM_THREADS` (default: all
    /// cores); a value here that differs is reported in the log.
    pub threads: Option<usize>,
    /// The kernel of prefills' projections (`--prefill-projections`):
    /// default [`PrefillProjections::Auto`], the int8 kernel where its
    /// blocks hold the file's weights exactly, f32 copies elsewhere
    /// (measured: `docs/engine.md`, "Kernels").
    pub prefill_projections: PrefillProjections,
    /// `--chat-template` / `--served-model-name`; default: the file's own.
    pub tokenizer: crate::tokenizer::TokenizerOverrides,
    /// The prefix cache (default: on, blocks of 16, 256 MiB).
    pub prefix_cache: PrefixCacheOptions,
    /// Chunked prefill: the tokens one scheduler iteration computes at
    /// most, the decode step's and the prefills' together (a chunk of the
    /// one in progress, and the waiting ones packed beside it whole; vLLM's
    /// `max_num_batched_tokens`; at least [`MIN_ROWS`]). Default `None`: a
    /// prefill runs whole in one iteration (measured: `docs/engine.md`,
    /// "Chunked prefill").
    pub max_num_batched_tokens: Option<usize>,
}

/// The budget chunked prefill takes when none is given (measured:
/// `docs/engine.md`, "Chunked prefill").
pub const DEFAULT_MAX_NUM_BATCHED_TOKENS: usize = 128;

impl CpuEngineOptions {
    /// Defaults for a model file: S = 512, batch 8, prefill projections
    /// chosen per tensor, the
    /// prefix cache's defaults, prefills unchunked.
    pub fn new(model_path: impl Into<PathBuf>) -> Self {
        CpuEngineOptions {
            model_path: model_path.into(),
            seq_len: 512,
            batch: 8,
            threads: None,
            prefill_projections: PrefillProjections::Auto,
            tokenizer: Default::default(),
            prefix_cache: PrefixCacheOptions::default(),
            max_num_batched_tokens: None,
        }
    }
}

/// Threads candle's compute pools use in this process.
pub fn compute_threads() -> usize {
    candle_core::utils::get_num_threads()
}

/// Fewest prompt rows a prefill step computes (a warm prefill, a chunk),
/// unless the whole prompt is shorter (`cpu/prefill.rs`).
pub const MIN_ROWS: usize = 8;

struct PrefillJob {
    prompt: Vec<u32>,
    params: SamplingParams,
    /// Where the cache goes in place (`None`: into the answer's blobs).
    sink: Option<Box<dyn KvSink>>,
    reply: oneshot::Sender<Result<Prefilled, EngineError>>,
}

struct DecodeJob {
    /// The prompt (the penalties' history; empty when none is on).
    prompt: Vec<u32>,
    prefilled: Prefilled,
    params: SamplingParams,
    tx: mpsc::Sender<GenEvent>,
}

#[derive(Default)]
struct State {
    prefills: VecDeque<PrefillJob>,
    decodes: VecDeque<DecodeJob>,
    shutdown: bool,
}

struct Shared {
    /// The iteration observer, if one is attached.
    iterations: Mutex<Option<Arc<dyn crate::IterationObserver>>>,
    state: Mutex<State>,
    wake: Condvar,
    waiting: AtomicUsize,
    running: AtomicUsize,
    /// Blocks of `block_size` positions the running streams' caches hold
    /// (a partial block counts whole), for [`Engine::kv_usage`].
    used_blocks: AtomicUsize,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic on the scheduler thread poisons nothing we cannot read.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// [`Engine::waiting`] from the queues in `st` (held locked).
    fn publish_waiting(&self, st: &State) {
        self.waiting
            .store(st.prefills.len() + st.decodes.len(), Ordering::Relaxed);
    }
}

/// A Llama on the CPU with continuous batching. See the module docs.
pub struct CpuEngine {
    info: ModelInfo,
    /// The weights (the scheduler's too); a reload derives the next from them.
    model: Arc<Model>,
    /// Where the weights came from, for a reload; `None` for a model built
    /// in memory.
    source: Option<reload::Source>,
    tokenizer: Arc<Tokenizer>,
    shared: Arc<Shared>,
    batch: usize,
    /// Blocks the decode slots can hold: `batch × ⌈seq_len / block_size⌉`.
    total_blocks: usize,
    /// Whether its prefills pack into one forward (mixed batches under a
    /// budget; `cpu/prefill.rs`).
    packs: bool,
    prefix: Arc<Mutex<PrefixCache>>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for CpuEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuEngine")
            .field("info", &self.info)
            .finish()
    }
}

impl CpuEngine {
    /// Loads a GGUF model and starts the scheduler thread.
    pub fn load(opts: CpuEngineOptions) -> Result<Arc<CpuEngine>, EngineError> {
        let started = Instant::now();
        if opts.seq_len == 0 || opts.batch == 0 {
            return Err(EngineError::InvalidRequest(
                "seq_len and batch must be at least 1".into(),
            ));
        }
        check_budget(opts.max_num_batched_tokens)?;
        let (mut model, tokenizer) =
            Model::load_gguf(&opts.model_path, opts.seq_len, opts.prefill_projections)?;
        let (f32_projections, projections) = model.f32_prefill_projections();
        tracing::info!(
            choice = ?opts.prefill_projections,
            f32_projections,
            int8_projections = projections - f32_projections,
            "prefill projections"
        );
        let tokenizer = tokenizer.with_overrides(&opts.tokenizer)?;
        let candle_threads = candle_core::utils::get_num_threads();
        if let Some(t) = opts.threads {
            model.set_threads(t)?;
            if t != candle_threads {
                tracing::warn!(
                    requested = t,
                    candle_threads,
                    "prefill's f32 GEMM (candle) is sized by CANDLE_NUM_THREADS / RAYON_NUM_THREADS; set one of them"
                );
            }
        }
        tracing::info!(
            model = %opts.model_path.display(),
            name = tokenizer.model_name(),
            layers = model.cfg.layers,
            seq_len = opts.seq_len,
            batch = opts.batch,
            threads = model.threads(),
            candle_threads,
            weight_version = %model.weight_version,
            load_ms = started.elapsed().as_millis() as u64,
            "CPU engine loaded"
        );
        Self::start(
            model,
            tokenizer,
            opts.seq_len,
            opts.batch,
            &opts.prefix_cache,
            opts.max_num_batched_tokens,
            Some(reload::Source { opts: opts.clone() }),
        )
    }

    /// Starts an engine on an already-built model (the tiny test model uses this).
    pub(crate) fn start(
        model: Model,
        tokenizer: impl Into<Arc<Tokenizer>>,
        seq_len: usize,
        batch: usize,
        prefix_options: &PrefixCacheOptions,
        max_num_batched_tokens: Option<usize>,
        source: Option<reload::Source>,
    ) -> Result<Arc<CpuEngine>, EngineError> {
        check_budget(max_num_batched_tokens)?;
        let model = Arc::new(model);
        let tokenizer: Arc<Tokenizer> = tokenizer.into();
        let c = &model.cfg;
        let layout = KvLayout {
            layers: c.layers,
            kv_heads: c.kv_heads,
            head_dim: c.head_dim,
            seq_len,
            dtype: Dtype::Bf16,
        };
        let info = ModelInfo {
            name: tokenizer.model_name().to_string(),
            seq_len,
            kv_layout: layout,
            vocab_size: c.vocab,
            weight_version: model.weight_version.clone(),
        };
        // The model's identity in every block hash: its served name and the
        // cache layout (docs/engine.md, Prefix cache).
        let prefix = Arc::new(Mutex::new(PrefixCache::new(
            prefix_options,
            layout,
            &info.name,
        )));
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            wake: Condvar::new(),
            waiting: AtomicUsize::new(0),
            iterations: Mutex::new(None),
            running: AtomicUsize::new(0),
            used_blocks: AtomicUsize::new(0),
        });
        let block_size = prefix_options.block_size.max(1);
        let packs = model.mixes_prefill_and_decode() && max_num_batched_tokens.is_some();
        let scheduler = Scheduler {
            model: model.clone(),
            tokenizer: tokenizer.clone(),
            shared: shared.clone(),
            layout,
            slots: (0..batch).map(|_| None).collect(),
            caches: Vec::new(),
            spare: Vec::new(),
            partial: None,
            max_num_batched_tokens,
            prefix: prefix.clone(),
            block_size,
            mixed: model.mixes_prefill_and_decode(),
            packs,
        };
        let thread = std::thread::Builder::new()
            .name("rngd-engine".into())
            .spawn(move || scheduler.run())
            .map_err(|source| EngineError::Io {
                context: "spawning the engine thread".into(),
                source,
            })?;
        Ok(Arc::new(CpuEngine {
            info,
            model,
            source,
            tokenizer,
            shared,
            batch,
            total_blocks: batch * seq_len.div_ceil(block_size),
            packs,
            prefix,
            thread: Mutex::new(Some(thread)),
        }))
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// Whether a prefill chunk and the running streams' decode step share
    /// one forward (a mixed batch): when every projection takes the int8
    /// kernel for prefill rows too (`--prefill-projections auto` on a model
    /// whose int8 blocks hold its weights exactly, or `int8`).
    pub fn mixed_batches(&self) -> bool {
        self.model.mixes_prefill_and_decode()
    }

    /// Decode slots (the `batch` option).
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// How many of the loaded model's layer projections prefill on the f32
    /// GEMM, of how many ([`CpuEngineOptions::prefill_projections`] as
    /// resolved at load; the others take the int8 kernel).
    pub fn f32_prefill_projections(&self) -> (usize, usize) {
        self.model.f32_prefill_projections()
    }

    /// Queues a prefill (its cache into `sink` when given) and waits for it.
    async fn prefill_job(
        &self,
        prompt: &[u32],
        params: &SamplingParams,
        sink: Option<Box<dyn KvSink>>,
    ) -> Result<Prefilled, EngineError> {
        if prompt.is_empty() {
            return Err(EngineError::InvalidRequest("the prompt is empty".into()));
        }
        check_context(
            prompt.len().saturating_sub(params.resumed),
            params.max_tokens,
            self.info.seq_len,
        )?;
        let (reply, rx) = oneshot::channel();
        let job = PrefillJob {
            prompt: prompt.to_vec(),
            params: params.clone(),
            sink,
            reply,
        };
        self.submit(|st| st.prefills.push_back(job))?;
        rx.await.map_err(|_| EngineError::Stopped)?
    }

    fn submit(&self, f: impl FnOnce(&mut State)) -> Result<(), EngineError> {
        let mut st = self.shared.lock();
        if st.shutdown {
            return Err(EngineError::Stopped);
        }
        f(&mut st);
        self.shared.publish_waiting(&st);
        drop(st);
        self.shared.wake.notify_one();
        Ok(())
    }
}

impl Drop for CpuEngine {
    fn drop(&mut self) {
        self.shared.lock().shutdown = true;
        self.shared.wake.notify_all();
        if let Some(t) = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = t.join();
        }
    }
}

#[async_trait::async_trait]
impl Engine for CpuEngine {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn reload(&self, model: &std::path::Path) -> Result<crate::Reloaded, EngineError> {
        self.reload_from(model)
    }

    fn max_batch(&self) -> Option<usize> {
        Some(self.batch)
    }

    fn max_prefills(&self) -> usize {
        if self.packs { MAX_PACKED_PREFILLS } else { 1 }
    }

    fn model_flops_per_token(&self) -> Option<u64> {
        Some(2 * self.model.matmul_weights())
    }

    fn variant(&self, seq_len: usize, max_batch: usize) -> Result<Arc<dyn Engine>, EngineError> {
        let engine: Arc<dyn Engine> = self.variant_of(seq_len, max_batch)?;
        Ok(engine)
    }

    fn tokenize(&self, text: &str) -> Result<Vec<u32>, EngineError> {
        self.tokenizer.encode(text)
    }

    fn tokenize_within(
        &self,
        text: &str,
        limit: usize,
    ) -> Result<crate::tokenizer::Within, EngineError> {
        self.tokenizer.encode_within(text, limit)
    }

    fn detokenize(&self, ids: &[u32]) -> Result<String, EngineError> {
        self.tokenizer.decode(ids)
    }

    fn tokenizer_digest(&self) -> Option<&str> {
        Some(self.tokenizer.digest())
    }

    fn chat_prompt(
        &self,
        messages: &[(String, String)],
        opts: &rngd_api::chat::TemplateOptions,
    ) -> Result<String, EngineError> {
        self.tokenizer.chat_prompt(messages, opts)
    }

    async fn prefill(
        &self,
        prompt: &[u32],
        params: &SamplingParams,
    ) -> Result<Prefilled, EngineError> {
        self.prefill_job(prompt, params, None).await
    }

    async fn prefill_into(
        &self,
        prompt: &[u32],
        params: &SamplingParams,
        sink: Box<dyn KvSink>,
    ) -> Result<Prefilled, EngineError> {
        let shape = sink.shape();
        if shape.layout != self.info.kv_layout || shape.tokens != prompt.len() {
            return Err(EngineError::InvalidRequest(format!(
                "a KV sink for {} positions of {:?} does not fit a prompt of {} tokens on {:?}",
                shape.tokens,
                shape.layout,
                prompt.len(),
                self.info.kv_layout
            )));
        }
        self.prefill_job(prompt, params, Some(sink)).await
    }

    async fn decode(
        &self,
        prompt: &[u32],
        prefilled: Prefilled,
        params: &SamplingParams,
    ) -> Result<mpsc::Receiver<GenEvent>, EngineError> {
        check_context(
            prompt.len().saturating_sub(params.resumed),
            params.max_tokens,
            self.info.seq_len,
        )?;
        if prefilled.kv.tokens != prompt.len() {
            return Err(EngineError::InvalidRequest(format!(
                "the KV cache holds {} positions but the prompt has {} tokens",
                prefilled.kv.tokens,
                prompt.len()
            )));
        }
        if prefilled.kv.layout != self.info.kv_layout {
            return Err(EngineError::InvalidRequest(format!(
                "KV layout {:?} does not match this engine's {:?}",
                prefilled.kv.layout, self.info.kv_layout
            )));
        }
        if prefilled.first_token as usize >= self.info.vocab_size {
            return Err(EngineError::InvalidRequest(format!(
                "first token {} is outside the vocabulary",
                prefilled.first_token
            )));
        }
        // Room for every event, so the scheduler never waits on a slow reader.
        let (tx, rx) = mpsc::channel(params.max_tokens + 2);
        // The prompt is kept for the penalties and for the prefix cache
        // (the stream's blocks are named by its tokens).
        let keep = params.repetition_penalty != 1.0 || lock(&self.prefix).enabled();
        let job = DecodeJob {
            prompt: if keep { prompt.to_vec() } else { Vec::new() },
            prefilled,
            params: params.clone(),
            tx,
        };
        self.submit(|st| st.decodes.push_back(job))?;
        Ok(rx)
    }

    fn waiting(&self) -> usize {
        self.shared.waiting.load(Ordering::Relaxed)
    }

    fn running(&self) -> usize {
        self.shared.running.load(Ordering::Acquire)
    }

    /// As vLLM counts it: blocks held by running requests over the blocks
    /// there are (cached blocks no request uses are free, as in vLLM).
    fn kv_usage(&self) -> f64 {
        let used = self.shared.used_blocks.load(Ordering::Acquire);
        (used as f64 / self.total_blocks.max(1) as f64).min(1.0)
    }

    fn prefix_cache_stats(&self) -> Option<PrefixCacheStats> {
        Some(lock(&self.prefix).stats())
    }

    /// Every cached block goes (none is referenced by a running sequence: a
    /// hit copies its blocks into the sequence's own cache).
    fn reset_prefix_cache(&self) -> bool {
        let mut p = lock(&self.prefix);
        if !p.enabled() {
            return false;
        }
        p.reset();
        true
    }

    fn set_iteration_observer(&self, observer: Option<Arc<dyn crate::IterationObserver>>) -> bool {
        *self
            .shared
            .iterations
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = observer;
        true
    }

    fn set_prefix_events(&self, sink: Option<Arc<dyn PrefixEventSink>>) -> bool {
        let mut p = lock(&self.prefix);
        p.set_sink(sink);
        p.enabled()
    }
}

/// A usable per-iteration budget: none, or at least [`MIN_ROWS`].
fn check_budget(budget: Option<usize>) -> Result<(), EngineError> {
    match budget {
        Some(b) if b < MIN_ROWS => Err(EngineError::InvalidRequest(format!(
            "max_num_batched_tokens {b} is below the smallest prefill step, {MIN_ROWS} tokens"
        ))),
        _ => Ok(()),
    }
}

/// The prefix cache, even after a panic elsewhere (its state is valid
/// between calls).
fn lock(p: &Mutex<PrefixCache>) -> MutexGuard<'_, PrefixCache> {
    p.lock().unwrap_or_else(|e| e.into_inner())
}

struct Scheduler {
    model: Arc<Model>,
    tokenizer: Arc<Tokenizer>,
    shared: Arc<Shared>,
    layout: KvLayout,
    slots: Vec<Option<Stream>>,
    /// One cache per slot, allocated on first use and reused.
    caches: Vec<SeqCache>,
    /// Sequence caches of prefills that ended, reused by the next ones (at
    /// most [`prefill::MAX_PACKED_PREFILLS`]).
    spare: Vec<SeqCache>,
    /// The prefill in progress.
    partial: Option<prefill::Partial>,
    /// See [`CpuEngineOptions::max_num_batched_tokens`].
    max_num_batched_tokens: Option<usize>,
    prefix: Arc<Mutex<PrefixCache>>,
    /// Positions per block, for the block count of [`Shared::used_blocks`].
    block_size: usize,
    /// Whether a prefill chunk and the decode step share a forward: every
    /// projection of the model takes the int8 kernel, prefill rows too
    /// (`--prefill-projections`), so the rows of one never change the
    /// other's.
    mixed: bool,
    /// Whether waiting prefills pack beside the one in progress: `mixed`
    /// under a budget (`cpu/prefill.rs`).
    packs: bool,
}

impl Scheduler {
    fn run(mut self) {
        loop {
            let (admitted, prefill, packable) = {
                let mut st = self.shared.lock();
                loop {
                    if st.shutdown {
                        return;
                    }
                    let free = self.slots.iter().filter(|s| s.is_none()).count();
                    let take = free.min(st.decodes.len());
                    let admitted: Vec<DecodeJob> = st.decodes.drain(..take).collect();
                    let prefill = if self.partial.is_none() {
                        st.prefills.pop_front()
                    } else {
                        None
                    };
                    // The prefills that may pack beside it (`cpu/prefill.rs`);
                    // those that do not fit go back to the front.
                    let packable = if self.packs && (prefill.is_some() || self.partial.is_some()) {
                        let n = st.prefills.len().min(prefill::MAX_PACKED_PREFILLS - 1);
                        st.prefills.drain(..n).collect()
                    } else {
                        Vec::new()
                    };
                    let active = self.slots.iter().any(Option::is_some) || self.partial.is_some();
                    self.shared.publish_waiting(&st);
                    if !admitted.is_empty() || prefill.is_some() || active {
                        break (admitted, prefill, packable);
                    }
                    st = self.shared.wake.wait(st).unwrap_or_else(|p| p.into_inner());
                }
            };
            for job in admitted {
                self.admit(job);
            }
            if let Some(job) = prefill {
                self.begin_prefill(job);
            }
            self.publish_running();
            let decoding = self.slots.iter().filter(|s| s.is_some()).count();
            let (prefilled, decoded) = if self.mixed {
                self.mixed_iteration(decoding, packable)
            } else {
                (self.prefill_chunk(decoding), self.step())
            };
            self.publish_running();
            self.observe_iteration(prefilled + decoded);
        }
    }

    /// Tells the iteration observer (if any) what this turn computed.
    fn observe_iteration(&self, tokens: usize) {
        if tokens == 0 {
            return;
        }
        let observer = self
            .shared
            .iterations
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        if let Some(o) = observer {
            o.iteration(tokens);
        }
    }

    /// The running count and block usage of the decode streams. The
    /// prefill in progress is in neither (vLLM counts a chunked prefill as
    /// running; the routing policy's load signal is calibrated on decode
    /// slots, and changing it is left to a measured change of its own).
    fn publish_running(&self) {
        let n = self.slots.iter().filter(|s| s.is_some()).count();
        let used: usize = self
            .slots
            .iter()
            .zip(&self.caches)
            .filter(|(s, _)| s.is_some())
            .map(|(_, c)| c.tokens.div_ceil(self.block_size))
            .sum();
        // The blocks first: whoever sees the stream running sees its blocks.
        self.shared.used_blocks.store(used, Ordering::Release);
        self.shared.running.store(n, Ordering::Release);
    }

    fn admit(&mut self, job: DecodeJob) {
        let Some(slot) = self.slots.iter().position(Option::is_none) else {
            // Cannot happen: admission is bounded by free slots.
            let _ = job
                .tx
                .try_send(GenEvent::Error("no free decode slot".into()));
            return;
        };
        while self.caches.len() <= slot {
            self.caches.push(SeqCache::new(self.layout));
        }
        if let Err(e) = self.caches[slot].import(&job.prefilled.kv) {
            let _ = job.tx.try_send(GenEvent::Error(e.to_string()));
            return;
        }
        let first = job.prefilled.first_token;
        let mut stream = Stream::new(
            job.tx,
            job.params,
            job.prompt,
            first,
            job.prefilled.cached_tokens,
            &self.tokenizer,
        );
        if stream.params.max_tokens == 0 {
            stream.finish(FinishReason::Length, None);
            self.keep(slot, &stream);
            return;
        }
        // The first token (index 0) came from the prefill.
        let sampled = crate::sampling::Sampled {
            id: first,
            logprobs: job.prefilled.first_logprobs,
        };
        if stream.on_token(&self.tokenizer, sampled) {
            self.slots[slot] = Some(stream);
        } else {
            self.keep(slot, &stream);
        }
    }

    /// A finished (or cancelled) stream's full blocks, prompt and generated
    /// tokens, into the prefix cache.
    fn keep(&self, slot: usize, stream: &Stream) {
        let cache = &self.caches[slot];
        if stream.seq.len() < cache.tokens {
            // Only the prompt is known (the prefix cache was off when the
            // decode was submitted).
            return;
        }
        let mut prefix = lock(&self.prefix);
        if !prefix.enabled() {
            return;
        }
        let ids = &stream.seq[..cache.tokens];
        let salt = stream.params.cache_salt.as_deref();
        let hashes = prefix.hashes(ids, salt);
        prefix.store(ids, &hashes, cache, salt);
    }

    /// One decode step for every running stream, in a forward of its own;
    /// the streams it stepped.
    fn step(&mut self) -> usize {
        let inputs = self.begin_step();
        self.run_step(inputs)
    }

    /// The running streams' next step: cancels the streams whose client is
    /// gone, appends each running stream's last token to its sequence and
    /// returns the slots to step with their input token (empty: none runs).
    fn begin_step(&mut self) -> Vec<(usize, [u32; 1])> {
        for i in 0..self.slots.len() {
            if self.slots[i].as_ref().is_some_and(Stream::is_closed) {
                tracing::debug!("decode stream cancelled: receiver dropped");
                if let Some(s) = self.slots[i].take() {
                    self.keep(i, &s);
                }
            }
        }
        let mut inputs = Vec::new();
        for (i, slot) in self.slots.iter_mut().enumerate() {
            if let Some(s) = slot {
                s.seq.push(s.last);
                inputs.push((i, [s.last]));
            }
        }
        inputs
    }

    /// Steps `inputs` (from [`Self::begin_step`]) in a forward of their own.
    fn run_step(&mut self, inputs: Vec<(usize, [u32; 1])>) -> usize {
        if inputs.is_empty() {
            return 0;
        }
        let started = Instant::now();
        let result = {
            let mut steps = decode_steps(&mut self.caches, &inputs);
            self.model.forward(&mut steps, false)
        };
        tracing::trace!(
            streams = inputs.len(),
            ms = started.elapsed().as_secs_f64() * 1e3,
            "decode step"
        );
        match result {
            Ok(logits) => self.finish_step(&inputs, Ok(&logits)),
            Err(e) => self.finish_step(&inputs, Err(e)),
        }
    }

    /// After the step of `inputs` (`logits`: `[streams, vocab]`, or the
    /// error): samples each stream's next token and ends the streams that
    /// are done (every stream, with the error, when the step failed).
    fn finish_step(
        &mut self,
        inputs: &[(usize, [u32; 1])],
        logits: Result<&[f32], EngineError>,
    ) -> usize {
        let logits = match logits {
            Ok(l) => l,
            Err(e) => {
                tracing::error!(error = %e, "decode step failed");
                for (i, _) in inputs {
                    if let Some(s) = self.slots[*i].take() {
                        s.send(GenEvent::Error(e.to_string()));
                    }
                }
                return 0;
            }
        };
        let vocab = self.model.cfg.vocab;
        for ((i, _), logits) in inputs.iter().zip(logits.chunks_exact(vocab)) {
            let Some(stream) = self.slots[*i].as_mut() else {
                continue;
            };
            let s = sample(logits, &stream.params, stream.sampled, &stream.history);
            if !stream.on_token(&self.tokenizer, s)
                && let Some(done) = self.slots[*i].take()
            {
                self.keep(*i, &done);
            }
        }
        inputs.len()
    }

    /// One iteration whose prefill chunk and decode step share one forward
    /// (vLLM's mixed batch): the streams wait for one pass over the
    /// weights instead of two. The `packable` prefills that fit what the
    /// budget leaves join it whole (`cpu/prefill.rs`). Only when every
    /// projection takes the int8 kernel whatever the rows (`mixed`), so
    /// each row computes as it would alone, bit for bit. When the shared
    /// forward fails, each part runs alone, so one's error is never
    /// another's. Returns the prompt tokens and the streams it computed.
    fn mixed_iteration(&mut self, decoding: usize, packable: Vec<PrefillJob>) -> (usize, usize) {
        let chunk = self.next_chunk(decoding);
        let inputs = self.begin_step();
        let Some(chunk) = chunk else {
            self.requeue(packable);
            return (0, self.run_step(inputs));
        };
        let room = prefill::pack_room(self.max_num_batched_tokens, inputs.len() + chunk.rows);
        let mut chunks = vec![chunk];
        chunks.extend(self.pack(packable, room));
        if inputs.is_empty() && chunks.len() == 1 {
            let chunk = chunks.pop().expect("one chunk");
            return (self.run_chunk(chunk), 0);
        }
        let started = Instant::now();
        let result = {
            let mut steps = Vec::with_capacity(chunks.len() + inputs.len());
            steps.extend(chunks.iter_mut().map(prefill::Chunk::step));
            steps.extend(decode_steps(&mut self.caches, &inputs));
            self.model.forward(&mut steps, false)
        };
        tracing::trace!(
            prefills = chunks.len(),
            streams = inputs.len(),
            ms = started.elapsed().as_secs_f64() * 1e3,
            "mixed step"
        );
        match result {
            Ok(logits) => {
                let (firsts, rest) = logits.split_at(chunks.len() * self.model.cfg.vocab);
                let mut prefilled = 0;
                for (chunk, first) in chunks
                    .into_iter()
                    .zip(firsts.chunks_exact(self.model.cfg.vocab))
                {
                    prefilled += self.finish_chunk(chunk, Ok(first));
                }
                (prefilled, self.finish_step(&inputs, Ok(rest)))
            }
            Err(e) => {
                tracing::debug!(error = %e, "mixed step failed: each prefill and the decode apart");
                let mut prefilled = 0;
                for chunk in chunks {
                    prefilled += self.run_chunk(chunk);
                }
                (prefilled, self.run_step(inputs))
            }
        }
    }
}

/// The decode rows of a forward: each input's token into its slot's cache.
fn decode_steps<'a>(
    caches: &'a mut [SeqCache],
    inputs: &'a [(usize, [u32; 1])],
) -> Vec<SeqStep<'a>> {
    let mut caches: Vec<Option<&mut SeqCache>> = caches.iter_mut().map(Some).collect();
    inputs
        .iter()
        .filter_map(|(i, t)| {
            caches
                .get_mut(*i)
                .and_then(Option::take)
                .map(|cache| SeqStep { tokens: t, cache })
        })
        .collect()
}
