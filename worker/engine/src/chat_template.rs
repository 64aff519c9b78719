//! Chat rendering: turns `(role, content)` messages into the prompt text the
//! model was trained on, ending with the assistant's generation prompt.
//!
//! The template is chosen once, when the tokenizer is built, from the GGUF's
//! `tokenizer.chat_template` and the vocabulary.

use crate::EngineError;

/// How chats are rendered into a prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChatTemplate {
    /// `<|im_start|>role\ncontent<|im_end|>\n` per message, then
    /// `<|im_start|>assistant\n`. `default_system` is inserted first when the
    /// chat does not start with a system message.
    ChatMl {
        /// The template's default system prompt, if it has one.
        default_system: Option<String>,
    },
    /// No chat template: `role: content\n` lines, then `assistant: `.
    Plain,
}

impl ChatTemplate {
    /// Picks the renderer for a model: its `tokenizer.chat_template` text (if
    /// any) and whether its vocabulary has `<|im_start|>`.
    pub fn select(template: Option<&str>, vocab_has_im_start: bool) -> ChatTemplate {
        match template {
            Some(t) if t.contains("<|im_start|>") => ChatTemplate::ChatMl {
                default_system: default_system_prompt(t),
            },
            None if vocab_has_im_start => ChatTemplate::ChatMl {
                default_system: None,
            },
            _ => ChatTemplate::Plain,
        }
    }

    /// Renders `(role, content)` messages, ending with the assistant generation prompt.
    pub fn render(&self, messages: &[(String, String)]) -> Result<String, EngineError> {
        if messages.is_empty() {
            return Err(EngineError::InvalidRequest(
                "a chat needs at least one message".into(),
            ));
        }
        let mut out = String::new();
        match self {
            ChatTemplate::ChatMl { default_system } => {
                if let Some(sys) = default_system
                    && messages[0].0 != "system"
                {
                    out.push_str("<|im_start|>system\n");
                    out.push_str(sys);
                    out.push_str("<|im_end|>\n");
                }
                for (role, content) in messages {
                    out.push_str("<|im_start|>");
                    out.push_str(role);
                    out.push('\n');
                    out.push_str(content);
                    out.push_str("<|im_end|>\n");
                }
                out.push_str("<|im_start|>assistant\n");
            }
            ChatTemplate::Plain => {
                for (role, content) in messages {
                    out.push_str(role);
                    out.push_str(": ");
                    out.push_str(content);
                    out.push('\n');
                }
                out.push_str("assistant: ");
            }
        }
        Ok(out)
    }
}

/// Finds the literal default system prompt of a ChatML Jinja template
/// (`'<|im_start|>system\n…<|im_end|>` inside a string literal).
fn default_system_prompt(template: &str) -> Option<String> {
    let start_tag = "<|im_start|>system\n";
    let at = template.find(start_tag)? + start_tag.len();
    let rest = &template[at..];
    let end = rest.find("<|im_end|>")?;
    let text = &rest[..end];
    // A template that inserts a variable here has no literal default.
    if text.contains("{{") || text.contains('\'') || text.contains('"') || text.contains('+') {
        return None;
    }
    Some(text.to_string())
}
