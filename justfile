# llmgw's recipes. `./dev <recipe>` bootstraps uv and just; `just <recipe>` if you have them.

set shell := ["bash", "-euo", "pipefail", "-c"]

# Never download a Python: use the machine's own.
export UV_PYTHON_DOWNLOADS := "never"
export UV_PYTHON_PREFERENCE := "only-system"

# llama.cpp (the engines group) builds from source: bounded parallelism so a
# 2-core machine stays usable, only llama-server and the RPC server matter,
# and nothing is fetched at build time. uv caches the built wheel.
export LLAMA_CPP_BUILD_JOBS := env("LLAMA_CPP_BUILD_JOBS", "2")
export CMAKE_ARGS := env("CMAKE_ARGS", "-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_RPC=ON -DGGML_NATIVE=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_APP=OFF")

default:
    @just --list

# Bring up a whole llmgw cluster on this machine (Ctrl-C stops it).
up *ARGS:
    uv sync --frozen --inexact --no-group engines
    uv run --frozen --no-sync llmgw up {{ARGS}}

# Tests run in parallel, a file to a worker (most of a test's time is spent waiting on its
# processes, so a 2-core machine runs three at once); LLMGW_TEST_WORKERS=0 runs them in turn.
workers := env("LLMGW_TEST_WORKERS", "3")

# Lint, type-check and run the whole test suite (builds llama.cpp once, then cached).
test *ARGS: system-packages sync-all lint
    uv run --frozen --no-sync pytest -n {{workers}} --dist loadfile {{ARGS}}

# Only the tests over plain data (no NATS, no processes): seconds, for the edit-test loop.
test-fast *ARGS:
    uv sync --frozen --inexact --no-group engines --no-group real-engines
    uv run --frozen --no-sync pytest -m fast {{ARGS}}

# The long faults at full length (NATS down 5 min, the chaos soak 150 s): `./dev test` runs them shorter.
soak *ARGS: sync-all
    uv run --frozen --no-sync pytest -m soak --soak {{ARGS}}

sync-all:
    uv sync --frozen --all-groups

# podman (with runc, netavark and aardvark-dns for service names, iptables for
# its bridge, catatonit for compose's `init: true`) and mmdebstrap for the
# container test, chromium for the browser test, iproute2 (`ip netns`) for the
# multi-host tests' hosts: installed with apt when root and missing; otherwise
# this says so and those tests skip with their reason (the multi-host tests
# fail instead when CI=true).
# As root, install the Debian packages some tests need (podman, mmdebstrap, chromium).
system-packages:
    #!/usr/bin/env bash
    set -euo pipefail
    wanted=(podman runc netavark aardvark-dns iptables iproute2 catatonit mmdebstrap chromium)
    missing=()
    for p in "${wanted[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q ' installed$' || missing+=("$p")
    done
    [ "${#missing[@]}" -eq 0 ] && exit 0
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
        echo "llmgw: not installing ${missing[*]} (needs root and apt-get); the tests that need them skip" >&2
        exit 0
    fi
    start=$SECONDS
    export DEBIAN_FRONTEND=noninteractive
    # A fresh machine's package lists may be missing or stale: refresh them only then.
    if ! apt-get install -y -qq -o DPkg::Lock::Timeout=300 --no-install-recommends "${missing[@]}" >/dev/null 2>&1; then
        apt-get update -qq
        apt-get install -y -qq -o DPkg::Lock::Timeout=300 --no-install-recommends "${missing[@]}" >/dev/null
    fi
    echo "llmgw: installed ${missing[*]} in $((SECONDS - start)) s" >&2

# ruff and mypy (strict on llmgw_core).
lint:
    uv run --frozen --no-sync ruff check .
    uv run --frozen --no-sync ruff format --check .
    uv run --frozen --no-sync mypy

# Format the code.
fmt:
    uv run --frozen ruff format .
    uv run --frozen ruff check --fix .

# Regenerate docs/asyncapi.yaml from the message types.
asyncapi:
    uv run --frozen python -m llmgw_core.asyncapi > docs/asyncapi.yaml

# Run the benchmarks; they print their figures and write BENCHMARKS.md.
bench *ARGS: sync-all
    uv run --frozen --no-sync python -m bench {{ARGS}}
