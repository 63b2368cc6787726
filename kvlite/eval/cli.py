"""`kvlite eval`: run a grid (or merge shards) and write records, summary tables and plots."""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import sys

from ..errors import KvliteError


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got '{text}'") from None


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def add_parser(sub) -> None:
    from . import ruler
    from .specs import split_policies
    from .tasks import TASKS

    p = sub.add_parser(
        "eval",
        help="evaluate policies x budgets on generated tasks or LongBench-format JSONL",
        description="Runs every (model, sample, policy, budget) cell not already in --out, then writes "
        "summary.csv, summary.md and plots/. Command-line values override a --config TOML file.",
    )
    p.add_argument("--config", help="TOML file with any of the options below (e.g. policies = ['full', 'echokv'])")
    p.add_argument("-m", "--model", dest="models", action="append", default=None, metavar="MODEL",
                   help="GGUF model (repeat for several; default: SmolLM2-135M-Instruct)")  # fmt: skip
    p.add_argument("--data", action="append", default=None, help="LongBench- or RULER-format JSONL file (repeatable)")
    p.add_argument(
        "--dataset", default=None, help="LongBench dataset name (or ruler_<task>) for lines without a 'dataset' field"
    )
    p.add_argument("--metric", default=None, help="override the dataset's metric")
    p.add_argument("--limit", type=int, default=None, help="at most this many samples per data file")
    p.add_argument(
        "--tasks",
        type=_names,
        default=None,
        help=f"generated tasks: {', '.join(TASKS)} (default single,multikey,twohop unless --data); paste-single "
        "and the like: the same document and question without the task's instructions, as a user pastes them",
    )
    p.add_argument("--ruler", type=_names, nargs="?", const=[], default=None, metavar="TASKS",
                   help="RULER's tasks at --lengths, generated offline from NVIDIA's packaged RULER with the "
                   "model's tokenizer (the ruler extra): all 13, or some of "
                   f"{','.join(ruler.TASKS)} (docs/results.md, \"RULER\")")  # fmt: skip
    p.add_argument("--lengths", type=_ints, default=None, help="prompt lengths in tokens (default 1024)")
    p.add_argument("-n", type=int, default=None, help="samples per task and length (default 4)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--split", choices=("tune", "test"), default=None,
                   help="generated tasks' prose and phrasing: tune (docstrings; where defaults are chosen) or test "
                   "(news articles, other phrasing; where results are reported). Default tune")  # fmt: skip
    p.add_argument(
        "--depth", type=float, default=None, help="evidence depth in [0, 1] (default: drawn per sample from [0.1, 0.9])"
    )
    p.add_argument("--policies", type=split_policies, default=None,
                   help="comma-separated, parameters as echokv(T=8,aggregate=mean); default: full,streaming,snapkv,"
                   "echokv")  # fmt: skip
    p.add_argument("--budgets", type=_names, default=None,
                   help="comma-separated KV budgets: cells, or a share of each prompt as kvpress's compression "
                   "ratios are (25%% keeps a quarter: ratio 0.75); default 128,256")  # fmt: skip
    p.add_argument(
        "--kv-types",
        type=_names,
        default=None,
        metavar="TYPES",
        help="comma-separated cache types, each for K and V (-ctk/-ctv): a grid axis (default f16)",
    )
    p.add_argument("--n-predict", type=int, default=None, help="generation length (default: each task's)")
    p.add_argument("--max-length", type=int, default=None,
                   help="longer prompts keep their first and last halves, as LongBench does "
                   "(default: the model's training context)")  # fmt: skip
    p.add_argument("--diagnostics", action="store_true", default=None,
                   help="also measure EchoKV's KV overlap (Table 1) on generated samples")  # fmt: skip
    p.add_argument("--evolution", action="store_true", default=None,
                   help="chunked cells record the positions kept at every refresh (cache-evolution plots)")  # fmt: skip
    p.add_argument("-t", "--threads", type=int, default=None)
    p.add_argument("--rpc", default=None, metavar="SERVERS", help="comma-separated HOST:PORT of ggml RPC servers")
    p.add_argument("-ngl", "--n-gpu-layers", type=int, default=None, metavar="N",
                   help="layers to offload to the GPU (default: all on a CUDA or Metal build)")  # fmt: skip
    p.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                   help="run the units on Ray: a local instance, or the cluster at ADDRESS (ray start --head); "
                   "needs the ray extra")  # fmt: skip
    p.add_argument("--shard", default=None, help="i/n: run every n-th sample starting at the i-th")
    p.add_argument("--out", default=None, help="output directory (default eval-out)")
    p.add_argument("--merge", nargs="+", metavar="DIR", help="merge shard directories into --out, run nothing")
    p.add_argument("--no-plots", action="store_true", help="skip the plots")
    p.add_argument("--json", action="store_true", help="print the summary rows as JSON on stdout")


def cmd_eval(args) -> int:
    from ..progress import progress_bar
    from . import report, ruler
    from .grid import Grid, GridConfig
    from .records import prepare_out, read_records, record_key, write_atomic

    if args.ruler == []:  # --ruler alone: every task
        args.ruler = list(ruler.TASKS)
    overrides = {k: getattr(args, k) for k in ("models", "data", "dataset", "metric", "limit", "tasks", "ruler",
                                               "lengths", "n", "seed", "split", "depth", "policies", "budgets",
                                               "n_predict", "max_length", "diagnostics", "evolution", "threads",
                                               "n_gpu_layers", "shard", "out", "ray", "kv_types")}  # fmt: skip
    cfg = GridConfig.load(args.config, overrides)
    if args.rpc and cfg.ray:
        raise KvliteError("--rpc and --ray together are not supported: the RPC servers would be the driver's only")
    if args.rpc:
        from ..native import rpc_add_servers

        rpc_add_servers(args.rpc)
    out = cfg.out_dir
    failures = 0
    nodes: dict[str, list[dict]] = {}  # --ray: the records each worker node made
    if args.merge:
        for d in map(pathlib.Path, args.merge):
            if not d.is_dir():
                raise KvliteError(f"--merge: not a directory: {d}")
        prepare_out(out)
        # with the records --out already holds: a merge adds, never replaces what it did not read
        merged = {record_key(r): r for r in read_records(out)}
        before = len(merged)
        for d in map(pathlib.Path, args.merge):
            for r in read_records(d):
                merged[record_key(r)] = r
            for err in d.glob("errors*.jsonl"):
                shutil.copyfile(err, out / f"errors.{d.name}.jsonl")
        write_atomic(out / "samples.jsonl", "".join(json.dumps(r) + "\n" for r in merged.values()))
        print(f"[kvlite eval] merged: {out} held {before} records, now {len(merged)}", file=sys.stderr)
    else:
        grid = Grid(cfg)
        with progress_bar(grid.count_todo(), "eval", unit="cell", lines=True) as bar:
            if cfg.ray:
                from .distributed import run as run_on_ray

                nodes = run_on_ray(grid, progress=bar)
            else:
                grid.run(progress=bar)
        failures = grid.failures
    records = read_records(out)
    rows = report.write_summary(out, records)
    if not args.no_plots and rows:
        report.write_plots(out, records, rows)
    if args.json:
        print(json.dumps(rows))
    else:
        print(report.to_markdown(rows))
        for where, recs in [("", records), *((f" ray node {n}:", rs) for n, rs in sorted(nodes.items()))]:
            t = report.throughput(recs)
            if t["total_s"]:
                share = 100 * t["overhead_share"]
                print(f"[kvlite eval]{where} {t['cells']} cells, {t['total_s']:.0f} s: model {t['model_s']:.0f} s, "
                      f"policies {t['policy_s']:.0f} s, harness overhead {share:.1f}%; reading each prompt once "
                      f"saved ~{t['replay_saved_s']:.0f} s", file=sys.stderr)  # fmt: skip
    if failures:
        print(f"kvlite eval: {failures} cell(s) or line(s) failed (see {out}/errors*.jsonl); the rest is in {out}",
              file=sys.stderr)  # fmt: skip
        return 1
    return 0
