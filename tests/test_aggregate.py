"""Aggregation to one score per token, against values computed by hand."""

import numpy as np
import pytest

from kvlite.errors import KvliteError
from kvlite.scoring.aggregate import aggregate, normalize_rows

# 1 layer, 2 groups, 4 tokens
S = np.array([[[1.0, 1.0, 2.0, 0.0], [0.0, 3.0, 0.0, 1.0]]])


def test_normalize_rows():
    np.testing.assert_allclose(normalize_rows(S)[0, 0], [0.25, 0.25, 0.5, 0.0])
    assert normalize_rows(np.zeros((1, 1, 3))).sum() == 0


def test_mean_and_max():
    # rows normalized: [.25 .25 .5 0] and [0 .75 0 .25]
    np.testing.assert_allclose(aggregate(S, "mean"), [0.125, 0.5, 0.25, 0.125])
    np.testing.assert_allclose(aggregate(S, "max"), [0.25, 0.75, 0.5, 0.25])


def test_votes_count_top_budget_membership_and_break_ties_by_mean():
    # top-1 of row 0: token 2; of row 1: token 1 -> votes [0, 1, 1, 0], mean breaks the tie
    v = aggregate(S, "votes", budget=1)
    np.testing.assert_allclose(v, [0.125, 1.5, 1.25, 0.125])
    assert np.argmax(v) == 1


def test_bad_method_and_shape():
    with pytest.raises(KvliteError, match="unknown aggregation"):
        aggregate(S, "median")
    with pytest.raises(KvliteError, match="budget"):
        aggregate(S, "votes")
    with pytest.raises(KvliteError, match="shape"):
        aggregate(S[0], "mean")
