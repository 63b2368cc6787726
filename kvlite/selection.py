"""The one pruning step every policy shares: protected positions always stay, the rest of the
budget goes to the highest scores."""

from __future__ import annotations

import numpy as np


def protected_positions(positions: np.ndarray, sinks: int, window: int = 0) -> np.ndarray:
    """Which of the resident positions are protected: the first `sinks` positions (attention
    sinks), the last `window` resident tokens (a recent window) and the last one (new tokens
    continue after it)."""
    mask = positions < sinks
    if len(positions):
        mask[-max(window, 1) :] = True
    return mask


def ranked(positions: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """Indices of `positions` from the highest score down; ties go to the later position. The one
    order every top-n cut uses (select_keep, Observation.top)."""
    # lexsort: last key is primary -> by score, then by position, both descending
    return np.lexsort((-np.asarray(positions), -np.asarray(scores, dtype=np.float64)))


def select_keep(positions: np.ndarray, scores: np.ndarray, budget: int, protected: np.ndarray) -> np.ndarray:
    """The positions to keep: every protected one, then the highest-scoring others up to `budget`
    in all. Ties go to the later position. Returns sorted positions."""
    positions = np.asarray(positions)
    scores = np.asarray(scores, dtype=np.float64)
    if scores.shape != positions.shape or protected.shape != positions.shape:
        raise ValueError("positions, scores and protected must have one entry per resident token")
    if len(positions) <= budget:
        return positions.copy()
    room = budget - int(protected.sum())
    if room < 0:
        raise ValueError(f"{int(protected.sum())} protected tokens do not fit in a budget of {budget}")
    free = np.flatnonzero(~protected)
    order = free[ranked(positions[free], scores[free])]
    keep = np.concatenate([np.flatnonzero(protected), order[:room]])
    return np.sort(positions[keep])
