"""A real solo worker's prefix cache, seen from outside as a router sees it:
the `openai` client's `usage.prompt_tokens_details.cached_tokens`, vLLM's
render endpoint, and the worker's KV events read by the independent consumer
of `test_kv_events.py` (vLLM's msgspec schema over pyzmq).

The worker runs with `--kv-events-config` on loopback ports it picks (printed
on stdout), a prefix cache of 8 blocks (so eviction happens within a few
requests), and the admin API (`POST /reset_prefix_cache`) on a free loopback
port with a bearer token.
"""

import os
import signal

import openai
import pytest
import requests
import zmq

from conftest import SERVED_MODEL, Proc, model_path, poll_ok, rngd_bin, worker_env
from vllm_kv_events import DECODER, END_SEQ, AllBlocksCleared, BlockRemoved, BlockStored

TOPIC = "kv@solo@SmolLM2"
TOKEN = "python-tests-worker-admin-token"
BLOCK = 16
# One block of 16 positions of SmolLM2-135M: 30 layers x K and V x 3 kv heads
# x 64 x 16 positions x 2 bytes.
BLOCK_BYTES = 30 * 2 * 3 * 64 * BLOCK * 2
BLOCKS = 8


@pytest.fixture(scope="module")
def worker():
    cfg = (
        '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://127.0.0.1:*",'
        f'"replay_endpoint":"tcp://127.0.0.1:*","topic":"{TOPIC}"}}'
    )
    proc = Proc(
        "solo worker (kv events)",
        [rngd_bin(), "worker", "--role", "solo", "--port", "0", "--model", model_path(),
         "--prefix-cache-bytes", str(BLOCKS * BLOCK_BYTES), "--kv-events-config", cfg,
         "--admin-listen", "127.0.0.1:0"],
        env=worker_env(RNGD_PD_ADMIN_TOKEN=TOKEN),
    )
    try:
        events = proc.wait_line("rngd-pd worker kv events on ", 120)
        pub, _, replay = events.partition(" replay ")
        admin = "http://" + proc.wait_line("rngd-pd worker admin on http://", 120)
        url = "http://" + proc.wait_line("rngd-pd worker listening on http://", 300)
        poll_ok(url + "/ready", 600, proc)
        yield {"url": url, "pub": pub, "replay": replay, "admin": admin}
    finally:
        proc.stop(signal.SIGTERM)


class Events:
    """Every batch of the worker, in order, with the block index a router keeps."""

    def __init__(self, w):
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
        self.sub.connect(w["pub"])
        self.replay_ep = w["replay"]
        self.seqs = []
        self.events = []
        self.index = {}

    def drain(self, until, timeout_ms=10_000):
        """Reads batches until `until(self)` holds."""
        while not until(self):
            assert self.sub.poll(timeout_ms), "no KV event batch came"
            topic, seq, payload = self.sub.recv_multipart()
            assert topic == TOPIC.encode()
            self.take(int.from_bytes(seq, "big"), payload)

    def take(self, seq, payload):
        if self.seqs:
            assert seq == self.seqs[-1] + 1, f"batch {seq} after {self.seqs[-1]}"
        self.seqs.append(seq)
        for e in DECODER.decode(payload).events:
            self.events.append(e)
            if isinstance(e, BlockStored):
                assert e.block_size == BLOCK and e.medium == "GPU"
                assert len(e.token_ids) == BLOCK * len(e.block_hashes)
                assert e.parent_block_hash is None or e.parent_block_hash in self.index, \
                    f"parent {e.parent_block_hash} unknown: the chain is broken"
                parent = e.parent_block_hash
                for i, h in enumerate(e.block_hashes):
                    self.index[h] = (parent, e.token_ids[i * BLOCK:(i + 1) * BLOCK])
                    parent = h
            elif isinstance(e, BlockRemoved):
                for h in e.block_hashes:
                    assert h in self.index, f"removed unknown block {h}"
                    del self.index[h]
            else:
                assert isinstance(e, AllBlocksCleared)
                self.index.clear()

    def chain_tokens(self, leaf):
        """The tokens from the root to `leaf`, by parent links."""
        out = []
        while leaf is not None:
            parent, toks = self.index[leaf]
            out[:0] = toks
            leaf = parent
        return out

    def replay_all(self):
        d = self.ctx.socket(zmq.DEALER)
        d.connect(self.replay_ep)
        d.send_multipart([b"", (0).to_bytes(8, "big")])
        out = []
        while True:
            assert d.poll(10_000), "replay did not answer"
            _, seq, payload = d.recv_multipart()
            if seq == END_SEQ:
                d.close(0)
                return out
            out.append((int.from_bytes(seq, "big"), payload))


def client(w):
    return openai.OpenAI(base_url=w["url"] + "/v1", api_key="unused", max_retries=0)


def render_ids(w, prompt):
    r = requests.post(w["url"] + "/v1/completions/render",
                      json={"model": SERVED_MODEL, "prompt": prompt, "max_tokens": 4}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()[0]["token_ids"]


PROMPT = ("A short history of the lighthouse keepers of the northern coast, told by the "
          "last of them: the storms, the ships, the long winter nights, the lamps and the "
          "logbooks, and the day the light was switched to run on its own. ")


def test_the_cache_seen_through_events_render_and_cached_tokens(worker):
    ev = Events(worker)
    c = client(worker)
    ids = render_ids(worker, PROMPT)
    assert len(ids) >= 3 * BLOCK, len(ids)

    first = c.completions.create(model=SERVED_MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens == len(ids)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # The prompt's full blocks are announced, their token ids those render gave.
    full = len(ids) // BLOCK
    ev.drain(lambda e: any(e.chain_tokens(h) == ids[:full * BLOCK] for h in e.index))

    # The same prompt again, streamed: the cached blocks are reused, and the
    # final usage chunk says how many tokens came from the cache.
    stream = c.completions.create(model=SERVED_MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                  stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    usage = chunks[-1].usage
    cached = usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % BLOCK == 0 and cached < len(ids), cached
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == first.choices[0].text, "a warm prefill gave other tokens"

    # A different salt never hits.
    salted = c.completions.create(model=SERVED_MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                  extra_body={"cache_salt": "tenant-b"})
    assert salted.usage.prompt_tokens_details.cached_tokens == 0
    assert salted.choices[0].text == first.choices[0].text

    # More distinct prompts than the budget holds: blocks are evicted and
    # announced as removed; the index never holds more than the budget.
    for i in range(4):
        p = f"Variation {i}: " + PROMPT[::-1] + f" ({i})"
        r = c.completions.create(model=SERVED_MODEL, prompt=p, max_tokens=2, temperature=0)
        assert r.usage.prompt_tokens_details.cached_tokens == 0
    ev.drain(lambda e: any(isinstance(x, BlockRemoved) for x in e.events))
    ev.drain(lambda e: len(e.index) <= BLOCKS, timeout_ms=5_000)

    # The admin API: no token → 401 and nothing dropped; the token → 200 and
    # AllBlocksCleared; then nothing hits.
    r = requests.post(worker["admin"] + "/reset_prefix_cache", timeout=10)
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert "bearer token" in r.json()["error"]["message"]
    r = requests.post(worker["admin"] + "/reset_prefix_cache?reset_external=true",
                      headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "reset_external"
    r = requests.post(worker["admin"] + "/reset_prefix_cache",
                      headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    assert r.status_code == 200, r.text
    ev.drain(lambda e: isinstance(e.events[-1], AllBlocksCleared))
    assert ev.index == {}
    again = c.completions.create(model=SERVED_MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == 0
    assert again.choices[0].text == first.choices[0].text
    # The public listener has no admin route.
    assert requests.post(worker["url"] + "/reset_prefix_cache", timeout=10).status_code == 404

    # A subscriber that joins now recovers the whole history by replay: the
    # same batches, in order, from sequence 0.
    ev.drain(lambda e: len(e.index) > 0)
    replayed = Events(worker)
    for seq, payload in ev.replay_all():
        replayed.take(seq, payload)
    assert replayed.seqs[0] == 0
    assert replayed.seqs == ev.seqs[: len(replayed.seqs)]
    assert replayed.seqs[-1] >= ev.seqs[-1]

    # The counters scrapers read, in tokens.
    m = requests.get(worker["url"] + "/metrics", timeout=10).text
    hits = sum(float(line.rsplit(" ", 1)[1]) for line in m.splitlines()
               if line.startswith("vllm:prefix_cache_hits_total"))
    assert hits >= cached
    assert f'num_gpu_blocks="{BLOCKS}"' in m and 'block_size="16"' in m
