"""Routing on cached prefixes through `rngd-pd up` with one prefill and two
decode workers (its gateway indexes every worker's KV events, `--kv-events`),
seen with the real `openai` client: a three-turn conversation stays on the
decode worker that holds it, turns 2 and 3 skip the remote prefill (the
`x-rngd-pd-route-reason: cached` response header), `cached_tokens` grows, and
the workers' hit counters account for it.

The policy configuration weighs the cache more than the defaults
(`prefix_weight` 10, `disaggregation_threshold_tokens` 48), as
`test_envoy_cache_routing.py` does, so the assertions do not depend on the
load figures the gateway scraped a few milliseconds earlier.
"""

import json
import os

import openai
import pytest
import requests

from conftest import converse, counter, start_stack


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """`rngd-pd up` as a user runs it: the workers publish KV events and the
    gateway indexes them."""
    cfg = tmp_path_factory.mktemp("cache-routing") / "policy.json"
    cfg.write_text(json.dumps({"disaggregation_threshold_tokens": 48, "prefix_weight": 10,
                               "same_node_transport": "shm"}))
    s = start_stack("shm", "--decode-workers", "2", "--policy-config", str(cfg))
    s.decode_1 = s.proc.wait_line("rngd-pd up: decode-1", 5)
    yield s
    assert s.proc.stop() == 0
    assert not os.path.exists(s.shm_root)


def client(stack):
    return openai.OpenAI(base_url=stack.gateway + "/v1", api_key="unused", max_retries=0, timeout=300)


SYSTEM = ("You are the archivist of a small harbour town. You answer questions about its lighthouse, "
          "its fishing fleet and the storms of the last century in two or three plain sentences.")


def served(stack):
    return [counter(w.removeprefix("http://"), "vllm:request_success_total") for w in (stack.decode, stack.decode_1)]


def test_a_conversation_stays_on_the_worker_that_holds_it(stack):
    messages = [{"role": "system", "content": SYSTEM + f" (transport {stack.transport})"},
                {"role": "user", "content": "When was the lighthouse built?"}]
    where, reasons, cached, prompt_tokens = converse(client(stack), stack.model, messages, ["Why?", "And then?"],
                                                     lambda: served(stack))
    # One decode worker served every turn; the first (cold, long) was
    # disaggregated, the later ones found the conversation cached there and
    # prefilled only the new tokens, in whole blocks of 16.
    assert all(len(w) == 1 for w in where) and where[0] == where[1] == where[2], where
    assert reasons == ["disaggregated", "cached", "cached"], reasons
    assert cached[0] == 0, cached
    assert 0 < cached[1] < cached[2] < prompt_tokens[2], (cached, prompt_tokens)
    assert all(n % 16 == 0 for n in cached), cached
    # The workers' caches were hit in total as reported.
    hits = sum(counter(w.removeprefix("http://"), "vllm:prefix_cache_hits_total")
               for w in (stack.prefill, stack.decode, stack.decode_1))
    assert hits >= sum(cached)
    # The gateway counts its decisions by reason.
    text = requests.get(stack.gateway + "/metrics", timeout=10).text
    assert 'rngd_pd_route_decisions_total{reason="cached"} 2' in text, text
