//! Prompt token counting and chat templating, behind [`PromptTokenizer`]: the
//! real implementation reads the model's tokenizer from its GGUF metadata
//! (no weights loaded); tests use fakes.

use crate::error::BoxError;

/// What the gateway needs from the model's tokenizer.
pub trait PromptTokenizer: Send + Sync + 'static {
    /// The model name served in the API.
    fn model_name(&self) -> &str;
    /// Number of tokens `text` encodes to.
    fn count(&self, text: &str) -> Result<usize, BoxError>;
    /// Renders a chat with the model's template (generation prompt included).
    fn chat_prompt(&self, messages: &[(String, String)]) -> Result<String, BoxError>;
}

/// The real tokenizer: built from the GGUF's metadata by `rngd-engine`.
impl PromptTokenizer for rngd_engine::tokenizer::Tokenizer {
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

/// One token per UTF-8 byte, the way `rngd_engine::fake::EchoEngine` counts:
/// the tokenizer for tests and benchmarks that run the gateway on that fake
/// engine, where no model file exists.
#[derive(Debug, Clone, Copy, Default)]
pub struct ByteTokenizer;

impl PromptTokenizer for ByteTokenizer {
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
