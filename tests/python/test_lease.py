"""The KV lease, with real processes: a prefill worker and a decode worker
sharing an shm root whose unread KV is swept after 1 s (`AIRM_KV_SHM_TTL_S`,
`AIRM_KV_TCP_TTL_S`: the handle's lease is 1 s too), and a gateway that
disaggregates every prompt of 8 tokens or more.

- KV swept before the decode's pull: the decode worker answers 410
  `kv_unavailable` at once (not after its 30 s pull timeout), nothing pulled.
- A lease that is over (1 s plus the 5 s clock-skew allowance): 410
  `kv_unavailable` naming the lease, at once.
- Through the gateway (its `--kv-load-failure-policy` default `recompute`):
  a decode worker stopped (SIGSTOP) between the prefill and the decode until
  the KV is swept answers with the refusal when it resumes, and the gateway
  serves the request whole on it with the prefill's seed: the client gets the
  same text as the run without a fault.
- A client that goes away between the prefill and the decode: no KV file is
  left and no engine slot stays taken; the next request is served.
"""

import json
import os
import pathlib
import signal
import threading
import time

import pytest
import requests

from conftest import SERVED_MODEL, Proc, counter, model_path, poll_ok, rngd_bin, start_worker, worker_env

TTL = {"AIRM_KV_SHM_TTL_S": "1", "AIRM_KV_TCP_TTL_S": "1"}
PROMPT = "Write three sentences about the old stone bridge over the river in winter."


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    shm = str(tmp_path_factory.mktemp("shm"))
    env = dict(TTL, PD_SHM_ROOT=shm)
    procs = []
    try:
        prefill, pre = start_worker("prefill", env=env)
        procs.append(prefill)
        decode, dec = start_worker("decode", env=env)
        procs.append(decode)
        cfg = tmp_path_factory.mktemp("lease") / "policy.json"
        cfg.write_text(json.dumps({"disaggregation_threshold_tokens": 8, "same_node_transport": "shm"}))
        gw = Proc("gateway", [rngd_bin(), "gateway", "--listen", "127.0.0.1:0", "--prefill", f"http://{pre}",
                              "--decode", f"http://{dec}", "--policy-config", str(cfg), "--model", model_path()],
                  env=dict(os.environ))
        procs.append(gw)
        url = gw.wait_line("rngd-pd gateway listening on", 120)
        poll_ok(url + "/ready", 120, gw)

        class PD:
            pass

        s = PD()
        s.url, s.prefill, s.decode, s.shm, s.decode_proc = url, pre, dec, shm, decode
        yield s
    finally:
        for p in reversed(procs):
            p.stop(signal.SIGTERM)


def kv_files(shm):
    return [str(p) for p in pathlib.Path(shm).rglob("*.kv") if p.is_file()]


def wait_until(what, cond, within=10):
    deadline = time.monotonic() + within
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not within {within} s"
        time.sleep(0.05)


def prefill(pd):
    r = requests.post(f"http://{pd.prefill}/v1/completions", timeout=60, json={
        "model": SERVED_MODEL, "prompt": PROMPT, "max_tokens": 8, "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]


def decode(pd, params):
    t = time.monotonic()
    r = requests.post(f"http://{pd.decode}/v1/completions", timeout=60, json={
        "model": SERVED_MODEL, "prompt": PROMPT, "max_tokens": 8, "kv_transfer_params": params})
    return r, time.monotonic() - t


def test_kv_swept_before_the_pull_is_refused_at_once(pd):
    params = prefill(pd)
    wait_until("the unread KV swept", lambda: not kv_files(pd.shm))
    before = counter(pd.decode, 'rngd_pd_worker_kv_load_failures_total{reason="not_found"}')
    r, took = decode(pd, params)
    assert r.status_code == 410, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("kv_unavailable", "kv_transfer_params"), err
    assert "no longer holds it" in err["message"], err
    assert took < 2, f"refused after {took:.1f} s (the pull timeout is 30 s)"
    assert counter(pd.decode, 'rngd_pd_worker_kv_load_failures_total{reason="not_found"}') == before + 1


def test_a_lease_that_is_over_is_refused_at_once(pd):
    params = prefill(pd)
    # The lease (1 s) and the clock-skew allowance (5 s) pass.
    time.sleep(6.5)
    r, took = decode(pd, params)
    assert r.status_code == 410, r.text
    err = r.json()["error"]
    assert err["code"] == "kv_unavailable" and "lease ended" in err["message"], err
    assert took < 2, took
    assert counter(pd.decode, 'rngd_pd_worker_kv_load_failures_total{reason="expired"}') >= 1
    assert kv_files(pd.shm) == []


def test_the_gateway_recomputes_a_lost_handoff_with_the_same_text(pd):
    body = {"model": SERVED_MODEL, "prompt": PROMPT, "max_tokens": 16, "temperature": 0.9, "seed": 21}
    want = requests.post(pd.url + "/v1/completions", json=body, timeout=120)
    assert want.status_code == 200, want.text
    assert want.headers.get("x-rngd-pd-route-reason") == "disaggregated", want.headers
    out = {}
    os.kill(pd.decode_proc.p.pid, signal.SIGSTOP)
    try:
        t = threading.Thread(target=lambda: out.setdefault(
            "r", requests.post(pd.url + "/v1/completions", json=body, timeout=120)))
        t.start()
        # The prefill answered and its KV was swept while the decode worker
        # was stopped.
        wait_until("the prefill's KV pushed", lambda: kv_files(pd.shm), within=30)
        wait_until("the unread KV swept", lambda: not kv_files(pd.shm))
    finally:
        os.kill(pd.decode_proc.p.pid, signal.SIGCONT)
    t.join(120)
    r = out["r"]
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == want.json()["choices"][0]["text"]
    assert r.json()["usage"] == want.json()["usage"]
    assert counter(pd.url.removeprefix("http://"), 'rngd_pd_gateway_kv_load_failures_total{policy="recompute"}') >= 1


def test_a_client_gone_between_prefill_and_decode_leaves_nothing(pd):
    body = {"model": SERVED_MODEL, "prompt": PROMPT, "max_tokens": 16, "temperature": 0}
    os.kill(pd.decode_proc.p.pid, signal.SIGSTOP)
    try:
        with pytest.raises(requests.exceptions.Timeout):
            requests.post(pd.url + "/v1/completions", json=body, timeout=1.5)
    finally:
        os.kill(pd.decode_proc.p.pid, signal.SIGCONT)
    wait_until("no KV left and no slot taken",
               lambda: not kv_files(pd.shm) and counter(pd.decode, "vllm:num_requests_running") == 0
               and counter(pd.decode, "vllm:num_requests_waiting") == 0)
    r = requests.post(pd.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
