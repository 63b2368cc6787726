"""Eviction's speed and memory on random-weight GGUFs of real model shapes, ratios measured in one run.

Speed does not depend on the weights' values, so a file with SmolLM2-135M's or Llama-3.2-1B's
shape, f16 matrices and random weights (kvlite.reference.tiny_gguf) times as the real file of that
shape and type does. That lets a machine without a model hub, the GPU machine of issue 28 among
them, measure real shapes. What differs from the real file: the vocabulary is the fixture's byte
vocabulary padded with unused tokens to the real size (so the output layer costs the same), one
character is one token, and the trained context is set to 128K so every prompt length is within it.

For each shape and prompt length, each policy runs as `kvlite generate` in its own process
(bench_memory.generate_peak, so each peak is its own) on the same prompt:
- ttft_vs_full: the policy's prefill plus eviction against the full cache's prefill;
- evict_share: the eviction's time as a share of the full cache's prefill;
- decode_vs_full: decode tok/s at the budget against the full cache's;
- peak host RSS and, where nvidia-smi is, the device's peak (MiB).
One JSON line per run goes to --out as it finishes; run again with the same --out, it measures only
what is missing (a run cut short at a time limit resumes).

usage: python scripts/bench_shapes.py [--shapes smollm2-135m,llama3.2-1b] [--lengths 8192,32768]
       [--budget 512] [--policies full,snapkv,laq,echokv] [-n 32] [--dir DIR] [--out FILE] [kvlite flags]
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
from kvlite.reference.tiny_gguf import TinySpec, write_tiny_gguf

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from bench_memory import generate_peak, prose_tokens  # noqa: E402

CTX = 131072
SHAPES = {
    # HuggingFaceTB/SmolLM2-135M: 30 layers, 9 heads of 64 over 3 KV heads, FFN 1536, vocab 49152
    "smollm2-135m": TinySpec(arch="llama", n_layer=30, n_head=9, n_head_kv=3, head_dim=64, n_ff=1536,
                             n_vocab=49152, rope_base=1e5, n_ctx_train=CTX, weights="f16"),
    # meta-llama/Llama-3.2-1B: 16 layers, 32 heads of 64 over 8 KV heads, FFN 8192, vocab 128256, llama3 RoPE
    "llama3.2-1b": TinySpec(arch="llama", n_layer=16, n_head=32, n_head_kv=8, head_dim=64, n_ff=8192,
                            n_vocab=128256, rope_base=5e5, rope_freqs=True, n_ctx_train=CTX, weights="f16"),
    # Qwen/Qwen2.5-7B: 28 layers, 28 heads of 128 over 4 KV heads, FFN 18944, vocab 152064 (15 GB in f16)
    "qwen2.5-7b": TinySpec(arch="qwen2", n_layer=28, n_head=28, n_head_kv=4, head_dim=128, n_ff=18944,
                           n_vocab=152064, rope_base=1e6, n_ctx_train=CTX, weights="f16"),
}  # fmt: skip


def shape_file(name: str, folder: pathlib.Path) -> pathlib.Path:
    """The shape's GGUF in folder, written once (seconds for 135M, about a minute for 1B)."""
    path = folder / f"random-{name}-f16.gguf"
    if not path.exists():
        t0 = time.perf_counter()
        tmp = write_tiny_gguf(path.with_suffix(".part"), SHAPES[name])
        tmp.rename(path)
        print(f"wrote {path} ({path.stat().st_size / 2**30:.2f} GiB, {time.perf_counter() - t0:.0f} s)", flush=True)
    return path


def measure(shape: str, n: int, name: str, path: pathlib.Path, prompt: str, args, flags: list[str]) -> dict:
    budget = [] if name == "full" else ["--budget", str(args.budget)]
    r = generate_peak(prompt, "-m", str(path), "--policy", name, *budget, "-n", str(args.n_predict), *flags)
    t = r["timings"]
    return dict(shape=shape, length=n, policy=name, budget=args.budget, prompt_tokens=r["prompt_tokens"],
                prefill_s=t["prefill_s"], evict_s=t["evict_s"], decode_tok_s=t["decode_tok_s"],
                decode_tokens=t["decode_tokens"], peak_rss_mb=r["peak_rss_mb"], peak_device_mb=r["peak_device_mb"],
                kv_bytes=r["cache"]["kv_bytes"], kv_buffers=r["cache"].get("kv_buffers"))  # fmt: skip


def describe(row: dict) -> str:
    dev = "" if row["peak_device_mb"] is None else f"  device {row['peak_device_mb']:6.0f} MiB"
    return (f"{row['shape']:13s} {row['length']:6d} {row['policy']:8s} prefill {row['prefill_s']:7.2f} s  evict "
            f"{row['evict_s']:6.2f} s ({100 * row['evict_share']:5.1f}% of full's prefill)  TTFT "
            f"{row['ttft_vs_full']:5.2f}x  decode {row['decode_tok_s'] or 0:7.1f} tok/s "
            f"({row['decode_vs_full']:5.2f}x)  RSS {row['peak_rss_mb']:6.0f} MB{dev}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="smollm2-135m,llama3.2-1b", help=f"comma-separated of {', '.join(SHAPES)}")
    ap.add_argument("--lengths", default="8192,32768", help="comma-separated prompt tokens")
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--policies", default="full,snapkv,laq,echokv", help="comma-separated; full is always run first")
    ap.add_argument("-n", "--n-predict", type=int, default=32)
    ap.add_argument("--dir", default=None, help="where the GGUF files are written and reused (default: a temp dir)")
    ap.add_argument("--out", default=None, help="JSON lines, one per run, appended as each finishes")
    args, flags = ap.parse_known_args()  # other flags go to every run: -ctk q8_0, -t 8
    shapes = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        ap.error(f"unknown shape {unknown[0]!r}: choose from {', '.join(SHAPES)}")
    lengths = [int(n) for n in args.lengths.split(",") if n]
    names = ["full", *(p for p in args.policies.split(",") if p and p != "full")]
    done = {}  # what an earlier, cut-short run with the same --out measured
    if args.out and os.path.exists(args.out):
        for line in pathlib.Path(args.out).read_text().splitlines():
            row = json.loads(line)
            done[row["shape"], row["length"], row["budget"], row["policy"]] = row
    with tempfile.TemporaryDirectory() as tmp:
        folder = pathlib.Path(args.dir or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        for n in lengths:  # every shape at the first length before any at the next
            prompt = os.path.join(tmp, f"prompt-{n}.txt")
            for shape in shapes:
                full = None
                for name in names:
                    key = (shape, n, args.budget, name)
                    if key in done:
                        full = full or done[key]
                        continue
                    path = shape_file(shape, folder)
                    if not os.path.exists(prompt):  # every shape has the fixture's vocabulary: one prompt for all
                        model = Model(path, n_gpu_layers=0)
                        pathlib.Path(prompt).write_text(model.detokenize(prose_tokens(model, n)))
                        del model
                    row = measure(shape, n, name, path, prompt, args, flags)
                    full = full or row
                    row["ttft_vs_full"] = (row["prefill_s"] + row["evict_s"]) / full["prefill_s"]
                    row["evict_share"] = row["evict_s"] / full["prefill_s"]
                    row["decode_vs_full"] = (row["decode_tok_s"] or 0) / (full["decode_tok_s"] or 1)
                    print(describe(row), flush=True)
                    if args.out:
                        with open(args.out, "a") as f:
                            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
