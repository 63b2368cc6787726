"""scripts/results.py estimates a stage's time before it runs it and refuses one over LIMIT_H hours
without --long, in one line and before any model work (issue 57). No model is loaded here."""

from __future__ import annotations

import gzip
import json
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
LONG = "long-test-qwen-32768"


@pytest.fixture(scope="module")
def results():
    sys.path.insert(0, str(ROOT / "scripts"))
    import results

    return results


def runs_with(tmp_path: pathlib.Path, records: int, seconds: float) -> pathlib.Path:
    """A results-runs/ of the 32K stage's first `records` records, which took `seconds` here, and
    the pick its specs are spelled from."""
    runs = tmp_path / "runs"
    (runs / LONG).mkdir(parents=True)
    (runs / "tune-default-4096").mkdir()
    shutil.copy(ROOT / "results-runs" / "tune-default-4096" / "pick.json", runs / "tune-default-4096")
    lines = gzip.decompress((ROOT / "results-runs" / LONG / "samples.jsonl.gz").read_bytes()).splitlines()
    (runs / LONG / "samples.jsonl").write_bytes(b"\n".join(lines[:records]) + b"\n")
    (runs / "wall.json").write_text(json.dumps({LONG: seconds}))
    return runs


def test_the_estimate_is_cells_left_at_the_rate_measured(results, tmp_path, monkeypatch):
    runs = runs_with(tmp_path, 19, 19 * 3600.0)  # one sample's cells, an hour a cell (over their records' times)
    monkeypatch.setattr(results.results_stages, "RUNS", runs)
    stage = next(s for s in results.stages() if s.name == LONG)
    assert results.cells_left(stage, runs) == 684 - 19
    measured = results.rates(runs)
    assert measured == {("qwen2.5-coder-0.5b", 32768): 3600.0}
    assert results.estimate_s(stage, 665, measured) == 665 * 3600.0
    # another length scales in proportion from the nearest measured one; an unmeasured model has none
    half = results.Stage("half", {**stage.cfg, "lengths": [16384]})
    assert results.estimate_s(half, 10, measured) == 10 * 1800.0
    assert results.estimate_s(results.Stage("smol", {**stage.cfg, "models": ["default"]}), 10, measured) is None


def test_gate_refuses_a_long_stage_unless_long(results, tmp_path, monkeypatch, capsys):
    runs = runs_with(tmp_path, 19, 19 * 3600.0)
    monkeypatch.setattr(results.results_stages, "RUNS", runs)
    stage = next(s for s in results.stages() if s.name == LONG)
    refusal = results.gate([(stage, 665)], runs, long=False)
    assert refusal is not None and "\n" not in refusal
    assert LONG in refusal and "--long" in refusal and "scripts/gpu_check.sh" in refusal
    assert capsys.readouterr().out == f"{LONG}: 665 cells left, about 665 h here\n"
    assert results.gate([(stage, 665)], runs, long=True) is None


def test_a_complete_stage_costs_nothing(results, tmp_path, monkeypatch, capsys):
    """No cell left: not run (no model loaded), not gated, nothing printed."""
    runs = runs_with(tmp_path, 1, 0.0)  # its first record: the full cache's cell of single 0
    monkeypatch.setattr(results.results_stages, "RUNS", runs)
    monkeypatch.setattr(results, "run", lambda *a: pytest.fail("a complete stage was run"))
    cfg = {**next(s for s in results.stages() if s.name == LONG).cfg, "tasks": ["single"], "n": 1, "policies": ["full"]}
    monkeypatch.setattr(results, "stages", lambda quick=False: [results.Stage(LONG, cfg)])
    monkeypatch.setattr(results, "write_document", lambda *a: None)
    monkeypatch.setattr(sys, "argv", ["results.py", "--stages", LONG, "--out", str(runs)])
    results.main()
    assert capsys.readouterr() == ("", "")


def test_results_refuses_the_32k_stage_in_one_line_before_any_model_work(tmp_path):
    runs = runs_with(tmp_path, 19, 19 * 3600.0)
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "results.py"), "--stages", LONG, "--out", str(runs)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout == f"{LONG}: 665 cells left, about 665 h here\n"
    assert proc.stderr == (
        f"results.py: {LONG} (about 665 h here) would take over 2 h, so nothing ran; {LONG} runs "
        "in the GPU check's pack (scripts/gpu_check.sh, docs/gpu.md); --long runs it here anyway\n"
    )
    assert sorted(p.name for p in (runs / LONG).iterdir()) == ["samples.jsonl"]  # no grid started


def test_the_default_run_leaves_the_gpu_stage_out(results, monkeypatch):
    """`scripts/results.py` with no arguments never gates or runs a GPU stage; --list shows it."""
    asked = []
    monkeypatch.setattr(results.results_stages, "RUNS", results.results_stages.RUNS)  # main sets it
    monkeypatch.setattr(results, "gate", lambda left, runs, long: asked.extend(s.name for s, _ in left) or "stop")
    monkeypatch.setattr(sys, "argv", ["results.py"])
    with pytest.raises(SystemExit, match="stop"):
        results.main()
    assert not set(asked) & results.GPU_STAGES
    names = [s.name for s in results.stages()]
    assert set(results.GPU_STAGES) <= set(names)
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "results.py"), "--list"], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    listed = dict(line.split(": ", 1) for line in proc.stdout.splitlines())
    assert [n.split(" (")[0] for n in listed] == names
    assert f"{LONG} (GPU pack; here with --long)" in listed
