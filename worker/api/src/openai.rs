//! OpenAI-compatible request, response and error bodies (`/v1/completions`,
//! `/v1/chat/completions`, `/v1/models`), shared by the gateway and the workers.
//!
//! Every field a request may carry is listed in `rules::fields` (checked by
//! `rules::parse_body` at every door): served, accepted only at its "off"
//! value (a 400 naming it otherwise), or informational (`user`, …). A field
//! in no list is a 400 naming it: nothing is silently ignored.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::pd::KvTransferParams;

/// `prompt` of a completion request: text or token ids.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    /// One text prompt.
    Text(String),
    /// A batch of text prompts (split into one request per prompt by
    /// `fanout`; a single-choice path sees a batch of one at most).
    TextBatch(Vec<String>),
    /// One prompt as token ids.
    Tokens(Vec<u32>),
    /// A batch of token-id prompts (split as [`Prompt::TextBatch`]).
    TokensBatch(Vec<Vec<u32>>),
}

/// `stop` of a request: one string or several.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    /// One stop sequence.
    One(String),
    /// Several stop sequences.
    Many(Vec<String>),
}

impl Stop {
    /// The stop sequences as a list.
    pub fn to_vec(&self) -> Vec<String> {
        match self {
            Stop::One(s) => vec![s.clone()],
            Stop::Many(v) => v.clone(),
        }
    }
}

/// `stream_options` of a streaming request.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StreamOptions {
    /// Send a final chunk with `usage`.
    #[serde(default)]
    pub include_usage: bool,
    /// With `include_usage`, every chunk also carries the usage so far
    /// (vLLM's extension); without it, nothing changes (as vLLM).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub continuous_usage_stats: bool,
}

// === impl StreamOptions ===

impl StreamOptions {
    /// Whether every chunk carries the usage so far: both flags set.
    pub fn continuous(&self) -> bool {
        self.include_usage && self.continuous_usage_stats
    }
}

/// Sampling fields common to completions and chat.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SamplingFields {
    /// Tokens to generate at most (default 16 for completions).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u32>,
    /// Softmax temperature; 0 = greedy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f32>,
    /// Nucleus sampling mass.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f32>,
    /// Top-k sampling (vLLM extension); -1, 0 or absent = off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_k: Option<i64>,
    /// Min-p sampling (vLLM extension), `[0, 1]`; 0 = off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_p: Option<f32>,
    /// Seed for sampling, any int64 (a negative one is taken as its
    /// two's-complement `u64`); absent: a fresh random seed per request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<i64>,
    /// OpenAI presence penalty, `[-2, 2]`, over the generated tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub presence_penalty: Option<f32>,
    /// OpenAI frequency penalty, `[-2, 2]`, over the generated tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frequency_penalty: Option<f32>,
    /// vLLM/HF repetition penalty, `(0, 2]`, over prompt + generated tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repetition_penalty: Option<f32>,
    /// Token id (a decimal string) → bias added to its logit, `[-100, 100]`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logit_bias: Option<BTreeMap<String, f32>>,
    /// Stop tokens are masked until this many tokens were generated (vLLM).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_tokens: Option<u32>,
    /// The model's own stop tokens do not stop the generation (vLLM).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ignore_eos: Option<bool>,
    /// More token ids that stop the generation (vLLM).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_token_ids: Option<Vec<u32>>,
    /// Stop sequences.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop: Option<Stop>,
    /// Stream as server-sent events.
    #[serde(default)]
    pub stream: bool,
    /// Streaming options.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream_options: Option<StreamOptions>,
    /// Number of choices (a door splits `n` > 1 into single-choice
    /// requests: `fanout`; a single-choice path refuses anything but 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub n: Option<u32>,
    /// vLLM's `cache_salt`: requests with different salts never share
    /// prefix-cache blocks (tenant isolation).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_salt: Option<String>,
    /// Leave special (control) tokens out of the answer's text (vLLM;
    /// default true). `false` writes them as their text (`<|im_end|>`), and
    /// stop sequences then see them too.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub skip_special_tokens: Option<bool>,
    /// vLLM's `spaces_between_special_tokens` (default true). Accepted as
    /// a boolean; with the byte-level BPE tokenizers this engine reads, the
    /// text is the same either way, as in vLLM's fast detokenizer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spaces_between_special_tokens: Option<bool>,
}

/// Body of `POST /v1/completions`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompletionRequest {
    /// Model name.
    pub model: String,
    /// The prompt.
    pub prompt: Prompt,
    /// Sampling and streaming fields.
    #[serde(flatten)]
    pub sampling: SamplingFields,
    /// Log-probabilities of each generated token with this many
    /// alternatives, 0..=20 (the legacy completions format).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<u32>,
    /// Prepend the prompt to the answer's text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub echo: Option<bool>,
    /// rngd-pd extension, set by a front door for a chat it serves as a
    /// completion: log-probabilities with this many alternatives, in the chat
    /// format (`{"content": [...]}`), so the answer turns back into a chat.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chat_logprobs: Option<u32>,
    /// PD protocol parameters (vLLM `kv_transfer_params`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_transfer_params: Option<KvTransferParams>,
    /// rngd-pd extension, set by a front door (a client's is refused
    /// there): the text prompt's token ids as the door made them, with its
    /// tokenizer's digest. A worker whose own digest is the same serves
    /// these ids instead of tokenizing the text again; any other worker
    /// tokenizes the text (docs/pd-protocol.md, "The door's token ids").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenized_prompt: Option<TokenizedPrompt>,
}

/// A prompt's token ids and the identity of the tokenizer that made them
/// (`CompletionRequest::tokenized_prompt`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenizedPrompt {
    /// The tokenizer's digest (16 hex digits: `rngd_engine`'s
    /// `Tokenizer::digest`, over vocabulary, merges, special tokens and
    /// chat template).
    pub digest: String,
    /// The prompt's token ids (of the chat rendered with the template, for
    /// a chat), special tokens as the worker would add them.
    pub ids: Vec<u32>,
}

/// One chat message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant` (or `tool`/`developer`, treated as text).
    pub role: String,
    /// Message text (a list of text parts is joined).
    pub content: ChatContent,
}

/// Content of a chat message: a string or a list of parts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ChatContent {
    /// Plain text.
    Text(String),
    /// Content parts; only `text` parts are served.
    Parts(Vec<ChatContentPart>),
}

/// One part of a multi-part message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatContentPart {
    /// Part type; only `text` is served.
    #[serde(rename = "type")]
    pub kind: String,
    /// The text of a `text` part.
    #[serde(default)]
    pub text: Option<String>,
}

impl ChatContent {
    /// The message as text, or an error naming the unsupported part type.
    pub fn text(&self) -> Result<String, String> {
        match self {
            ChatContent::Text(t) => Ok(t.clone()),
            ChatContent::Parts(parts) => {
                let mut out = String::new();
                for p in parts {
                    match (&*p.kind, &p.text) {
                        ("text", Some(t)) => out.push_str(t),
                        (kind, _) => {
                            return Err(format!("content part type '{kind}' is not supported"));
                        }
                    }
                }
                Ok(out)
            }
        }
    }
}

/// Body of `POST /v1/chat/completions`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatCompletionRequest {
    /// Model name.
    pub model: String,
    /// The conversation.
    pub messages: Vec<ChatMessage>,
    /// Newer name of `max_tokens`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_completion_tokens: Option<u32>,
    /// Answer each token's log-probability.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<bool>,
    /// With `logprobs`: this many alternatives per token, 0..=20.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_logprobs: Option<u32>,
    /// The template's `add_generation_prompt` (vLLM; default true): end
    /// the prompt with the assistant's turn header.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub add_generation_prompt: Option<bool>,
    /// Leave the final (assistant) message open so the model continues it
    /// (vLLM; default false; needs `add_generation_prompt: false`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub continue_final_message: Option<bool>,
    /// More variables for the chat template (vLLM's `chat_template_kwargs`,
    /// e.g. `{"enable_thinking": false}`); the names the template is
    /// already given are refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chat_template_kwargs: Option<serde_json::Map<String, serde_json::Value>>,
    /// Sampling and streaming fields.
    #[serde(flatten)]
    pub sampling: SamplingFields,
}

/// Token counts of a response.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// Tokens in the prompt.
    pub prompt_tokens: u32,
    /// Tokens generated.
    pub completion_tokens: u32,
    /// Sum of both.
    pub total_tokens: u32,
    /// Details of the prompt tokens (OpenAI's; `cached_tokens` from the
    /// engine's prefix cache).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_tokens_details: Option<PromptTokensDetails>,
}

/// `usage.prompt_tokens_details`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PromptTokensDetails {
    /// Prompt tokens whose KV came from the prefix cache (not computed).
    #[serde(default)]
    pub cached_tokens: u32,
}

impl Usage {
    /// Usage from the two counts.
    pub fn new(prompt_tokens: u32, completion_tokens: u32) -> Self {
        Usage {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
            prompt_tokens_details: None,
        }
    }

    /// This usage with `prompt_tokens_details.cached_tokens`.
    pub fn with_cached(mut self, cached_tokens: u32) -> Self {
        self.prompt_tokens_details = Some(PromptTokensDetails { cached_tokens });
        self
    }
}

/// Timings rngd-pd adds to a response (an extension field, ignored by OpenAI clients).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Timings {
    /// Time to first token, ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttft_ms: Option<f64>,
    /// Prefill compute, ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill_ms: Option<f64>,
    /// KV push (save) on the prefill side, ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_save_ms: Option<f64>,
    /// KV pull (load) on the decode side, ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_load_ms: Option<f64>,
    /// KV transfer as seen end to end (save + load), ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_transfer_ms: Option<f64>,
    /// Mean time per output token after the first, ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tpot_ms: Option<f64>,
    /// Whole request, ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total_ms: Option<f64>,
}

/// One choice of a completion response.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompletionChoice {
    /// Choice index (always 0).
    pub index: u32,
    /// Generated text (in a stream: this chunk's text).
    pub text: String,
    /// The tokens' log-probabilities when asked for (else null).
    pub logprobs: Option<ChoiceLogprobs>,
    /// `stop`, `length`, or null while streaming.
    pub finish_reason: Option<String>,
    /// vLLM's `stop_reason`: the stop token id or stop string that ended the
    /// generation (absent for EOS and length).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_reason: Option<serde_json::Value>,
    /// Generated token ids (extension; lets clients and tests compare tokens exactly).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
}

/// `logprobs` of a completion choice: the legacy completions format, or the
/// chat format when the request was a chat (`chat_logprobs`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ChoiceLogprobs {
    /// `{"content": [...]}`.
    Chat(ChatLogprobs),
    /// `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`.
    Completion(CompletionLogprobs),
}

/// OpenAI's legacy completions `logprobs`: one entry per generated token.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CompletionLogprobs {
    /// Each token's text.
    pub tokens: Vec<String>,
    /// Each token's log-probability.
    pub token_logprobs: Vec<Option<f32>>,
    /// Each token's top alternatives, text → log-probability (an
    /// alternative whose text repeats a likelier one's is listed once).
    pub top_logprobs: Vec<Option<BTreeMap<String, f32>>>,
    /// Where each token's text starts in `text` (bytes, UTF-8).
    pub text_offset: Vec<u32>,
}

/// OpenAI's chat `logprobs`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatLogprobs {
    /// One entry per generated token.
    pub content: Vec<ChatTokenLogprob>,
}

/// One token of chat `logprobs.content`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatTokenLogprob {
    /// The token's text.
    pub token: String,
    /// Its log-probability.
    pub logprob: f32,
    /// The UTF-8 bytes of `token`.
    pub bytes: Option<Vec<u8>>,
    /// The most likely tokens at this position, most likely first.
    pub top_logprobs: Vec<ChatTopLogprob>,
}

/// One alternative of [`ChatTokenLogprob::top_logprobs`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatTopLogprob {
    /// The token's text.
    pub token: String,
    /// Its log-probability.
    pub logprob: f32,
    /// The UTF-8 bytes of `token`.
    pub bytes: Option<Vec<u8>>,
}

/// Body of a completion response, or one streamed chunk (`object` differs only in chat).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompletionResponse {
    /// Response id.
    pub id: String,
    /// `text_completion`.
    pub object: String,
    /// Unix seconds.
    pub created: u64,
    /// Model name.
    pub model: String,
    /// The choices (one).
    pub choices: Vec<CompletionChoice>,
    /// Token counts (absent on intermediate stream chunks).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    /// PD protocol parameters returned by a prefill worker.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_transfer_params: Option<KvTransferParams>,
    /// rngd-pd timings (extension).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timings: Option<Timings>,
}

/// A chat message in a response.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatResponseMessage {
    /// `assistant`.
    pub role: String,
    /// Generated text.
    pub content: String,
}

/// One choice of a chat response.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatChoice {
    /// Choice index (always 0).
    pub index: u32,
    /// The message.
    pub message: ChatResponseMessage,
    /// The tokens' log-probabilities when asked for (else null).
    pub logprobs: Option<ChatLogprobs>,
    /// `stop` or `length`.
    pub finish_reason: Option<String>,
    /// vLLM's `stop_reason` (see [`CompletionChoice::stop_reason`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_reason: Option<serde_json::Value>,
}

/// Body of a chat completion response.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatCompletionResponse {
    /// Response id.
    pub id: String,
    /// `chat.completion`.
    pub object: String,
    /// Unix seconds.
    pub created: u64,
    /// Model name.
    pub model: String,
    /// The choices (one).
    pub choices: Vec<ChatChoice>,
    /// Token counts.
    pub usage: Usage,
    /// rngd-pd timings (extension).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timings: Option<Timings>,
}

/// The incremental part of a streamed chat chunk.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatDelta {
    /// `assistant` on the first chunk.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    /// New text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
}

/// One choice of a streamed chat chunk.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatChunkChoice {
    /// Choice index (always 0).
    pub index: u32,
    /// New content.
    pub delta: ChatDelta,
    /// This chunk's tokens' log-probabilities, when asked for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<ChatLogprobs>,
    /// Set on the last chunk.
    pub finish_reason: Option<String>,
    /// vLLM's `stop_reason`, on the last chunk.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_reason: Option<serde_json::Value>,
}

/// A streamed chat chunk (`chat.completion.chunk`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatCompletionChunk {
    /// Response id (same on every chunk).
    pub id: String,
    /// `chat.completion.chunk`.
    pub object: String,
    /// Unix seconds.
    pub created: u64,
    /// Model name.
    pub model: String,
    /// The choices (one; empty on a usage-only chunk).
    pub choices: Vec<ChatChunkChoice>,
    /// Token counts, on the usage chunk.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

/// One entry of `GET /v1/models`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Model {
    /// Model name.
    pub id: String,
    /// `model`.
    pub object: String,
    /// Unix seconds.
    pub created: u64,
    /// `rngd-pd`.
    pub owned_by: String,
    /// The model this name serves: its file's name (vLLM: the model path).
    #[serde(default)]
    pub root: Option<String>,
    /// The model this one was derived from; always null here (no adapters).
    #[serde(default)]
    pub parent: Option<String>,
    /// Compiled context length (vLLM's extension).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_model_len: Option<u32>,
    /// The identity of the weights a worker serves (rngd-pd extension; a
    /// worker shows it, the gateway, which holds no weights, does not).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight_version: Option<String>,
    /// The identity of the tokenizer and chat template a worker serves
    /// (rngd-pd extension: `Tokenizer::digest`, 16 hex digits; the one a
    /// door's `tokenized_prompt` must carry for the worker to use its ids).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer_digest: Option<String>,
    /// What a client may do with the model (vLLM's shape of OpenAI's
    /// retired field; clients written for vLLM read it).
    #[serde(default)]
    pub permission: Vec<ModelPermission>,
}

/// One entry of a model's `permission` list.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelPermission {
    /// `modelperm-` and the model name.
    pub id: String,
    /// `model_permission`.
    pub object: String,
    /// Unix seconds.
    pub created: u64,
    /// Whether a client may create engines from it (no).
    pub allow_create_engine: bool,
    /// Whether a client may sample from it (yes).
    pub allow_sampling: bool,
    /// Whether logprobs may be asked for (yes).
    pub allow_logprobs: bool,
    /// Whether search indices may be built (no).
    pub allow_search_indices: bool,
    /// Whether the model may be listed (yes).
    pub allow_view: bool,
    /// Whether it may be fine-tuned (no).
    pub allow_fine_tuning: bool,
    /// `*`.
    pub organization: String,
    /// Always null.
    pub group: Option<String>,
    /// Always false.
    pub is_blocking: bool,
}

// === impl ModelPermission ===

impl ModelPermission {
    /// The one permission every served model has: sample and view, nothing else.
    pub fn read_only(model: &str, created: u64) -> Self {
        ModelPermission {
            id: format!("modelperm-{model}"),
            object: "model_permission".into(),
            created,
            allow_create_engine: false,
            allow_sampling: true,
            allow_logprobs: true,
            allow_search_indices: false,
            allow_view: true,
            allow_fine_tuning: false,
            organization: "*".into(),
            group: None,
            is_blocking: false,
        }
    }
}

/// Body of `GET /v1/models`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelList {
    /// `list`.
    pub object: String,
    /// The models.
    pub data: Vec<Model>,
}

/// OpenAI error body: `{"error": {...}}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorBody {
    /// The error.
    pub error: ErrorDetail,
}

/// The inside of an OpenAI error body.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorDetail {
    /// Human-readable message.
    pub message: String,
    /// `invalid_request_error`, `not_found_error`, `server_error`, …
    #[serde(rename = "type")]
    pub kind: String,
    /// Offending parameter, if one.
    pub param: Option<String>,
    /// Machine-readable code (e.g. `context_length_exceeded`).
    pub code: Option<String>,
}

impl ErrorBody {
    /// An error body.
    pub fn new(kind: &str, message: impl Into<String>) -> Self {
        ErrorBody {
            error: ErrorDetail {
                message: message.into(),
                kind: kind.to_string(),
                param: None,
                code: None,
            },
        }
    }

    /// Sets `param`.
    pub fn with_param(mut self, param: &str) -> Self {
        self.error.param = Some(param.to_string());
        self
    }

    /// Sets `code`.
    pub fn with_code(mut self, code: &str) -> Self {
        self.error.code = Some(code.to_string());
        self
    }

    /// The OpenAI error type for an HTTP status.
    pub fn kind_for_status(status: u16) -> &'static str {
        match status {
            400 | 409 | 410 | 413 | 422 => "invalid_request_error",
            401 | 403 => "authentication_error",
            404 => "not_found_error",
            429 => "rate_limit_error",
            504 => "timeout_error",
            _ => "server_error",
        }
    }
}

/// The message for a prompt that does not fit the compiled context length.
/// Every component that refuses one uses this text.
pub fn context_length_message(prompt_tokens: usize, max_tokens: usize, seq_len: usize) -> String {
    format!(
        "prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) = {} exceeds the compiled context length of {seq_len} tokens",
        prompt_tokens + max_tokens
    )
}

/// `max_tokens` of a completion that sets none (OpenAI's default).
pub const DEFAULT_MAX_TOKENS: u32 = 16;

/// Error code used with [`context_length_message`].
pub const CONTEXT_LENGTH_CODE: &str = "context_length_exceeded";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_openai_client_body() {
        let body = r#"{"model":"m","prompt":"hi","max_tokens":5,"temperature":0,"stream":true,"user":"x",
            "stream_options":{"include_usage":true},"stop":["\n"]}"#;
        let req: CompletionRequest = serde_json::from_str(body).unwrap();
        assert_eq!(req.prompt, Prompt::Text("hi".into()));
        assert_eq!(req.sampling.max_tokens, Some(5));
        assert!(req.sampling.stream);
        assert_eq!(req.sampling.stop.unwrap().to_vec(), vec!["\n".to_string()]);
    }

    #[test]
    fn token_prompts_parse() {
        let req: CompletionRequest =
            serde_json::from_str(r#"{"model":"m","prompt":[1,2,3]}"#).unwrap();
        assert_eq!(req.prompt, Prompt::Tokens(vec![1, 2, 3]));
    }

    #[test]
    fn message_names_the_numbers() {
        let m = context_length_message(500, 20, 512);
        assert!(m.contains("500") && m.contains("20") && m.contains("520") && m.contains("512"));
    }
}
