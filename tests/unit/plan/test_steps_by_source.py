"""`--step-grouping source`: a window's packs dealt so that every source's packs spread evenly
over its steps (`deal_by_source`), and the order kept whose steps hold the blend best
(`steps_by_source`)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from packctl.plan.balance import deal_by_source, steps_by_source, worst_step_share_deviation


@st.composite
def windows(draw):
    """(units P x K, weights K, per_step): packs each of one or a few sources."""
    k = draw(st.integers(1, 4))
    num = draw(st.integers(0, 40))
    units = np.array(draw(st.lists(st.lists(st.integers(0, 50), min_size=k, max_size=k), min_size=num,
                                   max_size=num)), dtype=np.int64).reshape(num, k)
    weights = np.array(draw(st.lists(st.integers(1, 10), min_size=k, max_size=k)), dtype=np.float64)
    return units, weights / weights.sum(), draw(st.integers(1, 8))


@settings(max_examples=200, deadline=None, derandomize=True)
@given(window=windows())
def test_every_pack_once_and_every_source_spread_evenly_over_the_full_steps(window):
    units, weights, per_step = window
    order = deal_by_source(units, weights, per_step)
    assert sorted(order.tolist()) == list(range(len(units)))
    if len(units) == 0:
        return
    dominant = np.argmax(units, axis=1)[order]
    steps = -(-len(units) // per_step)
    full = steps - 1 if len(units) % per_step else steps
    for j in np.unique(dominant):
        counts = [int((dominant[s * per_step:(s + 1) * per_step] == j).sum()) for s in range(full)]
        assert not counts or max(counts) - min(counts) <= 1, (j, counts)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(window=windows())
def test_the_order_kept_holds_the_blend_at_least_as_well_as_either(window):
    units, weights, per_step = window
    chosen = steps_by_source(units, weights, per_step)
    assert sorted(chosen.tolist()) == list(range(len(units)))
    best = min(worst_step_share_deviation(units, weights, per_step),
               worst_step_share_deviation(units[deal_by_source(units, weights, per_step)], weights, per_step))
    assert worst_step_share_deviation(units[chosen], weights, per_step) == best


def test_packs_of_one_source_each_are_dealt_two_and_one():
    # the planner's order: a step of three packs of source 0, then one of 0 and two of 1
    units = np.array([[8, 0], [8, 0], [8, 0], [8, 0], [0, 8], [0, 8]])
    weights = np.array([2 / 3, 1 / 3])
    assert worst_step_share_deviation(units, weights, 3) == pytest.approx(1 / 3)
    dealt = deal_by_source(units, weights, 3)
    assert dealt.tolist() == [0, 2, 4, 1, 3, 5]  # two of source 0 and one of 1 in each step
    assert worst_step_share_deviation(units[dealt], weights, 3) == pytest.approx(0.0, abs=1e-12)
    assert steps_by_source(units, weights, 3).tolist() == dealt.tolist()


def test_packs_that_mix_sources_keep_the_planners_order():
    units = np.array([[6, 2], [6, 3], [5, 3], [7, 2]])
    weights = np.array([0.7, 0.3])
    assert steps_by_source(units, weights, 2).tolist() == [0, 1, 2, 3]
