"""The llm-d path end to end, discovery included: a real Envoy 1.40 talking TLS
to `rngd-pd ext-proc --pool-name demo --pool-namespace ai`, which discovers its
endpoints from an InferencePool and its pods, and real workers serving the
real model at the discovered addresses.

No Kubernetes API server can run on these machines: the API is served by
tests/python/kube_api.py (list, chunked watch, bookmarks, 410 Gone), with the
objects in the recorded shapes of tests/fixtures/kube/. Each "pod" is a real
worker process bound to its own loopback address (127.0.0.2, .3, .4) on the
pool's one target port, as pods share a port on distinct IPs.

The steps: PD through Envoy on the discovered pods gives the solo worker's
tokens; the decode pod turns unready → the picker has nothing to decode on
and says so (503) without calling a worker; a `both` pod appears → it serves;
the watch drops and resumes; the decode pod turns ready → PD again; the
pool's selector moves away → no endpoints.
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import sys
import time
import pathlib

import pytest
import requests

from conftest import SERVED_MODEL, Proc, counter, free_port, model_path, poll_ok, start_worker
from epp.helpers import ExtProc, envoy_binary, policy_module
import kube_api
from kube_api import KubeApi, PODS, POOLS

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "deploy" / "envoy"))
import render  # noqa: E402

MODEL = SERVED_MODEL
LONG_PROMPT = (
    "The history of the printing press begins in the fifteenth century, when movable type changed how books "
    "were made, how ideas travelled between cities, and how ordinary people learned to read. Summarize it:"
)
PREFILL_IP, DECODE_IP, BOTH_IP = "127.0.0.2", "127.0.0.3", "127.0.0.4"


def port_free_on_all(ips) -> int:
    """A port number free on every one of the loopback addresses."""
    for _ in range(50):
        port = free_port()
        try:
            for ip in ips:
                with socket.socket() as s:
                    s.bind((ip, port))
            return port
        except OSError:
            continue
    pytest.fail("no port free on all the loopback addresses")


def gauge(text: str, sample: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


class Cluster:
    pass


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, solo):
    c = Cluster()
    d = tmp_path_factory.mktemp("envoy-discovery")
    procs = []
    c.api = KubeApi(namespace="ai", bookmark_every=0.5)
    try:
        c.port = port_free_on_all([PREFILL_IP, DECODE_IP, BOTH_IP])
        c.prefill, c.decode, c.both = (f"{ip}:{c.port}" for ip in (PREFILL_IP, DECODE_IP, BOTH_IP))
        c.solo = solo.removeprefix("http://")
        procs.append(start_worker("prefill", host=PREFILL_IP, port=c.port)[0])
        procs.append(start_worker("decode", "--prefill-allow", c.prefill, host=DECODE_IP, port=c.port)[0])
        c.both_proc = None

        c.api.put(POOLS, kube_api.pool("demo", {"rngd-pd.io/pool": "demo"}, c.port))
        c.api.put(PODS, kube_api.pod("demo-prefill-0", PREFILL_IP, "prefill", "demo"))
        c.api.put(PODS, kube_api.pod("demo-decode-0", DECODE_IP, "decode", "demo"))
        # Another pool's pod, never an endpoint of ours.
        c.api.put(PODS, kube_api.pod("other-decode-0", "127.0.0.9", "decode", "other"))

        (d / "policy.json").write_text(json.dumps({"disaggregation_threshold_tokens": 32}))
        policy = d / "policy.wasm"
        shutil.copyfile(policy_module(), policy)
        c.epp = ExtProc(None, policy, d / "policy.json", model=model_path(), tls=True, extra=[
            "--pool-name", "demo", "--pool-namespace", "ai", "--kubeconfig", str(c.api.kubeconfig(d / "kubeconfig")),
        ])
        procs.append(c.epp.proc)

        c.listen, c.admin = free_port(), free_port()
        cfg = render.render({
            "LISTEN_HOST": "127.0.0.1", "LISTEN_PORT": c.listen, "ADMIN_PORT": c.admin,
            "EPP_HOST": c.epp.grpc.rsplit(":", 1)[0], "EPP_PORT": c.epp.grpc.rsplit(":", 1)[1],
            "BODY_MODE": "FULL_DUPLEX_STREAMED",
        })
        assert "envoy.transport_sockets.tls" in cfg
        (d / "envoy.yaml").write_text(cfg)
        envoy = Proc("envoy", [str(envoy_binary()), "-c", str(d / "envoy.yaml"), "--disable-hot-restart", "-l", "warning"])
        procs.append(envoy)
        poll_ok(f"http://127.0.0.1:{c.admin}/ready", 60, envoy)
        c.envoy_admin = f"127.0.0.1:{c.admin}"
        c.url = f"http://127.0.0.1:{c.listen}"
        c.procs = procs
        yield c
    finally:
        if getattr(c, "both_proc", None) is not None:
            c.both_proc.stop(signal.SIGTERM)
        for p in reversed(procs):
            p.stop(signal.SIGTERM)
        c.api.close()


def wait_pool(c: Cluster, ready: int, what: str, timeout: float = 30) -> str:
    """Waits until the picker reports `ready` healthy endpoints of pool `demo`."""
    deadline = time.monotonic() + timeout
    while True:
        text = c.epp.metrics_text()
        if gauge(text, 'inference_pool_ready_pods{name="demo"}') == ready:
            return text
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: the picker did not reach {ready} ready pods; metrics:\n"
                        + "\n".join(l for l in text.splitlines() if "pool" in l or "discovery" in l))
        time.sleep(0.05)


def solo_reference(c: Cluster, body: dict) -> dict:
    r = requests.post(f"http://{c.solo}/v1/completions", json=body, timeout=600)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def pd_counts(c: Cluster) -> tuple[float, float]:
    return counter(c.prefill, "rngd_pd_worker_prefills_total"), counter(c.decode, "rngd_pd_worker_kv_loads_total")


def test_pd_on_discovered_pods_matches_solo(cluster):
    c = cluster
    text = wait_pool(c, 2, "the first list")
    assert gauge(text, "rngd_pd_discovery_endpoints") == 2, "the other pool's pod is not ours"
    body = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 8, "temperature": 0}
    want = solo_reference(c, body)
    prefills, loads = pd_counts(c)
    r = requests.post(c.url + "/v1/completions", json=body, timeout=600)
    assert r.status_code == 200, r.text
    assert pd_counts(c) == (prefills + 1, loads + 1), "prefilled on the prefill pod, decoded on the decode pod"
    got = r.json()["choices"][0]
    assert got["token_ids"] == want["token_ids"] and got["text"] == want["text"]
    # The ext_proc connection is the TLS one.
    stats = requests.get(f"http://{c.envoy_admin}/stats?filter=cluster.epp.ssl.handshake", timeout=10).text
    assert float(stats.split(":")[-1]) >= 1, stats


def test_the_routes_follow_the_pods(cluster):
    c = cluster
    wait_pool(c, 2, "start")
    short = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "temperature": 0}

    # The decode pod turns unready: nothing can decode, the picker answers
    # 503 itself and no worker is called.
    dec = c.api.get(PODS, "demo-decode-0")
    kube_api.set_ready(dec, False)
    c.api.put(PODS, dec)
    wait_pool(c, 1, "decode pod unready")
    before = (counter(c.prefill, "rngd_pd_worker_requests_total"), counter(c.decode, "rngd_pd_worker_requests_total"))
    r = requests.post(c.url + "/v1/completions", json=short, timeout=60)
    assert r.status_code == 503, (r.status_code, r.text)
    after = (counter(c.prefill, "rngd_pd_worker_requests_total"), counter(c.decode, "rngd_pd_worker_requests_total"))
    assert after == before

    # A pod with role `both` appears: it serves whole requests.
    c.both_proc, _ = start_worker("solo", host=BOTH_IP, port=c.port)
    c.api.put(PODS, kube_api.pod("demo-both-0", BOTH_IP, None, "demo"))
    wait_pool(c, 2, "both pod added")
    n = counter(c.both, "rngd_pd_worker_requests_total")
    r = requests.post(c.url + "/v1/completions", json=short, timeout=600)
    assert r.status_code == 200, r.text
    assert counter(c.both, "rngd_pd_worker_requests_total") == n + 1

    # The watch drops and resumes: the next change still arrives.
    c.api.drop_watches()
    c.api.delete(PODS, "demo-both-0")
    wait_pool(c, 1, "both pod deleted after the watch dropped")

    # The decode pod is ready again: PD as before, equal to solo.
    dec = c.api.get(PODS, "demo-decode-0")
    kube_api.set_ready(dec, True)
    c.api.put(PODS, dec)
    wait_pool(c, 2, "decode pod ready again")
    body = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 6, "temperature": 0}
    want = solo_reference(c, body)
    prefills, loads = pd_counts(c)
    r = requests.post(c.url + "/v1/completions", json=body, timeout=600)
    assert r.status_code == 200, r.text
    assert pd_counts(c) == (prefills + 1, loads + 1)
    assert r.json()["choices"][0]["token_ids"] == want["token_ids"]

    # History compacted while the watch is away: 410 Gone, relist, same pods.
    c.api.compact()
    c.api.drop_watches()
    c.api.put(PODS, kube_api.pod("other-decode-1", "127.0.0.10", "decode", "other"))
    wait_pool(c, 2, "after a relist")

    # The pool's selector moves to the other pool's label: ours leave.
    c.api.put(POOLS, kube_api.pool("demo", {"rngd-pd.io/pool": "nobody"}, c.port))
    wait_pool(c, 0, "selector matches nothing")
    r = requests.post(c.url + "/v1/completions", json=short, timeout=60)
    assert r.status_code == 503, (r.status_code, r.text)
