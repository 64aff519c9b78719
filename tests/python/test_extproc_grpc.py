"""`rngd-pd ext-proc` alone, driven by an independent ext_proc client (grpcio +
xds-protos): protocol edge cases. The endpoints file lists fake model servers
(Python) whose `/metrics` the picker scrapes; the policy is the real
pd_default.wasm.

The picker serves TLS (its default, a self-signed certificate): the client
trusts the certificate the picker presents (`epp.helpers.channel`). The last
tests cover `--cert-path` (a replaced pair reaches new connections) and
`--secure-serving=false` (plaintext).
"""

from __future__ import annotations

import json
import ssl
import time

import grpc

import pytest

from conftest import SERVED_MODEL
from epp.helpers import (
    BUFFERED,
    ExtProc,
    ModelServerFake,
    body_req,
    endpoint_json,
    exchange,
    headers_req,
    immediate,
    lb_destination,
    policy_module,
    self_signed_pair,
    post_headers,
    set_headers,
    streamed_request_chunks,
)


@pytest.fixture(scope="module")
def epp(tmp_path_factory):
    busy = ModelServerFake(waiting=5, running=2, kv=0.5)
    idle = ModelServerFake(waiting=0, running=0, kv=0.0)
    d = tmp_path_factory.mktemp("epp")
    eps = d / "endpoints.json"
    eps.write_text(json.dumps([endpoint_json(busy.address), endpoint_json(idle.address)]))
    cfg = d / "policy.json"
    cfg.write_text(json.dumps({"disaggregation_threshold_tokens": 100000}))
    e = ExtProc(eps, policy_module(), cfg)
    e.busy, e.idle = busy, idle
    e.files = (eps, cfg)
    # Wait (by polling) until the first scrapes made both fakes healthy: a GET routes.
    deadline = time.monotonic() + 30
    while True:
        r = exchange(e, [headers_req([(":method", "GET"), (":path", "/v1/models")], end_of_stream=True)])
        if immediate(r) is None:
            break
        assert time.monotonic() < deadline, f"no endpoint became healthy: {r}"
        time.sleep(0.05)
    yield e
    code = e.stop()
    busy.close()
    idle.close()
    assert code == 0, f"ext-proc exited with {code} on SIGINT"


def completion(prompt="Hello there", **extra) -> bytes:
    return json.dumps({"model": SERVED_MODEL, "prompt": prompt, "max_tokens": 4, **extra}).encode()


def test_body_split_across_many_chunks(epp):
    body = completion()
    msgs = [post_headers()] + [body_req(body[i : i + 3], i + 3 >= len(body)) for i in range(0, len(body), 3)]
    resps = exchange(epp, msgs)
    first = resps[0]
    assert first.WhichOneof("response") == "request_headers", resps
    assert first.request_headers.response.clear_route_cache
    hdrs = set_headers(first)
    # Scraped load steers the pick: the idle fake wins over the busy one.
    assert hdrs["x-gateway-destination-endpoint"] == epp.idle.address
    assert hdrs["content-length"] == str(len(body))
    assert lb_destination(first) == epp.idle.address
    chunks = streamed_request_chunks(resps)
    assert b"".join(c for c, _ in chunks) == body
    assert chunks[-1][1] and not any(e for _, e in chunks[:-1])


def test_empty_body_is_400(epp):
    resps = exchange(epp, [post_headers(), body_req(b"", True)])
    im = immediate(resps)
    assert im is not None and im.status.code == 400, resps
    assert json.loads(im.body)["error"]["type"] == "invalid_request_error"


def test_get_without_body_is_routed_at_once(epp):
    resps = exchange(epp, [headers_req([(":method", "GET"), (":path", "/v1/models")], end_of_stream=True)])
    assert len(resps) == 1 and resps[0].WhichOneof("response") == "request_headers"
    hdrs = set_headers(resps[0])
    assert hdrs["x-gateway-destination-endpoint"] in (epp.idle.address, epp.busy.address)
    assert "content-length" not in hdrs


def test_malformed_json_is_400(epp):
    resps = exchange(epp, [post_headers(), body_req(b'{"model": "m", "prompt": ', True)])
    im = immediate(resps)
    assert im is not None and im.status.code == 400
    assert len(resps) == 1, "the stream closes after the immediate response"


def test_missing_model_is_400(epp):
    resps = exchange(epp, [post_headers(), body_req(b'{"prompt": "hi"}', True)])
    im = immediate(resps)
    assert im is not None and im.status.code == 400
    assert json.loads(im.body)["error"]["code"] == "missing_model"


def test_one_megabyte_body_resent_in_chunks(epp):
    # The filler rides in `user`, which every door accepts and ignores by
    # design (an unknown field would be a 400 naming it); the body stays
    # under the picker's default limit of 1 MiB.
    body = completion(user="x" * ((1 << 20) - 200))
    assert 1_000_000 < len(body) <= 1 << 20
    msgs = [post_headers()] + [body_req(body[i : i + 32768], i + 32768 >= len(body)) for i in range(0, len(body), 32768)]
    resps = exchange(epp, msgs)
    assert immediate(resps) is None, immediate(resps)
    assert set_headers(resps[0])["content-length"] == str(len(body))
    chunks = streamed_request_chunks(resps)
    assert all(len(c) <= 62_000 for c, _ in chunks)
    assert len(chunks) == -(-len(body) // 62_000)
    assert b"".join(c for c, _ in chunks) == body
    assert chunks[-1][1]


def test_subset_hint(epp):
    body = completion()
    # A hint naming only the busy endpoint overrides the load-based choice.
    resps = exchange(epp, [post_headers(subset=[epp.busy.address]), body_req(body, True)])
    assert set_headers(resps[0])["x-gateway-destination-endpoint"] == epp.busy.address
    # Empty hint, or one naming no known endpoint: 503.
    for subset in ([], ["192.0.2.1:8000"]):
        resps = exchange(epp, [post_headers(subset=subset), body_req(body, True)])
        im = immediate(resps)
        assert im is not None and im.status.code == 503, (subset, resps)


def test_buffered_mode(epp):
    body = completion()
    resps = exchange(epp, [post_headers(mode=BUFFERED), body_req(body, True)])
    assert [r.WhichOneof("response") for r in resps] == ["request_headers", "request_body"]
    assert not resps[0].request_headers.response.HasField("header_mutation")
    assert resps[1].request_body.response.clear_route_cache
    assert set_headers(resps[1])["x-gateway-destination-endpoint"] == epp.idle.address
    assert lb_destination(resps[1]) == epp.idle.address


def test_over_length_prompt_gets_policy_400(epp):
    # Without a tokenizer the policy estimates bytes/8: 8 KB of prompt cannot fit 512.
    resps = exchange(epp, [post_headers(), body_req(completion(prompt="word " * 2000), True)])
    im = immediate(resps)
    assert im is not None and im.status.code == 400
    assert json.loads(im.body)["error"]["code"] == "context_length_exceeded"


def test_picker_metrics(epp):
    text = epp.metrics_text()
    assert 'rngd_pd_epp_picks_total{result="route"}' in text
    assert "rngd_pd_epp_pick_seconds_bucket" in text


def _get():
    return [headers_req([(":method", "GET"), (":path", "/v1/models")], end_of_stream=True)]


def _routed(resps) -> bool:
    return immediate(resps) is None and "x-gateway-destination-endpoint" in set_headers(resps[0])


def _der(pem: str) -> bytes:
    return ssl.PEM_cert_to_DER_cert(pem)


def test_tls_by_default_and_plaintext_refused(epp):
    assert epp.security == "tls self-signed"
    assert _routed(exchange(epp, _get()))
    with pytest.raises(grpc.RpcError):
        exchange(epp.grpc, _get(), timeout=5)  # a plaintext client on the TLS port


def test_cert_path_pair_replaced_reaches_new_connections(epp, tmp_path):
    certs = tmp_path / "certs"
    a = self_signed_pair(certs)
    e = ExtProc(*epp.files[:1], policy_module(), epp.files[1], cert_path=certs)
    try:
        assert e.security == f"tls {certs}"
        assert _der(e.server_certificate()) == _der(a)
        assert _routed(exchange(e.grpc, _get(), root_pem=a))
        b = self_signed_pair(certs)
        deadline = time.monotonic() + 30
        while _der(e.server_certificate()) != _der(b):
            assert time.monotonic() < deadline, "the replaced pair was not served"
            time.sleep(0.05)
        assert _routed(exchange(e.grpc, _get(), root_pem=b))
        with pytest.raises(grpc.RpcError):
            exchange(e.grpc, _get(), root_pem=a, timeout=5)
    finally:
        assert e.stop() == 0


def test_secure_serving_false_is_plaintext(epp):
    e = ExtProc(*epp.files[:1], policy_module(), epp.files[1], tls=False)
    try:
        assert e.security == "plaintext"
        assert _routed(exchange(e.grpc, _get()))
    finally:
        assert e.stop() == 0
