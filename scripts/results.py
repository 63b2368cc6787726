"""Regenerate docs/results.md and its plots under the evaluation protocol (docs/results.md,
"Protocol"): defaults picked on the tune split (scripts/pick_defaults.py), every claim reported on
the independent test split, with paired-bootstrap intervals.

Every stage is a resumable grid under results-runs/NAME; the records are committed, so a run that a
session's time limit cut short resumes in the next session. Stages run in priority order; each can
be run alone:

    .venv/bin/python scripts/results.py                        # every stage, then docs/results.md
    .venv/bin/python scripts/results.py --stages test-smol-4096 # one stage (names: --list)
    .venv/bin/python scripts/results.py --skip-run             # the document from what is there
    .venv/bin/python scripts/results.py --quick                # a smoke run of the script

Before any model work each stage's time is estimated from the time its model's cells took here
(estimate_s); a stage over LIMIT_H hours is refused unless --long is given. GPU_STAGES are not in
the default plan: scripts/gpu_check.sh runs them where a GPU is lent (docs/gpu.md).

The stages, as data, are in scripts/results_stages.py; the document is written by scripts/results_doc.py.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import results_stages  # noqa: E402
from results_doc import write_document  # noqa: E402
from results_stages import (  # noqa: E402
    GPU_STAGES,
    LIMIT_H,
    Stage,
    cells_left,
    estimate_s,
    hours,
    rates,
    read_walls,
    stages,
)

from kvlite.errors import KvliteError  # noqa: E402
from kvlite.eval.grid import Grid, GridConfig  # noqa: E402
from kvlite.eval.records import write_atomic  # noqa: E402
from kvlite.progress import progress_bar  # noqa: E402


def run(stage: Stage, out: pathlib.Path, threads: int | None) -> None:
    """Run the stage's unfinished cells, adding the time to its wall.json entry cell by cell, so a
    stage stopped and resumed across sessions counts every run (but a cell cut off midway)."""
    grid = Grid(GridConfig(out=str(out / stage.name), threads=threads, **stage.cfg))
    last = time.perf_counter()
    with progress_bar(grid.count_todo(), stage.name, unit="cell", lines=True) as bar:

        def cell_done(n: int) -> None:
            nonlocal last
            now = time.perf_counter()
            walls = read_walls(out)  # read again: another run of this script may share the folder
            walls[stage.name] = walls.get(stage.name, 0.0) + now - last
            write_atomic(out / "wall.json", json.dumps(walls, indent=1))
            last = now
            bar(n)

        grid.run(progress=cell_done)
    if grid.failures:
        print(f"{stage.name}: {grid.failures} failure(s), see {out / stage.name}/errors.jsonl", file=sys.stderr)


def gate(left: list[tuple[Stage, int]], runs: pathlib.Path, long: bool) -> str | None:
    """Print each stage's cells left (left: the stages to run, with theirs) and time here, on stdout
    (stderr is for what went wrong); the one-line refusal when any would take over LIMIT_H hours
    and long is not given (None: go ahead)."""
    measured = rates(runs) if left else {}
    over = []
    for s, n in left:
        est = estimate_s(s, n, measured)
        print(f"{s.name}: {n} cells left, {hours(est)}", flush=True)
        if est is not None and est > LIMIT_H * 3600:
            over.append((s.name, est))
    if not over or long:
        return None
    named = ", ".join(f"{name} ({hours(est)})" for name, est in over)
    gpu = [name for name, _ in over if name in GPU_STAGES]
    where = f"{', '.join(gpu)} runs in the GPU check's pack (scripts/gpu_check.sh, docs/gpu.md); " if gpu else ""
    it = "it" if len(over) == 1 else "them"
    return f"results.py: {named} would take over {LIMIT_H} h, so nothing ran; {where}--long runs {it} here anyway"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stages", default=None, help="comma-separated stage names (default: all, in priority order)")
    ap.add_argument("--list", action="store_true", help="list the stages, each with its cells left and time here")
    ap.add_argument("--long", action="store_true", help=f"run stages estimated over {LIMIT_H} h here too")
    ap.add_argument("--skip-run", action="store_true", help="only write docs/results.md from results-runs/")
    ap.add_argument("--quick", action="store_true", help="a smoke run of the script (minutes)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "results-runs"))
    args = ap.parse_args()
    runs = results_stages.RUNS = pathlib.Path(args.out)  # the stages read their picks there
    out = runs / ("quick" if args.quick else "")
    plan = stages(args.quick)
    if args.list:
        measured = rates(runs)
        for s in plan:
            n = cells_left(s, out)
            gpu = " (GPU pack; here with --long)" if s.name in GPU_STAGES else ""
            state = f"{n} cells left, {hours(estimate_s(s, n, measured))}" if n else "complete"
            print(f"{s.name}{gpu}: {state}")
        return
    wanted = set(args.stages.split(",")) if args.stages else {s.name for s in plan if s.name not in GPU_STAGES}
    unknown = wanted - {s.name for s in plan}
    if unknown:
        sys.exit(f"unknown stage(s) {', '.join(sorted(unknown))}: see --list")
    if not args.skip_run:
        left = [(s, n) for s in plan if s.name in wanted and (n := cells_left(s, out))]  # a complete stage: nothing
        refusal = gate(left, runs, args.long)
        if refusal:
            sys.exit(refusal)
        for stage, _ in left:
            run(stage, out, args.threads)
    write_document(out, read_walls(out), args.quick)


if __name__ == "__main__":
    try:
        main()
    except KvliteError as e:  # a missing model or native library: say what to do, not a traceback
        sys.exit(f"results.py: {e}")
    except KeyboardInterrupt:
        sys.exit("results.py: interrupted; the records written so far are kept, and a rerun resumes")
