"""Compiled variants on a running worker (issue 28, item 2): `POST
/switch_variant {"seq_len", "max_batch"}` on the worker's admin listener.

- A worker started at S = 512 switches to S = 1024 (batch 4) without
  re-reading its weights: the same `weight_version`, `/v1/models` shows
  `max_model_len` 1024, and a prompt of about 700 tokens is now answered
  with the tokens and log-probabilities of a worker started with
  `--seq-len 1024 --batch 4`.
- Switched to S = 256 the worker refuses a 300-token prompt; switched back
  to 512 it swaps to the variant it kept prepared (`was_prepared`), listed
  with its memory cost in `GET /variants`.
- The routers follow: a gateway over a prefill and a decode worker
  disaggregates a 300-token prompt; once the prefill worker switches to
  S = 256 and the gateway's scrape has read its
  `rngd_pd_worker_variant_info`, its policy no longer sends that prompt to
  it (route reason `no_prefill_endpoint`) and the decode worker answers
  alone, with the same tokens; before that scrape, the prefill worker's
  refusal makes the gateway fall back to the decode worker
  (`prefill_context_fallback`), never a failed request. A short prompt is
  still disaggregated: the decode worker (S = 512) takes the trimmed KV of
  the prefill worker's S = 256 variant.
"""

import os
import signal
import time

import requests

from conftest import (SERVED_MODEL, Proc, model_path, poll_ok, rngd_bin, start_worker, wait_every_endpoint_scraped,
                      worker_env)

TOKEN = "variants-admin-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
LONG = "The tide came in over the flats, slow and grey, and the birds rose. " * 40
MID = "A lantern swung above the harbour wall while the boats came home. " * 20


def scored(addr, prompt, max_tokens=6):
    r = requests.post(f"http://{addr}/v1/completions",
                      json={"model": SERVED_MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                            "logprobs": 3},
                      timeout=300)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    return c["token_ids"], c["logprobs"]["token_logprobs"], c["logprobs"]["top_logprobs"]


def max_model_len(addr):
    return requests.get(f"http://{addr}/v1/models", timeout=10).json()["data"][0]["max_model_len"]


def prompt_tokens(addr, prompt):
    r = requests.post(f"http://{addr}/tokenize", json={"model": SERVED_MODEL, "prompt": prompt}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["count"]


def test_a_variant_switch_serves_a_longer_context_with_the_tokens_of_a_fresh_start():
    proc = Proc("variant worker", [rngd_bin(), "worker", "--role", "decode", "--port", "0", "--model", model_path(),
                                   "--seq-len", "512", "--batch", "2", "--admin-listen", "127.0.0.1:0"],
                env=worker_env(RNGD_PD_ADMIN_TOKEN=TOKEN))
    fresh_proc = None
    try:
        admin = "http://" + proc.wait_line("rngd-pd worker admin on http://", 120)
        url = proc.wait_line("rngd-pd worker listening on http://", 300)
        poll_ok(f"http://{url}/ready", 600, proc)
        version = requests.get(f"http://{url}/v1/models", timeout=10).json()["data"][0]["weight_version"]
        r = requests.post(f"http://{url}/v1/completions",
                          json={"model": SERVED_MODEL, "prompt": LONG, "max_tokens": 4}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text

        r = requests.post(admin + "/switch_variant", json={"seq_len": 1024, "max_batch": 4}, headers=AUTH,
                          timeout=300)
        assert r.status_code == 200, r.text
        a = r.json()
        assert (a["seq_len"], a["max_batch"], a["was_prepared"]) == (1024, 4, False), a
        assert max_model_len(url) == 1024
        assert requests.get(f"http://{url}/v1/models", timeout=10).json()["data"][0]["weight_version"] == version
        metrics = requests.get(f"http://{url}/metrics", timeout=10).text
        assert 'seq_len="1024"' in metrics and 'seq_len="512"' not in metrics, metrics
        n_long, n_mid = prompt_tokens(url, LONG), prompt_tokens(url, MID)
        assert 600 < n_long < 1000 and 256 < n_mid < 500, (n_long, n_mid)

        # Tokens and log-probabilities of a worker started with the variant.
        fresh_proc, fresh = start_worker("decode", "--seq-len", "1024", "--batch", "4")
        for p in (LONG, MID, "The capital of France is"):
            assert scored(url, p) == scored(fresh, p)

        # A shorter context: the worker's admission follows at once.
        r = requests.post(admin + "/switch_variant", json={"seq_len": 256}, headers=AUTH, timeout=300)
        assert r.status_code == 200, r.text
        assert r.json()["max_batch"] == 4
        r = requests.post(f"http://{url}/v1/completions",
                          json={"model": SERVED_MODEL, "prompt": MID, "max_tokens": 4}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text

        # Back to the start: a swap to the variant kept prepared.
        r = requests.post(admin + "/switch_variant", json={"seq_len": 512, "max_batch": 2}, headers=AUTH,
                          timeout=300)
        assert r.status_code == 200 and r.json()["was_prepared"] is True, r.text
        v = requests.get(admin + "/variants", headers=AUTH, timeout=10).json()["variants"]
        assert [(x["seq_len"], x["max_batch"], x["active"]) for x in v] == [
            (512, 2, True), (1024, 4, False), (256, 4, False)], v
        # bf16 K and V of 30 layers x 3 KV heads x 64 per position, per slot and the prefill cache.
        assert v[0]["kv_cache_bytes"] == 30 * 3 * 64 * 2 * 2 * 512 * 3, v
        assert max_model_len(url) == 512
    finally:
        for p in (fresh_proc, proc):
            if p is not None:
                p.stop(signal.SIGTERM)


def test_the_gateway_stops_sending_prompts_a_prefill_variant_cannot_hold(tmp_path):
    env = {"PD_SHM_ROOT": str(tmp_path / "shm")}
    procs = []
    try:
        prefill_proc = Proc("prefill worker", [rngd_bin(), "worker", "--role", "prefill", "--port", "0", "--model",
                                               model_path(), "--admin-listen", "127.0.0.1:0"],
                            env=worker_env(RNGD_PD_ADMIN_TOKEN=TOKEN, **env))
        procs.append(prefill_proc)
        admin = "http://" + prefill_proc.wait_line("rngd-pd worker admin on http://", 120)
        prefill = prefill_proc.wait_line("rngd-pd worker listening on http://", 300)
        poll_ok(f"http://{prefill}/ready", 600, prefill_proc)
        decode_proc, decode = start_worker("decode", "--prefill-allow", prefill, env=env)
        procs.append(decode_proc)
        cfg = tmp_path / "policy.json"
        cfg.write_text('{"disaggregation_threshold_tokens": 16}')
        gw = Proc("gateway", [rngd_bin(), "gateway", "--listen", "127.0.0.1:0", "--prefill", f"http://{prefill}",
                              "--decode", f"http://{decode}", "--policy-config", str(cfg), "--model", model_path()],
                  env=dict(os.environ))
        procs.append(gw)
        gw_url = gw.wait_line("rngd-pd gateway listening on", 120)
        wait_every_endpoint_scraped(gw_url)
        assert 256 < prompt_tokens(decode, MID) < 500
        body = {"model": SERVED_MODEL, "prompt": MID, "max_tokens": 6, "temperature": 0}
        r = requests.post(gw_url + "/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        assert r.headers["x-rngd-pd-route-reason"] == "disaggregated", r.headers
        want = r.json()["choices"][0]["text"]

        r = requests.post(admin + "/switch_variant", json={"seq_len": 256}, headers=AUTH, timeout=300)
        assert r.status_code == 200, r.text
        # Until the gateway's next scrape its policy still sends the prompt to the
        # prefill worker, which refuses it: the gateway then lets the decode worker
        # prefill it (`prefill_context_fallback`). After, the policy keeps it local.
        deadline = time.monotonic() + 30
        while True:
            r = requests.post(gw_url + "/v1/completions", json=body, timeout=300)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == want
            reason = r.headers["x-rngd-pd-route-reason"]
            assert reason in ("prefill_context_fallback", "no_prefill_endpoint"), r.headers
            if reason == "no_prefill_endpoint" or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert reason == "no_prefill_endpoint", r.headers
        # A short prompt still goes to the prefill worker.
        short = dict(body, prompt="Tell me about the sea and the birds above it, in a few words.")
        r = requests.post(gw_url + "/v1/completions", json=short, timeout=300)
        assert r.headers["x-rngd-pd-route-reason"] == "disaggregated", r.headers
    finally:
        for p in reversed(procs):
            p.stop(signal.SIGTERM)
