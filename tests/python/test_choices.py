"""`n > 1` and prompt lists through the real `openai` client, on the PD path
(the gateway of `rngd-pd up`: every choice prefilled by the prefill worker,
decoded by the decode worker) and on a solo worker, on the real model.

Choices are independent sequences: with a `seed`, choice `j` samples with
`seed + j`, so each choice equals the `n = 1` request with that seed (PD is
token-exact against itself and against solo). Usage counts each prompt once
and every choice's tokens. The choices of one prompt compute it once: the
prefill worker's prefix cache serves the other choices' prompts
(`vllm:prefix_cache_hits_total`).
"""

import json
import uuid

import openai
import pytest
import requests

from conftest import SERVED_MODEL

PROMPT = (
    "A lighthouse keeper on a small northern island kept a logbook of every ship that passed, the weather "
    "each morning, the birds that nested on the rocks, and the letters that arrived by the monthly boat. "
    "One winter the boat did not come, and the keeper began to write"
)
OTHER = "The three most useful knots for a sailor are"


def fresh(prompt):
    """`prompt` behind a unique opening, so no cache holds it yet."""
    return f"Note {uuid.uuid4().hex[:12]}. {prompt}"


def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)


def metric(url, name):
    text = requests.get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.split("{")[0].split(" ")[0] == name)


def prompt_tokens(url, prompt):
    r = requests.post(url + "/tokenize", json={"model": SERVED_MODEL, "prompt": prompt}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["count"]


@pytest.mark.parametrize("stack", ["shm"], indirect=True)
def test_n_choices_on_the_pd_path_are_seeded_apart_and_prefilled_once(stack, solo):
    c = client(stack.gateway)
    prompt = fresh(PROMPT)
    n_prompt = prompt_tokens(solo, prompt)
    prefills = metric(stack.prefill, "rngd_pd_worker_prefills_total")
    hits = metric(stack.prefill, "vllm:prefix_cache_hits_total")
    r = c.completions.create(model=SERVED_MODEL, prompt=prompt, n=3, max_tokens=8, temperature=0.9, seed=11,
                             extra_body={"ignore_eos": True})
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert r.usage.prompt_tokens == n_prompt, "the prompt counts once"
    assert r.usage.completion_tokens == 24
    assert metric(stack.prefill, "rngd_pd_worker_prefills_total") == prefills + 3, "each choice was prefilled remotely"
    # The first choice computed the prompt; the other two found its blocks
    # (all but the tail the engine always recomputes).
    assert metric(stack.prefill, "vllm:prefix_cache_hits_total") - hits >= 2 * (n_prompt - 32)
    texts = [ch.text for ch in r.choices]
    assert len(set(texts)) > 1, f"three sampled choices came out equal: {texts}"
    for j, text in enumerate(texts):
        one = c.completions.create(model=SERVED_MODEL, prompt=prompt, max_tokens=8, temperature=0.9, seed=11 + j,
                                   extra_body={"ignore_eos": True})
        assert one.choices[0].text == text, f"choice {j} differs from n = 1 with seed {11 + j}"
        ref = client(solo).completions.create(model=SERVED_MODEL, prompt=prompt, max_tokens=8, temperature=0.9,
                                              seed=11 + j, extra_body={"ignore_eos": True})
        assert ref.choices[0].text == text, f"choice {j} differs from the solo worker"


@pytest.mark.parametrize("stack", ["shm"], indirect=True)
def test_a_streamed_chat_with_n_choices_through_the_gateway(stack):
    msgs = [{"role": "user", "content": fresh("Name a colour and a fruit.")}]
    body = {"model": SERVED_MODEL, "messages": msgs, "n": 2, "max_tokens": 6, "temperature": 0.9, "seed": 3,
            "stream": True, "stream_options": {"include_usage": True}}
    events = []
    with requests.post(stack.gateway + "/v1/chat/completions", json=body, stream=True, timeout=600) as r:
        assert r.status_code == 200, r.text
        for line in r.iter_lines():
            if line.startswith(b"data: "):
                events.append(line[6:].decode())
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1, events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert len({ch["id"] for ch in chunks}) == 1, "one id across the choices"
    usage = [ch for ch in chunks if ch.get("usage") and not ch["choices"]]
    assert len(usage) == 1 and chunks[-1] is usage[0], "one usage chunk, last"
    text = {0: "", 1: ""}
    for ch in chunks:
        for choice in ch["choices"]:
            text[choice["index"]] += choice["delta"].get("content") or ""
    whole = client(stack.gateway).chat.completions.create(
        model=SERVED_MODEL, messages=msgs, n=2, max_tokens=6, temperature=0.9, seed=3)
    assert [ch.message.content for ch in whole.choices] == [text[0], text[1]], "streamed equals whole"
    assert usage[0]["usage"]["prompt_tokens"] == whole.usage.prompt_tokens
    assert usage[0]["usage"]["completion_tokens"] == whole.usage.completion_tokens
    assert 2 <= whole.usage.completion_tokens <= 12


def test_prompt_lists_on_a_solo_worker(solo):
    c = client(solo)
    prompts = [fresh(OTHER), "Water boils at"]
    r = c.completions.create(model=SERVED_MODEL, prompt=prompts, n=2, max_tokens=5, temperature=0,
                             extra_body={"ignore_eos": True})
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    singles = [c.completions.create(model=SERVED_MODEL, prompt=p, max_tokens=5, temperature=0,
                                    extra_body={"ignore_eos": True}) for p in prompts]
    want = [singles[0].choices[0].text] * 2 + [singles[1].choices[0].text] * 2
    assert [ch.text for ch in r.choices] == want
    assert r.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles), "each prompt once"
    assert r.usage.completion_tokens == 20
    # Token-id prompts too.
    ids = [requests.post(solo + "/tokenize", json={"model": SERVED_MODEL, "prompt": p}, timeout=60).json()["tokens"]
           for p in prompts]
    t = c.completions.create(model=SERVED_MODEL, prompt=ids, max_tokens=5, temperature=0,
                             extra_body={"ignore_eos": True})
    assert [ch.text for ch in t.choices] == [s.choices[0].text for s in singles]


@pytest.mark.parametrize("stack", ["shm"], indirect=True)
def test_bad_fan_outs_are_400s_naming_the_field_before_any_work(stack, solo):
    long = "word " * 5000
    cases = [
        ({"prompt": "Hi", "n": 17}, "n"),
        ({"prompt": "Hi", "n": 0}, "n"),
        ({"prompt": "Hi", "n": 2, "best_of": 1}, "best_of"),
        ({"prompt": ["Hi"] * 9, "n": 2}, "prompt"),
        ({"prompt": ["Hi", long], "max_tokens": 4}, "max_tokens"),
    ]
    prefills = metric(stack.prefill, "rngd_pd_worker_prefills_total")
    for url in (stack.gateway, solo):
        for body, param in cases:
            r = requests.post(url + "/v1/completions", json={"model": SERVED_MODEL, **body}, timeout=60)
            assert r.status_code == 400, (url, body, r.text)
            assert r.json()["error"]["param"] == param, (url, body, r.text)
    # The gateway checks every part before routing any.
    assert metric(stack.prefill, "rngd_pd_worker_prefills_total") == prefills, "a part was prefilled"
