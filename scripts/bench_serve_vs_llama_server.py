"""kvlite serve against llama-server as its users run it (issues 31, 59), same model, same machine,
same threads: N clients at once, each holding a three-turn conversation over its own ~2K-token
document. The documents are the test split's `chat` task: the first turn gives the document, which
states four codes once; turns 2 and 3 each ask for one of them. Swept over N, for each configuration:

  kvlite-echokv       kvlite serve --slots N --kv-cells CELLS, echokv at BUDGET (the server's
  kvlite-laq          eviction mode unless --evict): the idle conversations are parked in host
                      memory at every turn, compressed
  llama-server-ram    llama-server -np N -c CELLS -kvu --cache-ram R --cache-idle-slots: one cache
                      of the same cells shared by the slots, idle slots saved whole to a host-RAM
                      prompt cache of R MiB, R the most host memory kvlite's parked caches took
                      at that N (either kvlite run's, at least 1: 0 turns the RAM cache off).
                      Turns that meet in the cache and do not fit fail ("Context size has been
                      exceeded"): llama-server parks only idle slots
  llama-server-queue  llama-server -np 1 -c CELLS --cache-ram R: one slot, the turns queue, and the
                      RAM prompt cache keeps the other conversations (restored by prefix)
  llama-server-full   llama-server -np N -c N*CTX: every conversation its whole context (memory
                      is free: the full cache's accuracy)

llama-server is built from the llama.cpp that llama-cpp-python 0.3.36 vendors
(scripts/build_llama_server.sh), so both sides run the same llama.cpp. Per run: generated tokens
per second over the run, p50/p95 time to the first token and latency of a turn (streamed), the
server's peak RSS, the parked caches' host memory (kvlite's /metrics) or the RAM cache given, the
share of questions answered (llama-server-full's is the full cache's), the turns that failed,
and the first turns' prompt tokens (the same on every side: one tokenization, one template).
Prints a table and the ratios, and writes a plot and the rows to --out. Resumable: a row already
in DIR/rows.jsonl is not run again. Run it alone (2 cores).

usage: python scripts/bench_serve_vs_llama_server.py [--clients 1,2,4,8,16,32] [--cells 4096]
       [--budget 256] [--evict eager|lazy] [--recall N] [--configs kvlite-echokv,...]
       [--out results-runs/serve-vs-llama-server] [--plot-only]
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx2 as httpx
import numpy as np

from kvlite.engine import Model
from kvlite.eval import tasks
from kvlite.eval.metrics import score
from kvlite.models import default_model_path
from kvlite.native import default_threads

ROOT = pathlib.Path(__file__).resolve().parent.parent
LENGTH, TURNS, MAX_TOKENS = 2048, 3, 32
CTX = 2560  # a conversation's context: its document, two questions and their replies
# Given, so both sides render the same prompt: llama-server's Jinja engine adds SmolLM2's default
# system prompt when a conversation has none, llama.cpp's built-in one (kvlite's) does not.
SYSTEM = "You are a helpful assistant."
# the order they run in: llama-server-ram and -queue take the kvlite runs' parked memory
CONFIGS = ["kvlite-echokv", "kvlite-laq", "llama-server-ram", "llama-server-queue", "llama-server-full"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peak_rss_mb(pid: int) -> float:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def command(config: str, n: int, port: int, args, ram_mib: int = 0) -> list[str]:
    model, threads = str(default_model_path()), str(args.threads)
    if config == "llama-server-full":
        return [args.llama_server, "-m", model, "--port", str(port), "-np", str(n), "-c", str(n * CTX), "-t", threads,
                "-tb", threads]  # fmt: skip
    if config == "llama-server-ram":
        return [args.llama_server, "-m", model, "--port", str(port), "-np", str(n), "-c", str(args.cells), "-kvu",
                "--cache-ram", str(ram_mib), "--cache-idle-slots", "-t", threads, "-tb", threads]  # fmt: skip
    if config == "llama-server-queue":
        return [args.llama_server, "-m", model, "--port", str(port), "-np", "1", "-c", str(args.cells),
                "--cache-ram", str(ram_mib), "-t", threads, "-tb", threads]  # fmt: skip
    policy = config.removeprefix("kvlite-")
    kvlite = str(pathlib.Path(sys.executable).parent / "kvlite")
    evict = ["--evict", args.evict] if args.evict else []
    recall = ["--recall", str(args.recall)] if args.recall else []
    return [kvlite, "serve", "-m", model, "--port", str(port), "--slots", str(n), "--kv-cells", str(args.cells),
            "--policy", policy, "--budget", str(args.budget), "-c", str(CTX), "-t", threads,
            "--queue", str(n), *evict, *recall]  # fmt: skip


def converse(url: str, sample: tasks.Sample) -> list[dict]:
    """One client's conversation, turn by turn, streamed: each turn's time to the first token,
    latency, prompt and generated tokens, score (None for the document turn) and error. A failed
    turn ends it."""
    messages, out = [{"role": "system", "content": SYSTEM}], []
    for text, answers in sample.turns[:TURNS]:
        messages.append({"role": "user", "content": text})
        body = {"model": "m", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        turn = {"ttft_s": None, "latency_s": None, "error": None, "tokens": 0, "prompt_tokens": 0, "score": None}
        out.append(turn)
        reply, t0 = "", time.perf_counter()
        try:
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=1800) as r:
                if r.status_code != 200:
                    turn["error"] = f"{r.status_code}: {r.read().decode(errors='replace')[:200]}"
                    break
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        turn["error"] = str(chunk["error"])[:200]
                    for choice in chunk.get("choices") or []:
                        piece = (choice.get("delta") or {}).get("content") or ""
                        if piece and turn["ttft_s"] is None:
                            turn["ttft_s"] = time.perf_counter() - t0
                        reply += piece
                    if chunk.get("usage"):
                        turn["tokens"] = chunk["usage"]["completion_tokens"]
                        turn["prompt_tokens"] = chunk["usage"]["prompt_tokens"]
        except httpx.TransportError as e:
            turn["error"] = f"transport: {e}"
        turn["latency_s"] = time.perf_counter() - t0
        if turn["error"]:
            break
        if answers:
            turn["score"] = score("contains_all", reply, answers)
        messages.append({"role": "assistant", "content": reply})
    return out


def kvlite_metrics(url: str) -> dict:
    """From kvlite's /metrics: the most host memory its parked caches held at once (MiB), and the
    seconds its requests spent reading (evictions apart), evicting and generating. Requests batched
    together each count a shared step, so the stages can sum past the wall time."""
    values = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        name, _, value = line.partition(" ")
        if name.startswith("kvlite_") and "{" not in name:
            values[name.removeprefix("kvlite_")] = float(value)
    stages = {"read": values["prefill_seconds_total"] - values["evict_seconds_total"],
              "evict": values["evict_seconds_total"], "decode": values["decode_seconds_total"]}  # fmt: skip
    return {"parked_mib": values["parked_bytes_peak"] / 2**20, "stages_s": stages}


def settings(args) -> dict:
    """What a row was run with: a row of other settings is neither reused nor shown (schema 2: the
    rows with streamed turns and llama-server-ram, from issue 59 on; a row without recall ran none)."""
    out = {"cells": args.cells, "budget": args.budget, "evict": args.evict, "threads": args.threads, "schema": 2}
    return {**out, "recall": args.recall} if args.recall else out


def same_settings(row: dict, args) -> bool:
    """llama-server-full's rows hold whatever kvlite's budget and eviction mode were (-ram's and -queue's
    RAM cache is the kvlite rows' parked memory: those of this budget and mode)."""
    kvlite_only = ("budget", "evict", "recall") if row["config"] == "llama-server-full" else ()
    wanted = {"recall": None, **settings(args)}
    return all(row.get(k) == v for k, v in wanted.items() if k not in kvlite_only)


def ram_for(n: int, rows: list[dict]) -> int:
    """--cache-ram of llama-server-ram and -queue at N: the most host memory a kvlite run parked, in MiB up."""
    parked = [r["parked_mib"] for r in rows if r["clients"] == n and r.get("parked_mib") is not None]
    return max(1, math.ceil(max(parked, default=0)))


def run(config: str, n: int, samples: list[tasks.Sample], args, ram_mib: int = 0) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(command(config, n, port, args, ram_mib), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline = time.time() + 300
        while True:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                err = proc.stderr.read()[-2000:] if proc.poll() is not None else "no answer in 300 s"
                return {"config": config, "clients": n, **settings(args), "started": False, "error": err}
            time.sleep(0.2)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(n) as clients:
            runs = list(clients.map(lambda s: converse(url, s), samples[:n]))
        wall = time.perf_counter() - t0
        rss = peak_rss_mb(proc.pid)
        measured = kvlite_metrics(url) if config.startswith("kvlite") else {}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    turns = [t for conv in runs for t in conv]
    done = [t for t in turns if t["error"] is None]
    asked = n * sum(1 for _, answers in samples[0].turns[:TURNS] if answers)
    pct = lambda key, q: float(np.percentile([t[key] for t in done if t[key] is not None] or [np.nan], q))  # noqa: E731
    return {
        "config": config,
        "clients": n,
        **settings(args),
        "started": True,
        "turns": n * TURNS,
        "failed_turns": n * TURNS - len(done),
        "errors": sorted({t["error"] for t in turns if t["error"]})[:3],
        "accuracy": sum(t["score"] or 0 for t in turns) / asked,
        "tok_s": sum(t["tokens"] for t in turns) / wall,
        "ttft_p50_s": pct("ttft_s", 50),
        "ttft_p95_s": pct("ttft_s", 95),
        "latency_p50_s": pct("latency_s", 50),
        "latency_p95_s": pct("latency_s", 95),
        "peak_rss_mb": rss,
        "parked_mib": measured.get("parked_mib"),
        "stages_s": measured.get("stages_s"),
        "cache_ram_mib": ram_mib or None,
        "first_prompt_tokens": [conv[0]["prompt_tokens"] for conv in runs],
        "wall_s": wall,
    }


def plot(rows: list[dict], path: pathlib.Path, cells: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    panels = (("tok_s", "generated tok/s", "throughput"), ("ttft_p50_s", "seconds", "time to first token, p50"),
              ("accuracy", "questions answered", f"accuracy (pools of {cells} cells; -full: N x {CTX})"))  # fmt: skip
    for ax, (key, ylabel, title) in zip(axes, panels):
        for config in CONFIGS:
            got = sorted((r["clients"], r) for r in rows if r["config"] == config and r.get("started"))
            if got:
                ax.plot([c for c, _ in got], [r[key] for _, r in got], "o-", label=config)
        ax.set(xlabel="conversations at once", ylabel=ylabel, xscale="log", title=title)
    axes[2].set_ylim(-0.05, 1.05)
    ns = sorted({r["clients"] for r in rows})
    for ax in axes:
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.minorticks_off()
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def report(rows: list[dict]) -> None:
    """The table, kvlite's tok/s over llama-server-ram's at each N, and whether every side read the
    same first-turn prompts as the same number of tokens."""
    print(f"{'config':18s} {'N':>3s} {'tok/s':>7s} {'ttft50':>7s} {'ttft95':>7s} {'lat50':>7s} {'lat95':>7s} "
          f"{'RSS MB':>7s} {'host MiB':>8s} {'acc':>5s} {'failed':>6s}")  # fmt: skip
    by = {(r["config"], r["clients"]): r for r in rows}
    for r in sorted(rows, key=lambda r: (r["clients"], CONFIGS.index(r["config"]))):
        if not r.get("started"):
            print(f"{r['config']:18s} {r['clients']:3d} did not start: {r['error'][-120:]}")
            continue
        host = r["parked_mib"] if r.get("parked_mib") is not None else r.get("cache_ram_mib")
        host = f"{host:8.1f}" if host is not None else f"{'-':>8s}"
        print(f"{r['config']:18s} {r['clients']:3d} {r['tok_s']:7.2f} {r['ttft_p50_s']:7.1f} {r['ttft_p95_s']:7.1f} "
              f"{r['latency_p50_s']:7.1f} {r['latency_p95_s']:7.1f} {r['peak_rss_mb']:7.0f} {host} "
              f"{r['accuracy']:5.2f} {r['failed_turns']:3d}/{r['turns']}")  # fmt: skip
    for r in sorted(rows, key=lambda r: (r["clients"], CONFIGS.index(r["config"]))):
        if r.get("stages_s"):
            stages = ", ".join(f"{k} {v:.0f} s" for k, v in r["stages_s"].items())
            print(f"N={r['clients']:<3d} {r['config']} request time by stage: {stages} (wall {r['wall_s']:.0f} s)")
    for n in sorted({r["clients"] for r in rows}):
        for baseline in ("llama-server-ram", "llama-server-queue"):
            base = by.get((baseline, n))
            for config in ("kvlite-echokv", "kvlite-laq"):
                mine = by.get((config, n))
                if base and mine and base.get("started") and mine.get("started") and base["tok_s"]:
                    print(f"N={n:<3d} {config} tok/s / {baseline}'s: {mine['tok_s'] / base['tok_s']:.2f}x")
        prompts = {r["config"]: r.get("first_prompt_tokens") for r in rows if r["clients"] == n and r.get("started")}
        if len({tuple(p) for p in prompts.values() if p and all(p)}) > 1:  # (0: the turn failed)
            print(f"N={n:<3d} first-turn prompt tokens differ: {prompts}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", default="1,2,4,8,16,32", help="the N to sweep")
    ap.add_argument("--cells", type=int, default=4096, help="the pools' KV cells (kvlite's and llama-server-ram's)")
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--evict", default=None, choices=["eager", "lazy"],
                    help="kvlite's chat eviction mode (default: kvlite serve's)")  # fmt: skip
    ap.add_argument("--recall", type=int, default=0, metavar="N", help="kvlite serve --recall N (default: off)")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("-t", "--threads", type=int, default=default_threads())
    ap.add_argument("--out", default=str(ROOT / "results-runs" / "serve-vs-llama-server"))
    ap.add_argument("--plot-only", action="store_true", help="the table and plot of the rows there, nothing run")
    args = ap.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows_path = out / "rows.jsonl"
    rows = [json.loads(line) for line in rows_path.read_text().splitlines()] if rows_path.exists() else []
    rows = [r for r in rows if r["config"] in CONFIGS and same_settings(r, args)]
    configs = [c for c in CONFIGS if c in args.configs.split(",")]
    if not args.plot_only and any(c.startswith("llama-server") for c in configs):
        build = subprocess.run(["bash", str(ROOT / "scripts" / "build_llama_server.sh")], capture_output=True,
                               text=True)  # fmt: skip
        if build.returncode != 0:
            raise SystemExit(f"llama-server did not build:\n{build.stderr[-3000:]}")
        args.llama_server = build.stdout.strip()
    if not args.plot_only:
        model = Model(default_model_path())
        count = lambda text: len(model.tokenize(text, add_special=False, parse_special=False))  # noqa: E731
        ns = [int(x) for x in args.clients.split(",")]
        samples = tasks.generate("chat", max(ns), LENGTH, count, split="test")
        del model
        for n in ns:
            for config in configs:
                if any(r["config"] == config and r["clients"] == n for r in rows):
                    continue
                ram = ram_for(n, rows) if config in ("llama-server-ram", "llama-server-queue") else 0
                print(f"{config} with {n} clients{f' (--cache-ram {ram})' if ram else ''} ...", file=sys.stderr,
                      flush=True)  # fmt: skip
                row = run(config, n, samples, args, ram)
                rows.append(row)
                with open(rows_path, "a") as f:
                    f.write(json.dumps(row) + "\n")
    report(rows)
    plot(rows, out / "serve_vs_llama_server.png", args.cells)
    print(f"plot: {out / 'serve_vs_llama_server.png'}", file=sys.stderr)


if __name__ == "__main__":
    main()
