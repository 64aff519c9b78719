"""The picker's flags for a pool that is not vLLM, as the reference picker
spells them: `--total-queued-requests-metric`,
`--total-running-requests-metric`, `--kv-cache-usage-percentage-metric` name
the load gauges it scrapes (a model server exporting SGLang's names is read
and healthy with them, a failed scrape without them); a label selector is
refused at start; `--pool-namespace` defaults to `$NAMESPACE`."""

import json
import subprocess
import time

from conftest import counter, rngd_bin
from epp.helpers import ExtProc, ModelServerFake, endpoint_json, policy_module

SGLANG = ("sglang:num_queue_reqs", "sglang:num_running_reqs", "sglang:token_usage")
FLAGS = ["--total-queued-requests-metric", SGLANG[0], "--total-running-requests-metric", SGLANG[1],
         "--kv-cache-usage-percentage-metric", SGLANG[2]]


def ready_pods(epp):
    return counter(epp.metrics, "inference_pool_ready_pods")


def test_a_pool_with_other_metric_names_is_read_with_the_flags(tmp_path):
    fake = ModelServerFake(waiting=3, running=1, kv=0.5, names=SGLANG)
    (tmp_path / "endpoints.json").write_text(json.dumps([endpoint_json(fake.address)]))
    try:
        named = ExtProc(tmp_path / "endpoints.json", policy_module(), tls=False, extra=FLAGS)
        try:
            deadline = time.monotonic() + 30
            while ready_pods(named) != 1:
                assert time.monotonic() < deadline, "the SGLang-named endpoint never turned healthy"
                time.sleep(0.05)
            assert counter(named.metrics, "inference_pool_average_queue_size") == 3
            assert counter(named.metrics, "inference_pool_average_kv_cache_utilization") == 0.5
        finally:
            named.proc.stop()
        # Without the flags the same page is not a model server's: the
        # scrapes fail and the endpoint stays unhealthy.
        plain = ExtProc(tmp_path / "endpoints.json", policy_module(), tls=False)
        try:
            deadline = time.monotonic() + 30
            while counter(plain.metrics, "rngd_pd_epp_scrape_failures_total") < 3:
                assert time.monotonic() < deadline, "no failed scrape counted"
                time.sleep(0.05)
            assert ready_pods(plain) == 0
        finally:
            plain.proc.stop()
    finally:
        fake.close()


def check(tmp_path, *extra, env=None):
    (tmp_path / "endpoints.json").write_text("[]")
    return subprocess.run([rngd_bin(), "ext-proc", "--check", "--no-tokenizer", "--policy", str(policy_module()),
                           "--endpoints", str(tmp_path / "endpoints.json"), *extra],
                          capture_output=True, text=True, timeout=60, env=env)


def test_a_label_selector_is_refused_at_start(tmp_path):
    p = check(tmp_path, "--total-queued-requests-metric", 'vllm:num_requests_waiting{model_name="m"}')
    assert p.returncode != 0
    assert "label selectors are not supported" in p.stderr, p.stderr
    assert check(tmp_path).returncode == 0


def test_the_pool_namespace_defaults_to_namespace():
    out = subprocess.run([rngd_bin(), "ext-proc", "--help"], capture_output=True, text=True, timeout=60).stdout
    assert "[env: NAMESPACE=]" in out, out
