"""H2O's heavy-hitter statistic: the attention each cached token has received so far, summed over
every query that read it, kept per position and dropped with evicted tokens (numpy; the per-step
scores come from the native pooling kernel or captured attention rows)."""

from __future__ import annotations

import numpy as np

from ..errors import KvliteError


class AttentionAccumulator:
    """Cumulative attention per resident position (one number per token: kvlite evicts tokens)."""

    def __init__(self) -> None:
        self.positions = np.zeros(0, dtype=np.int64)  # ascending
        self.totals = np.zeros(0, dtype=np.float64)

    def add(self, positions: np.ndarray, scores: np.ndarray) -> None:
        """Add one step's attention: scores [..., len(positions)] (e.g. per layer and KV group, as
        attn_pool returns them) are summed over the leading axes. New positions start at 0."""
        positions = np.asarray(positions, dtype=np.int64)
        scores = np.asarray(scores, dtype=np.float64)
        if scores.shape[-1] != len(positions):
            raise KvliteError(f"{scores.shape[-1]} scores for {len(positions)} positions")
        step = scores.reshape(-1, len(positions)).sum(0)
        merged = np.union1d(self.positions, positions)
        totals = np.zeros(len(merged))
        totals[np.searchsorted(merged, self.positions)] = self.totals
        np.add.at(totals, np.searchsorted(merged, positions), step)
        self.positions, self.totals = merged, totals

    def keep(self, positions: np.ndarray) -> None:
        """Forget every position not kept (evicted tokens take their history with them)."""
        mask = np.isin(self.positions, np.asarray(positions))
        self.positions, self.totals = self.positions[mask], self.totals[mask]

    def scores(self, positions: np.ndarray) -> np.ndarray:
        """The accumulated attention of each given position (0 for one never attended to)."""
        positions = np.asarray(positions, dtype=np.int64)
        out = np.zeros(len(positions))
        idx = np.searchsorted(self.positions, positions)
        hit = idx < len(self.positions)
        hit[hit] = self.positions[idx[hit]] == positions[hit]
        out[hit] = self.totals[idx[hit]]
        return out
