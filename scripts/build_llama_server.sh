#!/usr/bin/env bash
# llama-server from the llama.cpp that llama-cpp-python 0.3.36 vendors (its sdist), built for this
# CPU as the wheel's llama.cpp is (GGML_NATIVE), for scripts/bench_serve_vs_llama_server.py: the
# same llama.cpp on both sides of the comparison. Kept in the build cache (scripts/build_cache.sh:
# ~/.cache/kvlite/builds/llama-server-KEY, keyed on the version, CMake flags, compiler, this CPU's
# instruction sets and the recipe); a second run only prints the path. About 6 minutes on 2 cores.
#
#   bash scripts/build_llama_server.sh      # prints the binary's path
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/build_cache.sh
. scripts/build_cache.sh

SERVER_CMAKE="-DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_USE_PREBUILT_UI=OFF
  -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF"
build_server() {  # DIR: DIR/llama-server, statically linked
  local dir=$1
  mkdir -p "$dir/src"
  tar xzf "$(lcp_sdist)" -C "$dir/src"
  # shellcheck disable=SC2086  # the flags are words
  if ! { cmake -S "$dir/src/llama_cpp_python-$LCP/vendor/llama.cpp" -B "$dir/cmake" -Wno-dev $SERVER_CMAKE &&
    cmake --build "$dir/cmake" --target llama-server -j "$(nproc)"; } > "$dir/build.log" 2>&1; then
    tail -n 40 "$dir/build.log" >&2
    echo "build_llama_server: the build failed (the end of its log is above)" >&2
    exit 1
  fi
  cp "$dir/cmake/bin/llama-server" "$dir/llama-server"
  rm -rf "$dir/src" "$dir/cmake"
}
# GGML_NATIVE compiles for this CPU: its instruction sets are part of the key
key="llama-cpp-python $LCP
cmake $SERVER_CMAKE, target llama-server
$(compiler_key)
cpu: $(grep -m1 '^flags' /proc/cpuinfo | sha256sum | cut -c1-16)"
echo "$(cached_build llama-server "$key" build_server)/llama-server"
