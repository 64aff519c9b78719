//! Tokenizer tests: llama.cpp's ids on the real model's metadata, round trips,
//! chat rendering, and streaming detokenization.

mod common;

use rngd_engine::tokenizer::{StreamDecoder, Tokenizer};

fn real() -> Tokenizer {
    Tokenizer::from_gguf(&common::real_model()).expect("tokenizer from GGUF metadata")
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
    let p = t.chat_prompt(&[("user".into(), "Hi".into())]).unwrap();
    assert_eq!(
        p,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
         <|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
    let p = t
        .chat_prompt(&[
            ("system".into(), "Be brief.".into()),
            ("user".into(), "Hi".into()),
        ])
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
