"""A worker with chunked prefill on (`--enable-chunked-prefill
--max-num-batched-tokens 16`) through the real `openai` client: a long
prompt, prefilled in 16-token chunks while other streams decode beside it,
gives exactly the tokens of the session's unchunked solo worker, streamed
and not. (Bit-equality of the chunks themselves, and that the running
streams get tokens between chunks, are checked at the engine level in
worker/engine/tests/chunked.rs.)
"""

import concurrent.futures
import subprocess

import openai
import pytest
from conftest import SERVED_MODEL, greedy_completion, rngd_bin, start_worker

PARAGRAPH = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based inks and a wooden press adapted from wine making. "
)
# About 300 tokens: 20 or so chunks under a budget of 16 less the decodes.
LONG = PARAGRAPH * 9 + "In short,"
SHORT = "Three primary colors are"


@pytest.fixture(scope="module")
def chunked():
    proc, addr = start_worker("solo", "--enable-chunked-prefill", "--max-num-batched-tokens", "16")
    try:
        yield "http://" + addr
    finally:
        proc.stop()


def test_a_chunked_long_prompt_beside_running_streams_equals_unchunked(chunked, solo):
    want_long = greedy_completion(solo, LONG, 24)
    want_short = greedy_completion(solo, SHORT, 64)
    assert want_long["usage"]["prompt_tokens"] > 250, want_long["usage"]
    client = openai.OpenAI(base_url=chunked + "/v1", api_key="unused", max_retries=0, timeout=300)

    def streamed_short():
        stream = client.completions.create(model=SERVED_MODEL, prompt=SHORT, max_tokens=64, temperature=0,
                                           stream=True)
        return "".join(c.choices[0].text for c in stream if c.choices)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        # Two streams decoding while the long prompt is prefilled in chunks.
        shorts = [pool.submit(streamed_short) for _ in range(2)]
        long = pool.submit(greedy_completion, chunked, LONG, 24)
        got_long = long.result(timeout=300)
        got_shorts = [f.result(timeout=300) for f in shorts]
    assert got_long["choices"][0]["text"] == want_long["choices"][0]["text"]
    # The counts; not `cached_tokens`, which depends on what each worker
    # served before (the session's solo worker is shared).
    for k in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert got_long["usage"][k] == want_long["usage"][k], (k, got_long["usage"], want_long["usage"])
    for text in got_shorts:
        assert text == want_short["choices"][0]["text"]


def test_a_budget_below_the_smallest_step_is_refused_at_check():
    r = subprocess.run([rngd_bin(), "worker", "--max-num-batched-tokens", "4", "--check"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "below the smallest prefill step, 8 tokens" in r.stderr, r.stderr
