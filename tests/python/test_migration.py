"""Answers that survive their decode worker's death, through `rngd-pd up`
(one prefill and two decode workers) and the real `openai` client.

Four streams run at once, two greedy and two seeded (temperature 0.9); once
each has streamed a few tokens, a decode worker is killed with SIGKILL. The
gateway moves each stream that was on it to the other decode worker with
the prompt plus the tokens already streamed (`kv_transfer_params.
resumed_tokens`), and every stream completes with exactly the text and usage
of the same request run without a fault. A whole (non-streamed) answer whose
worker is killed mid-generation is asked again of the other worker and
equals its uninterrupted run too. `rngd-pd up` restarts the killed worker.
"""

import os
import signal
import threading
import time

import openai
import pytest
import requests

from conftest import counter, start_stack, wait_every_endpoint_scraped
from test_up_workers import children

MAX_TOKENS = 80
# `ignore_eos` (vLLM's): every answer runs its MAX_TOKENS, long enough to be
# cut in the middle.
LONG = {"extra_body": {"ignore_eos": True}}
REQUESTS = [
    {"prompt": "Write a short story about a lighthouse keeper and a storm.", "temperature": 0, **LONG},
    {"prompt": "List the planets of the solar system, one line each.", "temperature": 0, **LONG},
    {"prompt": "Describe a walk through an autumn forest.", "temperature": 0.9, "seed": 7, **LONG},
    {"prompt": "Explain how bread is baked, step by step.", "temperature": 0.9, "seed": 11, **LONG},
]


@pytest.fixture(scope="module")
def stack():
    s = start_stack("shm", "--decode-workers", "2")
    s.decode1 = s.proc.wait_line("rngd-pd up: decode-1 ", 5)
    yield s
    assert s.proc.stop() == 0


def client(stack):
    return openai.OpenAI(base_url=stack.gateway + "/v1", api_key="unused", max_retries=0, timeout=300)


def streamed(c, model, req, on_chunk=lambda: None):
    text, usage = [], None
    for ch in c.completions.create(model=model, max_tokens=MAX_TOKENS, stream=True,
                                   stream_options={"include_usage": True}, **req):
        if ch.choices:
            text.append(ch.choices[0].text)
            on_chunk()
        if ch.usage:
            usage = (ch.usage.prompt_tokens, ch.usage.completion_tokens)
    return "".join(text), usage


def worker_pid(stack, url):
    """The pid of the decode worker at `url` (its KV-event topic names it)."""
    name = "decode-0" if url == stack.decode else "decode-1"
    pids = [pid for pid, cmd in children(stack.proc.p.pid).items()
            if " worker --role decode " in cmd and f'"topic":"kv@{name}"' in cmd]
    assert len(pids) == 1, (url, children(stack.proc.p.pid))
    return pids[0]


def metric(url, name):
    for line in requests.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_streams_continue_on_the_other_worker_token_for_token(stack):
    c = client(stack)
    reference = [streamed(c, stack.model, r) for r in REQUESTS]
    assert all(u[1] == MAX_TOKENS and t for t, u in reference), reference

    started = [threading.Event() for _ in REQUESTS]
    results = [None] * len(REQUESTS)

    def run(i):
        seen = [0]

        def tick():
            seen[0] += 1
            if seen[0] == 4:
                started[i].set()

        results[i] = streamed(c, stack.model, REQUESTS[i], tick)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(REQUESTS))]
    for t in threads:
        t.start()
    for e in started:
        assert e.wait(120), "a stream never started"
    # Both decode workers are serving: the in-flight count spread the four.
    victim = stack.decode
    running = counter(victim.removeprefix("http://"), "vllm:num_requests_running")
    os.kill(worker_pid(stack, victim), signal.SIGKILL)
    for t in threads:
        t.join(300)
    assert running > 0, "the killed worker was serving none of the streams"
    for i, (got, want) in enumerate(zip(results, reference)):
        assert got == want, (i, REQUESTS[i], got, want)
    assert metric(stack.gateway, 'rngd_pd_gateway_migrations_total{outcome="continued"}') >= 1


def test_a_whole_answer_is_asked_again_of_the_other_worker(stack):
    c = client(stack)
    # The killed worker is back (rngd-pd up restarted it) and scraped.
    deadline = time.monotonic() + 300
    while True:
        try:
            if requests.get(stack.decode + "/ready", timeout=5).status_code == 200:
                break
        except requests.RequestException:
            pass
        assert time.monotonic() < deadline, "the killed decode worker did not come back"
        time.sleep(0.2)
    wait_every_endpoint_scraped(stack.gateway)
    req = {"prompt": "Tell the history of the printing press in detail.", "temperature": 0.9, "seed": 3, **LONG}
    want = c.completions.create(model=stack.model, max_tokens=MAX_TOKENS, **req)
    before = metric(stack.gateway, 'rngd_pd_gateway_migrations_total{outcome="continued"}')
    out = {}
    t = threading.Thread(target=lambda: out.setdefault(
        "r", c.completions.create(model=stack.model, max_tokens=MAX_TOKENS, **req)))
    t.start()
    # Kill whichever decode worker is generating it, once it is.
    victim = None
    deadline = time.monotonic() + 60
    while victim is None and time.monotonic() < deadline:
        for url in (stack.decode, stack.decode1):
            if counter(url.removeprefix("http://"), "vllm:num_requests_running") > 0:
                victim = url
                break
        time.sleep(0.02)
    assert victim, "no decode worker ran the request"
    os.kill(worker_pid(stack, victim), signal.SIGKILL)
    t.join(300)
    got = out["r"]
    assert got.choices[0].text == want.choices[0].text
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (want.usage.prompt_tokens,
                                                                      want.usage.completion_tokens)
    assert metric(stack.gateway, 'rngd_pd_gateway_migrations_total{outcome="continued"}') == before + 1
