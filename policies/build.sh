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

# Binaryen's wasm-opt (tests/setup.sh installs it from npm) takes the default
# module from ~243 KB to ~203 KB at -O3 (dead code and duplicate functions
# rustc leaves in) with no measurable change in decision time. The features
# are the ones rustc enables by default for both wasm targets (a stripped
# module carries no features section for wasm-opt to read).
wasm_opt=$(command -v wasm-opt || true)
tools_opt=${XDG_CACHE_HOME:-$HOME/.cache}/rngd-pd/tools/node_modules/.bin/wasm-opt
[ -z "$wasm_opt" ] && [ -x "$tools_opt" ] && wasm_opt=$tools_opt
if [ -n "$wasm_opt" ]; then
    for target in wasm32-unknown-unknown wasm32-wasip1; do
        # From rustc's own output in deps/ (the copy beside it may be an
        # earlier run's result), written over the module the hosts load.
        module="$dir/$target/release/pd_default.wasm"
        "$wasm_opt" -O3 --enable-bulk-memory --enable-sign-ext --enable-mutable-globals \
            --enable-nontrapping-float-to-int --enable-multivalue --enable-reference-types \
            "$dir/$target/release/deps/pd_default.wasm" -o "$module.opt"
        rm -f "$module"
        mv "$module.opt" "$module"
    done
else
    echo "policies/build.sh: wasm-opt not found (tests/setup.sh installs it); pd_default.wasm left as rustc wrote it" >&2
fi
ls -l "$dir"/wasm32-*/release/{pd_default,fault_guest}.wasm
