"""Sampling parameters and log-probabilities through the real `openai` client,
against the gateway on the PD path (`rngd-pd up`: prefill worker → KV → decode
worker) and against a solo worker, on the real model.

The PD answer must equal the solo answer token for token and logprob for
logprob, exactly: both compute the same logits (the prefill's first token and
its log-probabilities travel signed in `kv_transfer_params`, the decode
continues the same seed and applies the penalties over the same prompt ids).
"""

import math

import openai
import pytest
import requests

from conftest import start_stack

# Long enough (> the default policy's 32-token threshold) to be disaggregated.
PROMPT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based inks and a wooden press adapted from wine making. "
    "Within a few decades, printing shops had spread across Europe, and the cost of books fell"
)
QUESTION = (
    "Explain in two sentences why the printing press changed how knowledge spread in Europe, "
    "mentioning books, cost and literacy, and say which century it happened in."
)
# SmolLM2's `<|im_end|>` (its EOS).
EOS = 2
# The served model's name (the gateway refuses others with 404), set by `pd`.
MODEL = []


@pytest.fixture(scope="module")
def pd():
    """`rngd-pd up` on the shm transport (the gateway drives PD)."""
    # Without KV events: each request here is to run PD (counted), which
    # routing on cached prefixes would skip for a repeated prompt.
    s = start_stack("shm", "--no-kv-events")
    MODEL[:] = [s.model]
    yield s
    assert s.proc.stop() == 0


def gw(pd):
    return openai.OpenAI(base_url=pd.gateway + "/v1", api_key="unused", max_retries=0, timeout=300)


def solo_client(solo):
    return openai.OpenAI(base_url=solo + "/v1", api_key="unused", max_retries=0, timeout=300)


def prefills(pd):
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in requests.get(pd.prefill + "/metrics", timeout=10).text.splitlines()
        if line.startswith("rngd_pd_worker_prefills_total")
    )


def both(pd, solo, call):
    """`call(client)` through the gateway (checked to run PD) and on the solo worker."""
    before = prefills(pd)
    a = call(gw(pd))
    assert prefills(pd) == before + 1, "the gateway request was not prefilled remotely"
    b = call(solo_client(solo))
    return a, b


def complete(c, **kw):
    return c.completions.create(model=MODEL[0], prompt=PROMPT, **kw)


def lp_of(choice):
    lp = choice.logprobs
    return (lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset)


def test_completion_logprobs_pd_equals_solo(pd, solo):
    a, b = both(pd, solo, lambda c: complete(c, max_tokens=12, temperature=1.0, seed=11, logprobs=5))
    ca, cb = a.choices[0], b.choices[0]
    assert ca.model_extra["token_ids"] == cb.model_extra["token_ids"]
    assert ca.text == cb.text
    assert lp_of(ca) == lp_of(cb), "PD and solo logprobs differ"
    tokens, token_lps, tops, offsets = lp_of(ca)
    assert len(tokens) == len(token_lps) == len(tops) == len(offsets) == 12
    assert "".join(tokens) == ca.text
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    for tok, lp, top in zip(tokens, token_lps, tops):
        assert lp <= 0.0
        # The chosen token plus the top 5 (a repeated text listed once).
        assert tok in top and top[tok] == lp and 1 <= len(top) <= 6
        # A distribution: the listed probabilities sum to at most 1.
        assert sum(math.exp(v) for v in top.values()) <= 1.0 + 1e-5


def test_greedy_logprobs_pick_the_most_likely_token(pd, solo):
    a, b = both(pd, solo, lambda c: complete(c, max_tokens=8, temperature=0, logprobs=3))
    assert lp_of(a.choices[0]) == lp_of(b.choices[0])
    _, token_lps, tops, _ = lp_of(a.choices[0])
    for lp, top in zip(token_lps, tops):
        assert lp == max(top.values())


def stream_parts(stream):
    text, ids, lps, finish = "", [], [], None
    for chunk in stream:
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        text += ch.text
        ids += ch.model_extra.get("token_ids") or []
        if ch.logprobs is not None:
            lps.append(lp_of(ch))
        finish = ch.finish_reason or finish
    return text, ids, lps, finish


def test_streamed_completion_logprobs_equal_the_whole_answer(pd, solo):
    kw = dict(max_tokens=10, temperature=0.8, seed=5, logprobs=2)
    whole = complete(solo_client(solo), **kw).choices[0]
    a, b = both(pd, solo, lambda c: stream_parts(complete(c, stream=True, **kw)))
    assert a == b
    text, ids, lps, finish = a
    assert (text, ids, finish) == (whole.text, whole.model_extra["token_ids"], whole.finish_reason)
    # Each chunk carries its own token's logprobs; together they are the whole answer's.
    assert len(lps) == 10
    tokens, token_lps, tops, offsets = lp_of(whole)
    assert [p[0][0] for p in lps] == tokens
    assert [p[1][0] for p in lps] == token_lps
    assert [p[2][0] for p in lps] == tops
    assert [p[3][0] for p in lps] == offsets


def chat(c, **kw):
    return c.chat.completions.create(model=MODEL[0], messages=[{"role": "user", "content": QUESTION}], **kw)


def content_of(lp):
    return [(t.token, t.logprob, t.bytes, [(x.token, x.logprob, x.bytes) for x in t.top_logprobs]) for t in lp.content]


def test_chat_logprobs_pd_equals_solo(pd, solo):
    kw = dict(max_tokens=10, temperature=0.7, seed=3, logprobs=True, top_logprobs=4)
    a, b = both(pd, solo, lambda c: chat(c, **kw))
    ca, cb = a.choices[0], b.choices[0]
    assert ca.message.content == cb.message.content
    assert content_of(ca.logprobs) == content_of(cb.logprobs)
    assert len(ca.logprobs.content) == 10
    for t in ca.logprobs.content:
        assert t.bytes == list(t.token.encode("utf-8"))
        assert len(t.top_logprobs) == 4
        assert [x.logprob for x in t.top_logprobs] == sorted((x.logprob for x in t.top_logprobs), reverse=True)
        assert t.logprob <= t.top_logprobs[0].logprob
    # Without top_logprobs: the chosen tokens only.
    plain = chat(gw(pd), max_tokens=4, temperature=0, logprobs=True).choices[0].logprobs.content
    assert len(plain) == 4 and all(t.top_logprobs == [] for t in plain)
    # Not asked: null.
    assert chat(gw(pd), max_tokens=2, temperature=0).choices[0].logprobs is None


def test_streamed_chat_logprobs_pd_equals_solo(pd, solo):
    kw = dict(max_tokens=8, temperature=0.7, seed=3, logprobs=True, top_logprobs=2, stream=True)

    def run(c):
        text, lps = "", []
        for chunk in chat(c, **kw):
            for ch in chunk.choices:
                text += ch.delta.content or ""
                if ch.logprobs is not None:
                    lps += content_of(ch.logprobs)
        return text, lps

    a, b = both(pd, solo, run)
    assert a == b
    whole = chat(solo_client(solo), **{**kw, "stream": False}).choices[0]
    assert a == (whole.message.content, content_of(whole.logprobs))


def test_a_seed_reproduces_on_pd_and_solo(pd, solo):
    kw = dict(max_tokens=16, temperature=1.0, seed=1234)
    a, b = both(pd, solo, lambda c: complete(c, **kw))
    again = complete(gw(pd), **kw)
    assert a.choices[0].text == b.choices[0].text == again.choices[0].text
    # A negative seed is an int64 like any other (two's complement), reproducible too.
    n1 = complete(gw(pd), max_tokens=16, temperature=1.0, seed=-7).choices[0].text
    n2 = complete(solo_client(solo), max_tokens=16, temperature=1.0, seed=-7).choices[0].text
    assert n1 == n2


def test_without_a_seed_each_request_draws_afresh(pd, solo):
    # With no seed, every request gets a fresh random seed (the prefill worker
    # chooses it). The bound: at temperature 1 with no other processor the
    # sampling distribution is the raw one, so the probability that another
    # independent request reproduces the first answer exactly is
    # P = exp(sum of its token logprobs). With 4 more requests, the chance
    # that all of them reproduce it is P**4; the test asserts that this bound
    # is below 1e-6 before relying on "at least one differs".
    for c in (gw(pd), solo_client(solo)):
        first = complete(c, max_tokens=16, temperature=1.0, logprobs=0).choices[0]
        p_same = math.exp(sum(first.logprobs.token_logprobs))
        assert p_same**4 < 1e-6, f"the prompt is too predictable for this test (P = {p_same})"
        others = [complete(c, max_tokens=16, temperature=1.0).choices[0].text for _ in range(4)]
        assert any(t != first.text for t in others), "five unseeded requests gave the same text"


def test_penalties_pd_equal_solo_and_change_the_text(pd, solo):
    kw = dict(max_tokens=24, temperature=0)
    pen = dict(
        frequency_penalty=1.5,
        presence_penalty=1.0,
        extra_body={"repetition_penalty": 1.3, "top_k": -1, "min_p": 0.05},
    )
    a, b = both(pd, solo, lambda c: complete(c, **kw, **pen))
    assert a.choices[0].model_extra["token_ids"] == b.choices[0].model_extra["token_ids"]
    plain = complete(solo_client(solo), **kw).choices[0]
    assert a.choices[0].model_extra["token_ids"] != plain.model_extra["token_ids"]
    # The frequency penalty discourages repeats: fewer repeated tokens than without.
    ids = a.choices[0].model_extra["token_ids"]
    plain_ids = plain.model_extra["token_ids"]
    assert len(ids) - len(set(ids)) <= len(plain_ids) - len(set(plain_ids))


def test_logit_bias_ignore_eos_and_min_tokens(pd, solo):
    # EOS made certain: the generation stops at once ...
    forced = {str(EOS): 100}
    a, b = both(pd, solo, lambda c: complete(c, max_tokens=6, temperature=0, logit_bias=forced))
    for r in (a, b):
        assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("stop", 0)
    # ... unless ignore_eos: it runs to max_tokens, EOS emitted each time.
    a, b = both(
        pd, solo, lambda c: complete(c, max_tokens=6, temperature=0, logit_bias=forced, extra_body={"ignore_eos": True})
    )
    for r in (a, b):
        assert r.choices[0].finish_reason == "length"
        assert r.choices[0].model_extra["token_ids"] == [EOS] * 6
    # min_tokens masks EOS for the first 4 tokens, then it stops.
    a, b = both(
        pd, solo, lambda c: complete(c, max_tokens=10, temperature=0, logit_bias=forced, extra_body={"min_tokens": 4})
    )
    assert a.choices[0].model_extra["token_ids"] == b.choices[0].model_extra["token_ids"]
    assert (a.choices[0].finish_reason, a.usage.completion_tokens) == ("stop", 4)


def test_stop_token_ids_and_stop_reason(pd, solo):
    base = complete(solo_client(solo), max_tokens=12, temperature=0).choices[0].model_extra["token_ids"]
    stop_id = base[5]
    cut = base.index(stop_id)
    a, b = both(pd, solo, lambda c: complete(c, max_tokens=12, temperature=0, extra_body={"stop_token_ids": [stop_id]}))
    for r in (a, b):
        ch = r.choices[0]
        assert ch.model_extra["token_ids"] == base[:cut]
        assert (ch.finish_reason, ch.model_extra["stop_reason"]) == ("stop", stop_id)
    # A stop string names itself.
    text = complete(solo_client(solo), max_tokens=12, temperature=0).choices[0].text
    word = text.split()[2]
    r = complete(gw(pd), max_tokens=12, temperature=0, stop=[word]).choices[0]
    assert (r.finish_reason, r.model_extra["stop_reason"]) == ("stop", word)


def test_echo_prepends_the_prompt(pd, solo):
    a, b = both(pd, solo, lambda c: complete(c, max_tokens=6, temperature=0, echo=True))
    plain = complete(solo_client(solo), max_tokens=6, temperature=0).choices[0].text
    for r in (a, b):
        assert r.choices[0].text == PROMPT + plain
    text, _, _, _ = stream_parts(complete(gw(pd), max_tokens=6, temperature=0, echo=True, stream=True))
    assert text == PROMPT + plain


@pytest.mark.parametrize(
    "kw,param",
    [
        (dict(logprobs=21), "logprobs"),
        (dict(logprobs=1, echo=True), "echo"),
        (dict(logit_bias={"999999": 1}), "logit_bias"),
        (dict(logit_bias={"5": 101}), "logit_bias"),
        (dict(n=17), "n"),
        (dict(best_of=2), "best_of"),
        (dict(extra_body={"stop_token_ids": [10**9]}), "stop_token_ids"),
        (dict(extra_body={"top_k": -2}), "top_k"),
        (dict(extra_body={"prompt_logprobs": 1}), "prompt_logprobs"),
        (dict(extra_body={"temperatur": 1}), "temperatur"),
    ],
)
def test_refused_parameters_name_the_param(pd, solo, kw, param):
    for c in (gw(pd), solo_client(solo)):
        with pytest.raises(openai.BadRequestError) as e:
            complete(c, max_tokens=2, **kw)
        assert e.value.status_code == 400
        body = e.value.response.json()["error"]
        assert body["param"] == param, body


# --- vLLM's detokenizer and chat-template fields ----------------------------

SPECIALS = ("<|im_end|>", "<|im_start|>")


def chat_extra(c, messages, **extra):
    """A greedy chat; `extra` goes in the body as vLLM's extra fields."""
    stop = extra.pop("stop", None)
    return c.chat.completions.create(model=MODEL[0], messages=messages, temperature=0,
                                     max_tokens=extra.pop("max_tokens", 120), stop=stop,
                                     extra_body=extra)


def test_skip_special_tokens_false_writes_control_tokens(pd, solo):
    """`skip_special_tokens: false` writes `<|im_end|>` into the text, on PD
    as on solo; the default text is that text without the control tokens;
    stop sequences see them; `spaces_between_special_tokens` changes nothing
    with this byte-level tokenizer (as vLLM's fast detokenizer)."""
    msgs = [{"role": "user", "content": QUESTION}]
    a, b = both(pd, solo, lambda c: chat_extra(c, msgs, ignore_eos=True, skip_special_tokens=False))
    kept = b.choices[0].message.content
    assert a.choices[0].message.content == kept
    assert "<|im_end|>" in kept, kept
    s = solo_client(solo)
    skipped = chat_extra(s, msgs, ignore_eos=True).choices[0].message.content
    stripped = kept
    for t in SPECIALS:
        stripped = stripped.replace(t, "")
    assert skipped == stripped
    assert "<|im_end|>" not in skipped
    same = chat_extra(s, msgs, ignore_eos=True, skip_special_tokens=False, spaces_between_special_tokens=False)
    assert same.choices[0].message.content == kept
    cut = chat_extra(s, msgs, ignore_eos=True, skip_special_tokens=False, stop=["<|im_end|>"])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == kept.split("<|im_end|>")[0]
    # Streamed through the gateway: the same text.
    streamed = gw(pd).chat.completions.create(
        model=MODEL[0], messages=msgs, temperature=0, max_tokens=120, stream=True,
        extra_body={"ignore_eos": True, "skip_special_tokens": False})
    assert "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices) == kept


def tokenize(solo, **body):
    r = requests.post(solo + "/tokenize", json={"model": MODEL[0], **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_continue_final_message_continues_the_assistant(pd, solo):
    """`add_generation_prompt: false` ends the prompt after the last message
    (`<|im_end|>\\n`, no assistant header); with `continue_final_message` the
    prompt stops inside that message, and the answer is what a completion of
    exactly those ids gives, on PD and solo."""
    msgs = [{"role": "user", "content": QUESTION},
            {"role": "assistant", "content": "The printing press"}]
    default = tokenize(solo, messages=msgs)
    closed = tokenize(solo, messages=msgs, add_generation_prompt=False)
    opened = tokenize(solo, messages=msgs, add_generation_prompt=False, continue_final_message=True)
    assert closed[-2:] == [EOS, 198] and default[:len(closed)] == closed and len(default) > len(closed)
    assert opened == closed[:-2]
    extra = dict(add_generation_prompt=False, continue_final_message=True, max_tokens=12)
    a, b = both(pd, solo, lambda c: chat_extra(c, msgs, **extra))
    text = b.choices[0].message.content
    assert a.choices[0].message.content == text
    assert a.usage.prompt_tokens == b.usage.prompt_tokens == len(opened)
    same = solo_client(solo).completions.create(model=MODEL[0], prompt=opened, max_tokens=12, temperature=0)
    assert same.choices[0].text == text


def test_chat_template_kwargs_and_their_refusals(pd, solo):
    """A variable this model's template does not read changes nothing; one
    the server sets, or both template switches on, is a 400 naming the field."""
    msgs = [{"role": "user", "content": QUESTION}]
    plain = chat_extra(solo_client(solo), msgs, max_tokens=8).choices[0].message.content
    for c in (gw(pd), solo_client(solo)):
        assert chat_extra(c, msgs, max_tokens=8, chat_template_kwargs={"enable_thinking": False}) \
            .choices[0].message.content == plain
        for extra, param in [
            (dict(chat_template_kwargs={"messages": []}), "chat_template_kwargs"),
            (dict(chat_template_kwargs={"add_generation_prompt": False}), "chat_template_kwargs"),
            (dict(continue_final_message=True), "continue_final_message"),
            (dict(skip_special_tokens="no"), "skip_special_tokens"),
        ]:
            with pytest.raises(openai.BadRequestError) as e:
                chat_extra(c, msgs, max_tokens=2, **extra)
            body = e.value.response.json()["error"]
            assert body["param"] == param, body


def test_the_decode_worker_counts_the_loaded_kv_as_external_hits(pd, solo):
    """vLLM's KV-connector families on the PD path: the decode worker's
    prompt tokens all came over the transport (external hits = queries =
    prompt tokens, none computed there); the prefill worker computed them."""
    def metric(addr, name):
        return sum(float(l.rsplit(" ", 1)[1]) for l in requests.get(addr + "/metrics", timeout=10).text.splitlines()
                   if l.startswith(name + "{") or l.startswith(name + " "))

    names = ["vllm:external_prefix_cache_hits_total", "vllm:external_prefix_cache_queries_total",
             "vllm:prompt_tokens_cached_total", "vllm:request_prefill_kv_computed_tokens_sum"]
    before = {(w, n): metric(getattr(pd, w), n) for w in ("prefill", "decode") for n in names}
    a, _ = both(pd, solo, lambda c: complete(c, max_tokens=4, temperature=0))
    p = a.usage.prompt_tokens
    after = {k: metric(getattr(pd, k[0]), k[1]) for k in before}
    d = {k: after[k] - before[k] for k in before}
    assert d[("decode", "vllm:external_prefix_cache_hits_total")] == p
    assert d[("decode", "vllm:external_prefix_cache_queries_total")] == p
    assert d[("decode", "vllm:prompt_tokens_cached_total")] == p
    assert d[("decode", "vllm:request_prefill_kv_computed_tokens_sum")] == 0
    assert d[("prefill", "vllm:external_prefix_cache_hits_total")] == 0
    cached = d[("prefill", "vllm:prompt_tokens_cached_total")]
    assert d[("prefill", "vllm:request_prefill_kv_computed_tokens_sum")] == p - cached
