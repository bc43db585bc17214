"""The drop-in packers: NeMo-RL's `get_packer(...).pack(lengths)` and verl's
`get_seqlen_balanced_partitions`, checked against small references of what those functions are
documented to do, written here (never the frameworks' code)."""
from __future__ import annotations

import heapq

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from packctl import PackctlError
from packctl.online.adapters import NEMO_RL_ALGORITHMS, SequencePacker, get_packer, get_seqlen_balanced_partitions
from support.profiles import examples

batches = st.lists(st.integers(1, 100), min_size=1, max_size=80)


def concatenative(lengths, capacity):
    """In order; a new bin when the next sequence does not fit."""
    bins, load = [], capacity + 1
    for i, n in enumerate(lengths):
        if load + n > capacity:
            bins.append([])
            load = 0
        bins[-1].append(i)
        load += n
    return bins


def first_fit_decreasing_loads(lengths, capacity):
    """O(n^2) first fit decreasing: the lengths of each bin (which of two equal lengths goes first
    does not change them)."""
    bins = []
    for n in sorted(lengths, reverse=True):
        b = next((b for b in bins if sum(b) + n <= capacity), None)
        if b is None:
            bins.append(b := [])
        b.append(n)
    return bins


def karmarkar_karp(lengths, k, equal_size):
    """Largest differencing: k-tuples of (sum, items) merged largest spread first, the largest
    part of one with the smallest of the other; with equal_size the items start k at a time."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    heap = []
    starts = [order[g:g + k] for g in range(0, len(order), k)] if equal_size else [[i] for i in order]
    for g, items in enumerate(starts):
        parts = [(lengths[i], [i]) for i in items] + [(0, [])] * (k - len(items))
        sums = [s for s, _ in parts]
        heapq.heappush(heap, (min(sums) - max(sums), g, parts))
    created = len(heap)
    while len(heap) > 1:
        a, b = heapq.heappop(heap)[2], heapq.heappop(heap)[2]
        a = sorted(enumerate(a), key=lambda x: (-x[1][0], x[0]))
        b = sorted(enumerate(b), key=lambda x: (x[1][0], x[0]))
        parts = [(x[1][0] + y[1][0], x[1][1] + y[1][1]) for x, y in zip(a, b)]
        sums = [s for s, _ in parts]
        heapq.heappush(heap, (min(sums) - max(sums), created, parts))
        created += 1
    return sorted(sorted(items) for _, items in heap[0][2])


@settings(max_examples=examples(100), deadline=None)
@given(batches)
def test_concatenative_is_nemo_rl_s(lengths):
    assert get_packer("concatenative", 120).pack(lengths) == concatenative(lengths, 120)


@settings(max_examples=examples(100), deadline=None)
@given(batches)
def test_first_fit_decreasing_makes_nemo_rl_s_bins(lengths):
    bins = get_packer("first_fit_decreasing", 120).pack(lengths)
    assert [[lengths[i] for i in b] for b in bins] == first_fit_decreasing_loads(lengths, 120)


@settings(max_examples=examples(100), deadline=None)
@given(batches, st.sampled_from(sorted(NEMO_RL_ALGORITHMS)), st.integers(0, 10), st.integers(1, 4))
def test_bin_counts_and_every_index_once(lengths, algorithm, min_bins, multiple):
    packer = get_packer(algorithm, 120, min_bin_count=min_bins, bin_count_multiple=multiple)
    try:
        bins = packer.pack(lengths)
    except PackctlError as error:  # only when the bins asked for outnumber the sequences
        assert "lower min_packs or packs_multiple" in str(error)
        planned = len(get_packer(algorithm, 120).pack(lengths))
        assert -(-max(planned, min_bins) // multiple) * multiple > len(lengths)
        return
    assert len(bins) >= min_bins and len(bins) % multiple == 0
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(b and sum(lengths[i] for i in b) <= 120 for b in bins)


def test_the_packer_takes_nemo_rl_s_enum_and_collects_metrics():
    class PackingAlgorithm:  # the shape of NeMo-RL's enum member
        value = "modified_first_fit_decreasing"

    packer = SequencePacker(PackingAlgorithm(), 10, collect_metrics=True)
    assert sorted(i for b in packer.pack([6, 5, 4, 3, 2]) for i in b) == [0, 1, 2, 3, 4]
    assert packer.metrics[0]["utilization"] == pytest.approx(1.0)
    with pytest.raises(PackctlError, match=r"lengths\[0\] = 12 .* exceeds capacity 10"):
        packer.pack([12])


@settings(max_examples=examples(100), deadline=None)
@given(batches, st.integers(1, 6), st.booleans())
def test_partitions_are_karmarkar_karp(lengths, k, equal_size):
    if len(lengths) < k or (equal_size and len(lengths) % k):
        with pytest.raises(PackctlError):
            get_seqlen_balanced_partitions(lengths, k, equal_size)
        return
    parts = get_seqlen_balanced_partitions(lengths, k, equal_size)
    assert len(parts) == k and all(p == sorted(p) and p for p in parts)
    assert sorted(i for p in parts for i in p) == list(range(len(lengths)))
    if equal_size:
        assert {len(p) for p in parts} == {len(lengths) // k}
    assert sorted(parts) == karmarkar_karp(lengths, k, equal_size)


def test_partitions_example():
    assert get_seqlen_balanced_partitions(np.array([8, 7, 6, 5, 4]), 2, equal_size=False) == [[1, 3, 4], [0, 2]]
