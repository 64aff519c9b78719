//! Length before tokens: the most bytes of text one token can stand for
//! (computed from the vocabulary at load), and [`Tokenizer::encode_within`],
//! which refuses a text that provably has more tokens than a limit without
//! tokenizing more than a bounded amount of it.
//!
//! The bound: a byte-level BPE token stands for exactly its bytes, and a
//! special or user-defined token for its text, so a text of `n` bytes is at
//! least ⌈n / longest⌉ tokens (plus the BOS/EOS the model adds). That holds
//! only when every byte that can occur in UTF-8 text is a token (nothing is
//! dropped): a vocabulary without them has no bound.

use super::Tokenizer;
use crate::EngineError;

/// Tokens of headroom over the limit when a prefix is tokenized to decide
/// "too long" (the last pieces of a prefix may tokenize differently from the
/// whole text and are not counted).
pub const PREFIX_MARGIN_TOKENS: usize = 64;

/// A prefix of `PREFIX_BYTES_PER_TOKEN × (limit + margin)` bytes is tokenized
/// first when the text is longer than that: ordinary text averages about 4
/// bytes per token, so a text past this size almost always is too long, and a
/// text that fits is tokenized whole.
pub const PREFIX_BYTES_PER_TOKEN: usize = 8;

/// What [`Tokenizer::encode_within`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Within {
    /// The text's token ids (there are at most `limit` of them).
    Ids(Vec<u32>),
    /// The text has more than `limit` tokens: at least `at_least`.
    TooLong {
        /// A proven lower bound on the text's tokens (`> limit`).
        at_least: usize,
        /// Bytes of the text that were tokenized to find it (0: the byte
        /// bound alone proved it).
        tokenized_bytes: usize,
    },
}

/// The longest text one token of the vocabulary stands for, or `None` when
/// some byte has no token of its own (the byte-level table is incomplete, so
/// text may be dropped and no bound holds).
pub(super) fn longest_token(
    tokens: &[String],
    token_bytes: &[Vec<u8>],
    matched_whole: impl Fn(usize) -> bool,
) -> Option<usize> {
    let table = super::bytes_to_unicode();
    let mut have = [false; 256];
    let mut longest = 1;
    for (i, t) in tokens.iter().enumerate() {
        let bytes = token_bytes.get(i).map_or(0, Vec::len);
        let text = if matched_whole(i) { t.len() } else { 0 };
        longest = longest.max(bytes).max(text);
        let mut chars = t.chars();
        if let (Some(c), None) = (chars.next(), chars.next())
            && let Some(b) = table.iter().position(|x| *x == c)
        {
            have[b] = true;
        }
    }
    // Bytes that never occur in UTF-8 text (0xC0, 0xC1, 0xF5..=0xFF) need no
    // token: vocabularies leave them out.
    have.iter()
        .enumerate()
        .all(|(b, h)| *h || matches!(b, 0xC0 | 0xC1 | 0xF5..=0xFF))
        .then_some(longest)
}

/// The largest char boundary of `text` at or below `at`.
fn floor_char_boundary(text: &str, mut at: usize) -> usize {
    at = at.min(text.len());
    while !text.is_char_boundary(at) {
        at -= 1;
    }
    at
}

impl Tokenizer {
    /// The most bytes of text one token stands for (the longest token of the
    /// vocabulary, special tokens' text included); `None` when the vocabulary
    /// lacks a token for some byte, so no such bound holds.
    pub fn max_token_bytes(&self) -> Option<usize> {
        self.max_token_bytes
    }

    /// The context length the model was trained for (GGUF
    /// `{general.architecture}.context_length`), if the file says.
    pub fn context_length(&self) -> Option<u32> {
        self.context_length
    }

    /// Tokens added around every text ([`Tokenizer::encode`]'s BOS and EOS).
    fn added_tokens(&self) -> usize {
        usize::from(self.add_bos && self.bos.is_some())
            + usize::from(self.add_eos && self.eos.is_some())
    }

    /// A proven lower bound on the tokens of a text of `bytes` bytes:
    /// ⌈bytes / [`Tokenizer::max_token_bytes`]⌉ plus BOS/EOS (0 without a bound).
    pub fn min_tokens(&self, bytes: usize) -> usize {
        match self.max_token_bytes {
            Some(b) => bytes.div_ceil(b) + self.added_tokens(),
            None => 0,
        }
    }

    /// [`Tokenizer::encode`] for a text that may have at most `limit` tokens
    /// to be of use: a text whose byte length proves it has more is refused
    /// without tokenizing; a text longer than `8 × (limit + 64)` bytes has a
    /// prefix of that size tokenized first and is refused when the prefix
    /// alone (its last two pre-tokenized pieces left out) has more than
    /// `limit` tokens; otherwise the whole text is tokenized (at most
    /// `limit × max_token_bytes` bytes) and its ids returned, or refused when
    /// more than `limit`.
    pub fn encode_within(&self, text: &str, limit: usize) -> Result<Within, EngineError> {
        let at_least = self.min_tokens(text.len());
        if at_least > limit {
            return Ok(Within::TooLong {
                at_least,
                tokenized_bytes: 0,
            });
        }
        let prefix_bytes = limit
            .saturating_add(PREFIX_MARGIN_TOKENS)
            .saturating_mul(PREFIX_BYTES_PER_TOKEN);
        if text.len() > prefix_bytes {
            let cut = floor_char_boundary(text, prefix_bytes);
            let at_least = self.prefix_lower_bound(&text[..cut])?;
            if at_least > limit {
                return Ok(Within::TooLong {
                    at_least,
                    tokenized_bytes: cut,
                });
            }
        }
        let ids = self.encode(text)?;
        if ids.len() > limit {
            return Ok(Within::TooLong {
                at_least: ids.len(),
                tokenized_bytes: text.len(),
            });
        }
        Ok(Within::Ids(ids))
    }

    /// Tokens of `prefix` that the whole text surely has too: every piece
    /// the pre-tokenizer cut (special tokens are pieces too) but the last
    /// two, which may end differently in the longer text (a regex match
    /// looks at most one character ahead), plus BOS/EOS.
    fn prefix_lower_bound(&self, prefix: &str) -> Result<usize, EngineError> {
        let enc =
            self.inner
                .encode_fast(prefix, false)
                .map_err(|source| EngineError::Tokenizer {
                    message: "encoding".into(),
                    source: Some(source),
                })?;
        let words = enc.get_word_ids();
        let last = words.iter().flatten().copied().max().unwrap_or(0);
        let kept = words
            .iter()
            .filter(|w| w.is_some_and(|w| w.saturating_add(2) <= last))
            .count();
        Ok(kept + self.added_tokens())
    }
}
