"""The shell scripts parse, and refuse a wrong call with their usage and exit 2, before touching
anything (the GPU check is rehearsed by hand: docs/gpu.md)."""

from __future__ import annotations

import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPTS = sorted((ROOT / "scripts").glob("*.sh"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_parses(script):
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("args", [[], ["--pack"], ["--rehearse"], ["--bogus", "x"], ["a", "b"]])
def test_gpu_check_usage(args):
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), *args], capture_output=True, text=True,
                          timeout=30)  # fmt: skip
    assert proc.returncode == 2 and "usage: bash scripts/gpu_check.sh" in proc.stderr, proc.stderr
