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

/// What a vocabulary proves about token counts: the longest text one token
/// stands for, and the bytes that have no token of their own (a text's
/// such bytes may be dropped or folded into `<unk>`, so they count for
/// nothing in the bound).
pub(super) fn longest_token(
    tokens: &[String],
    token_bytes: &[Vec<u8>],
    matched_whole: impl Fn(usize) -> bool,
) -> (usize, [bool; 256]) {
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
    let mut tokenless = [false; 256];
    for (b, h) in have.iter().enumerate() {
        tokenless[b] = !h;
    }
    (longest, tokenless)
}

impl Tokenizer {
    /// The most bytes of text one token stands for (the longest token of the
    /// vocabulary, special tokens' text included).
    pub fn max_token_bytes(&self) -> usize {
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

    /// A proven lower bound on the tokens of `text`: ⌈b /
    /// [`Tokenizer::max_token_bytes`]⌉ plus BOS/EOS, where `b` counts the
    /// text's bytes that have a token of their own (a byte the vocabulary
    /// lacks may vanish, so it proves nothing). One pass over the bytes, no
    /// allocation.
    pub fn min_tokens(&self, text: &str) -> usize {
        let counted = text
            .bytes()
            .filter(|b| !self.tokenless_bytes[usize::from(*b)])
            .count();
        counted.div_ceil(self.max_token_bytes) + self.added_tokens()
    }

    /// [`Tokenizer::encode`] for a text that may have at most `limit` tokens
    /// to be of use: a text whose bytes prove it has more is refused without
    /// tokenizing; otherwise the whole text is tokenized (so at most about
    /// `limit × max_token_bytes` bytes are ever tokenized) and its ids
    /// returned, or refused when more than `limit`.
    pub fn encode_within(&self, text: &str, limit: usize) -> Result<Within, EngineError> {
        let at_least = self.min_tokens(text);
        if at_least > limit {
            return Ok(Within::TooLong {
                at_least,
                tokenized_bytes: 0,
            });
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
}
