"""KVzip's scoring cost against prefill on SmolLM2, measured in one run: read a prompt with the
full cache (prefill), then read it again under kvzip and time the eviction alone (the
reconstruction passes, the scores, the cut). KVzip's authors (via kvpress) state 2-3x prefill.

    .venv/bin/python scripts/bench_kvzip.py [--lengths 1024,2048] [--repeat-chunk 512] [-t 2]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvlite.engine import Model  # noqa: E402
from kvlite.eval.haystack import haystack  # noqa: E402
from kvlite.models import default_model_path  # noqa: E402
from kvlite.policies import KVzip, make_policy  # noqa: E402
from kvlite.runner import Runner  # noqa: E402
from kvlite.settings import RunSettings, plan_context  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="1024,2048")
    ap.add_argument("--repeat-chunk", type=int, default=KVzip.repeat_chunk)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    model = Model(default_model_path())
    text = "\n\n".join(haystack(20_000))
    rows = []
    for n in map(int, args.lengths.split(",")):
        tokens = model.tokenize(text)[:n]
        times = {}
        for name in ("full", "kvzip"):
            params = {} if name == "full" else dict(budget=args.budget, repeat_chunk=args.repeat_chunk)
            policy = make_policy(name, **params)
            n_ctx, chunk = plan_context(policy, 0, n, 1, 512)
            runner = Runner(model, policy, RunSettings(n_ctx=n_ctx, chunk=chunk, n_threads=args.threads))
            try:
                runner.feed(tokens)
                t = runner.timings
                times[name] = (t.prefill_s - t.evict_s, t.evict_s, runner.workspace_forward_passes)
            finally:
                runner.close()
        prefill = times["full"][0]
        score = times["kvzip"][1]
        rows.append(dict(tokens=n, prefill_s=prefill, kvzip_scoring_s=score, ratio=score / prefill,
                         reconstruction_batches=times["kvzip"][2]))  # fmt: skip
        print(f"{n:6d} tokens: prefill {prefill:6.2f} s, kvzip scoring {score:6.2f} s = {score / prefill:.2f}x "
              f"prefill (repeat chunk {args.repeat_chunk}, {times['kvzip'][2]} reconstruction batches)")  # fmt: skip
    if args.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
