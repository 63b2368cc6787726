#!/usr/bin/env bash
# Vulkan as a tested backend (docs/gpu.md): a real GPU backend on a machine without a GPU.
#
# The Vulkan venv is build/vulkan/venv: a hard-linked copy of .venv (the CPU build, kvlite
# installed) with two of llama-cpp-python's libraries swapped for ones built with ggml's Vulkan
# backend: libggml (the backend registry, now with Vulkan in it) and libggml-vulkan, compiled from
# llama-cpp-python 0.3.36's sdist with scripts/patches/ggml-vulkan-*.patch applied. llama.cpp,
# ggml-base, ggml-cpu and kvlite's own library are .venv's, unchanged: the same source, so the
# same ABI, and the CPU side of both runs is one build. The two libraries are kept in the build
# cache (scripts/build_cache.sh: ~/.cache/kvlite/builds/vulkan-KEY, keyed on the version, CMake
# flags, compiler, glslc, the Vulkan headers, the patches and the recipe).
#
# Then, on Mesa's software Vulkan device (llvmpipe, which ggml uses only when named:
# GGML_VK_VISIBLE_DEVICES=0) with every layer and kvlite's kernels there:
#   - `kvlite info`, which must say Vulkan0;
#   - the tests marked `backend` (pyproject.toml; docs/gpu.md says what they cover) on the tiny
#     fixtures: parity with the torch twins, kernels on the device, resident positions against
#     llama.cpp's state after eviction and compaction, quantized caches with flash attention;
#   - scripts/backend_parity.py: logits and kept positions against the CPU build in .venv.
# Exits 0 only if all of that passes on Vulkan0.
#
#   apt-get install mesa-vulkan-drivers libvulkan-dev glslc spirv-headers glslang-tools
#   bash scripts/vulkan_check.sh [PYTEST_ARGS]
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
# shellcheck source=scripts/build_cache.sh
. scripts/build_cache.sh
work=$root/build/vulkan
venv=$work/venv
step() { echo; echo "== $* ($(date +%T))"; }

for need in glslc /usr/include/vulkan/vulkan.h /usr/share/vulkan/icd.d/lvp_icd.x86_64.json; do
  if ! command -v "$need" >/dev/null && [ ! -e "$need" ]; then
    echo "vulkan_check: $need is missing: apt-get install mesa-vulkan-drivers libvulkan-dev glslc spirv-headers glslang-tools" >&2
    exit 2
  fi
done
[ -x "$root/.venv/bin/kvlite" ] || { echo "vulkan_check: run 'bash scripts/setup.sh --test' first (the CPU build)" >&2; exit 2; }
# GGML_VK_DISABLE_F16: the f32 shader variants (with scripts/patches/ggml-vulkan-f32-noncontig.patch,
# f32 from end to end), so the tiny f32 fixtures are held to the twins at the CPU's tolerances. A
# device's default f16 tiles round every product's inputs to f16: logits 0.6-3.3e-2 off on these
# fixtures (docs/gpu.md), a precision a user gets by default and no test here claims more than.
export GGML_VK_VISIBLE_DEVICES=0 GGML_VK_DISABLE_F16=1

VULKAN_CMAKE="-DCMAKE_BUILD_TYPE=Release -DGGML_VULKAN=ON -DGGML_RPC=ON"
build_vulkan() {  # DIR: DIR/lib gets libggml and libggml-vulkan, built from the patched sdist
  local dir=$1 src=$1/src/llama_cpp_python-$LCP p
  mkdir -p "$dir/src" "$dir/lib"
  tar xzf "$(lcp_sdist)" -C "$dir/src"
  for p in scripts/patches/ggml-vulkan-*.patch; do patch -s -p1 -d "$src/vendor/llama.cpp" < "$p"; done
  # ggml-vulkan and ggml, and what they link (ggml-base, ggml-cpu, ggml-rpc): not llama.cpp itself.
  # The compiler's output goes to DIR/build.log, kept with the build; its tail is shown if it fails.
  # shellcheck disable=SC2086  # the flags are words
  if ! { cmake -S "$src" -B "$dir/cmake" -Wno-dev $VULKAN_CMAKE &&
    cmake --build "$dir/cmake" --target ggml ggml-vulkan -j "$(nproc)"; } > "$dir/build.log" 2>&1; then
    tail -n 40 "$dir/build.log" >&2
    echo "vulkan_check: the build failed (the end of its log is above)" >&2
    exit 1
  fi
  find "$dir/cmake" -type f \( -name 'libggml.so.*.*.*' -o -name 'libggml-vulkan.so.*.*.*' \) -exec cp {} "$dir/lib" \;
  [ "$(find "$dir/lib" -type f | wc -l)" = 2 ] || { echo "vulkan_check: the build left no libggml and libggml-vulkan" >&2; exit 1; }
  du -sh "$dir"/lib/*
  rm -rf "$dir/src" "$dir/cmake"
}
key="llama-cpp-python $LCP
cmake $VULKAN_CMAKE, targets ggml ggml-vulkan
$(compiler_key)
glslc: $(glslc --version | head -n1)
vulkan headers: $(grep -m1 '^#define VK_HEADER_VERSION ' /usr/include/vulkan/vulkan_core.h)
$(sha256sum scripts/patches/ggml-vulkan-*.patch)"
step "libggml and libggml-vulkan (cached; 4-6 minutes on 2 cores when the key is new)"
built=$(cached_build vulkan "$key" build_vulkan)

step "the Vulkan venv: .venv's hard-linked copy with them swapped in ($venv)"
mkdir -p "$work"
venv_overlay "$root/.venv" "$venv"
for f in "$built"/lib/*; do swap_lib "$(echo "$venv"/lib/python3*/site-packages/llama_cpp/lib)" "$f"; done

step "kvlite info: the Vulkan device"
tiny=$work/tiny.gguf
"$venv/bin/python" -c "from kvlite.reference.tiny_gguf import write_tiny_gguf as w; w('$tiny')"
"$venv/bin/kvlite" info -m "$tiny" | tee "$work/info.txt"
grep -q "^kernels_on *Vulkan0" "$work/info.txt" || { echo "vulkan_check: the kernels are not on Vulkan0" >&2; exit 1; }

step "the backend tests on Vulkan0 (pytest -m backend)"
# From outside the tree: `python -m pytest` puts the working directory first on sys.path, and the
# tree's kvlite would load build/'s native library, linked against the CPU build's ggml. Hypothesis
# draws 10 operation sequences a case here (the CPU suite 40, its RPC run 25): what this run adds
# is the device's buffers under them, and each sequence makes a context on llvmpipe.
(cd "$work" && KVLITE_HYPOTHESIS_EXAMPLES="${KVLITE_HYPOTHESIS_EXAMPLES:-10}" "$venv/bin/python" -m pytest -q \
  -p no:cacheprovider --rootdir "$root" -c "$root/pyproject.toml" -m "backend and not slow" "$root/tests" "$@")

step "against the CPU build (.venv)"
"$root/.venv/bin/python" scripts/backend_parity.py --dump "$work/cpu.json"
"$venv/bin/python" scripts/backend_parity.py --dump "$work/vulkan.json"
"$root/.venv/bin/python" scripts/backend_parity.py --compare "$work/cpu.json" "$work/vulkan.json"
step "done: every check passed on Vulkan0"
