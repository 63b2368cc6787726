"""Pick EchoKV's defaults on the tune split: a joint successive-halving search over anchors S,
lookahead T, smoothing, workspace B1 and aggregation, at budgets 128 and 256, against LAQ and
SnapKV on the same samples. Records go to results-runs/tune-* (committed; an interrupted search
resumes where it stopped). Test-split records are refused by kvlite.eval.tune.

    .venv/bin/python scripts/pick_defaults.py                 # SmolLM2, 4K prompts
    .venv/bin/python scripts/pick_defaults.py --quick         # a smoke run of the script
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvlite.eval import tune  # noqa: E402
from kvlite.eval.grid import Grid, GridConfig  # noqa: E402
from kvlite.eval.records import read_records  # noqa: E402
from kvlite.progress import progress_bar  # noqa: E402

SPACE = {
    "S": [1, 16],  # anchors: the last query alone (the paper) or the question's last tokens
    "T": [16, 24],
    "kernel": [7, 13],
    "B1": [512, 1024],
    "aggregate": ["max", "mean"],
}
BASELINES = ["full", "snapkv", "laq(T=24)"]
ROUNDS = [4, 8]  # samples per task in each round (sample i is the same in every round)
TASKS = ["single", "multikey", "twohop"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--budgets", default="128,256")
    ap.add_argument("--out", default=str(ROOT / "results-runs"))
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="two candidates, n=1, 1K prompts")
    args = ap.parse_args()
    budgets = [int(b) for b in args.budgets.split(",")]
    candidates = tune.joint_grid("echokv", SPACE)
    rounds, length, tasks = ROUNDS, args.length, TASKS
    name = f"tune-{args.model}-{length}"
    if args.quick:
        candidates, rounds, length, tasks, name = candidates[:2], [1, 2], 1024, ["single"], "quick-tune"
    out = pathlib.Path(args.out) / name

    def run_round(specs: list[str], n: int) -> list[dict]:
        cfg = GridConfig(models=[args.model], tasks=tasks, lengths=[length], n=n, split="tune",
                         policies=BASELINES + specs, budgets=budgets, threads=args.threads, out=str(out))  # fmt: skip
        grid = Grid(cfg)
        with progress_bar(grid.count_todo(), f"n={n}", unit="cell", lines=True) as bar:
            grid.run(progress=bar)
        return tune.tune_only(read_records(out))

    pick, standings = tune.successive_halving(run_round, candidates, rounds, budgets)
    records = read_records(out)
    result = {
        "pick": pick,
        "rounds": [[s.__dict__ for s in r] for r in standings],
        "versus": {b: tune.versus(records, pick, b, budgets).__dict__ for b in ("laq(T=24)", "snapkv") if b != pick},
        "model": args.model,
        "length": length,
        "budgets": budgets,
    }
    (out / "pick.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result["versus"], indent=1))
    print(f"pick: {pick}  (written to {out / 'pick.json'})")


if __name__ == "__main__":
    main()
