#!/usr/bin/env bash
# Vulkan as a tested backend (issue 28): a real GPU backend on a machine without a GPU.
#
# Builds llama-cpp-python 0.3.36 with ggml's Vulkan backend (-DGGML_VULKAN=ON) against Debian 12's
# packages into .venv-vulkan (reused once built: the build takes 20 minutes on 2 cores), with
# scripts/patches/ggml-vulkan-*.patch applied, and kvlite against that ggml. Then runs,
# on Mesa's software Vulkan device (llvmpipe, which ggml uses only when named:
# GGML_VK_VISIBLE_DEVICES=0) with every layer and kvlite's kernels there:
#   - `kvlite info`, which must say Vulkan0;
#   - the parity (torch twins) and invariant (llama.cpp's state) tests of tests/device_tests.txt on
#     the tiny fixtures, flash attention on and off among them;
#   - scripts/backend_parity.py: logits and kept positions against the CPU build in .venv.
# Exits 0 only if all of that passes on Vulkan0.
#
#   apt-get install mesa-vulkan-drivers libvulkan-dev glslc spirv-headers glslang-tools
#   bash scripts/vulkan_check.sh [PYTEST_ARGS]
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
LCP=0.3.36
venv=$root/.venv-vulkan
work=$root/build/vulkan
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
export GGML_VK_VISIBLE_DEVICES=0 GGML_VK_DISABLE_F16=1 PIP_DISABLE_PIP_VERSION_CHECK=1
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"

src=$work/llama_cpp_python-$LCP
patches=$(cat scripts/patches/ggml-vulkan-*.patch | sha256sum | cut -c1-16)  # a new patch rebuilds
if ! ls "$venv"/lib/python3*/site-packages/llama_cpp/lib/libggml-vulkan.so >/dev/null 2>&1 ||
   [ "$(cat "$venv/.patches" 2>/dev/null)" != "$patches" ]; then
  step "build: llama-cpp-python $LCP with -DGGML_VULKAN=ON (20 minutes on 2 cores; kept in $venv)"
  rm -rf "$venv" && python3 -m venv "$venv"
  mkdir -p "$work"
  if [ ! -d "$src" ]; then
    "$venv/bin/pip" download -q --no-deps --no-binary :all: -d "$work" "llama-cpp-python==$LCP"
    tar xzf "$work/llama_cpp_python-$LCP.tar.gz" -C "$work"
  fi
  for p in scripts/patches/ggml-vulkan-*.patch; do  # each once: a source patched before keeps its hunks
    if ! patch -p1 -R -s -f --dry-run -d "$src/vendor/llama.cpp" < "$p" >/dev/null 2>&1; then
      patch -p1 -d "$src/vendor/llama.cpp" < "$p"
    fi
  done
  # The build directory is kept, so a build cut short resumes where it stopped.
  CMAKE_ARGS="-DGGML_VULKAN=ON -DGGML_RPC=ON -DLLAVA_BUILD=OFF" "$venv/bin/pip" install -q \
    --config-settings=build-dir="$work/build" "$src"
  du -sh "$venv"/lib/python3*/site-packages/llama_cpp/lib/libggml-vulkan.so
  echo "$patches" > "$venv/.patches"
fi
step "kvlite against the Vulkan build's ggml"
"$venv/bin/pip" install -q scikit-build-core
"$venv/bin/pip" install -q --no-build-isolation ".[test]"

step "kvlite info: the Vulkan device"
tiny=$work/tiny.gguf
"$venv/bin/python" -c "from kvlite.reference.tiny_gguf import write_tiny_gguf as w; w('$tiny')"
"$venv/bin/kvlite" info -m "$tiny" | tee "$work/info.txt"
grep -q "^kernels_on *Vulkan0" "$work/info.txt" || { echo "vulkan_check: the kernels are not on Vulkan0" >&2; exit 1; }

step "parity and invariants on Vulkan0 (tests/device_tests.txt)"
# From outside the tree: `python -m pytest` puts the working directory first on sys.path, and the
# tree's kvlite would load build/'s native library, linked against the CPU build's ggml.
# shellcheck disable=SC2046
(cd "$work" && KVLITE_HYPOTHESIS_EXAMPLES="${KVLITE_HYPOTHESIS_EXAMPLES:-25}" "$venv/bin/python" -m pytest -q \
  -p no:cacheprovider --rootdir "$root" -c "$root/pyproject.toml" -m "not slow" \
  $(grep -v '^#' "$root/tests/device_tests.txt" | sed "s|^|$root/|") "$@")

step "against the CPU build (.venv)"
"$root/.venv/bin/python" scripts/backend_parity.py --dump "$work/cpu.json"
"$venv/bin/python" scripts/backend_parity.py --dump "$work/vulkan.json"
"$root/.venv/bin/python" scripts/backend_parity.py --compare "$work/cpu.json" "$work/vulkan.json"
step "done: every check passed on Vulkan0"
