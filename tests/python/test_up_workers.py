"""`rngd-pd up --prefill-workers N --decode-workers M`: one prefill and two
decode workers behind the gateway, driven with the real `openai` client.
Concurrent distinct prompts reach both decode workers (their own `/metrics`
count them), and once `up` stops on SIGINT none of its children is left.
Wrong counts are refused before anything starts.
"""

import os
import subprocess
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

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
    assert s.proc.stop() == 0
    assert not os.path.exists(s.shm_root)
    left = {pid: c for pid, c in s.children.items() if alive(pid, c)}
    assert not left, f"children of rngd-pd up still running: {left}"


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


def test_counts_are_refused_before_anything_starts():
    for flags, msg in [(["--prefill-workers", "0", "--decode-workers", "0"], "no worker would serve"),
                       (["--decode-workers", "0"], "--decode-workers must be at least 1"),
                       (["--prefill-workers", "17"], "more than 16")]:
        r = subprocess.run([rngd_bin(), "up", "--gateway-port", "0", *flags], capture_output=True, text=True,
                           timeout=30)
        assert r.returncode != 0 and msg in r.stderr, (flags, r.returncode, r.stderr)
