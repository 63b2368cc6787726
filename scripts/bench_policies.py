"""Policy benchmarks on SmolLM2, ratios measured in one run.

(a) Time to first token of each policy vs `full` on the same 4K (and 8K) token prompt: prefill,
    scoring, lookahead, eviction and compaction. Target: EchoKV and LAQ at most 1.10x full.
(b) Decode tok/s after each policy at budget 512 vs `full`, same runs. Target at 8K: >= 2.5x.
(c) Chunked mode on a 32K-token prompt with -c 4096: peak resident cells and peak RSS of the
    process (one subprocess per policy), against the same policy on a 4K prompt. Target: bounded
    by the cache, not the prompt.

usage: python scripts/bench_policies.py [--lengths 4096,8192] [--policies ...] [--long 32768] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import time

from kvlite.engine import Model
from kvlite.models import default_model_path
from kvlite.policies import make_policy
from kvlite.runner import Runner
from kvlite.settings import RunSettings, plan_context

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from bench_memory import generate_peak, prose_tokens  # noqa: E402

ALL = "full,streaming,h2o,tova,snapkv,dapq,laq,echokv,cc,cc-fast"


def run_policy(model: Model, name: str, tokens: list[int], budget: int, n_decode: int) -> dict:
    policy = make_policy(name, budget=None if name == "full" else budget)
    n_ctx, chunk = plan_context(policy, 0, len(tokens), n_decode + 1, 512)
    runner = Runner(model, policy, RunSettings(n_ctx=n_ctx, chunk=chunk))
    t0 = time.perf_counter()
    runner.feed(tokens)
    runner.generate(1)
    ttft = time.perf_counter() - t0
    t1 = time.perf_counter()
    out, _ = runner.generate(n_decode)
    rate = len(out) / (time.perf_counter() - t1)
    cells = runner.cache.n_resident
    runner.close()
    return dict(policy=name, ttft_s=ttft, decode_tok_s=rate, cells=cells)


def bench_ttft(model: Model, lengths: list[int], policies: list[str], budget: int, n_decode: int) -> list[dict]:
    rows = []
    for n in lengths:
        tokens = prose_tokens(model, n)
        base = None
        for name in policies:
            r = run_policy(model, name, tokens, budget, n_decode)
            base = r if name == "full" else base
            r["prompt"] = n
            if base:
                r["ttft_vs_full"] = r["ttft_s"] / base["ttft_s"]
                r["decode_vs_full"] = r["decode_tok_s"] / base["decode_tok_s"]
            rows.append(r)
            print(f"(a,b) {n:5d} tokens {name:9s}: TTFT {r['ttft_s']:6.1f} s ({r.get('ttft_vs_full', 1):.2f}x full) | "
                  f"decode {r['decode_tok_s']:5.1f} tok/s ({r.get('decode_vs_full', 1):.2f}x) with {r['cells']} cells",
                  flush=True)  # fmt: skip
    return rows


def chunked_run(prompt_file: str, name: str, cache: int, n_ctx: int) -> dict:
    """`kvlite generate` in its own process: its peak RSS is its own."""
    r = generate_peak(prompt_file, "-n", "16", "--policy", name, "--cache", str(cache), "--chunk", "512",
                      "-c", str(n_ctx))  # fmt: skip
    return dict(max_cells=r["cache"]["max_cells"], prompt=r["prompt_tokens"], seconds=r["timings"]["prefill_s"],
                rss_mb=r["peak_rss_mb"])  # fmt: skip


def bench_chunked(model: Model, policies: list[str], long: int, n_ctx: int) -> list[dict]:
    rows = []
    cache = n_ctx - 512 - 32  # room for one chunk and a lookahead
    with tempfile.TemporaryDirectory() as d:
        files = {}
        for n in (4096, long):
            text = model.detokenize(prose_tokens(model, n))
            files[n] = os.path.join(d, f"prompt{n}.txt")
            pathlib.Path(files[n]).write_text(text)
        for name in policies:
            short = chunked_run(files[4096], name, cache, n_ctx)
            big = chunked_run(files[long], name, cache, n_ctx)
            rows.append(dict(policy=name, cache=cache, short=short, long=big))
            print(f"(c) chunked {name:9s} -c {n_ctx}: {big['prompt']} tokens -> max cells {big['max_cells']}, "
                  f"peak RSS {big['rss_mb']:.0f} MB ({big['seconds']:.0f} s) | {short['prompt']} tokens -> "
                  f"max cells {short['max_cells']}, peak RSS {short['rss_mb']:.0f} MB", flush=True)  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="4096,8192", help="prompt lengths of (a, b); empty: skip them")
    ap.add_argument("--policies", default=ALL)
    ap.add_argument(
        "--long-policies", default="full,echokv,laq,streaming", help="the policies run at the longest length"
    )
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--long", type=int, default=32768, help="prompt tokens of the chunked run (0: skip it)")
    ap.add_argument("--chunked-policies", default="streaming,cc-fast")
    ap.add_argument("-c", "--ctx-size", type=int, default=4096)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    model = Model(default_model_path())
    lengths = [int(x) for x in args.lengths.split(",") if x]
    out = {"ttft": []}
    for i, n in enumerate(lengths):
        names = args.policies.split(",") if i == 0 else args.long_policies.split(",")
        out["ttft"] += bench_ttft(model, [n], names, args.budget, args.decode)
    if args.long:
        out["chunked"] = bench_chunked(model, args.chunked_policies.split(","), args.long, args.ctx_size)
    if args.json:
        print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
