"""First fit and best fit, in decreasing order (ffd, bfd) or a seeded shuffle (ffs).

Both place each item, one at a time, into a bin that already holds others when one has room, and
open a new bin otherwise. First fit takes the lowest-numbered bin with room; best fit the one with
the least room that still fits the item. Capacity 10:

    lengths [1, 6, 8, 3]   decreasing order: 8, 6, 3, 1
    ffd  -> [8 1] [6 3]    the 1 fits beside the 8 (room 2) and the 6 3 (room 1): the first bin
    bfd  -> [8] [6 3 1]    the tightest bin, keeping the 2 tokens of room together
    ffs  -> first fit in the order np.random.default_rng(seed).permutation(4)

The loops run in numba over a segment tree (first fit: max room per subtree, O(log B) a step) or a
presence tree over room values (best fit, O(log C) a step); numpy sorts and gathers.
"""
from __future__ import annotations

import math

import numpy as np

from packctl.jit import njit
from packctl.plan.bins import Bins, KernelOptions, whole_items_into_bins


def pack_ffd(lengths: np.ndarray, capacity: int, max_seqs: int, options: KernelOptions) -> Bins:
    """First fit decreasing: longest first (ties: lower index first), each into the lowest-numbered
    bin with room. O(n log B)."""
    return _first_fit_in_order(lengths, decreasing_order(lengths, capacity), capacity, max_seqs)


def pack_ffs(lengths: np.ndarray, capacity: int, max_seqs: int, options: KernelOptions) -> Bins:
    """First fit in a shuffled order (`np.random.default_rng(options.seed).permutation`). O(n log B)."""
    order = np.random.default_rng(options.seed).permutation(len(lengths)).astype(np.int64)
    return _first_fit_in_order(lengths, order, capacity, max_seqs)


def pack_bfd(lengths: np.ndarray, capacity: int, max_seqs: int, options: KernelOptions) -> Bins:
    """Best fit decreasing: the same order as ffd, each into the bin with the least room that still
    fits it; among bins with equal room, the one that has had that room the longest. O(n log C)."""
    order = decreasing_order(lengths, capacity)
    # Gathered once by numpy: inside the kernels, lengths[order[step]] would be a cache miss per
    # step stuck behind the tree walk, which made them about four times slower.
    sizes = lengths[order]
    n = len(sizes)
    leaves = 1 << int(capacity).bit_length()  # the least power of two > capacity
    bin_of_step = np.empty(n, np.int64)
    num_bins = _best_fit_kernel(sizes, capacity, max_seqs, np.zeros(2 * leaves, np.uint8),
                                np.full(capacity + 1, -1, np.int64), np.full(capacity + 1, -1, np.int64),
                                np.empty(n, np.int64), np.zeros(n, np.int64), bin_of_step)
    return whole_items_into_bins(lengths, order, bin_of_step, num_bins)


def _first_fit_in_order(lengths: np.ndarray, order: np.ndarray, capacity: int, max_seqs: int) -> Bins:
    sizes = lengths[order]  # gathered once by numpy, as in pack_bfd
    bin_of_step, num_bins = first_fit(sizes, capacity, max_seqs, first_fit_bin_bound(lengths, capacity, max_seqs), 0)
    return whole_items_into_bins(lengths, order, bin_of_step, num_bins)


# --- ordering -------------------------------------------------------------------------------------

def decreasing_order(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """Indices by length descending, ties by index ascending: [6, 5, 6, 2] -> [0, 2, 1, 3]."""
    # Lengths are bounded by capacity, so a counting sort is O(n + C) and beats a comparison sort
    # unless the capacity dwarfs the number of items.
    if capacity <= 4 * len(lengths) + 1024:
        order = np.empty(lengths.size, np.int64)
        _counting_sort_descending(lengths, capacity, np.zeros(capacity + 1, np.int64),
                                  np.empty(capacity + 1, np.int64), order)
        return order
    return np.argsort(-lengths, kind="stable").astype(np.int64)


# The kernels allocate nothing: their callers pass numpy arrays in (zeroed where the kernel counts
# into them). numba compiles its own np.empty, np.zeros and np.full for each dtype the first time a
# process uses them, about 0.35 s of a first run after an install; numpy allocates as fast.

@njit(cache=True)
def _counting_sort_descending(lengths, capacity, count_of_length, next_slot, order):
    """`order` = indices by length descending; `count_of_length` zeroed, both capacity + 1 long."""
    for i in range(lengths.size):
        count_of_length[lengths[i]] += 1
    slots_used = 0
    for length in range(capacity, -1, -1):
        next_slot[length] = slots_used
        slots_used += count_of_length[length]
    for i in range(lengths.size):  # ascending i keeps equal lengths in index order
        order[next_slot[lengths[i]]] = i
        next_slot[lengths[i]] += 1


def first_fit_bin_bound(lengths: np.ndarray, capacity: int, max_seqs: int) -> int:
    """Most bins first fit can open, to size its segment tree.

    Of the bins that never reach max_seqs, any two hold more than `capacity` together (the later
    one's first item did not fit the earlier one), so at most one is half empty and there are at
    most 2*sum/C + 1 of them. Bins at the sequence limit number at most n // max_seqs (0 when there
    is no limit: `pack_lengths` passes n + 1 then).
    """
    n = len(lengths)
    bound = 2 * math.ceil(int(lengths.sum()) / capacity) + 2
    bound += n // max_seqs
    return max(1, min(n, bound))


# --- first fit (ffd, ffs; and the last phase of mffd) ---------------------------------------------

def first_fit(sizes: np.ndarray, capacity: int, max_seqs: int, max_bins: int, first_bin: int
              ) -> tuple[np.ndarray, int]:
    """First fit of items with `sizes`, in that order; returns the bin of each step and the number
    of bins.

    A max segment tree over the room left in bins 0..max_bins-1 finds the lowest-indexed bin with
    room >= length by one root-to-leaf descent. Unopened bins have room `capacity` and sit to the
    right of every opened one, so "open a new bin" is simply what the descent finds when no opened
    bin fits. A bin at max_seqs gets room 0 (lengths are >= 1), which takes it out of the search.
    Bins are numbered from `first_bin`.
    """
    leaves = 1 << max(int(max_bins) - 1, 0).bit_length()  # the least power of two >= max_bins
    room = np.zeros(2 * leaves, np.int64)
    room[leaves: leaves + max_bins] = capacity
    bin_of_step = np.empty(sizes.size, np.int64)
    num_bins = _first_fit_kernel(sizes, max_seqs, first_bin, leaves, room, np.zeros(max_bins, np.int64),
                                 bin_of_step)
    return bin_of_step, num_bins


@njit(cache=True)
def _first_fit_kernel(sizes, max_seqs, first_bin, leaves, room, count, bin_of_step):
    """`first_fit`'s loop: `room` holds the leaves (zeroed, `capacity` for the first max_bins),
    `count` zeroed."""
    for node in range(leaves - 1, 0, -1):
        room[node] = max(room[2 * node], room[2 * node + 1])
    num_bins = 0
    for step in range(sizes.size):
        length = sizes[step]
        if room[1] < length:
            raise RuntimeError("first-fit bin bound exceeded")
        node = 1
        while node < leaves:
            node *= 2
            if room[node] < length:
                node += 1  # the left subtree has no bin with room
        b = node - leaves
        bin_of_step[step] = first_bin + b
        if b >= num_bins:
            num_bins = b + 1
        count[b] += 1
        room[node] = room[node] - length if count[b] < max_seqs else 0
        node //= 2
        while node >= 1:
            larger = max(room[2 * node], room[2 * node + 1])
            if room[node] == larger:
                break  # ancestors already hold the right maximum
            room[node] = larger
            node //= 2
    return num_bins


# --- best fit (bfd) -------------------------------------------------------------------------------
# The tree steps are inlined into _best_fit_kernel as numba reads it (`inline="always"`): compiled
# as functions of their own they added 6% to the compiling of a first run, and ran no faster.

@njit(cache=True, inline="always")
def _mark_room(present, leaves, room):
    node = leaves + room
    while node >= 1 and present[node] == 0:
        present[node] = 1
        node //= 2


@njit(cache=True, inline="always")
def _unmark_room(present, leaves, room):
    node = leaves + room
    present[node] = 0
    node //= 2
    while node >= 1:
        if present[2 * node] | present[2 * node + 1]:
            break
        present[node] = 0
        node //= 2


@njit(cache=True, inline="always")
def _smallest_room_at_least(present, leaves, length):
    """Smallest marked room >= length, or -1: climb to the first right subtree that has one, then
    descend to its leftmost marked leaf."""
    node = leaves + length
    if present[node]:
        return length
    while True:
        if node == 1:
            return -1
        if node % 2 == 0 and present[node + 1]:
            node += 1
            break
        node //= 2
    while node < leaves:
        node *= 2
        if present[node] == 0:
            node += 1
    return node - leaves


@njit(cache=True)
def _best_fit_kernel(sizes, capacity, max_seqs, present, queue_head, queue_tail, queue_next, count,
                     bin_of_step):
    """Best fit of items with `sizes`, in that order, into `bin_of_step`; returns the number of
    bins. `present` (zeroed, twice the least power of two > capacity), `queue_head`/`queue_tail`
    (-1, capacity + 1), `queue_next`, `count` (zeroed) and `bin_of_step` (n each) from the caller.

    Open bins are filed by the room they have left: a FIFO queue of bins per room value
    (`queue_head`/`queue_tail` per room, `queue_next` per bin), and a presence tree over room values
    0..capacity whose query gives the smallest non-empty room >= length in O(log C). Ties between
    bins with the same room go to the head of the queue: the bin that has had that room the longest.
    Full bins (room 0) and bins at max_seqs are never filed, so they are never offered again.
    """
    n = sizes.size
    leaves = present.size // 2
    num_bins = 0
    for step in range(n):
        length = sizes[step]
        room = _smallest_room_at_least(present, leaves, length)
        if room < 0:
            b = num_bins
            num_bins += 1
            room = capacity
        else:
            b = queue_head[room]
            queue_head[room] = queue_next[b]
            if queue_head[room] < 0:
                queue_tail[room] = -1
                _unmark_room(present, leaves, room)
        bin_of_step[step] = b
        count[b] += 1
        room -= length
        if room > 0 and count[b] < max_seqs:
            queue_next[b] = -1
            if queue_tail[room] < 0:
                queue_head[room] = b
                _mark_room(present, leaves, room)
            else:
                queue_next[queue_tail[room]] = b
            queue_tail[room] = b
    return num_bins
