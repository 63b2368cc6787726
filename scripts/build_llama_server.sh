#!/usr/bin/env bash
# llama-server from the llama.cpp that llama-cpp-python 0.3.36 vendors (its sdist), built for this
# CPU as the wheel's llama.cpp is (GGML_NATIVE), for scripts/bench_serve_vs_llama_server.py: the
# same llama.cpp on both sides of the comparison. Kept in build/llama-server; a second run only
# prints the path. 10-15 minutes on 2 cores.
#
#   bash scripts/build_llama_server.sh      # prints the binary's path
set -euo pipefail
cd "$(dirname "$0")/.."
LCP=0.3.36
work=$PWD/build/llama-server
bin=$work/build/bin/llama-server
if [ ! -x "$bin" ]; then
  mkdir -p "$work"
  src=$work/llama_cpp_python-$LCP
  if [ ! -d "$src" ]; then
    sdist=$PWD/build/vulkan/llama_cpp_python-$LCP.tar.gz  # scripts/vulkan_check.sh's download, if there
    if [ ! -f "$sdist" ]; then
      python3 -m pip download -q --no-deps --no-binary :all: -d "$work" "llama-cpp-python==$LCP" >&2
      sdist=$work/llama_cpp_python-$LCP.tar.gz
    fi
    tar xzf "$sdist" -C "$work"
  fi
  cmake -S "$src/vendor/llama.cpp" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF >&2
  cmake --build "$work/build" --target llama-server -j "$(nproc)" >&2
fi
echo "$bin"
