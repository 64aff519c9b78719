"""The model-server metrics a dashboard, an HPA or `inference-perf`'s
Prometheus report reads (issue 29, item 3), checked with `promtool` on real
workers:

- every `vllm:*` family and the `process_*` families are on the page from
  the model's load on, before any request, on every role (a prefill worker
  too), each with vLLM's `model_name` label;
- after requests, the request families hold what happened: one sample per
  request in the phase histograms, a gap per token pair, the token counts,
  and `finished_reason="abort"` for a stream its client dropped;
- the KPI inputs (issue 27): `rngd_pd_worker_device_info` names the worker's
  role, backend and the host CPU's vendor as `/proc/cpuinfo` gives it, and
  `rngd_pd_worker_model_flops_per_token` is 2 × the weights of the model's
  projections and output head, counted here from the GGUF with the `gguf`
  package.
"""

import subprocess
import time

import openai
import requests

from conftest import SERVED_MODEL, model_path, start_worker

# The families and their Prometheus types, as vLLM exports them.
VLLM = {
    "vllm:num_requests_waiting": "gauge",
    "vllm:num_requests_running": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:time_per_output_token_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:prompt_tokens_total": "counter",
    "vllm:generation_tokens_total": "counter",
    "vllm:request_success_total": "counter",
    "vllm:num_preemptions_total": "counter",
    "vllm:iteration_tokens_total": "histogram",
    "vllm:request_params_max_tokens": "histogram",
    "vllm:request_params_n": "histogram",
    "vllm:request_max_num_generation_tokens": "histogram",
    "vllm:request_prefill_kv_computed_tokens": "histogram",
    "vllm:prompt_tokens_cached_total": "counter",
    "vllm:external_prefix_cache_queries_total": "counter",
    "vllm:external_prefix_cache_hits_total": "counter",
}
PROCESS = ["process_cpu_seconds_total", "process_resident_memory_bytes", "process_virtual_memory_bytes",
           "process_open_fds", "process_max_fds", "process_threads", "process_start_time_seconds"]
MODEL = f'model_name="{SERVED_MODEL}"'


def page(addr):
    return requests.get(f"http://{addr}/metrics", timeout=10).text


def vllms_own_name(line):
    """A promtool lint about a name vLLM itself exports (dashboards and
    pickers read them as they are): the `:` in every vLLM name, and the
    `_total` of the histogram `vllm:iteration_tokens_total`."""
    return line.startswith("vllm:") and "should not contain ':'" in line or line.startswith(
        "vllm:iteration_tokens_total non-counter metrics should not have \"_total\" suffix")


def promtool_clean(text):
    """promtool parses the page; its only complaints may be about vLLM's own names."""
    p = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
    problems = [l for l in (p.stdout + p.stderr).splitlines() if l.strip() and not vllms_own_name(l)]
    assert problems == [], p.stdout + p.stderr


def value(text, series):
    """The value of the sample line starting with `series` (name and labels)."""
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{series} not on the page")


def assert_every_family(text):
    promtool_clean(text)
    for name, kind in VLLM.items():
        assert f"# TYPE {name} {kind}" in text, name
        sample = f"{name}_count{{" if kind == "histogram" else f"{name}{{"
        lines = [l for l in text.splitlines() if l.startswith(sample)]
        assert lines and all(MODEL in l for l in lines), (name, lines)
    for reason in ("stop", "length", "abort"):
        value(text, f'vllm:request_success_total{{finished_reason="{reason}",{MODEL}}}')
    for name in PROCESS:
        assert value(text, name) >= 0, name
    assert value(text, "process_resident_memory_bytes") > 10e6


def cpu_vendor():
    """The host CPU's vendor, read from /proc/cpuinfo here."""
    with open("/proc/cpuinfo") as f:
        ids = [l.split(":", 1)[1].strip() for l in f if l.split(":", 1)[0].strip() == "vendor_id"]
    return {"GenuineIntel": "intel", "AuthenticAMD": "amd"}.get(ids[0], ids[0].lower()) if ids else "unknown"


def matmul_weights(path):
    """Weights a token is multiplied by: every layer's projections and the
    output head (the token embedding when the file ties it), from the GGUF."""
    from gguf import GGUFReader

    sizes = {t.name: int(t.n_elements) for t in GGUFReader(path).tensors}
    kinds = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    layers = sum(n for name, n in sizes.items() if name.startswith("blk.") and name.split(".")[2] in kinds)
    return layers + sizes.get("output.weight", sizes["token_embd.weight"])


def test_every_role_exports_every_family_from_the_start():
    flops = 2 * matmul_weights(model_path())
    # SmolLM2-135M: ~134.5 M such weights (tied head included).
    assert 2.5e8 < flops < 2.8e8, flops
    for role in ("prefill", "decode", "solo"):
        p, addr = start_worker(role)
        try:
            text = page(addr)
            assert_every_family(text)
            device = f'backend="cpu",device="cpu",role="{role}",vendor="{cpu_vendor()}"'
            assert value(text, f"rngd_pd_worker_device_info{{{device}}}") == 1, role
            assert value(text, f"rngd_pd_worker_model_flops_per_token{{{MODEL}}}") == flops, role
            # Nothing served yet: every request family is at zero.
            assert value(text, f"vllm:request_prompt_tokens_count{{{MODEL}}}") == 0, role
            assert value(text, f'vllm:request_success_total{{finished_reason="length",{MODEL}}}') == 0
            assert value(text, f"vllm:num_preemptions_total{{{MODEL}}}") == 0
        finally:
            p.stop()


def test_request_families_count_what_was_served_and_aborted():
    p, addr = start_worker("solo")
    try:
        c = openai.OpenAI(base_url=f"http://{addr}/v1", api_key="unused", max_retries=0, timeout=120)
        chunks = list(c.completions.create(model=SERVED_MODEL, prompt="The sky is", max_tokens=8, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True}))
        assert chunks[-1].choices[0].finish_reason == "length"
        prompt_tokens = c.completions.create(model=SERVED_MODEL, prompt="The sky is", max_tokens=1).usage.prompt_tokens
        text = page(addr)
        assert_every_family(text)
        assert value(text, f'vllm:request_success_total{{finished_reason="length",{MODEL}}}') == 2
        for name in ("queue_time", "prefill_time", "decode_time", "inference_time"):
            assert value(text, f"vllm:request_{name}_seconds_count{{{MODEL}}}") == 2, name
        assert value(text, f"vllm:request_prefill_time_seconds_sum{{{MODEL}}}") > 0
        # 8 tokens: 7 gaps; 1 token: none.
        assert value(text, f"vllm:inter_token_latency_seconds_count{{{MODEL}}}") == 7
        assert value(text, f"vllm:time_per_output_token_seconds_count{{{MODEL}}}") == 7
        assert value(text, f"vllm:request_time_per_output_token_seconds_count{{{MODEL}}}") == 1
        assert value(text, f"vllm:request_generation_tokens_sum{{{MODEL}}}") == 9
        assert value(text, f"vllm:request_prompt_tokens_sum{{{MODEL}}}") == 2 * prompt_tokens
        assert value(text, f"vllm:generation_tokens_total{{{MODEL}}}") == 9
        # The engine's iterations: two prefills of the whole prompt (too short
        # for a cached block), then 7 decode steps of one stream.
        assert value(text, f"vllm:iteration_tokens_total_sum{{{MODEL}}}") == 2 * prompt_tokens + 7
        assert value(text, f"vllm:iteration_tokens_total_count{{{MODEL}}}") == 2 + 7
        # The request parameters (max_tokens 8 and 1, n 1 each), and nothing
        # cached or loaded: every prompt token computed here.
        assert value(text, f"vllm:request_params_max_tokens_sum{{{MODEL}}}") == 9
        assert value(text, f"vllm:request_max_num_generation_tokens_sum{{{MODEL}}}") == 9
        assert value(text, f"vllm:request_params_n_sum{{{MODEL}}}") == 2
        assert value(text, f"vllm:request_prefill_kv_computed_tokens_sum{{{MODEL}}}") == 2 * prompt_tokens
        assert value(text, f"vllm:prompt_tokens_cached_total{{{MODEL}}}") == 0
        assert value(text, f"vllm:external_prefix_cache_hits_total{{{MODEL}}}") == 0

        # A stream its client drops after the first chunk is counted as aborted.
        s = c.completions.create(model=SERVED_MODEL, prompt="Count to a thousand:", max_tokens=400,
                                 temperature=0, stream=True, extra_body={"ignore_eos": True})
        next(iter(s))
        s.close()
        deadline = time.monotonic() + 30
        series = f'vllm:request_success_total{{finished_reason="abort",{MODEL}}}'
        while value(page(addr), series) < 1:
            assert time.monotonic() < deadline, "the dropped stream was not counted as abort"
            time.sleep(0.05)
        assert value(page(addr), series) == 1
    finally:
        p.stop()


def test_the_relay_serves_its_figures_on_a_metrics_listener():
    """`rngd-pd relay --metrics-listen` puts the STATS figures on Prometheus:
    gauges of what it holds, counters of what it refused (a socket that
    fails the handshake is counted by reason), and the process families."""
    import os
    import signal
    import socket

    from conftest import Proc, rngd_bin

    p = Proc("relay", [rngd_bin(), "relay", "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0",
                       "--handshake-timeout-ms", "300"],
             env=dict(os.environ, AIRM_KV_TCP_SECRET="0123456789abcdef0123456789abcdef"))
    try:
        metrics = p.wait_line("relay metrics listening on", 60)
        relay = p.wait_line("relay listening on", 5)
        text = page(metrics)
        promtool_clean(text)
        for name in ("rngd_pd_relay_bytes", "rngd_pd_relay_blobs", "rngd_pd_relay_connections",
                     "rngd_pd_relay_expired_total", "rngd_pd_relay_handshakes",
                     "rngd_pd_relay_stranded_bytes"):
            assert value(text, name) == 0, name
        assert value(text, "rngd_pd_relay_max_bytes") == 4 << 30
        assert value(text, "process_resident_memory_bytes") > 1e6
        # A client that never completes the handshake: refused or timed out.
        host, port = relay.rsplit(":", 1)
        with socket.create_connection((host, int(port))) as s:
            s.sendall(b"not the handshake" * 8)
            s.settimeout(5)
            try:
                while s.recv(4096):
                    pass
            except OSError:
                pass
        deadline = time.monotonic() + 10
        while True:
            failures = [l for l in page(metrics).splitlines()
                        if l.startswith("rngd_pd_relay_handshake_failures_total{")]
            if sum(float(l.rsplit(" ", 1)[1]) for l in failures) >= 1:
                break
            assert time.monotonic() < deadline, failures
            time.sleep(0.05)
        assert all('reason="' in l for l in failures), failures
        assert p.stop(signal.SIGINT) == 0
    finally:
        p.stop(signal.SIGKILL)


def test_the_relay_check_names_a_bad_metrics_address():
    from conftest import rngd_bin

    env = {"PATH": "/usr/bin:/bin", "RUST_BACKTRACE": "0"}
    bad = subprocess.run([rngd_bin(), "relay", "--check", "--insecure-no-auth", "--metrics-listen", "nowhere"],
                         capture_output=True, text=True, timeout=60, env=env)
    assert bad.returncode != 0 and "--metrics-listen nowhere" in bad.stderr, bad.stderr
    good = subprocess.run([rngd_bin(), "relay", "--check", "--insecure-no-auth", "--metrics-listen", "127.0.0.1:0"],
                          capture_output=True, text=True, timeout=60, env=env)
    assert good.returncode == 0 and good.stdout.strip() == "ok", good.stderr
