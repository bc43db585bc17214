"""Exchanges at equal cost (plan/exchange.py): epochs 1.. of --epochs keep the exact plan's number
of packs, every pack within capacity and --max-seqs-per-bin, every sequence once, split pieces
and groups where the planner put them, and repeat at most 5% of epoch 0's packs on sample_data."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from packctl.plan.exchange import exchange_pieces
from packctl.plan.windows import plan_windows
from packctl.specs import WindowOptions

SAMPLE = Path(__file__).resolve().parents[3] / "sample_data"


def _packs(plan):
    return [frozenset(plan.piece_gid[a:b].tolist()) for a, b in zip(plan.bin_offsets[:-1], plan.bin_offsets[1:])]


@settings(max_examples=150, deadline=None)
@given(lengths=st.lists(st.integers(1, 5000), min_size=1, max_size=300), seed=st.integers(0, 2**31),
       algorithm=st.sampled_from(["concat", "ffd", "bfd", "mffd", "ffs", "pool", "split"]),
       align=st.sampled_from([1, 8]), max_seqs=st.sampled_from([None, 3]), window=st.sampled_from([50, 1000]),
       too_long=st.sampled_from(["split", "truncate"]), groups=st.booleans())
def test_exchanges_keep_every_rule_of_the_plan(lengths, seed, algorithm, align, max_seqs, window, too_long, groups):
    lengths = np.asarray(lengths, np.int64)
    gids = np.random.default_rng(seed).permutation(len(lengths)).astype(np.int64)
    new_group = None
    if groups and algorithm not in ("split",):
        new_group = np.random.default_rng(seed + 1).random(len(lengths)) < 0.6
        new_group[::3] = True  # groups of at most 3 sequences of at most 1,024 tokens: every group fits a pack
        lengths = np.minimum(lengths, 4096 // 4)
        max_seqs = None
    capacity = 4096
    kw = dict(capacity=capacity, align=align, algorithm=algorithm, too_long=too_long, window=window,
              max_seqs_per_bin=max_seqs, seed=seed)
    exact = plan_windows(gids, lengths[gids], WindowOptions(**kw), new_group=new_group)
    moved = plan_windows(gids, lengths[gids], WindowOptions(**kw, exchanges=True), new_group=new_group)
    assert np.array_equal(moved.window_bins, exact.window_bins)  # as many packs, window by window
    loads = np.add.reduceat(moved.piece_padded, moved.bin_offsets[:-1]) if len(moved.piece_padded) else []
    assert (np.asarray(loads) <= capacity).all()
    if max_seqs is not None:
        assert (np.diff(moved.bin_offsets) <= max_seqs).all()
    key = lambda p: sorted(zip(p.piece_gid.tolist(), p.piece_start.tolist(), p.piece_len.tolist()))  # noqa: E731
    assert key(moved) == key(exact)  # every piece once, unchanged
    pack = lambda p: np.repeat(np.arange(p.num_bins), np.diff(p.bin_offsets))  # noqa: E731
    # split pieces never move; members of a group of two or more stay together in their pack
    split = exact.split_gids()
    for plan_a, plan_b in ((exact, moved),):
        pa, pb = pack(plan_a), pack(plan_b)
        for gid in split.tolist():
            assert pa[plan_a.piece_gid == gid].tolist() == pb[plan_b.piece_gid == gid].tolist()
    if new_group is not None:
        group = np.cumsum(new_group) - 1
        group_of_gid = np.empty(len(lengths), np.int64)
        group_of_gid[gids] = group
        sizes = np.bincount(group)
        pb = pack(moved)
        pa = pack(exact)
        for g in np.flatnonzero(sizes > 1).tolist():
            members = group_of_gid[moved.piece_gid] == g
            assert len(set(pb[members].tolist())) == 1
            assert set(pb[members].tolist()) == set(pa[group_of_gid[exact.piece_gid] == g].tolist())


def test_same_window_same_exchanges_and_epoch_zero_is_the_exact_plan():
    rng = np.random.default_rng(3)
    lengths = np.clip(rng.lognormal(6.5, 1.0, 3000).astype(np.int64), 1, 4096)
    gids = np.arange(3000)
    options = WindowOptions(capacity=4096, align=1, algorithm="bfd", too_long="split", window=1000, exchanges=True)
    whole = plan_windows(gids, lengths, options)
    tail = plan_windows(gids[1000:], lengths[1000:], options, first_window=1)  # another rank's windows
    assert np.array_equal(tail.piece_gid, whole.piece_gid[whole.bin_offsets[whole.window_bins[1]]:])
    exact = plan_windows(gids, lengths, WindowOptions(capacity=4096, align=1, algorithm="bfd", too_long="split",
                                                      window=1000))
    kept = {p for p in _packs(exact) if len(p) > 1} & set(_packs(whole))
    assert len(kept) <= 0.05 * whole.num_bins  # packs of one sequence cannot change


def test_the_cheapest_move_and_no_move_that_changes_nothing():
    take, offsets = exchange_pieces(np.array([0, 2, 4]), np.array([6, 4, 6, 4]), np.ones(4, bool), 10, 4, seed=0)
    assert offsets.tolist() == [0, 2, 4] and sorted(take.tolist()) == [0, 1, 2, 3]
    assert {frozenset(take[:2].tolist()), frozenset(take[2:].tolist())} != {frozenset({0, 1}), frozenset({2, 3})}
    # two packs of one sequence each: trading them would give the same packs, so nothing moves
    take, _ = exchange_pieces(np.array([0, 1, 2]), np.array([10, 10]), np.ones(2, bool), 10, 4, seed=0)
    assert take.tolist() == [0, 1]


@pytest.mark.skipif(not SAMPLE.is_dir(), reason="sample_data is not there")
@pytest.mark.parametrize("algorithm", ["ffd", "bfd", "mffd", "ffs", "pool", "concat"])
def test_sample_data_epochs_repeat_at_most_5_percent_at_no_extra_pack(algorithm):
    from packctl.config import PackConfig
    from packctl.pipeline.plan import plan_corpus
    from packctl.plan.order import epoch_seed
    from packctl.stats.whatif import read_lengths

    index = read_lengths([str(SAMPLE)])
    config = PackConfig(inputs=[str(SAMPLE)], output="/dev/null", capacity=4096, algorithm=algorithm,
                        order="shuffle", too_long="split", epochs=3, pack_order="planner")
    specs = config.specs()
    plans = [plan_corpus(index, specs.for_epoch(epoch_seed(0, e), exchanges=e > 0)).plan for e in range(3)]
    exact = [plan_corpus(index, specs.for_epoch(epoch_seed(0, e), exchanges=False)).plan for e in range(3)]
    first = {p for p in _packs(plans[0]) if len(p) > 1}
    for plan, plain in zip(plans[1:], exact[1:]):
        assert plan.num_bins == plain.num_bins
        assert len([p for p in _packs(plan) if p in first]) / plan.num_bins <= 0.05


@settings(max_examples=60, deadline=None, derandomize=True)
@given(lengths=st.lists(st.integers(1, 60), min_size=2, max_size=120), seed=st.integers(0, 2**31),
       limit=st.sampled_from([1, 2, 3]))
def test_exchanges_keep_every_limit(lengths, seed, limit):
    """With limits (images per pack), a move that would take a pack over one is refused like one
    over the capacity; the packs still change."""
    lengths = np.asarray(lengths, np.int64)
    images = np.random.default_rng(seed).integers(0, 2, (len(lengths), 1))
    options = WindowOptions(capacity=100, align=1, algorithm="ffd", too_long="drop", window=10_000, seed=seed,
                            limits=(limit,))
    first = plan_windows(np.arange(len(lengths)), lengths, options, extra=images)
    later = plan_windows(np.arange(len(lengths)), lengths, dataclasses.replace(options, exchanges=True), extra=images)
    assert later.num_bins == first.num_bins and (later.loads() <= 100).all()
    assert (later.extra_loads() <= limit).all()
    assert sorted(later.piece_gid.tolist()) == list(range(len(lengths)))
    assert later.piece_extra[:, 0].tolist() == images[later.piece_gid, 0].tolist()


def test_exchange_refuses_a_move_over_a_limit():
    # packs [6 4] [6 4], one image each (on the first 6 and the second 4): every exchange of equal
    # lengths would give one pack two images
    offsets, padded = np.array([0, 2, 4]), np.array([6, 4, 6, 4])
    images = np.array([[1], [0], [0], [1]])
    take, new_offsets = exchange_pieces(offsets, padded, np.ones(4, bool), 10, 4, seed=1, extra=images,
                                        limits=np.array([1]))
    assert take.tolist() == [0, 1, 2, 3] and new_offsets.tolist() == [0, 2, 4]
    take, _ = exchange_pieces(offsets, padded, np.ones(4, bool), 10, 4, seed=1, extra=images, limits=np.array([2]))
    assert take.tolist() != [0, 1, 2, 3]
