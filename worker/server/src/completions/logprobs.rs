//! The engine's log-probabilities ([`TokenLogprobs`], token ids) as an
//! answer carries them: OpenAI's legacy completions format (`tokens`,
//! `token_logprobs`, `top_logprobs`, `text_offset`) or the chat format
//! (`content[]` of `{token, logprob, bytes, top_logprobs}`). A token's text is
//! the engine's decoding of that one id (an incomplete UTF-8 sequence shows
//! as U+FFFD, as in vLLM), `bytes` its UTF-8.

use std::collections::BTreeMap;
use std::sync::Arc;

use rngd_api::openai::{
    ChatLogprobs, ChatTokenLogprob, ChatTopLogprob, ChoiceLogprobs, CompletionLogprobs,
};
use rngd_engine::{Engine, TokenLogprobs};

/// Which format an answer's log-probabilities take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Format {
    /// `logprobs: N` of a completion.
    Completion,
    /// `logprobs: true` of a chat (`chat_logprobs` of its completion).
    Chat,
}

/// Builds the log-probabilities of one answer, token after token.
pub(super) struct Builder {
    engine: Arc<dyn Engine>,
    format: Format,
    /// Characters of text before the next token (the legacy `text_offset`).
    offset: usize,
}

impl Builder {
    /// A builder for `format`; `offset`: characters that precede the
    /// generated text in the answer.
    pub(super) fn new(engine: Arc<dyn Engine>, format: Format, offset: usize) -> Self {
        Builder {
            engine,
            format,
            offset,
        }
    }

    fn text(&self, id: u32) -> String {
        self.engine.detokenize(&[id]).unwrap_or_default()
    }

    /// An empty list in the builder's format.
    pub(super) fn empty(&self) -> ChoiceLogprobs {
        match self.format {
            Format::Completion => ChoiceLogprobs::Completion(CompletionLogprobs::default()),
            Format::Chat => ChoiceLogprobs::Chat(ChatLogprobs::default()),
        }
    }

    /// Appends token `id` (whose event carried `text`) to `out`.
    pub(super) fn push(
        &mut self,
        out: &mut ChoiceLogprobs,
        id: u32,
        text: &str,
        lp: &TokenLogprobs,
    ) {
        let token = self.text(id);
        match out {
            ChoiceLogprobs::Completion(c) => {
                // The chosen token first, then the alternatives (a text
                // already listed keeps its likelier value): vLLM's
                // "up to logprobs + 1" entries.
                let mut top = BTreeMap::new();
                top.insert(token.clone(), lp.logprob);
                for (alt, l) in &lp.top {
                    top.entry(self.text(*alt)).or_insert(*l);
                }
                c.tokens.push(token);
                c.token_logprobs.push(Some(lp.logprob));
                c.top_logprobs.push(Some(top));
                c.text_offset.push(self.offset as u32);
            }
            ChoiceLogprobs::Chat(c) => {
                let top = lp
                    .top
                    .iter()
                    .map(|(alt, l)| {
                        let t = self.text(*alt);
                        ChatTopLogprob {
                            bytes: Some(t.as_bytes().to_vec()),
                            token: t,
                            logprob: *l,
                        }
                    })
                    .collect();
                c.content.push(ChatTokenLogprob {
                    bytes: Some(token.as_bytes().to_vec()),
                    token,
                    logprob: lp.logprob,
                    top_logprobs: top,
                });
            }
        }
        self.offset += text.chars().count();
    }
}
