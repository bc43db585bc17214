"""The order-keeping algorithms: concat and split fill one open bin at a time, in input order.

concat (next fit) closes the bin when the next item does not fit; split fills every bin to the
capacity and cuts the item that overflows, its rest continuing in the next bin (inner cuts at
multiples of `align`). Capacity 10:

    lengths [6, 5, 4, 3, 2]
    concat -> [6] [5 4] [3 2]
    split  -> [6 4'] [1' 4 3 2]    the 5 cut into 4 + 1 across the two bins

Both are one pass in numba, O(n) and O(n + B); bins are runs of consecutive items.
"""
from __future__ import annotations

import numpy as np

from packctl.jit import njit
from packctl.plan.bins import Bins, KernelOptions


def pack_concat(lengths: np.ndarray, capacity: int, max_seqs: int, options: KernelOptions) -> Bins:
    """In the given order, one open bin; a new bin when the next item does not fit. O(n)."""
    offsets = _concat_kernel(lengths, capacity, max_seqs)
    n = len(lengths)
    return Bins(offsets, np.arange(n, dtype=np.int64), np.zeros(n, dtype=np.int64), lengths.copy())


@njit(cache=True)
def _concat_kernel(lengths, capacity, max_seqs):
    # Next fit: one open bin; bins are runs of consecutive items, so only their starts are needed.
    n = lengths.size
    offsets = np.empty(n + 1, np.int64)
    num_bins = 0
    load = capacity + 1  # no open bin yet: the first item opens one
    count = 0
    for i in range(n):
        if load + lengths[i] > capacity or count == max_seqs:
            offsets[num_bins] = i
            num_bins += 1
            load = 0
            count = 0
        load += lengths[i]
        count += 1
    offsets[num_bins] = n
    return offsets[: num_bins + 1].copy()


def pack_split(lengths: np.ndarray, capacity: int, max_seqs: int, options: KernelOptions) -> Bins:
    """In the given order, cut at capacity: each bin is filled up, the item that overflows continues
    in the next bin; inner cuts fall at multiples of `options.align`, which divides `capacity`
    (`pack_lengths` checks it). O(n + B)."""
    align = options.align
    empty = np.zeros(0, dtype=np.int64)
    num_pieces, num_bins = _split_kernel(lengths, capacity, align, max_seqs, empty, empty, empty, empty, False)
    members = np.empty(num_pieces, dtype=np.int64)
    starts = np.empty(num_pieces, dtype=np.int64)
    lens = np.empty(num_pieces, dtype=np.int64)
    offsets = np.empty(num_bins + 1, dtype=np.int64)
    _split_kernel(lengths, capacity, align, max_seqs, members, starts, lens, offsets, True)
    return Bins(offsets, members, starts, lens)


@njit(cache=True)
def _split_kernel(lengths, capacity, align, max_seqs, members, starts, lens, offsets, write):
    """Concatenate and cut at capacity. Run once to count pieces and bins (write=False), then again
    to fill the arrays sized from those counts."""
    num_pieces = 0
    num_bins = 0
    load = 0
    count = 0
    for item in range(lengths.size):
        done = 0
        while done < lengths[item]:
            rest = lengths[item] - done
            room = capacity - load
            if count < max_seqs and rest <= room:
                piece = rest  # an item's last piece is whatever remains
            else:
                piece = room // align * align  # inner cuts only at multiples of align
                if count >= max_seqs or piece == 0:
                    load = 0  # close the bin; the loop retries in a fresh one
                    count = 0
                    continue
            if count == 0:
                if write:
                    offsets[num_bins] = num_pieces
                num_bins += 1
            if write:
                members[num_pieces] = item
                starts[num_pieces] = done
                lens[num_pieces] = piece
            num_pieces += 1
            load += piece
            count += 1
            done += piece
    if write:
        offsets[num_bins] = num_pieces
    return num_pieces, num_bins


# --- more than one budget (`extra` costs n x k, `limits` k; pack_lengths runs these only when k >= 1) --

def pack_concat_limits(lengths: np.ndarray, extra: np.ndarray, limits: np.ndarray, capacity: int, max_seqs: int,
                       options: KernelOptions) -> Bins:
    """concat under every budget: a new bin when the next item does not fit the tokens or any
    limit. O(n k). Capacity 10, limit 2 on one cost column, items (tokens, cost)
    (3, 1) (3, 1) (3, 1) (3, 0) -> [(3,1) (3,1)] [(3,1) (3,0)]: the third image would make 3 > 2."""
    offsets = _concat_limits_kernel(lengths, extra, limits, capacity, max_seqs)
    n = len(lengths)
    return Bins(offsets, np.arange(n, dtype=np.int64), np.zeros(n, dtype=np.int64), lengths.copy())


@njit(cache=True)
def _concat_limits_kernel(lengths, extra, limits, capacity, max_seqs):
    n = lengths.size
    k = limits.size
    offsets = np.empty(n + 1, np.int64)
    spent = np.zeros(k, np.int64)  # the open bin's sum of each cost column
    num_bins = 0
    load = capacity + 1  # no open bin yet: the first item opens one
    count = 0
    for i in range(n):
        fits = load + lengths[i] <= capacity and count < max_seqs
        j = 0
        while fits and j < k:
            fits = spent[j] + extra[i, j] <= limits[j]
            j += 1
        if not fits:
            offsets[num_bins] = i
            num_bins += 1
            load = 0
            count = 0
            for j in range(k):
                spent[j] = 0
        load += lengths[i]
        count += 1
        for j in range(k):
            spent[j] += extra[i, j]
    offsets[num_bins] = n
    return offsets[: num_bins + 1].copy()


def pack_split_limits(lengths: np.ndarray, extra: np.ndarray, limits: np.ndarray, capacity: int, max_seqs: int,
                      options: KernelOptions) -> Bins:
    """split under every budget. An item with a cost (any column > 0: an image, a clip) is never
    cut: it goes whole into the open bin when it fits there in tokens and every limit, else whole
    into the next one (the open bin keeps its room, as with concat); an item of no cost is cut at
    capacity as without limits. `pack_lengths` refuses an item with a cost over capacity (it could
    only be cut). Capacity 10, align 1, items (tokens, cost) (6, 0) (5, 1) (7, 0):
    -> [(6,0)] [(5,1) (5' of 7)] [(2' of 7)]: the 5 with an image is not cut into the first bin."""
    align = options.align
    empty = np.zeros(0, dtype=np.int64)
    num_pieces, num_bins = _split_limits_kernel(lengths, extra, limits, capacity, align, max_seqs, empty, empty,
                                                empty, empty, False)
    members = np.empty(num_pieces, dtype=np.int64)
    starts = np.empty(num_pieces, dtype=np.int64)
    lens = np.empty(num_pieces, dtype=np.int64)
    offsets = np.empty(num_bins + 1, dtype=np.int64)
    _split_limits_kernel(lengths, extra, limits, capacity, align, max_seqs, members, starts, lens, offsets, True)
    return Bins(offsets, members, starts, lens)


@njit(cache=True)
def _split_limits_kernel(lengths, extra, limits, capacity, align, max_seqs, members, starts, lens, offsets, write):
    """`_split_kernel` with whole items of a cost: run to count (write=False), then to fill."""
    k = limits.size
    spent = np.zeros(k, np.int64)
    num_pieces = 0
    num_bins = 0
    load = 0
    count = 0
    for item in range(lengths.size):
        whole = False
        for j in range(k):
            whole = whole or extra[item, j] > 0
        done = 0
        while done < lengths[item]:
            rest = lengths[item] - done
            room = capacity - load
            fits = count < max_seqs and rest <= room
            if whole:
                for j in range(k):
                    fits = fits and spent[j] + extra[item, j] <= limits[j]
            if fits:
                piece = rest  # an item's last piece is whatever remains
            else:
                piece = 0 if whole else room // align * align  # inner cuts only at multiples of align
                if count >= max_seqs or piece == 0:
                    load = 0  # close the bin; the loop retries in a fresh one
                    count = 0
                    for j in range(k):
                        spent[j] = 0
                    continue
            if count == 0:
                if write:
                    offsets[num_bins] = num_pieces
                num_bins += 1
            if write:
                members[num_pieces] = item
                starts[num_pieces] = done
                lens[num_pieces] = piece
            num_pieces += 1
            load += piece
            count += 1
            done += piece
            if whole:
                for j in range(k):
                    spent[j] += extra[item, j]
    if write:
        offsets[num_bins] = num_pieces
    return num_pieces, num_bins
