"""`plan_steps(balance_scope="ranks")`: each step's sequences split over the ranks by
Karmarkar-Karp, then packed rank by rank: the capacity holds, every sequence is planned once, the
ranks' sums are Karmarkar-Karp's, the same input gives the same arrays."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from packctl import plan_packs, plan_steps
from packctl.plan.balance import kk_partition
from support.profiles import examples

batches = st.lists(st.integers(1, 200), min_size=1, max_size=150)
CAPACITY = 300


def rank_sums(steps, weights=None) -> np.ndarray:
    """steps x ranks: the tokens (or a weight per sequence) each rank runs in each step."""
    packs = steps.packs
    pack_of_piece = np.repeat(np.arange(packs.num_packs), np.diff(packs.offsets))
    cell = steps.step[pack_of_piece] * steps.dp_size + steps.rank[pack_of_piece]
    values = packs.length if weights is None else weights[packs.sequence]
    return np.bincount(cell, weights=values, minlength=steps.num_steps * steps.dp_size).reshape(-1, steps.dp_size)


@settings(max_examples=examples(150), deadline=None)
@given(batches, st.integers(1, 9), st.one_of(st.none(), st.integers(1, 4)), st.sampled_from(["tokens", "attention"]),
       st.sampled_from(["bfd", "ffd", "concat", "ffs", "split"]), st.one_of(st.none(), st.integers(1, 4)),
       st.sampled_from([1, 4]))
def test_capacity_conservation_and_counts(lengths, dp_size, micro_batches, balance, algorithm, max_seqs, align):
    steps = plan_steps(lengths, dp_size, micro_batches, capacity=CAPACITY, balance=balance, algorithm=algorithm,
                       max_seqs_per_bin=max_seqs, align=align, balance_scope="ranks")
    packs = steps.packs
    assert (packs.loads() <= CAPACITY).all()
    if max_seqs is not None:
        assert (np.diff(packs.offsets) <= max_seqs).all()
    assert (np.diff(packs.offsets) >= 1).all()
    # every token once; whole sequences (all but split) each in exactly one pack
    assert np.bincount(packs.sequence, weights=packs.length, minlength=len(lengths)).tolist() == list(lengths)
    if algorithm != "split":
        assert sorted(packs.sequence.tolist()) == list(range(len(lengths)))
    assert len(steps.rank) == len(steps.micro_batch) == len(steps.step) == packs.num_packs
    assert ((0 <= steps.rank) & (steps.rank < dp_size)).all()
    # packs step by step, micro-batch by micro-batch, rank by rank; micro-batches 0.. on each rank
    key = (steps.step * (packs.num_packs + 1) + steps.micro_batch) * dp_size + steps.rank
    assert (np.diff(key) > 0).all()
    counts = np.zeros((steps.num_steps, dp_size), np.int64)
    np.add.at(counts, (steps.step, steps.rank), 1)
    for s, r in zip(*np.nonzero(counts)):
        mine = steps.micro_batch[(steps.step == s) & (steps.rank == r)]
        assert sorted(mine.tolist()) == list(range(len(mine)))
    equal = (counts == counts.max(axis=1, keepdims=True)).all(axis=1)
    assert steps.unequal_steps == int((~equal).sum())
    if micro_batches is None:
        assert steps.num_steps == 1


@settings(max_examples=examples(100), deadline=None)
@given(batches, st.integers(1, 9), st.sampled_from(["tokens", "attention"]), st.sampled_from(["bfd", "ffd"]))
def test_ranks_sum_what_karmarkar_karp_gives(lengths, dp_size, balance, algorithm):
    # one step: each rank runs the sequences Karmarkar-Karp gave it (packing and the splits for
    # equal counts stay inside a rank), so the ranks' costs are KK's over the sequences
    steps = plan_steps(lengths, dp_size, capacity=CAPACITY, balance=balance, algorithm=algorithm,
                       balance_scope="ranks")
    lengths = np.asarray(lengths, dtype=np.float64)
    costs = lengths if balance == "tokens" else lengths * lengths
    expected = np.bincount(kk_partition(costs, dp_size), weights=costs, minlength=dp_size)
    assert sorted(rank_sums(steps, costs)[0].tolist()) == sorted(expected.tolist())


@settings(max_examples=examples(100), deadline=None)
@given(batches, st.integers(1, 9), st.one_of(st.none(), st.integers(1, 3)), st.integers(0, 3))
def test_same_input_same_arrays(lengths, dp_size, micro_batches, seed):
    a = plan_steps(lengths, dp_size, micro_batches, capacity=CAPACITY, seed=seed, algorithm="ffs",
                   balance_scope="ranks")
    b = plan_steps(np.array(lengths, dtype=np.int32), dp_size, micro_batches, capacity=CAPACITY, seed=seed,
                   algorithm="ffs", balance_scope="ranks")
    for name in ("step", "rank", "micro_batch"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    for name in ("offsets", "sequence", "start", "length", "pack", "position"):
        assert np.array_equal(getattr(a.packs, name), getattr(b.packs, name)), name


@settings(max_examples=examples(100), deadline=None)
@given(st.lists(st.tuples(st.integers(0, 8), st.integers(1, 40)), min_size=1, max_size=80), st.integers(1, 6))
def test_groups_stay_in_one_pack_in_their_order(members, dp_size):
    groups = np.array([g for g, _ in members])
    lengths = [n for _, n in members]
    steps = plan_steps(lengths, dp_size, capacity=CAPACITY, groups=groups, balance_scope="ranks")
    packs = steps.packs
    assert (packs.loads() <= CAPACITY).all()
    assert sorted(packs.sequence.tolist()) == list(range(len(lengths)))
    for g in np.unique(groups):
        mine = np.flatnonzero(groups == g)
        assert len(set(packs.pack[mine].tolist())) == 1
        assert np.diff(packs.position[mine]).tolist() == [1] * (len(mine) - 1)


def test_docstring_example():
    steps = plan_steps([9, 8, 7, 6, 5, 4, 3, 2], 2, capacity=16, balance="tokens", balance_scope="ranks")
    assert steps.packs.bins() == [[0, 3], [1, 2], [4, 7], [5, 6]]
    assert steps.rank.tolist() == [0, 1, 0, 1] and steps.micro_batch.tolist() == [0, 0, 1, 1]
    assert rank_sums(steps)[0].tolist() == [22, 22]


def test_planned_packs_and_drops():
    planned = plan_packs([5, 40, 6, 7, 3], 10, too_long="drop")
    steps = plan_steps(planned, 2, balance="tokens", balance_scope="ranks")
    assert steps.packs.dropped.tolist() == [1] and steps.packs.pack[1] == -1
    assert sorted(steps.packs.sequence.tolist()) == [0, 2, 3, 4]
    assert (steps.packs.loads() <= 10).all()


def test_more_ranks_than_sequences_leave_the_counts_unequal():
    steps = plan_steps([5, 4], 4, capacity=8, balance_scope="ranks")
    # one pack each on two ranks, none on the other two: nothing left to split
    assert steps.unequal_steps == 1 and steps.packs.num_packs == 2 and len(set(steps.rank.tolist())) == 2


def test_ranks_balance_what_whole_packs_do_not():
    # 3,000 sequences: auto deals whole packs; splitting the sequences first evens the tokens
    lengths = np.random.default_rng(0).lognormal(6.5, 1.2, 3000).clip(1, 8192).astype(np.int64)
    by_packs = plan_steps(lengths, 8, capacity=8192, balance="tokens", balance_scope="packs")
    by_ranks = plan_steps(lengths, 8, capacity=8192, balance="tokens", balance_scope="ranks")
    assert by_ranks.metrics()["tokens"]["max"] < 1.0001 < by_packs.metrics()["tokens"]["max"]
    assert (by_ranks.packs.loads() <= 8192).all()
    assert by_ranks.packs.num_packs <= plan_packs(lengths, 8192).num_packs + 8


@pytest.mark.parametrize("micro_batches", [None, 250])
def test_auto_splits_sequences_over_ranks_beyond_a_step_of_2048(micro_batches):
    # 3,000 sequences in about 900 packs: one step, or steps of 4 x 250 packs (2,400 sequences and up)
    lengths = np.random.default_rng(1).integers(1, 600, 3000)
    auto = plan_steps(lengths, 4, micro_batches, capacity=1024)
    scope = "ranks" if micro_batches is None else "packs"
    chosen = plan_steps(lengths, 4, micro_batches, capacity=1024, balance_scope=scope)
    assert np.array_equal(auto.packs.sequence, chosen.packs.sequence)
    assert np.array_equal(auto.rank, chosen.rank)
