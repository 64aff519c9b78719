//! The tokenizer's identity: a digest over everything that decides which
//! token ids a text or a chat becomes, so two processes agree on it exactly
//! when they tokenize alike, whatever their model files are called.
//!
//! It covers the vocabulary (every token's text and GGUF type, in id
//! order), the merges in priority order, the pre-tokenizer, the BOS and EOS
//! ids and whether encoding adds them, the ids that end generation, and the
//! chat template (its Jinja source, or which fallback renders). The served
//! model name is left out (a renamed model tokenizes alike). As the weights'
//! `weight_version` (`crate::identity`): the first 64 bits of a SHA-256, as
//! 16 lower-case hex digits.
//!
//! A front door sends the prompt's ids with its digest; a worker uses them
//! only when the digest is its own (docs/pd-protocol.md, "The door's token
//! ids").

use std::collections::HashSet;

use sha2::{Digest, Sha256};

use super::{ChatTemplate, PreTokenizer};

/// Hex digits of a [`super::Tokenizer::digest`].
pub const TOKENIZER_DIGEST_HEX: usize = 16;

/// What the vocabulary part of the digest is made of.
pub(super) struct Vocabulary<'a> {
    pub(super) tokens: &'a [String],
    /// GGUF token types, empty = all normal (1).
    pub(super) token_types: &'a [i32],
    pub(super) merges: &'a [String],
    pub(super) pre: PreTokenizer,
    pub(super) bos: Option<u32>,
    pub(super) eos: Option<u32>,
    pub(super) add_bos: bool,
    pub(super) add_eos: bool,
}

fn put_bytes(h: &mut Sha256, b: &[u8]) {
    h.update((b.len() as u64).to_le_bytes());
    h.update(b);
}

fn put_id(h: &mut Sha256, id: Option<u32>) {
    match id {
        Some(i) => {
            h.update([1]);
            h.update(i.to_le_bytes());
        }
        None => h.update([0]),
    }
}

/// The SHA-256 of the vocabulary part (computed once per tokenizer).
pub(super) fn vocabulary(v: &Vocabulary<'_>) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(b"rngd-pd tokenizer vocabulary v1\n");
    put_bytes(&mut h, v.pre.name().as_bytes());
    h.update((v.tokens.len() as u64).to_le_bytes());
    for (i, t) in v.tokens.iter().enumerate() {
        put_bytes(&mut h, t.as_bytes());
        // An absent type array means every token is normal (1).
        h.update(v.token_types.get(i).copied().unwrap_or(1).to_le_bytes());
    }
    h.update((v.merges.len() as u64).to_le_bytes());
    for m in v.merges {
        put_bytes(&mut h, m.as_bytes());
    }
    put_id(&mut h, v.bos);
    put_id(&mut h, v.eos);
    h.update([u8::from(v.add_bos), u8::from(v.add_eos)]);
    h.finalize().into()
}

/// The digest: the vocabulary's hash, the stop ids and the chat template.
pub(super) fn finish(
    vocabulary: &[u8; 32],
    stop_ids: &HashSet<u32>,
    template: &ChatTemplate,
) -> String {
    let mut h = Sha256::new();
    h.update(b"rngd-pd tokenizer v1\n");
    h.update(vocabulary);
    let mut stops: Vec<u32> = stop_ids.iter().copied().collect();
    stops.sort_unstable();
    h.update((stops.len() as u64).to_le_bytes());
    for s in stops {
        h.update(s.to_le_bytes());
    }
    put_bytes(&mut h, template.kind().as_bytes());
    match template.source() {
        Some(src) => {
            h.update([1]);
            put_bytes(&mut h, src.as_bytes());
        }
        None => h.update([0]),
    }
    h.finalize()
        .iter()
        .take(TOKENIZER_DIGEST_HEX / 2)
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::super::{Tokenizer, TokenizerParts};
    use super::TOKENIZER_DIGEST_HEX;

    /// A small ChatML byte-level tokenizer (the tiny test model's), as
    /// parts to edit.
    fn parts() -> TokenizerParts {
        let table = super::super::bytes_to_unicode();
        let g = table[b' ' as usize];
        let mut tokens: Vec<String> = table.iter().map(|c| c.to_string()).collect();
        tokens.extend(["he".to_string(), format!("{g}t"), format!("{g}the")]);
        tokens.extend(["<|endoftext|>", "<|im_start|>", "<|im_end|>"].map(String::from));
        let mut token_types = vec![1; tokens.len()];
        for id in [259, 260, 261] {
            token_types[id] = 3;
        }
        TokenizerParts {
            model_name: "tiny-llama".into(),
            tokens,
            merges: vec!["h e".to_string(), format!("{g} t"), format!("{g}t he")],
            pre: super::super::PreTokenizer::Smollm,
            token_types,
            eos_token_id: Some(261),
            bos_token_id: None,
            add_bos: false,
            add_eos: false,
            chat_template: None,
        }
    }

    /// One change to a tokenizer's parts.
    type Edit = Box<dyn Fn(&mut TokenizerParts)>;

    fn digest(p: TokenizerParts) -> String {
        Tokenizer::from_parts(p)
            .expect("tokenizer")
            .digest()
            .to_string()
    }

    #[test]
    fn the_digest_is_stable_and_ignores_the_model_name() {
        let base = digest(parts());
        assert_eq!(base.len(), TOKENIZER_DIGEST_HEX);
        assert!(
            base.bytes()
                .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
        );
        assert_eq!(base, digest(parts()));
        let mut renamed = parts();
        renamed.model_name = "another-name".into();
        assert_eq!(base, digest(renamed));
    }

    #[test]
    fn two_swapped_vocabulary_entries_change_the_digest() {
        let base = digest(parts());
        let mut p = parts();
        p.tokens.swap(b'a' as usize, b'b' as usize);
        let swapped = digest(p.clone());
        assert_ne!(base, swapped);
        // And the ids differ with it: what the digest is for.
        let a = Tokenizer::from_parts(parts()).unwrap();
        let b = Tokenizer::from_parts(p).unwrap();
        assert_ne!(a.encode("abba").unwrap(), b.encode("abba").unwrap());
    }

    #[test]
    fn every_part_that_decides_the_ids_changes_the_digest() {
        let base = digest(parts());
        let edits: Vec<(&str, Edit)> = vec![
            (
                "a token's text",
                Box::new(|p| p.tokens[259] = "<|end|>".into()),
            ),
            ("a token's type", Box::new(|p| p.token_types[256] = 4)),
            ("a merge", Box::new(|p| p.merges.truncate(2))),
            ("merge order", Box::new(|p| p.merges.swap(0, 1))),
            (
                "the pre-tokenizer",
                Box::new(|p| p.pre = super::super::PreTokenizer::Gpt2),
            ),
            ("bos", Box::new(|p| p.bos_token_id = Some(259))),
            ("eos", Box::new(|p| p.eos_token_id = Some(259))),
            (
                "add_bos",
                Box::new(|p| {
                    p.bos_token_id = Some(259);
                    p.add_bos = true;
                }),
            ),
            ("add_eos", Box::new(|p| p.add_eos = true)),
            (
                "a chat template",
                Box::new(|p| p.chat_template = Some("{{ messages[0]['content'] }}".into())),
            ),
        ];
        for (what, edit) in edits {
            let mut p = parts();
            edit(&mut p);
            assert_ne!(base, digest(p), "{what}");
        }
    }

    #[test]
    fn the_chat_template_is_part_of_the_digest() {
        let mut p = parts();
        p.chat_template = Some("{{ messages[0]['content'] }}".into());
        let one = digest(p.clone());
        p.chat_template = Some("{{ messages[0]['content'] }}!".into());
        assert_ne!(one, digest(p.clone()));
        // A template file given instead (`--chat-template`) changes it too,
        // and the same source from a file gives the same digest.
        let dir = std::env::temp_dir().join(format!("rngd-digest-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("t.jinja");
        std::fs::write(&file, "{{ messages[0]['content'] }}").unwrap();
        let base = Tokenizer::from_parts(parts()).unwrap();
        let with_file = base.clone().with_chat_template_file(&file).unwrap();
        assert_ne!(base.digest(), with_file.digest());
        assert_eq!(with_file.digest(), one);
        std::fs::remove_dir_all(&dir).ok();
    }
}
