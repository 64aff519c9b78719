//! Tokenizer tests: llama.cpp's ids on the real model's metadata, round trips,
//! chat rendering, streaming detokenization, and the pre-tokenizer chosen by
//! `tokenizer.ggml.pre` (the splits of each, an unknown name refused, BOS
//! defaults, user-defined tokens) on copies of the real model's metadata.
//! The full id battery against llama.cpp, SmolLM2 and Llama 3, is
//! `tests/python/test_tokenizer_fidelity.py`.

mod common;

use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{self, Value};
use rngd_engine::tokenizer::{PreTokenizer, StreamDecoder, Tokenizer, Within};

fn real() -> Tokenizer {
    Tokenizer::from_gguf(&common::real_model()).expect("tokenizer from GGUF metadata")
}

/// The real model's metadata with `edit` applied, written as a GGUF file
/// without tensors in `dir`.
fn edited_metadata(dir: &Path, edit: impl FnOnce(&mut Vec<(String, Value)>)) -> PathBuf {
    let mut f = std::fs::File::open(common::real_model()).unwrap();
    let content = gguf_file::Content::read(&mut f).unwrap();
    let mut kv: Vec<(String, Value)> = content.metadata.into_iter().collect();
    kv.sort_by(|a, b| a.0.cmp(&b.0));
    edit(&mut kv);
    let path = dir.join("edited.gguf");
    let mut out = std::fs::File::create(&path).unwrap();
    let refs: Vec<(&str, &Value)> = kv.iter().map(|(k, v)| (k.as_str(), v)).collect();
    gguf_file::write(&mut out, &refs, &[]).unwrap();
    path
}

fn set(kv: &mut Vec<(String, Value)>, key: &str, value: Option<Value>) {
    kv.retain(|(k, _)| k != key);
    if let Some(v) = value {
        kv.push((key.to_string(), v));
    }
}

fn with_pre(dir: &Path, pre: Option<&str>) -> PathBuf {
    edited_metadata(dir, |kv| {
        set(
            kv,
            "tokenizer.ggml.pre",
            pre.map(|p| Value::String(p.to_string())),
        )
    })
}

#[test]
fn the_real_model_uses_the_smollm_pre_tokenizer() {
    assert_eq!(real().pre_tokenizer(), PreTokenizer::Smollm);
    assert!(!real().adds_bos(), "SmolLM2 sets add_bos_token false");
}

/// The words each pre-tokenizer makes of one text, worked out by hand from
/// llama.cpp's expressions: Llama 3 keeps upper-case contractions, groups
/// digits by three and keeps a newline run apart from the spaces after it;
/// SmolLM2 splits every digit and knows only lower-case contractions.
#[test]
fn each_pre_tokenizer_splits_as_its_llama_cpp_expressions() {
    let text = "I'M 12345 don't\n\n  x";
    let got = |p: PreTokenizer| p.split(text).unwrap();
    assert_eq!(
        got(PreTokenizer::Llama3),
        ["I", "'M", " ", "123", "45", " don", "'t", "\n\n", " ", " x"]
    );
    assert_eq!(
        got(PreTokenizer::Smollm),
        [
            "I", "'", "M", " ", "1", "2", "3", "4", "5", " don", "'t", "\n\n ", " x"
        ]
    );
    assert_eq!(
        got(PreTokenizer::Gpt2),
        ["I", "'", "M", " 12345", " don", "'t", "\n\n ", " x"]
    );
    // llama.cpp's default: punctuation runs first, then GPT-2's words, digit
    // runs, three-digit groups.
    assert_eq!(
        got(PreTokenizer::Default),
        [
            "I", "'", "M", " ", "123", "45", " don", "'", "t", "\n\n ", " x"
        ]
    );
    // Every split is a partition of the text.
    for (_, p) in PreTokenizer::NAMES {
        assert_eq!(got(*p).concat(), text, "{p:?}");
    }
}

#[test]
fn tokenizer_ggml_pre_chooses_the_pre_tokenizer() {
    let dir = tempfile::tempdir().unwrap();
    for (name, want) in PreTokenizer::NAMES {
        let t = Tokenizer::from_gguf(&with_pre(dir.path(), Some(name))).unwrap();
        assert_eq!(t.pre_tokenizer(), *want, "{name}");
    }
    // The choice reaches the ids: a newline run keeps the spaces after it
    // (smollm: "\n\n " + " b") or not (llama-bpe: "\n\n" + " " + " b").
    let smollm = Tokenizer::from_gguf(&with_pre(dir.path(), Some("smollm"))).unwrap();
    let llama = Tokenizer::from_gguf(&with_pre(dir.path(), Some("llama-bpe"))).unwrap();
    let text = "a\n\n  b";
    assert_eq!(smollm.encode(text).unwrap(), real().encode(text).unwrap());
    assert_eq!(smollm.encode(text).unwrap(), [81, 8866, 278]);
    assert_eq!(llama.encode(text).unwrap(), [81, 1116, 216, 278]);
}

#[test]
fn an_unknown_pre_tokenizer_is_a_load_error_naming_the_key_and_the_value() {
    let dir = tempfile::tempdir().unwrap();
    for name in ["qwen2", "deepseek-llm", "gpt2", ""] {
        let err = Tokenizer::from_gguf(&with_pre(dir.path(), Some(name)))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("tokenizer.ggml.pre") && err.contains(&format!("`{name}`")),
            "{err}"
        );
        assert!(err.contains("llama-bpe") && err.contains("smollm"), "{err}");
    }
    let err = Tokenizer::from_gguf(&edited_metadata(dir.path(), |kv| {
        set(kv, "tokenizer.ggml.pre", Some(Value::U32(3)))
    }))
    .unwrap_err()
    .to_string();
    assert!(err.contains("tokenizer.ggml.pre"), "{err}");
}

#[test]
fn no_pre_tokenizer_name_means_llama_cpp_s_default() {
    let dir = tempfile::tempdir().unwrap();
    let t = Tokenizer::from_gguf(&with_pre(dir.path(), None)).unwrap();
    assert_eq!(t.pre_tokenizer(), PreTokenizer::Default);
}

#[test]
fn bos_follows_add_bos_token_with_the_pre_tokenizer_s_default() {
    let dir = tempfile::tempdir().unwrap();
    let file = |pre: &str, add_bos: Option<bool>| {
        edited_metadata(dir.path(), |kv| {
            set(kv, "tokenizer.ggml.pre", Some(Value::String(pre.into())));
            set(kv, "tokenizer.ggml.add_bos_token", add_bos.map(Value::Bool));
        })
    };
    let bos = 1; // SmolLM2's bos_token_id (<|im_start|>)
    let first = |p: PathBuf| Tokenizer::from_gguf(&p).unwrap().encode("hi").unwrap()[0];
    assert_eq!(
        first(file("llama-bpe", None)),
        bos,
        "llama-bpe adds BOS by default"
    );
    assert_ne!(first(file("llama-bpe", Some(false))), bos);
    assert_ne!(
        first(file("smollm", None)),
        bos,
        "smollm does not by default"
    );
    assert_eq!(first(file("smollm", Some(true))), bos);
    // add_bos without a BOS id is refused, naming the keys.
    let err = Tokenizer::from_gguf(&edited_metadata(dir.path(), |kv| {
        set(kv, "tokenizer.ggml.add_bos_token", Some(Value::Bool(true)));
        set(kv, "tokenizer.ggml.bos_token_id", None);
    }))
    .unwrap_err()
    .to_string();
    assert!(err.contains("tokenizer.ggml.bos_token_id"), "{err}");
}

/// A user-defined token (type 4) is matched whole in text, like a control
/// token, but decodes as written; control tokens decode to nothing.
#[test]
fn user_defined_tokens_are_matched_whole_and_decoded_as_written() {
    let dir = tempfile::tempdir().unwrap();
    let repo_name = 3u32; // `<repo_name>`, a control token in the file
    let path = edited_metadata(dir.path(), |kv| {
        let types = kv
            .iter_mut()
            .find(|(k, _)| k == "tokenizer.ggml.token_type")
            .unwrap();
        if let Value::Array(v) = &mut types.1 {
            v[repo_name as usize] = Value::I32(4);
        }
    });
    let user = Tokenizer::from_gguf(&path).unwrap();
    let ids = user.encode("a<repo_name>b").unwrap();
    assert!(ids.contains(&repo_name), "{ids:?}");
    assert_eq!(user.decode(&ids).unwrap(), "a<repo_name>b");
    assert_eq!(user.token_bytes(repo_name), b"<repo_name>");
    let control = real();
    let ids = control.encode("a<repo_name>b").unwrap();
    assert!(ids.contains(&repo_name), "{ids:?}");
    assert_eq!(control.decode(&ids).unwrap(), "ab");
}

#[test]
fn stop_ids_are_llama_cpp_s_end_of_generation_tokens() {
    let t = real();
    // <|endoftext|> (0) and <|im_end|> (2, also the EOS id); not <|im_start|>.
    let mut ids: Vec<u32> = t.stop_ids().iter().copied().collect();
    ids.sort();
    assert_eq!(ids, [0, 2]);
}

/// Ids produced by llama.cpp (llama-cpp-python 0.3.36, `tokenize(add_bos=False, special=True)`)
/// for SmolLM2-135M-Instruct.Q4_1.gguf.
const LLAMA_CPP_IDS: &[(&str, &[u32])] = &[
    ("Hello, world!", &[19556, 28, 905, 17]),
    (
        "  leading spaces and\ttabs\nnewline",
        &[216, 2899, 5600, 284, 197, 100, 7366, 198, 28160],
    ),
    (
        "Numbers 12345 and 3.14159",
        &[
            39006, 216, 33, 34, 35, 36, 37, 284, 216, 35, 30, 33, 36, 33, 37, 41,
        ],
    ),
    (
        "Ünïcödé café naïve — 日本語のテキスト",
        &[
            142, 246, 94, 25972, 83, 7466, 84, 2756, 37366, 15486, 46494, 1841, 17097, 241, 115,
            40993, 179, 120, 248, 26453, 11100, 224, 10391, 251, 10391, 134, 11100, 226,
        ],
    ),
    (
        "Emoji: 🚀🔥👍🏽 done",
        &[
            10809, 33777, 42, 15107, 244, 218, 10813, 238, 115, 10813, 235, 231, 10813, 233, 138,
            2294,
        ],
    ),
    (
        "fn main() {\n    println!(\"{}\", x + 1);\n}",
        &[
            7853, 1085, 1000, 1662, 472, 1628, 34115, 17, 43331, 1002, 1792, 1232, 216, 33, 4258,
            198, 109,
        ],
    ),
    (
        "<|im_start|>user\nHi<|im_end|>\n",
        &[1, 4093, 198, 26843, 2, 198],
    ),
];

#[test]
fn ids_match_llama_cpp() {
    let t = real();
    for (text, ids) in LLAMA_CPP_IDS {
        assert_eq!(t.encode(text).unwrap(), *ids, "ids of {text:?}");
    }
}

#[test]
fn round_trips_ascii_whitespace_unicode_emoji_and_code() {
    let t = real();
    for text in [
        "plain ascii text.",
        "  two leading spaces, trailing tab\t and\r\nCRLF\n\n",
        "Ünïcödé café naïve — 日本語のテキスト, Ελληνικά, русский",
        "emoji 🚀🔥👍🏽 and a family 👨‍👩‍👧",
        "fn main() {\n    let x: Vec<u8> = vec![1, 2, 3];\n    println!(\"{x:?}\");\n}\n",
        "12345678901234567890",
    ] {
        let ids = t.encode(text).unwrap();
        assert_eq!(t.decode(&ids).unwrap(), text);
    }
}

#[test]
fn streaming_holds_back_incomplete_utf8_and_matches_full_decode() {
    let t = real();
    let text = "emoji 🚀🔥 then 日本語 end";
    let ids = t.encode(text).unwrap();
    let mut dec = StreamDecoder::default();
    let mut streamed = String::new();
    let mut saw_hold = false;
    for id in &ids {
        let piece = dec.push(&t, *id);
        assert!(
            !piece.contains('\u{FFFD}'),
            "a split character leaked: {piece:?}"
        );
        saw_hold |= dec.is_holding();
        streamed.push_str(&piece);
    }
    streamed.push_str(&dec.finish());
    assert_eq!(streamed, text);
    assert!(saw_hold, "the emoji should span several byte tokens");
}

#[test]
fn chat_template_is_chatml_with_the_default_system_prompt() {
    let t = real();
    let p = t
        .chat_prompt(&[("user".into(), "Hi".into())], &Default::default())
        .unwrap();
    assert_eq!(
        p,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
         <|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
    let p = t
        .chat_prompt(
            &[
                ("system".into(), "Be brief.".into()),
                ("user".into(), "Hi".into()),
            ],
            &Default::default(),
        )
        .unwrap();
    assert!(p.starts_with("<|im_start|>system\nBe brief.<|im_end|>\n"));
    let ids = t.encode(&p).unwrap();
    assert_eq!(ids[0], 1, "<|im_start|> is one control token");
    assert!(t.stop_ids().contains(&2), "<|im_end|> ends generation");
    assert!(
        t.model_name().to_lowercase().contains("smollm2"),
        "{}",
        t.model_name()
    );
}

#[test]
fn from_gguf_reads_only_metadata_and_rejects_garbage() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("x.gguf");
    std::fs::write(&bad, [0u8; 64]).unwrap();
    let err = Tokenizer::from_gguf(&bad).unwrap_err().to_string();
    assert!(err.contains("x.gguf"), "{err}");
}

/// Texts of every kind the pre-tokenizers treat differently: prose, code,
/// digit runs, whitespace runs, newlines, special tokens, multi-byte text.
fn varied_texts() -> Vec<String> {
    let prose = "The quick brown fox jumps over the lazy dog; it's 12345 o'clock.\n\n";
    let code =
        "fn main() {\n    let x: Vec<u32> = (0..100).collect();\n\tprintln!(\"{x:?}\");\n}\n";
    let special = "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n";
    let unicode = "ünïcödé 漢字かな 🚀🚀 ————    \u{a0}\u{a0} ";
    let mut texts = vec![
        prose.repeat(40),
        code.repeat(40),
        special.repeat(60),
        unicode.repeat(60),
        "9".repeat(3000),
        " ".repeat(3000),
        "\n".repeat(3000),
        "=".repeat(3000),
        "a".repeat(3000),
    ];
    texts.push([prose, code, special, unicode].concat().repeat(25));
    texts
}

/// The bound holds: no text has fewer tokens than its bytes divided by the
/// longest token; and `encode_within` never refuses a text that fits, gives
/// a text that fits exactly `encode`'s ids, and never claims more tokens
/// than the text has (prefix pieces near the cut are not counted).
#[test]
fn encode_within_is_exact_when_it_fits_and_a_true_lower_bound_when_not() {
    let t = real();
    let longest = t.max_token_bytes();
    assert!((4..=256).contains(&longest), "{longest}");
    let mut byte_refusals = 0;
    // Long texts: refused by their bytes under small limits, tokenized at the
    // smallest limit the byte bound lets through (`min_tokens`).
    let long = [2_000, 5_000, 20_000].map(|k| "word ".repeat(k));
    for text in varied_texts().into_iter().chain(long) {
        let ids = t.encode(&text).unwrap();
        let n = ids.len();
        assert!(t.min_tokens(&text) <= n, "{n} tokens, {} bytes", text.len());
        for limit in [
            0,
            1,
            7,
            50,
            100,
            200,
            300,
            400,
            n.saturating_sub(1),
            n,
            n + 1,
            4 * n,
            t.min_tokens(&text),
        ] {
            match t.encode_within(&text, limit).unwrap() {
                Within::Ids(got) => {
                    assert!(n <= limit, "{n} tokens let through under limit {limit}");
                    assert_eq!(got, ids);
                }
                Within::TooLong {
                    at_least,
                    tokenized_bytes,
                } => {
                    assert!(n > limit, "{n} tokens refused under limit {limit}");
                    assert!(
                        at_least > limit && at_least <= n,
                        "at_least {at_least}, limit {limit}, actual {n}"
                    );
                    // Either nothing was tokenized (the bytes proved it) or
                    // a text within the byte bound was.
                    assert!(
                        tokenized_bytes == 0 || t.min_tokens(&text) <= limit,
                        "{tokenized_bytes}"
                    );
                    if tokenized_bytes == 0 {
                        byte_refusals += 1;
                    }
                }
            }
        }
    }
    assert!(
        byte_refusals >= 3,
        "the byte bound refused {byte_refusals} times"
    );
}

/// A 1 MB prompt is refused from its length alone (nothing tokenized:
/// `tokenized_bytes` is 0, whatever the machine's speed); a long prompt
/// just past the byte bound has only a bounded prefix tokenized.
#[test]
fn a_huge_text_is_refused_without_tokenizing_it() {
    let t = real();
    let longest = t.max_token_bytes();
    let mb = "word ".repeat(200_000);
    let got = t.encode_within(&mb, 8192).unwrap();
    assert!(
        matches!(got, Within::TooLong { tokenized_bytes: 0, at_least } if at_least == mb.len().div_ceil(longest)),
        "{got:?} (longest token {longest} bytes)"
    );
    // Within the byte bound but over the limit: tokenized (at most
    // 512 × the longest token's bytes) and refused.
    let text = "word ".repeat(512 * longest / 5);
    assert!(t.min_tokens(&text) <= 512);
    match t.encode_within(&text, 512).unwrap() {
        Within::TooLong {
            at_least,
            tokenized_bytes,
        } => {
            assert!(at_least > 512);
            assert_eq!(tokenized_bytes, text.len());
            assert!(text.len() <= 512 * longest);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(t.context_length(), Some(8192), "SmolLM2's trained context");
}
