#!/usr/bin/env bash
# The GPU check (docs/gpu.md), prepared here and run on a GPU machine that has no network: its tree
# travels capped at 64 MiB, a command runs 10 minutes at most, all tries get 15 (docs/gpu.md).
#
#   bash scripts/gpu_check.sh --pack DIR      here, with PyPI: writes the archive into DIR, prints its size
#   bash scripts/gpu_check.sh --rehearse DIR  here: installs from DIR into a clean venv inside a network
#                                             namespace with no network (a CPU build), runs the same check
#   bash scripts/gpu_check.sh DIR             the GPU machine: builds with CUDA for its GPU, runs the check
#
# DIR holds llama-cpp-python 0.3.36's sdist trimmed to what the build needs (llama.cpp's ggml, src,
# include, common, vendor, tools/mtmd and CMake files; no models, docs or tests), kvlite's tree
# (without results-runs/), wheels of the pure-Python dependencies the GPU machine lacks (it has
# Python 3.12 with numpy, torch, pytest, hypothesis, scikit-build-core, CMake and ninja), and news/,
# the test split's prose: the one file of gensim's wheel that kvlite reads.
# The check: `kvlite info`; the backend tests (pytest -m backend: parity with the torch twins,
# kernels on the device, the cache's buffers against llama.cpp's state) on the tiny fixtures (not
# the slow ones, whose models do not travel) with all layers and kvlite's kernels on the device;
# then eviction's speed and memory on random-weight GGUFs of real shapes written there
# (scripts/bench_shapes.py); then, on CUDA, the 32K test stage's remaining cells (long-test-qwen-32768:
# about 85 minutes a sample on 2 CPU cores, so it left results.py's CPU plan), into out/runs/, from the
# records the tree's results-runs/ holds. Bring back out/runs/long-test-qwen-32768/samples.jsonl (the
# new cells): append it to results-runs/long-test-qwen-32768/samples.jsonl, beside the .gz.
# That stage needs Qwen2.5-Coder-0.5B's GGUF (480 MB) in kvlite's model cache there (KVLITE_CACHE, or
# ~/.cache/kvlite), and nothing puts it there yet: that machine cannot download it, and the tree
# alone takes about 46 of a call's 64 MiB (results-runs/ 44), so a call carries a few MiB of it at
# most. Without the file the stage says so and is skipped; it has never run, and --rehearse (a CPU
# build, where it would take days) skips it too.
# Each stage leaves a mark in build/gpu-check-KIND/out, which a warm machine keeps between calls (the
# device tool's $OUT is new each call), so the same command again resumes after the last stage that
# finished; what that folder holds is copied into $OUT after each stage.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
LCP=0.3.36
WHEELS="typing_extensions==4.16.0 diskcache==5.6.3 jinja2==3.1.6 markupsafe==3.0.4 gguf==0.19.0 pyyaml==6.0.4
  requests==2.34.2 urllib3==2.8.0 idna==3.20 charset-normalizer==3.5.3 certifi==2026.10.19.post1 tqdm==4.70.1
  rouge==1.0.1 six==1.17.0 scikit-build-core==1.1.2 pathspec==1.1.1 packaging==26.4"
# What the check installs from the wheels (llama-cpp-python's and kvlite's imports at test time).
NEEDS="typing_extensions diskcache jinja2 markupsafe gguf pyyaml requests tqdm rouge six"
step() { echo; echo "== $* ($(date +%T))"; }
usage() { echo "usage: bash scripts/gpu_check.sh [--pack | --rehearse] DIR" >&2; exit 2; }

pack() {  # $1: DIR
  local dir=$1 tmp
  mkdir -p "$dir/wheels"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' RETURN
  step "llama-cpp-python $LCP sdist, trimmed"
  pip download -q --no-deps --no-binary :all: -d "$tmp" "llama-cpp-python==$LCP"
  tar xzf "$tmp/llama_cpp_python-$LCP.tar.gz" -C "$tmp"
  local p=llama_cpp_python-$LCP v=llama_cpp_python-$LCP/vendor/llama.cpp
  # Byte for byte the same archive from the same sdist (sorted, no gzip timestamp): --rehearse keys
  # its build directory on the archive's sha256.
  tar cf - -C "$tmp" --sort=name --mtime=2000-01-01 --owner=0 --group=0 --numeric-owner --exclude=.git --exclude=__pycache__ \
    $p/CMakeLists.txt $p/pyproject.toml $p/README.md $p/LICENSE.md $p/PKG-INFO $p/llama_cpp \
    $v/CMakeLists.txt $v/LICENSE $v/licenses $v/cmake $v/common $v/ggml $v/include $v/src $v/vendor $v/tools/mtmd \
    | gzip -n > "$dir/llama-cpp-python.tar.gz"
  step "kvlite's tree (what git tracks or would, without results-runs/)"
  git ls-files -co --exclude-standard -- . ':!results-runs' | tar czf "$dir/kvlite.tar.gz" --transform 's,^,kvlite/,' -T -
  step "wheels for Python 3.11 (the rehearsal) and 3.12 (the GPU machine)"
  for py in 3.11 3.12; do
    # shellcheck disable=SC2086
    pip download -q --no-deps --only-binary :all: --python-version "$py" --implementation cp \
      --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d "$dir/wheels" $WHEELS
  done
  step "the test split's prose (kvlite.eval.haystack's NEWS_FILE) out of gensim's wheel, for the 32K stage"
  local news
  news=$(python3 -c "from kvlite.eval.haystack import NEWS_PACKAGE as p, NEWS_FILE as f; print(p, '/'.join(f))")
  pip download -q --no-deps --only-binary :all: -d "$tmp" "${news% *}"  # any platform's wheel holds it
  python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract('gensim/' + sys.argv[2], sys.argv[3])" \
    "$tmp"/gensim-*.whl "${news#* }" "$dir/news"
  (cd "$dir" && { git -C "$root" rev-parse HEAD; git -C "$root" status --short | head -20;
    find . -type f -printf '%s %p\n' | sort -k2; } > MANIFEST.txt)
  step "archive: $(du -sb "$dir" | cut -f1) bytes in $dir ($(du -sh "$dir" | cut -f1); the tree's cap is 64 MiB)"
}

check() {  # $1: DIR, $2: venv (made, with numpy, torch, pytest, hypothesis visible), $3: cpu|cuda, $4: out
  local dir=$1 venv=$2 kind=$3 work src arch
  work=$root/build/gpu-check-$kind
  ret=$4 out=$work/out  # out is kept between calls; ret gets a copy after each stage and at exit
  mkdir -p "$work" "$out" "$ret"
  trap 'cp -a "$out/." "$ret/"' EXIT
  src=$work/kvlite
  # shellcheck disable=SC1091
  . "$venv/bin/activate"
  # Nothing from an index, nothing from this machine's pip configuration: only DIR.
  export PIP_NO_INDEX=1 PIP_FIND_LINKS=$dir/wheels PIP_CONFIG_FILE=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1
  export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
  if [ ! -e "$out/built" ]; then
    step "build: llama-cpp-python $LCP ($kind), then kvlite against its ggml"
    rm -rf "$src" && tar xzf "$dir/kvlite.tar.gz" -C "$work"
    [ -d "$work/llama_cpp_python-$LCP" ] || tar xzf "$dir/llama-cpp-python.tar.gz" -C "$work"
    pip install -q scikit-build-core pathspec packaging
    # --exclude-libs: a toolchain that links libstdc++ statically (the GPU machine's did) otherwise
    # exports its std:: symbols from libggml-cuda, and since llama-cpp-python loads its libraries
    # RTLD_GLOBAL, torch's and numpy's C++ then run on that copy: free(): invalid pointer in
    # std::locale's destructor the moment torch is imported (docs/gpu.md).
    local cmake="-DGGML_RPC=ON -DLLAVA_BUILD=OFF -DCMAKE_SHARED_LINKER_FLAGS=-Wl,--exclude-libs,ALL"
    if [ "$kind" = cuda ]; then  # this GPU's architecture only (9.0 -> 90): minutes, not the hour of all
      arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n1 | tr -d '. ')
      cmake="$cmake -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=${arch:-native}"
    fi
    # The build directory is kept (build-dir), so a build cut off at the time limit resumes.
    CMAKE_ARGS="$cmake" pip install -q --no-build-isolation --config-settings=build-dir="$work/lcp-build" \
      "$work/llama_cpp_python-$LCP"
    # shellcheck disable=SC2086
    pip install -q $NEEDS
    pip install -q --no-build-isolation --no-deps "$src"
    kvlite --version
    local lib leaked=""
    lib=$(python -c "import llama_cpp, pathlib; print(pathlib.Path(llama_cpp.__file__).parent / 'lib')")
    for f in "$lib"/*.so*; do
      nm -D --defined-only "$f" 2>/dev/null | grep -q ' _ZNSt6locale' && leaked="$leaked $(basename "$f")"
    done
    [ -z "$leaked" ] || { echo "gpu_check: libstdc++ is exported from$leaked (linked statically, not hidden)"; exit 1; }
    touch "$out/built"
  fi
  cp -a "$out/." "$ret/"
  cd "$src"
  step "kvlite info (devices, kernels_on) on a tiny fixture (the default model does not travel)"
  python -c "from kvlite.reference.tiny_gguf import write_tiny_gguf as w; w('$work/tiny.gguf')"
  kvlite info -m "$work/tiny.gguf" | tee "$out/info.txt"
  if [ "$kind" = cuda ]; then
    grep -q "gpu_offload *True" "$out/info.txt" || { echo "llama.cpp sees no GPU: the CUDA build did not take"; exit 1; }
  fi
  if [ ! -e "$out/tests-passed" ]; then
    step "parity and invariants on the tiny fixtures, every layer and the kernels on $(grep kernels_on "$out/info.txt" | awk '{print $2}')"
    # the modules holding backend tests only: the others import what the GPU machine lacks (FastAPI)
    # shellcheck disable=SC2046
    if KVLITE_HYPOTHESIS_EXAMPLES="${KVLITE_HYPOTHESIS_EXAMPLES:-25}" python -m pytest -q -p no:cacheprovider \
      -m "backend and not slow" $(grep -l 'pytest.mark.backend\|on_backend(' tests/test_*.py) \
      2>&1 | tee "$out/tests.txt"; then
      touch "$out/tests-passed"
    fi
  fi
  cp -a "$out/." "$ret/"
  step "eviction's speed and memory on random-weight GGUFs of real shapes"
  if [ "$kind" = cuda ]; then
    python scripts/bench_shapes.py --shapes "${SHAPES:-smollm2-135m,llama3.2-1b}" --lengths 8192,32768 \
      --dir "$work/shapes" --out "$out/shapes.jsonl" | tee -a "$out/shapes.txt"
  else  # on 2 CPU cores: that it runs, not what it measures
    python scripts/bench_shapes.py --shapes smollm2-135m --lengths 1024 --policies full,echokv --budget 128 -n 8 \
      --dir "$work/shapes" --out "$out/shapes.jsonl" | tee -a "$out/shapes.txt"
  fi
  cp -a "$out/." "$ret/"
  step "the 32K test stage's remaining cells (long-test-qwen-32768)"
  local gguf runs=$out/runs
  gguf=$(python -c "from kvlite import models as m; print(m.cache_dir() / m.PARTED_MODELS['qwen2.5-coder-0.5b'].file)")
  if [ "$kind" != cuda ]; then
    echo "skipped: a CPU build (days on a few cores; the stage is the GPU's)"
  elif [ -e "$out/long-test-done" ]; then
    echo "done in an earlier call: $runs/long-test-qwen-32768/samples.jsonl"
  elif [ ! -f "$gguf" ]; then
    echo "skipped: no Qwen2.5-Coder-0.5B GGUF at $gguf (it does not travel with the tree; docs/gpu.md)"
  else
    if [ ! -d "$runs" ]; then  # its records so far, and the pick its EchoKV and LAQ specs are spelled from
      mkdir -p "$runs/tune-default-4096"
      cp -a "$root/results-runs/long-test-qwen-32768" "$runs/"
      cp "$root/results-runs/tune-default-4096/pick.json" "$runs/tune-default-4096/"
    fi
    # news/: a gensim folder holding the corpus alone, which kvlite finds as it finds the wheel's
    export PYTHONPATH="$dir/news${PYTHONPATH:+:$PYTHONPATH}"
    # Stopped by SIGINT (results.py keeps every record written) well inside the call's 10 minutes, so
    # what it did reaches $OUT; the same command again resumes.
    if timeout -s INT -k 60 "${LONG_S:-300}" python scripts/results.py --stages long-test-qwen-32768 --long \
      -t "$(nproc)" --out "$runs" 2>&1 | tee -a "$out/long-test.txt"; then
      touch "$out/long-test-done"
    fi
  fi
  cp -a "$out/." "$ret/"
  [ -e "$out/tests-passed" ] || { echo "gpu_check: tests failed: $out/tests.txt"; exit 1; }
  step "done: $out/"
}

case "${1:-}" in
  --pack) [ $# = 2 ] || usage; pack "$2" ;;
  --rehearse)
    [ $# = 2 ] || usage
    dir=$(cd "$2" && pwd)
    base=$root/build/gpu-rehearse/base venv=$root/build/gpu-rehearse/venv out=$root/build/gpu-rehearse/out
    mkdir -p "$out"
    if [ ! -x "$base/bin/python" ]; then  # stands in for what the GPU machine has installed (with PyPI)
      python3 -m venv "$base"
      "$base/bin/pip" install -q numpy torch==2.13.0 pytest hypothesis
    fi
    # A clean venv every time; llama.cpp's build directory is kept while the sdist in DIR is the same
    # (its sha256), so a second rehearsal recompiles nothing (the first took 53 minutes beside a grid).
    sha=$(sha256sum "$dir/llama-cpp-python.tar.gz" | cut -c1-64)
    if [ "$(cat "$root/build/gpu-check-cpu/sdist.sha256" 2>/dev/null)" != "$sha" ]; then
      rm -rf "$root/build/gpu-check-cpu" && mkdir -p "$root/build/gpu-check-cpu"
      echo "$sha" > "$root/build/gpu-check-cpu/sdist.sha256"
    fi
    # A clean venv, so no stage is taken as done.
    rm -rf "$venv" "$out"/* "$root/build/gpu-check-cpu/out" && python3 -m venv "$venv"
    # Like `python3 -m venv --system-site-packages` on the GPU machine: the base's packages are visible.
    "$base/bin/python" -c "import site; print(site.getsitepackages()[0])" \
      > "$("$venv/bin/python" -c "import site; print(site.getsitepackages()[0])")/gpu-machine-base.pth"
    # In a network namespace of its own: no network at all, so any download would fail.
    unshare -n bash -c "$(declare -f step check); $(declare -p root LCP NEEDS); set -euo pipefail; \
      check '$dir' '$venv' cpu '$out'" 2>&1 | tee "$out/rehearse.log"
    ;;
  --* | "") usage ;;
  *)
    [ $# = 1 ] || usage
    dir=$(cd "$1" && pwd)
    out="${OUT:-$root/gpu-check}"
    mkdir -p "$out"
    exec > >(tee -a "$out/gpu_check.log") 2>&1
    step "GPU"
    nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader \
      || { echo "no nvidia-smi: not a CUDA machine"; exit 1; }
    nvcc --version | tail -1
    venv=$root/.venv-gpu
    py=${PYTHON:-python3}
    if [ ! -x "$venv/bin/python" ]; then
      "$py" -m venv --system-site-packages "$venv"
      # That machine's python3 is itself a venv (/opt/torch/.venv, with numpy and torch), whose
      # packages --system-site-packages does not reach: a .pth does.
      "$py" -c "import site; print(site.getsitepackages()[0])" \
        > "$("$venv/bin/python" -c "import site; print(site.getsitepackages()[0])")/gpu-machine-base.pth"
    fi
    check "$dir" "$venv" cuda "$out"
    ;;
esac
