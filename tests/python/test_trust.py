"""Trust in what the router predicts and what the doors accept, with real
processes: a prefill worker, a decode worker publishing vLLM's KV events on
fixed loopback ports, and a gateway indexing them, driven with the real
`openai` client and `requests`.

- Predicted against served: every routed turn counts the cached tokens the
  index predicted where it was prefilled and what the engine reported
  (`rngd_pd_router_{predicted,served}_cached_tokens_total`).
- Two tenants with different `cache_salt`s (and a client with none) never
  match each other's cached blocks: the worker publishes a salted chain with
  its salt (vLLM's `extra_keys`), the index keys it under the salt, and the
  doors look a request up under its own salt.
- A worker killed with SIGKILL and started again on the same address (same
  HTTP port, same KV-event ports) has an empty cache: the gateway sees the new
  process in its scrape and drops the worker's index entries before the next
  pick, so the next turn is never routed `cached` to the empty cache
  (`rngd_pd_router_index_resyncs_total{reason="restart"}`).
- The loose edges of a request: a body that is not JSON by its content type
  (415), a repeated key (400 `duplicate_key`, naming it), token ids outside
  the vocabulary (400, `param` `prompt`), a `max_tokens` past the context
  (400, `param` `max_tokens`), `release_only` without a handle at the worker
  (400, `param` `kv_transfer_params`).
"""

import json
import os
import pathlib
import signal

import openai
import pytest
import requests

from conftest import (SERVED_MODEL, Proc, free_port, model_path, poll_ok, rngd_bin, wait_every_endpoint_scraped,
                      worker_env)

SYSTEM = ("You keep the logbook of a mountain hut. You answer questions about its visitors, the weather on "
          "the pass and the supplies carried up each week in two or three plain sentences.")


def start_decode(port, pub, replay, shm):
    cfg = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{pub}",
                      "replay_endpoint": f"tcp://127.0.0.1:{replay}", "topic": "kv@decode"})
    p = Proc("decode worker", [rngd_bin(), "worker", "--role", "decode", "--host", "127.0.0.1", "--port", str(port),
                               "--model", model_path(), "--kv-events-config", cfg],
             env=worker_env(PD_SHM_ROOT=shm))
    p.wait_line("rngd-pd worker listening on", 300)
    poll_ok(f"http://127.0.0.1:{port}/ready", 600, p)
    return p


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    shm = str(tmp_path_factory.mktemp("shm"))
    prefill = Proc("prefill worker", [rngd_bin(), "worker", "--role", "prefill", "--host", "127.0.0.1", "--port",
                                      "0", "--model", model_path()], env=worker_env(PD_SHM_ROOT=shm))
    procs = [prefill]
    try:
        pre = prefill.wait_line("rngd-pd worker listening on", 300).removeprefix("http://")
        poll_ok(f"http://{pre}/ready", 600, prefill)
        port, pub, replay = free_port(), free_port(), free_port()
        decode = start_decode(port, pub, replay, shm)
        procs.append(decode)
        cfg = tmp_path_factory.mktemp("trust") / "policy.json"
        cfg.write_text(json.dumps({"disaggregation_threshold_tokens": 48, "prefix_weight": 10,
                                   "same_node_transport": "shm"}))
        dec = f"127.0.0.1:{port}"
        gw = Proc("gateway", [rngd_bin(), "gateway", "--listen", "127.0.0.1:0", "--prefill", f"http://{pre}",
                              "--decode", f"http://{dec}", "--policy-config", str(cfg), "--model", model_path(),
                              "--kv-events", f"{dec}=tcp://127.0.0.1:{pub},tcp://127.0.0.1:{replay}"],
                  env=dict(os.environ))
        procs.append(gw)
        url = gw.wait_line("rngd-pd gateway listening on", 120)
        wait_every_endpoint_scraped(url)

        class PD:
            pass

        s = PD()
        s.url, s.prefill, s.decode, s.shm, s.procs = url, pre, dec, shm, procs
        s.ports = (port, pub, replay)
        yield s
    finally:
        for p in reversed(procs):
            p.stop(signal.SIGTERM)


def metric(url, line_prefix):
    """The value of the first sample line of the gateway's /metrics starting with `line_prefix`, or 0."""
    for line in requests.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(line_prefix):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def turn(client, messages):
    raw = client.chat.completions.with_raw_response.create(model=SERVED_MODEL, messages=messages, max_tokens=4,
                                                           temperature=0)
    r = raw.parse()
    return raw.headers.get("x-rngd-pd-route-reason"), r.usage.prompt_tokens_details.cached_tokens, r


def test_two_salts_never_see_each_others_cache(pd):
    """Tenant A's salted conversation is routed to its cache; tenant B
    (another salt) and an unsalted client sending the very same messages are
    not: no route reason, `cached_tokens` or timing tells them A's prompt is
    cached."""
    c = openai.OpenAI(base_url=pd.url + "/v1", api_key="unused", max_retries=0, timeout=300)

    def ask(messages, salt):
        extra = {"extra_body": {"cache_salt": salt}} if salt else {}
        raw = c.chat.completions.with_raw_response.create(model=SERVED_MODEL, messages=messages, max_tokens=4,
                                                           temperature=0, **extra)
        r = raw.parse()
        return raw.headers.get("x-rngd-pd-route-reason"), r.usage.prompt_tokens_details.cached_tokens, r

    messages = [{"role": "system", "content": SYSTEM + " Tenant records are private."},
                {"role": "user", "content": "Which guide led the group on Tuesday?"}]
    reason, cached, r = ask(messages, "tenant-a")
    assert reason == "disaggregated" and cached == 0, (reason, cached)
    messages += [{"role": "assistant", "content": r.choices[0].message.content},
                 {"role": "user", "content": "How long did they stay?"}]
    reason, cached, _ = ask(messages, "tenant-a")
    assert reason == "cached" and cached > 0, (reason, cached)
    for salt in ("tenant-b", None):
        reason, cached, _ = ask(messages, salt)
        assert reason != "cached" and cached == 0, (salt, reason, cached)


def test_predictions_are_checked_and_a_restarted_worker_is_never_routed_cached(pd):
    c = openai.OpenAI(base_url=pd.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    # A system prompt no other test sends: nothing of it is cached yet.
    messages = [{"role": "system", "content": "Restart drill. " + SYSTEM},
                {"role": "user", "content": "Who came up yesterday?"}]
    reason, cached, r = turn(c, messages)
    assert reason == "disaggregated" and cached == 0, (reason, cached)
    messages += [{"role": "assistant", "content": r.choices[0].message.content},
                 {"role": "user", "content": "And the weather?"}]
    reason, cached, r = turn(c, messages)
    assert reason == "cached" and cached > 0, (reason, cached)
    # The gateway held its prediction against the engine's report.
    predicted = metric(pd.url, f'rngd_pd_router_predicted_cached_tokens_total{{endpoint="{pd.decode}"}}')
    served = metric(pd.url, f'rngd_pd_router_served_cached_tokens_total{{endpoint="{pd.decode}"}}')
    assert served >= cached and predicted > 0, (predicted, served, cached)
    assert abs(predicted - served) <= 32, (predicted, served)

    # The decode worker dies and comes back on the same address, cache empty.
    old = pd.procs[1]
    os.kill(old.p.pid, signal.SIGKILL)
    old.p.wait(30)
    pd.procs[1] = start_decode(*pd.ports, pd.shm)
    wait_every_endpoint_scraped(pd.url)
    messages += [{"role": "assistant", "content": r.choices[0].message.content},
                 {"role": "user", "content": "What was carried up?"}]
    reason, cached, r = turn(c, messages)
    # Not routed to a cache the restart emptied; whatever route it took, the
    # engine's figure and the route agree.
    assert reason != "cached", (reason, cached)
    assert metric(pd.url, 'rngd_pd_router_index_resyncs_total{reason="restart"}') == 1


def error_of(resp, status):
    assert resp.status_code == status, (resp.status_code, resp.text)
    return resp.json()["error"]


def test_loose_edges_get_their_error_and_param(pd):
    gw, worker = pd.url, f"http://{pd.decode}"
    body = {"model": SERVED_MODEL, "prompt": "The capital of France is", "max_tokens": 4}
    for url in (gw, worker):
        # Not JSON by its content type: 415 before the body is read.
        e = error_of(requests.post(url + "/v1/completions", data=json.dumps(body),
                                   headers={"content-type": "text/plain"}, timeout=30), 415)
        assert e["code"] == "unsupported_media_type", e
        # JSON with a charset, or no content type at all, is served.
        for headers in ({"content-type": "application/json; charset=utf-8"}, {}):
            r = requests.post(url + "/v1/completions", data=json.dumps(body).encode(), headers=headers, timeout=300)
            assert r.status_code == 200, (headers, r.text)
        # A repeated key: two readers would disagree on the model.
        raw = '{"model": "%s", "model": "other", "prompt": "hi", "max_tokens": 2}' % SERVED_MODEL
        e = error_of(requests.post(url + "/v1/completions", data=raw,
                                   headers={"content-type": "application/json"}, timeout=30), 400)
        assert (e["code"], e["param"]) == ("duplicate_key", "model"), e
        # Token ids outside the vocabulary.
        e = error_of(requests.post(url + "/v1/completions", json=dict(body, prompt=[1, 2, 10_000_000]),
                                   timeout=30), 400)
        assert e["param"] == "prompt" and "10000000" in e["message"], e
    # A max_tokens past the context, counted at the gateway's policy.
    e = error_of(requests.post(gw + "/v1/completions", json=dict(body, max_tokens=10**9), timeout=30), 400)
    assert (e["code"], e["param"]) == ("context_length_exceeded", "max_tokens"), e
    # release_only without the decode half of the protocol (and a handle).
    e = error_of(requests.post(worker + "/v1/completions",
                               json=dict(body, kv_transfer_params={"release_only": True}), timeout=30), 400)
    assert e["param"] == "kv_transfer_params" and "release_only" in e["message"], e
    # Nothing was left behind in the shm root by any of these (the prefill
    # worker's slot arena, *.kva, stays with it; a request's KV would not).
    left = [str(p) for p in pathlib.Path(pd.shm).rglob("*") if p.is_file() and p.suffix != ".kva"]
    assert left == [], left


def test_a_stalled_worker_past_its_idle_timeout_still_answers(pd):
    """A decode worker stopped (SIGSTOP) for longer than its 5 s idle timer
    with a request sent to it on a pooled connection: when it resumes, its
    idle timer closes that connection unread; the gateway sends the request
    again on a fresh connection and the client gets its answer, not a 502."""
    import threading
    import time

    body = {"model": SERVED_MODEL, "prompt": "The capital of France is", "max_tokens": 2, "temperature": 0}
    # A pooled connection to the decode worker, fresh.
    assert requests.post(pd.url + "/v1/completions", json=body, timeout=60).status_code == 200
    decode = pd.procs[1]
    out = {}
    os.kill(decode.p.pid, signal.SIGSTOP)
    try:
        t = threading.Thread(target=lambda: out.setdefault(
            "r", requests.post(pd.url + "/v1/completions", json=body, timeout=120)))
        t.start()
        time.sleep(6.5)  # the fault: the worker stays stopped past its idle timeout
    finally:
        os.kill(decode.p.pid, signal.SIGCONT)
    t.join(120)
    r = out["r"]
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"]
