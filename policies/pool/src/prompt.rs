//! What a request will cost the engine: [`PromptCounter`] (the model's own
//! tokenizer and chat template, from `rngd-engine`) and [`prepare`], the one
//! function both front doors turn a client body into a validated request,
//! its prompt's token ids and their count with. The gateway and the picker
//! therefore count exactly what the worker's engine will see, chat included.
//!
//! Length before tokens: a prompt whose byte length proves it cannot fit the
//! context is refused before it is tokenized, and no prompt is tokenized past
//! the context (`Tokenizer::encode_within`).

use std::path::Path;
use std::sync::Arc;

use rngd_api::models::{ModelNotFound, ServedModels};
use rngd_api::openai::{ChatCompletionRequest, CompletionRequest, Prompt, StreamOptions};
use rngd_api::rules::{self, RuleError};
pub use rngd_engine::tokenizer::{TokenizerOverrides, Within};

use crate::{BoxError, PoolError};

/// What the front doors need from the model's tokenizer.
pub trait PromptCounter: Send + Sync + 'static {
    /// The model name served in the API.
    fn model_name(&self) -> &str;
    /// The token ids `text` encodes to.
    fn tokenize(&self, text: &str) -> Result<Vec<u32>, BoxError>;
    /// [`PromptCounter::tokenize`] for a text of use only with at most
    /// `limit` tokens: a counter with a bound of bytes per token refuses a
    /// longer text without tokenizing it whole; this default tokenizes it
    /// and compares.
    fn tokenize_within(&self, text: &str, limit: usize) -> Result<Within, BoxError> {
        let ids = self.tokenize(text)?;
        Ok(if ids.len() > limit {
            Within::TooLong {
                at_least: ids.len(),
                tokenized_bytes: text.len(),
            }
        } else {
            Within::Ids(ids)
        })
    }
    /// The context length the model was trained for, if the counter knows
    /// it: the bound [`prepare`] tokenizes up to when the door gives none.
    fn max_context(&self) -> Option<u32> {
        None
    }
    /// The number of token ids the tokenizer knows, if the counter knows
    /// it: [`prepare`] refuses a prompt of ids past it (`param` `prompt`).
    fn vocab_size(&self) -> Option<usize> {
        None
    }
    /// The identity of the tokenizer and chat template
    /// (`rngd_engine::tokenizer::Tokenizer::digest`), if the counter has
    /// one: [`prepare`] sends the prompt's ids upstream with it
    /// (`tokenized_prompt`), for a worker with the same digest to use
    /// instead of tokenizing the text again. `None` (a test counter whose
    /// ids are placeholders): nothing is sent.
    fn digest(&self) -> Option<&str> {
        None
    }
    /// Number of tokens `text` encodes to.
    fn count(&self, text: &str) -> Result<usize, BoxError> {
        Ok(self.tokenize(text)?.len())
    }
    /// Renders a chat with the model's template as `opts` ask (by default
    /// with the generation prompt).
    fn chat_prompt(
        &self,
        messages: &[(String, String)],
        opts: &rngd_api::chat::TemplateOptions,
    ) -> Result<String, BoxError>;
}

/// The real counter: the tokenizer and chat template the engine itself uses,
/// built from the GGUF's metadata by `rngd-engine` (no weights loaded).
impl PromptCounter for rngd_engine::tokenizer::Tokenizer {
    fn model_name(&self) -> &str {
        rngd_engine::tokenizer::Tokenizer::model_name(self)
    }

    fn tokenize(&self, text: &str) -> Result<Vec<u32>, BoxError> {
        Ok(self.encode(text)?)
    }

    fn tokenize_within(&self, text: &str, limit: usize) -> Result<Within, BoxError> {
        Ok(self.encode_within(text, limit)?)
    }

    fn max_context(&self) -> Option<u32> {
        rngd_engine::tokenizer::Tokenizer::context_length(self)
    }

    fn vocab_size(&self) -> Option<usize> {
        Some(rngd_engine::tokenizer::Tokenizer::vocab_size(self))
    }

    fn digest(&self) -> Option<&str> {
        Some(rngd_engine::tokenizer::Tokenizer::digest(self))
    }

    fn chat_prompt(
        &self,
        messages: &[(String, String)],
        opts: &rngd_api::chat::TemplateOptions,
    ) -> Result<String, BoxError> {
        Ok(rngd_engine::tokenizer::Tokenizer::chat_prompt(
            self, messages, opts,
        )?)
    }
}

/// Loads the tokenizer of a GGUF model file as a counter (blocking: call it
/// off the async threads).
pub fn gguf_counter(path: &Path) -> Result<Arc<dyn PromptCounter>, PoolError> {
    gguf_counter_with(path, &TokenizerOverrides::default())
}

/// [`gguf_counter`] with the user's `--chat-template` / `--served-model-name`
/// applied, as the worker's engine applies them.
pub fn gguf_counter_with(
    path: &Path,
    overrides: &TokenizerOverrides,
) -> Result<Arc<dyn PromptCounter>, PoolError> {
    let t = rngd_engine::tokenizer::Tokenizer::from_gguf(path)
        .and_then(|t| t.with_overrides(overrides))
        .map_err(|e| PoolError::Tokenizer {
            path: path.to_path_buf(),
            source: Box::new(e),
        })?;
    Ok(Arc::new(t))
}

/// One token per UTF-8 byte, the way `rngd_engine::fake::EchoEngine` counts:
/// the counter for tests and benchmarks that run on that fake engine.
#[cfg(feature = "test-util")]
#[derive(Debug, Clone, Copy, Default)]
pub struct ByteCounter;

#[cfg(feature = "test-util")]
impl PromptCounter for ByteCounter {
    fn model_name(&self) -> &str {
        "echo"
    }
    fn tokenize(&self, text: &str) -> Result<Vec<u32>, BoxError> {
        Ok(text.bytes().map(u32::from).collect())
    }
    /// One byte is one token: the length decides, nothing is tokenized
    /// past `limit`.
    fn tokenize_within(&self, text: &str, limit: usize) -> Result<Within, BoxError> {
        if text.len() > limit {
            return Ok(Within::TooLong {
                at_least: text.len(),
                tokenized_bytes: 0,
            });
        }
        Ok(Within::Ids(self.tokenize(text)?))
    }
    /// `role: content` lines, as the echo engine renders (options have no effect).
    fn chat_prompt(
        &self,
        messages: &[(String, String)],
        _opts: &rngd_api::chat::TemplateOptions,
    ) -> Result<String, BoxError> {
        Ok(messages
            .iter()
            .map(|(r, c)| format!("{r}: {c}\n"))
            .collect())
    }
}

/// Whitespace-separated words as tokens, a ChatML-like template and a
/// model name of the test's choosing: the counter for tests that need token
/// counts a reader can check by eye.
#[cfg(feature = "test-util")]
#[derive(Debug, Clone, Copy)]
pub struct WordCounter {
    /// The model name served.
    pub model: &'static str,
}

#[cfg(feature = "test-util")]
impl PromptCounter for WordCounter {
    fn model_name(&self) -> &str {
        self.model
    }
    /// Word `i` of the text is token id `i` (the counts are what matter).
    fn tokenize(&self, text: &str) -> Result<Vec<u32>, BoxError> {
        Ok((0..text.split_whitespace().count() as u32).collect())
    }
    /// The generation prompt only when `opts` ask for it.
    fn chat_prompt(
        &self,
        messages: &[(String, String)],
        opts: &rngd_api::chat::TemplateOptions,
    ) -> Result<String, BoxError> {
        let mut s = String::new();
        for (r, c) in messages {
            s.push_str(&format!("<|im_start|>{r} {c} <|im_end|> "));
        }
        if opts.add_generation_prompt {
            s.push_str("<|im_start|>assistant");
        }
        Ok(s)
    }
}

/// Which API a request is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApiKind {
    /// `/v1/completions`.
    Completion,
    /// `/v1/chat/completions` (rendered to a completion for the workers).
    Chat,
}

impl ApiKind {
    /// The API of a request path (query string ignored); `None` for others.
    pub fn from_path(path: &str) -> Option<ApiKind> {
        match path.split('?').next().unwrap_or("") {
            "/v1/completions" => Some(ApiKind::Completion),
            "/v1/chat/completions" => Some(ApiKind::Chat),
            _ => None,
        }
    }
}

/// Why [`prepare`] refused a body.
#[derive(Debug, thiserror::Error)]
pub enum PrepareError {
    /// A request rule is broken (400, with the rule's `param`).
    #[error(transparent)]
    Rule(#[from] RuleError),
    /// The request names a model this door does not serve (404
    /// `model_not_found`, naming the served ones).
    #[error(transparent)]
    ModelNotFound(#[from] ModelNotFound),
    /// The tokenizer or chat template failed on this prompt (400).
    #[error("tokenizing the prompt: {0}")]
    Tokenize(#[source] BoxError),
    /// Preparing the request panicked, or its blocking task was cancelled
    /// (500: a bug or a shutdown, not the client's request).
    #[error("preparing the prompt failed: {reason}")]
    Task {
        /// The panic's message, or why the task ended.
        reason: String,
    },
}

/// A validated client request, in the completion form the workers speak.
#[derive(Debug, Clone)]
pub struct Prepared {
    /// API called.
    pub kind: ApiKind,
    /// Model name as the client sent it.
    pub client_model: String,
    /// The completion request for the workers: one prompt (a chat rendered
    /// with the model's template), `max_tokens` set, and usage asked for on
    /// streams.
    pub upstream: CompletionRequest,
    /// Prompt tokens, counted as the engine will see them.
    pub prompt_tokens: usize,
    /// The prompt's token ids, as the engine will see them (the counter's
    /// ids; `WordCounter`'s are placeholders). A text prompt's also travel
    /// in `upstream.tokenized_prompt` when the counter has a digest.
    pub prompt_ids: Vec<u32>,
    /// Whether the client itself asked for a usage chunk on a stream.
    pub include_usage: bool,
}

fn completion(body: &[u8]) -> Result<CompletionRequest, RuleError> {
    let req: CompletionRequest = rules::parse_body(body)?;
    rules::check_completion(&req)?;
    if req.kv_transfer_params.is_some() {
        return Err(RuleError::param(
            "kv_transfer_params",
            "kv_transfer_params is set by the serving system, not by clients",
        ));
    }
    // The door's own ids travel there; a client's would be trusted upstream.
    if req.tokenized_prompt.is_some() {
        return Err(RuleError::param(
            "tokenized_prompt",
            "tokenized_prompt is set by the serving system, not by clients",
        ));
    }
    Ok(req)
}

fn chat(body: &[u8]) -> Result<ChatCompletionRequest, RuleError> {
    let req: ChatCompletionRequest = rules::parse_body(body)?;
    rules::check_chat(&req)?;
    Ok(req)
}

/// Applies every rule [`prepare`] applies, without counting the prompt (for
/// a door that runs without a tokenizer).
pub fn check(kind: ApiKind, body: &[u8]) -> Result<(), RuleError> {
    if let Some(split) = rngd_api::fanout::split(body, matches!(kind, ApiKind::Chat))? {
        return split
            .parts
            .iter()
            .step_by(split.n)
            .try_for_each(|part| check(kind, part));
    }
    match kind {
        ApiKind::Completion => completion(body).map(drop),
        ApiKind::Chat => chat(body).map(drop),
    }
}

/// Bodies up to this size are prepared on the calling async thread; longer
/// ones on tokio's blocking pool. Tokenizing measured ~0.19 ms per KiB of
/// text here (`rngd-pd-bench tokenize`, 200 texts of 1 KiB against 1), so a
/// body this small blocks its thread for well under 0.1 ms, less than the
/// two thread wake-ups a hop to the blocking pool and back costs on an idle
/// machine (docs/epp.md, "Where a streamed request's time goes").
pub const PREPARE_INLINE_BYTES: usize = 512;

/// [`prepare`] for an async door: inline for a body of at most
/// [`PREPARE_INLINE_BYTES`], else on the blocking pool (tokenizing a long
/// prompt is CPU work that would stall the door's other requests). A panic
/// in the tokenizer or template is [`PrepareError::Task`] either way, never
/// a lost connection.
pub async fn prepare_async<B>(
    kind: ApiKind,
    body: B,
    counter: Arc<dyn PromptCounter>,
    seq_len: Option<u32>,
    served: Option<Arc<ServedModels>>,
) -> Result<Prepared, PrepareError>
where
    B: AsRef<[u8]> + Send + 'static,
{
    let inline = body.as_ref().len() <= PREPARE_INLINE_BYTES;
    let run = move || {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            prepare(
                kind,
                body.as_ref(),
                counter.as_ref(),
                seq_len,
                served.as_deref(),
            )
        }))
        .map_err(|panic| PrepareError::Task {
            reason: panic_message(panic.as_ref()),
        })?
    };
    if inline {
        return run();
    }
    tokio::task::spawn_blocking(run)
        .await
        .map_err(|e| PrepareError::Task {
            reason: e.to_string(),
        })?
}

/// The text of a panic's payload (a `&str` or `String`, as `panic!` makes).
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_string())
}

/// Parses and validates a client body of `kind`, renders a chat with the
/// model's template and tokenizes the prompt.
///
/// `seq_len`: the compiled context a chat without `max_tokens` may fill
/// (OpenAI's chat default is "until the context is full"); `None` leaves
/// such a chat at the completion default.
///
/// Length before tokens: a prompt that provably has more tokens than the
/// context (`seq_len`, else the model's own trained context from the
/// counter) is the context-length 400 before it is tokenized whole (its
/// bytes prove it, or a bounded prefix does: `Tokenizer::encode_within`),
/// so no prompt is tokenized past the context.
///
/// A request with several choices ([`rngd_api::fanout`]) is checked part by
/// part; its first prompt stands for it, counted as its longest.
///
/// `served`: the model names this door serves; a request naming another is
/// [`PrepareError::ModelNotFound`] once its body parses, before its prompt
/// is rendered or tokenized. `None` accepts any model (a door that does not
/// know what its workers serve).
pub fn prepare(
    kind: ApiKind,
    body: &[u8],
    counter: &dyn PromptCounter,
    seq_len: Option<u32>,
    served: Option<&ServedModels>,
) -> Result<Prepared, PrepareError> {
    let check_model = |model: &str| match served {
        Some(s) => s.check(model).map_err(PrepareError::ModelNotFound),
        None => Ok(()),
    };
    // Several choices (`n > 1`, a prompt list): every prompt is checked as
    // its own request; the first stands for the request (the policy routes
    // on its ids) with the longest prompt's count (the context fit).
    let split =
        rngd_api::fanout::split(body, matches!(kind, ApiKind::Chat)).map_err(PrepareError::Rule)?;
    if let Some(split) = split {
        let mut first: Option<Prepared> = None;
        for part in split.parts.iter().step_by(split.n) {
            let p = prepare(kind, part, counter, seq_len, served)?;
            match &mut first {
                None => first = Some(p),
                Some(f) => f.prompt_tokens = f.prompt_tokens.max(p.prompt_tokens),
            }
        }
        if let Some(first) = first {
            return Ok(first);
        }
    }
    let context = seq_len.or_else(|| counter.max_context());
    let ids_of = |text: &str, max_tokens: Option<u32>| -> Result<Vec<u32>, PrepareError> {
        let Some(context) = context else {
            return counter.tokenize(text).map_err(PrepareError::Tokenize);
        };
        let within = counter
            .tokenize_within(text, context as usize)
            .map_err(PrepareError::Tokenize)?;
        match within {
            Within::Ids(ids) => Ok(ids),
            Within::TooLong { at_least, .. } => Err(PrepareError::Rule(rules::prompt_too_long(
                at_least,
                max_tokens.map(|m| m as usize),
                context as usize,
            ))),
        }
    };
    // Whether the prompt is text the worker would tokenize (then the door's
    // ids travel with it).
    let mut text_prompt = true;
    let (client_model, mut upstream, prompt_ids) = match kind {
        ApiKind::Completion => {
            let mut req = completion(body)?;
            check_model(&req.model)?;
            req.prompt = rules::single_prompt(&req.prompt)?;
            let max_tokens = rules::max_tokens_or_default(req.sampling.max_tokens);
            let ids = match &req.prompt {
                Prompt::Text(t) => ids_of(t, Some(max_tokens))?,
                Prompt::Tokens(t) => {
                    if let Some(vocab) = counter.vocab_size() {
                        rules::check_token_ids(t, vocab)?;
                    }
                    text_prompt = false;
                    t.clone()
                }
                Prompt::TextBatch(_) | Prompt::TokensBatch(_) => {
                    unreachable!("single_prompt unwraps batches")
                }
            };
            req.sampling.max_tokens = Some(max_tokens);
            (req.model.clone(), req, ids)
        }
        ApiKind::Chat => {
            let chat = chat(body)?;
            check_model(&chat.model)?;
            let messages = rules::chat_messages(&chat)?;
            let opts = rngd_api::chat::TemplateOptions::of(&chat);
            let prompt = counter
                .chat_prompt(&messages, &opts)
                .map_err(PrepareError::Tokenize)?;
            let ids = ids_of(&prompt, rngd_api::chat::requested_max_tokens(&chat))?;
            let upstream = rngd_api::chat::to_completion(&chat, prompt, ids.len(), seq_len);
            (chat.model, upstream, ids)
        }
    };
    // The door's ids, made by the tokenizer the digest names: a worker with
    // the same digest serves them as they are; one with another tokenizes
    // the text itself.
    if text_prompt && let Some(digest) = counter.digest() {
        upstream.tokenized_prompt = Some(rngd_api::openai::TokenizedPrompt {
            digest: digest.to_string(),
            ids: prompt_ids.clone(),
        });
    }
    // The front doors need token counts on streams: ask the worker for usage
    // and remember whether the client wanted it passed on.
    let s = &mut upstream.sampling;
    let include_usage = s.stream_options.as_ref().is_some_and(|o| o.include_usage);
    if s.stream {
        // Usage on every chunk only when the client asked for it.
        let continuous = s
            .stream_options
            .as_ref()
            .is_some_and(StreamOptions::continuous);
        s.stream_options = Some(StreamOptions {
            include_usage: true,
            continuous_usage_stats: continuous,
        });
    }
    Ok(Prepared {
        kind,
        client_model,
        upstream,
        prompt_tokens: prompt_ids.len(),
        prompt_ids,
        include_usage,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn completion_defaults_and_counts() {
        let p = prepare(
            ApiKind::Completion,
            br#"{"model":"m","prompt":["hello"],"stream":true}"#,
            &ByteCounter,
            Some(512),
            None,
        )
        .expect("prepared");
        assert_eq!(p.prompt_tokens, 5);
        assert_eq!(p.prompt_ids, b"hello".map(u32::from).to_vec());
        assert_eq!(p.upstream.prompt, Prompt::Text("hello".into()));
        assert_eq!(p.upstream.sampling.max_tokens, Some(16));
        assert!(!p.include_usage);
        assert!(p.upstream.sampling.stream_options.unwrap().include_usage);
        let p = prepare(
            ApiKind::Completion,
            br#"{"model":"m","prompt":[1,2,3]}"#,
            &ByteCounter,
            None,
            None,
        )
        .unwrap();
        assert_eq!(p.prompt_tokens, 3);
    }

    #[test]
    fn chat_is_rendered_with_the_template_and_fills_the_context() {
        let p = prepare(
            ApiKind::Chat,
            br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#,
            &ByteCounter,
            Some(100),
            None,
        )
        .unwrap();
        assert_eq!(p.upstream.prompt, Prompt::Text("user: hi\n".into()));
        assert_eq!(p.prompt_tokens, 9);
        assert_eq!(p.upstream.sampling.max_tokens, Some(91));
    }

    #[test]
    fn refusals_name_the_param() {
        for (kind, body, param) in [
            (
                ApiKind::Completion,
                &br#"{"model":"","prompt":"x"}"#[..],
                Some("model"),
            ),
            (
                ApiKind::Completion,
                br#"{"model":"m","prompt":"x","n":0}"#,
                Some("n"),
            ),
            (
                ApiKind::Completion,
                br#"{"model":"m","prompt":"x","kv_transfer_params":{"do_remote_prefill":true}}"#,
                Some("kv_transfer_params"),
            ),
            (
                ApiKind::Completion,
                br#"{"model":"m","prompt":"x","tokenized_prompt":{"digest":"0123456789abcdef","ids":[1]}}"#,
                Some("tokenized_prompt"),
            ),
            (
                ApiKind::Chat,
                br#"{"model":"m","messages":[]}"#,
                Some("messages"),
            ),
            (ApiKind::Chat, b"nope", None),
        ] {
            match prepare(kind, body, &ByteCounter, None, None) {
                Err(PrepareError::Rule(e)) => assert_eq!(e.param, param),
                other => panic!("{other:?}"),
            }
            assert_eq!(check(kind, body).unwrap_err().param, param);
        }
    }

    #[test]
    fn several_choices_stand_as_the_first_prompt_counted_as_the_longest() {
        let body = br#"{"model":"m","prompt":["ab","abcdef"],"n":2,"max_tokens":1}"#;
        let p = prepare(ApiKind::Completion, body, &ByteCounter, None, None).unwrap();
        assert_eq!(p.upstream.prompt, Prompt::Text("ab".into()));
        assert_eq!(p.prompt_ids.len(), 2);
        assert_eq!(p.prompt_tokens, 6);
        check(ApiKind::Completion, body).unwrap();
        // Every prompt is checked: an empty one refuses the request.
        let bad = br#"{"model":"m","prompt":["ab",""],"n":2}"#;
        assert!(prepare(ApiKind::Completion, bad, &ByteCounter, None, None).is_err());
        assert_eq!(
            check(ApiKind::Completion, bad).unwrap_err().param,
            Some("prompt")
        );
    }

    /// A counter whose tokens are 4 bytes at most, and which records how
    /// many bytes it was asked to tokenize (a door must not tokenize a
    /// prompt its bytes already refuse).
    struct Bounded {
        tokenized: std::sync::atomic::AtomicUsize,
    }

    impl PromptCounter for Bounded {
        fn model_name(&self) -> &str {
            "m"
        }
        fn tokenize(&self, text: &str) -> Result<Vec<u32>, BoxError> {
            self.tokenized
                .fetch_add(text.len(), std::sync::atomic::Ordering::Relaxed);
            Ok((0..text.len().div_ceil(4) as u32).collect())
        }
        fn tokenize_within(&self, text: &str, limit: usize) -> Result<Within, BoxError> {
            let at_least = text.len().div_ceil(4);
            if at_least > limit {
                return Ok(Within::TooLong {
                    at_least,
                    tokenized_bytes: 0,
                });
            }
            Ok(Within::Ids(self.tokenize(text)?))
        }
        fn max_context(&self) -> Option<u32> {
            Some(1000)
        }
        fn chat_prompt(
            &self,
            messages: &[(String, String)],
            opts: &rngd_api::chat::TemplateOptions,
        ) -> Result<String, BoxError> {
            ByteCounter.chat_prompt(messages, opts)
        }
    }

    #[test]
    fn a_prompt_too_long_by_its_bytes_is_refused_before_tokenizing() {
        let c = Bounded {
            tokenized: Default::default(),
        };
        let big = "x".repeat(1 << 20);
        for (kind, body, ctx) in [
            (
                ApiKind::Completion,
                serde_json::json!({"model":"m","prompt":big,"max_tokens":5}),
                Some(512),
            ),
            // No context from the door: the model's own (the counter's) bounds it.
            (
                ApiKind::Chat,
                serde_json::json!({"model":"m","messages":[{"role":"user","content":big}]}),
                None,
            ),
        ] {
            let body = serde_json::to_vec(&body).unwrap();
            match prepare(kind, &body, &c, ctx, None) {
                Err(PrepareError::Rule(e)) => {
                    assert_eq!(e.param, Some("max_tokens"));
                    assert_eq!(e.code, Some(rngd_api::openai::CONTEXT_LENGTH_CODE));
                    let want = ctx.unwrap_or(1000);
                    assert!(
                        e.message.contains("(at least 2621")
                            && e.message
                                .contains(&format!("context length of {want} tokens")),
                        "{}",
                        e.message
                    );
                }
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(c.tokenized.load(std::sync::atomic::Ordering::Relaxed), 0);
        // One that fits is tokenized, and its ids are kept.
        let p = prepare(
            ApiKind::Completion,
            br#"{"model":"m","prompt":"abcdefgh"}"#,
            &c,
            Some(512),
            None,
        )
        .unwrap();
        assert_eq!((p.prompt_tokens, p.prompt_ids.clone()), (2, vec![0, 1]));
        let p = prepare(
            ApiKind::Completion,
            br#"{"model":"m","prompt":[5,6,7]}"#,
            &c,
            Some(512),
            None,
        )
        .unwrap();
        assert_eq!(p.prompt_ids, vec![5, 6, 7]);
    }

    /// Panics on every text: a bug in a tokenizer or template.
    struct Panicking;
    impl PromptCounter for Panicking {
        fn model_name(&self) -> &str {
            "m"
        }
        fn tokenize(&self, _: &str) -> Result<Vec<u32>, BoxError> {
            panic!("tokenizer bug")
        }
        fn chat_prompt(
            &self,
            _: &[(String, String)],
            _: &rngd_api::chat::TemplateOptions,
        ) -> Result<String, BoxError> {
            panic!("template bug")
        }
    }

    fn completion_body(prompt_bytes: usize) -> Vec<u8> {
        format!(r#"{{"model":"m","prompt":"{}"}}"#, "a".repeat(prompt_bytes)).into_bytes()
    }

    #[tokio::test]
    async fn prepare_async_equals_prepare_inline_and_off_thread() {
        // One body under the inline limit, one over it: same answer as the
        // synchronous prepare either way.
        for n in [3, PREPARE_INLINE_BYTES] {
            let body = completion_body(n);
            let want = prepare(ApiKind::Completion, &body, &ByteCounter, Some(4096), None).unwrap();
            let got = prepare_async(
                ApiKind::Completion,
                body,
                Arc::new(ByteCounter),
                Some(4096),
                None,
            )
            .await
            .unwrap();
            assert_eq!(got.prompt_ids, want.prompt_ids, "{n} bytes");
            assert_eq!(got.prompt_tokens, n);
        }
        // Rule failures come back as the same rule error on both paths.
        for n in [3, PREPARE_INLINE_BYTES] {
            let e = prepare_async(
                ApiKind::Completion,
                completion_body(n),
                Arc::new(ByteCounter),
                Some(2),
                None,
            )
            .await
            .unwrap_err();
            assert!(matches!(e, PrepareError::Rule(_)), "{n} bytes: {e:?}");
        }
    }

    #[tokio::test]
    async fn a_panicking_tokenizer_is_a_task_error_on_both_paths() {
        for n in [3, PREPARE_INLINE_BYTES] {
            let e = prepare_async(
                ApiKind::Completion,
                completion_body(n),
                Arc::new(Panicking),
                None,
                None,
            )
            .await
            .unwrap_err();
            match e {
                PrepareError::Task { reason } => {
                    assert!(reason.contains("tokenizer bug"), "{reason}")
                }
                other => panic!("{n} bytes: {other:?}"),
            }
        }
    }

    /// A small byte-level ChatML tokenizer (control tokens `<|im_start|>`,
    /// `<|im_end|>`, a BOS it adds when `bos`), with the chat `template`
    /// (none: the ChatML fallback).
    fn chatml(bos: bool, template: Option<&str>) -> rngd_engine::tokenizer::Tokenizer {
        use rngd_engine::tokenizer::{PreTokenizer, Tokenizer, TokenizerParts};
        let mut tokens: Vec<String> = rngd_engine::tokenizer::bytes_to_unicode()
            .iter()
            .map(|c| c.to_string())
            .collect();
        let g = tokens[b' ' as usize].clone();
        tokens.extend(["he".to_string(), format!("{g}t"), format!("{g}the")]);
        tokens.extend(["<s>", "<|im_start|>", "<|im_end|>"].map(String::from));
        let mut token_types = vec![1; tokens.len()];
        for id in [259, 260, 261] {
            token_types[id] = 3;
        }
        Tokenizer::from_parts(TokenizerParts {
            model_name: "m".into(),
            tokens,
            merges: vec!["h e".into(), format!("{g} t"), format!("{g}t he")],
            pre: PreTokenizer::Smollm,
            token_types,
            eos_token_id: Some(261),
            bos_token_id: Some(259),
            add_bos: bos,
            add_eos: false,
            chat_template: template.map(String::from),
        })
        .expect("tokenizer")
    }

    /// Differential: the ids a door sends upstream are exactly the ones the
    /// worker makes of the same body (its chat rendered with
    /// `Tokenizer::chat_prompt`, then `encode_within` of the context, as
    /// `worker/server`'s `chat::render` and `text_ids` do; a completion's
    /// text encoded whole), special tokens written in the text, BOS added
    /// or not, a template that prints the BOS itself, the template options.
    #[test]
    fn the_ids_sent_upstream_are_the_ids_the_worker_makes() {
        let bos_template = "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
        let chats = [
            serde_json::json!({"model":"m","messages":[{"role":"user","content":"the heat"}]}),
            serde_json::json!({"model":"m","messages":[
                {"role":"system","content":"be <|im_end|> terse"},
                {"role":"user","content":"<s>the <|im_start|>"}]}),
            serde_json::json!({"model":"m","add_generation_prompt":false,"messages":[
                {"role":"user","content":"hi"},{"role":"assistant","content":"the"}]}),
            serde_json::json!({"model":"m","continue_final_message":true,"add_generation_prompt":false,
                "messages":[{"role":"user","content":"hi"},{"role":"assistant","content":"the he"}]}),
        ];
        let texts = [
            "the heat",
            "<s>the<|im_start|> he",
            " \n\t<|im_end|>x",
            "é😀 the",
        ];
        for (bos, template) in [
            (false, None),
            (true, None),
            (true, Some(bos_template)),
            (false, Some(bos_template)),
        ] {
            let tok = chatml(bos, template);
            let seq_len = 4096usize;
            let worker_ids = |text: &str| match tok.encode_within(text, seq_len - 1).unwrap() {
                Within::Ids(ids) => ids,
                Within::TooLong { .. } => panic!("fits"),
            };
            for chat in &chats {
                let body = serde_json::to_vec(chat).unwrap();
                let p = prepare(ApiKind::Chat, &body, &tok, Some(seq_len as u32), None).unwrap();
                let sent = p
                    .upstream
                    .tokenized_prompt
                    .clone()
                    .expect("ids sent upstream");
                assert_eq!(sent.digest, tok.digest());
                // What the worker does with the same chat body.
                let req: ChatCompletionRequest = rules::parse_body(&body).unwrap();
                let messages = rules::chat_messages(&req).unwrap();
                let opts = rngd_api::chat::TemplateOptions::of(&req);
                let rendered = tok.chat_prompt(&messages, &opts).unwrap();
                assert_eq!(p.upstream.prompt, Prompt::Text(rendered.clone()));
                assert_eq!(sent.ids, worker_ids(&rendered), "{bos} {template:?} {chat}");
                assert_eq!(sent.ids, p.prompt_ids);
                assert_eq!(
                    sent.ids.first() == Some(&259),
                    bos || template.is_some(),
                    "one BOS when one is due: {:?}",
                    sent.ids
                );
                assert_ne!(sent.ids.get(1), Some(&259), "never two BOS");
            }
            for text in texts {
                let body =
                    serde_json::to_vec(&serde_json::json!({"model":"m","prompt":text})).unwrap();
                let p =
                    prepare(ApiKind::Completion, &body, &tok, Some(seq_len as u32), None).unwrap();
                let sent = p.upstream.tokenized_prompt.expect("ids sent upstream");
                assert_eq!(sent.ids, worker_ids(text), "{text:?}");
                assert_eq!(sent.ids, tok.encode(text).unwrap());
            }
            // A prompt of ids is sent as it is, with nothing beside it.
            let p = prepare(
                ApiKind::Completion,
                br#"{"model":"m","prompt":[1,2]}"#,
                &tok,
                None,
                None,
            )
            .unwrap();
            assert_eq!(p.upstream.tokenized_prompt, None);
        }
        // A counter without a digest sends no ids.
        let p = prepare(
            ApiKind::Completion,
            br#"{"model":"m","prompt":"ab"}"#,
            &ByteCounter,
            None,
            None,
        )
        .unwrap();
        assert_eq!(p.upstream.tokenized_prompt, None);
    }

    #[test]
    fn paths() {
        assert_eq!(
            ApiKind::from_path("/v1/completions"),
            Some(ApiKind::Completion)
        );
        assert_eq!(
            ApiKind::from_path("/v1/chat/completions?x=1"),
            Some(ApiKind::Chat)
        );
        assert_eq!(ApiKind::from_path("/v1/models"), None);
    }
}
