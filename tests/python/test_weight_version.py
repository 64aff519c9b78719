"""The weights' identity across a PD pair (issue 23, item 5): a prefill worker
and a decode worker loaded with different weights of the same shape.

The second model is the SmolLM2 file with one tensor's bytes changed, written
here with the `gguf` package (its reader, memory-mapped for writing). Every
shape, the vocabulary and the metadata are the original's, so the decode
worker would import the KV without complaint if nothing compared the weights:

- each worker shows its `weight_version` in `/v1/models` and in
  `rngd_pd_worker_weight_info`; the two differ, equal files agree;
- through the header path (`x-prefiller-host-port`), the decode worker
  answers 409 `weight_version_mismatch` naming both versions, pulls nothing,
  and the prefill's KV is gone from the transport at once (not left to its
  TTL);
- the gateway's policy, which reads each worker's version from its metrics,
  never makes such a pair: it serves the request on the decode worker alone
  (route reason `no_prefill_same_weights`, counted);
- a decode worker with the prefill worker's weights still decodes, with the
  solo worker's tokens;
- a running worker switched to the changed file (`POST
  /update_weights_from_disk` on its admin listener, under concurrent
  requests, none of which fails) shows the new version and then answers
  with the tokens and log-probabilities of a worker started on that file;
  a file that does not load leaves it serving the old weights;
- with per-tensor manifests (`rngd-pd model manifest`, checked here against
  the tensors' bytes with `hashlib`), the switch is a delta: the worker reads
  the header and the one changed tensor only (`bytes_read` equals the
  header plus that tensor's bytes, from the `gguf` reader), under
  concurrent requests, and answers exactly as a worker started on the
  changed file.
"""

import hashlib
import os
import pathlib
import shutil
import signal
import subprocess
import threading

import numpy as np
import pytest
import requests

import gguf
from conftest import (SERVED_MODEL, Proc, counter, greedy_completion, model_path, poll_ok, rngd_bin, start_worker,
                      wait_every_endpoint_scraped, worker_env)

# Long enough for the gateway's policy to disaggregate (threshold 16 below).
PROMPT = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying oil for the lamp "
          "and a notebook in which he wrote down the ships he saw. One night")
CHANGED_TENSOR = "blk.3.ffn_down.weight"


def changed_copy(src, dst):
    """`src` copied to `dst` with the bytes of one tensor altered (same
    type, same shape); returns the altered tensor's byte count."""
    shutil.copyfile(src, dst)
    r = gguf.GGUFReader(dst, "r+")
    (t,) = [t for t in r.tensors if t.name == CHANGED_TENSOR]
    raw = t.data.view(np.uint8).reshape(-1)
    raw[: raw.size // 2] ^= 0x11
    r.data.flush()
    return int(t.n_bytes)


def weight_version(addr):
    models = requests.get(f"http://{addr}/v1/models", timeout=10).json()["data"]
    versions = {m["weight_version"] for m in models}
    assert len(versions) == 1, models
    return versions.pop()


def shm_entries(root):
    # The prefill worker's slot arena (*.kva) stays with the worker; a
    # request left in it keeps its pointer file (*.kv), which is listed.
    return sorted(
        str(p.relative_to(root)) for p in pathlib.Path(root).rglob("*") if p.is_file() and p.suffix != ".kva"
    )


class Pair:
    pass


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("weights")
    other = d / "smollm2-changed.gguf"
    assert changed_copy(model_path(), other) > 0
    shm = d / "shm"
    env = {"PD_SHM_ROOT": str(shm)}
    p = Pair()
    p.shm = shm
    p.dir, p.changed = d, other
    procs = []
    try:
        p.prefill_proc, p.prefill = start_worker("prefill", env=env)
        procs.append(p.prefill_proc)
        # Decode workers that orchestrate on this prefill worker: one with other weights, one with the same.
        p.other_proc, p.other = start_worker("decode", "--prefill-allow", p.prefill, env=env, model=other)
        procs.append(p.other_proc)
        p.same_proc, p.same = start_worker("decode", "--prefill-allow", p.prefill, env=env)
        procs.append(p.same_proc)
        yield p
    finally:
        for proc in reversed(procs):
            proc.stop(signal.SIGTERM)


def test_each_worker_shows_its_weights_and_equal_files_agree(pair):
    ours, theirs, same = weight_version(pair.prefill), weight_version(pair.other), weight_version(pair.same)
    for v in (ours, theirs):
        assert len(v) == 16 and all(c in "0123456789abcdef" for c in v), v
    assert ours == same
    assert ours != theirs
    text = requests.get(f"http://{pair.other}/metrics", timeout=10).text
    info = [line for line in text.splitlines() if line.startswith("rngd_pd_worker_weight_info{")]
    assert info == [f'rngd_pd_worker_weight_info{{model_name="{SERVED_MODEL}",weight_version="{theirs}"}} 1'], info


def pd_by_header(prefill, decode):
    """A completion sent to `decode`, which has `prefill` prefill it."""
    return requests.post(
        f"http://{decode}/v1/completions",
        json={"model": SERVED_MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0},
        headers={"x-prefiller-host-port": prefill},
        timeout=300,
    )


def assert_conflict(r, ours, theirs):
    assert r.status_code == 409, r.text
    err = r.json()["error"]
    assert err["code"] == "weight_version_mismatch", err
    assert err["param"] == "kv_transfer_params", err
    assert err["type"] == "invalid_request_error", err
    assert f"weight_version {ours}" in err["message"] and f"weight_version {theirs}" in err["message"], err


def test_the_header_path_refuses_kv_from_other_weights_and_leaves_nothing(pair, solo):
    ours, theirs = weight_version(pair.prefill), weight_version(pair.other)
    prefills = counter(pair.prefill, "rngd_pd_worker_prefills_total")
    loads = counter(pair.other, "rngd_pd_worker_kv_loads_total")
    r = pd_by_header(pair.prefill, pair.other)
    assert_conflict(r, ours, theirs)
    assert counter(pair.prefill, "rngd_pd_worker_prefills_total") == prefills + 1, "the prefill ran"
    assert counter(pair.other, "rngd_pd_worker_kv_loads_total") == loads, "nothing pulled"
    assert counter(pair.other, "rngd_pd_worker_weight_version_refusals_total") >= 1
    assert shm_entries(pair.shm) == [], "the KV is released at once, not left to its TTL"

    # Same weights: decoded, with the solo worker's tokens.
    r = pd_by_header(pair.prefill, pair.same)
    assert r.status_code == 200, r.text
    assert counter(pair.same, "rngd_pd_worker_kv_loads_total") >= 1
    want = greedy_completion(solo, PROMPT, 8)
    assert r.json()["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]
    assert shm_entries(pair.shm) == []


def test_the_gateway_never_pairs_other_weights_and_serves_locally(pair, tmp_path):
    """The gateway scrapes each worker's `rngd_pd_worker_weight_info`: its
    policy does not send KV from the prefill worker to a decode worker of
    other weights, serves the request on the decode worker alone and says
    why (the route reason, counted in `rngd_pd_route_decisions_total`)."""
    cfg = tmp_path / "policy.json"
    cfg.write_text('{"disaggregation_threshold_tokens": 16}')

    def gateway(decode):
        return Proc("gateway", [rngd_bin(), "gateway", "--listen", "127.0.0.1:0", "--prefill",
                                f"http://{pair.prefill}", "--decode", f"http://{decode}", "--policy-config", str(cfg),
                                "--model", model_path()],
                    env=dict(os.environ))

    body = {"model": SERVED_MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    # The control: the same gateway over a decode worker of the same weights disaggregates.
    gw = gateway(pair.same)
    try:
        url = gw.wait_line("rngd-pd gateway listening on", 120)
        wait_every_endpoint_scraped(url)
        prefills = counter(pair.prefill, "rngd_pd_worker_prefills_total")
        r = requests.post(url + "/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        assert r.headers["x-rngd-pd-route-reason"] == "disaggregated", r.headers
        assert counter(pair.prefill, "rngd_pd_worker_prefills_total") == prefills + 1
    finally:
        gw.stop()

    gw = gateway(pair.other)
    try:
        url = gw.wait_line("rngd-pd gateway listening on", 120)
        wait_every_endpoint_scraped(url)
        loads = counter(pair.other, "rngd_pd_worker_kv_loads_total")
        prefills = counter(pair.prefill, "rngd_pd_worker_prefills_total")
        r = requests.post(url + "/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        assert r.headers["x-rngd-pd-route-reason"] == "no_prefill_same_weights", r.headers
        assert counter(pair.prefill, "rngd_pd_worker_prefills_total") == prefills, "no prefill was sent"
        assert counter(pair.other, "rngd_pd_worker_kv_loads_total") == loads, "nothing pulled"
        assert shm_entries(pair.shm) == []
        # The decode worker's own answer, on its own weights.
        direct = requests.post(f"http://{pair.other}/v1/completions", json=body, timeout=300).json()
        assert r.json()["choices"][0]["token_ids"] == direct["choices"][0]["token_ids"]
        text = requests.get(url + "/metrics", timeout=10).text
        assert 'rngd_pd_route_decisions_total{reason="no_prefill_same_weights"} 1' in text, text
    finally:
        gw.stop()


PROMPTS = ["The capital of France is", "def fibonacci(n):", PROMPT]
TOKEN = "weights-admin-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def scored(addr, prompt):
    """Greedy tokens and their log-probabilities (top 3) from a worker."""
    r = requests.post(f"http://{addr}/v1/completions",
                      json={"model": SERVED_MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0,
                            "logprobs": 3},
                      timeout=300)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    return c["token_ids"], c["logprobs"]["token_logprobs"], c["logprobs"]["top_logprobs"]


def update_under_load(url, admin, body):
    """`POST /update_weights_from_disk` with `body` while two clients keep
    sending a greedy completion of `PROMPTS[0]`; returns the update's answer
    and every completion's (status, token ids or error text)."""
    results, stop = [], threading.Event()

    def load():
        while not stop.is_set():
            r = requests.post(f"http://{url}/v1/completions",
                              json={"model": SERVED_MODEL, "prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0},
                              timeout=300)
            results.append((r.status_code, r.json()["choices"][0]["token_ids"] if r.ok else r.text))

    threads = [threading.Thread(target=load) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        r = requests.post(admin + "/update_weights_from_disk", json=body,
                          headers=AUTH, timeout=300)
    finally:
        stop.set()
        for t in threads:
            t.join(300)
    return r, results


def admin_worker(name, model):
    """A decode worker of `model` with an admin listener (token `TOKEN`);
    returns (process, admin base URL, API address) once it is ready."""
    proc = Proc(name, [rngd_bin(), "worker", "--role", "decode", "--port", "0", "--model", str(model),
                       "--admin-listen", "127.0.0.1:0"],
                env=worker_env(RNGD_PD_ADMIN_TOKEN=TOKEN))
    try:
        admin = "http://" + proc.wait_line("rngd-pd worker admin on http://", 120)
        url = proc.wait_line("rngd-pd worker listening on http://", 300)
        poll_ok(f"http://{url}/ready", 600, proc)
    except BaseException:
        proc.stop(signal.SIGTERM)
        raise
    return proc, admin, url


def test_a_running_worker_switches_weights_with_the_tokens_of_a_fresh_start(pair):
    # The worker's weights directory holds the original (a copy) and the changed file.
    original = pair.dir / "original.gguf"
    shutil.copyfile(model_path(), original)
    (pair.dir / "broken.gguf").write_bytes(original.read_bytes()[: 4 << 20])
    proc, admin, url = admin_worker("reloading worker", original)
    try:
        before = weight_version(url)
        assert before == weight_version(pair.same)
        old = {p: scored(url, p) for p in PROMPTS}
        assert old == {p: scored(pair.same, p) for p in PROMPTS}

        # A file that does not load: refused with the cause, the old weights serve on.
        r = requests.post(admin + "/update_weights_from_disk", json={"model_path": "broken.gguf"}, headers=AUTH,
                          timeout=300)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "model_path", r.text
        assert weight_version(url) == before
        assert scored(url, PROMPTS[0]) == old[PROMPTS[0]]

        # The switch, with requests running beside it: none fails.
        r, results = update_under_load(url, admin, {"model_path": pair.changed.name, "abort_all_requests": False})
        assert r.status_code == 200, r.text
        answer = r.json()
        assert answer["success"] is True
        assert answer["previous_weight_version"] == before
        assert answer["weight_version"] == weight_version(pair.other) != before
        # No manifest in the file: it is read whole, and the worker still tells what changed.
        assert answer["mode"] == "full", answer
        assert answer["bytes_read"] == os.path.getsize(pair.changed)
        assert answer["changed_tensors"] == [CHANGED_TENSOR] and answer["tensors_changed"] == 1, answer
        assert results and all(status == 200 for status, _ in results), results
        # Each answer is one engine's: the old weights' tokens or the new ones', never a mix.
        new = {p: scored(pair.other, p) for p in PROMPTS}
        assert all(ids in (old[PROMPTS[0]][0], new[PROMPTS[0]][0]) for _, ids in results), results

        assert weight_version(url) == answer["weight_version"]
        models = requests.get(f"http://{url}/v1/models", timeout=10).json()["data"]
        assert models[0]["root"] == pair.changed.name
        info = requests.get(admin + "/weight_info", headers=AUTH, timeout=10).json()
        assert info == {"model_name": SERVED_MODEL, "weight_version": answer["weight_version"],
                        "model_file": pair.changed.name}
        # The tokens and log-probabilities of a worker started on the new file.
        assert {p: scored(url, p) for p in PROMPTS} == new
        assert new != old, "the changed tensor changes what the model says"
    finally:
        proc.stop(signal.SIGTERM)


def manifested(src, dst):
    """`rngd-pd model manifest src dst`; checks every entry against the
    tensor's bytes as the `gguf` reader sees them. Returns the reader."""
    out = subprocess.run([rngd_bin(), "model", "manifest", str(src), str(dst)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    r = gguf.GGUFReader(dst)
    entries = r.fields["rngd_pd.tensor_sha256"].contents()
    listed = dict(e.rsplit(":", 1) for e in entries)
    assert listed == {t.name: hashlib.sha256(t.data.tobytes()).hexdigest() for t in r.tensors}
    return r


def test_a_manifest_makes_the_update_read_only_the_changed_tensor(pair):
    d = pair.dir / "delta"
    d.mkdir()
    base, changed = d / "base.gguf", d / "changed.gguf"
    manifested(model_path(), base)
    reader = manifested(pair.changed, changed)
    (t,) = [t for t in reader.tensors if t.name == CHANGED_TENSOR]
    header = int(reader.data_offset)
    proc, admin, url = admin_worker("delta worker", base)
    try:
        before = weight_version(url)
        assert before == weight_version(pair.same), "the manifest copy holds the same weights"
        old = scored(url, PROMPTS[0])

        r, results = update_under_load(url, admin, {"model_path": "changed.gguf"})
        assert r.status_code == 200, r.text
        answer = r.json()
        assert answer["mode"] == "delta", answer
        assert answer["changed_tensors"] == [CHANGED_TENSOR] and answer["tensors_changed"] == 1, answer
        assert answer["bytes_read"] == header + int(t.n_bytes), (answer, header, int(t.n_bytes))
        assert answer["bytes_read"] < os.path.getsize(changed) // 20
        assert answer["previous_weight_version"] == before
        assert answer["weight_version"] == weight_version(pair.other) == weight_version(url)
        assert results and all(status == 200 for status, _ in results), results
        new = {p: scored(pair.other, p) for p in PROMPTS}
        assert all(ids in (old[0], new[PROMPTS[0]][0]) for _, ids in results), results
        assert {p: scored(url, p) for p in PROMPTS} == new

        # Back by delta too; a manifest that lies about a changed tensor is refused, the weights stay.
        r = requests.post(admin + "/update_weights_from_disk", json={"model_path": "base.gguf"}, headers=AUTH,
                          timeout=300)
        assert r.status_code == 200 and r.json()["mode"] == "delta", r.text
        assert weight_version(url) == before
        lying = d / "lying.gguf"
        shutil.copyfile(changed, lying)
        lr = gguf.GGUFReader(lying, "r+")
        (lt,) = [x for x in lr.tensors if x.name == CHANGED_TENSOR]
        lt.data.view(np.uint8).reshape(-1)[7] ^= 0x01
        lr.data.flush()
        r = requests.post(admin + "/update_weights_from_disk", json={"model_path": "lying.gguf"}, headers=AUTH,
                          timeout=300)
        assert r.status_code == 400, r.text
        assert "manifest digest" in r.json()["error"]["message"], r.text
        assert weight_version(url) == before
        assert scored(url, PROMPTS[0]) == old
    finally:
        proc.stop(signal.SIGTERM)
