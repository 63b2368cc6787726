"""Choosing defaults from evaluation records, on the tune split only.

A default is picked on one split and reported on another that the choice never saw (docs/results.md,
"Protocol"). This module is where picks are made, and it refuses records of any split but "tune":
a picking script cannot see test data even by mistake.

The search is successive halving: every candidate runs on a few samples, the better third goes on to
a round with more samples (the same first samples plus new ones: sample i does not depend on n), and
so on; the last round's best is the pick."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence

import numpy as np

from ..errors import KvliteError
from . import report, stats

TUNE = "tune"


def tune_only(records: list[dict]) -> list[dict]:
    """The records, if every one is from the tune split; otherwise a KvliteError."""
    bad = [r for r in records if r.get("split", TUNE) != TUNE]
    if bad:
        splits = sorted({str(r.get("split")) for r in bad})
        raise KvliteError(
            f"{len(bad)} record(s) from the {', '.join(splits)} split: defaults are chosen on the tune split "
            "alone (run the sweep with --split tune)"
        )
    return records


@dataclasses.dataclass
class Standing:
    spec: str
    score: float  # mean over the samples and budgets every candidate ran
    kl: float
    n: int


def rank(records: list[dict], candidates: Sequence[str], budgets: Sequence[int]) -> list[Standing]:
    """Candidates by mean score over the (sample, budget) cells all of them ran; ties by lower KL."""
    tune_only(records)
    cells: dict[str, dict] = {c: {} for c in candidates}
    for r in records:
        if r["policy"] in cells and r.get("budget") in budgets and "score" in r:
            cells[r["policy"]][(*report.sample_key(r), r["budget"])] = r
    common = set.intersection(*(set(c) for c in cells.values())) if cells else set()
    if not common:
        raise KvliteError("no sample was run by every candidate: nothing to rank")
    out = []
    for c in candidates:
        rs = [cells[c][k] for k in common]
        kls = [r["kl"] for r in rs if r.get("kl") is not None]
        out.append(Standing(c, float(np.mean([r["score"] for r in rs])), float(np.mean(kls)) if kls else 0.0, len(rs)))
    return sorted(out, key=lambda s: (-round(s.score, 9), s.kl))


def versus(records: list[dict], a: str, b: str, budgets: Sequence[int]) -> stats.Interval:
    """Paired bootstrap of a - b over the tune split's (sample, budget) cells both ran."""
    tune_only(records)
    sa: dict = {}
    sb: dict = {}
    for r in records:
        if r.get("budget") in budgets and "score" in r:
            key = (*report.sample_key(r), r["budget"])
            if r["policy"] == a:
                sa[key] = r["score"]
            elif r["policy"] == b:
                sb[key] = r["score"]
    keys = sorted(set(sa) & set(sb))
    return stats.paired_difference([sa[k] for k in keys], [sb[k] for k in keys])


def spec(name: str, **params) -> str:
    """echokv(S=16,T=24,...) from keyword values, in a fixed order."""
    return f"{name}(" + ",".join(f"{k}={v}" for k, v in params.items()) + ")"


def joint_grid(name: str, space: dict[str, Sequence]) -> list[str]:
    """Every combination of the space's values, as specs."""
    keys = list(space)
    return [spec(name, **dict(zip(keys, values))) for values in itertools.product(*(space[k] for k in keys))]


def successive_halving(
    run_round: Callable[[list[str], int], list[dict]],
    candidates: list[str],
    samples: Sequence[int],
    budgets: Sequence[int],
    keep: float = 1 / 3,
    log: Callable[[str], None] = print,
) -> tuple[str, list[list[Standing]]]:
    """run_round(specs, n) runs the specs on n samples per task and returns the tune records so far.
    samples: n per round, increasing. Returns the pick and every round's standings."""
    alive = list(candidates)
    rounds = []
    for i, n in enumerate(samples):
        standings = rank(run_round(alive, n), alive, budgets)
        rounds.append(standings)
        log(f"round {i + 1}: {len(alive)} candidates on n={n} per task; best {standings[0].spec} "
            f"{standings[0].score:.3f} (KL {standings[0].kl:.3f})")  # fmt: skip
        if i < len(samples) - 1:
            alive = [s.spec for s in standings[: max(1, int(np.ceil(len(standings) * keep)))]]
    return rounds[-1][0].spec, rounds
