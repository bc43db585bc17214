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

To add an algorithm: write `pack_<name>(lengths, capacity, max_seqs, options) -> Bins` in a file
of its family (or a new one), add its row to `KERNELS` and its name to `names.ALGORITHMS`, which
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
    empty_bins,
    positive_int,
    validated_lengths,
)
from packctl.plan.fit import pack_bfd, pack_ffd, pack_ffs
from packctl.plan.mffd import pack_mffd
from packctl.plan.names import ALGORITHMS
from packctl.plan.pool import POOL_STRATEGIES, pack_pool
from packctl.plan.sequential import pack_concat, pack_split

__all__ = ["ALGORITHMS", "KERNELS", "POOL_STRATEGIES", "Bins", "Kernel", "KernelOptions", "batch_lengths",
           "choose_buckets", "pack_lengths"]


@dataclass(frozen=True)
class Kernel:
    """One algorithm: its runner, and whether it cuts items.

    `run(lengths, capacity, max_seqs, options)` gets checked, non-empty int64 lengths and a
    sequence limit that is always an int (n + 1 for none). A kernel that cuts items (`split`)
    accepts lengths over capacity, and its capacity must be a multiple of `align`, the cut
    granularity, for bins to fill exactly.
    """

    run: Callable[[np.ndarray, int, int, KernelOptions], Bins]
    cuts_items: bool = False


KERNELS: dict[str, Kernel] = {
    "concat": Kernel(pack_concat),
    "ffd": Kernel(pack_ffd),
    "bfd": Kernel(pack_bfd),
    "mffd": Kernel(pack_mffd),
    "ffs": Kernel(pack_ffs),
    "split": Kernel(pack_split, cuts_items=True),
    "pool": Kernel(pack_pool),
}


def pack_lengths(lengths, capacity: int, algorithm: str = "ffd", *, max_seqs_per_bin: int | None = None,
                 seed: int = 0, align: int = 1, pool_size: int = 128, pool_strategy: str = "closest") -> Bins:
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

    Example, capacity 10:

        >>> bins = pack_lengths([6, 5, 4, 3, 2], 10, "ffd")
        >>> bins.offsets.tolist(), bins.members.tolist(), bins.loads().tolist()
        ([0, 2, 5], [0, 2, 1, 3, 4], [10, 10])

    i.e. bins [6 4] and [5 3 2].

    Raises:
        ValueError: unknown algorithm, capacity/max_seqs_per_bin/align < 1, a length < 1, a length
            over capacity (except with `split`), or for `split` a capacity that is not a multiple of
            `align`.
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown packing algorithm {algorithm!r}: choose one of {', '.join(ALGORITHMS)}")
    kernel = KERNELS[algorithm]
    capacity = positive_int(capacity, "capacity")
    align = positive_int(align, "align")
    if max_seqs_per_bin is not None:
        max_seqs_per_bin = positive_int(max_seqs_per_bin, "max_seqs_per_bin")
    lengths = validated_lengths(lengths, capacity, allow_longer=kernel.cuts_items)
    if kernel.cuts_items and capacity % align != 0:
        raise ValueError(
            f"{algorithm} needs a capacity that is a multiple of align: capacity {capacity} is not a multiple "
            f"of {align}; use capacity {capacity // align * align or align}"
        )
    n = len(lengths)
    if n == 0:
        return empty_bins()
    # A limit that can never be reached keeps the kernels free of None checks.
    max_seqs = max_seqs_per_bin if max_seqs_per_bin is not None else n + 1
    options = KernelOptions(seed=seed, align=align, pool_size=pool_size, pool_strategy=pool_strategy)
    return kernel.run(lengths, capacity, max_seqs, options)
