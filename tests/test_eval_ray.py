"""`kvlite eval --ray` on a local Ray instance (this machine's CPUs): the records equal a local
run's cell for cell, an interrupted grid resumes in the other mode without redoing a cell, and a
worker killed during a unit has the unit retried."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from conftest import run_cli
from test_eval_grid import grid_cfg, rows_without_time, stop_after, uninterrupted  # noqa: F401 - a fixture

from kvlite.eval import distributed
from kvlite.eval.grid import Grid
from kvlite.eval.records import read_records

pytestmark = pytest.mark.slow
CELLS = 21  # grid_cfg: 3 samples x (full + 3 policies x 2 budgets)


def lines(out) -> int:
    return sum(1 for _ in (out / "samples.jsonl").open())


def test_ray_records_equal_a_local_run(tiny_paths, tmp_path, uninterrupted):  # noqa: F811
    nodes = distributed.run(Grid(grid_cfg(tiny_paths, tmp_path, ray="local")))
    assert lines(tmp_path) == CELLS
    assert rows_without_time(tmp_path) == rows_without_time(uninterrupted)
    assert sum(len(records) for records in nodes.values()) == CELLS


@pytest.mark.parametrize("first,then", [("ray", "local"), ("local", "ray")])
def test_an_interrupted_grid_resumes_in_the_other_mode(tiny_paths, tmp_path, uninterrupted, first, then):  # noqa: F811
    def run(mode: str, progress=None) -> None:
        grid = Grid(grid_cfg(tiny_paths, tmp_path, ray="local" if mode == "ray" else None))
        distributed.run(grid, progress) if mode == "ray" else grid.run(progress)

    with pytest.raises(KeyboardInterrupt):
        run(first, stop_after(5))
    assert 0 < len(read_records(tmp_path)) < CELLS
    run(then)
    assert lines(tmp_path) == CELLS  # nothing finished was redone
    assert rows_without_time(tmp_path) == rows_without_time(uninterrupted)


def unit_workers() -> list[int]:
    """Processes running a unit now (Ray titles a busy worker ray::<task>)."""
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    if f.read().startswith(b"ray::_unit"):
                        pids.append(int(d))
            except OSError:
                pass
    return pids


def test_a_worker_killed_during_a_unit_has_the_unit_retried(tiny_paths, tmp_path, uninterrupted):  # noqa: F811
    killed = []
    stop = threading.Event()

    def killer() -> None:
        while not stop.is_set() and not killed:
            for pid in unit_workers():
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                break
            time.sleep(0.002)

    watcher = threading.Thread(target=killer, daemon=True)
    watcher.start()
    try:
        distributed.run(Grid(grid_cfg(tiny_paths, tmp_path, ray="local", ray_retries=2)))
    finally:
        stop.set()
        watcher.join()
    assert killed, "no unit was caught running: the test did not kill anything"
    assert not (tmp_path / "errors.jsonl").exists() or not (tmp_path / "errors.jsonl").read_text().strip()
    assert lines(tmp_path) == CELLS  # every cell once: the dead worker's unit was redone whole, once
    assert rows_without_time(tmp_path) == rows_without_time(uninterrupted)


def test_cli_eval_on_ray(tiny_paths, tmp_path):
    out = tmp_path / "out"
    proc = run_cli("eval", "-m", tiny_paths["llama"], "--tasks", "single", "--lengths", "300", "-n", "2",
                   "--policies", "full,snapkv", "--budgets", "40", "--n-predict", "4", "--out", str(out),
                   "--ray", "--no-plots")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "ray node" in proc.stderr and "4 cells" in proc.stderr.split("ray node")[1]
    assert (out / "summary.md").exists() and lines(out) == 4


def test_without_ray_the_flag_says_how_to_install_it(tiny_paths, tmp_path):
    """As on a machine without the extra: `import ray` fails (sys.modules entry None)."""
    args = ["eval", "-m", tiny_paths["llama"], "--tasks", "single", "--lengths", "300", "-n", "1",
            "--policies", "full", "--out", str(tmp_path / "out"), "--ray"]  # fmt: skip
    code = f"import sys; sys.modules['ray'] = None; from kvlite.cli import main; sys.exit(main({args!r}))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "pip install 'kvlite[ray]'" in proc.stderr.strip().splitlines()[-1]
