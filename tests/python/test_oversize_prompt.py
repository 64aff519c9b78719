"""Fault row: an 8 MiB prompt through a real Envoy 1.40 and `rngd-pd ext-proc`
(the endpoint picker, counting with the real model's tokenizer) in front of a
real solo worker (issue 24, "length before tokens").

| row | the client sees | what is left | a normal request |
|---|---|---|---|
| one 1 MB prompt (under the picker's body limit) | a JSON 400 `context_length_exceeded` within 5 s | picker RSS growth under 200 MB | served |
| one 8 MiB prompt | a JSON 400 (`context_length_exceeded`), or the 413 of a body limit below it, within 5 s | picker RSS growth under 200 MB | served |

The picker has no compiled context of its own: it bounds tokenization by the
model's trained context (GGUF `llama.context_length`, 8192 for SmolLM2), and
the prompt's bytes prove it cannot fit before any of it is tokenized. Before
the change the picker tokenized it whole: 7 s and 921 MB.

Envoy runs in BUFFERED body mode (the whole body reaches the picker), from
the deploy config, as tests/python/test_envoy_epp.py runs it.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import signal
import sys
import time

import pytest
import requests

from epp.helpers import ExtProc, envoy_binary, policy_module
from conftest import SERVED_MODEL, Proc, free_port, model_path, poll_ok

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "deploy" / "envoy"))
import render  # noqa: E402  (deploy/envoy/render.py)

MODEL = SERVED_MODEL


def rss(pid: int) -> int:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def stack(tmp_path_factory, solo):
    d = tmp_path_factory.mktemp("oversize")
    s = type("Stack", (), {})()
    procs = []
    try:
        worker = solo.removeprefix("http://")
        eps = [{"address": worker, "role": "solo", "vendor": "cpu", "node": "n1", "seq_len": 512, "transports": ["shm"]}]
        (d / "endpoints.json").write_text(json.dumps(eps))
        (d / "policy.json").write_text(json.dumps({"disaggregation_threshold_tokens": 32}))
        shutil.copyfile(policy_module(), d / "policy.wasm")
        s.epp = ExtProc(d / "endpoints.json", d / "policy.wasm", d / "policy.json", model=model_path(), tls=True)
        procs.append(s.epp.proc)
        s.listen, s.admin = free_port(), free_port()
        cfg = render.render({
            "LISTEN_HOST": "127.0.0.1", "LISTEN_PORT": s.listen, "ADMIN_PORT": s.admin,
            "EPP_HOST": s.epp.grpc.rsplit(":", 1)[0], "EPP_PORT": s.epp.grpc.rsplit(":", 1)[1],
            "BODY_MODE": "BUFFERED",
        })
        (d / "envoy.yaml").write_text(cfg)
        envoy = Proc("envoy", [str(envoy_binary()), "-c", str(d / "envoy.yaml"), "--disable-hot-restart", "-l", "warning"])
        procs.append(envoy)
        poll_ok(f"http://127.0.0.1:{s.admin}/ready", 60, envoy)
        s.url = f"http://127.0.0.1:{s.listen}"
        yield s
    finally:
        for p in reversed(procs):
            p.stop(signal.SIGTERM)


def normal(stack):
    r = requests.post(stack.url + "/v1/completions",
                      json={"model": MODEL, "prompt": "Hello there", "max_tokens": 4}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] is not None


def test_a_1_mb_prompt_is_refused_by_its_length(stack):
    normal(stack)
    pid = stack.epp.proc.p.pid
    before = rss(pid)
    body = json.dumps({"model": MODEL, "prompt": "word " * 200_000, "max_tokens": 4})
    started = time.monotonic()
    r = requests.post(stack.url + "/v1/completions", data=body,
                      headers={"content-type": "application/json"}, timeout=60)
    took = time.monotonic() - started
    grown = rss(pid) - before
    print(f"1 MB prompt through Envoy: {r.status_code} in {took:.2f} s, picker RSS +{grown >> 20} MB")
    assert r.status_code == 400, r.text[:500]
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded", err
    assert "context length of 8192 tokens" in err["message"], err
    assert took < 5, took
    assert grown < 200 << 20, grown
    normal(stack)


def test_an_8_mib_prompt_is_refused_quickly_with_json(stack):
    normal(stack)
    pid = stack.epp.proc.p.pid
    before = rss(pid)
    prompt = "word " * (8 * 1024 * 1024 // 5)
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 4})
    started = time.monotonic()
    r = requests.post(stack.url + "/v1/completions", data=body,
                      headers={"content-type": "application/json"}, timeout=60)
    took = time.monotonic() - started
    grown = rss(pid) - before
    print(f"8 MiB prompt through Envoy: {r.status_code} in {took:.2f} s, picker RSS +{grown >> 20} MB")
    # A 400 from the length check, or a 413 if a body limit below 8 MiB
    # refuses it first: either way a JSON error, fast, nothing tokenized.
    assert r.status_code in (400, 413), r.text[:500]
    err = r.json()["error"]
    assert err["message"], err
    if r.status_code == 400:
        assert err["code"] == "context_length_exceeded", err
        assert "context length of 8192 tokens" in err["message"], err
    assert took < 5, took
    assert grown < 200 << 20, grown
    normal(stack)
