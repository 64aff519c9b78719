"""The real `openai` client against `rngd-pd up` (prefill worker + decode worker +
KV relay + gateway, CPU backend, real model), over each KV transport (shm, tcp, nixl-ucx).

Greedy outputs through the PD stack must equal a solo worker's for the same
prompt, token for token.
"""

import json
import os
import subprocess
import time

import openai
import pytest
import requests

from conftest import SERVED_MODEL, greedy_completion, start_worker

# Long enough (> the default policy's 32-token threshold) to be disaggregated.
PROMPT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based inks and a wooden press adapted from wine making. "
    "Within a few decades, printing shops had spread across Europe, and the cost of books fell"
)
SYSTEM = "You are a concise assistant."
QUESTION = "Name three primary colors and explain in one sentence why they are called primary."


def client(stack):
    return openai.OpenAI(base_url=stack.gateway + "/v1", api_key="unused", max_retries=0, timeout=300)


def solo_completion(solo, prompt, max_tokens):
    return greedy_completion(solo, prompt, max_tokens)["choices"][0]


def counter(url, name):
    """Sum of a counter over its label sets in a Prometheus text page."""
    total = 0.0
    for line in requests.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def chatml(messages):
    out = "".join(f"<|im_start|>{r}\n{c}<|im_end|>\n" for r, c in messages)
    return out + "<|im_start|>assistant\n"


def test_models_lists_the_served_model(stack):
    """The served name first, then the file's stem (the alias every door
    accepts without --served-model-name), with vLLM's fields; any other
    model is a 404 naming them, as the openai client sees it."""
    models = client(stack).models.list()
    assert [m.id for m in models.data] == [stack.model, "SmolLM2-135M-Instruct.Q4_1"]
    for m in models.data:
        assert m.model_extra["root"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
        assert m.model_extra["parent"] is None
        assert m.model_extra["max_model_len"] == 512
        assert m.model_extra["permission"][0]["object"] == "model_permission"
    with pytest.raises(openai.NotFoundError) as err:
        client(stack).completions.create(model="gpt-4o", prompt="hi", max_tokens=2)
    assert err.value.code == "model_not_found"
    assert stack.model in err.value.message
    alias = client(stack).completions.create(model="SmolLM2-135M-Instruct.Q4_1", prompt="hi", max_tokens=2)
    assert alias.model == stack.model and len(alias.choices) == 1


def test_completion_equals_solo_and_runs_pd(stack, solo):
    prefills = counter(stack.prefill, "rngd_pd_worker_prefills_total")
    loads = counter(stack.decode, "rngd_pd_worker_kv_loads_total")
    r = client(stack).completions.create(model=stack.model, prompt=PROMPT, max_tokens=24, temperature=0)
    choice = r.choices[0]
    assert choice.text.strip(), "empty completion"
    ref = solo_completion(solo, PROMPT, 24)
    assert choice.model_extra["token_ids"] == ref["token_ids"]
    assert choice.text == ref["text"]
    assert r.usage.completion_tokens == 24
    assert r.model == stack.model
    # It really went prefill → KV transfer → decode.
    assert counter(stack.prefill, "rngd_pd_worker_prefills_total") == prefills + 1
    assert counter(stack.decode, "rngd_pd_worker_kv_loads_total") == loads + 1
    timings = r.model_extra["timings"]
    assert timings["ttft_ms"] > 0 and timings["kv_transfer_ms"] >= 0


def test_streaming_completion_equals_solo(stack, solo):
    stream = client(stack).completions.create(
        model=stack.model, prompt=PROMPT, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    texts, ids, usage = [], set(), None
    for chunk in stream:
        ids.add(chunk.id)
        if chunk.choices:
            texts.append(chunk.choices[0].text)
        if chunk.usage:
            usage = chunk.usage
    assert len(ids) == 1, f"chunk ids differ: {ids}"
    assert "".join(texts) == solo_completion(solo, PROMPT, 24)["text"]
    assert usage is not None and usage.completion_tokens == 24


def test_chat_equals_solo_on_the_rendered_template(stack, solo):
    messages = [("system", SYSTEM), ("user", QUESTION)]
    r = client(stack).chat.completions.create(
        model=stack.model,
        messages=[{"role": role, "content": content} for role, content in messages],
        max_tokens=32,
        temperature=0,
    )
    assert r.object == "chat.completion"
    content = r.choices[0].message.content
    assert r.choices[0].message.role == "assistant"
    assert content.strip(), "empty chat answer"
    assert content == solo_completion(solo, chatml(messages), 32)["text"]

    stream = client(stack).chat.completions.create(
        model=stack.model,
        messages=[{"role": role, "content": content} for role, content in messages],
        max_tokens=32,
        temperature=0,
        stream=True,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == content


def test_errors_are_openai_errors(stack):
    c = client(stack)
    with pytest.raises(openai.NotFoundError) as e:
        c.completions.create(model="no-such-model", prompt="hi", max_tokens=4)
    assert "no-such-model" in str(e.value)

    # Over the compiled context length: the default policy's 400, naming the numbers.
    long_prompt = " ".join(["word"] * 505)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=stack.model, prompt=long_prompt, max_tokens=64)
    msg = str(e.value)
    assert "512" in msg and "64" in msg, msg

    r = requests.post(stack.gateway + "/v1/completions", data="{broken", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"]


def shm_files(root):
    # A prefill worker's slot arena (*.kva) lives as long as the worker; a
    # request left in it keeps its pointer file (*.kv), which is counted.
    found = []
    for d, _, files in os.walk(root):
        found += [os.path.join(d, f) for f in files if not f.endswith(".kva")]
    return found


def test_client_disconnect_mid_stream_leaves_no_kv(stack):
    running_before = counter(stack.decode, "vllm:num_requests_running")
    body = {"model": stack.model, "prompt": PROMPT, "max_tokens": 400, "temperature": 0, "stream": True}
    with requests.post(stack.gateway + "/v1/completions", json=body, stream=True, timeout=300) as r:
        assert r.status_code == 200
        seen = 0
        for line in r.iter_lines():
            if line.startswith(b"data: "):
                seen += 1
            if seen >= 2:
                break
    # The connection is closed: the decode must stop and nothing may stay in the transport.
    deadline = time.monotonic() + 30
    while True:
        left = shm_files(stack.shm_root) if stack.transport == "shm" else []
        running = counter(stack.decode, "vllm:num_requests_running")
        if not left and running <= running_before:
            break
        assert time.monotonic() < deadline, f"after disconnect: files {left}, running {running}"
        time.sleep(0.1)


def promtool(text):
    return subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)


def test_metrics_pass_promtool_and_kpis_are_exported(stack):
    # At least one PD request so every histogram has data.
    client(stack).completions.create(model=stack.model, prompt=PROMPT, max_tokens=4, temperature=0)
    main = requests.get(stack.gateway + "/metrics", timeout=5).text
    for name in ["rngd_pd_gateway_ttft_seconds", "rngd_pd_gateway_tpot_seconds",
                 "rngd_pd_gateway_policy_decision_seconds", "rngd_pd_gateway_requests_total"]:
        assert name in main, name
    assert f'rngd_pd_gateway_kv_transfer_seconds_count{{kv_transport="{stack.transport}"}}' in main
    p = promtool(main)
    assert p.returncode == 0, p.stdout + p.stderr

    kpis = requests.get(stack.kpis, timeout=5).text
    for name in ["airm_ttft_p90_ms", "airm_tpot_p90_ms", "airm_tok_s"]:
        assert f"\n{name} " in "\n" + kpis, name
    assert f'airm_kv_transfer_ms{{kv_transport="{stack.transport}"}}' in kpis
    # The KPI names are fixed by the seed (`_ms`): promtool parses them and its
    # only complaint is the unit abbreviation lint.
    p = promtool(kpis)
    problems = [l for l in (p.stdout + p.stderr).splitlines() if l.strip()]
    assert p.returncode in (0, 3), p.stdout + p.stderr
    assert all("abbreviated units" in l for l in problems), problems


def test_stream_options_are_checked_and_continuous_usage_is_served(stack):
    """`stream_options` is validated field by field (an unknown key is a 400
    naming it, never ignored), and `continuous_usage_stats` puts the usage
    so far on every chunk, through the gateway's PD path."""
    c = client(stack)
    with pytest.raises(openai.BadRequestError) as err:
        c.completions.create(model=stack.model, prompt=PROMPT, max_tokens=2, stream=True,
                             stream_options={"include_usage": True, "bogus": 1})
    assert err.value.code == "unknown_parameter" and err.value.param == "stream_options.bogus"
    chunks = list(c.completions.create(
        model=stack.model, prompt=PROMPT, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    done = [ch.usage.completion_tokens for ch in chunks]
    assert all(ch.usage.prompt_tokens == chunks[-1].usage.prompt_tokens for ch in chunks)
    assert done == sorted(done) and done[-1] == 6 and len([d for d in done if d < 6]) >= 5, done


def test_an_api_key_is_required_as_the_openai_client_sends_it():
    """A worker started with VLLM_API_KEY (vLLM's variable) refuses the openai
    client without the key (AuthenticationError) and serves it with; the
    probes stay open."""
    proc, addr = start_worker("solo", env={"VLLM_API_KEY": "py-key-123"})
    try:
        base = f"http://{addr}/v1"
        bare = openai.OpenAI(base_url=base, api_key="wrong", max_retries=0, timeout=60)
        with pytest.raises(openai.AuthenticationError) as err:
            bare.completions.create(model=SERVED_MODEL, prompt="hi", max_tokens=2)
        assert err.value.code == "invalid_api_key"
        keyed = openai.OpenAI(base_url=base, api_key="py-key-123", max_retries=0, timeout=60)
        r = keyed.completions.create(model=SERVED_MODEL, prompt="hi", max_tokens=2, temperature=0)
        assert r.usage.completion_tokens == 2
        assert [m.id for m in keyed.models.list().data][0] == SERVED_MODEL
        for path in ("/health", "/ready", "/metrics", "/version", "/ping"):
            assert requests.get(f"http://{addr}{path}", timeout=10).status_code == 200, path
    finally:
        proc.stop()
