"""Whole-process time to the first token of an evicting policy against the full cache, and the
eviction's share of the prefill, both from one run: `kvlite generate -n 1 --json` on the same
prose prompt, the two commands alternating (pairs), each in its own process, the machine otherwise
idle. A pair's ratio is its policy run's wall time over its full run's; the median over pairs is
reported, with the range. The eviction's share is the policy run's own timers (evict_s /
prefill_s). The peak RSS of each process is read from /proc (bench_memory.generate_peak).

usage: python scripts/bench_ttft.py [--tokens 8192,16384] [-m MODEL] [--policy echokv]
       [--budget-pct 2] [--pairs 3] [-t THREADS] [--json]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from bench_memory import generate_peak, prose_tokens  # noqa: E402

from kvlite.engine import Model  # noqa: E402
from kvlite.models import resolve_model  # noqa: E402


def timed(prompt_file: str, *flags: str) -> dict:
    t0 = time.perf_counter()
    r = generate_peak(prompt_file, "-n", "1", *flags)
    r["wall_s"] = time.perf_counter() - t0
    return r


def bench(model_arg: str | None, n_tokens: int, policy: str, budget: int, pairs: int, threads: int) -> dict:
    path = resolve_model(model_arg)
    model = Model(path)
    try:
        text = model.detokenize(prose_tokens(model, n_tokens))
        n_prompt = len(model.tokenize(text))
    finally:
        model.close()
    common = ["-m", str(path), "-t", str(threads)]
    rows = []
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
        f.write(text)
        f.flush()
        for i in range(pairs):
            full = timed(f.name, *common)
            evict = timed(f.name, *common, "--policy", policy, "--budget", str(budget))
            t = evict["timings"]
            rows.append(dict(pair=i, full_wall_s=full["wall_s"], policy_wall_s=evict["wall_s"],
                             ttft_ratio=evict["wall_s"] / full["wall_s"], prefill_s=t["prefill_s"],
                             evict_s=t["evict_s"], evict_share=t["evict_s"] / t["prefill_s"],
                             full_peak_mb=full["peak_rss_mb"], policy_peak_mb=evict["peak_rss_mb"],
                             peak_ratio=evict["peak_rss_mb"] / full["peak_rss_mb"]))  # fmt: skip
            print(f"  pair {i + 1}/{pairs}: full {full['wall_s']:.1f} s, {policy} {evict['wall_s']:.1f} s "
                  f"({rows[-1]['ttft_ratio']:.3f}x), eviction {t['evict_s']:.2f} s of a {t['prefill_s']:.1f} s "
                  f"prefill ({100 * rows[-1]['evict_share']:.2f}%)", file=sys.stderr, flush=True)  # fmt: skip

    def summary(key: str) -> dict:
        values = [r[key] for r in rows]
        return dict(median=statistics.median(values), min=min(values), max=max(values))

    return dict(model=path.name, prompt_tokens=n_prompt, policy=policy, budget=budget, pairs=rows,
                ttft_ratio=summary("ttft_ratio"), evict_share=summary("evict_share"),
                evict_s=summary("evict_s"), peak_ratio=summary("peak_ratio"))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="8192,16384", help="prompt lengths, comma-separated")
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--policy", default="echokv")
    ap.add_argument("--budget-pct", type=float, default=2.0, help="budget as a percent of the prompt")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    for n in (int(x) for x in args.tokens.split(",")):
        budget = max(16, int(n * args.budget_pct / 100))
        r = bench(args.model, n, args.policy, budget, args.pairs, args.threads)
        if args.json:
            print(json.dumps(r), flush=True)
            continue
        tt, share, peak = r["ttft_ratio"], r["evict_share"], r["peak_ratio"]
        print(f"{r['model']} {r['prompt_tokens']} tokens, {r['policy']} to {r['budget']} cells, {args.pairs} pairs: "
              f"time to first token {tt['median']:.3f}x the full cache's ({tt['min']:.3f}-{tt['max']:.3f}); "
              f"eviction {100 * share['median']:.2f}% of the prefill ({100 * share['min']:.2f}-"
              f"{100 * share['max']:.2f}%, {r['evict_s']['median']:.2f} s); peak RSS {peak['median']:.3f}x",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
