"""Confidence intervals for evaluation scores: a percentile bootstrap of a mean, and a *paired*
bootstrap of the difference between two policies scored on the same samples.

Pairing matters: two policies run on the same prompts, so the question "is A better than B" is a
question about the per-sample differences, whose spread is much smaller than that of either
policy's scores (a hard sample is hard for both). Resampling the samples with their differences
attached keeps that pairing; resampling each policy's scores on its own would not."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from ..errors import KvliteError

N_BOOT = 10_000
LEVEL = 0.95
# A paired difference from fewer samples gets no interval and is never marked: no distribution-free
# paired test (sign, signed-rank) reaches 5% two-sided below 6 pairs (all 5 one way: 2 x 0.5^5 =
# 0.0625), while the percentile bootstrap still gives one, a point where the pairs agree.
MIN_PAIRED = 6


@dataclasses.dataclass(frozen=True)
class Interval:
    mean: float
    lo: float
    hi: float
    n: int
    # Share of bootstrap means <= 0: for a difference, how often the resampled data does not favour A
    # (a one-sided bootstrap p-value; None for a plain mean).
    p_not_better: float | None = None

    def too_few(self) -> bool:
        """A paired difference from fewer than MIN_PAIRED samples."""
        return self.p_not_better is not None and self.n < MIN_PAIRED

    def excludes_zero(self) -> bool:
        return not self.too_few() and (self.lo > 0 or self.hi < 0)

    def fmt(self, digits: int = 2) -> str:
        if self.too_few():
            return f"{self.mean:.{digits}f} (n < {MIN_PAIRED}: no interval)"
        return f"{self.mean:.{digits}f} [{self.lo:.{digits}f}, {self.hi:.{digits}f}]"

    def fmt_marked(self, digits: int = 2) -> str:
        """fmt, with " **" where the interval excludes 0 (the tables' mark for a difference)."""
        return self.fmt(digits) + (" **" if self.excludes_zero() else "")

    def fmt_share(self) -> str:
        """p_not_better as a table shows it: "-" where fmt gives no interval."""
        return "-" if self.too_few() else f"{self.p_not_better:.3f}"


def _resampled_means(values: np.ndarray, n_boot: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(values), size=(n_boot, len(values)))
    return values[idx].mean(axis=1)


def bootstrap_mean(values: Sequence[float], n_boot: int = N_BOOT, level: float = LEVEL, seed: int = 0) -> Interval:
    """Mean of `values` with a percentile-bootstrap interval at `level`."""
    x = np.asarray([v for v in values if v is not None], dtype=np.float64)
    if x.size == 0:
        raise KvliteError("a confidence interval needs at least one value")
    if not 0 < level < 1:
        raise KvliteError(f"confidence level must be in (0, 1), got {level}")
    means = _resampled_means(x, n_boot, seed)
    a = (1 - level) / 2
    lo, hi = np.quantile(means, [a, 1 - a], method="inverted_cdf")
    return Interval(float(x.mean()), float(lo), float(hi), int(x.size))


def paired_difference(
    a: Sequence[float], b: Sequence[float], n_boot: int = N_BOOT, level: float = LEVEL, seed: int = 0
) -> Interval:
    """mean(a - b) over paired samples (a[i] and b[i] scored on the same prompt) with a paired
    percentile-bootstrap interval, and the share of resampled differences <= 0."""
    if len(a) != len(b):
        raise KvliteError(f"paired scores need the same samples: {len(a)} against {len(b)}")
    d = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    iv = bootstrap_mean(d, n_boot, level, seed)
    means = _resampled_means(d, n_boot, seed)
    return dataclasses.replace(iv, p_not_better=float((means <= 0).mean()))
