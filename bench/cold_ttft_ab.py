#!/usr/bin/env python3
"""Cold-prefill TTFT of two `rngd-pd` builds, side by side in one run.

Starts one solo worker per binary (default model, loopback, free ports),
then sends both the same prompts in alternation: `max_tokens` 1, greedy, a
fresh `cache_salt` on every request so nothing comes from the prefix cache.
Prints the median worker-reported `timings.ttft_ms` per prompt length and
the ratio B/A.

    python3 bench/cold_ttft_ab.py --a OLD/rngd-pd --b NEW/rngd-pd [--reps 7]
"""

import argparse
import json
import random
import socket
import statistics
import subprocess
import time
import urllib.request

TEXT = " ".join(f"the keeper climbs stairs number {i} tonight" for i in range(100))
WORDS = (2, 6, 12, 40, 150, 300)
MODEL = "smollm2-135M-instruct"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(port, proc, timeout=300):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"worker on {port} exited with {proc.returncode}")
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2).status == 200:
                return
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"worker on {port} not ready in {timeout} s")


def ttft_ms(port, words):
    body = {"model": MODEL, "prompt": " ".join(TEXT.split()[:words]), "max_tokens": 1,
            "temperature": 0, "cache_salt": f"ab-{random.random()}"}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    d = json.load(urllib.request.urlopen(req, timeout=120))
    return d["usage"]["prompt_tokens"], d["timings"]["ttft_ms"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", required=True, help="baseline rngd-pd binary")
    ap.add_argument("--b", required=True, help="rngd-pd binary compared with it")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    workers = {}
    try:
        for name, binary in (("a", args.a), ("b", args.b)):
            port = free_port()
            proc = subprocess.Popen([binary, "worker", "--role", "solo", "--host", "127.0.0.1",
                                     "--port", str(port)],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            workers[name] = (proc, port)
        for proc, port in workers.values():
            wait_ready(port, proc)
        res = {"a": {}, "b": {}}
        for _ in range(args.reps):
            for words in WORDS:
                for name, (_, port) in workers.items():
                    n, ms = ttft_ms(port, words)
                    res[name].setdefault(n, []).append(ms)
        rows = []
        for n in sorted(res["a"]):
            a, b = statistics.median(res["a"][n]), statistics.median(res["b"][n])
            rows.append({"prompt_tokens": n, "a_ms": a, "b_ms": b, "b_over_a": b / a})
            print(f"cold prompt {n:4} tokens: a {a:7.1f} ms, b {b:7.1f} ms, b/a {b / a:.2f}")
        print(json.dumps({"reps": args.reps, "rows": rows}))
    finally:
        for proc, _ in workers.values():
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    main()
