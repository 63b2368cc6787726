"""Pick the N that `kvlite chat --recall` and `kvlite serve --recall` take when given no number
(issue 61), on the tune split. Reads the stage scripts/results.py runs (results-runs/recall-tune-
smol-1024: LAQ and EchoKV in lazy mode at 256 cells, with recall 0, 32, 64, 128 and 256);
test-split records are refused by kvlite.eval.tune. The rule, fixed before the data:
- gain(N) = recall N - no recall, averaged over LAQ and EchoKV within each conversation, then a
  paired bootstrap over conversations (a conversation's cells are not independent of each other);
- the pick is the smallest N whose gain has a 95% interval above 0 and which the N of the best
  mean gain does not beat (best - N, paired the same way, has an interval reaching 0 or below);
- if no N's gain is above 0, none is picked and --recall needs a number.
Recall stays off by default whatever the pick: it adds up to N cells to what decode attends,
beyond the budget the user set.

--queries reads the second stage (results-runs/recall-queries-tune-smol-1024: LAQ and EchoKV in
eager mode, recall 32, scoring with the turn's queries alone or with the eviction's lookahead
queries beside them, recall_lookahead=0/1). The rule, fixed before the data: the lookahead's
queries join the turn's (kvlite.evict.RECALL_LOOKAHEAD) if lookahead - turn, averaged over the two
policies within a conversation and bootstrapped over conversations, has its interval above 0.

    .venv/bin/python scripts/pick_recall.py            # writes pick.json beside the records
    .venv/bin/python scripts/pick_recall.py --queries  # the same for the queries
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from results_stages import RECALL_TUNE as RECALLS  # noqa: E402  (the N its stage ran)

from kvlite.eval import report, tune  # noqa: E402
from kvlite.eval.records import read_records  # noqa: E402
from kvlite.eval.specs import spec_name  # noqa: E402

POLICIES = ("laq", "echokv")


def by_recall(records: list[dict]) -> dict[int, dict]:
    """recall N -> {conversation: mean score}, lazy cells that every N ran."""
    return report.per_conversation(records, lambda r: _arm(r, r.get("recall", 0) if r.get("evict") == "lazy" else None),
                                   (0, *RECALLS))  # fmt: skip


def by_queries(records: list[dict]) -> dict[int, dict]:
    """recall_lookahead (0, 1) -> {conversation: mean score}, eager cells with recall both ran."""
    return report.per_conversation(records, lambda r: _arm(r, int(r["recall_lookahead"]) if r.get("recall") else None),
                                   (0, 1))  # fmt: skip


def _arm(r: dict, arm: int | None) -> int | None:
    """The record's arm, for the policies the pick is made on."""
    return arm if spec_name(r["policy"]) in POLICIES else None


def pick_queries(runs: pathlib.Path) -> None:
    means = by_queries(tune.tune_only(read_records(runs)))
    gain = report.arm_difference(means, 1, 0)
    result = {"lookahead": bool(gain.lo > 0), "lookahead_minus_turn": gain.__dict__, "conversations": len(means[0])}
    (runs / "pick.json").write_text(json.dumps(result, indent=1))
    print(f"lookahead and turn - turn alone: {gain.fmt()}")
    print(f"pick: RECALL_LOOKAHEAD = {result['lookahead']}  (written to {runs / 'pick.json'})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", default=None, help="the stage's records (default: the one the mode reads)")
    ap.add_argument("--queries", action="store_true", help="choose recall's queries, not N")
    args = ap.parse_args()
    stage = "recall-queries-tune-smol-1024" if args.queries else "recall-tune-smol-1024"
    runs = pathlib.Path(args.runs or ROOT / "results-runs" / stage)
    if args.queries:
        pick_queries(runs)
        return
    means = by_recall(tune.tune_only(read_records(runs)))
    gains = {n: report.arm_difference(means, n, 0) for n in RECALLS}
    best = max(RECALLS, key=lambda n: gains[n].mean)
    behind = {n: report.arm_difference(means, best, n) for n in RECALLS if n != best}
    pick = next((n for n in RECALLS if gains[n].lo > 0 and (n == best or behind[n].lo <= 0)), None)
    result = {
        "pick": pick,
        "gain": {n: g.__dict__ for n, g in gains.items()},
        "best": best,
        "best_minus": {n: d.__dict__ for n, d in behind.items()},
        "conversations": len(means[0]),
    }
    (runs / "pick.json").write_text(json.dumps(result, indent=1))
    for n in RECALLS:
        extra = f"; best ({best}) - {n}: {behind[n].fmt()}" if n in behind else " (best)"
        print(f"recall {n:>3} - none: {gains[n].fmt()}{extra}")
    print(f"pick: --recall takes {pick} without a number  (written to {runs / 'pick.json'})")


if __name__ == "__main__":
    main()
