"""--pack-order: the stratified shuffle's bound in every window, split sequences kept in order,
the epochs of --order shuffle differing pack by pack, and the step order under --dp-size."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from packctl.plan.balance import balance_plan
from packctl.plan.order import epoch_seed, order_sequences
from packctl.plan.pack_order import (TINY_WINDOW, average_ranks, pack_keys, reorder_packs, spearman, split_precedence,
                                     split_units, stratified_permutation)
from packctl.plan.windows import plan_windows
from packctl.specs import BalanceSpec, WindowOptions

BOUND = 0.05  # the promise; the shuffle aims at 0.01


def test_spearman_and_ranks_of_small_examples():
    assert average_ranks(np.array([5, 1, 5])).tolist() == [1.5, 0.0, 1.5]
    assert spearman(np.array([1, 2, 3])) == 1.0 and spearman(np.array([3, 2, 1])) == -1.0
    assert spearman(np.array([4, 4, 4])) == 0.0 and spearman(np.array([7])) == 0.0


def test_packs_linked_by_split_sequences_are_one_unit():
    unit_of, members = split_units(5, np.array([[1, 3]]))
    assert unit_of.tolist() == [0, 1, 2, 1, 3] and members.tolist() == [0, 1, 3, 4, 5]
    unit_of, members = split_units(6, np.array([[4, 1], [1, 5], [2, 3]]))  # 1-4-5 linked through 1
    assert unit_of.tolist() == [0, 1, 2, 2, 1, 1] and members.tolist() == [0, 1, 4, 6]


@settings(max_examples=100, deadline=None)
@given(n=st.integers(TINY_WINDOW, 800), chains=st.integers(0, 120), seed=st.integers(0, 2**32))
def test_split_sequences_neither_break_their_order_nor_bring_back_the_trend(n, chains, seed):
    """Planner order longest first; `chains` split sequences, each a full pack (the longest key)
    followed by a tail pack further down, linked packs up to a quarter of the window (the
    bound is promised up to there: docs/cli.md): kept in order, and no trend of length with position."""
    rng = np.random.default_rng(seed)
    keys = np.sort(rng.integers(1, 4096, n))[::-1].astype(np.float64)
    chains = min(chains, n // 8)
    heads = np.arange(chains)
    keys[heads] = 4096
    tails = np.sort(rng.choice(np.arange(chains, n), chains, replace=False))
    before = np.stack([heads, tails], axis=1) if chains else None
    perm = stratified_permutation(keys, np.random.default_rng(seed), before)
    assert sorted(perm.tolist()) == list(range(n))
    position = np.empty(n, dtype=np.int64)
    position[perm] = np.arange(n)
    assert np.all(position[heads] < position[tails])
    assert abs(spearman(keys[perm])) <= BOUND


@settings(max_examples=150, deadline=None)
@given(keys=st.lists(st.integers(1, 4096), min_size=TINY_WINDOW, max_size=600),
       few_values=st.booleans(), seed=st.integers(0, 2**32))
def test_stratified_shuffle_holds_the_bound_in_every_window(keys, few_values, seed):
    keys = np.asarray(keys)
    if few_values:  # heavy ties: a handful of distinct lengths
        keys = keys % 4 * 1000 + 1
    perm = stratified_permutation(keys, np.random.default_rng(seed))
    assert sorted(perm.tolist()) == list(range(len(keys)))
    assert abs(spearman(keys[perm])) <= BOUND


def test_a_plain_shuffle_would_not_hold_it():
    """Why stratified: a plain permutation of 286 packs misses the bound in about four windows of ten."""
    keys = np.random.default_rng(0).lognormal(6, 1, 286)
    misses = sum(abs(spearman(keys[np.random.default_rng(s).permutation(286)])) > BOUND for s in range(200))
    assert 40 < misses < 120
    assert all(abs(spearman(keys[stratified_permutation(keys, np.random.default_rng(s))])) <= 0.011
               for s in range(200))


def _lengths(n: int, seed: int, capacity: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(6.5, 1.0, n).astype(np.int64), 1, 3 * capacity)


@pytest.mark.parametrize("algorithm", ["concat", "ffd", "bfd", "mffd", "ffs", "pool"])  # split: every pack is cut
@pytest.mark.parametrize("window", [700, 5000])
def test_shuffled_packs_of_every_algorithm_and_window(algorithm, window):
    capacity = 4096
    lengths = _lengths(5000, 1, capacity)
    gids = order_sequences(lengths, "shuffle", seed=3)
    options = WindowOptions(capacity=capacity, align=1, algorithm=algorithm, too_long="split", window=window)
    planner = plan_windows(gids, lengths[gids], options)
    plan = reorder_packs(planner, "shuffle", seed=3)
    assert np.array_equal(plan.window_bins, planner.window_bins)
    keys = pack_keys(plan, "longest")
    for lo, hi in zip(plan.window_bins[:-1], plan.window_bins[1:]):
        assert hi - lo >= TINY_WINDOW
        assert abs(spearman(keys[lo:hi])) <= BOUND
        # the same packs, only moved: as sets of pieces
        pieces = lambda p: sorted(tuple(zip(p.piece_gid[p.bin_offsets[b]:p.bin_offsets[b + 1]].tolist(),  # noqa: E731
                                            p.piece_start[p.bin_offsets[b]:p.bin_offsets[b + 1]].tolist()))
                                  for b in range(lo, hi))
        assert pieces(plan) == pieces(planner)
    # pieces of a split sequence stay in order (chunks first, the last piece after them)
    pack_of = np.repeat(np.arange(plan.num_bins), np.diff(plan.bin_offsets))
    for gid in plan.split_gids().tolist():
        where = np.flatnonzero(plan.piece_gid == gid)
        assert np.all(np.diff(pack_of[where]) > 0) and np.all(np.diff(plan.piece_start[where]) > 0)
    # the permutation of a window is its own: planning windows 1.. apart gives their packs alike
    if plan.num_windows > 1:
        lo = int(planner.window_bins[1])
        start = int(np.searchsorted(gids, gids[window]) * 0 + window)
        tail = reorder_packs(plan_windows(gids[start:], lengths[gids[start:]], options, first_window=1), "shuffle",
                             seed=3, first_window=1)
        assert np.array_equal(tail.piece_gid, plan.piece_gid[plan.bin_offsets[lo]:])


def test_longest_order_is_ascending_but_for_split_sequences():
    capacity = 4096
    lengths = _lengths(3000, 2, capacity)
    gids = order_sequences(lengths, "curriculum")
    options = WindowOptions(capacity=capacity, align=1, algorithm="bfd", too_long="split", window=1000)
    plan = reorder_packs(plan_windows(gids, lengths[gids], options), "longest", seed=0)
    keys = pack_keys(plan, "longest")
    # every window's packs ascend by their longest sequence, except where a split sequence's packs keep their order
    splits = set(np.repeat(np.arange(plan.num_bins), np.diff(plan.bin_offsets))[
        np.isin(plan.piece_gid, plan.split_gids())].tolist())
    for lo, hi in zip(plan.window_bins[:-1], plan.window_bins[1:]):
        free = [b for b in range(lo, hi) if b not in splits]
        assert np.all(np.diff(keys[free]) >= 0)


@pytest.mark.parametrize("algorithm", ["ffs", "concat", "pool"])
def test_epochs_of_the_order_following_algorithms_differ_pack_by_pack(algorithm):
    """One window holds the whole corpus; these algorithms follow the epoch's shuffled order, so at
    most 5% of packs of two or more sequences repeat epoch 0 (measured: none)."""
    capacity = 4096
    lengths = _lengths(6000, 4, capacity)

    def epoch(e: int):
        seed = epoch_seed(0, e)
        gids = order_sequences(lengths, "shuffle", seed=seed)
        plan = plan_windows(gids, lengths[gids], WindowOptions(capacity=capacity, align=1, algorithm=algorithm,
                                                               too_long="split", window=100_000,
                                                               seed=seed))
        return {tuple(sorted(plan.piece_gid[a:b].tolist())) for a, b in zip(plan.bin_offsets[:-1],
                                                                             plan.bin_offsets[1:]) if b - a > 1}, plan

    first, _ = epoch(0)
    for e in (1, 2):
        packs, plan = epoch(e)
        assert len(packs & first) / plan.num_bins <= 0.05


def test_steps_are_ordered_whole_under_dp_size():
    capacity = 4096
    lengths = np.minimum(_lengths(4000, 5, capacity), capacity)  # no split: its steps keep their order
    gids = order_sequences(lengths, "shuffle", seed=1)
    plan = plan_windows(gids, lengths[gids], WindowOptions(capacity=capacity, align=1, algorithm="bfd",
                                                          too_long="split", window=100_000))
    results = {}
    for order in ("planner", "shuffle", "longest"):
        spec = BalanceSpec(dp_size=4, micro_batches=2, capacity=capacity, seed=1, step_order=order)
        results[order] = balance_plan(plan, spec)
    for order, result in results.items():
        steps = result.step
        assert np.all(np.diff(steps) >= 0)  # a step's packs are consecutive
        assert np.array_equal(np.sort(result.plan.piece_gid), np.sort(plan.piece_gid))
    keys = pack_keys(results["shuffle"].plan, "longest")
    step_keys = np.array([keys[results["shuffle"].step == s].max() for s in range(results["shuffle"].num_steps)])
    assert results["shuffle"].num_steps >= TINY_WINDOW and abs(spearman(step_keys)) <= BOUND
    assert abs(spearman(keys)) <= BOUND
    keys = pack_keys(results["longest"].plan, "longest")
    step_keys = np.array([keys[results["longest"].step == s].max() for s in range(results["longest"].num_steps)])
    assert spearman(step_keys) > 0.9


def _reference_pack_spearman(result) -> float:
    """Spearman(position, longest sequence) of the packs as written: what `packctl stats` checks."""
    plan = result.plan
    return spearman(np.maximum.reduceat(plan.piece_len, plan.bin_offsets[:-1]))


@pytest.mark.parametrize("dp_size, micro_batches, grouping", [(4, 2, "cost"), (2, 4, "cost"), (8, 1, "cost"),
                                                              (4, 2, "order")])
def test_shuffled_steps_hold_the_bound_over_their_packs_with_split_sequences(dp_size, micro_batches, grouping):
    """--order shuffle --dp-size: whole steps are shuffled, and the packs they hold, as written
    (after the balance moves sequences between them), meet the bound too, with sequences split
    over steps (8 of 2,000 here, as sample_data has 7 at --capacity 4096). Keyed by each step's
    longest sequence and dealt apart from the steps of its split sequences, 10 of 40 seeds of
    sample_data at (4, 2) are over 0.05 (up to 0.15)."""
    capacity = 4096
    lengths = np.minimum(_lengths(2000, 7, capacity), capacity)
    lengths[np.random.default_rng(7).choice(len(lengths), 8, replace=False)] = capacity * 3 // 2
    worst = 0.0
    for seed in range(12):
        gids = order_sequences(lengths, "shuffle", seed=seed)
        plan = plan_windows(gids, lengths[gids], WindowOptions(capacity=capacity, align=1, algorithm="bfd",
                                                              too_long="split", window=100_000))
        plan = reorder_packs(plan, "shuffle", seed)
        spec = BalanceSpec(dp_size=dp_size, micro_batches=micro_batches, capacity=capacity, seed=seed,
                           step_order="shuffle", grouping=grouping)
        result = balance_plan(plan, spec)
        assert result.num_steps >= TINY_WINDOW and len(plan.split_gids())
        worst = max(worst, abs(_reference_pack_spearman(result)))
    assert worst <= BOUND / 2


def test_the_steps_of_sample_data_hold_the_bound_under_dp_size():
    """`packctl pack sample_data --order shuffle --too-long split --dp-size 4 --micro-batches 2`
    (7 sequences split over steps): |Spearman| of the packs within 0.05 for every seed tried.
    Keyed by each step's longest sequence, the steps of a split sequence dealt apart, the worst
    of these seeds is 0.073, which `packctl stats` flags."""
    from support.paths import SAMPLE_DATA

    from packctl.config import PackConfig
    from packctl.pipeline.plan import plan_corpus
    from packctl.stats import read_lengths

    index = read_lengths([str(SAMPLE_DATA)])
    worst = 0.0
    for seed in range(10):
        config = PackConfig(inputs=["sample_data"], output="-", order="shuffle", seed=seed, too_long="split",
                            dp_size=4, micro_batches=2)
        plan = plan_corpus(index, config.specs()).plan
        worst = max(worst, abs(spearman(np.maximum.reduceat(plan.piece_len, plan.bin_offsets[:-1]))))
    assert worst <= BOUND / 2
