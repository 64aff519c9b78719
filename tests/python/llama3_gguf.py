"""A small Llama-3.1-architecture GGUF with random weights and the real Llama 3 tokenizer.

`build(path, *, seed=0, ...)` writes the file and returns its path; the CLI is
`python3 tests/python/llama3_gguf.py OUT.gguf [--seed N] [--tied] [--weights f32|f16|q8_0]`.

What is in the file:
- the vocabulary of Llama 3 (PyPI `llama-models`, `llama_models/llama3/tokenizer.model`:
  tiktoken ranks of 128,000 byte strings) plus its 256 special tokens, as a GGUF
  `gpt2` tokenizer: tokens written in GPT-2's byte-to-character alphabet, merges
  reconstructed from the ranks (every split of a token into two tokens is a
  merge, ordered by the merged token's rank, then by the ranks of the
  two parts), `tokenizer.ggml.pre = "llama-bpe"`, BOS added, special tokens of
  type 3 (control);
- a Llama 3 chat template in `tokenizer.chat_template`;
- Llama 3.1's RoPE scaling, written the way llama.cpp's converter writes it: no
  `rope.scaling.type`, a `rope_freqs.weight` tensor of per-frequency divisors
  computed with the `llama3` rule (factor 8, low/high frequency factors 1 and 4,
  original context `orig_ctx`, 64 by default so that short test prompts go past it);
- random weights (seeded, numpy's PCG64), scaled so the logits are spread out
  (greedy choices are not near-ties), in F32 (norms, rope_freqs) and `weights`
  (the matrices).

Building takes a few seconds (the merges); the file is ~35 MB with F16 matrices.
"""

import argparse
import base64
import functools
import math
import os

import numpy as np

import gguf

# Llama 3's special tokens (llama_models.llama3.tokenizer, in id order after the
# 128,000 ranked tokens), then reserved ones up to 256.
SPECIAL_TOKENS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|step_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
    "<|image|>",
]
NUM_SPECIAL = 256

# A Llama 3 (3.1-style) chat template: system header with the knowledge and
# current dates, one header + content + <|eot_id|> per message, the assistant
# header as generation prompt.
CHAT_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- if not date_string is defined %}\n"
    "    {%- set date_string = strftime_now('%d %b %Y') %}\n"
    "{%- endif %}\n"
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system_message = messages[0]['content'] | trim %}\n"
    "    {%- set messages = messages[1:] %}\n"
    "{%- else %}\n"
    "    {%- set system_message = '' %}\n"
    "{%- endif %}\n"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}\n"
    "{{- 'Cutting Knowledge Date: December 2023\\n' }}\n"
    "{{- 'Today Date: ' + date_string + '\\n\\n' }}\n"
    "{{- system_message }}\n"
    "{{- '<|eot_id|>' }}\n"
    "{%- for message in messages %}\n"
    "    {%- if message['role'] not in ['user', 'assistant', 'ipython'] %}\n"
    "        {{- raise_exception('unsupported role ' + message['role']) }}\n"
    "    {%- endif %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}\n"
    "    {{- message['content'] | trim + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)


def tokenizer_model_path():
    """Path of Llama 3's tiktoken file in the installed `llama-models` package."""
    import llama_models

    p = os.path.join(os.path.dirname(llama_models.__file__), "llama3", "tokenizer.model")
    if not os.path.isfile(p):
        raise FileNotFoundError(f"{p} is missing: pip install llama-models==0.3.0")
    return p


def load_ranks(path=None):
    """The tiktoken ranks: {token bytes: rank}, ranks 0..N-1."""
    ranks = {}
    with open(path or tokenizer_model_path(), "rb") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            b64, rank = line.split()
            ranks[base64.b64decode(b64)] = int(rank)
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError("tokenizer.model ranks are not 0..N-1")
    return ranks


@functools.lru_cache(maxsize=1)
def byte_alphabet():
    """GPT-2's byte → printable character table (bytes that print stand for
    themselves, the others are moved to U+0100 and up, in byte order)."""
    printable = set(range(0x21, 0x7F)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(0x100 + extra)
            extra += 1
    return table


def to_gguf_text(token: bytes) -> str:
    t = byte_alphabet()
    return "".join(t[b] for b in token)


def merges_from_ranks(ranks):
    """BPE merges equivalent to tiktoken's rank-ordered merging.

    tiktoken merges, at each step, the adjacent pair whose concatenation has the
    lowest rank. A BPE merge list gives the same result when every way of
    writing a token as two tokens is a merge, ranked by the merged token's rank
    (ties: the ranks of the left, then the right part)."""
    out = []
    for token, rank in ranks.items():
        if len(token) < 2:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            rl, rr = ranks.get(left), ranks.get(right)
            if rl is not None and rr is not None:
                out.append((rank, rl, rr, left, right))
    out.sort()
    return [f"{to_gguf_text(left)} {to_gguf_text(right)}" for _, _, _, left, right in out]


@functools.lru_cache(maxsize=2)
def llama3_vocab(path=None):
    """(tokens, token_types, merges) of the Llama 3 tokenizer in GGUF form."""
    ranks = load_ranks(path)
    by_rank = sorted(ranks.items(), key=lambda kv: kv[1])
    tokens = [to_gguf_text(t) for t, _ in by_rank]
    types = [int(gguf.TokenType.NORMAL)] * len(tokens)
    specials = special_tokens()
    tokens += specials
    types += [int(gguf.TokenType.CONTROL)] * len(specials)
    return tokens, types, merges_from_ranks(ranks)


def special_tokens():
    """All 256 special tokens in id order (after the 128,000 ranked ones)."""
    return SPECIAL_TOKENS + [
        f"<|reserved_special_token_{2 + i}|>" for i in range(NUM_SPECIAL - len(SPECIAL_TOKENS))
    ]


def special_id(name):
    """Id of a Llama 3 special token, e.g. `<|begin_of_text|>` → 128000."""
    return 128000 + special_tokens().index(name)


def llama3_rope_factors(head_dim, base, *, factor, low_freq_factor, high_freq_factor, orig_ctx):
    """Per-frequency divisors of Llama 3.1's `llama3` RoPE scaling
    (`rope_freqs.weight`: θ_i = pos · base^(−2i/d) / f_i)."""
    i = np.arange(0, head_dim, 2, dtype=np.float64)
    freq = base ** (-i / head_dim)
    wavelen = 2.0 * math.pi / freq
    low_wavelen = orig_ctx / low_freq_factor  # longer than this: divided by `factor`
    high_wavelen = orig_ctx / high_freq_factor  # shorter than this: unchanged
    out = np.empty_like(freq)
    for k, (f, w) in enumerate(zip(freq, wavelen)):
        if w < high_wavelen:
            new = f
        elif w > low_wavelen:
            new = f / factor
        else:
            smooth = (orig_ctx / w - low_freq_factor) / (high_freq_factor - low_freq_factor)
            new = (1.0 - smooth) * f / factor + smooth * f
        out[k] = f / new
    return out.astype(np.float32)


def _matrix_type(weights):
    return {
        "f32": gguf.GGMLQuantizationType.F32,
        "f16": gguf.GGMLQuantizationType.F16,
        "q8_0": gguf.GGMLQuantizationType.Q8_0,
    }[weights]


def _add_matrix(w, name, m, weights):
    qt = _matrix_type(weights)
    if qt == gguf.GGMLQuantizationType.F32:
        w.add_tensor(name, m.astype(np.float32))
    elif qt == gguf.GGMLQuantizationType.F16:
        w.add_tensor(name, m.astype(np.float16))
    else:
        q = gguf.quants.quantize(m.astype(np.float32), qt)
        w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qt)


def build(
    path,
    *,
    seed=0,
    layers=2,
    hidden=64,
    heads=4,
    kv_heads=2,
    ffn=128,
    rope_base=500000.0,
    rope_factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    orig_ctx=64,
    context_length=512,
    tied=False,
    rope_scaling=True,
    pre="llama-bpe",
    weights="f16",
    logit_scale=0.5,
    name="Llama-3.1-tiny-random",
):
    """Writes the GGUF to `path` and returns `path`. Same arguments, same bytes.

    `tied`: no `output.weight` (the head is the embedding table). `rope_scaling`
    False: no `rope_freqs.weight` (plain RoPE; the weights are the same as with
    it for the same seed). `pre`: the `tokenizer.ggml.pre` written (tests of
    the refusal of unknown names)."""
    head_dim = hidden // heads
    if hidden % heads or heads % kv_heads:
        raise ValueError(f"inconsistent shape: hidden {hidden}, heads {heads}, kv_heads {kv_heads}")
    tokens, types, merges = llama3_vocab()
    vocab = len(tokens)
    rng = np.random.default_rng(seed)

    def normal(shape, std):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(name)
    w.add_context_length(context_length)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_rope_dimension_count(head_dim)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(rope_base)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_file_type({"f32": 0, "f16": 1, "q8_0": 7}[weights])

    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(special_id("<|begin_of_text|>"))
    w.add_eos_token_id(special_id("<|eot_id|>"))
    w.add_add_bos_token(True)
    w.add_chat_template(CHAT_TEMPLATE)

    # Embeddings ~ N(0, 1); projections ~ N(0, 1/fan_in) so activations stay O(1);
    # norms near 1; the head scaled by `logit_scale` (logit std ≈ logit_scale·√hidden).
    embd = normal((vocab, hidden), 1.0)
    _add_matrix(w, "token_embd.weight", embd, weights)
    w.add_tensor("output_norm.weight", 1.0 + normal((hidden,), 0.1))
    if not tied:
        _add_matrix(w, "output.weight", normal((vocab, hidden), logit_scale), weights)
    factors = llama3_rope_factors(
        head_dim,
        rope_base,
        factor=rope_factor,
        low_freq_factor=low_freq_factor,
        high_freq_factor=high_freq_factor,
        orig_ctx=orig_ctx,
    )
    if rope_scaling:
        w.add_tensor("rope_freqs.weight", factors)
    inv = 1.0 / math.sqrt(hidden)
    for i in range(layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", 1.0 + normal((hidden,), 0.1))
        _add_matrix(w, p + "attn_q.weight", normal((heads * head_dim, hidden), 2.0 * inv), weights)
        _add_matrix(w, p + "attn_k.weight", normal((kv_heads * head_dim, hidden), 2.0 * inv), weights)
        _add_matrix(w, p + "attn_v.weight", normal((kv_heads * head_dim, hidden), inv), weights)
        _add_matrix(w, p + "attn_output.weight", normal((hidden, heads * head_dim), inv), weights)
        w.add_tensor(p + "ffn_norm.weight", 1.0 + normal((hidden,), 0.1))
        _add_matrix(w, p + "ffn_gate.weight", normal((ffn, hidden), inv), weights)
        _add_matrix(w, p + "ffn_up.weight", normal((ffn, hidden), inv), weights)
        _add_matrix(w, p + "ffn_down.weight", normal((hidden, ffn), 1.0 / math.sqrt(ffn)), weights)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="output GGUF path")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tied", action="store_true", help="no output.weight (head tied to token_embd)")
    ap.add_argument("--weights", choices=["f32", "f16", "q8_0"], default="f16")
    ap.add_argument("--orig-ctx", type=int, default=64)
    a = ap.parse_args()
    print(build(a.out, seed=a.seed, tied=a.tied, weights=a.weights, orig_ctx=a.orig_ctx))


if __name__ == "__main__":
    main()
