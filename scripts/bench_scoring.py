"""Scoring benchmarks on SmolLM2 shapes, ratios measured in one run.

(a) Attention pooling (EchoKV Eq. 3) of T=8 queries over 1K / 4K / 16K keys, all layers:
    native (ggml) vs torch vs numpy, called in turn; the median of the per-round ratios.
    Target: native >= 3x torch.
(b) Counter-causal refresh latency on a real SmolLM2 cache, full vs fast, at n=512 and n=4096
    (target fast >= 10x full), and the fast refresh with the gathered raw logit vs with a
    full-vocabulary projection (the log-probability score; target >= 3x).
(c) EchoKV's scoring passes (proposal rotation, bootstrap, repair, final pooling) as a fraction
    of the prefill of the same 8K prompt. Target <= 5%.
(d) Raw vs normalized surprise on a stated-once 5-digit code in ~1.5K tokens of prose: where the
    code's tokens rank in keep order (0 = kept first, 1 = evicted first) under each score.
(e) -t: the same kernels at each thread count of --threads (default 1 and every core kvlite may
    use), called in turn: attention pooling over 16K keys and, unless --skip-cc, a fast
    counter-causal refresh of 4096 cells; the ratio to the first thread count.
(f) --roofline (alone): the pooling kernel's GFLOP/s on EchoKV's first pass (16 anchors x 24
    positions = 384 queries, every layer) over 4K, 8K and 16K f16 keys, beside llama.cpp's own
    prefill GFLOP/s on a 4K-token prompt of the same model, threads and machine, in turn each round.
    Useful FLOPs on both sides: the kernel's q.k products (2 x layers x heads x queries x keys x
    head_dim; the softmax and sums are not counted), the prefill's weight products (2 x the
    elements of every blk.* matrix a token) and causal attention (q.k and p.v over the positions
    before each token); llama.cpp's masked products over its padded cache are not counted either.

usage: python scripts/bench_scoring.py [--repeat 3] [--skip-cc] [--threads 1,2] [--roofline] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from kvlite.cache import KVCache
from kvlite.engine import Capture, Context, Model
from kvlite.eval.haystack import haystack
from kvlite.models import default_model_path
from kvlite.native import default_threads, native
from kvlite.reference.scores import attn_pool as torch_pool
from kvlite.scoring.proposals import proposals
from kvlite.scoring.surprise import CacheContents, SurpriseModel, cache_contents


def timed(fn, repeat: int) -> float:
    """Median seconds of `repeat` calls (after one warm-up)."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def numpy_pool(q: np.ndarray, k: np.ndarray) -> np.ndarray:
    group = q.shape[1] // k.shape[1]
    kh = np.repeat(k.astype(np.float32), group, axis=1)
    x = np.einsum("lhqd,lhnd->lhqn", q, kh) / np.sqrt(q.shape[-1])
    x = np.exp(x - x.max(-1, keepdims=True))
    x /= x.sum(-1, keepdims=True)
    return x.reshape(q.shape[0], k.shape[1], -1, k.shape[2]).sum(2)


def interleaved(fns: dict, repeat: int) -> dict[str, list[float]]:
    """Seconds per call of each function, called in turn `repeat` times (after one warm-up each),
    so a change in the machine's load hits all of them alike."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def bench_pooling(info, repeat: int) -> list[dict]:
    rng = np.random.default_rng(0)
    rows = []
    for n_keys in (1024, 4096, 16384):
        q = rng.standard_normal((info.n_layer, info.n_head, 8, info.head_dim)).astype(np.float32)
        k = rng.standard_normal((info.n_layer, info.n_head_kv, n_keys, info.head_dim)).astype(np.float16)
        qt, kt = torch.from_numpy(q), torch.from_numpy(k)
        t = interleaved(
            {
                "native": lambda: native().attn_pool(q, k),  # noqa: B023
                "torch": lambda: torch_pool(qt, kt.float()),  # noqa: B023
                "numpy": lambda: numpy_pool(q, k),  # noqa: B023
            },
            repeat,
        )
        ratio = {other: statistics.median(a / b for a, b in zip(t[other], t["native"])) for other in ("torch", "numpy")}
        ms = {name: 1e3 * statistics.median(v) for name, v in t.items()}
        rows.append(dict(keys=n_keys, **{f"{k}_ms": v for k, v in ms.items()}, torch_over_native=ratio["torch"],
                         numpy_over_native=ratio["numpy"]))  # fmt: skip
        print(
            f"(a) {n_keys:6d} keys: native {ms['native']:7.1f} ms | torch {ms['torch']:7.1f} ms "
            f"({ratio['torch']:.1f}x) | numpy {ms['numpy']:7.1f} ms ({ratio['numpy']:.1f}x)",
            flush=True,
        )
    return rows


def prefill_cache(model: Model, n: int) -> tuple[KVCache, float]:
    info = model.info
    cap = Capture(info)
    cap.request("hidden", [info.n_layer - 2])
    cap.request("q_pre", range(info.n_layer))
    cache = KVCache(Context(model, n_ctx=n + 64, n_batch=512, capture=cap), hidden_layer=info.n_layer - 2)
    rng = np.random.default_rng(1)
    t0 = time.perf_counter()
    cache.append([int(t) for t in rng.integers(100, 30000, size=n)])
    return cache, time.perf_counter() - t0


def tail(c: CacheContents, n: int) -> CacheContents:
    h = None if c.hidden is None else c.hidden[-n:]
    # cache_contents reads K/V a layer at a time (LayerRows): stacked here, for the bench's tails only
    k, v = np.asarray(c.k)[:, -n:], np.asarray(c.v)[:, -n:]
    return CacheContents(c.tokens[-n:], c.positions[-n:], k, v, h)


def bench_counter_causal(model: Model, cache: KVCache, repeat: int) -> list[dict]:
    cc = SurpriseModel(model.info)
    full = cache_contents(cache, cc, "full")
    fast = cache_contents(cache, cc, "fast")
    rows = []
    for n in (512, 4096):
        cf, cq = tail(full, n), tail(fast, n)
        t_full = timed(lambda: cc.logits(cf, "full", "raw"), max(1, repeat // 2))  # noqa: B023
        t_fast = timed(lambda: cc.logits(cq, "fast", "raw"), repeat)  # noqa: B023
        t_fast_vocab = timed(lambda: cc.logits(cq, "fast", "logprob"), repeat)  # noqa: B023
        rows.append(dict(n=n, full_ms=1e3 * t_full, fast_ms=1e3 * t_fast, fast_vocab_ms=1e3 * t_fast_vocab,
                         full_over_fast=t_full / t_fast, vocab_over_gather=t_fast_vocab / t_fast))  # fmt: skip
        print(f"(b) n={n:5d}: full {1e3 * t_full:8.1f} ms | fast {1e3 * t_fast:7.1f} ms ({t_full / t_fast:.1f}x) | "
              f"fast with full-vocabulary projection {1e3 * t_fast_vocab:7.1f} ms "
              f"(gather is {t_fast_vocab / t_fast:.1f}x faster)", flush=True)  # fmt: skip
    return rows


def bench_echokv_passes(model: Model, cache: KVCache, prefill_s: float, repeat: int) -> dict:
    """The scoring EchoKV adds to a prefill (Algorithm 1 with S=1, T=8, B1=1024): rotate the last
    query to T positions, pool the T proposals over the prompt (bootstrap), pool round 1's T/2
    queries (repair), pool all T decode queries (final). The lookahead decodes are not scoring."""
    info = model.info
    t_len = 8
    positions, k, _ = cache.read_kv(range(info.n_layer))
    keys = np.ascontiguousarray(
        k.reshape(info.n_layer, len(positions), info.n_head_kv, info.head_dim).transpose(0, 2, 1, 3)
    )
    anchors = np.stack([cache.ctx.capture.get("q_pre", il)[-1:] for il in range(info.n_layer)])
    n = len(positions)
    rng = np.random.default_rng(2)
    decode_q = rng.standard_normal((info.n_layer, info.n_head, t_len, info.head_dim)).astype(np.float32)

    def passes():
        props = proposals(info, anchors, range(n, n + t_len), range(info.n_layer))
        native().attn_pool(props, keys)  # bootstrap: W1 from the proposals
        native().attn_pool(np.ascontiguousarray(decode_q[:, :, : t_len // 2]), keys)  # repair with Q1
        native().attn_pool(decode_q, keys)  # final with [Q1; Q2]

    t = timed(passes, repeat)
    print(f"(c) EchoKV scoring passes over {n} prompt tokens: {1e3 * t:.0f} ms = {100 * t / prefill_s:.2f}% "
          f"of its {prefill_s:.1f} s prefill (target <= 5%)", flush=True)  # fmt: skip
    return dict(prompt=n, passes_ms=1e3 * t, prefill_s=prefill_s, fraction=t / prefill_s)


def bench_needle_ranks(model: Model) -> list[dict]:
    info = model.info
    paras = haystack(14)
    needle = "The locker code of Orla Bren is 54554."
    paras.insert(len(paras) * 3 // 10, needle)
    text = "\n\n".join(paras) + "\n\nWhat is the locker code of Orla Bren?"
    tokens = model.tokenize(text)
    cap = Capture(info)
    cap.request("hidden", [info.n_layer - 2])
    cache = KVCache(Context(model, n_ctx=len(tokens) + 64, capture=cap), hidden_layer=info.n_layer - 2)
    cache.append(tokens)
    code = model.tokenize(" 54554.", add_special=False)[:-1]
    start = next(i for i in range(len(tokens)) if tokens[i : i + len(code)] == code)
    code_pos = np.arange(start, start + len(code))
    cc = SurpriseModel(info)
    rows = []
    for variant in ("fast", "full"):
        contents = cache_contents(cache, cc, variant)
        for score in ("raw", "logprob"):
            keep_score = -cc.logits(contents, variant, score)[:-1]  # the last token is always kept
            order = np.argsort(-keep_score, kind="stable")  # kept first
            rank = np.empty(len(order))
            rank[order] = np.arange(len(order)) / len(order)
            r = rank[code_pos]
            survives = int((r * len(order) < 128 - 5).sum())  # budget 128 minus 4 sinks and the last token
            rows.append(dict(variant=variant, score=score, code_ranks=r.round(3).tolist(), survive_at_128=survives))
            print(f"(d) {variant:4s} {score:7s}: code tokens rank {np.round(r, 2).tolist()} of {len(order)} "
                  f"(0 = kept first); {survives}/{len(code)} kept at budget 128", flush=True)  # fmt: skip
    return rows


def bench_threads(model: Model, cache: KVCache | None, repeat: int, threads: list[int]) -> list[dict]:
    info = model.info
    rng = np.random.default_rng(3)
    q = rng.standard_normal((info.n_layer, info.n_head, 8, info.head_dim)).astype(np.float32)
    k = rng.standard_normal((info.n_layer, info.n_head_kv, 16384, info.head_dim)).astype(np.float16)
    kernels = {"pooling 16K keys": lambda: native().attn_pool(q, k)}
    if cache is not None:
        cc = SurpriseModel(info)
        fast = tail(cache_contents(cache, cc, "fast"), 4096)
        kernels["cc-fast 4096 cells"] = lambda: cc.logits(fast, "fast", "raw")
    rows = []
    for what, kernel in kernels.items():

        def at(n: int, kernel=kernel):
            return lambda: (native().set_threads(n), kernel())

        t = interleaved({n: at(n) for n in threads}, repeat)
        ms = {n: 1e3 * statistics.median(v) for n, v in t.items()}
        speedup = {n: statistics.median(a / b for a, b in zip(t[threads[0]], t[n])) for n in threads}
        rows.append(dict(kernel=what, ms=ms, speedup=speedup))
        print(f"(e) {what}: " + " | ".join(f"-t {n} {ms[n]:7.1f} ms ({speedup[n]:.2f}x)" for n in threads), flush=True)
    native().set_threads(default_threads())
    return rows


def prefill_flops(model: Model, n: int) -> float:
    """Useful FLOPs of reading n tokens: every blk.* weight matrix once a token, and causal attention."""
    from kvlite.gguf_header import read_header

    weights = sum(int(np.prod(t.shape)) for t in read_header(str(model.path)).tensors
                  if t.name.startswith("blk.") and len(t.shape) == 2)  # fmt: skip
    info = model.info
    attention = 2 * 2 * info.n_layer * info.n_head * info.head_dim * n * (n + 1) / 2
    return 2.0 * weights * n + attention


def bench_roofline(model: Model, repeat: int, prompt: int = 4096) -> list[dict]:
    info, rng = model.info, np.random.default_rng(0)
    n_q = 16 * 24  # EchoKV's first pass: its anchors rotated to every lookahead position
    q = rng.standard_normal((info.n_layer, info.n_head, n_q, info.head_dim)).astype(np.float32)
    keys = {n: rng.standard_normal((info.n_layer, info.n_head_kv, n, info.head_dim)).astype(np.float16)
            for n in (4096, 8192, 16384)}  # fmt: skip
    tokens = [int(t) for t in rng.integers(100, 30000, size=prompt)]

    def prefill() -> None:
        KVCache(Context(model, n_ctx=prompt + 64, n_batch=512)).append(tokens)

    fns = {"prefill": prefill, **{n: (lambda k=k: native().attn_pool(q, k)) for n, k in keys.items()}}
    times = interleaved(fns, repeat)
    flops = {"prefill": prefill_flops(model, prompt),
             **{n: 2.0 * info.n_layer * info.n_head * n_q * n * info.head_dim for n in keys}}  # fmt: skip
    rate = {name: flops[name] / statistics.median(ts) / 1e9 for name, ts in times.items()}
    rows = []
    print(f"\n(f) GFLOP/s, median of {repeat} rounds; llama.cpp prefill of {prompt} tokens: {rate['prefill']:.1f}")
    for n in keys:
        per_round = [flops[n] / t / (flops["prefill"] / p) for t, p in zip(times[n], times["prefill"])]
        rows.append({"keys": n, "kernel_s": statistics.median(times[n]), "kernel_gflops": rate[n],
                     "prefill_gflops": rate["prefill"], "ratio": statistics.median(per_round),
                     "ratio_range": [min(per_round), max(per_round)]})  # fmt: skip
        print(f"  {n:>6} keys: {statistics.median(times[n]):6.2f} s  {rate[n]:6.1f} GFLOP/s  "
              f"{rows[-1]['ratio']:.2f}x prefill's (rounds {min(per_round):.2f}-{max(per_round):.2f})")  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=8192, help="prompt tokens for (b) and (c)")
    ap.add_argument("--skip-cc", action="store_true", help="only (a) and (e)'s pooling")
    ap.add_argument("--threads", default=f"1,{default_threads()}", help="thread counts for (e), comma-separated")
    ap.add_argument("--roofline", action="store_true", help="only (f): the kernel against llama.cpp's prefill")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    threads = sorted({int(n) for n in args.threads.split(",")})
    torch.set_num_threads(max(1, torch.get_num_threads()))
    model = Model(default_model_path())
    if args.roofline:
        rows = bench_roofline(model, args.repeat)
        if args.json:
            print(json.dumps({"roofline": rows}, indent=1))
        return
    out = {"pooling": bench_pooling(model.info, args.repeat)}
    if not args.skip_cc:
        print(f"prefilling {args.prompt} tokens for (b) and (c) ...", flush=True)
        cache, prefill_s = prefill_cache(model, args.prompt)
        out["counter_causal"] = bench_counter_causal(model, cache, args.repeat)
        out["echokv"] = bench_echokv_passes(model, cache, prefill_s, args.repeat)
        out["needle_ranks"] = bench_needle_ranks(model)
    out["threads"] = bench_threads(model, None if args.skip_cc else cache, args.repeat, threads)
    if args.json:
        print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
