from __future__ import annotations

import numpy as np
from hypothesis import given, strategies as st

from packctl.plan.order import order_sequences, window_seed

LENGTHS = np.array([5, 2, 9, 2, 7])


def test_orders_of_the_docstring_example():
    assert order_sequences(LENGTHS, "input").tolist() == [0, 1, 2, 3, 4]
    assert order_sequences(LENGTHS, "curriculum").tolist() == [1, 3, 0, 4, 2]
    assert order_sequences(LENGTHS, "curriculum", curriculum_order="desc").tolist() == [2, 4, 0, 1, 3]


@given(st.lists(st.integers(1, 50), min_size=1, max_size=300), st.integers(0, 2**63 - 1))
def test_shuffle_is_a_seeded_permutation(lengths, seed):
    lengths = np.array(lengths)
    perm = order_sequences(lengths, "shuffle", seed=seed)
    assert sorted(perm.tolist()) == list(range(len(lengths)))
    assert np.array_equal(perm, order_sequences(lengths, "shuffle", seed=seed))


def test_shuffle_depends_on_seed_and_mixes():
    lengths = np.ones(1000, np.int64)
    a, b = order_sequences(lengths, "shuffle", seed=1), order_sequences(lengths, "shuffle", seed=2)
    assert not np.array_equal(a, b)
    # a real shuffle: few elements stay in place, and the first half holds about half of the low gids
    assert (a == np.arange(1000)).sum() < 20
    assert 200 < (a[:500] < 500).sum() < 300


def test_curriculum_ties_by_gid():
    lengths = np.array([3, 1, 3, 1, 3])
    assert order_sequences(lengths, "curriculum").tolist() == [1, 3, 0, 2, 4]
    assert order_sequences(lengths, "curriculum", curriculum_order="desc").tolist() == [0, 2, 4, 1, 3]


def test_window_seeds_differ():
    assert len({window_seed(0, w) for w in range(100)}) == 100
    assert window_seed(1, 0) != window_seed(2, 0)
