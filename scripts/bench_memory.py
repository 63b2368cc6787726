"""Peak memory of an eviction: each policy's `kvlite generate` peak RSS against `--policy full`.

One process per policy (so each peak is its own), the same prompt (prose, 8K tokens of SmolLM2 by
default), prefill-end eviction to --budget. Target (issue 12): every scored policy within 1.15x
of full. The ratio is the number to read; absolute MB depend on the build and the allocator. On a
CUDA machine (nvidia-smi present) each run's peak device memory is printed beside it.
--kv-types f16,q8_0,q4_0 runs every policy with each cache type (-ctk/-ctv), each against the full
cache of its own type, and prints the resident cells' K and V bytes and their share of the full
cache of the first type listed: the two savings multiply (issue 26). Memory does not depend on
what else runs, so this can share the CPU; its decode tok/s cannot.

usage: python scripts/bench_memory.py [--tokens 8192] [--budget 512] [--policies ...] [--kv-types f16]
       [--prompt-file FILE] [--json]
       [kvlite flags]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from kvlite.engine import Model
from kvlite.eval.haystack import haystack
from kvlite.models import default_model_path

POLICIES = "full,streaming,h2o,tova,snapkv,laq,echokv,knorm,kvzip,cc,cc-fast"
TARGET = 1.15


def prose_tokens(model: Model, n: int, text: str | None = None) -> list[int]:
    """n tokens of text (default: the docstring haystack), repeated if it runs short."""
    tokens = model.tokenize(text if text is not None else "\n\n".join(haystack(10_000)))
    while len(tokens) < n:
        tokens += tokens
    return tokens[:n]


def generate_peak(prompt_file: str, *flags: str) -> dict:
    """`kvlite generate -f prompt_file --json FLAGS` in its own process: its JSON and its peak RSS (MB).

    The peak is read from /proc while the child runs: getrusage's ru_maxrss of a child counts the
    parent's RSS at fork time (Linux keeps the high-water mark across exec)."""
    kvlite = pathlib.Path(sys.executable).parent / "kvlite"
    cmd = [str(kvlite), "generate", "-f", prompt_file, "--json", *flags]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err)
        peak_kb, device = 0, [0.0]
        cuda = shutil.which("nvidia-smi") is not None
        if cuda:  # a CUDA machine: the device's peak too (nvidia-smi is slow: its own thread)
            threading.Thread(target=_poll_device, args=(proc, device), daemon=True).start()
        while proc.poll() is None:
            peak_kb = max(peak_kb, _vm_hwm_kb(proc.pid))
            time.sleep(0.05)
        if proc.returncode != 0:
            err.seek(0)
            why = err.read().decode().strip() or f"exit status {proc.returncode} (negative: killed by that signal)"
            raise SystemExit(f"{' '.join(cmd)} failed: {why}")
        out.seek(0)
        result = json.loads(out.read())
    result["peak_rss_mb"] = peak_kb / 1024
    result["peak_device_mb"] = device[0] if cuda else None
    return result


def _poll_device(proc: subprocess.Popen, peak: list[float]) -> None:
    """The most device memory nvidia-smi saw the process use (MiB)."""
    query = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
    while proc.poll() is None:
        try:
            rows = subprocess.run(query, capture_output=True, text=True, timeout=10).stdout.splitlines()
        except (OSError, subprocess.TimeoutExpired):
            return
        for row in rows:
            pid, _, used = row.partition(",")
            if pid.strip() == str(proc.pid) and used.strip().isdigit():
                peak[0] = max(peak[0], float(used))
        time.sleep(0.1)


def _vm_hwm_kb(pid: int) -> int:
    try:
        for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass  # it just exited
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192, help="prompt tokens")
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--policies", default=POLICIES, help="comma-separated; full is always run first")
    ap.add_argument("-n", "--n-predict", type=int, default=16)
    ap.add_argument("--kv-types", default="f16", help="comma-separated cache types, each for K and V")
    ap.add_argument("--prompt-file", default=None, help="the prompt's text (repeated to --tokens) instead of prose")
    ap.add_argument("--json", action="store_true")
    args, flags = ap.parse_known_args()  # other flags go to every evicting run: --repeat-chunk 128
    model = Model(default_model_path())
    names = ["full", *(p for p in args.policies.split(",") if p and p != "full")]
    rows = []
    with tempfile.TemporaryDirectory() as d:
        prompt = os.path.join(d, "prompt.txt")
        text = pathlib.Path(args.prompt_file).read_text() if args.prompt_file else None
        pathlib.Path(prompt).write_text(model.detokenize(prose_tokens(model, args.tokens, text)))
        del model
        for kv_type in args.kv_types.split(","):
            full = None
            for name in names:
                budget = [] if name == "full" else ["--budget", str(args.budget), *flags]
                r = generate_peak(prompt, "--policy", name, *budget, "-n", str(args.n_predict), "-ctk", kv_type,
                                  "-ctv", kv_type)  # fmt: skip
                row = dict(policy=name, kv_type=kv_type, peak_rss_mb=r["peak_rss_mb"],
                           peak_device_mb=r["peak_device_mb"], prompt_tokens=r["prompt_tokens"],
                           max_cells=r["cache"]["max_cells"], kv_bytes=r["cache"]["kv_bytes"],
                           evict_s=r["timings"].get("evict_s"), prefill_tok_s=r["timings"].get("prefill_tok_s"),
                           decode_tok_s=r["timings"].get("decode_tok_s"))  # fmt: skip
                full = full or row
                row["vs_full"] = row["peak_rss_mb"] / full["peak_rss_mb"]
                rows.append(row)
                row["kv_vs_first_full"] = row["kv_bytes"] / rows[0]["kv_bytes"]  # the first type's full cache
                mark = "" if name == "full" else ("  ok" if row["vs_full"] <= TARGET else f"  over {TARGET}x")
                dev = "" if r["peak_device_mb"] is None else f"  device {r['peak_device_mb']:7.0f} MiB"
                if not args.json:
                    share = f"1/{1 / row['kv_vs_first_full']:4.1f} of full {rows[0]['kv_type']}"
                    speed = f"prefill {row['prefill_tok_s'] or 0:6.1f}, decode {row['decode_tok_s'] or 0:5.1f} tok/s"
                    print(f"{name:10s} {kv_type:6s} {r['prompt_tokens']:6d} tokens  KV "
                          f"{row['kv_bytes'] / 2**20:7.1f} MiB ({share})  peak RSS {row['peak_rss_mb']:7.0f} MB "
                          f"{row['vs_full']:5.2f}x full {kv_type}{mark}  {speed}{dev}", flush=True)  # fmt: skip
    if args.json:
        print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
