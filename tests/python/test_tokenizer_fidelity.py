"""Our token ids equal llama.cpp's, string for string, for SmolLM2 and for Llama 3.

The ids are the engine's (`rngd-pd-bench tokenize`: `Tokenizer::encode`, the
serving path's encoding, special tokens in the text parsed, BOS as the model
says) and llama.cpp's (`llama_cpp.Llama(path, vocab_only=True).tokenize(text,
add_bos=True, special=True)`, the same convention). The strings: a fixed
battery (ASCII, Unicode, CJK, emoji, code, digit runs, whitespace runs,
newlines, contractions, special tokens) and 300 seeded random mixes of the
same kinds of characters. For Llama 3 the ids of the texts without special
tokens are also tiktoken's on the original `tokenizer.model` ranks, which
checks the GGUF the test builds (merges reconstructed from the ranks).
"""

import json
import os
import random
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import llama3_gguf  # noqa: E402
from conftest import model_path, rngd_bin  # noqa: E402

BATTERY = [
    "Hello, world!",
    "  leading spaces and\ttabs\nnewline",
    "Numbers 12345 and 3.14159",
    "1234567890123456789012345678901234567890",
    "a 1 22 333 4444 55555 666666 7777777",
    "Ünïcödé café naïve — 日本語のテキスト",
    "中文分词测试，标点符号。한국어 텍스트",
    "Ελληνικά, русский, עברית, العربية, हिन्दी",
    "Emoji: 🚀🔥👍🏽 done 👨‍👩‍👧",
    'fn main() {\n    println!("{}", x + 1);\n}',
    "def f(x):\n\tif x:\n\t\treturn x**2  # comment\n",
    "I'm, you're, he'll, we'd, they've, it's, DON'T, I'M, She'S",
    "   \n\n\n   spaces   and\r\nCRLF  \t\t end   ",
    "trailing spaces   ",
    "\n",
    " ",
    "<|im_start|>user\nHi<|im_end|>\n",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>",
    "text <|eot_id|> more <|reserved_special_token_5|>",
    "<|im_start|> not closed <|im_end",
    "$$$ 100% ~~~ ||| <=> ^^^ +++ ... !!!",
    "https://example.com/path?q=1&r=2#frag",
    "x" * 50 + " " + "ab" * 30,
    '{"key": [1, 2.5e-3, null, true], "k2": "v\\n"}',
    "\u00a0non-breaking\u2003em space\u200bzero width",
]

POOLS = [
    "abcXYZ", "0123456789", " ", "  ", "\n", "\r\n", "\t", "'s't're've'm'll'd'S'T",
    ".,;:!?-_()[]{}<>\"'`~@#$%^&*+=|\\/", "éüñßøÅÆ", "日本語中文한국어", "🚀🔥👍🏽👨‍👩‍👧",
    "\u0301\u0308", "\u00a0\u2003\u200b\u3000", "١٢٣٤٥", "Ⅷ½²",
    "<|im_start|>", "<|eot_id|>", "<|begin_of_text|>",
]


def random_mixes(n=300, seed=1):
    """Strings of 1–12 pieces, each a character of a pool or a whole pool."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        pieces = []
        for _ in range(rng.randint(1, 12)):
            pool = rng.choice(POOLS)
            pieces.append(rng.choice(pool) if rng.random() < 0.7 else pool)
        out.append("".join(pieces))
    return out


TEXTS = BATTERY + random_mixes()


def bench_bin():
    b = os.path.join(os.path.dirname(rngd_bin()), "rngd-pd-bench")
    if not os.path.isfile(b):
        pytest.fail(f"rngd-pd-bench not found at {b}: build it with `cargo build --release -p rngd-pd-bench`")
    return b


def our_ids(model, texts):
    """(report, ids per text) from `rngd-pd-bench tokenize`."""
    args = [bench_bin(), "tokenize", "--model", model]
    for t in texts:
        args += ["--text", t]
    r = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"rngd-pd-bench tokenize failed: {r.stderr}"
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(out["ids"]) == len(texts)
    return out, out["ids"]


def llama_cpp_ids(model, texts):
    import llama_cpp

    llm = llama_cpp.Llama(model_path=model, vocab_only=True, verbose=False)
    return [llm.tokenize(t.encode(), add_bos=True, special=True) for t in texts]


def assert_all_equal(ours, ref, texts, what):
    bad = [(t, o, r) for t, o, r in zip(texts, ours, ref) if o != r]
    report = "\n".join(f"{t!r}:\n  ours      {o}\n  llama.cpp {r}" for t, o, r in bad[:10])
    print(f"{what}: ids equal for {len(texts) - len(bad)}/{len(texts)} strings")
    assert not bad, f"{what}: {len(bad)}/{len(texts)} strings tokenize differently:\n{report}"


@pytest.fixture(scope="module")
def llama3_model(tmp_path_factory):
    return str(llama3_gguf.build(tmp_path_factory.mktemp("llama3") / "llama3-tiny.gguf"))


def test_smollm2_ids_equal_llama_cpp():
    m = model_path()
    if not os.path.isfile(m):
        pytest.fail(f"model {m} not found: run `rngd-pd model fetch` or set RNGD_PD_MODEL")
    report, ours = our_ids(m, TEXTS)
    assert report["pre"] == "smollm" and report["add_bos"] is False, report
    assert_all_equal(ours, llama_cpp_ids(m, TEXTS), TEXTS, "SmolLM2")


def test_llama3_ids_equal_llama_cpp(llama3_model):
    report, ours = our_ids(llama3_model, TEXTS)
    assert report["pre"] == "llama-bpe" and report["add_bos"] is True, report
    assert_all_equal(ours, llama_cpp_ids(llama3_model, TEXTS), TEXTS, "Llama 3")
    bos = llama3_gguf.special_id("<|begin_of_text|>")
    assert all(ids[0] == bos for ids in ours), "every Llama 3 encoding starts with BOS"
    # Special tokens written in the text are one id each.
    i = TEXTS.index("text <|eot_id|> more <|reserved_special_token_5|>")
    assert llama3_gguf.special_id("<|eot_id|>") in ours[i]
    assert llama3_gguf.special_id("<|reserved_special_token_5|>") in ours[i]


def test_llama3_ids_equal_tiktoken_on_the_original_ranks(llama3_model):
    """The GGUF's merges reproduce tiktoken's merging of the original ranks."""
    import tiktoken

    ranks = llama3_gguf.load_ranks()
    specials = llama3_gguf.special_tokens()
    enc = tiktoken.Encoding(
        name="llama3",
        pat_str=r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        mergeable_ranks=ranks,
        special_tokens={t: len(ranks) + i for i, t in enumerate(specials)},
    )
    plain = [t for t in TEXTS if "<|" not in t]
    _, ours = our_ids(llama3_model, plain)
    bos = llama3_gguf.special_id("<|begin_of_text|>")
    ref = [[bos] + enc.encode(t, disallowed_special=()) for t in plain]
    assert_all_equal(ours, ref, plain, "Llama 3 vs tiktoken")
