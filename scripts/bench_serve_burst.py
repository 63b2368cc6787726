"""What a new user tries first: four short conversations sent to `kvlite serve` at once, against the
same four one after another. Two servers run side by side on the default model, the default (a
context a slot, one request at a time) and one pool for the four slots (`--kv-cells 16384`, 4 x -c:
their turns run at once, their decodes batched); the rounds alternate between them. Prints each
round's generated tok/s both ways and the medians; run it alone (2 cores).

Then why, in process on one pool (no HTTP): the decode tok/s of one conversation alone, of four at
once (their decodes batched), and of one beside three idle conversations holding about 4K cells (attention
spans the pool up to its highest cell in use, which is why the server parks idle conversations).

usage: python scripts/bench_serve_burst.py [--rounds 5] [--max-tokens 64] [--json]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx2 as httpx
from bench_server import free_port

from kvlite.api import Session
from kvlite.engine import Model, Pool
from kvlite.models import default_model_path
from kvlite.policies import make_policy
from kvlite.settings import RunSettings

QUESTIONS = ["Name three fruits.", "What is the capital of France?", "Write a haiku about rain.",
             "Count from one to ten."]  # fmt: skip
SERVERS = {"default": [], "--kv-cells 16384": ["--kv-cells", "16384"]}


def ask(url: str, question: str, max_tokens: int) -> int:
    """One conversation's first turn at temperature 0; the tokens generated."""
    body = {"model": "m", "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "temperature": 0}  # fmt: skip
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
    r.raise_for_status()
    return r.json()["usage"]["completion_tokens"]


def start(flags: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    kvlite = pathlib.Path(sys.executable).parent / "kvlite"
    proc = subprocess.Popen([str(kvlite), "serve", "--port", str(port), *flags], stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            sys.exit(f"kvlite serve {' '.join(flags)} exited with status {proc.returncode}")
        time.sleep(0.5)
    sys.exit("kvlite serve did not come up in 5 minutes")


def in_process(max_tokens: int) -> dict[str, float]:
    """Generated tok/s on one pool: one conversation, four at once, one beside three idle ones."""
    model = Model(default_model_path())
    pool = Pool(model, 16384, 8)
    settings = RunSettings(n_ctx=4096)

    def generate(i: int, n: int = max_tokens) -> tuple[int, float]:
        conv = Session(model, make_policy("full"), settings, pool=pool).conversation()
        with pool.ctx.batcher.turn(conv.runner.cache.lane):
            t = time.perf_counter()
            reply, _ = conv.turn([{"role": "user", "content": QUESTIONS[i % 4]}], n, None, lambda: False,
                                 progress=False)  # fmt: skip
            dt = time.perf_counter() - t
        n_tokens = conv.runner.timings.decode_tokens
        conv.runner.close()
        return n_tokens, dt

    generate(0, 8)  # warm-up
    out = {"alone_tok_s": statistics.median(n / dt for n, dt in (generate(i) for i in range(3)))}
    with ThreadPoolExecutor(4) as threads:
        t = time.perf_counter()
        n = sum(k for k, _ in threads.map(generate, range(4)))
        out["four_at_once_tok_s"] = n / (time.perf_counter() - t)
    idle = []
    for i in range(3):
        conv = Session(model, make_policy("full"), settings, pool=pool).conversation()
        conv.turn([{"role": "user", "content": f"word {i} " * 450}], 1, None, lambda: False, progress=False)
        idle.append(conv)
    out["idle_cells"] = pool.ctx.cells_in_use()
    out["beside_idle_tok_s"] = statistics.median(n / dt for n, dt in (generate(i) for i in range(3)))
    pool.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    procs = {name: start(flags) for name, flags in SERVERS.items()}
    rounds: dict[str, list[dict]] = {name: [] for name in SERVERS}
    try:
        for _, url in procs.values():
            ask(url, "Hello.", 8)  # warm-up
        with ThreadPoolExecutor(len(QUESTIONS)) as clients:
            for i in range(args.rounds):
                for name, (_, url) in procs.items():
                    t = time.perf_counter()
                    n_seq = sum(ask(url, q, args.max_tokens) for q in QUESTIONS)
                    t_seq = time.perf_counter() - t
                    t = time.perf_counter()
                    n_once = sum(clients.map(lambda q, url=url: ask(url, q, args.max_tokens), QUESTIONS))
                    t_once = time.perf_counter() - t
                    r = {"one_after_another_tok_s": n_seq / t_seq, "at_once_tok_s": n_once / t_once}
                    r["at_once_vs_one_after_another"] = r["at_once_tok_s"] / r["one_after_another_tok_s"]
                    rounds[name].append(r)
                    if not args.json:
                        print(f"round {i + 1} {name:16s} one after another {r['one_after_another_tok_s']:5.1f} tok/s,"
                              f" at once {r['at_once_tok_s']:5.1f} tok/s: {r['at_once_vs_one_after_another']:.2f}x",
                              flush=True)  # fmt: skip
    finally:
        for proc, _ in procs.values():
            proc.terminate()
            proc.wait(timeout=60)
    medians = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in rounds.items()}
    for name, m in medians.items():
        print(f"median {name:16s} one after another {m['one_after_another_tok_s']:5.1f} tok/s, at once "
              f"{m['at_once_tok_s']:5.1f} tok/s: {m['at_once_vs_one_after_another']:.2f}x")  # fmt: skip
    steps = in_process(args.max_tokens)
    if args.json:
        print(json.dumps({"rounds": rounds, "medians": medians, "in_process": steps}, indent=1))
        return
    (a, ma), (b, mb) = medians.items()
    print(f"{b} / {a}: one after another {mb['one_after_another_tok_s'] / ma['one_after_another_tok_s']:.2f}x, "
          f"at once {mb['at_once_tok_s'] / ma['at_once_tok_s']:.2f}x")  # fmt: skip
    alone = steps["alone_tok_s"]
    print(f"in process, one pool: one conversation {alone:.1f} tok/s; four at once {steps['four_at_once_tok_s']:.1f} "
          f"({steps['four_at_once_tok_s'] / alone:.2f}x); one beside {steps['idle_cells']} idle cells "
          f"{steps['beside_idle_tok_s']:.1f} ({steps['beside_idle_tok_s'] / alone:.2f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
