"""A small Llama-3.1-architecture GGUF loads in our engine and computes what llama.cpp computes.

The model (`llama3_gguf.build`): random weights, the real Llama 3 tokenizer,
Llama 3.1's `llama3` RoPE scaling as `rope_freqs.weight` with an original
context of 64 tokens, GQA (4 query heads over 2 KV heads), F16 matrices.
With random weights "agreeing" means: at every position (prefill path and
decode path, `rngd-pd-bench logits`) the largest logit difference over the
128,256-token vocabulary is under `TOLERANCE` logit standard deviations and
the greedy token is llama.cpp's at ≥ 90 % of the positions (the others are
near-ties), on a short prompt and on one 2.7 times the original context. The same comparison against llama.cpp run on the file *without*
`rope_freqs.weight` fails by far (the scaling is applied, not just
accepted). Tied output embeddings (no `output.weight`) agree the same way.
Through the serving path, a solo worker started with `--model` on the file
greedily generates llama.cpp's arg-max wherever llama.cpp's top-2 margin
exceeds twice the tolerance.

The float64 reference comparison (KL, error bounds) is `test_numerics.py`.
"""

import os
import subprocess
import sys

import numpy as np
import pytest
import requests

sys.path.insert(0, os.path.dirname(__file__))
import llama3_gguf  # noqa: E402
from conftest import Proc, poll_ok, rngd_bin, worker_env  # noqa: E402

# Largest |our logit − llama.cpp's| allowed at a position (the maximum over
# the whole vocabulary), in units of the logits' standard deviation (≈ 4
# here): our int8 weights and activations and bf16 KV cache against
# llama.cpp's F16 weights. Measured: prefill path 0.07–0.08 (f32 projections,
# int8 head), decode path 0.12–0.23 (int8 activations in every projection);
# against llama.cpp without the RoPE scaling: 5.
TOLERANCE = 0.3
# Share of positions whose greedy token must be llama.cpp's.
AGREEMENT = 0.9

ORIG_CTX = 64


def bench_bin():
    b = os.path.join(os.path.dirname(rngd_bin()), "rngd-pd-bench")
    if not os.path.isfile(b):
        pytest.fail(f"rngd-pd-bench not found at {b}: build it with `cargo build --release -p rngd-pd-bench`")
    return b


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama3")
    return {
        "scaled": str(llama3_gguf.build(d / "scaled.gguf", orig_ctx=ORIG_CTX)),
        "plain": str(llama3_gguf.build(d / "plain.gguf", orig_ctx=ORIG_CTX, rope_scaling=False)),
        "tied": str(llama3_gguf.build(d / "tied.gguf", orig_ctx=ORIG_CTX, tied=True)),
    }


SHORT = "The quick brown fox jumps over the lazy dog."
# 171 tokens, well past the 64-token original context (checked in the test).
LONG = (
    "Rust is a systems programming language focused on safety, speed and concurrency. "
    "It achieves memory safety without a garbage collector by using a borrow checker. "
) * 6


def tokenize(model, text):
    import llama_cpp

    llm = llama_cpp.Llama(model_path=model, vocab_only=True, verbose=False)
    return llm.tokenize(text.encode(), add_bos=True, special=True)


def llama_cpp_logits(model, ids):
    """llama.cpp's logits at every position of `ids`, float64 [n, vocab]."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=model, n_ctx=512, n_batch=512, logits_all=True, n_threads=2, verbose=False)
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)], dtype=np.float64)


def our_logits(model, ids, tmp_path, prefill_len=None):
    """Our logits (`rngd-pd-bench logits`): prefill path rows 0..n, or with
    `prefill_len` K the decode path, rows K-1..n."""
    out = tmp_path / "logits.npy"
    args = [bench_bin(), "logits", "--model", model, "--ids", ",".join(map(str, ids)), "--out", str(out)]
    if prefill_len is not None:
        args += ["--prefill-len", str(prefill_len)]
    r = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"rngd-pd-bench logits failed: {r.stderr}"
    return np.load(out).astype(np.float64)


def compare(ours, ref, what):
    """(max |Δlogit| / std, share of positions with the same arg-max)."""
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    std = ref.std()
    err = np.abs(ours - ref).max(axis=1)
    same = ours.argmax(axis=1) == ref.argmax(axis=1)
    print(
        f"{what}: {len(ref)} positions, max |Δlogit| {err.max():.4f} (std {std:.2f}, "
        f"{err.max() / std:.4f} std), greedy equal at {same.sum()}/{len(ref)}"
    )
    return err.max() / std, same.mean()


@pytest.mark.parametrize("path", ["prefill", "decode"])
def test_logits_agree_with_llama_cpp_past_the_original_context(models, tmp_path, path):
    for text in (SHORT, LONG):
        m = models["scaled"]
        ids = tokenize(m, text)
        ref = llama_cpp_logits(m, ids)
        if path == "prefill":
            ours = our_logits(m, ids, tmp_path)
        else:
            k = min(4, len(ids) - 1)
            ours = our_logits(m, ids, tmp_path, prefill_len=k)
            ref = ref[k - 1 :]
        rel, agree = compare(ours, ref, f"{path}, {len(ids)} tokens")
        assert rel < TOLERANCE, f"max |Δlogit| is {rel:.4f} std (limit {TOLERANCE})"
        assert agree >= AGREEMENT, f"greedy tokens equal at only {agree:.0%} of the positions"
    assert len(ids) > 2 * ORIG_CTX, f"the long prompt ({len(ids)} tokens) must go past the original context"


def test_the_rope_scaling_is_applied(models, tmp_path):
    """Against llama.cpp on the same weights without `rope_freqs.weight`, our
    logits past the original context are far off: we do scale."""
    ids = tokenize(models["scaled"], LONG)
    ours = our_logits(models["scaled"], ids, tmp_path)
    scaled = llama_cpp_logits(models["scaled"], ids)
    plain = llama_cpp_logits(models["plain"], ids)
    past = slice(ORIG_CTX, len(ids))
    near, near_agree = compare(ours[past], scaled[past], "ours vs llama.cpp (scaled), past the original context")
    far, far_agree = compare(ours[past], plain[past], "ours vs llama.cpp (no rope_freqs), past the original context")
    assert near < TOLERANCE and near_agree >= AGREEMENT
    assert far > 10 * near, f"without the scaling llama.cpp is only {far:.4f} std away (with it {near:.4f})"
    assert far_agree < 0.5
    # And our file without rope_freqs is llama.cpp's without it.
    ours_plain = our_logits(models["plain"], ids, tmp_path)
    plain_rel, plain_agree = compare(ours_plain, plain, "ours vs llama.cpp, both without rope_freqs")
    assert plain_rel < TOLERANCE and plain_agree >= AGREEMENT


def test_tied_output_embeddings_agree(models, tmp_path):
    m = models["tied"]
    ids = tokenize(m, SHORT)
    rel, agree = compare(our_logits(m, ids, tmp_path), llama_cpp_logits(m, ids), "tied head")
    assert rel < TOLERANCE and agree >= AGREEMENT


def test_a_worker_serves_the_llama3_gguf_with_llama_cpp_s_greedy_tokens(models):
    import llama_cpp

    m = models["scaled"]
    p = Proc("llama3 solo worker", [rngd_bin(), "worker", "--role", "solo", "--port", "0", "--model", m],
             env=worker_env())
    try:
        url = p.wait_line("rngd-pd worker listening on", 300)
        if not url.startswith("http"):
            url = "http://" + url
        poll_ok(url + "/ready", 300, p)
        prompt = tokenize(m, LONG)
        served = requests.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        r = requests.post(url + "/v1/completions", json={
            "model": served, "prompt": prompt, "max_tokens": 12, "temperature": 0,
        }, timeout=120)
        assert r.status_code == 200, r.text
        ours = r.json()["choices"][0]["token_ids"]
        assert len(ours) == 12, ours
    finally:
        p.stop()
    # llama.cpp teacher-forced on our tokens: each of ours is its arg-max
    # wherever its top-2 margin exceeds twice the tolerance (a difference
    # within the tolerance cannot flip it there).
    llm = llama_cpp.Llama(model_path=m, n_ctx=512, logits_all=True, n_threads=2, verbose=False)
    llm.eval(prompt + ours[:-1])
    scores = np.array(llm.scores[len(prompt) - 1 : len(prompt) - 1 + len(ours)], dtype=np.float64)
    std = scores.std()
    top2 = np.sort(scores, axis=1)[:, -2:]
    decisive = (top2[:, 1] - top2[:, 0]) > 2 * TOLERANCE * std
    agree = scores.argmax(axis=1) == np.array(ours)
    print(f"worker greedy: {agree.sum()}/{len(ours)} equal llama.cpp's arg-max, {decisive.sum()} decisive")
    assert agree[decisive].all(), (ours, scores.argmax(axis=1).tolist())
    assert agree.mean() >= AGREEMENT - 0.1, (ours, scores.argmax(axis=1).tolist())


def test_a_worker_refuses_an_unknown_pre_tokenizer_naming_it(tmp_path):
    m = str(llama3_gguf.build(tmp_path / "qwen2-pre.gguf", pre="qwen2"))
    r = subprocess.run([rngd_bin(), "worker", "--role", "solo", "--model", m, "--check"],
                       capture_output=True, text=True, timeout=120, env=worker_env())
    assert r.returncode != 0, r.stdout
    assert "tokenizer.ggml.pre" in r.stderr and "`qwen2`" in r.stderr, r.stderr
