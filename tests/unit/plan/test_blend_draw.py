"""plan/mixture.py: the draw of a blend's uses and the interleave of its sources, against the
tolerances docs/mixtures.md states (2 to 5 sources of skewed sizes)."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from packctl.plan.mixture import (Blend, EmptySource, RepeatOverCap, draw_blend, draw_uses, interleave, source_order,
                                  uses_of, window_deviation)


def test_the_docstring_example():
    draw = draw_uses([np.array([100, 100, 100]), np.array([10, 10, 10, 10])], [np.arange(3), np.arange(3, 7)],
                     np.array([0.75, 0.25]), np.array([1.0, 1.0]))
    assert draw.size == 160
    assert [int(c.sum()) for c in draw.counts] == [1, 4]
    assert interleave([np.array([100]), np.array([10, 10, 10, 10])]).tolist() == [1, 2, 0, 3, 4]
    assert interleave([np.array([2, 2]), np.array([1, 1, 1, 1])]).tolist() == [2, 0, 3, 4, 1, 5]


def test_uses_come_pass_by_pass():
    gids, passes = uses_of(np.array([7, 8, 9]), np.array([2, 1, 0]))
    assert gids.tolist() == [7, 8, 7] and passes.tolist() == [0, 0, 1]


def test_a_blend_over_a_cap_is_refused_naming_the_source_and_what_it_needs():
    with pytest.raises(RepeatOverCap) as info:
        draw_uses([np.full(10, 5), np.full(10, 5)], [np.arange(10), np.arange(10, 20)], np.array([0.5, 0.5]),
                  np.array([1.0, 2.0]), size=250)
    assert info.value.source == 0 and math.isclose(info.value.needed, 2.5) and info.value.cap == 1.0
    with pytest.raises(EmptySource):
        draw_uses([np.zeros(3, np.int64), np.ones(3, np.int64)], [np.arange(3), np.arange(3, 6)],
                  np.array([0.5, 0.5]), np.array([1.0, 1.0]))


def _blend(seed: int, sources: int):
    """Sources of skewed sizes (rows 3 to 400) and lengths (1 to 300), weights from 0.02 up."""
    rng = np.random.default_rng(seed)
    rows = rng.integers(3, 400, sources)
    lengths = np.concatenate([rng.integers(1, rng.integers(2, 300), n) for n in rows])
    starts = np.concatenate([[0], np.cumsum(rows)])
    weights = rng.uniform(0.02, 1.0, sources)
    return lengths, starts, weights / weights.sum()


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32), st.integers(2, 5), st.floats(0.2, 3.0), st.sampled_from(["input", "shuffle",
                                                                                       "curriculum"]))
def test_every_window_holds_each_source_within_the_stated_tolerance(seed, sources, scale, order):
    lengths, starts, weights = _blend(seed, sources)
    longest = [int(lengths[starts[k]:starts[k + 1]].max()) for k in range(sources)]
    natural = min(lengths[starts[k]:starts[k + 1]].sum() / weights[k] for k in range(sources))
    size = int(natural * scale)
    draw, gids = draw_blend(lengths, Blend(starts, weights, [10.0] * sources, size=size, seed=seed))
    # overall: each source gives its target within half its longest row
    given = np.array([int((lengths[g] * c).sum()) for g, c in zip(gids, draw.counts)])
    assert np.all(np.abs(given - weights * size) <= np.array(longest) / 2 + 1e-6)
    for k, (g, c) in enumerate(zip(gids, draw.counts)):  # every row used floor(r) or ceil(r) times
        passes = weights[k] * size / lengths[g].sum()
        assert c.min() >= math.floor(passes + 1e-9) and c.max() <= math.ceil(passes - 1e-9)
    # each source in its order, then interleaved
    order_of, units = [], []
    for k, (g, c) in enumerate(zip(gids, draw.counts)):
        use, passes = uses_of(g, c)
        perm = source_order(use, passes, lengths[use], order, seed=seed, source=k, num_sequences=len(lengths))
        order_of.append(use[perm])
        units.append(lengths[use[perm]])
    positions = interleave(units)
    used = np.concatenate(order_of)[positions]
    source = (np.searchsorted(starts, used, side="right") - 1)
    realized = given / given.sum()
    rng = np.random.default_rng(seed + 1)
    cuts = np.sort(rng.integers(0, len(used) + 1, 12))
    for a, b in zip(cuts[:-1], cuts[1:]):
        window = lengths[used[a:b]]
        total = int(window.sum())
        for k in range(sources):
            mine = int(window[source[a:b] == k].sum())
            bound = longest[k] + realized[k] * sum(longest)
            assert abs(mine - realized[k] * total) <= bound + 1e-6, (k, a, b)
            assert abs(mine - weights[k] * total) <= bound + abs(realized[k] - weights[k]) * total + 1e-6


def test_the_draw_is_seeded_and_independent_of_anything_else():
    lengths, starts, weights = _blend(3, 3)
    one, _ = draw_blend(lengths, Blend(starts, weights, [5.0] * 3, size=int(lengths.sum()), seed=1))
    again, _ = draw_blend(lengths.copy(), Blend(starts, weights, [5.0] * 3, size=int(lengths.sum()), seed=1))
    other, _ = draw_blend(lengths, Blend(starts, weights, [5.0] * 3, size=int(lengths.sum()), seed=2))
    assert all(np.array_equal(a, b) for a, b in zip(one.counts, again.counts))
    assert not all(np.array_equal(a, b) for a, b in zip(one.counts, other.counts))


def test_sequences_as_the_unit_and_the_size_of_one_pass_over_a_source():
    lengths = np.array([1, 1, 1, 1, 100, 100], np.int64)
    draw, _ = draw_blend(lengths, Blend([0, 4, 6], [0.5, 0.5], [3.0, 3.0], unit="sequences", epochs_of=1))
    assert draw.size == 4  # source 1 once: 2 sequences at weight 0.5
    assert draw.counts[1].tolist() == [1, 1] and int(draw.counts[0].sum()) == 2 and draw.counts[0].max() == 1


def test_window_deviation_is_the_worst_share_off_its_weight():
    assert window_deviation(np.array([0, 1, 0, 1]), np.array([1, 1, 1, 1]), 2, np.array([0.5, 0.5])).tolist() == [0, 0]
    assert window_deviation(np.array([0, 0, 1, 1]), np.array([1, 1, 1, 1]), 2, np.array([0.5, 0.5])).tolist() == [
        0.5, 0.5]


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31), st.integers(1, 4))
def test_groups_are_drawn_whole_and_each_source_gives_its_target_within_half_its_largest_group(seed, sources):
    from packctl.plan.mixture import blend_groups, member_uses

    rng = np.random.default_rng(seed)
    rows = rng.integers(5, 60, sources)
    lengths = rng.integers(1, 100, int(rows.sum()))
    gid_starts = np.concatenate([[0], np.cumsum(rows)])
    cuts = np.flatnonzero(rng.random(len(lengths)) < 0.5)  # groups of 1 to a few rows, some over two sources
    groups = blend_groups(np.concatenate([[0], cuts[cuts > 0], [len(lengths)]]), gid_starts)
    weights = rng.dirichlet(np.ones(sources))
    found, gids = draw_blend(lengths, Blend(gid_starts, weights, np.full(sources, 1e6), size=int(lengths.sum()),
                                            seed=seed), group_starts=groups)
    uses = member_uses(len(lengths), gids, found.counts, groups)
    member_of = np.searchsorted(groups, np.arange(len(lengths)), side="right") - 1
    assert (uses == uses[groups[member_of]]).all()  # every row as often as its group
    largest = np.maximum.reduceat(np.add.reduceat(lengths, groups[:-1]), np.searchsorted(groups[:-1], gid_starts[:-1]))
    for k in range(sources):
        given_k = int((uses * lengths)[gid_starts[k]:gid_starts[k + 1]].sum())
        assert abs(given_k - found.targets[k]) <= largest[k] / 2 + 1e-6
