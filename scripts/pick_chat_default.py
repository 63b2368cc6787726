"""Pick `kvlite chat`'s defaults on the tune split (issue 11): the eviction mode (eager or lazy)
and whether the hybrid (KVzip for turns without a question, EchoKV's lookahead for turns with one)
pays enough to be the policy `kvlite chat --budget N` uses when no --policy is given.

Reads the multi-turn tune stage that scripts/results.py runs (results-runs/chat-tune-smol-1024);
test-split records are refused by kvlite.eval.tune. The rules, fixed before the data:
- lazy becomes the default mode if lazy - eager, paired over (policy, sample, budget) for every
  chat policy, has a 95% interval above 0; otherwise eager (today's behaviour) stays;
- the hybrid becomes the policy `kvlite chat --budget N` uses without --policy if, in the chosen
  mode, hybrid - echokv and hybrid - kvzip both have intervals above 0; otherwise --policy stays
  required with --budget (the standings are printed for docs/policies.md).

    .venv/bin/python scripts/pick_chat_default.py            # writes pick.json beside the records
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from results_stages import BUDGETS  # noqa: E402
from results_stages import CHAT as POLICIES  # noqa: E402  (the chat stages' policies, which it picks among)

from kvlite.eval import report, stats, tune  # noqa: E402
from kvlite.eval.records import read_records  # noqa: E402


def mode_difference(records: list[dict]) -> stats.Interval:
    """lazy - eager over every chat policy and budget, per conversation (report.mode_difference), on
    tune records alone."""
    return report.mode_difference(tune.tune_only(records), tuple(BUDGETS))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", default=str(ROOT / "results-runs" / "chat-tune-smol-1024"))
    args = ap.parse_args()
    runs = pathlib.Path(args.runs)
    records = tune.tune_only(read_records(runs))
    lazy_gain = mode_difference(records)
    mode = "lazy" if lazy_gain.lo > 0 else "eager"
    standings = tune.rank(records, [tune.spec(p, evict=mode) for p in POLICIES], BUDGETS)
    hybrid = tune.spec("hybrid", evict=mode)
    versus = {b: tune.versus(records, hybrid, tune.spec(b, evict=mode), BUDGETS) for b in ("echokv", "kvzip")}
    hybrid_pays = all(v.lo > 0 for v in versus.values())
    result = {
        "mode": mode,
        "policy": "hybrid" if hybrid_pays else None,
        "lazy_minus_eager": lazy_gain.__dict__,
        "hybrid_pays": hybrid_pays,
        "hybrid_minus": {b: v.__dict__ for b, v in versus.items()},
        "standings": [s.__dict__ for s in standings],
        "budgets": BUDGETS,
    }
    (runs / "pick.json").write_text(json.dumps(result, indent=1))
    print(f"lazy - eager: {lazy_gain.fmt()}")
    for b, v in versus.items():
        print(f"hybrid - {b} ({mode}): {v.fmt()}")
    for s in standings:
        print(f"  {s.spec:24} {s.score:.3f}  (n = {s.n})")
    default = "--policy hybrid by default" if hybrid_pays else "--policy stays required with --budget"
    print(f"pick: --evict {mode}; {default}  (written to {runs / 'pick.json'})")


if __name__ == "__main__":
    main()
