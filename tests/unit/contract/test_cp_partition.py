"""cp_partition_indices: Transformer Engine's THD context-parallel split (thd_get_partitioned_indices)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from packctl.arrays import offsets_of
from packctl.contract.thd import cp_partition_indices
from support.profiles import examples


def test_transformer_engine_example():
    # TE's own example: two sequences of 8, cp 2 -> chunks of 2, rank r keeps chunks r and 3 - r.
    assert cp_partition_indices(np.array([0, 8, 16]), 2, 0).tolist() == [0, 1, 6, 7, 8, 9, 14, 15]
    assert cp_partition_indices(np.array([0, 8, 16]), 2, 1).tolist() == [2, 3, 4, 5, 10, 11, 12, 13]


def test_cp_one_keeps_everything_and_cp_three_by_hand():
    assert cp_partition_indices([0, 4, 6], 1, 0).tolist() == list(range(6))
    # one sequence of 12, cp 3 -> 6 chunks of 2; rank 1 keeps chunks 1 and 4
    assert cp_partition_indices([0, 12], 3, 1).tolist() == [2, 3, 8, 9]


@pytest.mark.parametrize("cu, cp, rank, fragment", [
    ([0, 6, 16], 2, 0, "sequence 0 has padded length 6, not a multiple of 2*cp_size = 4"),
    ([0, 8, 4], 2, 0, "decreases at sequence 1"),
    ([0, 8], 2, 2, "cp_rank 2 is not in [0, cp_size=2)"),
])
def test_bad_layouts_are_refused(cu, cp, rank, fragment):
    with pytest.raises(ValueError) as err:
        cp_partition_indices(cu, cp, rank)
    assert fragment in str(err.value)


@settings(max_examples=examples(60), deadline=None)
@given(st.integers(1, 4), st.lists(st.integers(0, 6), min_size=1, max_size=12))
def test_ranks_partition_every_sequence_evenly(cp, multiples):
    padded = np.array(multiples, dtype=np.int64) * 2 * cp
    cu = offsets_of(padded)
    shares = [cp_partition_indices(cu, cp, r) for r in range(cp)]
    held = np.concatenate(shares)
    assert np.array_equal(np.sort(held), np.arange(cu[-1]))  # a partition of the tokens
    seq_of = np.repeat(np.arange(len(padded)), padded)
    for r, idx in enumerate(shares):
        assert len(idx) == cu[-1] // cp
        assert np.all(np.diff(idx) > 0)  # ascending: sequence after sequence
        assert np.array_equal(np.bincount(seq_of[idx], minlength=len(padded)), padded // cp)  # local cu = cu / cp
        chunk = padded // (2 * cp)
        position = idx - cu[seq_of[idx]]
        chunk_of = position // np.maximum(chunk[seq_of[idx]], 1)
        assert set(chunk_of.tolist()) <= {r, 2 * cp - 1 - r}


def test_packs_end_to_end_give_each_packs_indices_shifted():
    # the function works on one pack's cu_seqlens_padded, or on several packs laid end to end
    one, two = np.array([0, 8, 16]), np.array([0, 4])
    both = np.concatenate([one, two[1:] + 16])
    for r in range(2):
        expected = np.concatenate([cp_partition_indices(one, 2, r), cp_partition_indices(two, 2, r) + 16])
        assert np.array_equal(cp_partition_indices(both, 2, r), expected)
