//! The tokenizer of a GGUF model, built from its metadata alone.
//!
//! GGUF files of the `gpt2` tokenizer family carry a byte-level BPE vocabulary
//! (`tokenizer.ggml.tokens`), its merges (`tokenizer.ggml.merges`) and token
//! types (`tokenizer.ggml.token_type`, 3 = control). This module rebuilds that
//! as a `tokenizers` BPE with the pre-tokenizer llama.cpp uses for such models:
//! individual digits, then GPT-2 byte-level splitting without a prefix space.
//! (candle's own GGUF tokenizer falls back to a byte-level pre-tokenizer that
//! adds a prefix space, which gives wrong ids for `tokenizer.ggml.pre = "smollm"`.)
//!
//! It also renders chats with the model's template (ChatML for models whose
//! vocabulary has `<|im_start|>`), and turns generated tokens into text
//! incrementally without splitting UTF-8 characters ([`StreamDecoder`]).

use std::collections::{HashMap, HashSet};
use std::path::Path;

use candle_core::quantized::gguf_file;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::{AddedToken, PreTokenizerWrapper};

use crate::EngineError;
pub use crate::chat_template::ChatTemplate;

/// GGUF token type of control tokens (`<|im_start|>`, EOS, …).
const TOKEN_TYPE_CONTROL: i32 = 3;

/// Everything needed to build a [`Tokenizer`] without a file (see [`Tokenizer::from_parts`]).
#[derive(Debug, Clone)]
pub struct TokenizerParts {
    /// Model name reported by [`Tokenizer::model_name`].
    pub model_name: String,
    /// Byte-level token strings, indexed by id.
    pub tokens: Vec<String>,
    /// BPE merges, `"left right"`, highest priority first.
    pub merges: Vec<String>,
    /// GGUF token types (same length as `tokens`, or empty = all normal).
    pub token_types: Vec<i32>,
    /// End-of-sequence token id.
    pub eos_token_id: Option<u32>,
    /// Beginning-of-sequence token id, prepended when `add_bos` is set.
    pub bos_token_id: Option<u32>,
    /// Whether encoding prepends BOS.
    pub add_bos: bool,
    /// GGUF `tokenizer.chat_template`, if any.
    pub chat_template: Option<String>,
}

/// A model's tokenizer and chat template.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    model_name: String,
    /// Bytes each token stands for (empty for control tokens).
    token_bytes: Vec<Vec<u8>>,
    stop_ids: HashSet<u32>,
    bos: Option<u32>,
    add_bos: bool,
    template: ChatTemplate,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("model_name", &self.model_name)
            .field("vocab_size", &self.token_bytes.len())
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

/// Reads only the header and metadata of a GGUF file.
pub(crate) fn read_gguf_header(
    path: &Path,
) -> Result<(gguf_file::Content, std::fs::File), EngineError> {
    if !path.exists() {
        return Err(EngineError::ModelNotFound {
            path: path.to_path_buf(),
        });
    }
    let mut file = std::fs::File::open(path).map_err(|source| EngineError::Io {
        context: format!("opening {}", path.display()),
        source,
    })?;
    let content =
        gguf_file::Content::read(&mut file).map_err(|source| EngineError::InvalidModel {
            path: path.to_path_buf(),
            reason: "cannot parse the GGUF header".into(),
            source: Some(Box::new(source)),
        })?;
    Ok((content, file))
}

/// Typed access to GGUF metadata with errors naming the key.
pub(crate) struct Meta<'a> {
    pub(crate) map: &'a HashMap<String, gguf_file::Value>,
    pub(crate) path: &'a Path,
}

impl Meta<'_> {
    pub(crate) fn invalid(&self, reason: String) -> EngineError {
        EngineError::InvalidModel {
            path: self.path.to_path_buf(),
            reason,
            source: None,
        }
    }

    pub(crate) fn get(&self, key: &str) -> Result<&gguf_file::Value, EngineError> {
        self.map
            .get(key)
            .ok_or_else(|| self.invalid(format!("metadata key `{key}` is missing")))
    }

    fn wrap<T>(&self, key: &str, r: candle_core::Result<T>) -> Result<T, EngineError> {
        r.map_err(|source| EngineError::InvalidModel {
            path: self.path.to_path_buf(),
            reason: format!("metadata key `{key}` has an unexpected type"),
            source: Some(Box::new(source)),
        })
    }

    pub(crate) fn string(&self, key: &str) -> Result<String, EngineError> {
        let v = self.get(key)?;
        self.wrap(key, v.to_string().cloned())
    }

    pub(crate) fn opt_string(&self, key: &str) -> Option<String> {
        self.map.get(key).and_then(|v| v.to_string().ok().cloned())
    }

    /// An unsigned integer of any width.
    pub(crate) fn uint(&self, key: &str) -> Result<u64, EngineError> {
        let v = self.get(key)?;
        use gguf_file::Value as V;
        let n = match v {
            V::U8(x) => u64::from(*x),
            V::U16(x) => u64::from(*x),
            V::U32(x) => u64::from(*x),
            V::U64(x) => *x,
            V::I8(x) if *x >= 0 => *x as u64,
            V::I16(x) if *x >= 0 => *x as u64,
            V::I32(x) if *x >= 0 => *x as u64,
            V::I64(x) if *x >= 0 => *x as u64,
            _ => {
                return Err(self.invalid(format!(
                    "metadata key `{key}` is not a non-negative integer"
                )));
            }
        };
        Ok(n)
    }

    pub(crate) fn opt_uint(&self, key: &str) -> Option<u64> {
        self.map.get(key).and_then(|_| self.uint(key).ok())
    }

    pub(crate) fn opt_f32(&self, key: &str) -> Option<f32> {
        match self.map.get(key)? {
            gguf_file::Value::F32(x) => Some(*x),
            gguf_file::Value::F64(x) => Some(*x as f32),
            _ => None,
        }
    }

    pub(crate) fn opt_bool(&self, key: &str) -> Option<bool> {
        self.map.get(key).and_then(|v| v.to_bool().ok())
    }

    fn string_array(&self, key: &str) -> Result<Vec<String>, EngineError> {
        let v = self.get(key)?;
        let items = self.wrap(key, v.to_vec())?;
        items
            .iter()
            .map(|x| self.wrap(key, x.to_string().cloned()))
            .collect()
    }

    fn int_array(&self, key: &str) -> Result<Vec<i32>, EngineError> {
        let v = self.get(key)?;
        let items = self.wrap(key, v.to_vec())?;
        items.iter().map(|x| self.wrap(key, x.to_i32())).collect()
    }
}

/// GPT-2's byte ↔ printable-character table: byte `b` is written as `char(table[b])`.
pub(crate) fn bytes_to_unicode() -> [char; 256] {
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
                "tokenizer model `{model}` is not supported (only the byte-level BPE `gpt2` family is)"
            )));
        }
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
        Self::from_parts(TokenizerParts {
            model_name,
            tokens,
            merges,
            token_types,
            eos_token_id: meta
                .opt_uint("tokenizer.ggml.eos_token_id")
                .map(|x| x as u32),
            bos_token_id: meta
                .opt_uint("tokenizer.ggml.bos_token_id")
                .map(|x| x as u32),
            add_bos: meta
                .opt_bool("tokenizer.ggml.add_bos_token")
                .unwrap_or(false),
            chat_template: meta.opt_string("tokenizer.chat_template"),
        })
    }

    /// Builds a tokenizer from its parts (used by the in-process tiny model).
    pub fn from_parts(parts: TokenizerParts) -> Result<Tokenizer, EngineError> {
        let TokenizerParts {
            model_name,
            tokens,
            merges,
            token_types,
            eos_token_id,
            bos_token_id,
            add_bos,
            chat_template,
        } = parts;
        if tokens.is_empty() {
            return Err(tok_err("the vocabulary is empty"));
        }
        let is_control = |id: usize| token_types.get(id) == Some(&TOKEN_TYPE_CONTROL);
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
            .build()
            .map_err(|source| EngineError::Tokenizer {
                message: "building the BPE model".into(),
                source: Some(source),
            })?;
        let mut inner = tokenizers::Tokenizer::new(bpe);
        let pre = Sequence::new(vec![
            PreTokenizerWrapper::Digits(Digits::new(true)),
            PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, true)),
        ]);
        inner.with_pre_tokenizer(Some(pre));
        inner.with_decoder(Some(ByteLevelDecoder::new(false, true, true)));
        let specials: Vec<AddedToken> = tokens
            .iter()
            .enumerate()
            .filter(|(i, _)| is_control(*i))
            .map(|(_, t)| AddedToken::from(t.clone(), true))
            .collect();
        inner.add_special_tokens(&specials);

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
            .collect();

        let id_of = |s: &str| tokens.iter().position(|t| t == s).map(|i| i as u32);
        let mut stop_ids = HashSet::new();
        stop_ids.extend(eos_token_id);
        let im_start = id_of("<|im_start|>");
        if im_start.is_some() {
            stop_ids.extend(id_of("<|im_end|>"));
        }
        stop_ids.extend(id_of("<|endoftext|>"));
        let template = ChatTemplate::select(chat_template.as_deref(), im_start.is_some());
        Ok(Tokenizer {
            inner,
            model_name,
            token_bytes,
            stop_ids,
            bos: bos_token_id,
            add_bos,
            template,
        })
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

    /// Token ids that end generation (EOS, `<|im_end|>` for ChatML models, `<|endoftext|>`).
    pub fn stop_ids(&self) -> &HashSet<u32> {
        &self.stop_ids
    }

    /// Text → token ids. Control tokens written in the text (`<|im_start|>`) become
    /// their ids; BOS is prepended only if the model asks for it.
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

    /// Renders `(role, content)` messages with the model's template, ending with
    /// the assistant generation prompt.
    pub fn chat_prompt(&self, messages: &[(String, String)]) -> Result<String, EngineError> {
        self.template.render(messages)
    }
}

/// Turns a stream of token ids into text pieces, holding back bytes of a UTF-8
/// character that is not complete yet.
#[derive(Debug, Default, Clone)]
pub struct StreamDecoder {
    pending: Vec<u8>,
}

impl StreamDecoder {
    /// Whether bytes of an incomplete character are held back.
    pub fn is_holding(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Adds one token; returns the text that is now complete (possibly empty).
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> String {
        self.pending.extend_from_slice(tokenizer.token_bytes(id));
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
