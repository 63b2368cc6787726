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


def test_serve_bench_shows_llama_server_beside_either_eviction_mode(tmp_path):
    """--plot-only reads the rows there: llama-server-full's whatever kvlite's --evict, kvlite's and
    llama-server-ram's (its RAM cache is kvlite's parked memory) of this one; and the ratio of
    kvlite's tok/s to llama-server-ram's at each N."""
    import json
    import sys

    common = {"cells": 4096, "budget": 256, "threads": 2, "schema": 2, "started": True, "turns": 3,
              "failed_turns": 0, "accuracy": 0.5, "tok_s": 1.0, "ttft_p50_s": 0.5, "ttft_p95_s": 0.9,
              "latency_p50_s": 1.0, "latency_p95_s": 2.0, "peak_rss_mb": 100.0,
              "first_prompt_tokens": [2100]}  # fmt: skip
    rows = [{"config": "llama-server-full", "clients": 1, "evict": "eager", **common},
            {"config": "llama-server-ram", "clients": 1, "evict": "lazy", **common, "tok_s": 2.0, "cache_ram_mib": 7},
            {"config": "llama-server-ram", "clients": 1, "evict": "eager", **common, "tok_s": 9.0, "cache_ram_mib": 1},
            {"config": "kvlite-laq", "clients": 1, "evict": "eager", **common, "tok_s": 7.0, "parked_mib": 0.0},
            {"config": "kvlite-laq", "clients": 1, "evict": "lazy", **common, "tok_s": 3.0, "parked_mib": 6.2},
            {"config": "kvlite-laq", "clients": 2, "evict": "lazy", **{**common, "schema": 1}},
            {"config": "kvlite-laq", "clients": 1, "evict": "lazy", "recall": 128, **common, "tok_s": 5.0,
             "parked_mib": 6.0}]  # fmt: skip
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_serve_vs_llama_server.py"), "--plot-only",
                           "--evict", "lazy", "-t", "2", "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()[1:]
    assert [line.split()[:3] for line in lines[:3]] == [["kvlite-laq", "1", "3.00"], ["llama-server-ram", "1", "2.00"],
                                                        ["llama-server-full", "1", "1.00"]]  # fmt: skip
    assert lines[0].split()[8] == "6.2" and lines[1].split()[8] == "7.0"  # host memory: parked, the RAM cache
    assert lines[3:] == ["N=1   kvlite-laq tok/s / llama-server-ram's: 1.50x"], lines
    assert (tmp_path / "serve_vs_llama_server.png").stat().st_size > 0
    # --recall N: kvlite's rows of that recall only, llama-server-full's still
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_serve_vs_llama_server.py"), "--plot-only",
                           "--evict", "lazy", "--recall", "128", "-t", "2", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    shown = [line.split()[:3] for line in proc.stdout.splitlines()[1:3]]
    assert shown == [["kvlite-laq", "1", "5.00"], ["llama-server-full", "1", "1.00"]], proc.stdout


def test_results_script_says_in_one_line_that_the_native_library_is_missing(tmp_path):
    """scripts/results.py runs the kvlite beside it: a tree without its native library built is a
    one-line error that says how to build it, not a traceback, and no record or page is written."""
    import shutil
    import sys

    shutil.copytree(ROOT / "kvlite", tmp_path / "kvlite", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    (tmp_path / "scripts").mkdir()
    for script in (ROOT / "scripts").glob("results*.py"):  # results.py and its stages and document
        shutil.copy(script, tmp_path / "scripts")
    proc = subprocess.run([sys.executable, str(tmp_path / "scripts" / "results.py"), "--quick", "--out",
                           str(tmp_path / "out")], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "native library" in proc.stderr
    assert not list((tmp_path / "out").rglob("*.jsonl")) and not list((tmp_path / "out").rglob("*.md"))
