# Sourced by the scripts that compile llama.cpp beside the wheel (vulkan_check.sh,
# build_llama_server.sh, cpu_variants.sh): one sdist, one build cache, one venv overlay.
#
# Builds live outside the clone, in $KVLITE_BUILDS (default ~/.cache/kvlite/builds), one folder
# per build and key. The key is the sha256 of a text naming everything that changes the binary:
# the caller's (llama-cpp-python's version, CMake flags, compiler, patches) and the recipe, which
# cached_build adds (the recipe function and this file, whose helpers it calls); that text is kept
# beside the build as KEY. A build is made in a temporary folder and renamed into
# place when it is whole, so a build cut short is never reused: the next run starts it again.

# The callers run with set -e and read a build's folder as $(cached_build ...): without this, bash
# drops -e inside the substitution and a recipe's failed command would not stop it.
shopt -s inherit_errexit
LCP=0.3.36  # the llama-cpp-python that scripts/setup.sh installs
KVLITE_BUILDS=${KVLITE_BUILDS:-${XDG_CACHE_HOME:-$HOME/.cache}/kvlite/builds}

lcp_sdist() {  # prints the path of llama-cpp-python's sdist, downloaded once into the cache
  local sdist=$KVLITE_BUILDS/llama_cpp_python-$LCP.tar.gz tmp
  if [ ! -f "$sdist" ]; then
    mkdir -p "$KVLITE_BUILDS"
    tmp=$(mktemp -d "$KVLITE_BUILDS/.sdist.XXXXXX")
    python3 -m pip download -q --no-deps --no-binary :all: -d "$tmp" "llama-cpp-python==$LCP" >&2
    mv "$tmp/llama_cpp_python-$LCP.tar.gz" "$sdist" && rm -rf "$tmp"
  fi
  echo "$sdist"
}

compiler_key() {  # the toolchain lines of a key
  echo "cc: $(cc --version | head -n1)"
  echo "c++: $(c++ --version | head -n1)"
  echo "cmake: $(cmake --version | head -n1)"
}

cached_build() {  # NAME KEY_TEXT FUNCTION: prints the build's folder, calling FUNCTION DIR to fill it if absent
  local name=$1 fn=$3 dir tmp text
  text="$2
recipe: $({ declare -f "$fn"; cat "${BASH_SOURCE[0]}"; } | sha256sum | cut -c1-16)"
  dir=$KVLITE_BUILDS/$name-$(printf '%s' "$text" | sha256sum | cut -c1-16)
  if [ ! -f "$dir/KEY" ]; then
    mkdir -p "$KVLITE_BUILDS"
    tmp=$(mktemp -d "$KVLITE_BUILDS/.$name.XXXXXX")
    # shellcheck disable=SC2064  # tmp is fixed now
    trap "rm -rf '$tmp'" EXIT
    echo "build: $name: no $dir yet, building it ($(date +%T))" >&2
    "$fn" "$tmp" >&2
    printf '%s\n' "$text" > "$tmp/KEY"
    chmod 755 "$tmp"  # mktemp's folder is the user's alone
    # a build finished meanwhile by another run under the same key is kept, this one dropped
    mv -T "$tmp" "$dir" 2>/dev/null || rm -rf "$tmp"
    trap - EXIT
    echo "build: $name kept in $dir ($(date +%T))" >&2
  fi
  echo "$dir"
}

venv_overlay() {  # SRC DEST: a copy of venv SRC made of hard links (seconds), its console scripts pointing at DEST
  local src=$1 dest=$2 f
  rm -rf "$dest"
  cp -al "$src" "$dest"
  find "$dest/bin" -maxdepth 1 -type f | while read -r f; do
    if head -c 200 "$f" | grep -q "^#!$src/bin/python"; then  # new files, not the hard links
      sed "1s|^#!$src/bin/python|#!$dest/bin/python|" "$f" > "$f.new" && chmod +x "$f.new" && mv "$f.new" "$f"
    fi
  done
}

swap_lib() {  # LIBDIR BUILT: every file LIBDIR/<name>.so* replaced by BUILT (wheels hold .so, .so.0 and .so.X.Y.Z as files)
  local libdir=$1 built=$2 base f
  base=$(basename "$built")
  base=${base%%.so*}.so
  rm -f "$libdir/$base" "$libdir/$base".*
  for f in "$base" "$(basename "$built")" "$(readelf -d "$built" | sed -n 's/.*SONAME.*\[\(.*\)\]/\1/p')"; do
    if [ ! -e "$libdir/$f" ]; then cp "$built" "$libdir/$f"; fi
  done
}
