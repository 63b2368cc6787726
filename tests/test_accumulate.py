"""H2O's accumulated attention, against sums computed by hand."""

import numpy as np
import pytest

from kvlite.errors import KvliteError
from kvlite.scoring.accumulate import AttentionAccumulator


def test_accumulates_over_steps_layers_and_groups():
    acc = AttentionAccumulator()
    # step 1: 2 layers x 1 group over positions 0..2
    acc.add([0, 1, 2], np.array([[[0.5, 0.3, 0.2]], [[0.1, 0.1, 0.8]]]))
    # step 2: position 3 is new, position 1 was evicted in between
    acc.keep([0, 2])
    acc.add([0, 2, 3], np.array([0.2, 0.3, 0.5]))
    np.testing.assert_allclose(acc.scores([0, 1, 2, 3]), [0.6 + 0.2, 0.0, 1.0 + 0.3, 0.5])
    assert acc.positions.tolist() == [0, 2, 3]


def test_empty_and_mismatched():
    acc = AttentionAccumulator()
    np.testing.assert_array_equal(acc.scores([4, 5]), [0.0, 0.0])
    with pytest.raises(KvliteError):
        acc.add([0, 1], np.ones(3))
