"""`packctl.plan_packs` and `plan_steps` over a batch's lengths: the capacity holds, every token is
planned once, the same input gives the same arrays, bad input is one PackctlError line."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from packctl import PackctlError, plan_packs, plan_steps
from packctl.plan.names import ALGORITHMS
from support.profiles import examples

batches = st.lists(st.integers(1, 200), min_size=1, max_size=120)


def first_fit_decreasing(lengths, capacity):
    """O(n^2) first fit decreasing, longest first, ties by index: the bins `ffd` must make."""
    bins, room = [], []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        b = next((b for b, r in enumerate(room) if r >= lengths[i]), None)
        if b is None:
            bins.append([])
            room.append(capacity)
            b = len(bins) - 1
        bins[b].append(i)
        room[b] -= lengths[i]
    return bins


def tokens_of(packs, n):
    """Tokens planned of each sequence (pieces added up)."""
    return np.bincount(packs.sequence, weights=packs.length, minlength=n).astype(np.int64)


@settings(max_examples=examples(200), deadline=None)
@given(batches, st.integers(200, 600), st.sampled_from(ALGORITHMS), st.sampled_from([1, 2, 8]),
       st.one_of(st.none(), st.integers(1, 6)))
def test_capacity_holds_and_every_token_is_planned_once(lengths, capacity, algorithm, align, max_seqs):
    capacity = capacity // align * align
    packs = plan_packs(lengths, capacity, algorithm=algorithm, align=align, max_seqs_per_bin=max_seqs)
    assert (packs.loads() <= capacity).all()
    assert (packs.padded == -(-packs.length // align) * align).all()
    assert tokens_of(packs, len(lengths)).tolist() == list(lengths)
    if max_seqs is not None:
        assert (np.diff(packs.offsets) <= max_seqs).all()
    # per sequence: the pack and place of its first piece
    first = packs.start == 0
    piece_pack = np.repeat(np.arange(packs.num_packs), np.diff(packs.offsets))
    assert (packs.pack[packs.sequence[first]] == piece_pack[first]).all()
    assert (packs.position[packs.sequence[first]] == np.flatnonzero(first) - packs.offsets[piece_pack[first]]).all()


@settings(max_examples=examples(100), deadline=None)
@given(batches, st.sampled_from(ALGORITHMS), st.integers(0, 3))
def test_same_input_same_arrays(lengths, algorithm, seed):
    a = plan_packs(np.array(lengths, dtype=np.int32), 256, algorithm=algorithm, seed=seed)
    b = plan_packs(list(lengths), 256, algorithm=algorithm, seed=seed)
    for name in ("offsets", "sequence", "start", "length", "padded", "pack", "position"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name


@settings(max_examples=examples(100), deadline=None)
@given(batches)
def test_ffd_is_first_fit_decreasing(lengths):
    assert plan_packs(lengths, 256, algorithm="ffd").bins() == first_fit_decreasing(lengths, 256)


@settings(max_examples=examples(100), deadline=None)
@given(batches, st.integers(1, 12), st.one_of(st.none(), st.integers(1, 4)))
def test_min_packs_and_multiple(lengths, min_packs, multiple):
    planned = plan_packs(lengths, 400).num_packs
    want = max(planned, min_packs)
    want = want if multiple is None else -(-want // multiple) * multiple
    if want > len(lengths):
        with pytest.raises(PackctlError, match="lower min_packs or packs_multiple"):
            plan_packs(lengths, 400, min_packs=min_packs, packs_multiple=multiple)
        return
    packs = plan_packs(lengths, 400, min_packs=min_packs, packs_multiple=multiple)
    assert packs.num_packs == want
    assert (np.diff(packs.offsets) >= 1).all() and (packs.loads() <= 400).all()
    assert sorted(packs.sequence.tolist()) == list(range(len(lengths)))


def test_min_packs_moves_the_last_sequence_of_the_fullest_pack():
    # ffd: [6 4] [5 3 2]; a third pack takes the 2 from the pack of three
    assert plan_packs([6, 5, 4, 3, 2], 10, algorithm="ffd", min_packs=3).bins() == [[0, 2], [1, 3], [4]]


@settings(max_examples=examples(100), deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 60)), min_size=1, max_size=60),
       st.sampled_from([a for a in ALGORITHMS if a != "split"]))
def test_groups_share_one_pack_in_their_order(members, algorithm):
    groups = [g for g, _ in members]
    lengths = [n for _, n in members]
    packs = plan_packs(lengths, 400, algorithm=algorithm, groups=groups)
    assert sorted(packs.sequence.tolist()) == list(range(len(lengths)))
    for g in set(groups):
        mine = [i for i, x in enumerate(groups) if x == g]
        assert len(set(packs.pack[mine].tolist())) == 1
        assert np.diff(packs.position[mine]).tolist() == [1] * (len(mine) - 1)


@settings(max_examples=examples(100), deadline=None)
@given(batches, st.integers(1, 8), st.one_of(st.none(), st.integers(1, 4)), st.sampled_from(["tokens", "attention"]))
def test_steps_deal_every_pack_within_capacity(lengths, dp_size, micro_batches, balance):
    steps = plan_steps(lengths, dp_size, micro_batches, capacity=300, balance=balance)
    packs = steps.packs
    assert (packs.loads() <= 300).all()
    assert tokens_of(packs, len(lengths)).tolist() == list(lengths)
    assert len(steps.rank) == len(steps.micro_batch) == len(steps.step) == packs.num_packs
    assert ((0 <= steps.rank) & (steps.rank < dp_size)).all()
    if micro_batches is not None:
        assert (steps.micro_batch < micro_batches).all()
    else:
        assert steps.num_steps == 1
    again = plan_steps(np.array(lengths), dp_size, micro_batches, capacity=300, balance=balance)
    assert np.array_equal(again.rank, steps.rank) and np.array_equal(again.packs.sequence, packs.sequence)


@settings(max_examples=examples(100), deadline=None)
@given(batches, st.integers(2, 8), st.integers(1, 3))
def test_steps_of_planned_packs_keep_their_sequence_bound(lengths, dp_size, max_seqs):
    planned = plan_packs(lengths, 300, max_seqs_per_bin=max_seqs)
    steps = plan_steps(packs=planned, dp_size=dp_size, balance="tokens", balance_scope="sequences")
    assert (np.diff(steps.packs.offsets) <= max_seqs).all()
    assert np.array_equal(plan_steps(planned, dp_size, balance="tokens", balance_scope="sequences").rank, steps.rank)
    assert (steps.packs.loads() <= 300).all()


def test_steps_even_out_the_ranks():
    lengths = np.random.default_rng(0).lognormal(6, 1, 2000).clip(1, 4096).astype(np.int64)
    steps = plan_steps(lengths, 8, capacity=8192, balance="tokens")
    figures = steps.metrics()
    assert figures["tokens"]["max"] < 1.01 < figures["before"]["tokens"]["max"]


def test_metrics_are_packs_figures():
    figures = plan_packs([3, 2, 5], 8, algorithm="concat", align=2).metrics()
    # docs: C = 8, a = 2, packs [3 2] [5]: utilization 10/16
    assert figures["utilization"] == pytest.approx(0.625)
    assert figures["packs"] == 2


def test_too_long_policies():
    with pytest.raises(PackctlError, match=r"lengths\[1\] = 12 .* exceeds capacity 10: raise capacity"):
        plan_packs([3, 12, 4], 10)
    dropped = plan_packs([3, 12, 4], 10, too_long="drop")
    assert dropped.dropped.tolist() == [1] and dropped.pack.tolist()[1] == -1
    split = plan_packs([3, 12, 4], 10, too_long="split", algorithm="concat")
    assert tokens_of(split, 3).tolist() == [3, 12, 4]


@pytest.mark.parametrize(("call", "message"), [
    (lambda: plan_packs([3, 0, 2], 8), r"lengths\[1\] = 0: every length must be >= 1"),
    (lambda: plan_packs([[3, 2]], 8), "lengths must be 1-D"),
    (lambda: plan_packs([2.5], 8), "lengths must be integers"),
    (lambda: plan_packs([3], 0), "capacity must be an integer >= 1"),
    (lambda: plan_packs([3], 10, align=4), "capacity 10 is not a multiple of align 4: use capacity 12"),
    (lambda: plan_packs([3], 8, algorithm="best"), "algorithm 'best' is not one of concat"),
    (lambda: plan_packs([3], 8, groups=[1, 2]), r"groups must be one integer id per sequence, shape \(1,\)"),
    (lambda: plan_packs([5, 5], 8, groups=[1, 1]), "groups: the group of sequence 0 .* raise capacity"),
    (lambda: plan_steps([3], 2), "lengths need capacity="),
    (lambda: plan_steps(packs=plan_packs([3], 8), dp_size=2, capacity=8), "leave out capacity"),
    (lambda: plan_steps(plan_packs([3], 8), 2, algorithm="ffd"), "leave out algorithm"),
    (lambda: plan_steps(dp_size=2), "give the batch's lengths .* or packs= from plan_packs, one of the two"),
    (lambda: plan_steps([3], 2, packs=plan_packs([3], 8)), "one of the two"),
    (lambda: plan_steps([3], 0, capacity=8), "dp_size must be an integer >= 1"),
    (lambda: plan_steps([3], 2, capacity=8, balance="flops"), "balance 'flops' is not one of tokens, attention"),
])
def test_bad_input_is_one_line(call, message):
    with pytest.raises(PackctlError, match=message) as error:
        call()
    assert "\n" not in str(error.value)


def test_empty_batch():
    packs = plan_packs([], 8)
    assert packs.num_packs == 0 and packs.bins() == []


@pytest.mark.torch
def test_torch_lengths_are_read_where_they_live():
    import torch

    lengths = torch.tensor([6, 5, 4, 3, 2])
    assert plan_packs(lengths, 10, algorithm="ffd").bins() == [[0, 2], [1, 3, 4]]
