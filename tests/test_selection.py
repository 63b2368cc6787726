import numpy as np
import pytest

from kvlite.selection import protected_positions, select_keep


def test_protected_are_sinks_and_last():
    pos = np.array([0, 1, 2, 5, 9, 12])
    assert protected_positions(pos, 2).tolist() == [True, True, False, False, False, True]


def test_select_keep_fills_budget_by_score_after_protected():
    pos = np.array([0, 1, 4, 6, 8, 10, 11])
    scores = np.array([0.0, 0.0, 5.0, 1.0, 3.0, 2.0, 0.0])
    keep = select_keep(pos, scores, budget=5, protected=protected_positions(pos, 2))
    assert keep.tolist() == [0, 1, 4, 8, 11]


def test_select_keep_ties_prefer_later_positions():
    pos = np.arange(10)
    keep = select_keep(pos, np.zeros(10), budget=4, protected=protected_positions(pos, 1))
    assert keep.tolist() == [0, 7, 8, 9]


def test_select_keep_under_budget_keeps_all_and_rejects_impossible_budget():
    pos = np.arange(5)
    assert select_keep(pos, np.zeros(5), 10, protected_positions(pos, 0)).tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError):
        select_keep(np.arange(10), np.zeros(10), 2, protected_positions(np.arange(10), 4))
