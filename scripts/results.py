"""Regenerate docs/results.md and its plots: full-cache calibration, every policy at budgets 64-512
on the generated tasks the full cache solves, fidelity, EchoKV's Table 1 and Table 6 diagnostics,
and sweeps of the knobs that decide quality. Each grid resumes from results-runs/ (not committed),
so an interrupted run picks up where it stopped.

    .venv/bin/python scripts/results.py            # both models, ~1.5 h on 2 cores
    .venv/bin/python scripts/results.py --quick    # a smoke run of the script itself (minutes)
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import sys
from collections import defaultdict

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvlite.eval import report  # noqa: E402
from kvlite.eval.grid import Grid, GridConfig, read_records  # noqa: E402
from kvlite.progress import progress_bar  # noqa: E402

MODELS = {"smol": "default", "qwen": "qwen2.5-coder-0.5b"}
POLICIES = ["full", "streaming", "h2o", "tova", "snapkv", "dapq", "laq", "echokv", "cc", "cc-fast"]
BUDGETS = [64, 128, 256, 512]
TASKS = ["single", "multikey", "twohop", "vt"]
SWEEPS = [
    "echokv(T=8)", "echokv(T=24)", "echokv(aggregate=mean)", "echokv(aggregate=votes)", "echokv(kernel=0)",
    "echokv(kernel=3)", "echokv(kernel=13)", "echokv(B1=256)", "echokv(B1=512)", "laq(B1=256)",
    "cc(surprise=logprob)", "cc-fast(surprise=logprob)",
]  # fmt: skip
SOLVED = 0.5  # a task enters the policy grid where the full cache solves at least this share


SKIP_RUN = False  # --skip-run: tables from what results-runs/ holds (a partial run shows its n)


def run(name: str, out: pathlib.Path, **cfg) -> list[dict]:
    if SKIP_RUN:
        return read_records(out / name) if (out / name).exists() else []
    grid = Grid(GridConfig(out=str(out / name), **cfg))
    with progress_bar(grid.count_todo(), name, unit="cell") as bar:
        grid.run(progress=bar)
    if grid.failures:
        print(f"{name}: {grid.failures} failure(s), see {out / name}/errors.jsonl", file=sys.stderr)
    return read_records(out / name)


def mean(xs) -> float:
    xs = [x for x in xs if x is not None]
    return float(np.mean(xs)) if xs else float("nan")


def calibration_table(records_by_model: dict[str, list[dict]]) -> tuple[str, dict]:
    lines = ["| model | task | full-cache accuracy | n |", "|---|---|---|---|"]
    solved = {}
    for m, records in records_by_model.items():
        model = next(iter({r["model"] for r in records}), m)
        by = defaultdict(list)
        for r in records:
            if r["policy"] == "full":
                by[r["task"]].append(r["score"])
        for task, scores in sorted(by.items()):
            lines.append(f"| {model} | {task} | {mean(scores):.2f} | {len(scores)} |")
            solved[(m, task)] = mean(scores)
    return "\n".join(lines), solved


def overlap_table(records: list[dict]) -> str:
    diags = [r["overlap"] for r in records if "overlap" in r]
    if not diags:
        return "(no diagnostics)"
    steps = len(diags[0]["frozen"])
    head = "| workspace | " + " | ".join(f"k={k + 1}" for k in range(steps)) + " |"
    rows = [head, "|---|" + "---|" * steps]
    for kind, label in (("frozen", "frozen (T steps on W1)"), ("refreshed", "refreshed at T/2")):
        vals = np.mean([d[kind] for d in diags], axis=0)
        rows.append(f"| {label} | " + " | ".join(f"{v:.3f}" for v in vals) + " |")
    d = diags[0]
    kernel = d.get("pool_kernel", 7)  # runs before it was recorded used smoothing 7
    rows.append(f"\nB = {d['budget']}, B1 = {d['workspace']}, T = {d['lookahead']}, smoothing {kernel}, "
                f"{len(diags)} samples.")  # fmt: skip
    return "\n".join(rows)


def retention_table(records: list[dict], budget: int = 128) -> str:
    """Table 6: evidence tokens in LAQ's W and EchoKV's W1, W2 (B1 = 256 sweep cells), and in the final cache."""
    by = defaultdict(lambda: defaultdict(list))
    for r in records:
        if r.get("budget") != budget or "workspace_evidence" not in r:
            continue
        ev = r["workspace_evidence"]
        if r["policy"] == "laq(B1=256)" and ev:
            by[r["task"]]["LAQ W"].append(ev[0])
        if r["policy"] == "echokv(B1=256)" and len(ev) == 2:
            by[r["task"]]["EchoKV W1"].append(ev[0])
            by[r["task"]]["EchoKV W2"].append(ev[1])
        if r["policy"] in ("laq(B1=256)", "echokv(B1=256)"):
            by[r["task"]][f"{r['policy'].split('(')[0]} final"].append(r.get("evidence_kept"))
    cols = ["LAQ W", "EchoKV W1", "EchoKV W2", "laq final", "echokv final"]
    lines = ["| task | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for task, d in sorted(by.items()):
        lines.append(f"| {task} | " + " | ".join(f"{100 * mean(d[c]):.1f}" for c in cols) + " |")
    return "\n".join(lines)


def sweep_table(records: list[dict], main: list[dict]) -> str:
    defaults = {BASE: BASE, "cc": "cc (raw)", "cc-fast": "cc-fast (raw)"}
    by = defaultdict(lambda: defaultdict(list))
    for r in records + [r for r in main if r["policy"] in defaults]:
        if r.get("budget") in (64, 128) and "score" in r:
            by[(r["policy"], r["budget"])]["score"].append(r["score"])
            by[(r["policy"], r["budget"])]["kl"].append(r.get("kl"))
    lines = ["| variant | budget | score | KL | n |", "|---|---|---|---|---|"]
    for (policy, budget), d in sorted(by.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        label = defaults.get(policy, policy)
        lines.append(f"| {label} | {budget} | {mean(d['score']):.3f} | {mean(d['kl']):.3f} | {len(d['score'])} |")
    return "\n".join(lines)


# Each knob's values as grid specs; the first is the shipped default (the main grid's row).
# The sweeps vary one knob at a time from BASE, EchoKV's defaults before the sweeps (T=16, max
# aggregation, smoothing 7, B1=1024); the main grid's BASE rows are its "echokv" rows of that run.
BASE = "echokv(T=16,aggregate=max,kernel=7,B1=1024)"
KNOBS = {
    "T": {"16": BASE, "8": "echokv(T=8)", "24": "echokv(T=24)"},
    "aggregation": {"max": BASE, "mean": "echokv(aggregate=mean)", "votes": "echokv(aggregate=votes)"},
    "smoothing kernel": {"7": BASE, "0": "echokv(kernel=0)", "3": "echokv(kernel=3)", "13": "echokv(kernel=13)"},
    "workspace B1": {"1024": BASE, "256": "echokv(B1=256)", "512": "echokv(B1=512)"},
    "cc score": {"raw": "cc", "logprob": "cc(surprise=logprob)"},
    "cc-fast score": {"raw": "cc-fast", "logprob": "cc-fast(surprise=logprob)"},
}


def defaults_table(sweeps: dict[str, list[dict]], main: dict[str, list[dict]], budget: int = 128) -> str:
    """Per knob and value: accuracy and KL at one budget on each model, on the samples every value
    ran; the pick is the best accuracy averaged over the models (at equal accuracy the default stays)."""
    models = list(sweeps)
    head = "| knob | value | " + " | ".join(f"{m} score / KL" for m in models) + " | pick |"
    lines = [head, "|---|---|" + "---|" * len(models) + "---|"]
    for knob, values in KNOBS.items():
        stats: dict[str, list] = {v: [] for v in values}
        for m in models:
            at_budget = [r for r in sweeps[m] + main[m] if r.get("budget") == budget]
            cell = {
                v: {(r["task"], r["sample"]): r for r in at_budget if r["policy"] == spec} for v, spec in values.items()
            }
            common = set.intersection(*(set(c) for c in cell.values()))  # compare on the same samples
            for v in values:
                rs = [cell[v][key] for key in common]
                stats[v].append((mean([r["score"] for r in rs]), mean([r.get("kl") for r in rs])))
        default = next(iter(values))
        pick = max(stats, key=lambda v: (round(mean([a for a, _ in stats[v]]), 6), v == default))
        for i, (value, per_model) in enumerate(stats.items()):
            label = f"{value} (default)" if i == 0 else value
            cells = " | ".join(f"{a:.2f} / {k:.2f}" for a, k in per_model)
            lines.append(f"| {knob} | {label} | {cells} | {'**pick**' if value == pick else ''} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="n=1, budget 128, two policies: check the script")
    ap.add_argument("--models", default="smol,qwen")
    ap.add_argument("--n-smol", type=int, default=6)
    ap.add_argument("--n-qwen", type=int, default=3)
    ap.add_argument("--skip-run", action="store_true", help="only write the tables from results-runs/")
    ap.add_argument("--out", default=str(ROOT / "results-runs"))
    args = ap.parse_args()
    global SKIP_RUN
    SKIP_RUN = args.skip_run
    out = pathlib.Path(args.out)
    plots = ROOT / "docs" / "results"
    models = [m.strip() for m in args.models.split(",")]
    n = {"smol": args.n_smol, "qwen": args.n_qwen}
    policies, budgets, sweeps = POLICIES, BUDGETS, SWEEPS
    if args.quick:
        n = {m: 1 for m in n}
        policies, budgets, sweeps = ["full", "echokv"], [128], ["echokv(B1=256)", "laq(B1=256)"]
        out, plots = out / "quick", out / "quick" / "plots"

    calib, main_records, sweep_records, rows = {}, {}, {}, []
    for m in models:  # 1K prompts with each model's n; 2K with 3 samples (they cost twice as much)
        calib[m] = run(f"calib-{m}", out, models=[MODELS[m]], tasks=TASKS, lengths=[1024], n=n[m],
                       policies=["full"], budgets=[128])  # fmt: skip
        calib[m] += run(f"calib2k-{m}", out, models=[MODELS[m]], tasks=TASKS, lengths=[2048], n=min(n[m], 3),
                        policies=["full"], budgets=[128])  # fmt: skip
    calib_md, solved = calibration_table(calib)
    for m in models:
        tasks = [t for t in TASKS if solved.get((m, f"{t}/1024"), 0) >= SOLVED]
        main_records[m] = run(f"main-{m}", out, models=[MODELS[m]], tasks=tasks, lengths=[1024], n=n[m],
                              policies=policies, budgets=budgets, diagnostics=True)  # fmt: skip
        sweep_records[m] = run(f"sweeps-{m}", out, models=[MODELS[m]], tasks=tasks, lengths=[1024], n=n[m],
                               policies=["full", *sweeps], budgets=[64, 128] if m == "smol" else [128])  # fmt: skip
        rows += report.summarize(main_records[m])

    plots.mkdir(parents=True, exist_ok=True)
    images = []
    for m in models:
        recs = main_records[m]
        mrows = report.summarize(recs)
        for p in report.write_plots(out / f"main-{m}", recs, mrows):
            shutil.copyfile(p, plots / p.name)
            images.append(p.name)

    all_main = [r for rs in main_records.values() for r in rs]
    t = report.throughput(all_main + [r for rs in calib.values() for r in rs])
    sections = [
        "# Results\n",
        "Generated by `scripts/results.py` (do not edit by hand; the discussion at the end is part of the script). "
        "Greedy decoding, chat template, llama.cpp CPU, f16 KV cache, 2 threads. Every policy evicts once, when "
        "the prompt has been read (prefill-end), keeps 4 sink tokens and its own protected window, and generates "
        "with the budget it kept. Scores: 1 if every gold string appears in the output.\n",
        "## Full-cache accuracy (calibration)\n",
        calib_md,
        f"\nTasks with full-cache accuracy >= {SOLVED} at 1K tokens enter the policy grid.\n",
        "## Accuracy by policy and budget (1K-token prompts)\n",
        report.to_markdown(rows),
        "## Fidelity to the full cache (mean over tasks and samples)\n",
        "KL(full || evicted) of next-token distributions along the full cache's greedy continuation (teacher-forced,"
        " from its second token: the first comes from the prompt's own logits under every prefill-end policy), top-1"
        " agreement there, token agreement and exact match of the greedy outputs, share of evidence tokens kept.\n",
    ]
    for m in models:
        model_name = next(iter({r["model"] for r in main_records[m]}), m)
        sections += [f"### {model_name}\n", report.fidelity_markdown(rows, model_name), ""]
    sections += ["## EchoKV Table 1: KV overlap with the true decode queries\n"]
    for m in models:
        sections += [f"### {m}\n", overlap_table(main_records[m]), ""]
    sections += ["## EchoKV Table 6: evidence retention (%) at B = 128, B1 = 256\n"]
    for m in sweep_records:
        sections += [f"### {m}\n", retention_table(sweep_records[m]), ""]
    sections += [
        "## Defaults: what the sweeps pick (B = 128)\n",
        defaults_table(sweep_records, main_records),
        "",
        DEFAULTS,
        "## Sweeps (SmolLM2 at budgets 64 and 128, Qwen at 128)\n",
    ]
    for m in sweep_records:
        sections += [f"### {m}\n", sweep_table(sweep_records[m], main_records[m]), ""]
    sections += [
        "## Throughput of the evaluation\n",
        f"{t['cells']} cells in {t['total_s']:.0f} s: the model's own prefill and decode {t['model_s']:.0f} s, the "
        f"policies' scoring {t['policy_s']:.0f} s, the harness (contexts, snapshot restores, metrics, records) "
        f"{t['overhead_s']:.0f} s = {100 * (t['overhead_share'] or 0):.1f}% of the total. Reading each prompt "
        f"once and replaying its snapshot saved about {t['replay_saved_s']:.0f} s of prefill against reading it "
        "again in every cell; scores of budget-independent policies are computed once per sample and cut at "
        "each budget, so the policies' time above counts each scoring once.\n",
        "## Plots\n",
        *[f"![{name}](results/{name})\n" for name in images],
        DISCUSSION,
    ]
    target = ROOT / "docs" / "results.md" if not args.quick else out / "results.md"
    target.write_text("\n".join(sections))
    print(f"wrote {target}")


DEFAULTS = """Each row changes one knob of the previous EchoKV defaults (T=16, max aggregation, smoothing 7,
B1=1024; `BASE` in the script, whose rows are the main grid's `echokv` rows of that run) and is
scored on the same samples. kvlite now ships the picks for T (24), smoothing (13) and the workspace
(512). It does not take the pick of mean aggregation: mean won at 128 cells by one sample of 18 on
SmolLM2 (with a higher KL, 0.34 against 0.21) and tied on Qwen, and combined with the other three
picks it lost the README's stated-once code, which max keeps. The `echokv` rows of the main tables
are the shipped defaults (the cells were rerun after the change); `echokv(T=16,...)` rows are the
previous defaults. The combination is better than the previous defaults at 128 and 256 cells
(single needle at 128: SmolLM2 1.00 vs 0.17, Qwen 1.00 vs 0.67) and worse at 64 (two-hop at 64:
SmolLM2 0.00 vs 0.50, Qwen 0.33 vs 1.00, with higher KL): the sweeps picked at 128, and at 64 cells
the wider smoothing and the smaller workspace cost the two-hop evidence. At very small budgets pass
`-T 16 --pool-kernel 7 --workspace 1024` (`echokv(T=16,kernel=7,B1=1024)` in a grid).
Counter-causal keeps the paper's raw score: the normalized one is no more
accurate (0.00 for both), though its KL is lower on SmolLM2.
"""

DISCUSSION = """## What agrees and what disagrees with the papers

Read the accuracy tables with their n in mind (6 samples per task on SmolLM2, 3 on Qwen: one sample
moves a cell by 0.17 or 0.33); the fidelity table averages every sample of every task and is the
steadier signal. The numbers below are those of the committed run.

- **Lookahead wins, as notes/lookahead.md predicted.** `laq` and `echokv` are the only policies that
  keep most of the full cache's accuracy at 64-128 cells of a 1K prompt, and they have the lowest KL
  at every budget on SmolLM2 (0.21 nats at 128 against 0.77 for SnapKV, 0.86 for H2O, 0.96 for
  StreamingLLM). SnapKV, TOVA and H2O lose the needle below 512 cells, as kvpress did in
  notes/peers.md.
- **EchoKV vs LAQ.** With the same settings (T=16, B1=1024, the `echokv(T=16,...)` rows) they tie:
  the workspace holds (almost) the whole 1K prompt, so both decode the same greedy tokens on the same
  view (identical numbers on Qwen). With a workspace smaller than the prompt (B1 = 256, sweep rows)
  EchoKV is ahead of LAQ at 128 cells on SmolLM2 (0.33 vs 0.22, KL 0.47 vs 0.48): the paper's
  direction, within this sample size's noise. At the shipped EchoKV defaults (T=24, smoothing 13,
  B1=512) EchoKV beats LAQ at 128-256 cells on the single needle (SmolLM2 1.00 vs 0.17 at 128) and
  loses to it at 64 on two-hop (see Defaults).
- **Table 1 agrees in shape.** On a frozen workspace the overlap of the step-k query's top-B sets
  with the true step-k query's falls with k; refreshing the workspace at T/2 stops the fall (SmolLM2:
  0.959 at k=1, 0.910 frozen vs 0.936 refreshed at k=8). The paper's decay is steeper (0.92 to 0.77
  on Mistral-7B over 10K-token LongBench prompts); with 1K prompts and B1 = 256 a quarter of the
  prompt is always in view. On Qwen the decay is nearly flat (0.964 to 0.954).
- **Table 6 agrees on the repair, not on the bootstrap.** W2 (the repaired workspace) holds more
  gold evidence than W1 on every task, as in the paper (SmolLM2 multikey 7% to 71%). But W1, built
  from DapQ proposals of the last query, holds *less* evidence than LAQ's SnapKV workspace W here
  (e.g. 7% vs 55% on multikey), where the paper found W1 > W (73.2 vs 70.0): our questions come at
  the end of the prompt, so the last 32 real queries already point at the needle.
- **DapQ alone is strong on Qwen** (single needle 1.00 at 128 cells, lowest KL at 256-512): position
  proposals of the last query work well when the question is the last thing read, and poorly on
  SmolLM2 (KL 0.87 at 128).
- **Counter-causal surprise fails every task on both models** (0.00 at every budget, KL 2.4-3.5 nats
  at 128), which disagrees with the counter-causal paper's LongBench results. kvlite implements the
  paper's definition (tested against its reference code); measured in issue 4 and docs/policies.md:
  in the counter-causal pass the token x_i is the input at position i and small models copy digits,
  so a stated-once number looks *predictable* and is evicted first. The normalized score
  (`surprise=logprob`) lowers KL (SmolLM2 at 128: 2.13 vs 3.30 for `cc`) but answers nothing either;
  the paper's raw score stays the default, as the reference code has it.
- **Variable tracking** is beyond SmolLM2 with the full cache (0/6) and dropped for it; on Qwen every
  policy loses it below 512 cells: the chain's five statements are spread over the whole prompt.
"""

if __name__ == "__main__":
    main()
