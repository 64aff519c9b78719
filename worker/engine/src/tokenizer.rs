//! The tokenizer of a GGUF model, built from its metadata alone.
//!
//! GGUF files of the `gpt2` tokenizer family carry a byte-level BPE vocabulary
//! (`tokenizer.ggml.tokens`), its merges (`tokenizer.ggml.merges`), token
//! types (`tokenizer.ggml.token_type`) and the name of their pre-tokenizer
//! (`tokenizer.ggml.pre`). This module rebuilds that as a `tokenizers` BPE
//! with the pre-tokenizer llama.cpp uses for that name ([`PreTokenizer`]; an
//! unknown name is a load error), and treats special tokens as llama.cpp does:
//! control (3), user-defined (4) and unknown (2) tokens are matched whole in
//! the text before BPE runs, BOS is prepended (and EOS appended) as
//! `tokenizer.ggml.add_bos_token` / `add_eos_token` say, with the
//! pre-tokenizer's default when the key is absent (true for `llama-bpe`).
//!
//! It also renders chats with the model's template (ChatML for models whose
//! vocabulary has `<|im_start|>`), and turns generated tokens into text
//! incrementally without splitting UTF-8 characters ([`StreamDecoder`]).

mod bound;
mod digest;
mod gguf_meta;
mod pre;

use std::collections::{HashMap, HashSet};
use std::path::Path;

use candle_core::quantized::gguf_file;
use tokenizers::AddedToken;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{BPE, Vocab};

use rngd_api::chat::TemplateOptions;

use crate::EngineError;
pub use crate::chat_template::{ChatTemplate, SpecialTokens};
pub use bound::Within;
pub use digest::TOKENIZER_DIGEST_HEX;
pub(crate) use gguf_meta::{Meta, read_gguf_header};
pub use pre::PreTokenizer;

/// GGUF token type of unknown tokens (`<unk>`).
const TOKEN_TYPE_UNKNOWN: i32 = 2;
/// GGUF token type of control tokens (`<|im_start|>`, EOS, …).
const TOKEN_TYPE_CONTROL: i32 = 3;
/// GGUF token type of user-defined tokens (added words, matched whole, shown as written).
const TOKEN_TYPE_USER_DEFINED: i32 = 4;

/// Control tokens that end a turn or the text, found by name as llama.cpp
/// does (its end-of-generation set), besides the file's EOS/EOT/EOM ids.
const END_OF_GENERATION: &[&str] = &[
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end_of_text|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|end|>",
    "<end_of_turn>",
];

/// Everything needed to build a [`Tokenizer`] without a file (see [`Tokenizer::from_parts`]).
#[derive(Debug, Clone)]
pub struct TokenizerParts {
    /// Model name reported by [`Tokenizer::model_name`].
    pub model_name: String,
    /// Byte-level token strings, indexed by id.
    pub tokens: Vec<String>,
    /// BPE merges, `"left right"`, highest priority first.
    pub merges: Vec<String>,
    /// How text is split into words before BPE (`tokenizer.ggml.pre`).
    pub pre: PreTokenizer,
    /// GGUF token types (same length as `tokens`, or empty = all normal).
    pub token_types: Vec<i32>,
    /// End-of-sequence token id.
    pub eos_token_id: Option<u32>,
    /// Beginning-of-sequence token id, prepended when `add_bos` is set.
    pub bos_token_id: Option<u32>,
    /// Whether encoding prepends BOS.
    pub add_bos: bool,
    /// Whether encoding appends EOS.
    pub add_eos: bool,
    /// GGUF `tokenizer.chat_template`, if any.
    pub chat_template: Option<String>,
}

/// What a user may change about a model's tokenizer (`--chat-template`,
/// `--served-model-name`); the default changes nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TokenizerOverrides {
    /// A Jinja chat template file to use instead of the model's own.
    pub chat_template: Option<std::path::PathBuf>,
    /// The model name to serve instead of the one from the file's metadata.
    pub served_model_name: Option<String>,
}

/// A model's tokenizer and chat template.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    model_name: String,
    /// Bytes each token stands for (empty for control tokens).
    token_bytes: Vec<Vec<u8>>,
    /// The text of each control token (`<|im_end|>`), shown when a request
    /// keeps special tokens (`skip_special_tokens: false`).
    control_text: HashMap<u32, Vec<u8>>,
    /// The longest text one token stands for (`bound`).
    max_token_bytes: usize,
    /// Bytes with no token of their own (`bound`: they prove no tokens).
    tokenless_bytes: [bool; 256],
    /// GGUF `{general.architecture}.context_length`, if the file has it.
    context_length: Option<u32>,
    stop_ids: HashSet<u32>,
    bos: Option<u32>,
    add_bos: bool,
    eos: Option<u32>,
    add_eos: bool,
    pre: PreTokenizer,
    template: ChatTemplate,
    /// The SHA-256 of the vocabulary, merges and BOS/EOS handling (`digest`).
    vocabulary_sha: [u8; 32],
    /// [`Tokenizer::digest`], kept current when the stop ids or the template change.
    digest: String,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("model_name", &self.model_name)
            .field("vocab_size", &self.token_bytes.len())
            .field("digest", &self.digest)
            .field("template", &self.template)
            .finish()
    }
}

fn tok_err(message: impl Into<String>) -> EngineError {
    EngineError::Tokenizer {
        message: message.into(),
        source: None,
    }
}

/// GPT-2's byte ↔ printable-character table: byte `b` is written as `char(table[b])`.
pub fn bytes_to_unicode() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..256u32 {
        let printable =
            (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
        let c = if printable {
            b
        } else {
            n += 1;
            255 + n
        };
        table[b as usize] = char::from_u32(c).unwrap_or('\0');
    }
    table
}

impl Tokenizer {
    /// Builds the tokenizer of a GGUF file, reading only its metadata (not the weights).
    pub fn from_gguf(path: &Path) -> Result<Tokenizer, EngineError> {
        let (content, _file) = read_gguf_header(path)?;
        Self::from_metadata(&content.metadata, path)
    }

    /// Builds the tokenizer from already-parsed GGUF metadata.
    pub(crate) fn from_metadata(
        map: &HashMap<String, gguf_file::Value>,
        path: &Path,
    ) -> Result<Tokenizer, EngineError> {
        let meta = Meta { map, path };
        let model = meta.string("tokenizer.ggml.model")?;
        if model != "gpt2" {
            return Err(meta.invalid(format!(
                "metadata key `tokenizer.ggml.model` is `{model}`: not supported (only the byte-level BPE `gpt2` family is)"
            )));
        }
        let pre = match meta.opt_string("tokenizer.ggml.pre") {
            Some(name) => PreTokenizer::from_gguf_name(&name).ok_or_else(|| {
                meta.invalid(format!(
                    "metadata key `tokenizer.ggml.pre` is `{name}`, a pre-tokenizer this engine \
                     does not implement (it implements {})",
                    pre::supported_names()
                ))
            })?,
            None if map.contains_key("tokenizer.ggml.pre") => {
                return Err(
                    meta.invalid("metadata key `tokenizer.ggml.pre` is not a string".to_string())
                );
            }
            // As llama.cpp: no name means its default splitting (it warns that
            // quality may suffer; so do we).
            None => {
                tracing::warn!(
                    path = %path.display(),
                    "the GGUF has no `tokenizer.ggml.pre`: using the `default` pre-tokenizer, as llama.cpp does"
                );
                PreTokenizer::Default
            }
        };
        let tokens = meta.string_array("tokenizer.ggml.tokens")?;
        let merges = meta.string_array("tokenizer.ggml.merges")?;
        let token_types = if map.contains_key("tokenizer.ggml.token_type") {
            meta.int_array("tokenizer.ggml.token_type")?
        } else {
            Vec::new()
        };
        let model_name = meta
            .opt_string("general.basename")
            .or_else(|| meta.opt_string("general.name"))
            .unwrap_or_else(|| {
                path.file_stem()
                    .map(|s| s.to_string_lossy().into_owned())
                    .unwrap_or_else(|| "model".into())
            });
        let model_name = match (
            meta.opt_string("general.size_label"),
            meta.opt_string("general.finetune"),
        ) {
            (Some(size), _) if !model_name.contains(&size) => {
                let mut n = format!("{model_name}-{size}");
                if tokens.iter().any(|t| t == "<|im_start|>") {
                    n.push_str("-instruct");
                }
                n
            }
            _ => model_name,
        };
        let n_tokens = tokens.len();
        let id = |key: &str| -> Result<Option<u32>, EngineError> {
            match meta.opt_uint(key) {
                Some(x) if (x as usize) < n_tokens => Ok(Some(x as u32)),
                Some(x) => Err(meta.invalid(format!(
                    "metadata key `{key}` is {x}, outside the vocabulary of {n_tokens}"
                ))),
                None => Ok(None),
            }
        };
        let (bos_token_id, eos_token_id) = (
            id("tokenizer.ggml.bos_token_id")?,
            id("tokenizer.ggml.eos_token_id")?,
        );
        let add_bos = meta
            .opt_bool("tokenizer.ggml.add_bos_token")
            .unwrap_or(pre.default_add_bos());
        let add_eos = meta
            .opt_bool("tokenizer.ggml.add_eos_token")
            .unwrap_or(false);
        for (add, what, key) in [
            (add_bos, bos_token_id, "bos"),
            (add_eos, eos_token_id, "eos"),
        ] {
            if add && what.is_none() {
                return Err(meta.invalid(format!(
                    "tokenizer.ggml.add_{key}_token is true but `tokenizer.ggml.{key}_token_id` is missing"
                )));
            }
        }
        let mut tokenizer = Self::from_parts(TokenizerParts {
            model_name,
            tokens,
            merges,
            pre,
            token_types,
            eos_token_id,
            bos_token_id,
            add_bos,
            add_eos,
            chat_template: meta.opt_string("tokenizer.chat_template"),
        })?;
        for key in ["tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"] {
            tokenizer.stop_ids.extend(id(key)?);
        }
        tokenizer.refresh_digest();
        tokenizer.context_length = meta
            .opt_string("general.architecture")
            .and_then(|a| meta.opt_uint(&format!("{a}.context_length")))
            .and_then(|n| u32::try_from(n).ok());
        Ok(tokenizer)
    }

    /// Builds a tokenizer from its parts (used by the in-process tiny model).
    pub fn from_parts(parts: TokenizerParts) -> Result<Tokenizer, EngineError> {
        let TokenizerParts {
            model_name,
            tokens,
            merges,
            pre,
            token_types,
            eos_token_id,
            bos_token_id,
            add_bos,
            add_eos,
            chat_template,
        } = parts;
        if tokens.is_empty() {
            return Err(tok_err("the vocabulary is empty"));
        }
        let vocabulary_sha = digest::vocabulary(&digest::Vocabulary {
            tokens: &tokens,
            token_types: &token_types,
            merges: &merges,
            pre,
            bos: bos_token_id,
            eos: eos_token_id,
            add_bos,
            add_eos,
        });
        let ty = |id: usize| token_types.get(id).copied().unwrap_or(1);
        let is_control = |id: usize| matches!(ty(id), TOKEN_TYPE_CONTROL | TOKEN_TYPE_UNKNOWN);
        let vocab: Vocab = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        let merges = merges
            .iter()
            .map(|m| {
                m.split_once(' ')
                    .map(|(a, b)| (a.to_string(), b.to_string()))
                    .ok_or_else(|| {
                        tok_err(format!(
                            "merge `{m}` is not two tokens separated by a space"
                        ))
                    })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .ignore_merges(pre.ignore_merges())
            .build()
            .map_err(|source| EngineError::Tokenizer {
                message: "building the BPE model".into(),
                source: Some(source),
            })?;
        let mut inner = tokenizers::Tokenizer::new(bpe);
        inner.with_pre_tokenizer(Some(pre.build()?));
        inner.with_decoder(Some(ByteLevelDecoder::new(false, true, true)));
        // Matched whole before the pre-tokenizer runs: control and unknown
        // tokens as special (left out when decoding), user-defined ones as
        // added words (decoded as written).
        let added = |special: bool| -> Vec<AddedToken> {
            tokens
                .iter()
                .enumerate()
                .filter(|(i, _)| {
                    if special {
                        is_control(*i)
                    } else {
                        ty(*i) == TOKEN_TYPE_USER_DEFINED
                    }
                })
                .map(|(_, t)| AddedToken::from(t.clone(), special))
                .collect()
        };
        inner.add_special_tokens(&added(true));
        inner.add_tokens(&added(false));

        let table = bytes_to_unicode();
        let mut inverse = HashMap::with_capacity(256);
        for (b, c) in table.iter().enumerate() {
            inverse.insert(*c, b as u8);
        }
        let token_bytes = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| {
                if is_control(i) {
                    Vec::new()
                } else if ty(i) == TOKEN_TYPE_USER_DEFINED {
                    t.as_bytes().to_vec()
                } else {
                    // Characters outside the byte table (user-defined tokens) stand for themselves.
                    let mut out = Vec::with_capacity(t.len());
                    for c in t.chars() {
                        match inverse.get(&c) {
                            Some(b) => out.push(*b),
                            None => out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
                        }
                    }
                    out
                }
            })
            .collect::<Vec<Vec<u8>>>();
        let control_text = tokens
            .iter()
            .enumerate()
            .filter(|(i, _)| is_control(*i))
            .map(|(i, t)| (i as u32, t.as_bytes().to_vec()))
            .collect();
        let (max_token_bytes, tokenless_bytes) = bound::longest_token(&tokens, &token_bytes, |i| {
            is_control(i) || ty(i) == TOKEN_TYPE_USER_DEFINED
        });

        let id_of = |s: &str| tokens.iter().position(|t| t == s).map(|i| i as u32);
        let mut stop_ids = HashSet::new();
        stop_ids.extend(eos_token_id);
        let im_start = id_of("<|im_start|>");
        stop_ids.extend(
            END_OF_GENERATION
                .iter()
                .filter_map(|name| id_of(name))
                .filter(|id| is_control(*id as usize) || token_types.is_empty()),
        );
        let specials = SpecialTokens {
            bos: bos_token_id.and_then(|i| tokens.get(i as usize)).cloned(),
            eos: eos_token_id.and_then(|i| tokens.get(i as usize)).cloned(),
        };
        let template =
            ChatTemplate::for_model(chat_template.as_deref(), specials, im_start.is_some())?;
        let digest = digest::finish(&vocabulary_sha, &stop_ids, &template);
        Ok(Tokenizer {
            inner,
            model_name,
            token_bytes,
            control_text,
            max_token_bytes,
            tokenless_bytes,
            context_length: None,
            stop_ids,
            bos: bos_token_id,
            add_bos,
            eos: eos_token_id,
            add_eos,
            pre,
            template,
            vocabulary_sha,
            digest,
        })
    }

    /// The tokenizer's identity: 16 hex digits over the vocabulary (each
    /// token's text and type, in id order), the merges, the pre-tokenizer,
    /// the BOS/EOS ids and whether they are added, the stop ids and the chat
    /// template (`digest`). Two tokenizers with the same digest turn every
    /// text and chat into the same ids; the model name is not part of it.
    pub fn digest(&self) -> &str {
        &self.digest
    }

    fn refresh_digest(&mut self) {
        self.digest = digest::finish(&self.vocabulary_sha, &self.stop_ids, &self.template);
    }

    /// The pre-tokenizer in use (from `tokenizer.ggml.pre`).
    pub fn pre_tokenizer(&self) -> PreTokenizer {
        self.pre
    }

    /// The BOS token id, if the model has one.
    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    /// Whether [`Tokenizer::encode`] prepends BOS.
    pub fn adds_bos(&self) -> bool {
        self.add_bos && self.bos.is_some()
    }

    /// The model's name (from GGUF `general.*` metadata).
    pub fn model_name(&self) -> &str {
        &self.model_name
    }

    /// Vocabulary size.
    pub fn vocab_size(&self) -> usize {
        self.token_bytes.len()
    }

    /// The chat template in use.
    pub fn template(&self) -> &ChatTemplate {
        &self.template
    }

    /// Token ids that end generation: EOS, the file's EOT/EOM ids, and the
    /// control tokens llama.cpp ends generation on by name (`<|eot_id|>`,
    /// `<|eom_id|>`, `<|end_of_text|>`, `<|im_end|>`, `<|endoftext|>`, …).
    pub fn stop_ids(&self) -> &HashSet<u32> {
        &self.stop_ids
    }

    /// Text → token ids, as llama.cpp's `llama_tokenize(text, add_special = true,
    /// parse_special = true)`: special tokens written in the text
    /// (`<|im_start|>`, `<|begin_of_text|>`) become their ids; BOS is prepended
    /// and EOS appended only if the model asks for it (a text that starts with
    /// the BOS token's text then starts with two BOS ids, as in llama.cpp).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, EngineError> {
        let enc = self
            .inner
            .encode_fast(text, false)
            .map_err(|source| EngineError::Tokenizer {
                message: "encoding".into(),
                source: Some(source),
            })?;
        let mut ids = Vec::with_capacity(enc.len() + 1);
        if self.add_bos {
            ids.extend(self.bos);
        }
        ids.extend_from_slice(enc.get_ids());
        if self.add_eos {
            ids.extend(self.eos);
        }
        Ok(ids)
    }

    /// Token ids → text; control tokens are left out. Invalid UTF-8 becomes U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> Result<String, EngineError> {
        for id in ids {
            if *id as usize >= self.token_bytes.len() {
                return Err(tok_err(format!(
                    "token id {id} is outside the vocabulary of {}",
                    self.token_bytes.len()
                )));
            }
        }
        self.inner
            .decode(ids, true)
            .map_err(|source| EngineError::Tokenizer {
                message: "decoding".into(),
                source: Some(source),
            })
    }

    /// The bytes a token stands for (empty for control tokens and unknown ids).
    pub fn token_bytes(&self, id: u32) -> &[u8] {
        self.token_bytes
            .get(id as usize)
            .map(Vec::as_slice)
            .unwrap_or(&[])
    }

    /// The bytes a token shows in an answer's text: [`Tokenizer::token_bytes`],
    /// or a control token's own text when `keep_special` (vLLM's
    /// `skip_special_tokens: false`).
    pub fn shown_bytes(&self, id: u32, keep_special: bool) -> &[u8] {
        match self.control_text.get(&id) {
            Some(text) if keep_special => text,
            _ => self.token_bytes(id),
        }
    }

    /// Renders `(role, content)` messages with the model's template as `opts`
    /// ask (by default ending with the assistant generation prompt).
    ///
    /// When the template prints `bos_token` first and [`Tokenizer::encode`]
    /// prepends BOS itself, that leading BOS text is left out, so the prompt
    /// encodes with one BOS (as vLLM tokenizes chats, without adding special
    /// tokens to a template that has them).
    pub fn chat_prompt(
        &self,
        messages: &[(String, String)],
        opts: &TemplateOptions,
    ) -> Result<String, EngineError> {
        let mut text = self.template.render(messages, opts)?;
        if self.add_bos
            && self.bos.is_some()
            && let Some(bos) = &self.template.specials().bos
            && text.starts_with(bos.as_str())
        {
            text.drain(..bos.len());
        }
        Ok(text)
    }

    /// Renders chats with the Jinja template in `path` instead of the model's
    /// own (`--chat-template FILE`); a template that does not compile is an error.
    pub fn with_chat_template_file(mut self, path: &Path) -> Result<Tokenizer, EngineError> {
        self.template = self.template.with_file(path)?;
        self.refresh_digest();
        Ok(self)
    }

    /// Serves the model under `name` instead of the one its metadata gives
    /// (`--served-model-name`); an empty name is an error.
    pub fn with_model_name(mut self, name: &str) -> Result<Tokenizer, EngineError> {
        if name.trim().is_empty() {
            return Err(tok_err("the served model name must not be empty"));
        }
        self.model_name = name.to_string();
        Ok(self)
    }

    /// Applies the user's choices ([`TokenizerOverrides`]) to the tokenizer of a model file.
    pub fn with_overrides(self, o: &TokenizerOverrides) -> Result<Tokenizer, EngineError> {
        let t = match &o.chat_template {
            Some(p) => self.with_chat_template_file(p)?,
            None => self,
        };
        match &o.served_model_name {
            Some(n) => t.with_model_name(n),
            None => Ok(t),
        }
    }
}

/// Turns a stream of token ids into text pieces, holding back bytes of a UTF-8
/// character that is not complete yet. Control tokens show no text unless
/// the decoder keeps them ([`StreamDecoder::keeping_special`]).
#[derive(Debug, Default, Clone)]
pub struct StreamDecoder {
    pending: Vec<u8>,
    keep_special: bool,
}

impl StreamDecoder {
    /// A decoder that writes control tokens as their text (vLLM's
    /// `skip_special_tokens: false`) when `keep` is set.
    pub fn keeping_special(keep: bool) -> Self {
        StreamDecoder {
            pending: Vec::new(),
            keep_special: keep,
        }
    }

    /// Whether bytes of an incomplete character are held back.
    pub fn is_holding(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Adds one token; returns the text that is now complete (possibly empty).
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> String {
        self.pending
            .extend_from_slice(tokenizer.shown_bytes(id, self.keep_special));
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    return out;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // The prefix up to `valid_up_to` is valid UTF-8.
                    out.push_str(std::str::from_utf8(&self.pending[..valid]).unwrap_or_default());
                    match e.error_len() {
                        // Incomplete character at the end: keep it for the next token.
                        None => {
                            self.pending.drain(..valid);
                            return out;
                        }
                        // Invalid bytes: replace them, as a lossy decode would.
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            self.pending.drain(..valid + bad);
                        }
                    }
                }
            }
        }
    }

    /// Ends the stream: whatever is held back, lossily.
    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }
}
