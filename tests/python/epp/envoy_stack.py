"""Helpers for suites that run real Envoy in front of `rngd-pd ext-proc`:
the deploy config with a trusted subset-hint filter, a raw HTTP/1.1 client
that can stall mid-body, and a process's resident memory from /proc.

The subset hint of GIE comes from Envoy's filter metadata
(`envoy.lb.subset_hint` / `x-gateway-destination-endpoint-subset`), which
something in front of the picker sets; a client header never counts. The
test stacks let the tests set it through Envoy's `header_to_metadata` filter
on a test-only header (`SUBSET_HINT_HEADER`, removed before forwarding): the
operator's choice of a trusted source, never the picker's.
"""

from __future__ import annotations

import re
import socket

SUBSET_HINT_HEADER = "x-test-subset-hint"

_FILTER = """\
{indent}- name: envoy.filters.http.header_to_metadata
{indent}  typed_config:
{indent}    "@type": type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config
{indent}    request_rules:
{indent}      - header: {header}
{indent}        on_header_present:
{indent}          metadata_namespace: envoy.lb.subset_hint
{indent}          key: x-gateway-destination-endpoint-subset
{indent}          type: STRING
{indent}        remove: true
"""


def with_subset_hint_filter(cfg: str, header: str = SUBSET_HINT_HEADER) -> str:
    """The rendered deploy config with a `header_to_metadata` filter before
    ext_proc that turns `header` into the subset hint metadata."""
    m = re.search(r"^( *)- name: envoy\.filters\.http\.ext_proc$", cfg, re.M)
    assert m, "the ext_proc filter is not in the rendered config"
    return cfg[: m.start()] + _FILTER.format(indent=m.group(1), header=header) + cfg[m.start():]


def rss_kb(pid: int) -> int:
    """VmRSS of a process, KiB (/proc/<pid>/status)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")


def open_post(host: str, port: int, path: str, headers: dict, body_prefix: bytes, timeout: float = 30) -> socket.socket:
    """An HTTP/1.1 POST whose headers and the first `body_prefix` bytes are
    sent; the rest of the body (per the headers) is never sent: a stalled client."""
    s = socket.create_connection((host, port), timeout=timeout)
    lines = [f"POST {path} HTTP/1.1", f"host: {host}:{port}"] + [f"{k}: {v}" for k, v in headers.items()]
    s.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
    if body_prefix:
        s.sendall(body_prefix)
    return s


def read_response(s: socket.socket, timeout: float = 30) -> tuple[int, dict, bytes]:
    """Status, headers and body of one HTTP/1.1 response (content-length framed)."""
    s.settimeout(timeout)
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = s.recv(65536)
        if not chunk:
            raise AssertionError(f"connection closed before a response: {buf!r}")
        buf += chunk
    head, rest = buf.split(b"\r\n\r\n", 1)
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    status = int(status_line.split()[1])
    headers = {}
    for line in header_lines:
        k, v = line.split(":", 1)
        headers[k.strip().lower()] = v.strip()
    n = int(headers.get("content-length", "0"))
    while len(rest) < n:
        chunk = s.recv(65536)
        if not chunk:
            break
        rest += chunk
    return status, headers, rest[:n]
