"""Tables and plots from an evaluation directory's records: summary.csv / summary.md, score vs budget
per task, and which prompt positions each policy kept (the counter-causal paper's Figure 4)."""

from __future__ import annotations

import csv
import io
import pathlib
from collections import defaultdict

import numpy as np

FIDELITY = ("exact_match", "token_agreement", "kl", "top1", "evidence_kept")
COLUMNS = ("task", "policy", "budget", "score", "n", "model", *FIDELITY)


def _mean(values: list) -> float | None:
    vals = [v for v in values if v is not None]
    return float(np.mean(vals)) if vals else None


def _budget_order(b) -> tuple:
    return (0, 0) if b is None else (1, b)


def summarize(records: list[dict]) -> list[dict]:
    """One row per (model, task, policy, budget): mean score over samples, n, mean fidelity."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        if "score" in r:
            groups[(r["model"], r["task"], r["policy"], r["budget"])].append(r)
    rows = []
    for (model, task, policy, budget), rs in groups.items():
        row = {"task": task, "policy": policy, "budget": budget, "score": _mean([r["score"] for r in rs]),
               "n": len(rs), "model": model}  # fmt: skip
        row.update({k: _mean([r.get(k) for r in rs]) for k in FIDELITY})
        rows.append(row)
    rows.sort(key=lambda r: (r["model"], r["task"], _policy_order(r["policy"]), _budget_order(r["budget"])))
    return rows


def _policy_order(spec: str) -> tuple:
    """Registry order (full, streaming, ... cc-fast), variants after their base policy."""
    from ..policies import POLICIES

    names = list(POLICIES)
    base = spec.split("(")[0]
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


def to_markdown(rows: list[dict], value: str = "score", digits: int = 2) -> str:
    """Per model and task: policies as rows, budgets as columns (the full cache in its own column)."""
    out = []
    by = defaultdict(list)
    for r in rows:
        by[(r["model"], r["task"])].append(r)
    for (model, task), rs in by.items():
        budgets = sorted({r["budget"] for r in rs if r["budget"] is not None})
        full = next((r for r in rs if r["policy"] == "full"), None)
        n = max(r["n"] for r in rs)
        out.append(f"**{model} · {task}** ({value}, n = {n}; full cache: {_fmt(full and full[value], digits)})\n")
        out.append("| policy | " + " | ".join(str(b) for b in budgets) + " |")
        out.append("|---|" + "---|" * len(budgets))
        cells = {(r["policy"], r["budget"]): r[value] for r in rs}
        for policy in dict.fromkeys(r["policy"] for r in rs if r["policy"] != "full"):
            out.append(f"| {policy} | " + " | ".join(_fmt(cells.get((policy, b)), digits) for b in budgets) + " |")
        out.append("")
    return "\n".join(out)


def fidelity_markdown(rows: list[dict], model: str) -> str:
    """Fidelity averaged over tasks, per policy and budget: KL, top-1, token agreement, exact match."""
    acc: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        if r["model"] == model and r["policy"] != "full":
            acc[(r["policy"], r["budget"])].append(r)
    lines = [
        "| policy | budget | KL (nats) | top-1 | token agreement | exact match | evidence kept |",
        "|---|---|---|---|---|---|---|",
    ]
    for (policy, budget), rs in sorted(acc.items(), key=lambda kv: (_policy_order(kv[0][0]), _budget_order(kv[0][1]))):
        vals = [_mean([r[k] for r in rs]) for k in ("kl", "top1", "token_agreement", "exact_match", "evidence_kept")]
        lines.append(f"| {policy} | {budget} | " + " | ".join(_fmt(v) for v in vals) + " |")
    return "\n".join(lines)


def write_summary(out: pathlib.Path, records: list[dict]) -> list[dict]:
    rows = summarize(records)
    (out / "summary.csv").write_text(to_csv(rows))
    (out / "summary.md").write_text(to_markdown(rows) + "\n")
    return rows


# -- plots ----------------------------------------------------------------------------------------
def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_scores(rows: list[dict], model: str, path: pathlib.Path, value: str = "score") -> pathlib.Path:
    """Score vs budget, one panel per task, one line per policy; the full cache dashed."""
    plt = _pyplot()
    mine = [r for r in rows if r["model"] == model]
    task_names = list(dict.fromkeys(r["task"] for r in mine))
    fig, axes = plt.subplots(1, len(task_names), figsize=(4 * len(task_names), 3.4), squeeze=False)
    for ax, task in zip(axes[0], task_names):
        rs = [r for r in mine if r["task"] == task]
        for policy in dict.fromkeys(r["policy"] for r in rs if r["policy"] != "full"):
            pts = sorted((r["budget"], r[value]) for r in rs if r["policy"] == policy and r[value] is not None)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=policy)
        full = next((r[value] for r in rs if r["policy"] == "full"), None)
        if full is not None:
            ax.axhline(full, color="black", linestyle="--", label="full cache")
        ax.set_xscale("log", base=2)
        ax.set_title(task)
        ax.set_xlabel("budget (cells)")
        ax.set_ylabel(value)
        ax.set_ylim(-0.05, 1.05)
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.suptitle(model)
    fig.tight_layout()
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


def write_plots(out: pathlib.Path, records: list[dict], rows: list[dict]) -> list[pathlib.Path]:
    plots = out / "plots"
    plots.mkdir(exist_ok=True)
    paths = []
    for model in dict.fromkeys(r["model"] for r in rows):
        paths.append(plot_scores(rows, model, plots / f"scores-{model}.png"))
        budgets = sorted({r["budget"] for r in records if r.get("budget") and "kept" in r and r["model"] == model})
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
