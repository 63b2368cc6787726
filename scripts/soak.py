"""Soak: a long chunked-mode chat on the default model, checking after every turn that kvlite's
view of the cache is llama.cpp's (resident positions per sequence, nothing left on the workspace,
the cache within its bound) and that memory stays flat (RSS sampled every 50 turns, within 10% of
the first sample). Not run in CI; issue 10's closing note reports its numbers.

    .venv/bin/python scripts/soak.py                       # 1000 turns, echokv, cache 256, h 64
    .venv/bin/python scripts/soak.py --turns 50 --policy snapkv
"""

from __future__ import annotations

import argparse
import pathlib
import random
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvlite.api import Session  # noqa: E402
from kvlite.engine import SamplingParams  # noqa: E402
from kvlite.policies import make_policy  # noqa: E402
from kvlite.runner import RunSettings  # noqa: E402

WORDS = [
    "river",
    "lamp",
    "copper",
    "seven",
    "garden",
    "quiet",
    "number",
    "orbit",
    "violet",
    "table",
    "shadow",
    "engine",
    "harbor",
    "pencil",
]


def rss_mb() -> float:
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def check(conv, bound: int) -> None:
    runner = conv.runner
    cache = runner.cache
    live = cache.positions()
    assert np.array_equal(live, cache.llama_positions(0)), "live positions differ from llama.cpp's"
    assert len(cache.llama_positions(1)) == 0 and not cache.workspace.active, "workspace cells left behind"
    assert len(live) <= bound, f"{len(live)} cells resident, bound {bound}"
    assert cache.max_cells <= runner.ctx.n_ctx


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=1000)
    ap.add_argument("--policy", default="echokv")
    ap.add_argument("--cache", type=int, default=256, help="chunked mode's cache J")
    ap.add_argument("--chunk", type=int, default=64, help="refresh interval h")
    ap.add_argument("-n", "--n-predict", type=int, default=16)
    ap.add_argument("-t", "--threads", type=int, default=2)
    args = ap.parse_args()

    policy = make_policy(args.policy, budget=args.cache, mode="chunked")
    settings = RunSettings(chunk=args.chunk, sampling=SamplingParams(temp=0.8, seed=1), n_threads=args.threads)
    conv = Session(None, policy, settings).conversation(system="You are a helpful assistant.")
    bound = args.cache + args.chunk + policy.lookahead_cells()
    rng = random.Random(0)
    samples: list[tuple[int, float]] = []
    t0 = time.perf_counter()
    for turn in range(1, args.turns + 1):
        message = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 30))) + "?"
        conv.turn(message, args.n_predict, on_text=None, interrupted=lambda: False, progress=False)
        check(conv, bound)
        if turn % 50 == 0 or turn == 1:
            samples.append((turn, rss_mb()))
            c, elapsed = conv.runner.cache, time.perf_counter() - t0
            print(f"turn {turn:5d}  rss {samples[-1][1]:7.1f} MB  positions {c.n_pos:6d}  resident "
                  f"{c.n_resident:4d}  evicted {c.evicted:6d}  {elapsed:6.0f} s", flush=True)  # fmt: skip
    base = next((mb for turn, mb in samples if turn >= 50), samples[0][1])  # after warm-up
    peak = max(mb for _, mb in samples)
    growth = peak / base - 1
    ok = growth <= 0.10
    print(f"soak: {args.turns} turns of {args.policy} (J={args.cache}, h={args.chunk}), invariants held every "
          f"turn; RSS {base:.1f} MB at turn 50, peak {peak:.1f} MB ({100 * growth:+.1f}%): "
          f"{'flat' if ok else 'NOT flat'} within 10%; {time.perf_counter() - t0:.0f} s")  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
