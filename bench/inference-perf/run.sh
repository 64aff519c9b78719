#!/usr/bin/env bash
# inference-perf (the benchmark GIE and llm-d use) against `rngd-pd up`, with
# its server-side report read from a Prometheus server scraping both workers.
# Not part of CI: it needs Python >= 3.12 (inference-perf 0.7.0 and its
# dependencies, ~1 GB, installed into a venv) and runs for about 2 minutes.
#
#   bench/inference-perf/run.sh [OUT_DIR]
#
# Needs: `rngd-pd` built (CARGO_TARGET_DIR or ~/.cache/rngd-pd/target), the
# model fetched, `prometheus` on PATH (Debian's package), python3.12.
# Prints which of the vLLM families inference-perf queries the workers export.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
out=${1:-$(mktemp -d /tmp/rngd-pd-inference-perf.XXXXXX)}
mkdir -p "$out"
target=${CARGO_TARGET_DIR:-$HOME/.cache/rngd-pd/target}
bin=${RNGD_PD_BIN:-$target/release/rngd-pd}
model=${RNGD_PD_MODEL:-$HOME/.cache/rngd-pd/models/SmolLM2-135M-Instruct.Q4_1.gguf}
venv=${INFERENCE_PERF_VENV:-$HOME/.cache/rngd-pd/inference-perf-venv}
py=${PYTHON312:-python3.12}

if [ ! -x "$venv/bin/inference-perf" ]; then
  "$py" -m venv "$venv"
  "$venv/bin/pip" install -q inference-perf==0.7.0 gguf==0.19.0
fi
"$venv/bin/python" "$here/make_tokenizer.py" "$model" "$out/tokenizer"

pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -INT -- "-$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT

setsid "$bin" up --gateway-port 0 --metrics-port 0 >"$out/up.log" 2>"$out/up.err" &
pids+=($!)
for _ in $(seq 600); do grep -q "rngd-pd up: ready" "$out/up.log" && break; sleep 0.5; done
grep -q "rngd-pd up: ready" "$out/up.log" || { cat "$out/up.err"; exit 1; }
gateway=$(grep "^rngd-pd up: gateway " "$out/up.log" | awk '{print $4}')
prefill=$(grep "^rngd-pd up: prefill " "$out/up.log" | awk '{print $4}')
decode=$(grep "^rngd-pd up: decode " "$out/up.log" | awk '{print $4}')

prom_port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
cat >"$out/prometheus.yml" <<YAML
global:
  scrape_interval: 2s
scrape_configs:
  - job_name: rngd-pd-workers
    static_configs:
      - targets: ["${prefill#http://}", "${decode#http://}"]
YAML
setsid prometheus --config.file="$out/prometheus.yml" --storage.tsdb.path="$out/prometheus-data" \
  --web.listen-address="127.0.0.1:$prom_port" >"$out/prometheus.log" 2>&1 &
pids+=($!)
prom="http://127.0.0.1:$prom_port"
for _ in $(seq 100); do
  curl -sf "$prom/api/v1/targets" | grep -q '"health":"up".*"health":"up"' && break
  sleep 0.3
done

sed -e "s#GATEWAY_URL#$gateway#; s#TOKENIZER_DIR#$out/tokenizer#; s#PROMETHEUS_URL#$prom#; s#REPORT_DIR#$out/report#" \
  "$here/config.yaml" >"$out/config.yaml"
(cd "$out" && "$venv/bin/inference-perf" -c "$out/config.yaml" >"$out/inference-perf.log" 2>&1)
sleep 3  # one more scrape of the last requests' counters

# Which of the vLLM families inference-perf's vLLM client queries are on
# Prometheus (a counter as NAME_total, a histogram as NAME_bucket).
curl -s "$prom/api/v1/label/__name__/values" >"$out/names.json"
"$venv/bin/python" - "$venv" "$out/names.json" <<'PY'
import glob, json, re, sys
venv, names = sys.argv[1], set(json.load(open(sys.argv[2]))["data"])
src = open(glob.glob(f"{venv}/lib/python3*/site-packages/inference_perf/client/modelserver/vllm_client.py")[0]).read()
queried = sorted(set(re.findall(r'(Counter|Histogram|Gauge)Metric\("(vllm:[a-z0-9_]+)"', src)))
suffix = {"Counter": "_total", "Histogram": "_bucket", "Gauge": ""}
for kind, n in queried:
    print(("found " if n + suffix[kind] in names else "ABSENT"), kind.lower(), n)
PY
python3 - "$out/report" <<'PY'
import json, sys
d = json.load(open(f"{sys.argv[1]}/summary_lifecycle_metrics.json"))
s = d["successes"]
print(f"requests ok {s['count']}, failed {d['failures']['count']}, "
      f"request rate {s['throughput']['requests_per_sec']:.2f}/s, "
      f"TTFT p50 {s['latency']['time_to_first_token']['median']*1e3:.0f} ms, "
      f"output {s['throughput']['output_tokens_per_sec']:.1f} tokens/s")
PY
echo "reports in $out/report"
