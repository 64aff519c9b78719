//! What a request will cost the engine: [`PromptCounter`] (the model's own
//! tokenizer and chat template, from `rngd-engine`) and [`prepare`], the one
//! function both front doors turn a client body into a validated request and
//! its prompt-token count with. The gateway and the picker therefore count
//! exactly what the worker's engine will see, chat included.

use std::path::Path;
use std::sync::Arc;

use rngd_api::openai::{ChatCompletionRequest, CompletionRequest, Prompt, StreamOptions};
use rngd_api::rules::{self, RuleError};
pub use rngd_engine::tokenizer::TokenizerOverrides;

use crate::{BoxError, PoolError};

/// What the front doors need from the model's tokenizer.
pub trait PromptCounter: Send + Sync + 'static {
    /// The model name served in the API.
    fn model_name(&self) -> &str;
    /// Number of tokens `text` encodes to.
    fn count(&self, text: &str) -> Result<usize, BoxError>;
    /// Renders a chat with the model's template (generation prompt included).
    fn chat_prompt(&self, messages: &[(String, String)]) -> Result<String, BoxError>;
}

/// The real counter: the tokenizer and chat template the engine itself uses,
/// built from the GGUF's metadata by `rngd-engine` (no weights loaded).
impl PromptCounter for rngd_engine::tokenizer::Tokenizer {
    fn model_name(&self) -> &str {
        rngd_engine::tokenizer::Tokenizer::model_name(self)
    }

    fn count(&self, text: &str) -> Result<usize, BoxError> {
        Ok(self.encode(text)?.len())
    }

    fn chat_prompt(&self, messages: &[(String, String)]) -> Result<String, BoxError> {
        Ok(rngd_engine::tokenizer::Tokenizer::chat_prompt(
            self, messages,
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
    fn count(&self, text: &str) -> Result<usize, BoxError> {
        Ok(text.len())
    }
    fn chat_prompt(&self, messages: &[(String, String)]) -> Result<String, BoxError> {
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
    fn count(&self, text: &str) -> Result<usize, BoxError> {
        Ok(text.split_whitespace().count())
    }
    fn chat_prompt(&self, messages: &[(String, String)]) -> Result<String, BoxError> {
        let mut s = String::new();
        for (r, c) in messages {
            s.push_str(&format!("<|im_start|>{r} {c} <|im_end|> "));
        }
        s.push_str("<|im_start|>assistant");
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
    /// The tokenizer or chat template failed on this prompt (400).
    #[error("tokenizing the prompt: {0}")]
    Tokenize(#[source] BoxError),
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
    match kind {
        ApiKind::Completion => completion(body).map(drop),
        ApiKind::Chat => chat(body).map(drop),
    }
}

/// Parses and validates a client body of `kind`, renders a chat with the
/// model's template and counts the prompt's tokens.
///
/// `seq_len`: the compiled context a chat without `max_tokens` may fill
/// (OpenAI's chat default is "until the context is full"); `None` leaves
/// such a chat at the completion default.
pub fn prepare(
    kind: ApiKind,
    body: &[u8],
    counter: &dyn PromptCounter,
    seq_len: Option<u32>,
) -> Result<Prepared, PrepareError> {
    let (client_model, mut upstream, prompt_tokens) = match kind {
        ApiKind::Completion => {
            let mut req = completion(body)?;
            req.prompt = rules::single_prompt(&req.prompt)?;
            let n = match &req.prompt {
                Prompt::Text(t) => counter.count(t).map_err(PrepareError::Tokenize)?,
                Prompt::Tokens(t) => t.len(),
                Prompt::TextBatch(_) | Prompt::TokensBatch(_) => {
                    unreachable!("single_prompt unwraps batches")
                }
            };
            req.sampling.max_tokens = Some(rules::max_tokens_or_default(req.sampling.max_tokens));
            (req.model.clone(), req, n)
        }
        ApiKind::Chat => {
            let chat = chat(body)?;
            let messages = rules::chat_messages(&chat)?;
            let prompt = counter
                .chat_prompt(&messages)
                .map_err(PrepareError::Tokenize)?;
            let n = counter.count(&prompt).map_err(PrepareError::Tokenize)?;
            let upstream = rngd_api::chat::to_completion(&chat, prompt, n, seq_len);
            (chat.model, upstream, n)
        }
    };
    // The front doors need token counts on streams: ask the worker for usage
    // and remember whether the client wanted it passed on.
    let s = &mut upstream.sampling;
    let include_usage = s.stream_options.as_ref().is_some_and(|o| o.include_usage);
    if s.stream {
        s.stream_options = Some(StreamOptions {
            include_usage: true,
        });
    }
    Ok(Prepared {
        kind,
        client_model,
        upstream,
        prompt_tokens,
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
        )
        .expect("prepared");
        assert_eq!(p.prompt_tokens, 5);
        assert_eq!(p.upstream.prompt, Prompt::Text("hello".into()));
        assert_eq!(p.upstream.sampling.max_tokens, Some(16));
        assert!(!p.include_usage);
        assert!(p.upstream.sampling.stream_options.unwrap().include_usage);
        let p = prepare(
            ApiKind::Completion,
            br#"{"model":"m","prompt":[1,2,3]}"#,
            &ByteCounter,
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
                br#"{"model":"m","prompt":"x","n":3}"#,
                Some("n"),
            ),
            (
                ApiKind::Completion,
                br#"{"model":"m","prompt":"x","kv_transfer_params":{"do_remote_prefill":true}}"#,
                Some("kv_transfer_params"),
            ),
            (
                ApiKind::Chat,
                br#"{"model":"m","messages":[]}"#,
                Some("messages"),
            ),
            (ApiKind::Chat, b"nope", None),
        ] {
            match prepare(kind, body, &ByteCounter, None) {
                Err(PrepareError::Rule(e)) => assert_eq!(e.param, param),
                other => panic!("{other:?}"),
            }
            assert_eq!(check(kind, body).unwrap_err().param, param);
        }
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
