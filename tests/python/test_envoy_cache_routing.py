"""Routing on cached prefixes through a real Envoy 1.40 with `rngd-pd ext-proc`
as its endpoint picker (TLS, the deploy config), in front of three real
workers on the real model: one prefill worker and two decode workers, each
publishing its KV events (vLLM's format). The picker learns the streams from
the endpoints file (`kv_events`, `kv_events_replay` fields), not from flags.

- A three-turn conversation, through the `openai` client, lands every turn on
  the decode worker that holds it; `cached_tokens` grows; turns 2 and 3 skip
  the remote prefill (the response header `x-rngd-pd-route-reason: cached`).
- A decode worker whose stream goes down (the file points the picker at a
  publisher that does not answer) is routed on load alone: the picker's
  `rngd_pd_kv_index_stream_up` drops to 0, its lookups count as
  `stream_down`, and one WARN line names it; requests are still served.

The policy configuration of this test weighs the cache more than the
defaults (`prefix_weight` 10, `disaggregation_threshold_tokens` 48), so the
assertions do not depend on the load figures the picker scraped a few
milliseconds earlier.
"""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import signal
import sys
import time

import openai
import pytest

from conftest import SERVED_MODEL, Proc, converse, counter, free_port, model_path, poll_ok, start_worker
from epp.helpers import ExtProc, envoy_binary, policy_module

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "deploy" / "envoy"))
import render  # noqa: E402  (deploy/envoy/render.py)

EVENTS = ('{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://127.0.0.1:*",'
          '"replay_endpoint":"tcp://127.0.0.1:*"}')

SYSTEM = ("You keep the records of a mountain observatory. You answer questions about its telescopes, "
          "the weather on the summit and the comets seen from it, in one short sentence.")


def events_worker(role, *extra):
    proc, addr = start_worker(role, "--kv-events-config", EVENTS, *extra)
    pub, _, replay = proc.wait_line("rngd-pd worker kv events on ", 10).partition(" replay ")
    return proc, addr, pub, replay


def endpoint(addr, role, pub, replay):
    return {"address": addr, "role": role, "vendor": "cpu", "node": "n1", "seq_len": 512,
            "transports": ["shm"], "kv_events": pub, "kv_events_replay": replay}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = type("Stack", (), {})()
    d = tmp_path_factory.mktemp("envoy-cache")
    procs = []
    try:
        p_proc, s.prefill, p_pub, p_replay = events_worker("prefill")
        procs.append(p_proc)
        s.decode = []
        s.entries = [endpoint(s.prefill, "prefill", p_pub, p_replay)]
        for _ in range(2):
            proc, addr, pub, replay = events_worker("decode", "--prefill-allow", s.prefill)
            procs.append(proc)
            s.decode.append(addr)
            s.entries.append(endpoint(addr, "decode", pub, replay))
        s.endpoints = d / "endpoints.json"
        s.endpoints.write_text(json.dumps(s.entries))
        (d / "policy.json").write_text(json.dumps({"disaggregation_threshold_tokens": 48, "prefix_weight": 10}))
        policy = d / "policy.wasm"
        shutil.copyfile(policy_module(), policy)
        s.log = d / "ext-proc.log"
        s.epp = ExtProc(s.endpoints, policy, d / "policy.json", model=model_path(), tls=True,
                        log=open(s.log, "w"))
        procs.append(s.epp.proc)
        listen, admin = free_port(), free_port()
        host, port = s.epp.grpc.rsplit(":", 1)
        cfg = render.render({"LISTEN_HOST": "127.0.0.1", "LISTEN_PORT": listen, "ADMIN_PORT": admin,
                             "EPP_HOST": host, "EPP_PORT": port, "BODY_MODE": "FULL_DUPLEX_STREAMED"})
        (d / "envoy.yaml").write_text(cfg)
        envoy = Proc("envoy", [str(envoy_binary()), "-c", str(d / "envoy.yaml"), "--disable-hot-restart",
                               "-l", "warning"])
        procs.append(envoy)
        poll_ok(f"http://127.0.0.1:{admin}/ready", 60, envoy)
        s.url = f"http://127.0.0.1:{listen}"
        # Every stream replayed and live before the first request.
        wait_metric(s, lambda m: all(stream_up(m, a) == 1 for a in [s.prefill, *s.decode]), "every stream up")
        yield s
    finally:
        for p in reversed(procs):
            p.stop(signal.SIGTERM)


def sample(text: str, name: str, **labels) -> float | None:
    """The value of one sample of `name` with exactly these labels, or None."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(f"{name}{{{want}}} ") or (not labels and line.startswith(f"{name} ")):
            return float(line.rsplit(" ", 1)[1])
    return None


def stream_up(metrics: str, addr: str) -> float | None:
    return sample(metrics, "rngd_pd_kv_index_stream_up", endpoint=addr)


def wait_metric(s, cond, what, timeout=60):
    deadline = time.monotonic() + timeout
    while True:
        m = s.epp.metrics_text()
        if cond(m):
            return m
        if time.monotonic() > deadline:
            pytest.fail(f"the picker's metrics never showed {what}:\n" +
                        "\n".join(line for line in m.splitlines() if "kv_index" in line or "prefix" in line))
        time.sleep(0.1)


def served(s) -> list[float]:
    return [counter(a, "vllm:request_success_total") for a in s.decode]


def test_a_conversation_stays_on_the_worker_that_holds_it(stack):
    c = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "Which telescope is the oldest?"}]
    where, reasons, cached, prompts = converse(c, SERVED_MODEL, messages, ["Why?", "And then?"],
                                               lambda: served(stack))
    # One decode worker served all three turns.
    assert all(len(w) == 1 for w in where), where
    assert where[0] == where[1] == where[2], where
    # The first turn is cold and long: disaggregated. The later ones find the
    # conversation cached there and prefill only the new tokens locally.
    assert reasons[0] == "disaggregated", reasons
    assert reasons[1:] == ["cached", "cached"], reasons
    assert cached[0] == 0, cached
    assert 0 < cached[1] < cached[2] < prompts[2], (cached, prompts)
    assert all(n % 16 == 0 for n in cached), cached
    m = stack.epp.metrics_text()
    assert sample(m, "rngd_pd_route_decisions_total", reason="cached") >= 2, m
    assert sample(m, "rngd_pd_prefix_lookups_total", result="indexed") >= 9, m
    # The index gauges are refreshed at each 500 ms sync (docs/kv-index.md).
    held = stack.decode[where[0][0]]
    wait_metric(stack, lambda m: (sample(m, "rngd_pd_kv_index_blocks", endpoint=held) or 0) > 0,
                f"blocks indexed for {held}", timeout=10)


def test_a_stream_that_goes_down_falls_back_to_load_with_a_metric_and_a_log_line(stack):
    down = stack.decode[1]
    # The file now points the picker at a publisher that never answers (a
    # port nothing listens on): its first replay fails, the stream is broken.
    entries = [dict(e) for e in stack.entries]
    dead = f"tcp://127.0.0.1:{free_port()}"
    for e in entries:
        if e["address"] == down:
            e["kv_events"], e["kv_events_replay"] = dead, f"tcp://127.0.0.1:{free_port()}"
    stack.endpoints.write_text(json.dumps(entries))
    try:
        # Its first replay gets no answer within the index's replay timeout (2 s).
        wait_metric(stack, lambda m: stream_up(m, down) == 0 and stream_up(m, stack.decode[0]) == 1
                    and (sample(m, "rngd_pd_kv_index_stream_faults_total", endpoint=down, fault="replay_failed")
                         or 0) >= 1,
                    f"{down}'s stream down after a failed replay")
        before = sample(stack.epp.metrics_text(), "rngd_pd_prefix_lookups_total", result="stream_down")
        c = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        r = c.completions.create(model=SERVED_MODEL, prompt="The summit weather today is", max_tokens=2,
                                 temperature=0)
        assert r.choices[0].text is not None
        m = stack.epp.metrics_text()
        assert sample(m, "rngd_pd_prefix_lookups_total", result="stream_down") == before + 1, m
        log = stack.log.read_text()
        lines = [line for line in log.splitlines() if "KV-event stream down" in line and down in line]
        assert len(lines) >= 1, log[-4000:]
        assert re.search(r"WARN", lines[0]), lines[0]
    finally:
        stack.endpoints.write_text(json.dumps(stack.entries))
    # Back on the real stream, it is replayed and live again.
    wait_metric(stack, lambda m: stream_up(m, down) == 1, f"{down}'s stream back up")
