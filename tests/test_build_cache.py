"""scripts/build_cache.sh, the build cache of the Vulkan check, llama-server and the CPU variants
(issue 57): a build is reused only under its own key, and one cut short or failed is never reused."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parent.parent
# A recipe that counts its runs in $COUNT, writes half its output, then fails in a command that
# is not its last, dies at once (SIGKILL: no trap runs, as when a machine stops), or finishes.
RECIPE = """
make_it() {
  echo run >> "$COUNT"
  echo half > "$1/out"
  case "$HOW" in
    fail) false ;;
    die) kill -9 "$BASHPID" ;;
  esac
  echo whole > "$1/out"
}
"""


def cached(builds: pathlib.Path, key: str, how: str = "finish", recipe: str = RECIPE) -> subprocess.CompletedProcess:
    # as the scripts call it: set -e, then the folder read from a command substitution
    call = f'dir=$(cached_build thing "{key}" make_it)\necho "$dir"'
    script = f'set -euo pipefail; . "{ROOT}/scripts/build_cache.sh"\n{recipe}\n{call}'
    env = dict(os.environ, KVLITE_BUILDS=str(builds), COUNT=str(builds.parent / "count"), HOW=how)
    return subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60)


def runs(builds: pathlib.Path) -> int:
    count = builds.parent / "count"
    return len(count.read_text().splitlines()) if count.exists() else 0


def finished(builds: pathlib.Path) -> list[str]:
    return sorted(p.name for p in builds.iterdir() if not p.name.startswith("."))


def test_a_build_is_reused_under_its_key_and_made_again_under_another(tmp_path):
    builds = tmp_path / "builds"
    first = cached(builds, "version 1\nflags -DX=ON")
    assert first.returncode == 0, first.stderr
    folder = pathlib.Path(first.stdout.strip())
    assert (folder / "out").read_text() == "whole\n"
    key = (folder / "KEY").read_text().splitlines()
    assert key[:2] == ["version 1", "flags -DX=ON"] and re.fullmatch("recipe: [0-9a-f]{16}", key[2]) and len(key) == 3
    assert oct(folder.stat().st_mode & 0o777) == "0o755"
    again = cached(builds, "version 1\nflags -DX=ON")
    assert again.stdout == first.stdout and runs(builds) == 1 and "building" not in again.stderr
    other = cached(builds, "version 1\nflags -DX=OFF")
    assert other.returncode == 0 and other.stdout != first.stdout and runs(builds) == 2
    assert len(finished(builds)) == 2


def test_a_changed_recipe_is_a_new_key(tmp_path):
    builds = tmp_path / "builds"
    first = cached(builds, "k")
    changed = cached(builds, "k", recipe=RECIPE.replace('echo whole > "$1/out"', 'echo whole, again > "$1/out"'))
    assert first.returncode == changed.returncode == 0 and first.stdout != changed.stdout and runs(builds) == 2


def test_a_build_that_fails_leaves_nothing(tmp_path):
    builds = tmp_path / "builds"
    failed = cached(builds, "k", how="fail")
    assert failed.returncode != 0 and failed.stdout == ""
    assert finished(builds) == [] and [p.name for p in builds.iterdir()] == []  # the temporary folder too
    assert cached(builds, "k").returncode == 0 and runs(builds) == 2


def test_a_build_cut_short_is_never_reused(tmp_path):
    builds = tmp_path / "builds"
    cut = cached(builds, "k", how="die")
    assert cut.returncode == 137 and cut.stdout == ""
    assert finished(builds) == []  # only its temporary folder, which no lookup reads
    whole = cached(builds, "k")
    assert whole.returncode == 0 and runs(builds) == 2
    assert (pathlib.Path(whole.stdout.strip()) / "out").read_text() == "whole\n"


def test_swap_lib_replaces_every_name_of_a_library(tmp_path):
    """A wheel holds libx.so, libx.so.0 and libx.so.0.1.2 as three files: each becomes the new
    build, and a library the wheel lacks arrives under its file name, its soname and the bare .so."""
    lib, built = tmp_path / "lib", tmp_path / "built"
    lib.mkdir(), built.mkdir()
    for name in ("libx.so", "libx.so.0", "libx.so.0.1.2", "liby.so"):
        (lib / name).write_text("old")
    (tmp_path / "x.c").write_text("int x(void) { return 1; }\n")
    for name, soname in (("libx.so.0.1.3", "libx.so.0"), ("libz.so.0.1.3", "libz.so.0")):
        subprocess.run(["cc", "-shared", "-fPIC", f"-Wl,-soname,{soname}", "-o", built / name, tmp_path / "x.c"],
                       check=True)  # fmt: skip
        script = f'. "{ROOT}/scripts/build_cache.sh"; set -euo pipefail; swap_lib "{lib}" "{built / name}"'
        subprocess.run(["bash", "-c", script], check=True, timeout=60)
    new = (built / "libx.so.0.1.3").read_bytes()
    assert sorted(p.name for p in lib.iterdir()) == [
        "libx.so", "libx.so.0", "libx.so.0.1.3", "liby.so", "libz.so", "libz.so.0", "libz.so.0.1.3"
    ]  # fmt: skip
    assert all((lib / n).read_bytes() == new for n in ("libx.so", "libx.so.0", "libx.so.0.1.3"))
    assert (lib / "liby.so").read_text() == "old"
