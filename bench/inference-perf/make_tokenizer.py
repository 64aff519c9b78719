"""Writes a Hugging Face tokenizer directory (`tokenizer.json`,
`tokenizer_config.json`) for a GGUF model, from the vocabulary, merges and
special tokens in the file itself, for clients that want one (inference-perf
counts prompt tokens with it). Byte-level BPE, as this project's engine reads
these models.

    python make_tokenizer.py MODEL.gguf OUT_DIR
"""

import json
import sys
from pathlib import Path

from gguf import GGUFReader
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, AddedToken

CONTROL = 3


def field(r, key):
    f = r.fields[key]
    return [bytes(f.parts[i]).decode("utf-8") if f.types[-1].name == "STRING" else f.parts[i].tolist()[0]
            for i in f.data]


def main(model, out):
    r = GGUFReader(model)
    tokens = field(r, "tokenizer.ggml.tokens")
    merges = field(r, "tokenizer.ggml.merges")
    types = field(r, "tokenizer.ggml.token_type")
    eos = field(r, "tokenizer.ggml.eos_token_id")[0]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                     merges=[tuple(m.split(" ", 1)) for m in merges], ignore_merges=False)
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t, ty in zip(tokens, types) if ty == CONTROL])
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": tokens[eos],
        "model_max_length": 8192,
    }))


if __name__ == "__main__":
    main(*sys.argv[1:3])
