#!/usr/bin/env bash
# Installs everything the test suite needs that is not Rust code: the wasm
# targets, the Python clients and servers the tests drive (openai, Envoy,
# grpcio + xds-protos, helm-python-sdk, pytest), promtool and iproute2.
# Idempotent: a second run only checks.
set -euo pipefail

PY=${PYTHON:-python3}

# Rust: the toolchain file names the wasm targets; make sure they are there.
rustup target add wasm32-unknown-unknown wasm32-wasip1 >/dev/null

# Python packages, pinned to the versions the suite was written against.
"$PY" -m pip install --quiet --disable-pip-version-check -r "$(dirname "$0")/python/requirements.txt"

# The NIXL runtime of the nixl-ucx transport: the wheel bundles libnixl,
# libnixl_capi, the UCX plugin and UCX. Only its shared libraries are used
# (none links torch or CUDA), so its Python dependencies (torch and the CUDA
# wheels, several GB) are not installed.
"$PY" -m pip install --quiet --disable-pip-version-check --no-deps nixl-cu12==1.5.1

# Debian packages: promtool (metrics exposition checks), ip (network
# namespaces), npm (for binaryen below).
need=()
command -v promtool >/dev/null 2>&1 || need+=(prometheus)
command -v ip >/dev/null 2>&1 || need+=(iproute2)
command -v npm >/dev/null 2>&1 || need+=(nodejs npm)
# libclang and g++: the nixl-sys bindings (the nixl-ucx transport) run
# bindgen and compile their C++ stubs at build time.
ls /usr/lib/llvm-*/lib/libclang.so >/dev/null 2>&1 || need+=(libclang-dev)
command -v g++ >/dev/null 2>&1 || need+=(g++)
if [ ${#need[@]} -gt 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

# Binaryen's wasm-opt (npm package `binaryen`, run by node), which
# policies/build.sh applies to the default policy module.
tools=${XDG_CACHE_HOME:-$HOME/.cache}/rngd-pd/tools
if [ ! -x "$tools/node_modules/.bin/wasm-opt" ]; then
    mkdir -p "$tools"
    npm install --silent --no-audit --no-fund --prefix "$tools" binaryen@132.0.0 >/dev/null
fi
