"""A streamed answer leaves Envoy + the endpoint picker chunk by chunk.

Real Envoy 1.40 with the deploy config (Envoy → picker over TLS, the
picker's default `FULL_DUPLEX_STREAMED` body mode, so every response chunk
passes through the picker), in front of the gated fake model server of
`epp.helpers` (`ModelServerFake`): it writes its first token chunk at once and
each later one only when the test releases it. The test reads each token
before releasing the next one, so a proxy that held chunks back (until the
end of the answer, or until more bytes came) would leave the client waiting
for a token the fake has not written yet. It checks ordering, not wall time:
the time a chunk takes is measured by `rngd-pd-bench epp --stream`.

`BUFFERED` (GIE's own e2e config) buffers whole bodies by design, the response
too; it is not a streaming mode and is not tested here.
"""

from __future__ import annotations

import json
import signal
import sys
import time

import pytest
import requests

from conftest import SERVED_MODEL, Proc, free_port, model_path, poll_ok
from epp.helpers import REPO, ExtProc, ModelServerFake, endpoint_json, envoy_binary, policy_module

sys.path.insert(0, str(REPO / "deploy" / "envoy"))
import render  # noqa: E402  (deploy/envoy/render.py)

MODEL = SERVED_MODEL


class Stack:
    pass


@pytest.fixture(scope="module")
def st(tmp_path_factory):
    s = Stack()
    d = tmp_path_factory.mktemp("epp-streaming")
    s.fake = ModelServerFake()
    procs = []
    try:
        (d / "endpoints.json").write_text(json.dumps([endpoint_json(s.fake.address)]))
        (d / "policy.json").write_text(json.dumps({}))
        s.epp = ExtProc(d / "endpoints.json", policy_module(), d / "policy.json", model=model_path(), tls=True)
        procs.append(s.epp.proc)
        listen, admin = free_port(), free_port()
        cfg = render.render({
            "LISTEN_HOST": "127.0.0.1", "LISTEN_PORT": listen, "ADMIN_PORT": admin,
            "EPP_HOST": s.epp.grpc.rsplit(":", 1)[0], "EPP_PORT": s.epp.grpc.rsplit(":", 1)[1],
            "BODY_MODE": "FULL_DUPLEX_STREAMED",
        })
        (d / "envoy.yaml").write_text(cfg)
        envoy = Proc("envoy", [str(envoy_binary()), "-c", str(d / "envoy.yaml"), "--disable-hot-restart", "-l", "warning"])
        procs.append(envoy)
        poll_ok(f"http://127.0.0.1:{admin}/ready", 60, envoy)
        s.url = f"http://127.0.0.1:{listen}"
        # Polled, not slept: the picker's first scrape makes the fake healthy.
        deadline = time.monotonic() + 60
        while requests.post(s.url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1},
                            timeout=30).status_code != 200:
            assert time.monotonic() < deadline, "no request routed within 60 s"
            time.sleep(0.1)
        yield s
    finally:
        for p in reversed(procs):
            p.stop(signal.SIGTERM)
        s.fake.close()


def token_events(text: str) -> list[str]:
    """The token texts of the complete events in `text` (the part after the
    last blank line has not fully arrived)."""
    out = []
    for event in text.split("\n\n")[:-1]:
        data = event.strip().removeprefix("data: ")
        if data != "[DONE]":
            out.append(json.loads(data)["choices"][0]["text"])
    return out


@pytest.mark.parametrize("api,body", [
    ("/v1/completions", {"prompt": "Hi"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
])
def test_each_token_chunk_reaches_the_client_before_the_next_exists(st, api, body):
    n = 4
    start = st.fake.sent
    with requests.post(st.url + api, json={"model": MODEL, "max_tokens": n, "stream": True, **body},
                       stream=True, timeout=(10, 20)) as r:
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith("text/event-stream"), r.headers
        chunks = r.iter_content(chunk_size=None)
        text = ""
        for i in range(n):
            # A read timeout (20 s) here means the chunk was held back: the
            # fake will not write token i+1 until this loop releases it.
            while len(token_events(text)) <= i:
                text += next(chunks).decode()
            assert token_events(text)[: i + 1] == [f"t{k}" for k in range(i + 1)], text
            assert st.fake.sent - start == i + 1, "the fake wrote a token the test had not released"
            if i + 1 < n:
                st.fake.gate.release()
        rest = b"".join(chunks).decode()
    assert (text + rest).rstrip().endswith("data: [DONE]"), text + rest
