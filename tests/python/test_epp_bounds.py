"""The endpoint picker bounds its work, through real Envoy 1.40 (the deploy
config, Envoy → picker over TLS, FULL_DUPLEX_STREAMED), and client headers
never steer routing.

Model servers are the fakes of `epp.helpers` (they echo the headers they
receive, so what Envoy forwarded is visible); the picker counts prompts with
the real model's tokenizer and routes with the real pd_default.wasm. The
picker runs with `--max-inflight-body-bytes 8388608` (8 MiB) so the budget is
reached by a few dozen stalled clients.

Each row checks what the client saw, what was left (the picker's RSS from
/proc/<pid>/status, its body-bytes gauge, its /metrics size) and that a
normal request still works.

Measured here (2026-12-02, 2 shared vCPUs, `pytest -s` prints them), picker
RSS growth: one 8 MiB prompt +96 KiB (413 in 1.07 s, the client's upload
through Envoy included; before the fix: 921 MB and 7 s), four at once
+1.2 MB (before: 2.9 GB), 40 stalled 30 MiB bodies +1.2 MB (before:
+1,270 MB), 40 stalled 1 MB bodies under the limit +15 MB (8 admitted by
the 8 MiB budget, 32 answered 429); 300 random model names: /metrics
11,807 -> 12,245 bytes (before: 3.2 KB -> 2.49 MB). The bounds below (32,
48, 32 and 64 MiB; 20 KB) leave room above those.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import string
import subprocess
import sys
import threading
import time

import pytest
import requests

from conftest import SERVED_MODEL, Proc, counter, free_port, model_path, poll_ok
from epp.envoy_stack import SUBSET_HINT_HEADER, open_post, read_response, rss_kb, with_subset_hint_filter
from epp.helpers import REPO, ExtProc, ModelServerFake, endpoint_json, envoy_binary, policy_module

sys.path.insert(0, str(REPO / "deploy" / "envoy"))
import render  # noqa: E402  (deploy/envoy/render.py)

MODEL = SERVED_MODEL
BUDGET = 8 << 20
MIB = 1 << 20


class Stack:
    pass


@pytest.fixture(scope="module")
def st(tmp_path_factory):
    s = Stack()
    d = tmp_path_factory.mktemp("epp-bounds")
    # Two decode fakes, one loaded (the policy prefers the idle one), and a prefill fake.
    s.busy = ModelServerFake(waiting=20, running=4, kv=0.6)
    s.idle = ModelServerFake()
    s.prefill = ModelServerFake()
    procs = []
    try:
        eps = [endpoint_json(s.busy.address), endpoint_json(s.idle.address),
               endpoint_json(s.prefill.address, role="prefill")]
        (d / "endpoints.json").write_text(json.dumps(eps))
        (d / "policy.json").write_text(json.dumps({"disaggregation_threshold_tokens": 32}))
        s.epp = ExtProc(d / "endpoints.json", policy_module(), d / "policy.json", model=model_path(), tls=True,
                        extra=["--max-inflight-body-bytes", str(BUDGET)])
        procs.append(s.epp.proc)
        s.listen, s.admin = free_port(), free_port()
        cfg = render.render({
            "LISTEN_HOST": "127.0.0.1", "LISTEN_PORT": s.listen, "ADMIN_PORT": s.admin,
            "EPP_HOST": s.epp.grpc.rsplit(":", 1)[0], "EPP_PORT": s.epp.grpc.rsplit(":", 1)[1],
            "BODY_MODE": "FULL_DUPLEX_STREAMED",
        })
        (d / "envoy.yaml").write_text(with_subset_hint_filter(cfg))
        s.envoy = Proc("envoy", [str(envoy_binary()), "-c", str(d / "envoy.yaml"), "--disable-hot-restart", "-l", "warning"])
        procs.append(s.envoy)
        poll_ok(f"http://127.0.0.1:{s.admin}/ready", 60, s.envoy)
        s.url = f"http://127.0.0.1:{s.listen}"
        # Polled, not slept: the first scrapes make the fakes healthy.
        deadline = time.monotonic() + 60
        while normal(s, check=False).status_code != 200:
            assert time.monotonic() < deadline, "no request routed within 60 s"
            time.sleep(0.1)
        yield s
    finally:
        for p in reversed(procs):
            p.stop(signal.SIGTERM)
        for f in (s.busy, s.idle, s.prefill):
            f.close()


def normal(s, check=True, headers=None, prompt="Hi", model=MODEL, **extra):
    r = requests.post(s.url + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 2, **extra},
                      headers=headers or {}, timeout=60)
    if check:
        assert r.status_code == 200, r.text
    return r


def picker_rss(s) -> int:
    return rss_kb(s.epp.proc.p.pid)


def body_bytes_in_flight(s) -> float:
    return counter(s.epp.metrics, "rngd_pd_epp_body_bytes_in_flight")


def wait_body_bytes_zero(s, timeout=30):
    deadline = time.monotonic() + timeout
    while body_bytes_in_flight(s) != 0:
        assert time.monotonic() < deadline, f"body bytes still reserved: {body_bytes_in_flight(s)}"
        time.sleep(0.05)


def error_json(text: str) -> dict:
    err = json.loads(text)["error"]
    assert set(err) >= {"message", "type", "param", "code"}, err
    return err


# ---- body size -------------------------------------------------------------------------


def test_an_8_mib_prompt_is_refused_fast_with_json_and_no_memory(st):
    before = picker_rss(st)
    t0 = time.monotonic()
    r = normal(st, check=False, prompt="word " * (8 * MIB // 5))
    took = time.monotonic() - t0
    assert r.status_code == 413, r.text
    err = error_json(r.text)
    assert err["code"] == "request_too_large" and err["type"] == "invalid_request_error", err
    assert took < 5, f"took {took:.2f} s"
    grew = picker_rss(st) - before
    print(f"one 8 MiB prompt: {r.status_code} in {took:.3f} s, picker RSS +{grew} KiB")
    assert grew < 32 * 1024, f"picker RSS grew {grew} KiB"
    wait_body_bytes_zero(st)
    normal(st)


def test_four_8_mib_prompts_at_once(st):
    before = picker_rss(st)
    results = []

    def one():
        results.append(normal(st, check=False, prompt="word " * (8 * MIB // 5)))

    ts = [threading.Thread(target=one) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert [r.status_code for r in results] == [413] * 4, [r.text for r in results]
    grew = picker_rss(st) - before
    print(f"four 8 MiB prompts: picker RSS +{grew} KiB")
    assert grew < 48 * 1024, f"picker RSS grew {grew} KiB"
    normal(st)


def test_stalled_30_mib_bodies_are_refused_at_their_headers(st):
    """40 clients declare 30 MiB and stall after 64 KiB: each is answered 413
    (JSON) without its body; the picker holds nothing for them."""
    before = picker_rss(st)
    socks = []
    try:
        for _ in range(40):
            socks.append(open_post("127.0.0.1", st.listen, "/v1/completions",
                                   {"content-type": "application/json", "content-length": str(30 * MIB)},
                                   b'{"model":"' + MODEL.encode() + b'","prompt":"' + b"x" * 65536))
        for sock in socks:
            status, _, body = read_response(sock)
            assert status == 413, body
            assert error_json(body.decode())["code"] == "request_too_large"
        assert body_bytes_in_flight(st) == 0
        grew = picker_rss(st) - before
        print(f"40 stalled 30 MiB bodies: picker RSS +{grew} KiB")
        assert grew < 32 * 1024, f"picker RSS grew {grew} KiB"
        normal(st)
    finally:
        for sock in socks:
            sock.close()


def test_stalled_bodies_under_the_limit_stay_within_the_budget(st):
    """40 clients declare 1 MB (under the 1 MiB limit) and stall after 900 kB:
    the budget (8 MiB) admits 8, the other 32 get 429 with Retry-After at
    their headers; the picker's memory grows by about the admitted bytes; a
    normal request still works meanwhile, and the bytes return when the
    stalled clients go away."""
    before = picker_rss(st)
    declared, sent = 1_000_000, 900_000
    prefix = b'{"model":"' + MODEL.encode() + b'","prompt":"' + b"x" * (sent - 40)
    socks = []
    refused, held = 0, []
    try:
        for _ in range(40):
            socks.append(open_post("127.0.0.1", st.listen, "/v1/completions",
                                   {"content-type": "application/json", "content-length": str(declared)}, prefix))
        for sock in socks:
            try:
                status, headers, body = read_response(sock, timeout=2)
            except TimeoutError:
                held.append(sock)  # admitted: the picker waits for the rest of its body
                continue
            assert status == 429, body
            # Retry-After: the queue timeout in seconds (default 5 s).
            assert headers.get("retry-after") == "5", headers
            assert error_json(body.decode())["code"] == "server_overloaded"
            refused += 1
        assert (len(held), refused) == (BUDGET // declared, 40 - BUDGET // declared)
        assert body_bytes_in_flight(st) == len(held) * declared
        grew = picker_rss(st) - before
        print(f"40 stalled 1 MB bodies: {len(held)} held, {refused} refused, picker RSS +{grew} KiB")
        assert grew < 64 * 1024, f"picker RSS grew {grew} KiB with {len(held)} bodies held"
        assert counter(st.epp.metrics, 'rngd_pd_epp_overload_rejections_total{reason="body_budget"}') >= refused
        # A normal request (a small body) still fits beside the held ones.
        normal(st)
    finally:
        for sock in socks:
            sock.close()
    wait_body_bytes_zero(st)
    normal(st)


# ---- labels ----------------------------------------------------------------------------


def test_random_model_names_leave_metrics_bounded(st):
    normal(st)
    before = len(st.epp.metrics_text())
    rng = random.Random(7)
    for i in range(300):
        model = "".join(rng.choices(string.ascii_lowercase, k=24))
        # Half refused as models nobody serves (404), half by a rule first (400).
        extra = {} if i % 2 == 0 else {"temperature": -1}
        r = normal(st, check=False, model=model, **extra)
        assert r.status_code == (404 if i % 2 == 0 else 400), r.text
        if i % 2 == 0:
            assert r.json()["error"]["code"] == "model_not_found", r.text
    text = st.epp.metrics_text()
    print(f"300 random models: /metrics {before} -> {len(text)} bytes")
    assert len(text) < before + 20_000, f"/metrics grew from {before} to {len(text)} bytes"
    # Only the served names (the GGUF's own and the file's stem, each on the
    # page from the start) and `other` label series.
    names = set(re.findall(r'model_name="([^"]*)"', text))
    stem = os.path.basename(model_path()).removesuffix(".gguf")
    assert "other" in names and names <= {"other", SERVED_MODEL, stem}, names
    p = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    normal(st)


def test_the_picker_exports_gies_scheduler_and_process_families(st):
    """GIE's scheduler families (the whole pick, the policy plugin's part,
    the build info), the per-model normalized TPOT and the process families
    are on the picker's page and pass promtool."""
    normal(st)
    text = st.epp.metrics_text()

    def sample(series):
        line = next((l for l in text.splitlines() if l.startswith(series + " ")), None)
        assert line is not None, f"{series} missing"
        return float(line.rsplit(" ", 1)[1])

    assert sample("inference_extension_scheduler_e2e_duration_seconds_count") >= 1
    plugin = 'extension_point="Picker",plugin_name="policy",plugin_type="wasm-policy"'
    assert sample(f"inference_extension_plugin_duration_seconds_count{{{plugin}}}") >= 1
    info = [l for l in text.splitlines() if l.startswith("inference_extension_info{")]
    assert len(info) == 1 and info[0].endswith(" 1") and 'build_ref="' in info[0], info
    assert "# TYPE inference_objective_normalized_time_per_output_token_seconds histogram" in text
    assert re.search(r'inference_objective_normalized_time_per_output_token_seconds_count\{model_name="[^"]+"', text)
    assert sample("process_resident_memory_bytes") > 1e6
    assert sample("process_open_fds") > 0
    p = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr


# ---- steering headers ------------------------------------------------------------------


def served_by(s, before):
    return [f.address for f in (s.busy, s.idle, s.prefill) if len(f.seen) > before[f.address]]


def test_a_client_subset_header_does_not_pin_a_pod(st):
    """The client names the loaded pod in `x-gateway-destination-endpoint-subset`:
    the policy still picks the idle one, and the header is not forwarded."""
    for _ in range(5):
        before = {f.address: len(f.seen) for f in (st.busy, st.idle, st.prefill)}
        r = normal(st, headers={"x-gateway-destination-endpoint-subset": st.busy.address,
                                "x-gateway-destination-endpoint": st.busy.address})
        assert served_by(st, before) == [st.idle.address]
        echo = r.json()
        assert "x-gateway-destination-endpoint-subset" not in echo["headers"], echo["headers"]
        assert echo["headers"]["x-gateway-destination-endpoint"] == st.idle.address
    # The same hint from Envoy's metadata (the trusted filter) does narrow the pool.
    before = {f.address: len(f.seen) for f in (st.busy, st.idle, st.prefill)}
    normal(st, headers={SUBSET_HINT_HEADER: st.busy.address})
    assert served_by(st, before) == [st.busy.address]


def test_a_client_prefiller_header_never_reaches_the_decode_worker(st):
    """Short prompt (no PD): the client's `x-prefiller-host-port` is removed;
    long prompt (PD): it is replaced by the prefill pod the policy chose."""
    evil = "127.0.0.1:1"
    r = normal(st, headers={"x-prefiller-host-port": evil, "x-rngd-pd-kv-transport": "tcp"})
    h = r.json()["headers"]
    assert "x-prefiller-host-port" not in h and "x-rngd-pd-kv-transport" not in h, h
    long_prompt = "The history of the printing press begins in the fifteenth century, " * 4
    r = normal(st, prompt=long_prompt, headers={"x-prefiller-host-port": evil})
    h = r.json()["headers"]
    assert h.get("x-prefiller-host-port") == st.prefill.address, h
    assert evil not in json.dumps(h)
