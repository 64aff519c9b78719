"""`rngd-pd workload run`: the ai-rm workload runner (docs/workload.md).

The dry-run launch of each kind is checked against the documented argv and
env; bad workloads are refused naming the key; a `serve` workload is started
and answers a completion through the `openai` client, and stops cleanly on
SIGINT (the runner became `rngd-pd up`)."""

import json
import os
import subprocess

import openai
import pytest

from conftest import SERVED_MODEL, Proc, Stack, free_port, model_path, rngd_bin


def dry_run(tmp_path, text, name="w.yaml"):
    f = tmp_path / name
    f.write_text(text)
    r = subprocess.run([rngd_bin(), "workload", "run", "--dry-run", str(f)], capture_output=True, text=True,
                       timeout=60)
    return r


def launch(tmp_path, text, name="w.yaml"):
    r = dry_run(tmp_path, text, name)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert os.path.samefile(out["argv"][0], rngd_bin()), out["argv"][0]
    return out["argv"][1:], out["env"]


@pytest.mark.parametrize(
    "text,argv,env",
    [
        ("kind: prefill\n",
         "worker --role prefill --host 127.0.0.1 --port 8000 --seq-len 256 --kv-transport shm", {}),
        ("kind: decode\nmodel: /m.gguf\nbatch_hint: 4\nkv_transport: tcp\nbackend: cpu\n",
         "worker --role decode --host 127.0.0.1 --port 8000 --seq-len 256 --kv-transport tcp --backend cpu "
         "--batch 4 --model /m.gguf", {}),
        ("kind: serve\nprefill_url: http://p:8000\ndecode_url: http://d:8000\nport: 8080\nmetrics_port: 9100\n",
         "gateway --listen 127.0.0.1:8080 --prefill http://p:8000 --decode http://d:8000 --seq-len 256 "
         "--worker-transport shm --metrics-port 9100", {}),
        ("kind: serve\nseq_len: 512\nhost: 0.0.0.0\nargs: [--no-kv-events]\nenv: {RUST_LOG: debug}\n",
         "up --host 0.0.0.0 --port 8000 --max-model-len 512 --kv-transport shm --no-kv-events",
         {"RUST_LOG": "debug"}),
    ],
)
def test_each_kind_launches_the_documented_command(tmp_path, text, argv, env):
    got_argv, got_env = launch(tmp_path, text)
    assert got_argv == argv.split()
    transport = "tcp" if "kv_transport: tcp" in text else "shm"
    assert got_env == {**env, "AIRM_KV_TRANSPORT": transport}


def test_json_and_dry_run_key(tmp_path):
    argv, _ = launch(tmp_path, json.dumps({"kind": "decode", "port": 9001}), name="w.json")
    assert argv[:6] == ["worker", "--role", "decode", "--host", "127.0.0.1", "--port"]
    # `dry_run: true` in the file prints too (the process is not started).
    f = tmp_path / "d.yaml"
    f.write_text("kind: prefill\ndry_run: true\n")
    r = subprocess.run([rngd_bin(), "workload", "run", str(f)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["argv"][1:3] == ["worker", "--role"]


@pytest.mark.parametrize(
    "text,named",
    [
        ("kind: prefill\nbatch_hint: 2\n", "batch_hint"),
        ("kind: decode\nmetrics_port: 9100\n", "metrics_port"),
        ("kind: serve\nprefill_url: http://p:8000\n", "decode_url"),
        ("kind: serve\nprot: 8000\n", "prot"),
        ("kind: train\n", "train"),
        ("kind: prefill\nkv_transport: nixl\n", "nixl"),
        ("kind: prefill\nport: eighty\n", "port"),
    ],
)
def test_bad_workloads_are_refused_naming_the_key(tmp_path, text, named):
    r = dry_run(tmp_path, text)
    assert r.returncode != 0
    assert named in r.stderr, r.stderr


def test_a_serve_workload_starts_the_stack_and_answers(tmp_path):
    port = free_port()
    f = tmp_path / "serve.yaml"
    f.write_text(f"kind: serve\nport: {port}\nseq_len: 512\nmodel: {model_path()}\nmetrics_port: 0\n")
    proc = Proc("workload serve", [rngd_bin(), "workload", "run", str(f)])
    try:
        s = Stack(proc, "shm")
        c = openai.OpenAI(base_url=s.gateway + "/v1", api_key="unused", max_retries=0, timeout=300)
        r = c.completions.create(model=SERVED_MODEL, prompt="The capital of France is", max_tokens=4,
                                 temperature=0)
        assert r.choices[0].text and r.usage.completion_tokens == 4
    finally:
        code = proc.stop()
    assert code == 0, f"the served workload exited with {code} on SIGINT"
