"""One backend's numbers against another's (issue 28): the CPU build against a GPU build.

--dump FILE, run with each build's Python: on every tiny fixture (kvlite.reference.tiny_gguf.FIXTURES,
f32 weights, an f32 cache), the prefill logits of 40 fixed tokens, and for each policy what
`Session.generate` (what `kvlite generate` runs) kept of a 600-token prompt at budget 100 and its
first 8 tokens. One process, and one model load per fixture: a GPU backend compiles its shaders
once, not once a policy (docs/gpu.md has the times).
--compare A B: the logits within ATOL_LOGITS, and the kept positions of each run overlapping in at
least MIN_KEPT_OVERLAP of the budget. Exits 1, naming what differs, where they do not.

Tolerances: the logits are O(1-10), and a GPU backend sums in another order, in f16 where its
matmul shaders do (ggml-vulkan on a device with fp16 arithmetic): 2e-2 is within what the f16 cache
test (tests/test_reference_parity.py) allows for one f16 rounding of K and V. A kept set is a top-k
of scores: a position whose score is within that noise of the k-th may swap with it, so the sets
are held to 90% overlap, and the texts are printed, not asserted.

usage: python scripts/backend_parity.py --dump FILE | --compare A B
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile

import numpy as np

ATOL_LOGITS = 2e-2
MIN_KEPT_OVERLAP = 0.9
PROMPT = "abcdefghij" * 60  # 600 byte-level tokens
POLICIES = {  # name: make_policy's parameters (the CLI's -T is lookahead, --cache J is budget J, chunked)
    "snapkv": dict(budget=100),
    "laq": dict(budget=100, lookahead=4, workspace=200),
    "echokv": dict(budget=100, lookahead=4, workspace=200),
    "kvzip": dict(budget=100),
    "knorm": dict(budget=100),
    "cc-fast": dict(budget=100),
    "streaming": dict(budget=96, mode="chunked"),
}


def dump(out: pathlib.Path) -> None:
    from kvlite.api import Session
    from kvlite.cache import KVCache
    from kvlite.engine import Context, Model
    from kvlite.native import default_device
    from kvlite.policies import make_policy
    from kvlite.reference.tiny_gguf import FIXTURES, write_tiny_gguf
    from kvlite.settings import RunSettings

    result: dict = {"kernels_on": default_device(), "archs": {}}
    with tempfile.TemporaryDirectory() as d:
        for name, spec in FIXTURES.items():
            model = Model(str(write_tiny_gguf(pathlib.Path(d) / f"{name}.gguf", spec)))
            ctx = Context(model, n_ctx=256, n_batch=64, type_k="f32", type_v="f32")
            tokens = [int(t) for t in np.random.default_rng(0).integers(3, model.n_vocab, size=40)]
            KVCache(ctx).append(tokens, logits="all")
            logits = np.stack([ctx.logits(i) for i in range(len(tokens))])
            ctx.close()
            runs = {}
            for policy, params in POLICIES.items():
                if policy.startswith("cc") and spec.arch == "gemma3":
                    continue  # the counter-causal pass refuses gemma3 (docs/policies.md)
                settings = RunSettings(chunk=32) if policy == "streaming" else RunSettings()  # h = 32
                g = Session(model, make_policy(policy, **params), settings).generate(PROMPT, 8).as_dict()
                runs[policy] = dict(text=g["text"], kept=g["cache"]["kept_positions"],
                                    kv_buffers=g["cache"]["kv_buffers"])  # fmt: skip
            result["archs"][name] = dict(logits=logits.tolist(), runs=runs)
            model.close()
    out.write_text(json.dumps(result))
    print(f"wrote {out} (kernels on {result['kernels_on']})")


def _kept(kept) -> set:
    """kept_positions as a set, whatever its nesting (per sequence or flat)."""
    if isinstance(kept, dict):
        kept = [p for v in kept.values() for p in v]
    return set(map(int, np.asarray(kept).ravel().tolist()))


def compare(a_path: pathlib.Path, b_path: pathlib.Path) -> int:
    a, b = json.loads(a_path.read_text()), json.loads(b_path.read_text())
    print(f"{a_path.name}: kernels on {a['kernels_on']}; {b_path.name}: kernels on {b['kernels_on']}")
    bad = []
    for name, ra in a["archs"].items():
        rb = b["archs"][name]
        err = float(np.abs(np.array(ra["logits"]) - np.array(rb["logits"])).max())
        print(f"{name:7s} logits max |diff| {err:.2e} (atol {ATOL_LOGITS})")
        if not err <= ATOL_LOGITS:
            bad.append(f"{name}: logits differ by {err:.2e}")
        for policy, pa in ra["runs"].items():
            pb = rb["runs"][policy]
            ka, kb = _kept(pa["kept"]), _kept(pb["kept"])
            overlap = len(ka & kb) / max(len(ka), 1)
            same = "same text" if pa["text"] == pb["text"] else f"text {pa['text']!r} vs {pb['text']!r}"
            print(f"        {policy:9s} kept {len(ka)} vs {len(kb)}, overlap {overlap:.2f}  {same}  "
                  f"cache on {list(pb['kv_buffers'])}")  # fmt: skip
            if len(ka) != len(kb) or overlap < MIN_KEPT_OVERLAP:
                bad.append(f"{name} {policy}: kept {len(ka)} vs {len(kb)} positions, overlap {overlap:.2f}")
    for line in bad:
        print(f"backend_parity: {line}", file=sys.stderr)
    return 1 if bad else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--dump", type=pathlib.Path, metavar="FILE")
    g.add_argument("--compare", type=pathlib.Path, nargs=2, metavar=("A", "B"))
    args = ap.parse_args()
    if args.dump:
        dump(args.dump)
    else:
        sys.exit(compare(*args.compare))


if __name__ == "__main__":
    main()
