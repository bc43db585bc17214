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


# --- more than one budget (`extra` costs n x k, `limits` k; pack_lengths runs these only when k >= 1) --
# Multi-dimensional any-fit: an item fits a bin when it fits its token room and its room in every
# cost column. The order stays the one of one budget (decreasing by tokens, or the shuffle of ffs),
# so limits that never bind give the very bins of one budget; a normalized order packed 0.1-0.2%
# tighter only where a cost limit binds (docs/algorithms.md, "More than one budget").

def pack_ffd_limits(lengths: np.ndarray, extra: np.ndarray, limits: np.ndarray, capacity: int, max_seqs: int,
                    options: KernelOptions) -> Bins:
    """First fit decreasing under every budget: longest first (ties: lower index first), each into
    the lowest-numbered bin with room for its tokens and every cost. O(n log B) when one budget
    decides where items go, up to O(n B) when budgets conflict (see `first_fit_limits`)."""
    return _first_fit_limits_in_order(lengths, extra, limits, decreasing_order(lengths, capacity), capacity, max_seqs)


def pack_ffs_limits(lengths: np.ndarray, extra: np.ndarray, limits: np.ndarray, capacity: int, max_seqs: int,
                    options: KernelOptions) -> Bins:
    """First fit under every budget in the shuffled order of ffs (the same permutation)."""
    order = np.random.default_rng(options.seed).permutation(len(lengths)).astype(np.int64)
    return _first_fit_limits_in_order(lengths, extra, limits, order, capacity, max_seqs)


def _first_fit_limits_in_order(lengths, extra, limits, order, capacity, max_seqs) -> Bins:
    bound = first_fit_limits_bin_bound(lengths, extra, limits, capacity, max_seqs)
    bin_of_step, num_bins = first_fit_limits(lengths[order], extra[order], limits, capacity, max_seqs, bound, 0)
    return whole_items_into_bins(lengths, order, bin_of_step, num_bins)


def first_fit_limits_bin_bound(lengths: np.ndarray, extra: np.ndarray, limits: np.ndarray, capacity: int,
                               max_seqs: int) -> int:
    """Most bins first fit under every budget can open. Of two bins below max_seqs, the later one's
    first item did not fit the earlier one in some budget d, so together they hold more than d's
    limit: pairing the bins, at most ceil(sum_d / limit_d) pairs overflow budget d, and there are
    at most 2 * sum over budgets of ceil(sum_d / limit_d) + 1 such bins (a column of no cost at
    all never overflows, whatever its limit)."""
    n = len(lengths)
    pairs = math.ceil(int(lengths.sum()) / capacity)
    for total, limit in zip(extra.sum(axis=0).tolist(), limits.tolist()):
        if total > 0:
            pairs += math.ceil(total / limit)
    return max(1, min(n, 2 * pairs + 2 + n // max_seqs))


def first_fit_limits(sizes: np.ndarray, costs: np.ndarray, limits: np.ndarray, capacity: int, max_seqs: int,
                     max_bins: int, first_bin: int) -> tuple[np.ndarray, int]:
    """`first_fit` under every budget: items of `sizes` tokens and `costs` (n x k) in that order.

    The segment tree over bins keeps, per node, the most room in each cost column among its bins,
    and the most token room, once per *kind* of item: the set of columns it has a cost in (a text
    row: none; an image row: images and image tokens). In the token room an item of a kind sees, a
    bin that can take no item of that kind any more (its room in one of the kind's columns below
    that column's smallest positive cost) counts 0: such bins, full of images but not of tokens,
    are what would send descents astray. A subtree can hold the item only if every maximum
    suffices; the descent takes the left child when it can and backs up when the maxima came from
    different bins. An item of no cost, or of the smallest costs, never backs up: O(log B) a step
    per kind; costs that conflict further cost backing up, O(B) at worst."""
    leaves = 1 << max(int(max_bins) - 1, 0).bit_length()
    n, k = costs.shape
    positive = costs > 0
    smallest_cost = (np.where(positive, costs, np.iinfo(np.int64).max).min(axis=0) if n
                     else np.zeros(k, np.int64))
    kind_mask = positive.astype(np.int64) @ (1 << np.arange(k, dtype=np.int64)) if n else np.zeros(0, np.int64)
    masks, kind = np.unique(kind_mask, return_inverse=True)
    kind_columns = ((masks[:, None] >> np.arange(k)) & 1).astype(np.bool_)  # kinds x k
    room = np.zeros((len(masks), 2 * leaves), np.int64)
    room[:, leaves: leaves + max_bins] = capacity
    cost_room = np.zeros((2 * leaves, k), np.int64)
    cost_room[leaves: leaves + max_bins] = limits
    bin_of_step = np.empty(sizes.size, np.int64)
    num_bins = _first_fit_limits_kernel(sizes, costs, kind.astype(np.int64).reshape(-1), kind_columns, smallest_cost,
                                        max_seqs, first_bin, leaves, room, cost_room, np.zeros(max_bins, np.int64),
                                        np.zeros(max_bins, np.int64), bin_of_step)
    return bin_of_step, num_bins


@njit(cache=True, inline="always")
def _holds(room, cost_room, node, length, costs, step):
    if room[node] < length:
        return False
    for j in range(costs.shape[1]):
        if cost_room[node, j] < costs[step, j]:
            return False
    return True


@njit(cache=True)
def _first_fit_limits_kernel(sizes, costs, kind, kind_columns, smallest_cost, max_seqs, first_bin, leaves, rooms,
                             cost_room, count, load, bin_of_step):
    """`first_fit_limits`'s loop: leaves of `rooms` (kinds x nodes) and `cost_room` filled by the
    caller; `count` and `load` (the tokens of each bin) zeroed."""
    k = costs.shape[1]
    kinds = rooms.shape[0]
    capacity = rooms[0, leaves]
    for node in range(leaves - 1, 0, -1):
        for t in range(kinds):
            rooms[t, node] = max(rooms[t, 2 * node], rooms[t, 2 * node + 1])
        for j in range(k):
            cost_room[node, j] = max(cost_room[2 * node, j], cost_room[2 * node + 1, j])
    num_bins = 0
    for step in range(sizes.size):
        length = sizes[step]
        room = rooms[kind[step]]
        node = 1
        if not _holds(room, cost_room, node, length, costs, step):
            raise RuntimeError("first-fit bin bound exceeded")
        while node < leaves:
            if _holds(room, cost_room, 2 * node, length, costs, step):
                node = 2 * node
            elif _holds(room, cost_room, 2 * node + 1, length, costs, step):
                node = 2 * node + 1
            else:
                # every maximum suffices here, but no single bin below: back up to the nearest
                # right sibling (of this node or an ancestor) that may hold the item
                while True:
                    if node == 1:
                        raise RuntimeError("first-fit bin bound exceeded")
                    if node % 2 == 0 and _holds(room, cost_room, node + 1, length, costs, step):
                        node += 1
                        break
                    node //= 2
        b = node - leaves
        bin_of_step[step] = first_bin + b
        if b >= num_bins:
            num_bins = b + 1
        count[b] += 1
        load[b] += length
        token_room = capacity - load[b] if count[b] < max_seqs else 0
        for j in range(k):
            cost_room[node, j] -= costs[step, j]
        for t in range(kinds):
            takes_kind = True
            for j in range(k):
                if kind_columns[t, j] and cost_room[node, j] < smallest_cost[j]:
                    takes_kind = False
            rooms[t, node] = token_room if takes_kind else 0
        node //= 2
        while node >= 1:
            changed = False
            for t in range(kinds):
                larger = max(rooms[t, 2 * node], rooms[t, 2 * node + 1])
                if rooms[t, node] != larger:
                    rooms[t, node] = larger
                    changed = True
            for j in range(k):
                larger = max(cost_room[2 * node, j], cost_room[2 * node + 1, j])
                if cost_room[node, j] != larger:
                    cost_room[node, j] = larger
                    changed = True
            if not changed:
                break  # ancestors already hold the right maxima
            node //= 2
    return num_bins


def pack_bfd_limits(lengths: np.ndarray, extra: np.ndarray, limits: np.ndarray, capacity: int, max_seqs: int,
                    options: KernelOptions) -> Bins:
    """Best fit decreasing under every budget: the order of bfd, each item into the bin with the
    least token room among those that fit its tokens and every cost; among those, the one that has
    had that room the longest (the rule of one budget). See `_best_fit_limits_kernel`."""
    order = decreasing_order(lengths, capacity)
    bin_of_step, num_bins = best_fit_limits(lengths[order], extra[order], limits, capacity, max_seqs)
    return whole_items_into_bins(lengths, order, bin_of_step, num_bins)


def best_fit_limits(sizes: np.ndarray, costs: np.ndarray, limits: np.ndarray, capacity: int, max_seqs: int
                    ) -> tuple[np.ndarray, int]:
    """Best fit under every budget of items of `sizes` tokens and `costs` (n x k), in that order:
    the bin of each step and the number of bins.

    The kernel's tree tells a room value with no bin by -1 in every cost column, so it needs one
    column at least: with no budget (k = 0) it runs on one column of zero costs under a limit of 0,
    which holds for every bin and only says where bins are (the rule of tokens alone)."""
    n = len(sizes)
    if limits.size == 0:
        costs, limits = np.zeros((n, 1), np.int64), np.zeros(1, np.int64)
    k = limits.size
    leaves = 1 << int(capacity).bit_length()
    bin_of_step = np.empty(n, np.int64)
    num_bins = _best_fit_limits_kernel(sizes, np.ascontiguousarray(costs), limits, capacity, max_seqs,
                                       np.full((2 * leaves, k), -1, np.int64),
                                       np.full(capacity + 1, -1, np.int64), np.full(capacity + 1, -1, np.int64),
                                       np.full(n, -1, np.int64), np.full(n, -1, np.int64), np.zeros((n, k), np.int64),
                                       np.zeros(n, np.int64), bin_of_step)
    return bin_of_step, num_bins


@njit(cache=True, inline="always")
def _room_holds(best_cost_room, node, costs, step):
    for j in range(costs.shape[1]):
        if best_cost_room[node, j] < costs[step, j]:
            return False
    return True


@njit(cache=True, inline="always")
def _refresh_room(best_cost_room, leaves, room, queue_head, queue_next, cost_room):
    """Leaf `room` := the most cost room of its bins in each column (-1: no bin has that room),
    then its ancestors, up to the first that does not change."""
    k = cost_room.shape[1]
    node = leaves + room
    for j in range(k):
        best_cost_room[node, j] = -1
    b = queue_head[room]
    while b >= 0:
        for j in range(k):
            best_cost_room[node, j] = max(best_cost_room[node, j], cost_room[b, j])
        b = queue_next[b]
    node //= 2
    while node >= 1:
        changed = False
        for j in range(k):
            larger = max(best_cost_room[2 * node, j], best_cost_room[2 * node + 1, j])
            if best_cost_room[node, j] != larger:
                best_cost_room[node, j] = larger
                changed = True
        if not changed:
            break
        node //= 2


@njit(cache=True)
def _best_fit_limits_kernel(sizes, costs, limits, capacity, max_seqs, best_cost_room, queue_head, queue_tail,
                            queue_next, queue_prev, cost_room, count, bin_of_step):
    """Best fit under every budget, into `bin_of_step`; returns the number of bins.

    Open bins are filed by token room, as in `_best_fit_kernel`: a FIFO list of bins per room value
    (doubly linked here, as a bin may leave from the middle). The tree over room values 0..C keeps
    per node and cost column the most room any of its bins has left in that column (-1: no bin), so
    the smallest room >= length holding a bin that may fit is found by a descent: O(log C) with one
    cost column (exact), backing up when columns conflict. At that room the oldest bin that fits
    every budget is taken (one exists with one column; with more the search goes on to the next
    room value when none does). Taking it rescans its room's list to refresh the maxima only when
    it held one of them. A bin full in tokens, or at max_seqs, is never filed again."""
    n = sizes.size
    k = limits.size
    leaves = best_cost_room.shape[0] // 2
    num_bins = 0
    for step in range(n):
        length = sizes[step]
        # smallest room value >= length whose list may hold a bin that fits: climb from the leaf
        # to the first right sibling that may, descend to its leftmost leaf that may, back up if none
        b = -1
        room = -1
        node = leaves + length
        if not _room_holds(best_cost_room, node, costs, step):
            node = -node  # look right of the leaf
        while b < 0:
            if node < 0:  # climb from -node to the nearest right sibling that may hold the item
                node = -node
                while node > 1 and not (node % 2 == 0 and _room_holds(best_cost_room, node + 1, costs, step)):
                    node //= 2
                if node <= 1:
                    break  # no filed bin fits: open one
                node += 1
            while node < leaves:  # descend to the leftmost leaf that may hold it
                if _room_holds(best_cost_room, 2 * node, costs, step):
                    node = 2 * node
                elif _room_holds(best_cost_room, 2 * node + 1, costs, step):
                    node = 2 * node + 1
                else:
                    break
            if node < leaves:
                node = -node  # the maxima came from different bins: back up
                continue
            candidate = queue_head[node - leaves]
            while candidate >= 0:
                fits = True
                for j in range(k):
                    fits = fits and cost_room[candidate, j] >= costs[step, j]
                if fits:
                    break
                candidate = queue_next[candidate]
            if candidate >= 0:
                b = candidate
                room = node - leaves
            else:
                node = -node
        if b < 0:
            b = num_bins
            num_bins += 1
            room = capacity
            for j in range(k):
                cost_room[b, j] = limits[j]
        else:
            # unlink b from its room's list
            held_max = False
            for j in range(k):
                held_max = held_max or cost_room[b, j] == best_cost_room[leaves + room, j]
            if queue_prev[b] >= 0:
                queue_next[queue_prev[b]] = queue_next[b]
            else:
                queue_head[room] = queue_next[b]
            if queue_next[b] >= 0:
                queue_prev[queue_next[b]] = queue_prev[b]
            else:
                queue_tail[room] = queue_prev[b]
            if held_max:
                _refresh_room(best_cost_room, leaves, room, queue_head, queue_next, cost_room)
        bin_of_step[step] = b
        count[b] += 1
        room -= length
        for j in range(k):
            cost_room[b, j] -= costs[step, j]
        if room > 0 and count[b] < max_seqs:
            queue_next[b] = -1
            queue_prev[b] = queue_tail[room]
            if queue_tail[room] < 0:
                queue_head[room] = b
            else:
                queue_next[queue_tail[room]] = b
            queue_tail[room] = b
            node = leaves + room
            raised = False
            for j in range(k):
                if cost_room[b, j] > best_cost_room[node, j]:
                    best_cost_room[node, j] = cost_room[b, j]
                    raised = True
            node //= 2
            while raised and node >= 1:
                raised = False
                for j in range(k):
                    if cost_room[b, j] > best_cost_room[node, j]:
                        best_cost_room[node, j] = cost_room[b, j]
                        raised = True
                node //= 2
    return num_bins
