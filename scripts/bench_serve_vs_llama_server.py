"""kvlite serve against llama-server (issue 31), same model, same machine, same threads: N clients
at once, each holding a three-turn conversation over its own ~2K-token document. The documents are
the test split's `chat` task: the first turn gives the document, which states four codes once;
turns 2 and 3 each ask for one of them. Swept over N, for each configuration:

  llama-server-full   llama-server -np N -c N*CTX: every conversation its whole context
  llama-server-pool   llama-server -np N -c CELLS: the KV memory kvlite's pool has
  kvlite-echokv       kvlite serve --slots N --kv-cells CELLS --evict EVICT, echokv at BUDGET
  kvlite-laq          kvlite serve --slots N --kv-cells CELLS --evict EVICT, laq at BUDGET

(--evict eager by default: each conversation then holds its budget between turns; lazy holds whole
turns up to its cap, CTX, and lets the pool park the idle ones.)

llama-server is built from the llama.cpp that llama-cpp-python 0.3.36 vendors
(scripts/build_llama_server.sh), so both sides run the same llama.cpp. Per run: generated tokens
per second over the run, p50/p95 latency of a turn, the server's peak RSS, the share of questions
answered right (llama-server-full's is the full cache's), and the turns that failed. Prints a
table and writes a plot (tok/s and accuracy against N) and the rows to --out. Resumable: a row
already in DIR/rows.jsonl is not run again. Run it alone (2 cores).

usage: python scripts/bench_serve_vs_llama_server.py [--clients 1,2,4,8] [--cells 4096] [--budget 256]
       [--evict eager|lazy] [--out results-runs/serve-vs-llama-server] [--plot-only]
"""

from __future__ import annotations

import argparse
import json
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
CONFIGS = ["llama-server-full", "llama-server-pool", "kvlite-echokv", "kvlite-laq"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peak_rss_mb(pid: int) -> float:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def command(config: str, n: int, port: int, args) -> list[str]:
    model, threads = str(default_model_path()), str(args.threads)
    if config.startswith("llama-server"):
        cells = n * CTX if config == "llama-server-full" else args.cells
        return [args.llama_server, "-m", model, "--port", str(port), "-np", str(n), "-c", str(cells), "-t", threads,
                "-tb", threads]  # fmt: skip
    policy = config.removeprefix("kvlite-")
    kvlite = str(pathlib.Path(sys.executable).parent / "kvlite")
    return [kvlite, "serve", "-m", model, "--port", str(port), "--slots", str(n), "--kv-cells", str(args.cells),
            "--policy", policy, "--budget", str(args.budget), "-c", str(CTX), "-t", threads,
            "--evict", args.evict, "--queue", str(n)]  # fmt: skip


def converse(url: str, sample: tasks.Sample) -> list[dict]:
    """One client's conversation, turn by turn: each turn's latency, tokens, score (None for the
    document turn) and error. A failed turn ends it."""
    messages, out = [], []
    for text, answers in sample.turns[:TURNS]:
        messages.append({"role": "user", "content": text})
        body = {"model": "m", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
        t0 = time.perf_counter()
        try:
            r = httpx.post(url + "/v1/chat/completions", json=body, timeout=1800)
            ok = r.status_code == 200
            error = None if ok else f"{r.status_code}: {r.text[:200]}"
        except httpx.TransportError as e:
            ok, error = False, f"transport: {e}"
        turn = {"latency_s": time.perf_counter() - t0, "error": error, "tokens": 0, "score": None}
        out.append(turn)
        if not ok:
            break
        reply = r.json()["choices"][0]["message"]["content"]
        turn["tokens"] = r.json()["usage"]["completion_tokens"]
        if answers:
            turn["score"] = score("contains_all", reply, answers)
        messages.append({"role": "assistant", "content": reply})
    return out


def settings(args) -> dict:
    """What a row was run with: a row of other settings is neither reused nor shown."""
    return {"cells": args.cells, "budget": args.budget, "evict": args.evict, "threads": args.threads}


def same_settings(row: dict, args) -> bool:
    """llama-server's rows hold whatever kvlite's budget and eviction mode were."""
    kvlite_only = ("budget", "evict") if row["config"].startswith("llama-server") else ()
    return all(row.get(k) == v for k, v in settings(args).items() if k not in kvlite_only)


def run(config: str, n: int, samples: list[tasks.Sample], args) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(command(config, n, port, args), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
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
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    turns = [t for conv in runs for t in conv]
    asked = n * sum(1 for _, answers in samples[0].turns[:TURNS] if answers)
    lat = np.array([t["latency_s"] for t in turns if t["error"] is None] or [np.nan])
    return {
        "config": config,
        "clients": n,
        **settings(args),
        "started": True,
        "turns": n * TURNS,
        "failed_turns": n * TURNS - sum(t["error"] is None for t in turns),
        "errors": sorted({t["error"] for t in turns if t["error"]})[:3],
        "accuracy": sum(t["score"] or 0 for t in turns) / asked,
        "tok_s": sum(t["tokens"] for t in turns) / wall,
        "latency_p50_s": float(np.percentile(lat, 50)),
        "latency_p95_s": float(np.percentile(lat, 95)),
        "peak_rss_mb": rss,
        "wall_s": wall,
    }


def plot(rows: list[dict], path: pathlib.Path, cells: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for config in CONFIGS:
        got = sorted((r["clients"], r) for r in rows if r["config"] == config and r.get("started"))
        if got:
            a.plot([c for c, _ in got], [r["tok_s"] for _, r in got], "o-", label=config)
            b.plot([c for c, _ in got], [r["accuracy"] for _, r in got], "o-", label=config)
    a.set(xlabel="conversations at once", ylabel="generated tok/s", xscale="log", title="throughput")
    b.set(xlabel="conversations at once", ylabel="questions answered", xscale="log", ylim=(-0.05, 1.05),
          title=f"accuracy (pools of {cells} cells; -full: N x {CTX})")  # fmt: skip
    ns = sorted({r["clients"] for r in rows})
    for ax in (a, b):
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.minorticks_off()
    a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", default="1,2,4,8", help="the N to sweep")
    ap.add_argument("--cells", type=int, default=4096, help="the pools' KV cells (kvlite's and llama-server-pool's)")
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--evict", default="eager", choices=["eager", "lazy"], help="kvlite's chat eviction mode")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("-t", "--threads", type=int, default=default_threads())
    ap.add_argument("--out", default=str(ROOT / "results-runs" / "serve-vs-llama-server"))
    ap.add_argument("--plot-only", action="store_true", help="the table and plot of the rows there, nothing run")
    args = ap.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows_path = out / "rows.jsonl"
    rows = [json.loads(line) for line in rows_path.read_text().splitlines()] if rows_path.exists() else []
    rows = [r for r in rows if same_settings(r, args)]
    if not args.plot_only:
        build = subprocess.run(["bash", str(ROOT / "scripts" / "build_llama_server.sh")], capture_output=True,
                               text=True)  # fmt: skip
        if build.returncode != 0:
            raise SystemExit(f"llama-server did not build:\n{build.stderr[-3000:]}")
        args.llama_server = build.stdout.strip()
        model = Model(default_model_path())
        count = lambda text: len(model.tokenize(text, add_special=False, parse_special=False))  # noqa: E731
        ns = [int(x) for x in args.clients.split(",")]
        samples = tasks.generate("chat", max(ns), LENGTH, count, split="test")
        del model
        done = {(r["config"], r["clients"]) for r in rows}
        for n in ns:
            for config in args.configs.split(","):
                if (config, n) in done:
                    continue
                print(f"{config} with {n} clients ...", file=sys.stderr, flush=True)
                row = run(config, n, samples, args)
                rows.append(row)
                with open(rows_path, "a") as f:
                    f.write(json.dumps(row) + "\n")
    print(
        f"{'config':18s} {'N':>3s} {'tok/s':>7s} {'p50 s':>7s} {'p95 s':>7s} {'RSS MB':>7s} {'acc':>5s} {'failed':>6s}"
    )
    for r in sorted(rows, key=lambda r: (r["clients"], CONFIGS.index(r["config"]))):
        if not r.get("started"):
            print(f"{r['config']:18s} {r['clients']:3d} did not start: {r['error'][-120:]}")
            continue
        print(f"{r['config']:18s} {r['clients']:3d} {r['tok_s']:7.2f} {r['latency_p50_s']:7.1f} "
              f"{r['latency_p95_s']:7.1f} {r['peak_rss_mb']:7.0f} {r['accuracy']:5.2f} "
              f"{r['failed_turns']:3d}/{r['turns']}")  # fmt: skip
    plot(rows, out / "serve_vs_llama_server.png", args.cells)
    print(f"plot: {out / 'serve_vs_llama_server.png'}", file=sys.stderr)


if __name__ == "__main__":
    main()
