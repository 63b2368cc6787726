"""Bootstrap intervals against cases computed by hand (the resampling distribution of a mean of
n values drawn with replacement from {0, 1} is binomial, so its quantiles are known exactly)."""

import numpy as np
import pytest

from kvlite.errors import KvliteError
from kvlite.eval import report, stats


def test_paired_bootstrap_hand_computed():
    # Per-sample differences a - b = (1, 0, 0, 0). A resample of 4 draws with replacement has mean
    # K/4 with K ~ Binomial(4, 1/4): P(0) = 0.3164, P(1/4) = 0.4219, P(1/2) = 0.2109, P(3/4) = 0.0469,
    # P(1) = 0.0039. Cumulative: 0.316, 0.738, 0.949, 0.996, 1: the 2.5% quantile is 0, the 97.5% is
    # 3/4, and P(difference <= 0) = 0.3164.
    a, b = [1, 1, 0, 0], [0, 1, 0, 0]
    iv = stats.paired_difference(a, b)
    assert (iv.mean, iv.lo, iv.hi, iv.n) == (0.25, 0.0, 0.75, 4)
    assert iv.p_not_better == pytest.approx(0.3164, abs=0.015)  # 10,000 resamples: sd 0.005
    assert not iv.excludes_zero()
    # Unpaired, the same scores would give a wider interval: pairing is what the function does.
    unpaired = np.mean(a) - np.mean(b)
    assert unpaired == iv.mean
    rng = np.random.default_rng(0)
    wide = [rng.choice(a, 4).mean() - rng.choice(b, 4).mean() for _ in range(4000)]
    assert np.quantile(wide, 0.025) < 0 < iv.hi < np.quantile(wide, 0.975) + 0.5


def test_interval_of_a_mean_and_a_sure_difference():
    iv = stats.bootstrap_mean([1.0, 0.0])  # means 0, 0.5, 1 with probabilities 1/4, 1/2, 1/4
    assert (iv.mean, iv.lo, iv.hi) == (0.5, 0.0, 1.0)
    sure = stats.paired_difference([1] * 6, [0] * 6)
    assert (sure.lo, sure.hi, sure.p_not_better) == (1.0, 1.0, 0.0) and sure.excludes_zero()
    assert sure.fmt() == "1.00 [1.00, 1.00]" and sure.fmt_marked() == "1.00 [1.00, 1.00] **"


def test_too_few_pairs_get_no_interval():
    # Five pairs all one way: a sign test's two-sided p is 2 x 0.5^5 = 0.0625, so nothing can be
    # claimed, though the bootstrap's interval is the point 1 (every resample's mean is 1).
    few = stats.paired_difference([1] * 5, [0] * 5)
    assert (few.lo, few.hi, few.n) == (1.0, 1.0, 5) and not few.excludes_zero()
    assert few.fmt() == few.fmt_marked() == "1.00 (n < 6: no interval)"
    assert stats.bootstrap_mean([1.0]).fmt() == "1.00 [1.00, 1.00]"  # a plain mean keeps its interval


def test_bad_input():
    with pytest.raises(KvliteError, match="same samples"):
        stats.paired_difference([1, 0], [1])
    with pytest.raises(KvliteError, match="at least one"):
        stats.bootstrap_mean([])


def rec(policy, budget, score, sample, task="single/1024"):
    return {"model": "m", "task": task, "sample": sample, "policy": policy, "budget": budget, "score": score}


def test_compare_pairs_by_sample_and_skips_unpaired():
    records = [rec("laq", 128, s, i) for i, s in enumerate([1, 1, 0, 0])]
    records += [rec("snapkv", 128, s, i) for i, s in enumerate([0, 1, 0, 0])]
    records += [rec("snapkv", 128, 1, 9)]  # no laq twin: not counted
    (iv,) = report.compare(records, ("laq", 128), ("snapkv", 128)).values()
    assert (iv.mean, iv.lo, iv.hi, iv.n) == (0.25, 0.0, 0.75, 4)
    md = report.compare_markdown(records, [("laq", "snapkv")], [128])
    assert "| m | 128 | laq - snapkv | 0.25 (n < 6: no interval) | 4 | - |" in md


def test_compare_another_metric():
    # KL against the full cache, per sample: laq 0.1 and 0.3 three times each, snapkv 0.5; differences
    # -0.4 and -0.2. A resample of 6 holds K ~ Binomial(6, 1/2) of the -0.4s, mean -0.2 - K/30:
    # P(K = 6) = 1/64 = 0.016 and P(K >= 5) = 7/64 = 0.109 put the 2.5% quantile at K = 5 (-0.367),
    # and by symmetry the 97.5% at K = 1 (-0.233). The full cache's record has no KL: skipped.
    records = [{**rec("laq", 128, 1, i), "kl": (0.1, 0.3)[i % 2]} for i in range(6)]
    records += [{**rec("snapkv", 128, 0, i), "kl": 0.5} for i in range(6)]
    records += [rec("full", None, 1, 0)]
    (iv,) = report.compare(records, ("laq", 128), ("snapkv", 128), metric="kl").values()
    assert (iv.mean, iv.lo, iv.hi, iv.n, iv.p_not_better) == pytest.approx((-0.3, -0.2 - 5 / 30, -0.2 - 1 / 30, 6, 1))
    md = report.compare_markdown(records, [("laq", "snapkv")], [128], metric="kl", digits=3)
    assert "| m | 128 | laq - snapkv | -0.300 [-0.367, -0.233] ** | 6 | 1.000 |" in md
