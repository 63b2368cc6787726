"""Whole-process time to the first token of evicting policies against the full cache, and the
eviction's share of the prefill, both from one run: `kvlite generate -n 1 --json` on the same
prose prompt, the full cache and each policy in turn (rounds), each in its own process, the machine
otherwise idle. A round's ratio is the policy run's wall time over the round's full run's; the
median over rounds is reported, with the range. The eviction's share is the policy run's own
timers: the eviction over the prompt's reading before it. The peak RSS of each process is read
from /proc (bench_memory.generate_peak). On a shared 2-core machine single runs vary by up to ~10%:
the share is the steadier number, and enough rounds are needed for a ratio near 1.05x. After each
policy run one fixed pooling call is timed here (the kernel probe): the machine's speed just after
that run's eviction, which moves by a third between minutes (docs/cache.md).

usage: python scripts/bench_ttft.py [--tokens 8192,16384] [-m MODEL]
       [--policies "echokv,echokv --proposals 6"] [--budget-pct 2] [--rounds 3] [-t THREADS] [--json]
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
import numpy as np  # noqa: E402
from bench_memory import generate_peak, prose_tokens  # noqa: E402

from kvlite.engine import Model  # noqa: E402
from kvlite.models import resolve_model  # noqa: E402
from kvlite.native import native  # noqa: E402


def timed(prompt_file: str, *flags: str) -> dict:
    t0 = time.perf_counter()
    r = generate_peak(prompt_file, "-n", "1", *flags)
    r["wall_s"] = time.perf_counter() - t0
    return r


def kernel_probe_ms(threads: int) -> float:
    """The machine's speed now: one fixed pooling call (a Qwen layer's 96 proposals over 16K f16
    keys, random), best of three."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 14, 96, 64), dtype=np.float32)
    k = rng.standard_normal((1, 2, 16384, 64)).astype(np.float16)
    kernels = native()
    kernels.set_threads(threads)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        kernels.attn_pool(q, k)
        times.append(time.perf_counter() - t0)
    kernels.release()
    return 1000 * min(times)


def bench(model_arg: str | None, n_tokens: int, policies: list[str], budget: int, rounds: int, threads: int) -> dict:
    """rounds x (the full cache, then each policy in turn); each policy's ratios are to its round's
    full run. A policy is a name and its flags ("echokv --proposals 6")."""
    path = resolve_model(model_arg)
    model = Model(path)
    try:
        text = model.detokenize(prose_tokens(model, n_tokens))
        n_prompt = len(model.tokenize(text))
    finally:
        model.close()
    common = ["-m", str(path), "-t", str(threads)]
    rows: dict[str, list[dict]] = {p: [] for p in policies}
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
        f.write(text)
        f.flush()
        for i in range(rounds):
            full = timed(f.name, *common)
            for spec in policies:
                name, *flags = spec.split()
                run = timed(f.name, *common, "--policy", name, "--budget", str(budget), *flags)
                probe_ms = kernel_probe_ms(threads)
                t = run["timings"]
                read_s = t["prefill_s"] - t["evict_s"]  # the runner's prefill timer holds the eviction
                row = dict(round=i, full_wall_s=full["wall_s"], policy_wall_s=run["wall_s"],
                           ttft_ratio=run["wall_s"] / full["wall_s"], prefill_s=read_s, evict_s=t["evict_s"],
                           evict_share=t["evict_s"] / read_s, full_peak_mb=full["peak_rss_mb"],
                           policy_peak_mb=run["peak_rss_mb"],
                           peak_ratio=run["peak_rss_mb"] / full["peak_rss_mb"], kernel_probe_ms=probe_ms)  # fmt: skip
                rows[spec].append(row)
                print(f"  round {i + 1}/{rounds}: full {full['wall_s']:.1f} s, {spec} {run['wall_s']:.1f} s "
                      f"({row['ttft_ratio']:.3f}x), eviction {t['evict_s']:.2f} s after a {read_s:.1f} s "
                      f"prefill ({100 * row['evict_share']:.2f}%); kernel probe {probe_ms:.0f} ms",
                      file=sys.stderr, flush=True)  # fmt: skip

    def summary(spec: str, key: str) -> dict:
        values = [r[key] for r in rows[spec]]
        return dict(median=statistics.median(values), min=min(values), max=max(values))

    keys = ("ttft_ratio", "evict_share", "evict_s", "peak_ratio")
    return dict(model=path.name, prompt_tokens=n_prompt, budget=budget, rounds=rounds,
                policies={p: dict(runs=rows[p], **{k: summary(p, k) for k in keys}) for p in policies})  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="8192,16384", help="prompt lengths, comma-separated")
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--policies", default="echokv", help="comma-separated, each a name and its flags")
    ap.add_argument("--budget-pct", type=float, default=2.0, help="budget as a percent of the prompt")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    policies = [p.strip() for p in args.policies.split(",")]
    for n in (int(x) for x in args.tokens.split(",")):
        budget = max(16, int(n * args.budget_pct / 100))
        r = bench(args.model, n, policies, budget, args.rounds, args.threads)
        if args.json:
            print(json.dumps(r), flush=True)
            continue
        for spec, p in r["policies"].items():
            tt, share, peak = p["ttft_ratio"], p["evict_share"], p["peak_ratio"]
            print(f"{r['model']} {r['prompt_tokens']} tokens, {spec} to {budget} cells, {args.rounds} rounds: time to "
                  f"first token {tt['median']:.3f}x the full cache's ({tt['min']:.3f}-{tt['max']:.3f}); eviction "
                  f"{100 * share['median']:.2f}% of the prefill ({100 * share['min']:.2f}-{100 * share['max']:.2f}%, "
                  f"{p['evict_s']['median']:.2f} s); peak RSS {peak['median']:.3f}x", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
