"""A Kubernetes API server for the discovery test through Envoy. No real API
server can run on the machines these tests run on; this one serves what the
picker's `kube` client calls, the way the API server answers:

- list: `GET /api/v1/namespaces/NS/pods?labelSelector=k=v,...` and
  `GET /apis/inference.networking.k8s.io/v1/namespaces/NS/inferencepools?fieldSelector=metadata.name=N`
  → a `PodList` / `InferencePoolList` with `metadata.resourceVersion`;
- watch (`watch=true&resourceVersion=V`): a chunked stream of JSON lines
  `{"type": ADDED|MODIFIED|DELETED|BOOKMARK|ERROR, "object": ...}`, every change
  after V; an object that leaves (enters) the selector is DELETED (ADDED);
  `410 Gone` (an ERROR event with a `Status`, reason `Expired`) when V is older
  than the compacted history; bookmarks at the current version.

Objects start from the recorded shapes in tests/fixtures/kube/. The Rust
discovery tests use a twin of this server (policies/pool/tests/common/kube_api.rs).
"""

from __future__ import annotations

import copy
import http.server
import json
import pathlib
import threading
import time
import urllib.parse

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "kube"
POOLS = "inferencepools"
PODS = "pods"


def fixture(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


def pod(name: str, ip: str, role: str | None, pool: str, ready: bool = True, seq_len: int = 512) -> dict:
    p = fixture("pod.json")
    p["metadata"]["name"] = name
    p["metadata"]["uid"] = f"uid-{name}"
    labels = p["metadata"]["labels"]
    labels["rngd-pd.io/pool"] = pool
    if role is None:
        labels.pop("llm-d.ai/role", None)
    else:
        labels["llm-d.ai/role"] = role
    p["metadata"]["annotations"]["rngd-pd.io/seq-len"] = str(seq_len)
    p["status"]["podIP"] = ip
    p["status"]["podIPs"] = [{"ip": ip}]
    set_ready(p, ready)
    return p


def set_ready(p: dict, ready: bool) -> None:
    for c in p["status"]["conditions"]:
        if c["type"] in ("Ready", "ContainersReady"):
            c["status"] = "True" if ready else "False"
    p["status"]["containerStatuses"][0]["ready"] = ready


def pool(name: str, match_labels: dict, port: int) -> dict:
    p = fixture("inferencepool.json")
    p["metadata"]["name"] = name
    p["spec"]["selector"]["matchLabels"] = match_labels
    p["spec"]["targetPorts"] = [{"number": port}]
    return p


def _status(code: int, reason: str, message: str) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}


def _selector(query: dict) -> tuple[list, str | None]:
    labels = [tuple(p.split("=", 1)) for p in query.get("labelSelector", [""])[0].split(",") if "=" in p]
    name = None
    for p in query.get("fieldSelector", [""])[0].split(","):
        if p.startswith("metadata.name="):
            name = p.split("=", 1)[1]
    return labels, name


def _matches(obj: dict | None, sel: tuple[list, str | None]) -> bool:
    if obj is None:
        return False
    labels, name = sel
    if name is not None and obj["metadata"].get("name") != name:
        return False
    have = obj["metadata"].get("labels") or {}
    return all(have.get(k) == v for k, v in labels)


class KubeApi(http.server.ThreadingHTTPServer):
    """The fake API server for namespace `namespace` on 127.0.0.1:0."""

    daemon_threads = True

    def __init__(self, namespace: str = "ai", bookmark_every: float = 0.5):
        self.namespace = namespace
        self.bookmark_every = bookmark_every
        self.cond = threading.Condition()
        self.rv = 1000
        self.objects: dict[tuple[str, str], dict] = {}
        self.history: list[tuple[int, str, dict | None, dict | None]] = []
        self.compacted_below = 0
        self.generation = 0
        self.watches: list[tuple[str, int]] = []
        super().__init__(("127.0.0.1", 0), _Handler)
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def kubeconfig(self, path: pathlib.Path) -> pathlib.Path:
        path.write_text(
            "apiVersion: v1\nkind: Config\n"
            f"clusters:\n- name: fake\n  cluster:\n    server: {self.url}\n"
            f"contexts:\n- name: fake\n  context:\n    cluster: fake\n    user: nobody\n    namespace: {self.namespace}\n"
            "current-context: fake\nusers:\n- name: nobody\n  user: {}\n"
        )
        return path

    # --- what a test does to the cluster ---

    def put(self, resource: str, obj: dict) -> None:
        with self.cond:
            self.rv += 1
            obj = copy.deepcopy(obj)
            obj["metadata"]["resourceVersion"] = str(self.rv)
            key = (resource, obj["metadata"]["name"])
            before = self.objects.get(key)
            self.objects[key] = obj
            self.history.append((self.rv, resource, before, obj))
            self.cond.notify_all()

    def get(self, resource: str, name: str) -> dict:
        with self.cond:
            return copy.deepcopy(self.objects[(resource, name)])

    def delete(self, resource: str, name: str) -> None:
        with self.cond:
            before = self.objects.pop((resource, name), None)
            if before is None:
                return
            self.rv += 1
            self.history.append((self.rv, resource, before, None))
            self.cond.notify_all()

    def drop_watches(self) -> None:
        """Ends every open watch (a connection reset, the server's watch timeout)."""
        with self.cond:
            self.generation += 1
            self.cond.notify_all()

    def compact(self) -> None:
        """Forgets the history: watches resuming from before now get 410 Gone."""
        with self.cond:
            self.compacted_below = self.rv
            self.history.clear()

    def close(self) -> None:
        self.drop_watches()
        self.shutdown()
        self.server_close()


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: KubeApi

    def log_message(self, *args):  # quiet
        pass

    def _json(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        url = urllib.parse.urlsplit(self.path)
        q = urllib.parse.parse_qs(url.query)
        ns = self.server.namespace
        if url.path == f"/api/v1/namespaces/{ns}/pods":
            resource = PODS
        elif url.path == f"/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools":
            resource = POOLS
        else:
            self._json(404, _status(404, "NotFound", f"the server could not find the requested resource ({url.path})"))
            return
        sel = _selector(q)
        if q.get("watch", ["false"])[0] == "true":
            self._watch(resource, sel, int(q.get("resourceVersion", ["0"])[0] or 0),
                        q.get("allowWatchBookmarks", ["false"])[0] == "true",
                        int(q.get("timeoutSeconds", ["290"])[0]))
        else:
            self._list(resource, sel)

    def _list(self, resource: str, sel) -> None:
        s = self.server
        with s.cond:
            items = []
            for (r, _), o in sorted(s.objects.items()):
                if r == resource and _matches(o, sel):
                    o = copy.deepcopy(o)
                    o.pop("kind", None)
                    o.pop("apiVersion", None)
                    items.append(o)
            rv = s.rv
        kind, api = ("PodList", "v1") if resource == PODS else ("InferencePoolList", "inference.networking.k8s.io/v1")
        self._json(200, {"kind": kind, "apiVersion": api, "metadata": {"resourceVersion": str(rv)}, "items": items})

    def _chunk(self, obj: dict) -> None:
        data = (json.dumps(obj) + "\n").encode()
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _watch(self, resource: str, sel, since: int, bookmarks: bool, timeout_s: int) -> None:
        s = self.server
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        with s.cond:
            s.watches.append((resource, since))
            generation = s.generation
            expired = since < s.compacted_below
        try:
            if expired:
                self._chunk({"type": "ERROR", "object": _status(410, "Expired", f"too old resource version: {since}")})
                return
            cursor = since
            end = time.monotonic() + timeout_s
            next_bookmark = time.monotonic() + s.bookmark_every
            while time.monotonic() < end:
                with s.cond:
                    events = []
                    for rv, r, before, after in s.history:
                        if r != resource or rv <= cursor:
                            continue
                        was, is_ = _matches(before, sel), _matches(after, sel)
                        if was and is_:
                            events.append({"type": "MODIFIED", "object": after})
                        elif is_:
                            events.append({"type": "ADDED", "object": after})
                        elif was:
                            gone = copy.deepcopy(after if after is not None else before)
                            gone["metadata"]["resourceVersion"] = str(rv)
                            events.append({"type": "DELETED", "object": gone})
                    cursor = s.rv
                    if s.generation != generation:
                        return
                for e in events:
                    self._chunk(e)
                if bookmarks and time.monotonic() >= next_bookmark:
                    kind, api = ("Pod", "v1") if resource == PODS else ("InferencePool", "inference.networking.k8s.io/v1")
                    self._chunk({"type": "BOOKMARK", "object": {"kind": kind, "apiVersion": api,
                                                                "metadata": {"resourceVersion": str(cursor)}}})
                    next_bookmark = time.monotonic() + s.bookmark_every
                with s.cond:
                    if s.rv == cursor and s.generation == generation:
                        s.cond.wait(timeout=max(0.01, next_bookmark - time.monotonic()))
        except (BrokenPipeError, ConnectionResetError):
            return
        finally:
            try:
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
            except OSError:
                pass
            self.close_connection = True
