"""A ggml RPC server on this machine's CPU backend (what llama.cpp's `rpc-server` tool does).

Clients reach its device with llama.cpp's --rpc (kvlite: `--rpc HOST:PORT -ngl N`): the layers
offloaded there, and their KV cache, live in a buffer that is not host memory, as on a GPU. That
is how kvlite's tests exercise the GPU code paths on a CPU-only machine. It serves until killed;
bind to 127.0.0.1 unless you mean to expose it (the protocol has no authentication).

usage: python scripts/rpc_server.py [--host 127.0.0.1] [--port 50052] [-t THREADS]
"""

from __future__ import annotations

import argparse
import sys

from kvlite.errors import KvliteError
from kvlite.native import rpc_serve


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=50052)
    ap.add_argument("-t", "--threads", type=int, default=1)
    args = ap.parse_args()
    print(f"rpc_server: serving the CPU backend at {args.host}:{args.port}", file=sys.stderr, flush=True)
    try:
        rpc_serve(f"{args.host}:{args.port}", args.threads)
    except KvliteError as e:
        print(f"rpc_server: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
