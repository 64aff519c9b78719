#!/usr/bin/env bash
# Builds the policy guests (pd-default, fault-guest) for both wasm targets.
# Output: $CARGO_TARGET_DIR/<target>/release/{pd_default,fault_guest}.wasm
# (CARGO_TARGET_DIR defaults to <workspace>/target).
set -euo pipefail
cd "$(dirname "$0")/.."
# Debug line tables (the workspace release profile) and per-crate codegen
# would double the module size; these overrides apply to this build only.
export CARGO_PROFILE_RELEASE_DEBUG=false CARGO_PROFILE_RELEASE_STRIP=symbols \
    CARGO_PROFILE_RELEASE_LTO=true CARGO_PROFILE_RELEASE_CODEGEN_UNITS=1
for target in wasm32-unknown-unknown wasm32-wasip1; do
    cargo build --release --target "$target" -p fault-guest "$@"
    # pd-default is also an rlib (the benchmark links it natively); building
    # the module as the cdylib alone keeps LTO whole (an rlib beside it adds
    # ~20 KB to the .wasm).
    cargo rustc --release --target "$target" -p pd-default --crate-type cdylib "$@"
done
dir=${CARGO_TARGET_DIR:-$PWD/target}
ls -l "$dir"/wasm32-*/release/{pd_default,fault_guest}.wasm
