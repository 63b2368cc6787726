"""Tables and plots from an evaluation directory's records: summary.csv / summary.md, score vs budget
per task, and which prompt positions each policy kept (the counter-causal paper's Figure 4)."""

from __future__ import annotations

import csv
import io
import pathlib
from collections import defaultdict
from collections.abc import Callable

import numpy as np

from ..errors import KvliteError
from . import stats
from .specs import budget_order, spec_name

FIDELITY = ("exact_match", "token_agreement", "kl", "top1", "evidence_kept")
# score_lo / score_hi: the 95% percentile-bootstrap interval of the mean score over samples (stats.py).
COLUMNS = ("task", "policy", "budget", "score", "score_lo", "score_hi", "n", "model", *FIDELITY)


def _mean(values: list) -> float | None:
    vals = [v for v in values if v is not None]
    return float(np.mean(vals)) if vals else None


def summarize(records: list[dict]) -> list[dict]:
    """One row per (model, task, policy, budget): mean score over samples, n, mean fidelity."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        if "score" in r:
            groups[(r["model"], r["task"], r["policy"], r["budget"])].append(r)
    rows = []
    for (model, task, policy, budget), rs in groups.items():
        ci = stats.bootstrap_mean([r["score"] for r in rs])
        row = {"task": task, "policy": policy, "budget": budget, "score": ci.mean, "score_lo": ci.lo,
               "score_hi": ci.hi, "n": len(rs), "model": model}  # fmt: skip
        row.update({k: _mean([r.get(k) for r in rs]) for k in FIDELITY})
        rows.append(row)
    rows.sort(key=lambda r: (r["model"], r["task"], _policy_order(r["policy"]), budget_order(r["budget"])))
    return rows


def _policy_order(spec: str) -> tuple:
    """Registry order (full, streaming, ... cc-fast), variants after their base policy."""
    from ..policies import POLICIES

    names = list(POLICIES)
    base = spec_name(spec)
    return (names.index(base) if base in names else len(names), spec)


def _fmt(v, digits: int = 3) -> str:
    if v is None:
        return ""
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def to_csv(rows: list[dict]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(COLUMNS)
    for r in rows:
        w.writerow([("full" if k == "budget" and r[k] is None else _fmt(r[k], 4)) for k in COLUMNS])
    return buf.getvalue()


def _cell(r: dict | None, value: str, digits: int) -> str:
    """A value, with its interval when it is the score: 0.83 [0.67, 0.96]."""
    if r is None:
        return ""
    if value == "score" and r.get("score_lo") is not None:
        return f"{r['score']:.{digits}f} [{r['score_lo']:.{digits}f}, {r['score_hi']:.{digits}f}]"
    return _fmt(r[value], digits)


def to_markdown(rows: list[dict], value: str = "score", digits: int = 2) -> str:
    """Per model and task: policies as rows, budgets as columns (the full cache in its own column);
    scores carry their 95% bootstrap interval."""
    out = []
    by = defaultdict(list)
    for r in rows:
        by[(r["model"], r["task"])].append(r)
    for (model, task), rs in by.items():
        budgets = sorted({r["budget"] for r in rs if r["budget"] is not None}, key=budget_order)
        full = next((r for r in rs if r["policy"] == "full"), None)
        n = max(r["n"] for r in rs)
        out.append(f"**{model} · {task}** ({value}, n = {n}; full cache: {_cell(full, value, digits)})\n")
        if not budgets:  # only the full cache ran
            out += ["| policy | score |", "|---|---|", f"| full | {_cell(full, value, digits)} |", ""]
            continue
        out.append("| policy | " + " | ".join(str(b) for b in budgets) + " |")
        out.append("|---|" + "---|" * len(budgets))
        cells = {(r["policy"], r["budget"]): r for r in rs}
        for policy in dict.fromkeys(r["policy"] for r in rs if r["policy"] != "full"):
            out.append(
                f"| {policy} | " + " | ".join(_cell(cells.get((policy, b)), value, digits) for b in budgets) + " |"
            )
        out.append("")
    return "\n".join(out)


def sample_key(r: dict) -> tuple:
    """What pairs two cells: the same model, split, task and sample."""
    return (r["model"], r.get("split", "tune"), r["task"], r["sample"])


def compare(
    records: list[dict],
    a: tuple[str, int | None],
    b: tuple[str, int | None],
    group=lambda r: r["model"],
    metric: str = "score",
) -> dict:
    """Paired bootstrap of metric(a) - metric(b) (a record's field: "score", or "kl" against the full
    cache), cells given as (policy spec, budget), per group of samples (default: per model, pooling
    tasks and lengths). Only samples where both cells have the metric count."""
    by: dict = defaultdict(dict)
    for r in records:
        if r.get(metric) is not None and (r["policy"], r["budget"]) in (a, b):
            by[(r["policy"], r["budget"])][sample_key(r)] = r
    out: dict = {}
    groups: dict = defaultdict(list)
    for k in sorted(set(by[a]) & set(by[b])):
        groups[group(by[a][k])].append(k)
    for g, keys in groups.items():
        out[g] = stats.paired_difference([by[a][k][metric] for k in keys], [by[b][k][metric] for k in keys])
    return out


def per_conversation(records: list[dict], arm, arms: tuple) -> dict:
    """arm -> {sample: its mean score over the cells (policy, budget) that every arm ran}. arm(r):
    the record's arm (a chat mode, a recall N, ...), None for a record of no arm. A conversation's
    cells are averaged before any bootstrap: they are not independent of each other."""
    by: dict = {}
    for r in records:
        if "score" in r and (a := arm(r)) is not None:
            by[(a, sample_key(r), spec_name(r["policy"]), r.get("budget"))] = r["score"]
    cells = sorted(set.intersection(*({k[1:] for k in by if k[0] == a} for a in arms)))
    out: dict = {}
    for a in arms:
        scores = defaultdict(list)
        for c in cells:
            scores[c[0]].append(by[(a, *c)])
        out[a] = {s: float(np.mean(v)) for s, v in scores.items()}
    return out


def arm_difference(means: dict, a, b) -> stats.Interval:
    """a - b of per_conversation's means, paired by sample."""
    keys = sorted(means[a])
    return stats.paired_difference([means[a][k] for k in keys], [means[b][k] for k in keys])


def mode_difference(records: list[dict], budgets: tuple = (128, 256)) -> stats.Interval:
    """Chat: lazy - eager over every policy and budget both modes ran, per conversation
    (per_conversation). Pass one model's records; the split is the caller's choice."""
    modes = ("lazy", "eager")
    means = per_conversation(records, lambda r: r.get("evict") if r.get("budget") in budgets else None, modes)
    if not means["lazy"]:
        raise KvliteError("no cell ran in both chat modes")
    return arm_difference(means, *modes)


def compare_markdown(
    records: list[dict],
    pairs: list[tuple[str, str]],
    budgets: list[int],
    group=None,
    label=str,
    metric: str = "score",
    digits: int = 2,
) -> str:
    """One row per (group, budget, pair): the mean difference in `metric` with its paired 95% interval
    (** when it excludes 0), n, and the share of bootstrap resamples whose difference is <= 0 (on a
    score, A not ahead; on a loss such as "kl", A no worse); neither from fewer than
    stats.MIN_PAIRED samples. label: how a policy spec is shown."""
    group = group or (lambda r: r["model"])
    lines = ["| samples | budget | A - B | difference [95% CI] | n | P(A <= B) |", "|---|---|---|---|---|---|"]
    for budget in budgets:
        for a, b in pairs:
            cells = compare(records, (a, budget), (b, None if b == "full" else budget), group, metric)
            for g, iv in sorted(cells.items(), key=lambda kv: str(kv[0])):
                lines.append(f"| {g} | {budget} | {label(a)} - {label(b)} | {iv.fmt_marked(digits)} | {iv.n} | "
                             f"{iv.fmt_share()} |")  # fmt: skip
    return "\n".join(lines)


def write_summary(out: pathlib.Path, records: list[dict]) -> list[dict]:
    from .records import write_atomic

    rows = summarize(records)
    write_atomic(out / "summary.csv", to_csv(rows))
    write_atomic(out / "summary.md", to_markdown(rows) + "\n")
    return rows


# -- plots ----------------------------------------------------------------------------------------
def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _task_and_length(task: str) -> tuple[str, str]:
    """A task's name and prompt length: "test:single/2048" -> ("test:single", "2048"); (task, "")
    for a task without one (a LongBench file's)."""
    name, _, length = task.rpartition("/")
    return (name, length) if name and length.isdigit() else (task, "")


def plot_scores(
    rows: list[dict], model: str, path: pathlib.Path, value: str = "score", label: Callable[[str], str] = str
) -> pathlib.Path:
    """Score vs budget as a grid of panels, one row per task and one column per prompt length, one
    line per policy (the same colour and marker in every panel, named once in the figure's legend);
    the full cache dashed. label: how a policy spec reads in the legend."""
    plt = _pyplot()
    mine = [r for r in rows if r["model"] == model]
    cells = {_task_and_length(r["task"]) for r in mine}
    tasks = list(dict.fromkeys(_task_and_length(r["task"])[0] for r in mine))
    lengths = sorted({length for _, length in cells}, key=lambda s: int(s) if s else 0)
    split = {t.partition(":")[0] for t in tasks if ":" in t}
    shared = split.pop() if len(split) == 1 and all(":" in t for t in tasks) else ""  # "test": said once, in the title
    policies = list(dict.fromkeys(r["policy"] for r in mine if r["policy"] != "full"))
    colours = plt.get_cmap("tab10").colors
    style = {p: (colours[i % len(colours)], "os^Dv<>ph*"[i % 10]) for i, p in enumerate(policies)}
    budgets = sorted({r["budget"] for r in mine if r["budget"] is not None}, key=budget_order)
    x = lambda b: budget_order(b)[1]  # noqa: E731 - cells, or a share's percent
    shares = [isinstance(b, str) for b in budgets]
    xlabel = "budget (cells; %: of the prompt)" if any(shares) else "budget (cells)"
    if shares and all(shares):
        xlabel = "budget (% of the prompt)"
    width = max(6.0, 0.6 + 2.9 * len(lengths))  # room for the legend's four columns under one panel
    fig, axes = plt.subplots(len(tasks), len(lengths), figsize=(width, 0.9 + 2.1 * len(tasks)),
                             sharex=True, sharey=True, squeeze=False, layout="constrained")  # fmt: skip
    handles: dict[str, object] = {}
    for i, task in enumerate(tasks):
        for j, length in enumerate(lengths):
            ax = axes[i][j]
            rs = [r for r in mine if _task_and_length(r["task"]) == (task, length)]
            if not rs:
                ax.set_axis_off()
                continue
            for policy in policies:
                pts = sorted((x(r["budget"]), r[value]) for r in rs if r["policy"] == policy and r[value] is not None)
                if pts:
                    colour, marker = style[policy]
                    (handles[policy],) = ax.plot(*zip(*pts), color=colour, marker=marker, markersize=5, alpha=0.85)
            full = next((r[value] for r in rs if r["policy"] == "full"), None)
            if full is not None:
                handles["full"] = ax.axhline(full, color="black", linestyle="--", linewidth=1.2)
            ax.grid(alpha=0.3)
            if i == 0 and length:
                ax.set_title(f"{length} tokens", fontsize=10)
            if j == 0:
                ax.set_ylabel(f"{task.removeprefix(shared + ':') if shared else task}\n{value}")
            if i == len(tasks) - 1:
                ax.set_xlabel(xlabel)
    for ax in axes.flat:
        ax.set_xscale("log", base=2)
        if budgets:
            ax.set_xticks([x(b) for b in budgets], [str(b) for b in budgets])
            ax.minorticks_off()
        ax.set_ylim(-0.05, 1.05)
    names = [p for p in policies if p in handles] + (["full"] if "full" in handles else [])
    fig.legend([handles[p] for p in names], [("full cache" if p == "full" else label(p)) for p in names],
               loc="outside lower center", ncol=min(len(names), 4), fontsize=9, frameon=False)  # fmt: skip
    fig.suptitle(f"{model} · {shared} split" if shared else model, fontsize=11)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_occupancy(records: list[dict], model: str, task: str, sample: int, budget: int, path: pathlib.Path):
    """Which prompt positions each policy kept at one budget, one row per policy; evidence in red."""
    plt = _pyplot()
    rs = [r for r in records if (r["model"], r["task"], r["sample"], r["budget"]) == (model, task, sample, budget)]
    rs = [r for r in rs if "kept" in r]
    if not rs:
        return None
    n = rs[0]["prompt_tokens"]
    grid = np.zeros((len(rs), n))
    for i, r in enumerate(rs):
        grid[i, [p for p in r["kept"] if p < n]] = 1
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(rs) + 1.2))
    ax.imshow(grid, aspect="auto", cmap="Greys", interpolation="nearest", vmin=0, vmax=1)
    for p in rs[0].get("evidence", []):
        ax.axvline(p, color="red", alpha=0.25, linewidth=1)
    ax.set_yticks(range(len(rs)), [f"{r['policy']} ({r['score']:.0f})" for r in rs], fontsize=7)
    ax.set_xlabel("prompt position (black: kept; red: evidence)")
    ax.set_title(f"{model} · {task} #{sample} · budget {budget}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_evolution(record: dict, path: pathlib.Path) -> pathlib.Path | None:
    """The counter-causal paper's Figure 4: one row per refresh of a chunked cell, its kept positions
    coloured by position (the prompt's in a sequential map, generated tokens in red), evidence
    marked on the axis."""
    plt = _pyplot()
    rows = record.get("evolution")
    if not rows:
        return None
    n_prompt = record["prompt_tokens"]
    top = max(max(r) for r in rows if r) + 1
    fig, ax = plt.subplots(figsize=(9, 4.2))
    for i, kept in enumerate(rows):
        kept = np.asarray(kept)
        prompt = kept[kept < n_prompt]
        ax.scatter(prompt, np.full(len(prompt), i), c=prompt, cmap="viridis", vmin=0, vmax=n_prompt, s=1.5,
                   marker="s", linewidths=0)  # fmt: skip
        gen = kept[kept >= n_prompt]
        ax.scatter(gen, np.full(len(gen), i), color="red", s=1.5, marker="s", linewidths=0)
    for p in record.get("evidence", []):
        ax.plot([p], [-1.5], marker="^", color="red", markersize=3)
    ax.set_xlim(0, top)
    ax.set_ylim(len(rows), -3)
    ax.set_xlabel("position (colour: prompt position; red: generated; triangles: evidence)")
    ax.set_ylabel("refresh")
    ax.set_title(f"{record['model']} · {record['task']} #{record['sample']} · {record['policy']} · cache "
                 f"{record['budget']} · score {record['score']:.2f}", fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def end_to_end(records: list[dict]) -> dict[tuple, float]:
    """Seconds per sample to read the prompt and generate, by (model, task, policy, budget), the
    counter-causal paper's Table 1 column. Teacher forcing (an evaluation cost) is left out; the full
    cache's prompt is read once per sample (prefix_s) and every prefill-end cell replays it, so a
    prefill-end cell is charged that prefix too; a chunked cell reads its prompt itself. The median
    over samples: a cell slowed by another job on a shared machine (or a paused run, whose clock
    runs on) moves a mean by minutes and a median not at all."""
    prefix = {sample_key(r): r["time"]["prefix_s"] for r in records if "prefix_s" in r.get("time", {})}
    acc: dict[tuple, list[float]] = defaultdict(list)
    for r in records:
        t = r.get("time")
        if not t or "score" not in r:
            continue
        own = t["cell_s"] - t.get("teacher_forcing_s", 0.0)
        if "mode=chunked" not in r["policy"]:
            own += prefix.get(sample_key(r), 0.0) if "prefix_s" not in t else t["prefix_s"]
        acc[(r["model"], r["task"], r["policy"], r["budget"])].append(own)
    return {k: float(np.median(v)) for k, v in acc.items()}


def write_plots(out: pathlib.Path, records: list[dict], rows: list[dict]) -> list[pathlib.Path]:
    plots = out / "plots"
    plots.mkdir(exist_ok=True)
    paths = []
    for model in dict.fromkeys(r["model"] for r in rows):
        paths.append(plot_scores(rows, model, plots / f"scores-{model}.png"))
        budgets = sorted({r["budget"] for r in records if r.get("budget") and "kept" in r and r["model"] == model},
                         key=budget_order)  # fmt: skip
        first = next((r for r in records if r["model"] == model and r.get("evidence") and "kept" in r), None)
        if first and budgets:
            b = 128 if 128 in budgets else budgets[0]
            safe = first["task"].replace("/", "-")
            p = plot_occupancy(records, model, first["task"], first["sample"], b, plots / f"kept-{model}-{safe}.png")
            if p:
                paths.append(p)
    return paths


def throughput(records: list[dict]) -> dict:
    """Where an evaluation's time went: the model's own prefill and decode (prompt prefixes,
    tails, generation, teacher forcing), the policies' scoring, and the rest (the harness: context
    creation, snapshot restores, metrics, records)."""
    t = defaultdict(float)
    for r in records:
        for k, v in r.get("time", {}).items():
            t[k] += v
    model_s = t["prefix_s"] + t["prefill_s"] + t["decode_s"] + t["teacher_forcing_s"]
    total = t["cell_s"] + t["prefix_s"]
    overhead = total - model_s - t["policy_s"]
    # Reading each prompt once instead of once per cell: every further cell of a sample would have
    # paid its prefix again.
    per_sample = defaultdict(lambda: [0.0, 0])
    for r in records:
        if "time" in r:
            acc = per_sample[(r["model"], r["task"], r["sample"])] if "model" in r else per_sample[id(r)]
            acc[0] += r["time"].get("prefix_s", 0.0)
            acc[1] += 1
    return {
        "replay_saved_s": sum(prefix * (cells - 1) for prefix, cells in per_sample.values() if cells),
        "total_s": total,
        "model_s": model_s,
        "policy_s": t["policy_s"],
        "overhead_s": overhead,
        "overhead_share": overhead / total if total else None,
        "cells": sum(1 for r in records if "time" in r),
    }
