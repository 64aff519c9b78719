"""`rngd-pd up --prefill-workers N --decode-workers M`: one prefill and two
decode workers behind the gateway, driven with the real `openai` client.
Concurrent distinct prompts reach both decode workers (their own `/metrics`
count them). A SIGKILLed decode worker, then the SIGKILLed relay, are
started again by `up` on the addresses they had, while the gateway keeps
answering; once `up` stops on SIGINT none of its children (the restarted
ones included) is left. Wrong counts are refused before anything starts.
"""

import os
import signal
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import requests

from conftest import counter, rngd_bin, start_stack


def children(pid):
    """{pid: cmdline} of the processes whose parent is `pid`."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode().strip()
        except OSError:
            continue
        # The parent pid is the second field after the parenthesised name.
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out[int(entry)] = cmdline
    return out


def alive(pid, cmdline):
    """The process `pid` still runs the same command line (not a reused pid)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode().strip() == cmdline
    except OSError:
        return False


@pytest.fixture(scope="module")
def stack():
    s = start_stack("shm", "--prefill-workers", "1", "--decode-workers", "2",
                    "--served-model-name", "up-served-name")
    s.decode1 = s.proc.wait_line("rngd-pd up: decode-1 ", 5)
    s.children = children(s.proc.p.pid)
    yield s
    # Read again now: a test may have had children restarted since.
    kids = children(s.proc.p.pid)
    assert s.proc.stop() == 0
    assert not os.path.exists(s.shm_root)
    left = {pid: c for pid, c in {**s.children, **kids}.items() if alive(pid, c)}
    assert not left, f"children of rngd-pd up still running: {left}"


def wait_for(what, check, within):
    """Polls `check()` every 0.1 s until it returns something true (returned)."""
    deadline = time.monotonic() + within
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"{what}: not within {within} s"
        time.sleep(0.1)


def the_child(stack, *needles, but=None):
    """(pid, cmdline) of the one running child of `up` whose command line
    holds every needle (other than pid `but`), or None."""
    found = [(pid, c) for pid, c in children(stack.proc.p.pid).items()
             if pid != but and c and all(n in c for n in needles)]
    assert len(found) <= 1, found
    return found[0] if found else None


def client(stack):
    return openai.OpenAI(base_url=stack.gateway + "/v1", api_key="unused", max_retries=0, timeout=300)


def ask(c, stack, prompt):
    r = c.completions.create(model=stack.model, prompt=prompt, max_tokens=4, temperature=0)
    assert r.choices[0].text, r
    return r


def healthy_decoders(stack):
    roles = requests.get(stack.gateway + "/ready", timeout=5).json().get("endpoints", {})
    return roles.get("decode", {}).get("healthy", 0)


def test_every_worker_is_a_child_and_is_printed(stack):
    cmds = list(stack.children.values())
    assert sum(" worker --role prefill " in c for c in cmds) == 1, cmds
    assert sum(" worker --role decode " in c for c in cmds) == 2, cmds
    assert sum(" gateway " in c for c in cmds) == 1, cmds
    urls = {stack.prefill, stack.decode, stack.decode1}
    assert len(urls) == 3 and all(u.startswith("http://") for u in urls), urls
    # Each worker has its own KV-event publisher, given to the gateway.
    gateway = next(c for c in cmds if " gateway " in c)
    for u in urls:
        assert f"--kv-events {u.removeprefix('http://')}=tcp://" in gateway, gateway


def test_the_picker_s_metrics_and_health_are_printed_and_answer(stack):
    """The summary names the picker's metrics URL and gRPC health address;
    the metrics page answers with the picker's families."""
    import requests

    line = stack.proc.wait_line("rngd-pd up: ext-proc  metrics ", 5)
    url, health = line.split(", grpc health ")
    assert url.startswith("http://") and url.endswith("/metrics"), line
    assert "inference_pool_ready_pods" in requests.get(url, timeout=10).text
    host, port = health.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0, line
    # Every door serves the name given to up: the picker too.
    assert stack.model == "up-served-name"
    cmds = list(stack.children.values())
    for kind in (" ext-proc ", " gateway ", " worker "):
        for c in (c for c in cmds if kind in c):
            assert "--served-model-name up-served-name" in c, c


def test_concurrent_prompts_reach_both_decode_workers(stack):
    c = openai.OpenAI(base_url=stack.gateway + "/v1", api_key="unused", max_retries=0, timeout=300)
    decoders = [u.removeprefix("http://") for u in (stack.decode, stack.decode1)]
    metric = "rngd_pd_worker_requests_total"
    before = [counter(d, metric) for d in decoders]

    def ask(i):
        prompt = f"Item {i}: a {['red', 'green', 'blue', 'small'][i % 4]} boat number {i * 7} sails to"
        r = c.completions.create(model=stack.model, prompt=prompt, max_tokens=4, temperature=0)
        assert r.choices[0].text, r
        return r

    # Routing reads the workers' load from their /metrics (scraped every
    # 50 ms), so a burst that starts together may land on one worker; a few
    # bursts at most are sent until both have served some.
    sent = 0
    for burst in range(4):
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(ask, range(sent, sent + 8)))
        sent += 8
        served = [counter(d, metric) - b for d, b in zip(decoders, before)]
        if all(n > 0 for n in served):
            break
    assert all(n > 0 for n in served), f"requests per decode worker after {sent}: {served}"
    assert sum(served) >= sent


def test_a_killed_decode_worker_comes_back_on_its_addresses(stack):
    """SIGKILL decode-1: `up` keeps running, the gateway answers on the
    other decode worker meanwhile, and decode-1 comes back (a new process)
    on the same URL and the same KV-event endpoints the gateway and the
    picker were given, and serves requests again."""
    worker = (" worker --role decode ", '"topic":"kv@decode-1"')
    old, _ = the_child(stack, *worker)
    port = stack.decode1.rsplit(":", 1)[1]
    publ, replay = stack.proc.wait_line("rngd-pd up: kv events decode-1 ", 5).split(" replay ")
    os.kill(old, signal.SIGKILL)
    c = client(stack)
    # Once the gateway has seen it go, the other decode worker serves.
    wait_for("the gateway seeing decode-1 gone", lambda: healthy_decoders(stack) == 1, 30)
    for i in range(3):
        ask(c, stack, f"While one worker restarts, request {i} asks about")
    assert stack.proc.p.poll() is None, "rngd-pd up stopped when a worker died"

    def back():
        try:
            if requests.get(stack.decode1 + "/ready", timeout=2).status_code != 200:
                return None
        except requests.RequestException:
            return None
        return the_child(stack, *worker, but=old)

    # Bounded by the model load (seconds) and the first backoff (0.5 s).
    new, cmd = wait_for("decode-1 ready again on " + stack.decode1, back, 120)
    assert new != old
    assert f" --port {port} " in cmd, cmd
    assert f'"endpoint":"{publ}"' in cmd and f'"replay_endpoint":"{replay}"' in cmd, cmd
    assert stack.proc.p.poll() is None
    # The gateway routes to it again: bursts of distinct prompts until the
    # new process has served some (its counters start from zero).
    wait_for("the gateway seeing decode-1 back", lambda: healthy_decoders(stack) == 2, 30)
    d1 = stack.decode1.removeprefix("http://")
    metric = "rngd_pd_worker_requests_total"
    sent = 0
    with ThreadPoolExecutor(8) as pool:
        for burst in range(4):
            list(pool.map(lambda i: ask(c, stack, f"After the restart, boat {i * 13} sails to"),
                          range(sent, sent + 8)))
            sent += 8
            if counter(d1, metric) > 0:
                break
    assert counter(d1, metric) > 0, f"decode-1 served none of {sent} requests after its restart"


def test_a_killed_relay_comes_back_on_its_addresses(stack):
    """SIGKILL the relay: it comes back on the same listen and metrics
    addresses (the workers were given the first), and requests still work."""
    addr = stack.proc.wait_line("rngd-pd up: relay     tcp://", 5)
    metrics = stack.proc.wait_line("rngd-pd up: relay     metrics ", 5)
    old, _ = the_child(stack, " relay --listen ")
    os.kill(old, signal.SIGKILL)
    c = client(stack)
    ask(c, stack, "While the relay restarts, the sky is")

    def back():
        new = the_child(stack, " relay --listen ", but=old)
        if new is None:
            return None
        try:
            host, port = addr.rsplit(":", 1)
            with socket.create_connection((host, int(port)), timeout=2):
                pass
            if requests.get(metrics, timeout=2).status_code != 200:
                return None
        except OSError:
            return None
        return new

    new, cmd = wait_for("the relay back on " + addr, back, 60)
    assert f" --listen {addr} " in cmd, cmd
    assert f" --metrics-listen {metrics.removeprefix('http://').removesuffix('/metrics')}" in cmd, cmd
    assert stack.proc.p.poll() is None, "rngd-pd up stopped when the relay died"
    ask(c, stack, "After the relay restarted, the sea is")


def test_counts_are_refused_before_anything_starts():
    for flags, msg in [(["--prefill-workers", "0", "--decode-workers", "0"], "no worker would serve"),
                       (["--decode-workers", "0"], "--decode-workers must be at least 1"),
                       (["--prefill-workers", "17"], "more than 16")]:
        r = subprocess.run([rngd_bin(), "up", "--gateway-port", "0", *flags], capture_output=True, text=True,
                           timeout=30)
        assert r.returncode != 0 and msg in r.stderr, (flags, r.returncode, r.stderr)
