"""One tokenization (issue 52, item 4), with real processes: a gateway
tokenizes each prompt for routing and sends its ids upstream with its
tokenizer's digest (`tokenized_prompt`); a worker with the same digest
serves those ids without tokenizing the text again, one with another
digest ignores them and tokenizes the text itself.

The mismatch is a second GGUF made from the default model with two
vocabulary entries swapped (`Ġthe` and `Ġand`: same length, same type, so
the file stays a valid model of the same weights and the same name; only
the ids of the two words trade places). A gateway with the original file
in front of a worker with the swapped one must:

- answer 200 with exactly what the worker answers when asked directly
  (completions and chats), which differs from what the door's ids would
  give;
- count the worker's `rngd_pd_worker_tokenizer_mismatch_total`, with a
  warning in the worker's log;
- show both digests on its `/metrics` (`rngd_pd_router_tokenizer_info`, its
  own as `endpoint="self"`) and `rngd_pd_router_tokenizer_mismatch` 1 for
  the worker, with a warning in its log.

With the same file on both sides, nothing is counted as a mismatch and the
worker serves the door's ids (`rngd_pd_worker_prompt_ids_reused_total`).
A client may not send `tokenized_prompt` to the gateway (400, `param`
`tokenized_prompt`).
"""

import os
import re
import shutil

import pytest
import requests

import gguf
from conftest import (SERVED_MODEL, Proc, counter, model_path, poll_ok, rngd_bin, wait_every_endpoint_scraped,
                      worker_env)

SWAPPED = ("Ġthe", "Ġand")
# Both swapped words, several times each.
PROMPT = ("Write down the names and the dates of the ships and the boats that passed the harbour and the "
          "lighthouse in the night, and the weather")
CHAT = [{"role": "system", "content": "You answer the questions and the requests in one sentence."},
        {"role": "user", "content": "What are the colours of the sea and the sky and the sand?"}]


def swapped_copy(src, dst):
    """`src` copied to `dst` with the vocabulary entries of `SWAPPED`
    exchanged in place (equal byte lengths); returns their ids."""
    shutil.copyfile(src, dst)
    r = gguf.GGUFReader(dst, "r+")
    f = r.fields["tokenizer.ggml.tokens"]
    want = [s.encode() for s in SWAPPED]
    ids = {}
    for i, at in enumerate(f.data):
        b = bytes(f.parts[at])
        if b in want:
            ids[b] = i
    a, b = (ids[w] for w in want)
    pa, pb = f.parts[f.data[a]], f.parts[f.data[b]]
    assert len(pa) == len(pb)
    ta, tb = pa.copy(), pb.copy()
    pa[:] = tb
    pb[:] = ta
    r.data.flush()
    return a, b


def start_solo(name, model, log):
    p = Proc(name, [rngd_bin(), "worker", "--role", "solo", "--host", "127.0.0.1", "--port", "0", "--model",
                    str(model)], env=worker_env(), stderr=log)
    addr = p.wait_line("rngd-pd worker listening on", 300).removeprefix("http://")
    poll_ok(f"http://{addr}/ready", 600, p)
    return p, addr


def start_gateway(worker, log):
    gw = Proc("gateway", [rngd_bin(), "gateway", "--listen", "127.0.0.1:0", "--solo", f"http://{worker}",
                          "--model", model_path()], env=dict(os.environ), stderr=log)
    url = gw.wait_line("rngd-pd gateway listening on", 120)
    if not url.startswith("http"):
        url = "http://" + url
    wait_every_endpoint_scraped(url)
    return gw, url


class Pair:
    pass


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    d = tmp_path_factory.mktemp("tokenizer")
    other = d / "swapped.gguf"
    ids = swapped_copy(model_path(), other)
    logs = {k: open(d / f"{k}.log", "w") for k in ("same", "other", "gw_same", "gw_other")}
    procs = []
    try:
        s = Pair()
        s.swapped_ids, s.dir = ids, d
        p, s.same = start_solo("worker (same tokenizer)", model_path(), logs["same"])
        procs.append(p)
        p, s.other = start_solo("worker (swapped vocabulary)", other, logs["other"])
        procs.append(p)
        p, s.gw_same = start_gateway(s.same, logs["gw_same"])
        procs.append(p)
        p, s.gw_other = start_gateway(s.other, logs["gw_other"])
        procs.append(p)
        s.log = lambda k: (d / f"{k}.log").read_text()
        yield s
    finally:
        for p in reversed(procs):
            p.stop()
        for f in logs.values():
            f.close()
        shutil.rmtree(d, ignore_errors=True)


def digest_of(addr):
    models = requests.get(f"http://{addr}/v1/models", timeout=10).json()["data"]
    digests = {m["tokenizer_digest"] for m in models}
    assert len(digests) == 1, models
    d = digests.pop()
    assert re.fullmatch(r"[0-9a-f]{16}", d), d
    return d


def metric_lines(url, name):
    text = requests.get(f"{url}/metrics", timeout=10).text
    return [line for line in text.splitlines() if line.startswith(name + "{")]


def completion(url, prompt=PROMPT):
    r = requests.post(f"{url}/v1/completions", timeout=300,
                      json={"model": SERVED_MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def chat(url):
    r = requests.post(f"{url}/v1/chat/completions", timeout=300,
                      json={"model": SERVED_MODEL, "messages": CHAT, "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def tokenize(addr, prompt=PROMPT):
    r = requests.post(f"http://{addr}/tokenize", json={"model": SERVED_MODEL, "prompt": prompt}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_each_worker_shows_its_tokenizer_digest(pairs):
    same, other = digest_of(pairs.same), digest_of(pairs.other)
    assert same != other
    for addr, d in ((pairs.same, same), (pairs.other, other)):
        lines = metric_lines(f"http://{addr}", "rngd_pd_worker_tokenizer_info")
        assert len(lines) == 1 and f'digest="{d}"' in lines[0] and lines[0].endswith(" 1"), lines
    # The swap matters: the two files make other ids of the same text.
    a, b = pairs.swapped_ids
    ids_same, ids_other = tokenize(pairs.same), tokenize(pairs.other)
    assert a in ids_same and b in ids_same
    assert ids_other == [{a: b, b: a}.get(i, i) for i in ids_same]


def test_a_worker_with_another_tokenizer_tokenizes_the_text_itself(pairs):
    mismatches = counter(pairs.other, "rngd_pd_worker_tokenizer_mismatch_total")
    reused = counter(pairs.other, "rngd_pd_worker_prompt_ids_reused_total")
    direct = completion(f"http://{pairs.other}"), chat(f"http://{pairs.other}")
    # The door's ids would have given the original model's answer.
    original = completion(f"http://{pairs.same}"), chat(f"http://{pairs.same}")
    assert direct != original, "the swap changes the answers"
    through = completion(pairs.gw_other), chat(pairs.gw_other)
    assert through == direct
    assert counter(pairs.other, "rngd_pd_worker_tokenizer_mismatch_total") == mismatches + 2
    assert counter(pairs.other, "rngd_pd_worker_prompt_ids_reused_total") == reused
    assert "another tokenizer" in pairs.log("other")


def test_the_gateway_shows_both_digests_and_the_mismatch(pairs):
    door, theirs = digest_of(pairs.same), digest_of(pairs.other)
    info = metric_lines(pairs.gw_other, "rngd_pd_router_tokenizer_info")
    assert any('endpoint="self"' in line and f'digest="{door}"' in line and line.endswith(" 1") for line in info), info
    assert any(f'endpoint="{pairs.other}"' in line and f'digest="{theirs}"' in line and line.endswith(" 1")
               for line in info), info
    mismatch = metric_lines(pairs.gw_other, "rngd_pd_router_tokenizer_mismatch")
    assert mismatch == [f'rngd_pd_router_tokenizer_mismatch{{endpoint="{pairs.other}"}} 1'], mismatch
    assert "tokenizer differs from this door's" in pairs.log("gw_other")
    # The door of the same tokenizer sees none.
    mismatch = metric_lines(pairs.gw_same, "rngd_pd_router_tokenizer_mismatch")
    assert mismatch == [f'rngd_pd_router_tokenizer_mismatch{{endpoint="{pairs.same}"}} 0'], mismatch
    assert "tokenizer differs" not in pairs.log("gw_same")


def test_a_worker_with_the_same_tokenizer_serves_the_doors_ids(pairs):
    reused = counter(pairs.same, "rngd_pd_worker_prompt_ids_reused_total")
    direct = completion(f"http://{pairs.same}"), chat(f"http://{pairs.same}")
    # Asked directly, the worker tokenized the text itself.
    assert counter(pairs.same, "rngd_pd_worker_prompt_ids_reused_total") == reused
    through = completion(pairs.gw_same), chat(pairs.gw_same)
    assert through == direct
    assert counter(pairs.same, "rngd_pd_worker_prompt_ids_reused_total") == reused + 2
    assert counter(pairs.same, "rngd_pd_worker_tokenizer_mismatch_total") == 0
    assert "another tokenizer" not in pairs.log("same")


def test_a_client_cannot_send_token_ids_as_the_doors(pairs):
    forged = {"digest": digest_of(pairs.same), "ids": tokenize(pairs.same, "Say something rude")}
    for path, body in (("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions", {"messages": CHAT})):
        r = requests.post(pairs.gw_same + path, timeout=30,
                          json={"model": SERVED_MODEL, "max_tokens": 4, **body, "tokenized_prompt": forged})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "tokenized_prompt", r.text
