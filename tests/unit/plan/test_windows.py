"""Planning across windows, and the over-long policies."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from packctl.plan.windows import SequenceTooLong, WindowOptions, plan_windows
from support.profiles import examples


def plan_in_order(lengths, permutation, **options):
    """plan_windows over all sequences, given the gid order."""
    lengths, permutation = np.asarray(lengths), np.asarray(permutation)
    first_window, progress = options.pop("first_window", 0), options.pop("progress", None)
    return plan_windows(permutation, lengths[permutation], WindowOptions(**options), first_window=first_window,
                        progress=progress)


def pieces(plan):
    return [[(int(g), int(s), int(l)) for g, s, l in zip(plan.piece_gid[a:b], plan.piece_start[a:b], plan.piece_len[a:b])]
            for a, b in zip(plan.bin_offsets[:-1], plan.bin_offsets[1:])]


def test_split_chunks_go_right_before_the_last_piece():
    plan = plan_in_order(np.array([3, 19, 4]), np.arange(3), capacity=8, align=1, algorithm="concat",
                        too_long="split", window=10)
    # concat packs [gid 0 (3), last piece of gid 1 (3)] then [gid 2 (4)]; gid 1's full chunks
    # come right before the pack holding its last piece
    assert pieces(plan) == [[(1, 0, 8)], [(1, 8, 8)], [(0, 0, 3), (1, 16, 3)], [(2, 0, 4)]]
    assert plan.split_gids().tolist() == [1]


def test_split_with_ffd_keeps_pieces_in_order():
    # ffd puts the 3-token remainder of gid 1 into the first pack (with gid 0): its full chunk
    # must still come first
    plan = plan_in_order(np.array([4, 11]), np.arange(2), capacity=8, align=1, algorithm="ffd",
                        too_long="split", window=10)
    assert pieces(plan) == [[(1, 0, 8)], [(0, 0, 4), (1, 8, 3)]]


def test_drop_and_truncate_count():
    lengths = np.array([5, 12, 3, 20])
    drop = plan_in_order(lengths, np.arange(4), capacity=8, align=4, algorithm="ffd", too_long="drop", window=2)
    assert drop.dropped.tolist() == [1, 3] and drop.tokens_dropped == 32
    assert sorted(drop.piece_gid.tolist()) == [0, 2]
    trunc = plan_in_order(lengths, np.arange(4), capacity=8, align=4, algorithm="ffd", too_long="truncate", window=2)
    assert trunc.truncated.tolist() == [1, 3] and trunc.tokens_truncated == 4 + 12
    assert dict(zip(trunc.piece_gid.tolist(), trunc.piece_len.tolist())) == {0: 5, 1: 8, 2: 3, 3: 8}


def test_error_names_the_first_sequence():
    with pytest.raises(SequenceTooLong) as err:
        plan_in_order(np.array([5, 9, 12]), np.array([2, 1, 0]), capacity=8, align=1, algorithm="ffd",
                     too_long="error", window=10)
    assert err.value.gid == 1 and err.value.length == 9


def test_alignment_is_applied_before_packing():
    # 5 -> 8 with align 4: two of them fill capacity 16; without alignment three would fit
    plan = plan_in_order(np.array([5, 5, 5]), np.arange(3), capacity=16, align=4, algorithm="ffd",
                        too_long="error", window=10)
    assert plan.num_bins == 2
    assert plan.piece_padded.tolist() == [8, 8, 8]
    assert plan.loads().tolist() == [16, 8]


@settings(max_examples=examples(150), deadline=None)
@given(lengths=st.lists(st.integers(1, 100), min_size=1, max_size=60),
       algorithm=st.sampled_from(["concat", "ffd", "bfd", "mffd", "ffs", "split"]),
       too_long=st.sampled_from(["drop", "truncate", "split"]), align=st.sampled_from([1, 2, 4]),
       window=st.integers(1, 70), order_seed=st.integers(0, 1000))
def test_pieces_cover_what_the_policy_keeps(lengths, algorithm, too_long, align, window, order_seed):
    lengths = np.array(lengths)
    capacity = 32
    perm = np.random.default_rng(order_seed).permutation(len(lengths))
    plan = plan_in_order(lengths, perm, capacity=capacity, align=align, algorithm=algorithm, too_long=too_long,
                        window=window)
    assert (plan.loads() <= capacity).all()
    assert (plan.piece_padded == (plan.piece_len + align - 1) // align * align).all()
    assert (plan.piece_len >= 1).all()
    # windows partition the packs and each window's packs hold exactly that window's sequences
    assert plan.window_bins[0] == 0 and plan.window_bins[-1] == plan.num_bins
    for w in range(plan.num_windows):
        a, b = plan.bin_offsets[plan.window_bins[w]], plan.bin_offsets[plan.window_bins[w + 1]]
        expected = set(perm[w * window:(w + 1) * window].tolist()) - set(plan.dropped.tolist())
        assert set(plan.piece_gid[a:b].tolist()) == expected
    # per sequence: pieces in output order are contiguous and cover the kept tokens
    for gid, n in enumerate(lengths):
        mine = np.flatnonzero(plan.piece_gid == gid)
        if gid in plan.dropped:
            assert len(mine) == 0
            continue
        starts, lens = plan.piece_start[mine], plan.piece_len[mine]
        assert starts[0] == 0 and (starts[1:] == (starts + lens)[:-1]).all()
        kept = min(n, capacity) if gid in plan.truncated else n
        assert lens.sum() == kept


def test_split_pieces_are_those_of_split_gids_and_each_window_answers_alone():
    from packctl.plan.windows import PackPlan

    def plan(window_bins, gids, starts):
        n = len(gids)
        return PackPlan(window_bins=np.array(window_bins), bin_offsets=np.arange(n + 1), piece_gid=np.array(gids),
                        piece_start=np.array(starts), piece_len=np.ones(n, np.int64),
                        piece_padded=np.ones(n, np.int64), dropped=np.zeros(0, np.int64),
                        truncated=np.zeros(0, np.int64), tokens_dropped=0, tokens_truncated=0)

    once = plan([0, 3, 5], [4, 4, 5, 6, 6], [0, 9, 0, 0, 3])  # every gid planned once
    split, count = once.split_pieces()
    assert split.tolist() == np.isin(once.piece_gid, once.split_gids()).tolist() and count == len(once.split_gids())
    # a blend plans row 5 twice, in two windows, uncut: not split, whichever windows a rank holds
    twice = plan([0, 3, 4], [4, 4, 5, 5], [0, 9, 0, 0])
    assert twice.split_pieces()[0].tolist() == [True, True, False, False] and twice.split_pieces()[1] == 1
