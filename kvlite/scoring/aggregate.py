"""From per-(layer, KV group) token scores to one score per token.

The papers select tokens per layer and KV group; llama.cpp frees a cell in every layer and head
at once, so kvlite aggregates (docs/design.md, "Token-level eviction"). Three ways, chosen by
measurement (max or mean with smoothing kept a stated-once code, votes did not: docs/design.md,
"Why lookahead"):
- mean:  the mean over (layer, group) of each row normalized to sum 1;
- max:   the maximum over (layer, group) of the normalized rows;
- votes: how many (layer, group) rows put the token in their own top-`budget`, ties broken by mean.
"""

from __future__ import annotations

import numpy as np

from ..errors import KvliteError

METHODS = ("mean", "max", "votes")


def normalize_rows(scores: np.ndarray) -> np.ndarray:
    """scores [..., n_tokens] (non-negative) -> each row divided by its sum (rows summing to 0 stay 0)."""
    s = np.array(scores, dtype=np.float64)  # the one copy, divided in place
    total = s.sum(-1, keepdims=True)
    return np.divide(s, total, out=s, where=total > 0)


def aggregate(scores: np.ndarray, method: str = "mean", budget: int | None = None) -> np.ndarray:
    """scores [n_layer, n_group, n_tokens] (non-negative) -> [n_tokens]."""
    if scores.ndim != 3:
        raise KvliteError(f"aggregate wants [layer, group, token] scores, got shape {scores.shape}")
    rows = normalize_rows(scores).reshape(-1, scores.shape[-1])
    if method == "mean":
        return rows.mean(0)
    if method == "max":
        return rows.max(0)
    if method == "votes":
        if budget is None or budget <= 0:
            raise KvliteError("votes aggregation needs a positive budget")
        b = min(budget, rows.shape[1])
        top = np.argpartition(-rows, b - 1, axis=1)[:, :b]
        votes = np.zeros(rows.shape[1])
        np.add.at(votes, top.ravel(), 1.0)
        # The mean is < 1 per token: it only orders tokens with equal votes.
        return votes + rows.mean(0)
    raise KvliteError(f"unknown aggregation '{method}': choose from {', '.join(METHODS)}")
