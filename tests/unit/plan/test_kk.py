"""plan/kk.py `kk_parts`: the compiled Karmarkar-Karp gives `kk_partition`'s parts, item for item."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from packctl.plan.balance import kk_partition
from packctl.plan.kk import kk_parts
from support.profiles import examples


def test_docstring_example():
    assert kk_parts([8, 7, 6, 5, 4], 2).tolist() == [1, 0, 1, 0, 0]


@settings(max_examples=examples(300), deadline=None)
@given(st.lists(st.one_of(st.integers(0, 50), st.floats(0, 1e6, allow_nan=False)), max_size=90),
       st.integers(1, 9), st.booleans())
def test_same_parts_as_kk_partition(costs, k, equal_counts):
    # ties (equal costs, equal spreads) are frequent with costs 0..50: they break alike too
    assert kk_parts(costs, k, equal_counts=equal_counts).tolist() == \
        kk_partition(costs, k, equal_counts=equal_counts).tolist()


def test_many_items():
    costs = np.random.default_rng(3).lognormal(6, 1.5, 5000)
    for equal_counts in (False, True):
        assert np.array_equal(kk_parts(costs, 8, equal_counts=equal_counts),
                              kk_partition(costs, 8, equal_counts=equal_counts))


def test_bad_k():
    with pytest.raises(ValueError, match="k must be >= 1"):
        kk_parts([1.0], 0)
