"""Metrics against hand computations (the worked example of packctl/plan/metrics.py)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from hypothesis import given, settings, strategies as st

from packctl.plan.metrics import length_histogram, martello_toth_l2, pack_metrics, padded_batching_tokens
from support.profiles import examples


def test_worked_example():
    # C = 8, align 2, packs [3, 2] and [5], both written at length 8
    m = pack_metrics(np.array([3, 2, 5]), np.array([0, 2, 3]), np.array([8, 8]), capacity=8, align=2)
    assert m["packs"] == 2 and m["sequences"] == 3 and m["tokens"] == 10
    assert m["utilization"] == pytest.approx(10 / 16)
    assert m["waste_ratio"] == pytest.approx(6 / 16)
    assert m["bin_balance"] == pytest.approx(1.0)
    assert m["lower_bound_packs"] == 2 and m["packing_efficiency"] == pytest.approx(1.0)
    assert m["padding"] == {"alignment_tokens": 2, "tail_tokens": 4, "written_tokens": 16,
                            "fraction_of_written": pytest.approx(6 / 16)}
    assert m["sequences_per_pack"] == {"min": 1, "mean": 1.5, "max": 2, "histogram": [0, 1, 1]}


def test_unbalanced_and_inefficient_packing():
    # C = 10, align 1: packs [9], [1], [5] -> loads .9 .1 .5
    m = pack_metrics(np.array([9, 1, 5]), np.array([0, 1, 2, 3]), np.array([10, 10, 10]), capacity=10, align=1)
    fill = np.array([0.9, 0.1, 0.5])
    util = 15 / 30
    assert m["utilization"] == pytest.approx(util)
    assert m["bin_balance"] == pytest.approx(1 - math.sqrt(((fill - fill.mean()) ** 2).mean()) / util)
    assert m["lower_bound_packs"] == 2 and m["packing_efficiency"] == pytest.approx(2 / 3)


def test_padded_batching_baseline():
    assert padded_batching_tokens(np.array([3, 5, 2, 2]), 2) == 2 * 5 + 2 * 2
    assert padded_batching_tokens(np.array([3, 5, 2]), 2) == 2 * 5 + 1 * 2
    assert padded_batching_tokens(np.array([], np.int64), 3) == 0
    # the baseline batches in input order: sequence 9 comes first there
    m = pack_metrics(np.array([1, 1, 9, 9]), np.array([0, 2, 4]), np.array([10, 10]), capacity=10, align=1,
                     input_order=np.array([2, 0, 3, 1]))
    assert m["padded_batching"]["batch_size"] == 2
    assert m["padded_batching"]["tokens"] == 2 * 9 + 2 * 9
    assert m["padded_batching"]["estimated_gain"] == pytest.approx(36 / 20)


def test_length_histogram_power_of_two_buckets():
    h = length_histogram(np.array([1, 2, 3, 4, 7, 8, 100]))
    assert h["edges"] == [1, 2, 4, 8, 16, 32, 64, 128]
    assert h["counts"] == [1, 2, 2, 1, 0, 0, 1]


def test_martello_toth_l2_examples():
    assert martello_toth_l2(np.array([6, 6, 6, 4, 4, 4]), 10) == 3
    assert martello_toth_l2(np.array([7, 7, 7, 4, 4, 4]), 10) == 5  # ceil(sum/C) says 4
    assert martello_toth_l2(np.array([1] * 25), 10) == 3
    assert martello_toth_l2(np.array([10, 1]), 10) == 2


@settings(max_examples=examples(200), deadline=None)
@given(st.lists(st.integers(1, 12), min_size=1, max_size=9))
def test_martello_toth_l2_is_a_valid_bound(lengths):
    """ceil(sum/C) <= L2 <= the optimum, found by exhaustive search on tiny inputs."""
    capacity = 12
    lengths = sorted(lengths, reverse=True)
    best = len(lengths)

    def place(i, loads):
        nonlocal best
        if len(loads) >= best:
            return
        if i == len(lengths):
            best = len(loads)
            return
        for b in range(len(loads)):
            if loads[b] + lengths[i] <= capacity:
                loads[b] += lengths[i]
                place(i + 1, loads)
                loads[b] -= lengths[i]
        place(i + 1, loads + [lengths[i]])

    place(0, [])
    bound = martello_toth_l2(np.array(lengths), capacity)
    assert math.ceil(sum(lengths) / capacity) <= bound <= best
