//! The pre-tokenizer of a GGUF BPE vocabulary, chosen by `tokenizer.ggml.pre`.
//!
//! llama.cpp splits text into words with one or more regular expressions per
//! pre-tokenizer type (`src/llama-vocab.cpp`), each applied to the pieces the
//! previous one left, matches and the text between them both kept as pieces;
//! BPE then runs on each piece's bytes written in GPT-2's byte alphabet. Here
//! the same expressions become `tokenizers` `Split` pre-tokenizers (behaviour
//! `Isolated`, which keeps matches and gaps alike; the crate is built with
//! `fancy-regex`, so the look-aheads work), followed by `ByteLevel` without a
//! regex of its own and without a prefix space.
//!
//! Supported: `llama-bpe` (and its aliases `llama3`, `llama-v3`: Llama 3.x),
//! `smollm`, `gpt-2` and `default`. Any other value is refused when the
//! tokenizer is built: a vocabulary split the wrong way gives wrong ids
//! without any error, so there is no fallback.

use tokenizers::PreTokenizerWrapper;
use tokenizers::SplitDelimiterBehavior;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};

use crate::EngineError;

/// GPT-2's word pattern as llama.cpp writes it (contractions, letters with an
/// optional leading space, digits likewise, other symbols likewise, then
/// whitespace not followed by a non-space).
const GPT2_WORDS: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";

/// Llama 3's word pattern (tiktoken's `pat_str`), with the case-insensitive
/// contraction group spelled out per letter as llama.cpp does: contractions,
/// letters with at most one leading non-letter/non-digit (not a newline),
/// digits in groups of one to three, symbols with an optional leading space
/// and trailing newlines, newline runs with their leading spaces, whitespace
/// not followed by a non-space, other whitespace.
const LLAMA3_WORDS: &str = concat!(
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])",
    r"|[^\r\n\p{L}\p{N}]?\p{L}+",
    r"|\p{N}{1,3}",
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"|\s*[\r\n]+",
    r"|\s+(?!\S)",
    r"|\s+",
);

/// The pre-tokenizers this engine implements (`tokenizer.ggml.pre`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreTokenizer {
    /// `llama-bpe` / `llama3` / `llama-v3`: Llama 3.x. The whole word is taken
    /// as one token when the vocabulary has it (llama.cpp's `ignore_merges`),
    /// and BOS is added unless the file says otherwise.
    Llama3,
    /// `smollm` (also StarCoder's): every digit on its own, then GPT-2's words.
    Smollm,
    /// `gpt-2`: GPT-2's words.
    Gpt2,
    /// `default`: llama.cpp's default BPE splitting (punctuation runs, GPT-2's
    /// words, digit runs, then three-digit groups).
    Default,
}

impl PreTokenizer {
    /// The GGUF names accepted for each variant (llama.cpp's spellings).
    pub const NAMES: &'static [(&'static str, PreTokenizer)] = &[
        ("llama-bpe", PreTokenizer::Llama3),
        ("llama3", PreTokenizer::Llama3),
        ("llama-v3", PreTokenizer::Llama3),
        ("smollm", PreTokenizer::Smollm),
        ("gpt-2", PreTokenizer::Gpt2),
        ("default", PreTokenizer::Default),
    ];

    /// The variant for a `tokenizer.ggml.pre` value, if it is implemented.
    pub fn from_gguf_name(name: &str) -> Option<PreTokenizer> {
        Self::NAMES
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, p)| *p)
    }

    /// The canonical GGUF name.
    pub fn name(self) -> &'static str {
        match self {
            PreTokenizer::Llama3 => "llama-bpe",
            PreTokenizer::Smollm => "smollm",
            PreTokenizer::Gpt2 => "gpt-2",
            PreTokenizer::Default => "default",
        }
    }

    /// Whether a word found whole in the vocabulary skips the merges.
    pub fn ignore_merges(self) -> bool {
        self == PreTokenizer::Llama3
    }

    /// Whether BOS is added when the file has no `tokenizer.ggml.add_bos_token`.
    pub fn default_add_bos(self) -> bool {
        self == PreTokenizer::Llama3
    }

    /// The regular expressions, in the order they are applied.
    pub fn patterns(self) -> &'static [&'static str] {
        match self {
            PreTokenizer::Llama3 => &[LLAMA3_WORDS],
            PreTokenizer::Smollm => &[r"\p{N}", GPT2_WORDS],
            PreTokenizer::Gpt2 => &[GPT2_WORDS],
            PreTokenizer::Default => &[
                r"[\p{P}\$\+<=>\^~\|]+",
                GPT2_WORDS,
                r"\p{N}+",
                r"[0-9][0-9][0-9]",
            ],
        }
    }

    /// The `tokenizers` pre-tokenizer: the splits, then the byte alphabet.
    pub(crate) fn build(self) -> Result<PreTokenizerWrapper, EngineError> {
        let mut steps = Vec::new();
        for p in self.patterns() {
            let split = Split::new(
                SplitPattern::Regex((*p).to_string()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .map_err(|source| EngineError::Tokenizer {
                message: format!(
                    "compiling the `{}` pre-tokenizer pattern {p:?}",
                    self.name()
                ),
                source: Some(source),
            })?;
            steps.push(PreTokenizerWrapper::Split(split));
        }
        steps.push(PreTokenizerWrapper::ByteLevel(ByteLevel::new(
            false, true, false,
        )));
        Ok(PreTokenizerWrapper::Sequence(Sequence::new(steps)))
    }
}

impl PreTokenizer {
    /// The words `text` is split into (before the byte alphabet and BPE), as
    /// substrings of `text`. For tests and diagnostics.
    pub fn split(self, text: &str) -> Result<Vec<String>, EngineError> {
        use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer as _};
        let err = |source| EngineError::Tokenizer {
            message: format!("splitting with the `{}` pre-tokenizer", self.name()),
            source: Some(source),
        };
        let mut pts = PreTokenizedString::from(text);
        self.build()?.pre_tokenize(&mut pts).map_err(err)?;
        Ok(pts
            .get_splits(OffsetReferential::Original, OffsetType::Byte)
            .into_iter()
            .map(|(_, (a, b), _)| text[a..b].to_string())
            .collect())
    }
}

/// The names accepted in `tokenizer.ggml.pre`, for error messages.
pub(crate) fn supported_names() -> String {
    PreTokenizer::NAMES
        .iter()
        .map(|(n, _)| format!("`{n}`"))
        .collect::<Vec<_>>()
        .join(", ")
}
