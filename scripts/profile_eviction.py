"""Where one eviction's time goes: the prompt is read once without evicting (its last tokens are read
again by each policy, from a snapshot), then one eviction of each policy runs under cProfile and its
time is split by part (the lookahead's decoding on the workspace, the score kernel, the smoothing,
the key reads from llama.cpp's state, compaction, ...), beside the prefill's time. Run it alone on
the machine: the prefill and the kernels share the cores.

usage: python scripts/profile_eviction.py [--tokens 8192] [--policies "echokv,laq,echokv(P=6)"] [--budget 512]
       [-m MODEL] [-t THREADS] [--shared] [--rounds 1] [--json]

--rounds N evicts N times from the same snapshot, each after the kernel probe of bench_ttft.py (one
fixed pooling call): the machine's speed moves between minutes, and the eviction with it.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pathlib
import pstats
import re
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from bench_memory import prose_tokens  # noqa: E402
from bench_ttft import kernel_probe_ms  # noqa: E402

from kvlite.cache import Snapshot  # noqa: E402
from kvlite.engine import Model  # noqa: E402
from kvlite.eval.evaluate import read_prefix  # noqa: E402
from kvlite.eval.specs import policy_for  # noqa: E402
from kvlite.limits import DEFAULT_CHUNK  # noqa: E402
from kvlite.models import resolve_model  # noqa: E402
from kvlite.runner import Runner  # noqa: E402
from kvlite.settings import RunSettings, plan_context  # noqa: E402

TAIL = 64  # the prompt's last tokens each policy reads itself (EchoKV's 16 anchors, SnapKV's window)

# (file, function) whose cumulative time is the part; the kernel is native.attn_pool's cumulative
# time less the max-pool it calls (its Python checks are microseconds; the C call runs in a lambda
# handed to Native._run)
PARTS = {
    "lookahead decode (llama.cpp, workspace)": ("workspace.py", "decode"),
    "workspace's own context made": ("runner.py", "_workspace_context"),
    "workspace cells copied to it": ("workspace.py", "_copy_to_side"),
    "score kernel (attn_pool, C)": ("native.py", "attn_pool"),
    "max-pool smoothing": ("native.py", "max_smooth"),
    "key reads (state file)": ("cache.py", "cached_kv"),
    "key layers read": ("kvstate.py", "_read"),
    "compaction": ("runner.py", "_compact"),
    "captured queries": ("capture.py", "take"),
    "proposals (RoPE)": ("proposals.py", "proposals"),
    "aggregation": ("aggregate.py", "aggregate"),
}


def profile(model: Model, tokens: list[int], prefix: Snapshot, n_ctx: int, name: str, budget: int,
            threads: int, shared: bool = False) -> dict:  # fmt: skip
    """One eviction of `name` under cProfile, on the prompt's prefix restored from `prefix` and its
    last TAIL tokens fed again (the queries the policy observes). shared: the lookahead on the
    workspace sequence of the cache's own context, never on a copy (as before the copy)."""
    policy = policy_for(name, budget)
    runner = Runner(model, policy, RunSettings(n_ctx=n_ctx, chunk=DEFAULT_CHUNK, n_threads=threads))
    if shared:
        runner.cache.workspace.make_context = None
    try:
        runner.restore(prefix)
        t0 = time.perf_counter()
        runner.feed(tokens[-TAIL:], evict=False)
        t1 = time.perf_counter()
        prof = cProfile.Profile()
        prof.enable()
        runner.evict()
        prof.disable()
        t2 = time.perf_counter()
    finally:
        runner.close()
    stats = pstats.Stats(prof).stats  # (file, line, function) -> (cc, nc, own, cumulative, callers)
    parts = {part: sum(v[3] for k, v in stats.items() if k[2] == fn and k[0].endswith(file))
             for part, (file, fn) in PARTS.items()}  # fmt: skip
    parts["score kernel (attn_pool, C)"] -= sum(
        ct for k, v in stats.items() if k[2] == "max_smooth" for c, (_, _, _, ct) in v[4].items() if c[2] == "attn_pool"
    )
    parts["the rest (Python, selection, masks)"] = (t2 - t1) - sum(parts.values())
    return dict(policy=name + (" [shared workspace]" if shared else ""), tokens=len(tokens), budget=budget,
                tail_s=t1 - t0, evict_s=t2 - t1, parts=parts)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--policies", default="echokv,laq")
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--rounds", type=int, default=1, help="evictions of each policy, alternating, each after the probe")
    ap.add_argument("--shared", action="store_true", help="each policy again with its lookahead on the shared "
                    "workspace (no copy to a small context), after the copied run")  # fmt: skip
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    model = Model(resolve_model(args.model))
    tokens = prose_tokens(model, args.tokens)
    names = re.split(r",(?![^(]*\))", args.policies)  # commas outside a spec's parentheses
    n_ctx = max(plan_context(policy_for(n, args.budget), 0, len(tokens), 2, DEFAULT_CHUNK)[0] for n in names)
    t0 = time.perf_counter()
    prefix = read_prefix(model, tokens[:-TAIL], n_ctx, args.threads)
    prefix_s = time.perf_counter() - t0
    runs = [(name, shared) for name in names for shared in ((False, True) if args.shared else (False,))]
    for name, shared in runs * args.rounds:
        probe_ms = kernel_probe_ms(args.threads)
        r = profile(model, tokens, prefix, n_ctx, name, args.budget, args.threads, shared)
        r["prefill_s"], r["kernel_probe_ms"] = prefix_s + r["tail_s"], probe_ms
        if args.json:
            print(json.dumps(r), flush=True)
            continue
        share = 100 * r["evict_s"] / r["prefill_s"]
        print(
            f"{r['policy']} at {r['tokens']} tokens, budget {r['budget']}: prefill {r['prefill_s']:.1f} s, "
            f"eviction {r['evict_s']:.2f} s ({share:.1f}% of the prefill; kernel probe {probe_ms:.0f} ms)"
        )
        for part, s in r["parts"].items():
            print(f"  {part:40s} {s:6.2f} s  {100 * s / r['evict_s']:5.1f}%")


if __name__ == "__main__":
    main()
