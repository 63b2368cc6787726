"""A bounded load test of `kvlite serve`: N concurrent clients on 127.0.0.1, requests mixing
policies and multi-turn conversations, then the same prompts run directly (Session.generate, no
HTTP) for the throughput ratio. Prints: lost or duplicated requests (must be 0), p50/p95 latency,
tokens/s through the server and directly, and the server's RSS after warm-up and at the end
(flat within 10% is the target). Starts and stops its own server; run it alone (2 cores).

--kv-cells 0,4096 runs the same load on two servers in turn, a context per slot (0) and one pool of
4096 cells (whose slots' turns run at once, their decodes batched), and prints each one's figures
and their ratios.

usage: python scripts/bench_server.py [--requests 200] [--clients 8] [--kv-cells 0[,N]] [--direct N] [--json]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx2 as httpx
import numpy as np

from kvlite.api import Session
from kvlite.engine import Model
from kvlite.eval.haystack import haystack
from kvlite.models import default_model_path
from kvlite.policies import make_policy

POLICIES = [("full", None), ("snapkv", 128), ("echokv", 128), ("streaming", 128), ("tova", 128)]
MAX_TOKENS = 24


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def requests_for(n: int) -> list[dict]:
    """n requests: every 4th continues an earlier conversation (a second turn), the rest open one
    with a ~250-token document; policies round-robin."""
    docs = haystack(200)
    out = []
    for i in range(n):
        policy, budget = POLICIES[i % len(POLICIES)]
        extra = {"kv_policy": policy} | ({"kv_budget": budget} if budget else {})
        doc = " ".join(docs[(i * 7) % len(docs) : (i * 7) % len(docs) + 6])[:1200]
        messages = [{"role": "user", "content": f"Request {i}. {doc}\nSummarize this in one sentence."}]
        out.append({"id": i, "messages": messages, "extra": extra, "follow_up": i % 4 == 3})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--direct", type=int, default=None,
                    help="the first N measured requests run directly too (default: all; 0: none)")  # fmt: skip
    ap.add_argument("--kv-cells", default="0",
                    help="servers in turn: 0 a context per slot, N one pool of N cells (e.g. 0,4096)")  # fmt: skip
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    pools = [int(x) for x in args.kv_cells.split(",")]
    results = {}
    for cells in pools:
        results[f"kv_cells={cells}"] = serve_and_load(args, cells)
    reqs = requests_for(args.requests)
    warm = min(args.clients, len(reqs))
    if args.direct != 0:
        direct_tok_s = direct(reqs[warm:] if args.direct is None else reqs[warm : warm + args.direct])
        for r in results.values():
            r["direct_tok_s"] = direct_tok_s
            r["server_vs_direct"] = r["server_tok_s"] / direct_tok_s
    if len(pools) == 2:
        a, b = (results[f"kv_cells={c}"] for c in pools)
        results["ratios"] = {f"{k}_ratio": b[k] / a[k] for k in ("latency_p50_s", "latency_p95_s", "server_tok_s")}
    if args.json:
        print(json.dumps(results, indent=1))
        return
    for name, result in results.items():
        print(f"-- {name}")
        for k, v in result.items():
            print(f"{k:28s} {v:.3f}" if isinstance(v, float) else f"{k:28s} {v}")


def serve_and_load(args, kv_cells: int) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    kvlite = pathlib.Path(sys.executable).parent / "kvlite"
    cmd = [str(kvlite), "serve", "--port", str(port), "--slots", "4", "--queue", str(args.clients)]
    proc = subprocess.Popen(cmd + (["--kv-cells", str(kv_cells)] if kv_cells else []),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        return run(url, proc, args)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def run(url: str, proc: subprocess.Popen, args) -> dict:
    deadline = time.time() + 120
    while True:
        try:
            if httpx.get(url + "/health").status_code == 200:
                break
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            raise SystemExit(f"the server did not start: {proc.stderr.read() if proc.poll() is not None else ''}")
        time.sleep(0.1)
    reqs = requests_for(args.requests)
    answers: dict[int, list[str]] = {}
    latencies, tokens = [], []
    lock = threading.Lock()

    def ask(r: dict) -> None:
        body = {"messages": r["messages"], "max_tokens": MAX_TOKENS, **r["extra"]}
        t0 = time.perf_counter()
        replies = [httpx.post(url + "/v1/chat/completions", json=body, timeout=600).json()]
        if r["follow_up"]:  # a second turn on the same conversation: the slot's cache is reused
            answer = replies[0]["choices"][0]["message"]
            body["messages"] = [*r["messages"], answer, {"role": "user", "content": "Shorter."}]
            replies.append(httpx.post(url + "/v1/chat/completions", json=body, timeout=600).json())
        with lock:
            latencies.append(time.perf_counter() - t0)
            tokens.append(sum(reply["usage"]["completion_tokens"] for reply in replies))
            answers.setdefault(r["id"], []).extend(reply["id"] for reply in replies)

    warm = min(args.clients, len(reqs))
    with ThreadPoolExecutor(args.clients) as pool:
        list(pool.map(ask, reqs[:warm]))
        rss_start = rss_mb(proc.pid)
        t0 = time.perf_counter()
        list(pool.map(ask, reqs[warm:]))
        wall = time.perf_counter() - t0
    rss_end = rss_mb(proc.pid)
    metrics = httpx.get(url + "/metrics").text
    served = sum(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("kvlite_requests_total"))
    ids = [i for v in answers.values() for i in v]
    lost = len(reqs) - len(answers)
    expected = len(reqs) + sum(r["follow_up"] for r in reqs)
    duplicated = len(ids) - len(set(ids)) + max(0, len(ids) - expected)
    lat = np.array(latencies[warm:])
    server_tok_s = sum(tokens[warm:]) / wall
    return {
        "requests": len(reqs),
        "http_calls_answered": int(served),
        "http_calls_expected": expected,
        "lost": lost,
        "duplicated": duplicated,
        "clients": args.clients,
        "latency_p50_s": float(np.percentile(lat, 50)),
        "latency_p95_s": float(np.percentile(lat, 95)),
        "server_tok_s": server_tok_s,
        "rss_after_warmup_mb": rss_start,
        "rss_end_mb": rss_end,
        "rss_growth": rss_end / rss_start - 1,
    }


def direct(reqs: list[dict]) -> float:
    """The same conversations through the Python API in this process, one after another: decoded
    tokens per wall second (the ratio is what HTTP, the queue and the slots cost)."""
    model = Model(default_model_path())
    n, t0 = 0, time.perf_counter()
    for r in reqs:
        policy = make_policy(r["extra"]["kv_policy"], budget=r["extra"].get("kv_budget"))
        conv = Session(model, policy).conversation()
        turns = [r["messages"][0]["content"]] + (["Shorter."] if r["follow_up"] else [])
        for text in turns:
            conv.turn(text, MAX_TOKENS, None, lambda: False, progress=False)
        n += conv.runner.timings.decode_tokens
        conv.runner.close()
    return n / (time.perf_counter() - t0)


if __name__ == "__main__":
    main()
