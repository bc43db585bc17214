"""Modified first fit decreasing (mffd, Johnson & Garey 1985): large items first, each given a
partner from the classes below before first fit decreasing packs the rest.

Sizes are classed against the capacity C: large (> C/2), medium (C/3, C/2], small (C/6, C/3],
tiny (<= C/6). Capacity 20:

    lengths [19, 17, 11, 10, 6, 5, 4, 4]
    large bins [19] [17] [11]; no medium (the 10) fits any of them;
    backward, the 11 (room 9) takes the smallest small 4 and then the largest small that fits, 5;
    ffd packs the rest: [10 6 4]
    mffd -> [19] [17] [11 4 5] [10 6 4]   4 bins, where ffd needs 5

Phases 1 to 4 run in one numba kernel here; phase 5 is first fit decreasing (fit.py), called by
`pack_mffd` rather than from inside the kernel: numba caches a kernel by its own source file only,
so a kernel calling into fit.py would keep a stale first fit in its cache after fit.py changed.
"""
from __future__ import annotations

import numpy as np

from packctl.jit import njit
from packctl.plan.bins import Bins, KernelOptions, whole_items_into_bins
from packctl.plan.fit import (
    decreasing_order,
    first_fit,
    first_fit_bin_bound,
    first_fit_limits,
    first_fit_limits_bin_bound,
)


def pack_mffd(lengths: np.ndarray, capacity: int, max_seqs: int, options: KernelOptions) -> Bins:
    """Modified first fit decreasing (see `_mffd_kernel` for the phases). O(n log n)."""
    order = decreasing_order(lengths, capacity)
    sizes = lengths[order]  # gathered once by numpy, as in fit.pack_bfd
    step_item, bin_of_step, steps, num_bins, leftover_sizes = _mffd_kernel(sizes, order, capacity, max_seqs)
    if leftover_sizes.size > 0:
        # Phase 5: first fit decreasing for what is left, in new bins after the large ones.
        ffd_bins, ffd_count = first_fit(leftover_sizes, capacity, max_seqs,
                                        first_fit_bin_bound(lengths, capacity, max_seqs), num_bins)
        bin_of_step[steps:] = ffd_bins
        num_bins += ffd_count
    return whole_items_into_bins(lengths, step_item, bin_of_step, num_bins)


@njit(cache=True)
def _next_alive(next_alive, position):
    """First position >= `position` not yet packed (union-find with path halving; n if none)."""
    while next_alive[position] != position:
        next_alive[position] = next_alive[next_alive[position]]
        position = next_alive[position]
    return position


@njit(cache=True)
def _previous_alive(previous_alive, position):
    """Last position <= `position` not yet packed, or -1. The array is shifted by one so that slot
    0 stands for "none"."""
    slot = position + 1
    while previous_alive[slot] != slot:
        previous_alive[slot] = previous_alive[previous_alive[slot]]
        slot = previous_alive[slot]
    return slot - 1


@njit(cache=True)
def _first_at_most(sizes_descending, low, high, limit):
    """First position in [low, high) whose size is <= limit (high if none): a binary search."""
    while low < high:
        middle = (low + high) // 2
        if sizes_descending[middle] <= limit:
            high = middle
        else:
            low = middle + 1
    return low


@njit(cache=True)
def _place(position, b, sizes, order, room, count, next_alive, previous_alive, step_item, bin_of_step, steps):
    """Put the item at `position` (of the decreasing order) into bin b: log the step, mark the
    item packed for both neighbour searches. Returns the new step count."""
    room[b] -= sizes[position]
    count[b] += 1
    next_alive[position] = position + 1
    previous_alive[position + 1] = position
    step_item[steps] = order[position]
    bin_of_step[steps] = b
    return steps + 1


@njit(cache=True)
def _mffd_kernel(sizes, order, capacity, max_seqs):
    """Phases 1 to 4 of Johnson & Garey's modified first fit decreasing; returns the placement log
    (item and bin of each step: the items left for phase 5 already logged, in the decreasing order,
    their bins not yet), the steps placed, the number of bins and the sizes of the items left.

    Size classes: large (> C/2), medium (C/3, C/2], small (C/6, C/3], tiny (<= C/6). Phases:
      1. each large item opens a bin, largest first (the "large bins");
      2. forward through the large bins: each takes the largest remaining medium item that fits;
      3. backward through the large bins that got no medium item: where the two smallest remaining
         small items fit together, the bin takes the smallest one and then the largest remaining
         small item that fits beside it;
      4. forward through the large bins: each keeps taking the largest remaining item that fits
         until none does;
      5. first fit decreasing packs what is left into new bins (`pack_mffd`).
    A bin at max_seqs takes nothing more, and phase 3 needs room for two more sequences. Capacity
    20, lengths [19, 17, 11, 10, 6, 5, 4, 4]: phase 1 gives [19] [17] [11]; no medium (10) fits;
    going backward, the 11-bin (room 9) takes 4 and then 5; phase 5 packs [10 6 4]. Four bins,
    where ffd needs five ([19] [17] [11 6] [10 5 4] [4]).

    Works on positions in the decreasing order, where the size classes are consecutive ranges:
    large [0, end_large), medium [end_large, end_medium), small [end_medium, end_small), tiny
    [end_small, n). "Largest remaining that fits" is the first unpacked position at or after a
    binary-searched one, and "smallest remaining" the last unpacked one; two union-find arrays over
    positions skip the packed ones. Ties between equal sizes follow the decreasing order: the lower
    index counts as larger.
    """
    n = order.size
    end_large = _first_at_most(sizes, 0, n, capacity // 2)  # 2*size > C
    end_medium = _first_at_most(sizes, 0, n, capacity // 3)  # 3*size > C
    end_small = _first_at_most(sizes, 0, n, capacity // 6)  # 6*size > C

    next_alive = np.arange(n + 1)
    previous_alive = np.arange(n + 1)
    step_item = np.empty(n, np.int64)
    bin_of_step = np.empty(n, np.int64)
    steps = 0
    room = np.empty(max(end_large, 1), np.int64)
    count = np.zeros(max(end_large, 1), np.int64)
    has_medium = np.zeros(max(end_large, 1), np.bool_)

    # Phase 1: one bin per large item, largest first.
    for b in range(end_large):
        room[b] = capacity - sizes[b]
        count[b] = 1
        next_alive[b] = b + 1
        previous_alive[b + 1] = b
        step_item[steps] = order[b]
        bin_of_step[steps] = b
        steps += 1

    # Phase 2: forward through the large bins; each takes the largest medium item that fits.
    for b in range(end_large):
        if count[b] >= max_seqs:
            continue
        position = _next_alive(next_alive, _first_at_most(sizes, end_large, end_medium, room[b]))
        if position >= end_medium:
            continue
        has_medium[b] = True
        steps = _place(position, b, sizes, order, room, count, next_alive, previous_alive, step_item,
                       bin_of_step, steps)

    # Phase 3: backward through the large bins without a medium item; where the two smallest small
    # items fit together, add the smallest and the largest small item that fits beside it.
    for b in range(end_large - 1, -1, -1):
        if has_medium[b] or count[b] + 2 > max_seqs:
            continue
        smallest = _previous_alive(previous_alive, end_small - 1)
        if smallest < end_medium:
            break  # no small items left
        second_smallest = _previous_alive(previous_alive, smallest - 1)
        if second_smallest < end_medium:
            break  # a single small item left: no pair for any bin
        if sizes[smallest] + sizes[second_smallest] > room[b]:
            continue
        for pick in range(2):
            if pick == 0:
                position = smallest
            else:
                position = _next_alive(
                    next_alive, _first_at_most(sizes, end_medium, end_small, room[b]))
            steps = _place(position, b, sizes, order, room, count, next_alive, previous_alive, step_item,
                           bin_of_step, steps)

    # Phase 4: forward through all large bins; each keeps taking the largest remaining item of any
    # class that fits until none does.
    for b in range(end_large):
        while count[b] < max_seqs:
            position = _next_alive(next_alive, _first_at_most(sizes, end_large, n, room[b]))
            if position >= n:
                break
            steps = _place(position, b, sizes, order, room, count, next_alive, previous_alive, step_item,
                           bin_of_step, steps)

    # What is left for phase 5, in the decreasing order.
    leftover_sizes = np.empty(n - steps, np.int64)
    position = _next_alive(next_alive, 0)
    for k in range(leftover_sizes.size):
        step_item[steps + k] = order[position]
        leftover_sizes[k] = sizes[position]
        position = _next_alive(next_alive, position + 1)
    return step_item, bin_of_step, steps, end_large, leftover_sizes


# --- more than one budget (`extra` costs n x k, `limits` k; pack_lengths runs these only when k >= 1) --

MFFD_SCAN = 32  # items past the largest that fits in tokens looked at for one that fits every budget


def pack_mffd_limits(lengths: np.ndarray, extra: np.ndarray, limits: np.ndarray, capacity: int, max_seqs: int,
                     options: KernelOptions) -> Bins:
    """mffd under every budget: the phases of `_mffd_kernel` (classes by tokens), where "the
    largest remaining item that fits" is the first of the MFFD_SCAN largest remaining that fit the
    tokens which also fits every cost (none of them: the bin takes nothing in that step), and
    phase 5 is first fit decreasing under every budget. O(n log n + n MFFD_SCAN k)."""
    order = decreasing_order(lengths, capacity)
    sizes = lengths[order]
    costs = extra[order]
    step_item, bin_of_step, steps, num_bins, leftover = _mffd_limits_kernel(sizes, costs, limits, order, capacity,
                                                                           max_seqs)
    if leftover.size > 0:
        ffd_bins, ffd_count = first_fit_limits(sizes[leftover], costs[leftover], limits, capacity, max_seqs,
                                               first_fit_limits_bin_bound(lengths, extra, limits, capacity,
                                                                          max_seqs), num_bins)
        bin_of_step[steps:] = ffd_bins
        num_bins += ffd_count
    return whole_items_into_bins(lengths, step_item, bin_of_step, num_bins)


@njit(cache=True)
def _costs_fit(costs, position, other, cost_room, b):
    """Whether the item at `position` (with the one at `other`, unless -1) fits bin b's room in
    every cost column."""
    for j in range(costs.shape[1]):
        more = costs[other, j] if other >= 0 else 0
        if costs[position, j] + more > cost_room[b, j]:
            return False
    return True


@njit(cache=True)
def _fitting_from(next_alive, sizes, costs, cost_room, b, start, end, room):
    """The first remaining position in [start, end) that fits bin b's token room and every cost,
    among the MFFD_SCAN first remaining ones at or after `start` (end if none)."""
    position = _next_alive(next_alive, start)
    for _ in range(MFFD_SCAN):
        if position >= end or sizes[position] > room:
            return end
        if _costs_fit(costs, position, -1, cost_room, b):
            return position
        position = _next_alive(next_alive, position + 1)
    return end


@njit(cache=True)
def _place_limits(position, b, sizes, costs, order, room, cost_room, count, next_alive, previous_alive, step_item,
                  bin_of_step, steps):
    for j in range(costs.shape[1]):
        cost_room[b, j] -= costs[position, j]
    return _place(position, b, sizes, order, room, count, next_alive, previous_alive, step_item, bin_of_step, steps)


@njit(cache=True)
def _mffd_limits_kernel(sizes, costs, limits, order, capacity, max_seqs):
    """Phases 1 to 4 of `_mffd_kernel` with a room per bin in every cost column; returns the
    placement log, the steps placed, the number of bins and the positions left for phase 5 (in
    the decreasing order)."""
    n = order.size
    k = limits.size
    end_large = _first_at_most(sizes, 0, n, capacity // 2)
    end_medium = _first_at_most(sizes, 0, n, capacity // 3)
    end_small = _first_at_most(sizes, 0, n, capacity // 6)

    next_alive = np.arange(n + 1)
    previous_alive = np.arange(n + 1)
    step_item = np.empty(n, np.int64)
    bin_of_step = np.empty(n, np.int64)
    steps = 0
    bins = max(end_large, 1)
    room = np.empty(bins, np.int64)
    cost_room = np.empty((bins, k), np.int64)
    count = np.zeros(bins, np.int64)
    has_medium = np.zeros(bins, np.bool_)

    # Phase 1: one bin per large item, largest first.
    for b in range(end_large):
        room[b] = capacity
        for j in range(k):
            cost_room[b, j] = limits[j]
        steps = _place_limits(b, b, sizes, costs, order, room, cost_room, count, next_alive, previous_alive,
                              step_item, bin_of_step, steps)

    # Phase 2: each large bin takes the largest medium item that fits every budget.
    for b in range(end_large):
        if count[b] >= max_seqs:
            continue
        position = _fitting_from(next_alive, sizes, costs, cost_room, b,
                                 _first_at_most(sizes, end_large, end_medium, room[b]), end_medium, room[b])
        if position >= end_medium:
            continue
        has_medium[b] = True
        steps = _place_limits(position, b, sizes, costs, order, room, cost_room, count, next_alive, previous_alive,
                              step_item, bin_of_step, steps)

    # Phase 3: backward through the large bins without a medium item: where the two smallest small
    # items fit together, add the smallest and the largest small item that fits beside it.
    for b in range(end_large - 1, -1, -1):
        if has_medium[b] or count[b] + 2 > max_seqs:
            continue
        smallest = _previous_alive(previous_alive, end_small - 1)
        if smallest < end_medium:
            break
        second_smallest = _previous_alive(previous_alive, smallest - 1)
        if second_smallest < end_medium:
            break
        if sizes[smallest] + sizes[second_smallest] > room[b]:
            continue
        if not _costs_fit(costs, smallest, second_smallest, cost_room, b):
            continue
        steps = _place_limits(smallest, b, sizes, costs, order, room, cost_room, count, next_alive, previous_alive,
                              step_item, bin_of_step, steps)
        position = _fitting_from(next_alive, sizes, costs, cost_room, b,
                                 _first_at_most(sizes, end_medium, end_small, room[b]), end_small, room[b])
        if position < end_small:
            steps = _place_limits(position, b, sizes, costs, order, room, cost_room, count, next_alive,
                                  previous_alive, step_item, bin_of_step, steps)

    # Phase 4: each large bin keeps taking the largest remaining item that fits every budget.
    for b in range(end_large):
        while count[b] < max_seqs:
            position = _fitting_from(next_alive, sizes, costs, cost_room, b,
                                     _first_at_most(sizes, end_large, n, room[b]), n, room[b])
            if position >= n:
                break
            steps = _place_limits(position, b, sizes, costs, order, room, cost_room, count, next_alive,
                                  previous_alive, step_item, bin_of_step, steps)

    leftover = np.empty(n - steps, np.int64)
    position = _next_alive(next_alive, 0)
    for i in range(leftover.size):
        step_item[steps + i] = order[position]
        leftover[i] = position
        position = _next_alive(next_alive, position + 1)
    return step_item, bin_of_step, steps, end_large, leftover
