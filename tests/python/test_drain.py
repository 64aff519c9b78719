"""The drain on SIGTERM / Ctrl-C, as a client sees it (issue 29, item 4).

- A worker told to stop turns `/ready` to 503 at once, refuses new requests
  with a 503 `shutting_down`, lets a stream in flight finish, and exits 0.
- Past `--shutdown-timeout`, a stream in flight ends with an error event and
  `data: [DONE]`: the `openai` client raises the error, a raw reader sees the
  `[DONE]` after it.
- `rngd-pd up` on Ctrl-C drains its children (the gateway first, then the
  workers, then the relay) instead of killing them: a stream through the
  gateway (prefill and decode on two workers) finishes, `up` exits 0 and
  leaves no shm root.
"""

import json
import os
import re
import signal
import time

import httpx
import openai
import pytest
import requests

from conftest import SERVED_MODEL, Proc, model_path, rngd_bin, start_stack, start_worker

PROMPT = "Once upon a time, in a small village by the sea, there lived"


def client(addr):
    return openai.OpenAI(base_url=f"http://{addr}/v1", api_key="unused", max_retries=0, timeout=120)


def stream(addr, max_tokens):
    """A greedy completion stream that runs to `max_tokens` (EOS ignored)."""
    return client(addr).completions.create(
        model=SERVED_MODEL, prompt=PROMPT, max_tokens=max_tokens, temperature=0, stream=True,
        extra_body={"ignore_eos": True})


def wait_not_ready(url, timeout=10):
    deadline = time.monotonic() + timeout
    while True:
        r = requests.get(url + "/ready", timeout=5)
        if r.status_code != 200:
            return r
        assert time.monotonic() < deadline, "/ready still 200 after the signal"
        time.sleep(0.02)


def assert_refused(addr):
    with pytest.raises(openai.APIStatusError) as e:
        client(addr).completions.create(model=SERVED_MODEL, prompt="hi", max_tokens=2)
    assert e.value.status_code == 503, e.value
    assert e.value.body["code"] == "shutting_down", e.value.body


def test_a_worker_drains_refusing_new_requests_and_finishing_the_stream_in_flight():
    p, addr = start_worker("solo", "--shutdown-timeout", "120")
    try:
        s = stream(addr, 48)
        chunks = [next(iter(s))]
        p.p.send_signal(signal.SIGTERM)
        ready = wait_not_ready(f"http://{addr}")
        assert ready.status_code == 503
        # The liveness probe still answers while the worker drains.
        assert requests.get(f"http://{addr}/health", timeout=5).status_code == 200
        assert_refused(addr)
        chunks.extend(s)
        code = p.p.wait(60)
    finally:
        p.stop(signal.SIGKILL)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"], chunks[-3:]
    assert sum(1 for c in chunks if c.choices and c.choices[0].text) >= 40, text
    assert code == 0, f"worker exited with {code}"


def test_past_the_shutdown_timeout_a_stream_ends_with_an_error_event_and_done():
    p, addr = start_worker("solo", "--shutdown-timeout", "0")
    try:
        # Two streams in flight: one read raw, one through the openai client.
        body = {"model": SERVED_MODEL, "prompt": PROMPT, "max_tokens": 400, "temperature": 0,
                "stream": True, "ignore_eos": True}
        with httpx.Client(timeout=120) as h, h.stream("POST", f"http://{addr}/v1/completions", json=body) as raw:
            assert raw.status_code == 200
            lines = raw.iter_lines()
            first = next(l for l in lines if l.startswith("data: "))
            s = stream(addr, 400)
            it = iter(s)
            next(it)
            p.p.send_signal(signal.SIGTERM)
            with pytest.raises(openai.APIError) as e:
                for _ in it:
                    pass
            assert "shut down" in str(e.value), e.value
            events = [first] + [l for l in lines if l.startswith("data: ")]
        code = p.p.wait(60)
    finally:
        p.stop(signal.SIGKILL)
    assert events[-1] == "data: [DONE]", events[-3:]
    error = json.loads(events[-2].removeprefix("data: "))
    assert error["error"]["code"] == "shutting_down", error
    assert error["error"]["type"] == "server_error", error
    # Cut short: far fewer than the 400 tokens asked for.
    assert len(events) < 300, len(events)
    assert code == 0, f"worker exited with {code}"


def test_up_drains_its_stack_on_ctrl_c_and_the_stream_finishes():
    s = start_stack("shm", "--no-kv-events", "--no-ext-proc", "--shutdown-timeout", "120")
    try:
        gw = s.gateway.removeprefix("http://")
        # The relay's figures are on its metrics listener, printed in the summary.
        relay_metrics = s.proc.wait_line("rngd-pd up: relay     metrics", 5)
        assert "rngd_pd_relay_bytes " in requests.get(relay_metrics, timeout=10).text
        # Long enough to be disaggregated: prefill on one worker, decode on another.
        long_prompt = " ".join([PROMPT] * 6)
        st = client(gw).completions.create(
            model=SERVED_MODEL, prompt=long_prompt, max_tokens=48, temperature=0, stream=True,
            extra_body={"ignore_eos": True})
        chunks = [next(iter(st))]
        s.proc.p.send_signal(signal.SIGINT)
        wait_not_ready(s.gateway)
        assert_refused(gw)
        chunks.extend(st)
        code = s.proc.p.wait(120)
    finally:
        s.proc.stop(signal.SIGKILL)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"], chunks[-3:]
    assert code == 0, f"up exited with {code}"
    assert not os.path.exists(s.shm_root), f"shm root {s.shm_root} left behind"
    left = [l for l in s.proc.lines if "panicked" in l]
    assert left == [], left


def test_the_picker_drains_its_ext_proc_streams_on_sigterm(tmp_path):
    """On SIGTERM the picker's gRPC readiness turns NOT_SERVING at once
    (liveness stays SERVING, so the kubelet does not restart it), and an
    ext_proc stream already open (one request Envoy is processing) is still
    answered and routed; then the picker exits 0."""
    import queue
    import threading

    from epp.helpers import (ExtProc, ModelServerFake, body_req, channel, endpoint_json, epg, health_check,
                             immediate, policy_module, post_headers, set_headers)

    fake = ModelServerFake()
    (tmp_path / "endpoints.json").write_text(json.dumps([endpoint_json(fake.address)]))
    e = ExtProc(tmp_path / "endpoints.json", policy_module(), tls=False, extra=["--shutdown-timeout", "60"])
    try:
        sent = queue.Queue()

        def requests_():
            while (m := sent.get()) is not None:
                yield m

        out = []
        ch = channel(e)
        stream = epg.ExternalProcessorStub(ch).Process(requests_(), timeout=60)
        reader = threading.Thread(target=lambda: out.extend(stream), daemon=True)
        reader.start()
        sent.put(post_headers())
        # SIGTERM only once the picker holds the stream (its headers took an
        # admission slot); a fixed sleep raced the stream's setup under load.
        deadline = time.monotonic() + 30
        while not re.search(r"^rngd_pd_epp_in_flight 1$", e.metrics_text(), re.M):
            assert time.monotonic() < deadline, "the picker never admitted the stream"
            time.sleep(0.02)
        e.proc.p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while health_check(e.health, "readiness") == 1:
            assert time.monotonic() < deadline, "readiness still SERVING after SIGTERM"
            time.sleep(0.02)
        assert health_check(e.health, "readiness") == 2  # NOT_SERVING
        assert health_check(e.health, "liveness") == 1
        # The stream in flight is still served: its body is picked and routed.
        body = json.dumps({"model": SERVED_MODEL, "prompt": "Hello", "max_tokens": 2}).encode()
        sent.put(body_req(body, True))
        deadline = time.monotonic() + 30
        while not out:
            assert time.monotonic() < deadline, "no answer to the stream in flight"
            time.sleep(0.02)
        sent.put(None)
        reader.join(30)
        ch.close()
        assert immediate(out) is None, out
        assert "x-gateway-destination-endpoint" in set_headers(out[0]), out
        assert e.proc.p.wait(30) == 0
    finally:
        e.proc.stop(signal.SIGKILL)
        fake.close()
