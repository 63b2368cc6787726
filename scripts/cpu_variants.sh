#!/usr/bin/env bash
# Runs tests on llama.cpp's CPU backend compiled for other instruction sets than this machine's.
#
# llama-cpp-python compiles ggml with -march=native, so a model's floating-point sums, and with
# them a small model's greedy words, differ between CPUs (AVX-512 here, AVX2 on the next machine).
# A test that asserts words must hold on all of them (tests/README.md). Only libggml-cpu carries
# instruction-set code (ggml-base, ggml and llama are built without arch flags), so each variant
# is that one library, built from the installed llama-cpp-python's own sources with its own
# CMakeLists, swapped into a hard-linked copy of .venv.
#
#   bash scripts/cpu_variants.sh [VARIANT[@THREADS] ...] [-- PYTEST_ARGS]
#
# VARIANT: native (the installed build), avx2 (-DGGML_NATIVE=OFF: llama.cpp's portable x86-64
# build, SSE4.2/AVX/AVX2/FMA/F16C, no AVX-512), generic (-DGGML_NATIVE=OFF and every x86 extension
# off: ggml's plain C path). THREADS pins the run to that many cores with taskset; kvlite's
# default -t is the cores it may run on. Default: native avx2 generic, each at 1 and 2 threads,
# running the model-answer tests (-m model_answer); `-- ` with nothing after runs the whole suite.
# Each variant's library is kept in the build cache (scripts/build_cache.sh:
# ~/.cache/kvlite/builds/ggml-cpu-VARIANT-KEY; under a minute each on 2 cores the first time), its
# venv in build/cpu-variants/.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
# shellcheck source=scripts/build_cache.sh
. scripts/build_cache.sh
venv=$root/.venv
out=$root/build/cpu-variants
mkdir -p "$out"
[ -x "$venv/bin/pytest" ] || { echo "cpu_variants: run 'bash scripts/setup.sh --test' first" >&2; exit 2; }

runs=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do runs+=("$1"); shift; done
if [ $# -gt 0 ]; then shift; pytest_args=("$@"); else pytest_args=(-m model_answer); fi
[ ${#runs[@]} -gt 0 ] || runs=(native@1 native@2 avx2@1 avx2@2 generic@1 generic@2)

site=$("$venv/bin/python" -c "import llama_cpp, os; print(os.path.dirname(os.path.dirname(llama_cpp.__file__)))")
version=$("$venv/bin/python" -c "import llama_cpp; print(llama_cpp.__version__)")
[ "$version" = "$LCP" ] || { echo "cpu_variants: .venv has llama-cpp-python $version, not $LCP: run scripts/setup.sh" >&2; exit 2; }

flags_of() {
  case "$1" in
    avx2) echo "-DGGML_NATIVE=OFF" ;;
    generic) echo "-DGGML_NATIVE=OFF -DGGML_SSE42=OFF -DGGML_AVX=OFF -DGGML_AVX2=OFF -DGGML_BMI2=OFF -DGGML_FMA=OFF -DGGML_F16C=OFF" ;;
    *) echo "cpu_variants: unknown variant '$1' (native, avx2, generic)" >&2; exit 2 ;;
  esac
}

build_variant() {  # DIR: DIR/lib gets the variant $variant's libggml-cpu
  local dir=$1
  mkdir -p "$dir/src" "$dir/lib"
  tar xzf "$(lcp_sdist)" -C "$dir/src"
  # shellcheck disable=SC2046  # the flags are words
  cmake -S "$dir/src/llama_cpp_python-$LCP" -B "$dir/cmake" -Wno-dev -DCMAKE_BUILD_TYPE=Release -DGGML_RPC=ON \
    $(flags_of "$variant") > "$dir/build.log" 2>&1
  cmake --build "$dir/cmake" --target ggml-cpu -j "$(nproc)" >> "$dir/build.log" 2>&1
  find "$dir/cmake" -type f -name 'libggml-cpu.so.*.*.*' -exec cp {} "$dir/lib" \;
  rm -rf "$dir/src" "$dir/cmake"
}

overlay() {  # a copy of .venv (hard links, seconds) whose libggml-cpu is the variant's
  local dir=$out/venv-$1 built variant=$1
  built=$(cached_build "ggml-cpu-$1" "llama-cpp-python $LCP
cmake $(flags_of "$1"), target ggml-cpu
$(compiler_key)" build_variant)
  venv_overlay "$venv" "$dir"
  swap_lib "${site/#$venv/$dir}/llama_cpp/lib" "$(echo "$built"/lib/libggml-cpu.so.*)"
  echo "$dir"
}

declare -a summary
status=0
for run in "${runs[@]}"; do
  name=${run%@*}
  threads=$([ "$name" = "$run" ] && nproc || echo "${run#*@}")
  if ! [[ $threads =~ ^[1-9][0-9]*$ ]] || [ "$threads" -gt "$(nproc)" ]; then
    echo "cpu_variants: '$run': threads must be 1 to $(nproc)" >&2; exit 2
  fi
  if [ "$name" = native ]; then env_dir=$venv; else flags_of "$name" >/dev/null; env_dir=$(overlay "$name"); fi
  cores="0-$((threads - 1))"
  # what the process really loads: llama.cpp's report of the CPU backend's compiled features
  features=$(cd / && "$env_dir/bin/python" -c "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())")
  case $name in
    avx2) [[ $features == *"AVX2 = 1"* && $features != *AVX512* ]] ;;
    generic) [[ $features != *AVX* ]] ;;
  esac || { echo "cpu_variants: $name loads the wrong ggml-cpu: $features" >&2; exit 1; }
  echo "== $name, $threads thread(s), $features: pytest ${pytest_args[*]}" >&2
  set +e
  taskset -c "$cores" "$env_dir/bin/python" -m pytest -p no:cacheprovider "${pytest_args[@]}" 2>&1 | tee "$out/$name@$threads.log"
  rc=${PIPESTATUS[0]}
  set -e
  summary+=("$name@$threads: $(tail -n1 "$out/$name@$threads.log")")
  [ "$rc" -eq 0 ] || status=1
done
printf '%s\n' "== summary" "${summary[@]}"
exit "$status"
