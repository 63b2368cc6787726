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
from collections import defaultdict

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvlite.eval import report, stats, tune  # noqa: E402
from kvlite.eval.records import read_records  # noqa: E402
from kvlite.eval.specs import spec_name  # noqa: E402

POLICIES = ("laq", "echokv")
RECALLS = (32, 64, 128, 256)  # as scripts/results.py's RECALL_TUNE


def per_conversation(records: list[dict], arm, arms: tuple) -> dict:
    """arm -> {conversation: mean score over the policies}, over the cells every arm ran. arm(r): the
    record's arm (its recall N, or whether it used the lookahead's queries), None for no arm."""
    by: dict = {}
    for r in records:
        if "score" in r and spec_name(r["policy"]) in POLICIES and (a := arm(r)) is not None:
            by[(a, report.sample_key(r), spec_name(r["policy"]))] = r["score"]
    cells = set.intersection(*({k[1:] for k in by if k[0] == a} for a in arms))
    out: dict = {}
    for a in arms:
        scores = defaultdict(list)
        for sample, policy in cells:
            scores[sample].append(by[(a, sample, policy)])
        out[a] = {s: float(np.mean(v)) for s, v in scores.items()}
    return out


def by_recall(records: list[dict]) -> dict[int, dict]:
    """recall N -> {conversation: mean score}, lazy cells that every N ran."""
    return per_conversation(records, lambda r: r.get("recall", 0) if r.get("evict") == "lazy" else None, (0, *RECALLS))


def by_queries(records: list[dict]) -> dict[int, dict]:
    """recall_lookahead (0, 1) -> {conversation: mean score}, eager cells with recall both ran."""
    return per_conversation(records, lambda r: int(r["recall_lookahead"]) if r.get("recall") else None, (0, 1))


def pick_queries(runs: pathlib.Path) -> None:
    means = by_queries(tune.tune_only(read_records(runs)))
    gain = difference(means, 1, 0)
    result = {"lookahead": bool(gain.lo > 0), "lookahead_minus_turn": gain.__dict__, "conversations": len(means[0])}
    (runs / "pick.json").write_text(json.dumps(result, indent=1))
    print(f"lookahead and turn - turn alone: {gain.fmt()}")
    print(f"pick: RECALL_LOOKAHEAD = {result['lookahead']}  (written to {runs / 'pick.json'})")


def difference(means: dict[int, dict], a: int, b: int) -> stats.Interval:
    keys = sorted(means[a])
    return stats.paired_difference([means[a][k] for k in keys], [means[b][k] for k in keys])


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
    gains = {n: difference(means, n, 0) for n in RECALLS}
    best = max(RECALLS, key=lambda n: gains[n].mean)
    behind = {n: difference(means, best, n) for n in RECALLS if n != best}
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
