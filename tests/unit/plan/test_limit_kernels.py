"""Packing under budgets besides tokens (`extra` costs, `limits`): every algorithm, against small
plain-Python references, and with no limit (k = 0) or limits that never bind the very bins of one
budget."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.profiles import examples

from packctl.plan.algorithms import (
    ALGORITHMS,
    KERNELS,
    OverLimit,
    UncuttableTooLong,
    over_limits,
    pack_lengths,
)
from packctl.plan.bins import KernelOptions

SETTINGS = settings(max_examples=examples(300, default=60), deadline=None, derandomize=True)
WHOLE = tuple(a for a in ALGORITHMS if a != "split")


@st.composite
def budgets(draw, *, max_len=None, allow_longer=False):
    """(lengths, capacity, extra n x k, limits k, max_seqs): 1-3 cost columns, many zeros (text
    rows), costs exactly at a limit, limits that bind and limits that never do."""
    capacity = draw(st.integers(1, 40))
    n = draw(st.integers(0, 60))
    top = capacity * 3 if allow_longer else capacity
    lengths = draw(st.lists(st.integers(1, top), min_size=n, max_size=n))
    k = draw(st.integers(1, 3))
    limits = [draw(st.sampled_from([0, 1, 2, 3, 8, 1000])) for _ in range(k)]
    extra = [[draw(st.sampled_from([0, 0, 0, limit, *range(limit + 1)[:4]])) for limit in limits]
             for _ in range(n)]
    max_seqs = draw(st.sampled_from([None, 1, 2, 5]))
    return (np.asarray(lengths, np.int64), capacity, np.asarray(extra, np.int64).reshape(n, k),
            np.asarray(limits, np.int64), max_seqs)


def bins_of(bins):
    return [bins.members[a:b].tolist() for a, b in zip(bins.offsets[:-1], bins.offsets[1:])]


def assert_within_every_budget(bins, lengths, capacity, extra, limits, max_seqs, *, cut_allowed=False):
    n = len(lengths)
    covered = np.zeros(n, np.int64)
    np.add.at(covered, bins.members, bins.lens)
    assert covered.tolist() == lengths.tolist()  # every item once (split: its pieces cover it)
    if not cut_allowed:
        assert sorted(bins.members.tolist()) == list(range(n))
    else:  # an item with a cost is never cut
        pieces = np.bincount(bins.members, minlength=n)
        assert (pieces[(extra > 0).any(axis=1)] == 1).all()
    assert (bins.loads() <= capacity).all()
    assert (bins.extra_loads(extra) <= limits).all()
    if max_seqs is not None:
        assert (np.diff(bins.offsets) <= max_seqs).all()
    assert (np.diff(bins.offsets) >= 1).all()


# --- plain-Python references ----------------------------------------------------------------------

def fits(members, i, lengths, extra, capacity, limits, max_seqs):
    return (sum(lengths[j] for j in members) + lengths[i] <= capacity and len(members) < max_seqs
            and all(sum(extra[j][d] for j in members) + extra[i][d] <= limits[d] for d in range(len(limits))))


def reference_concat(lengths, extra, capacity, limits, max_seqs):
    bins = []
    for i in range(len(lengths)):
        if bins and fits(bins[-1], i, lengths, extra, capacity, limits, max_seqs):
            bins[-1].append(i)
        else:
            bins.append([i])
    return bins


def reference_first_fit(order, lengths, extra, capacity, limits, max_seqs):
    bins = []
    for i in order:
        for members in bins:
            if fits(members, i, lengths, extra, capacity, limits, max_seqs):
                members.append(i)
                break
        else:
            bins.append([i])
    return bins


def reference_best_fit(order, lengths, extra, capacity, limits, max_seqs):
    """Among the bins that fit every budget, the least token room; ties: the oldest last change."""
    bins, changed = [], []
    for step, i in enumerate(order):
        fitting = [b for b, members in enumerate(bins) if fits(members, i, lengths, extra, capacity, limits, max_seqs)]
        if fitting:
            b = min(fitting, key=lambda b: (capacity - sum(lengths[j] for j in bins[b]), changed[b]))
            bins[b].append(i)
            changed[b] = step
        else:
            bins.append([i])
            changed.append(step)
    return bins


def reference_pool(lengths, extra, capacity, limits, max_seqs, pool_size, closest):
    waiting, upcoming, bins = [], list(range(len(lengths))), []
    while waiting or upcoming:
        while len(waiting) < pool_size and upcoming:
            waiting.append(upcoming.pop(0))
        members = [waiting.pop(0)]
        while True:
            while len(waiting) < pool_size and upcoming:
                waiting.append(upcoming.pop(0))
            candidates = [i for i in waiting if fits(members, i, lengths, extra, capacity, limits, max_seqs)]
            if not candidates:
                break
            pick = max(candidates, key=lambda i: (lengths[i], -waiting.index(i))) if closest else candidates[0]
            members.append(pick)
            waiting.remove(pick)
        bins.append(members)
    return bins


def decreasing(lengths):
    return sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))


def as_lists(lengths, extra, limits, max_seqs):
    return lengths.tolist(), extra.tolist(), limits.tolist(), max_seqs if max_seqs is not None else len(lengths) + 1


# --- every algorithm: the budgets hold, and the same input gives the same bins ---------------------

@pytest.mark.parametrize("algorithm", WHOLE)
@SETTINGS
@given(data=budgets())
def test_every_budget_holds_and_is_deterministic(algorithm, data):
    lengths, capacity, extra, limits, max_seqs = data
    if len(lengths) == 0:
        assert pack_lengths(lengths, capacity, algorithm, extra=extra, limits=limits).num_bins == 0
        return
    bins = pack_lengths(lengths, capacity, algorithm, max_seqs_per_bin=max_seqs, seed=3, extra=extra, limits=limits,
                        pool_size=4)
    assert_within_every_budget(bins, lengths, capacity, extra, limits, max_seqs)
    again = pack_lengths(lengths, capacity, algorithm, max_seqs_per_bin=max_seqs, seed=3, extra=extra, limits=limits,
                         pool_size=4)
    assert bins_of(again) == bins_of(bins)


@SETTINGS
@given(data=budgets(allow_longer=True), align=st.sampled_from([1, 2, 4]))
def test_split_never_cuts_an_item_with_a_cost(data, align):
    lengths, capacity, extra, limits, max_seqs = data
    capacity = capacity * align
    cuttable = ~((lengths > capacity) & (extra > 0).any(axis=1))
    lengths, extra = lengths[cuttable], extra[cuttable]
    if len(lengths) == 0:
        return
    bins = pack_lengths(lengths, capacity, "split", max_seqs_per_bin=max_seqs, align=align, extra=extra,
                        limits=limits)
    assert_within_every_budget(bins, lengths, capacity, extra, limits, max_seqs, cut_allowed=True)
    # the pieces of a cut item follow each other, in order
    for item in np.unique(bins.members):
        at = np.flatnonzero(bins.members == item)
        assert (bins.starts[at] == np.concatenate([[0], np.cumsum(bins.lens[at])[:-1]])).all()


# --- the references --------------------------------------------------------------------------------

@SETTINGS
@given(data=budgets())
def test_concat_ffd_ffs_bfd_pool_match_the_references(data):
    lengths, capacity, extra, limits, max_seqs = data
    if len(lengths) == 0:
        return
    L, X, lim, m = as_lists(lengths, extra, limits, max_seqs)
    run = (lambda a, **kw: bins_of(pack_lengths(lengths, capacity, a, max_seqs_per_bin=max_seqs, extra=extra,
                                                limits=limits, **kw)))
    assert run("concat") == reference_concat(L, X, capacity, lim, m)
    assert run("ffd") == reference_first_fit(decreasing(L), L, X, capacity, lim, m)
    shuffled = np.random.default_rng(7).permutation(len(L)).tolist()
    assert run("ffs", seed=7) == reference_first_fit(shuffled, L, X, capacity, lim, m)
    assert run("bfd") == reference_best_fit(decreasing(L), L, X, capacity, lim, m)
    for size, strategy in ((1, "closest"), (3, "closest"), (5, "first")):
        assert run("pool", pool_size=size, pool_strategy=strategy) == reference_pool(
            L, X, capacity, lim, m, size, strategy == "closest")


# --- no budget besides tokens, or budgets that never bind: the bins of one budget -----------------

@pytest.mark.parametrize("algorithm", ALGORITHMS)
@SETTINGS
@given(data=budgets(allow_longer=True))
def test_no_limit_and_limits_that_never_bind_give_the_bins_of_tokens_only(algorithm, data):
    lengths, capacity, extra, _, max_seqs = data
    if algorithm != "split":
        lengths = np.minimum(lengths, capacity)
    else:
        extra = np.zeros_like(extra)  # split places an item with a cost whole: only no cost cuts the same
    if len(lengths) == 0:
        return
    kwargs = {"max_seqs_per_bin": max_seqs, "seed": 5, "pool_size": 3}
    tokens_only = pack_lengths(lengths, capacity, algorithm, **kwargs)
    k0 = pack_lengths(lengths, capacity, algorithm, extra=np.zeros((len(lengths), 0), np.int64), limits=[],
                      **kwargs)
    loose = pack_lengths(lengths, capacity, algorithm, extra=extra, limits=extra.sum(axis=0), **kwargs)
    for bins in (k0, loose):
        for field in ("offsets", "members", "starts", "lens"):
            assert np.array_equal(getattr(bins, field), getattr(tokens_only, field)), field


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@SETTINGS
@given(data=budgets(allow_longer=True))
def test_each_limits_kernel_called_with_no_budget_gives_the_bins_of_its_token_kernel(algorithm, data):
    """`pack_lengths` runs a limits kernel only for k >= 1; called directly with an n x 0 `extra`
    (as bench_limits_kernels.py does, and as a merged kernel would be) each one still plans the
    bins of tokens alone, within its arrays (bfd's tree once read room values past the capacity)."""
    lengths, capacity, _, _, max_seqs = data
    kernel = KERNELS[algorithm]
    if len(lengths) == 0:
        return  # a kernel gets non-empty lengths
    if not kernel.cuts_items:
        lengths = np.minimum(lengths, capacity)
    max_seqs = len(lengths) + 1 if max_seqs is None else max_seqs
    options = KernelOptions(seed=5, align=1, pool_size=3, pool_strategy="closest")
    tokens_only = kernel.run(lengths, capacity, max_seqs, options)
    k0 = kernel.run_limits(lengths, np.zeros((len(lengths), 0), np.int64), np.zeros(0, np.int64), capacity,
                           max_seqs, options)
    for field in ("offsets", "members", "starts", "lens"):
        assert np.array_equal(getattr(k0, field), getattr(tokens_only, field)), field


def test_many_random_inputs_agree_with_one_budget_when_limits_never_bind():
    """Bigger inputs than the hypothesis ones, for the tree kernels (deeper trees, long lists)."""
    rng = np.random.default_rng(0)
    for trial in range(6):
        n, capacity = int(rng.integers(2000, 6000)), int(rng.choice([64, 512, 4096]))
        lengths = np.minimum(rng.lognormal(np.log(capacity / 8), 1.0, n).astype(np.int64) + 1, capacity)
        extra = rng.integers(0, 4, (n, int(rng.integers(1, 4))))
        for algorithm in ALGORITHMS:
            if algorithm == "split":
                continue
            base = pack_lengths(lengths, capacity, algorithm, seed=trial)
            loose = pack_lengths(lengths, capacity, algorithm, seed=trial, extra=extra, limits=extra.sum(axis=0))
            assert np.array_equal(base.members, loose.members) and np.array_equal(base.offsets, loose.offsets)
            tight = pack_lengths(lengths, capacity, algorithm, seed=trial, extra=extra,
                                 limits=np.full(extra.shape[1], 6))
            assert_within_every_budget(tight, lengths, capacity, extra, np.full(extra.shape[1], 6), None)
            assert tight.num_bins >= base.num_bins


# --- worked examples -------------------------------------------------------------------------------

def test_a_limit_that_binds_opens_bins_tokens_would_not():
    # capacity 100, at most 2 images a bin: 6 items of 10 tokens with one image each need 3 bins
    lengths = np.full(6, 10)
    extra = np.ones((6, 1), np.int64)
    for algorithm in ALGORITHMS:
        bins = pack_lengths(lengths, 100, algorithm, extra=extra, limits=[2])
        assert bins.num_bins == 3 and bins.extra_loads(extra)[:, 0].tolist() == [2, 2, 2], algorithm


def test_text_rows_fill_the_room_image_rows_cannot():
    # bfd: the two image rows open two bins (limit 1), the text rows fill both
    lengths = np.array([6, 6, 4, 4])
    extra = np.array([[1], [1], [0], [0]])
    bins = pack_lengths(lengths, 10, "bfd", extra=extra, limits=[1])
    assert bins_of(bins) == [[0, 2], [1, 3]]


def test_split_places_an_item_with_a_cost_whole():
    bins = pack_lengths([6, 5, 7], 10, "split", extra=[[0], [1], [0]], limits=[1])
    assert bins_of(bins) == [[0], [1, 2], [2]]
    assert bins.lens.tolist() == [6, 5, 5, 2]


def test_split_refuses_an_item_with_a_cost_over_capacity():
    with pytest.raises(UncuttableTooLong) as err:
        pack_lengths([4, 25, 30], 10, "split", extra=[[0], [0], [2]], limits=[3])
    assert err.value.item == 2 and err.value.column == 0 and err.value.count == 1
    assert "never cut" in str(err.value)
    # the same item without a cost is cut as before
    assert pack_lengths([4, 25, 30], 10, "split", extra=[[0], [0], [0]], limits=[3]).num_bins == 6


def test_an_item_over_a_limit_is_reported_with_its_index_and_column():
    extra = np.array([[0, 1], [0, 5], [9, 0]])
    with pytest.raises(OverLimit) as err:
        pack_lengths([1, 2, 3], 10, "ffd", extra=extra, limits=[8, 4])
    assert (err.value.item, err.value.column, err.value.cost, err.value.limit, err.value.count) == (1, 1, 5, 4, 2)
    assert over_limits(extra, [8, 4]).tolist() == [False, True, True]
    assert over_limits(np.zeros((3, 0)), []).tolist() == [False, False, False]
    # exactly at a limit fits
    assert bins_of(pack_lengths([1, 2, 3], 10, "ffd", extra=extra, limits=[9, 5])) == [[2, 1], [0]]


def test_a_limit_of_zero_takes_only_items_of_no_cost():
    bins = pack_lengths([3, 3, 3], 10, "ffd", extra=[[0], [0], [0]], limits=[0])
    assert bins.num_bins == 1
    with pytest.raises(OverLimit):
        pack_lengths([3, 3, 3], 10, "ffd", extra=[[0], [1], [0]], limits=[0])


@pytest.mark.parametrize("extra, limits, message", [
    ([[1], [1]], None, "go together"),
    (None, [1], "go together"),
    ([1, 1], [1], "shape"),
    ([[1], [1], [1]], [1], "shape"),
    ([[1, 1], [1, 1]], [1], "shape"),
    ([[1.5], [1]], [2], "integers"),
    ([[-1], [1]], [2], ">= 0"),
    ([[1], [1]], [-2], ">= 0"),
    ([[1], [1]], [[2]], "1-D"),
])
def test_bad_budgets_are_refused(extra, limits, message):
    with pytest.raises(ValueError, match=message):
        pack_lengths([1, 2], 10, "ffd", extra=extra, limits=limits)


@pytest.mark.parametrize("seed", range(4))
def test_deep_trees_match_the_references_on_image_like_costs(seed):
    """Hundreds of bins, text rows (no cost) beside image rows (images and image tokens, both
    binding): the per-kind token rooms of first fit and the back-ups of both trees at depth."""
    rng = np.random.default_rng(seed)
    n, capacity = 500, 200
    images = np.where(rng.random(n) < 0.6, 1 + rng.poisson(0.5, n), 0).clip(0, 4)
    extra = np.stack([images, images * rng.integers(8, 24, n)], axis=1).astype(np.int64)
    lengths = np.minimum(rng.integers(5, 40, n) + extra[:, 1], capacity)
    limits = np.array([4, 60])
    keep = (extra <= limits).all(axis=1)
    lengths, extra = lengths[keep], extra[keep]
    L, X, lim, m = as_lists(lengths, extra, limits, None)
    for algorithm, reference in (("ffd", lambda: reference_first_fit(decreasing(L), L, X, capacity, lim, m)),
                                 ("bfd", lambda: reference_best_fit(decreasing(L), L, X, capacity, lim, m))):
        assert bins_of(pack_lengths(lengths, capacity, algorithm, extra=extra, limits=limits)) == reference()
    shuffled = np.random.default_rng(seed).permutation(len(L)).tolist()
    assert bins_of(pack_lengths(lengths, capacity, "ffs", seed=seed, extra=extra, limits=limits)) == \
        reference_first_fit(shuffled, L, X, capacity, lim, m)
