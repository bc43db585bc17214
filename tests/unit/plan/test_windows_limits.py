"""Planning windows under limits (WindowOptions.limits, plan_windows extra=): windows, groups,
--group-scope step, exchanges (--epochs), pack order; the over-limit policies."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.profiles import examples

from packctl.plan.algorithms import ALGORITHMS
from packctl.plan.groups import GroupOverLimit
from packctl.plan.pack_order import reorder_packs
from packctl.plan.windows import SequenceOverLimit, SequenceTooLong, UncuttableSequence, merge_plans, plan_windows
from packctl.specs import WindowOptions

SETTINGS = settings(max_examples=examples(200, default=40), deadline=None, derandomize=True)


def assert_plan_keeps_every_budget(plan, gids, lengths, extra, options, dropped=()):
    placed = np.setdiff1d(gids, np.asarray(dropped, np.int64))
    covered = np.zeros(int(gids.max()) + 1 if len(gids) else 0, np.int64)
    np.add.at(covered, plan.piece_gid, plan.piece_len)
    true_length = dict(zip(gids.tolist(), lengths.tolist()))
    for gid in placed.tolist():
        assert covered[gid] == true_length[gid] or (options.too_long == "truncate" and covered[gid] == options.capacity)
    assert set(plan.piece_gid.tolist()) == set(placed.tolist())
    assert (plan.loads() <= options.capacity).all()
    loads = plan.extra_loads()
    assert loads.shape == (plan.num_bins, len(options.limits))
    assert (loads <= np.asarray(options.limits)).all()
    # each sequence's costs, on its one piece (only sequences of no cost are cut)
    cost = {g: extra[i] for i, g in enumerate(gids.tolist())}
    pieces = np.bincount(plan.piece_gid, minlength=covered.size)
    for p, gid in enumerate(plan.piece_gid.tolist()):
        if pieces[gid] > 1:
            assert not cost[gid].any() and not plan.piece_extra[p].any()
        else:
            assert plan.piece_extra[p].tolist() == cost[gid].tolist()


@st.composite
def corpora(draw):
    n = draw(st.integers(1, 120))
    capacity = draw(st.sampled_from([16, 64]))
    lengths = np.asarray(draw(st.lists(st.integers(1, capacity * 2), min_size=n, max_size=n)), np.int64)
    k = draw(st.integers(1, 3))
    limits = tuple(draw(st.sampled_from([1, 2, 4, 50])) for _ in range(k))
    extra = np.asarray([[draw(st.sampled_from([0, 0, 1, 2, 5][: 3 + (limit > 2)])) for limit in limits]
                        for _ in range(n)], np.int64).reshape(n, k)
    gids = np.asarray(draw(st.permutations(range(n))), np.int64)
    return gids, lengths[gids], extra[gids], capacity, limits


@SETTINGS
@given(data=corpora(), algorithm=st.sampled_from(ALGORITHMS), window=st.sampled_from([7, 1000]),
       align=st.sampled_from([1, 4]), exchanges=st.booleans(), max_seqs=st.sampled_from([None, 3]),
       pack_order=st.sampled_from(["planner", "shuffle"]))
def test_windows_keep_every_limit_and_drop_what_cannot_fit(data, algorithm, window, align, exchanges, max_seqs,
                                                          pack_order):
    gids, lengths, extra, capacity, limits = data
    options = WindowOptions(capacity=capacity, align=align, algorithm=algorithm, too_long="drop", window=window,
                            max_seqs_per_bin=max_seqs, seed=3, exchanges=exchanges, limits=limits)
    plan = plan_windows(gids, lengths, options, extra=extra)
    over_limit = (extra > np.asarray(limits)).any(axis=1)
    over_capacity = -(-lengths // align) * align > capacity
    assert plan.over_limit.tolist() == sorted(gids[over_limit].tolist())
    assert plan.dropped.tolist() == sorted(gids[over_limit | over_capacity].tolist())
    assert plan.tokens_dropped == int(lengths[over_limit | over_capacity].sum())
    assert_plan_keeps_every_budget(plan, gids, lengths, extra, options, plan.dropped)
    again = plan_windows(gids, lengths, options, extra=extra)
    assert np.array_equal(again.piece_gid, plan.piece_gid) and np.array_equal(again.bin_offsets, plan.bin_offsets)
    reordered = reorder_packs(plan, pack_order, 3)
    assert (reordered.extra_loads() <= np.asarray(limits)).all()
    assert sorted(map(tuple, reordered.extra_loads().tolist())) == sorted(map(tuple, plan.extra_loads().tolist()))


@SETTINGS
@given(data=corpora(), algorithm=st.sampled_from(ALGORITHMS), too_long=st.sampled_from(["truncate", "split", "drop"]),
       exchanges=st.booleans())
def test_limits_that_never_bind_plan_as_without_limits(data, algorithm, too_long, exchanges):
    gids, lengths, extra, capacity, limits = data
    if algorithm == "split" or too_long != "drop":  # media is never cut: compare sequences of no cost
        extra = np.zeros_like(extra)
    options = WindowOptions(capacity=capacity, align=1, algorithm=algorithm, too_long=too_long, window=50, seed=1,
                            exchanges=exchanges)
    without = plan_windows(gids, lengths, options)
    loose = plan_windows(gids, lengths, dataclasses.replace(options, limits=tuple(extra.sum(axis=0).tolist())),
                         extra=extra)
    for name in ("window_bins", "bin_offsets", "piece_gid", "piece_start", "piece_len", "piece_padded", "dropped",
                 "truncated"):
        assert np.array_equal(getattr(without, name), getattr(loose, name)), name
    assert without.piece_extra is None and without.extra_loads().shape == (without.num_bins, 0)


@SETTINGS
@given(data=corpora(), algorithm=st.sampled_from([a for a in ALGORITHMS if a != "split"]),
       step=st.sampled_from([None, 3]))
def test_groups_share_a_pack_and_keep_every_limit(data, algorithm, step):
    gids, lengths, extra, capacity, limits = data
    lengths = np.minimum(lengths, capacity // 4)
    extra = np.minimum(extra, np.asarray(limits) // 2)  # groups of at most 2 fit every limit
    new_group = np.zeros(len(gids), bool)
    new_group[::2] = True
    options = WindowOptions(capacity=capacity, align=1, algorithm=algorithm, too_long="drop", window=5, seed=2,
                            limits=limits, step_packs=step)
    plan = plan_windows(gids, lengths, options, new_group=new_group, extra=extra)
    assert_plan_keeps_every_budget(plan, gids, lengths, extra, options)
    if step is None:  # pack scope: both members of a group in one pack
        pack_of = dict(zip(plan.piece_gid.tolist(), np.repeat(np.arange(plan.num_bins), np.diff(plan.bin_offsets))))
        for a in range(0, len(gids) - 1, 2):
            assert pack_of[int(gids[a])] == pack_of[int(gids[a + 1])]


def test_a_group_over_a_limit_is_refused_naming_it():
    gids = np.array([4, 5, 6])
    options = WindowOptions(capacity=100, align=1, algorithm="ffd", too_long="drop", window=10, limits=(4,))
    with pytest.raises(GroupOverLimit) as err:
        plan_windows(gids, np.array([5, 5, 5]), options, new_group=np.array([True, False, True]),
                     extra=np.array([[3], [2], [1]]))
    assert (err.value.gid, err.value.members, err.value.cost, err.value.limit) == (4, 2, 5, 4)
    # with --group-scope step the members spread over packs: only a member over the limit is refused
    step = dataclasses.replace(options, step_packs=2)
    plan = plan_windows(gids, np.array([5, 5, 5]), step, new_group=np.array([True, False, True]),
                        extra=np.array([[3], [2], [1]]))
    assert (plan.extra_loads() <= 4).all() and sorted(plan.piece_gid.tolist()) == [4, 5, 6]


def test_over_a_limit_follows_too_long():
    gids, lengths = np.array([7, 3, 5]), np.array([4, 4, 40])
    extra = np.array([[0, 1], [0, 9], [2, 0]])  # gid 3 over the second limit; gid 5 over capacity with a cost
    base = WindowOptions(capacity=10, align=1, algorithm="bfd", too_long="drop", window=10, limits=(2, 8))
    plan = plan_windows(gids, lengths, base, extra=extra)
    assert plan.dropped.tolist() == [3, 5] and plan.over_limit.tolist() == [3] and plan.tokens_dropped == 44
    with pytest.raises(SequenceOverLimit) as err:
        plan_windows(gids, lengths, dataclasses.replace(base, too_long="error"), extra=extra)
    assert (err.value.gid, err.value.column, err.value.cost, err.value.limit) == (3, 1, 9, 8)
    for too_long in ("truncate", "split"):
        with pytest.raises(SequenceOverLimit, match="cannot cut media"):
            plan_windows(gids, lengths, dataclasses.replace(base, too_long=too_long), extra=extra)
        with pytest.raises(UncuttableSequence, match=f"--too-long {too_long} would cut its media") as err:
            plan_windows(gids[[0, 2]], lengths[[0, 2]], dataclasses.replace(base, too_long=too_long),
                         extra=extra[[0, 2]])
        assert err.value.gid == 5 and err.value.column == 0
    # error: the smaller gid decides which comes first
    with pytest.raises(SequenceTooLong):
        plan_windows(np.array([1, 3]), np.array([40, 4]), dataclasses.replace(base, too_long="error"),
                     extra=np.array([[0, 0], [0, 9]]))
    # an over-long sequence of no cost is still cut or truncated
    cut = plan_windows(np.array([1]), np.array([25]), dataclasses.replace(base, too_long="split"),
                       extra=np.array([[0, 0]]))
    assert cut.piece_len.tolist() == [10, 10, 5] and (cut.extra_loads() == 0).all()


def test_bad_extra_is_refused():
    options = WindowOptions(capacity=10, align=1, algorithm="ffd", too_long="drop", window=10, limits=(2,))
    with pytest.raises(ValueError, match="pass extra"):
        plan_windows(np.array([0]), np.array([3]), options)
    with pytest.raises(ValueError, match="shape"):
        plan_windows(np.array([0]), np.array([3]), options, extra=np.array([[1, 1]]))
    with pytest.raises(ValueError, match="without limits"):
        plan_windows(np.array([0]), np.array([3]), dataclasses.replace(options, limits=()), extra=np.array([[1]]))
    with pytest.raises(ValueError, match="batch mode"):
        plan_windows(np.array([0]), np.array([3]), dataclasses.replace(options, algorithm="batch", max_tokens=10),
                     extra=np.array([[1]]))


def test_merged_plans_keep_their_costs():
    options = WindowOptions(capacity=10, align=1, algorithm="ffd", too_long="drop", window=2, limits=(1,))
    extra = np.array([[1], [1], [0], [1]])
    whole = plan_windows(np.arange(4), np.array([3, 3, 3, 3]), options, extra=extra)
    first = plan_windows(np.arange(2), np.array([3, 3]), options, extra=extra[:2])
    second = plan_windows(np.arange(2, 4), np.array([3, 3]), options, first_window=1, extra=extra[2:])
    merged = merge_plans([first, second])
    assert np.array_equal(merged.piece_extra, whole.piece_extra)
    assert merged.extra_loads().tolist() == whole.extra_loads().tolist()
    with pytest.raises(ValueError, match="limits"):
        merge_plans([first, plan_windows(np.arange(2), np.array([3, 3]), dataclasses.replace(options, limits=()))])
