"""Fixtures that start the real local stack (`rngd-pd up`) and a solo worker.

The binary is `$RNGD_PD_BIN`, else `$CARGO_TARGET_DIR/release/rngd-pd`
(default target dir `~/.cache/rngd-pd/target`). Readiness is read from the
processes' printed lines and by polling HTTP endpoints; nothing sleeps a fixed
time to wait for a server.
"""

import os
import signal
import subprocess
import threading
import time

import pytest
import requests


def rngd_bin():
    b = os.environ.get("RNGD_PD_BIN")
    if not b:
        target = os.environ.get("CARGO_TARGET_DIR") or os.path.expanduser("~/.cache/rngd-pd/target")
        b = os.path.join(target, "release", "rngd-pd")
    if not os.path.isfile(b):
        pytest.fail(f"rngd-pd binary not found at {b}: build it with `cargo build --release` or set RNGD_PD_BIN")
    return b


# The test deployment's KV secret: workers sign and verify KV handles with it
# (a prefill or decode worker does not start without one).
KV_SECRET = "python-tests-kv-secret-0123456789"

# The name the default model is served under (from its GGUF metadata; see
# docs/engine.md). Every door refuses any other name with 404, so tests that
# talk to a door running the default model send this one.
SERVED_MODEL = "smollm2-135M-instruct"


def worker_env(**extra):
    """The environment of a worker the tests start (the KV secret added)."""
    return dict(os.environ, AIRM_KV_TCP_SECRET=KV_SECRET, **extra)


def start_worker(role, *extra, host="127.0.0.1", port=0, env=None, model=None):
    """A real worker (the KV secret in its environment, and `env`) on
    `host:port` (port 0: any) serving `model` (default: the default model's
    file), ready (`/ready` 200); returns (proc, "host:port")."""
    m = str(model) if model else model_path()
    if not os.path.isfile(m):
        pytest.fail(f"model {m} not found: run `rngd-pd model fetch` or set RNGD_PD_MODEL")
    p = Proc(f"{role} worker {host}", [rngd_bin(), "worker", "--role", role, "--host", host, "--port", str(port),
                                       "--model", m, *extra], env=worker_env(**(env or {})))
    url = p.wait_line("rngd-pd worker listening on", 300)
    if not url.startswith("http"):
        url = "http://" + url
    poll_ok(url + "/ready", 600, p)
    return p, url.removeprefix("http://")


def counter(addr, name):
    """Sum of the samples of `name` (any labels) on a server's `/metrics`."""
    text = requests.get(f"http://{addr}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def greedy_completion(url, prompt, max_tokens):
    """A greedy, non-streamed completion from `url` (a base URL); the whole answer."""
    r = requests.post(
        url + "/v1/completions",
        json={"model": SERVED_MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
        timeout=300,
    )
    assert r.status_code == 200, r.text
    return r.json()


def model_path():
    m = os.environ.get("RNGD_PD_MODEL")
    if m:
        return m
    cache = os.environ.get("RNGD_PD_CACHE") or os.path.expanduser("~/.cache/rngd-pd")
    return os.path.join(cache, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")


class Proc:
    """A child process whose stdout lines are collected by a reader thread."""

    def __init__(self, name, args, env=None, stderr=None):
        """`stderr`: a file to write the child's standard error (its log) to;
        None = inherited (pytest shows it on failure)."""
        self.name = name
        self.lines = []
        self.cond = threading.Condition()
        self.done = False
        self.p = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=env,
            start_new_session=True,
        )
        self.t = threading.Thread(target=self._read, daemon=True)
        self.t.start()

    def _read(self):
        for line in self.p.stdout:
            with self.cond:
                self.lines.append(line.rstrip("\n"))
                self.cond.notify_all()
        with self.cond:
            self.done = True
            self.cond.notify_all()

    def wait_line(self, prefix, timeout):
        """Returns the rest of the first stdout line starting with `prefix`."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for line in self.lines:
                    if line.startswith(prefix):
                        return line[len(prefix):].strip()
                if self.done:
                    pytest.fail(f"{self.name} exited (code {self.p.poll()}) before printing {prefix!r}; output: {self.lines}")
                left = deadline - time.monotonic()
                if left <= 0:
                    pytest.fail(f"{self.name} did not print {prefix!r} within {timeout} s; output: {self.lines}")
                self.cond.wait(left)

    def stop(self, sig=signal.SIGINT, timeout=30):
        if self.p.poll() is None:
            self.p.send_signal(sig)
            try:
                self.p.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.p.pid, signal.SIGKILL)
                self.p.wait(10)
                pytest.fail(f"{self.name} did not stop on {sig!r} within {timeout} s")
        return self.p.returncode


def wait_every_endpoint_scraped(url, within=60):
    """Polls the gateway's `/ready` until every endpoint it was given is
    healthy, i.e. scraped once (health, weight version and load come from
    the same scrape). `/ready` itself turns 200 as soon as one endpoint can
    decode, which can be before the prefill worker's first scrape."""
    deadline = time.monotonic() + within
    while True:
        r = requests.get(url + "/ready", timeout=5)
        roles = r.json().get("endpoints", {})
        if roles and all(c["healthy"] == c["total"] for c in roles.values()):
            return
        assert time.monotonic() < deadline, f"endpoints not all scraped in {within} s: {r.text}"
        time.sleep(0.05)


def poll_ok(url, timeout, proc=None):
    deadline = time.monotonic() + timeout
    while True:
        try:
            r = requests.get(url, timeout=2)
            if r.status_code == 200:
                return r
        except requests.RequestException:
            pass
        if proc is not None and proc.p.poll() is not None:
            pytest.fail(f"{proc.name} exited (code {proc.p.returncode}) while waiting for {url}")
        if time.monotonic() > deadline:
            pytest.fail(f"{url} not ready within {timeout} s")
        time.sleep(0.1)


def free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Stack:
    def __init__(self, proc, transport):
        self.proc = proc
        self.transport = transport
        self.gateway = proc.wait_line("rngd-pd up: gateway", 900)
        self.prefill = proc.wait_line("rngd-pd up: prefill", 5)
        self.decode = proc.wait_line("rngd-pd up: decode", 5)
        self.shm_root = proc.wait_line("rngd-pd up: shm root", 5)
        self.kpis = proc.wait_line("rngd-pd up: kpis", 5)
        self.model = proc.wait_line("rngd-pd up: model", 5)
        proc.wait_line("rngd-pd up: ready", 5)
        poll_ok(self.gateway + "/health", 60, proc)


def start_stack(transport, *extra):
    proc = Proc(
        f"rngd-pd up ({transport})",
        [rngd_bin(), "up", "--gateway-port", "0", "--metrics-port", "0", "--kv-transport", transport, *extra],
    )
    try:
        return Stack(proc, transport)
    except BaseException:
        proc.stop()
        raise


@pytest.fixture(scope="session", params=["shm", "tcp", "nixl-ucx"])
def stack(request):
    """`rngd-pd up` with the given KV transport; stopped (and checked clean) at the end.

    Without KV events (`--no-kv-events`), so the gateway routes on load: the
    PD suites send the same prompts again and count a prefill and a KV load
    per request, which routing on cached prefixes would (rightly) skip.
    `test_cache_routing.py` starts its own stack with them."""
    s = start_stack(request.param, "--no-kv-events")
    yield s
    code = s.proc.stop()
    assert code == 0, f"rngd-pd up exited with {code} on SIGINT"
    assert not os.path.exists(s.shm_root), f"shm root {s.shm_root} left behind"


@pytest.fixture(scope="session")
def solo():
    """A solo worker on the same model: the single-worker reference."""
    proc = Proc("solo worker", [rngd_bin(), "worker", "--role", "solo", "--port", "0", "--model", model_path()],
                env=worker_env())
    try:
        url = proc.wait_line("rngd-pd worker listening on", 120)
        if not url.startswith("http"):
            url = "http://" + url
        poll_ok(url + "/ready", 600, proc)
        yield url
    finally:
        proc.stop(signal.SIGTERM)


def converse(client, model, messages, follow_ups, served):
    """A conversation through the `openai` client: `messages`, then each of
    `follow_ups` after the assistant's answer (greedy, 4 tokens a turn). Per
    turn: the indexes of the decode workers whose `served()` count rose, the
    `x-rngd-pd-route-reason` response header, `cached_tokens`, `prompt_tokens`."""
    messages = list(messages)
    turns = []
    for question in [*follow_ups, None]:
        before = served()
        raw = client.chat.completions.with_raw_response.create(model=model, messages=messages, max_tokens=4,
                                                               temperature=0)
        r = raw.parse()
        after = served()
        turns.append(([i for i in range(len(after)) if after[i] > before[i]],
                      raw.headers.get("x-rngd-pd-route-reason"),
                      r.usage.prompt_tokens_details.cached_tokens, r.usage.prompt_tokens))
        if question is not None:
            messages += [{"role": "assistant", "content": r.choices[0].message.content},
                         {"role": "user", "content": question}]
    return [list(column) for column in zip(*turns)]
