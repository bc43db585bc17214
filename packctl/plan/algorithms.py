"""Bin packing: padded sequence lengths -> bins (packs) of at most `capacity` tokens.

Every algorithm takes the lengths of one planning window, already padded by the caller to the
alignment multiple, and returns the bins in CSR form (`Bins`). With capacity 10:

    lengths [6, 5, 4, 3, 2]
    concat  -> [6] [5 4] [3 2]       in order; a new bin when the next one does not fit
    ffd     -> [6 4] [5 3 2]         largest first, each into the first bin with room
    split   -> [6 4'] [1' 4 3 2]     in order; the 5 is cut into 4 + 1 across the two bins

`pack_lengths` checks what every algorithm needs and runs the one `KERNELS` names. The kernels live
one file per family:

    bins.py        Bins, the checks, a placement log -> Bins
    sequential.py  concat, split (input order kept)
    fit.py         ffd, ffs, bfd (first fit and best fit, the decreasing order)
    mffd.py        mffd
    pool.py        pool
    batch.py       batch_lengths, choose_buckets (--mode batch)

With budgets besides tokens (`extra` n x k costs, `limits` k: images, image tokens), every family
has a second runner `pack_<name>_limits` beside the first, in the same file; `pack_lengths` runs it
only when k >= 1. Where the limits kernel with k = 0 plans as fast as a kernel of tokens alone
(within 10%, benchmarks/bench_limits_kernels.py: pool), the first runner calls it with no budget
and there is one kernel. Elsewhere a kernel of tokens alone stays: the limits kernels of ffd, ffs
and mffd search bins by every budget and are 5-8x slower without one, bfd's 4.4x, and
concat's and split's take a few milliseconds a million items either way, their ratio varying
from 1.0 to 1.4 from run to run.

To add an algorithm: write `pack_<name>(lengths, capacity, max_seqs, options) -> Bins` and
`pack_<name>_limits(lengths, extra, limits, capacity, max_seqs, options) -> Bins` in a file of its
family (or a new one), add its row to `KERNELS` and its name to `names.ALGORITHMS`, which
the options read without loading numba (a test keeps the two equal). A kernel calls numba
functions of its own file only: numba caches a kernel by its source file, and would not notice a
change in a callee in another file.

See docs/algorithms.md for drawings, complexities and when to use each one. The loops run in numba
(one pass over the items, O(log) per placement); numpy does the sorting and the bookkeeping.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from packctl.plan.batch import batch_lengths, choose_buckets
from packctl.plan.bins import (
    Bins,
    KernelOptions,
    OverLimit,
    empty_bins,
    over_limits,
    positive_int,
    validated_extra,
    validated_lengths,
)
from packctl.plan.fit import (
    pack_bfd,
    pack_bfd_limits,
    pack_ffd,
    pack_ffd_limits,
    pack_ffs,
    pack_ffs_limits,
)
from packctl.plan.mffd import pack_mffd, pack_mffd_limits
from packctl.plan.names import ALGORITHMS
from packctl.plan.pool import POOL_STRATEGIES, pack_pool, pack_pool_limits
from packctl.plan.sequential import (
    pack_concat,
    pack_concat_limits,
    pack_split,
    pack_split_limits,
)

__all__ = ["ALGORITHMS", "KERNELS", "POOL_STRATEGIES", "Bins", "Kernel", "KernelOptions", "OverLimit",
           "UncuttableTooLong", "batch_lengths", "choose_buckets", "cuts_items", "over_limits", "pack_lengths"]


@dataclass(frozen=True)
class Kernel:
    """One algorithm: its runner, and whether it cuts items.

    `run(lengths, capacity, max_seqs, options)` gets checked, non-empty int64 lengths and a
    sequence limit that is always an int (n + 1 for none). A kernel that cuts items (`split`)
    accepts lengths over capacity, and its capacity must be a multiple of `align`, the cut
    granularity, for bins to fill exactly.

    `run_limits(lengths, extra, limits, capacity, max_seqs, options)` is the same algorithm under
    k >= 1 budgets more (`extra`: n x k int64 costs, each <= its limit; `limits`: k int64). With no
    budget besides tokens `pack_lengths` runs `run`, the very code of one budget.
    """

    run: Callable[[np.ndarray, int, int, KernelOptions], Bins]
    run_limits: Callable[[np.ndarray, np.ndarray, np.ndarray, int, int, KernelOptions], Bins]
    cuts_items: bool = False

    def pack(self, lengths: np.ndarray, extra: np.ndarray | None, limits: np.ndarray | None, capacity: int,
             max_seqs: int, options: KernelOptions) -> Bins:
        """No bins for no items; else `run` for tokens alone (`extra` None), `run_limits` under k budgets."""
        if len(lengths) == 0:
            return empty_bins()
        if extra is None:
            return self.run(lengths, capacity, max_seqs, options)
        return self.run_limits(lengths, extra, limits, capacity, max_seqs, options)


KERNELS: dict[str, Kernel] = {
    "concat": Kernel(pack_concat, pack_concat_limits),
    "ffd": Kernel(pack_ffd, pack_ffd_limits),
    "bfd": Kernel(pack_bfd, pack_bfd_limits),
    "mffd": Kernel(pack_mffd, pack_mffd_limits),
    "ffs": Kernel(pack_ffs, pack_ffs_limits),
    "split": Kernel(pack_split, pack_split_limits, cuts_items=True),
    "pool": Kernel(pack_pool, pack_pool_limits),
}


def cuts_items(algorithm: str) -> bool:
    """Whether `algorithm` may cut a sequence across packs (its `Kernel.cuts_items`): True for
    `split`; False for the others, and for `batch` (--mode batch: no kernel of `KERNELS`)."""
    kernel = KERNELS.get(algorithm)
    return kernel is not None and kernel.cuts_items


class UncuttableTooLong(ValueError):
    """With `split`, an item over capacity that has a cost (media cannot be cut): `item` its index,
    `column` its first cost column > 0, `count` how many such items."""

    def __init__(self, item: int, length: int, capacity: int, column: int, cost: int, count: int):
        self.item, self.length, self.capacity, self.column, self.cost, self.count = (item, length, capacity, column,
                                                                                     cost, count)
        super().__init__(f"lengths[{item}] = {length} exceeds capacity {capacity} and costs {cost} in cost column "
                         f"{column}: an item with a cost is never cut ({count} such item(s)); increase --capacity "
                         f"or drop them (--too-long drop)")


def pack_lengths(lengths, capacity: int, algorithm: str = "ffd", *, max_seqs_per_bin: int | None = None,
                 seed: int = 0, align: int = 1, pool_size: int = 128, pool_strategy: str = "closest",
                 extra=None, limits=None) -> Bins:
    """Pack items of the given lengths into bins of `capacity` tokens.

    Args:
        lengths: 1-D array of positive ints: each sequence's length after padding to `align`.
        capacity: tokens per bin. Every length must fit, except with `split`.
        algorithm: one of `ALGORITHMS`: concat, ffd, bfd, mffd, ffs, split, pool.
        max_seqs_per_bin: at most this many pieces in a bin (None: no limit).
        seed: seed of the shuffle of `ffs`; the other algorithms are deterministic without it.
        align: cut granularity of `split` (cuts fall at multiples of `align` inside a sequence);
            unused by the other algorithms, whose items are never cut.
        pool_size, pool_strategy: the pool of `pool` (items waiting, and how the next one is picked).
        extra, limits: budgets besides tokens: `extra` (n x k integers >= 0) is each item's cost in
            k columns (images, image tokens, ...), `limits` (k) the most a bin may hold of each.
            None (or k = 0): tokens only, the exact bins of before. An item with a cost is never
            cut (`split` places it whole).

    Returns:
        `Bins`, in creation order; pieces inside a bin in the order they were put there.

    Algorithms (docs/algorithms.md has drawings; n items, B bins, C capacity):
        concat: in the given order, one open bin; a new bin when the next item does not fit. O(n).
        ffd: first fit decreasing. Longest first (ties: lower index first), each into the
            lowest-numbered bin with room. O(n log B).
        bfd: best fit decreasing. Same order, each into the bin with the least room that still
            fits it; among bins with equal room, the one that has had that room the longest.
            O(n log C).
        mffd: Johnson & Garey's modified first fit decreasing: one bin per item over C/2, then
            passes that add items between C/3 and C/2, pairs between C/6 and C/3, then any, and
            first fit decreasing for the rest (see `mffd._mffd_kernel`). O(n log n).
        ffs: first fit in a shuffled order (`np.random.default_rng(seed).permutation`). O(n log B).
        split: in the given order, cut at capacity: each bin is filled up, the item that overflows
            continues in the next bin; inner cuts fall at multiples of `align`. O(n + B).
        pool: near input order. The next `pool_size` items wait in a pool; a bin opens with the
            oldest, then takes pool items while one fits: the largest that fits ("closest", best
            fit) or the oldest that fits ("first"); the pool refills in input order. Every bin
            opens with the oldest waiting item, so an item is placed at the latest in the
            `pool_size`-th bin opened after it entered the pool: order moves little. pool_size 1
            is concat. O(n * pool_size).
        `max_seqs_per_bin` holds in every one: a bin at the limit takes nothing more.
        With limits every algorithm keeps its order and places an item where it fits the tokens
        and every cost (docs/algorithms.md, "More than one budget"): concat and split open a new
        bin when the next item does not fit every budget, first fit takes the lowest-numbered bin
        that fits every budget, best fit the least token room among them, pool and mffd the
        largest item that fits every budget.

    Example, capacity 10:

        >>> bins = pack_lengths([6, 5, 4, 3, 2], 10, "ffd")
        >>> bins.offsets.tolist(), bins.members.tolist(), bins.loads().tolist()
        ([0, 2, 5], [0, 2, 1, 3, 4], [10, 10])

    i.e. bins [6 4] and [5 3 2].

    Raises:
        ValueError: unknown algorithm, capacity/max_seqs_per_bin/align < 1, a length < 1, a length
            over capacity (except with `split`), or for `split` a capacity that is not a multiple of
            `align`. With limits: `extra` not n x k integers >= 0, `OverLimit` for an item over a
            limit on its own, `UncuttableTooLong` (split) for an item with a cost over capacity.

    With limits, capacity 10 and at most 2 images a bin (items (tokens, images)):

        >>> bins = pack_lengths([6, 5, 4, 3, 2], 10, "ffd", extra=[[1], [1], [1], [1], [0]], limits=[2])
        >>> bins.offsets.tolist(), bins.members.tolist(), bins.extra_loads([[1], [1], [1], [1], [0]]).tolist()
        ([0, 2, 5], [0, 2, 1, 3, 4], [[2], [2]])
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown packing algorithm {algorithm!r}: choose one of {', '.join(ALGORITHMS)}")
    kernel = KERNELS[algorithm]
    capacity, align = positive_int(capacity, "capacity"), positive_int(align, "align")
    max_seqs_per_bin = None if max_seqs_per_bin is None else positive_int(max_seqs_per_bin, "max_seqs_per_bin")
    lengths = validated_lengths(lengths, capacity, allow_longer=kernel.cuts_items)
    extra, limits = validated_extra(extra, limits, len(lengths))
    if kernel.cuts_items:
        _check_cuts(algorithm, lengths, capacity, align, extra)
    max_seqs = max_seqs_per_bin if max_seqs_per_bin is not None else len(lengths) + 1  # n + 1: no limit
    options = KernelOptions(seed=seed, align=align, pool_size=pool_size, pool_strategy=pool_strategy)
    return kernel.pack(lengths, extra, limits, capacity, max_seqs, options)


def _check_cuts(algorithm: str, lengths: np.ndarray, capacity: int, align: int, extra: np.ndarray | None) -> None:
    """What an algorithm that cuts items (`split`) needs besides checked lengths: no item with a
    cost over the capacity (media are never cut: `UncuttableTooLong`), and a capacity that is a
    multiple of `align`, its cut granularity, so that bins fill exactly."""
    if extra is not None:
        uncuttable = np.flatnonzero((lengths > capacity) & (extra > 0).any(axis=1))
        if uncuttable.size:
            item = int(uncuttable[0])
            column = int(np.argmax(extra[item] > 0))
            raise UncuttableTooLong(item, int(lengths[item]), capacity, column, int(extra[item, column]),
                                    uncuttable.size)
    if capacity % align != 0:
        raise ValueError(
            f"{algorithm} needs a capacity that is a multiple of align: capacity {capacity} is not a multiple "
            f"of {align}; use capacity {capacity // align * align or align}"
        )
