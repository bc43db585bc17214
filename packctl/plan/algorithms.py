"""Bin packing: padded sequence lengths -> bins (packs) of at most `capacity` tokens.

Every algorithm takes the lengths of one planning window, already padded by the caller to the
alignment multiple, and returns the bins in CSR form (`Bins`). With capacity 10:

    lengths [6, 5, 4, 3, 2]
    concat  -> [6] [5 4] [3 2]       in order; a new bin when the next one does not fit
    ffd     -> [6 4] [5 3 2]         largest first, each into the first bin with room
    split   -> [6 4'] [1' 4 3 2]     in order; the 5 is cut into 4 + 1 across the two bins

See docs/algorithms.md for drawings, complexities and when to use each one. The loops run in numba
(one pass over the items, O(log) per placement); numpy does the sorting and the bookkeeping.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import numpy as np

from packctl.jit import njit
from packctl.plan.names import ALGORITHMS

POOL_STRATEGIES: tuple[str, ...] = ("closest", "first")


@dataclass(frozen=True, eq=False)
class Bins:
    """CSR bins. Bin b holds pieces offsets[b]:offsets[b+1] of members/starts/lens, in pack order.

    A piece is a whole sequence, or with `split` a contiguous slice of one. Capacity 10, `split`,
    lengths [6, 5, 4, 3, 2]:

        offsets [0, 2, 6]
        members [0, 1,   1, 2, 3, 4]    index into `lengths`
        starts  [0, 0,   4, 0, 0, 0]    sequence 1 continues at its token 4 in bin 1
        lens    [6, 4,   1, 4, 3, 2]
        bin 0   |seq 0: 6     |seq 1: 0..3|             load 10
        bin 1   |seq 1: 4|seq 2: 4|seq 3: 3|seq 4: 2|   load 10

    Two `Bins` are equal only when they are the same object; compare contents array by array
    (`np.array_equal`).
    """

    offsets: np.ndarray  # int64, len B+1, offsets[0] == 0
    members: np.ndarray  # int64, index into the input `lengths` array of each piece
    starts: np.ndarray  # int64, offset of the piece inside its item (0 unless the item was split)
    lens: np.ndarray  # int64, length of the piece (== lengths[member] unless split)

    @property
    def num_bins(self) -> int:
        """Number of bins B."""
        return len(self.offsets) - 1

    def loads(self) -> np.ndarray:
        """Tokens in each bin (int64, length B): lens [6, 4, 1, 4, 3, 2], offsets [0, 2, 6] -> [10, 10]."""
        cumulative = np.concatenate(([0], np.cumsum(self.lens, dtype=np.int64)))
        return cumulative[self.offsets[1:]] - cumulative[self.offsets[:-1]]


def pack_lengths(lengths, capacity: int, algorithm: str = "ffd", *, max_seqs_per_bin: int | None = None,
                 seed: int = 0, align: int = 1, pool_size: int = 128, pool_strategy: str = "closest") -> Bins:
    """Pack items of the given lengths into bins of `capacity` tokens.

    Args:
        lengths: 1-D array of positive ints: each sequence's length after padding to `align`.
        capacity: tokens per bin. Every length must fit, except with `split`.
        algorithm: one of `ALGORITHMS`: concat, ffd, bfd, mffd, ffs, split.
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
            first fit decreasing for the rest (see `_mffd_kernel`). O(n log n).
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
    capacity = _positive_int(capacity, "capacity")
    align = _positive_int(align, "align")
    if max_seqs_per_bin is not None:
        max_seqs_per_bin = _positive_int(max_seqs_per_bin, "max_seqs_per_bin")
    lengths = _validated_lengths(lengths, capacity, allow_longer=algorithm == "split")
    n = len(lengths)
    # A limit that can never be reached keeps the kernels free of None checks.
    max_seqs = max_seqs_per_bin if max_seqs_per_bin is not None else n + 1

    if algorithm == "split":
        if capacity % align != 0:
            raise ValueError(
                f"split needs a capacity that is a multiple of align: capacity {capacity} is not a multiple "
                f"of {align}; use capacity {capacity // align * align or align}"
            )
        return _split(lengths, capacity, align, max_seqs)
    if n == 0:
        return _empty_bins()
    if algorithm == "concat":
        return _concat(lengths, capacity, max_seqs)
    if algorithm == "pool":
        if pool_strategy not in POOL_STRATEGIES:
            raise ValueError(f"unknown pool strategy {pool_strategy!r}: choose one of {', '.join(POOL_STRATEGIES)}")
        step_item, bin_of_step, num_bins = _pool_kernel(lengths, capacity, max_seqs,
                                                        _positive_int(pool_size, "pool_size"),
                                                        pool_strategy == "closest")
        return _whole_items_into_bins(lengths, step_item, bin_of_step, num_bins)

    if algorithm == "ffs":
        order = np.random.default_rng(seed).permutation(n).astype(np.int64)
    else:
        order = _decreasing_order(lengths, capacity)
    # Gathered once by numpy: inside the kernels, lengths[order[step]] would be a cache miss per
    # step stuck behind the tree walk, which made them about four times slower.
    sizes = lengths[order]
    if algorithm in ("ffd", "ffs"):
        max_bins = _first_fit_bin_bound(lengths, capacity, max_seqs_per_bin)
        bin_of_step, num_bins = _first_fit_kernel(sizes, capacity, max_seqs, max_bins, 0)
        return _whole_items_into_bins(lengths, order, bin_of_step, num_bins)
    if algorithm == "bfd":
        bin_of_step, num_bins = _best_fit_kernel(sizes, capacity, max_seqs)
        return _whole_items_into_bins(lengths, order, bin_of_step, num_bins)
    # mffd
    step_item, bin_of_step, num_bins = _mffd_kernel(
        sizes, order, capacity, max_seqs, _first_fit_bin_bound(lengths, capacity, max_seqs_per_bin))
    return _whole_items_into_bins(lengths, step_item, bin_of_step, num_bins)


# --- validation -----------------------------------------------------------------------------------

def _positive_int(value, name: str) -> int:
    try:
        value = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}") from None
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def _validated_lengths(lengths, capacity: int, *, allow_longer: bool) -> np.ndarray:
    array = np.asarray(lengths)
    if array.ndim != 1:
        raise ValueError(f"lengths must be a 1-D array, got shape {array.shape}")
    if array.size == 0:
        return np.zeros(0, dtype=np.int64)
    if array.dtype.kind not in "iu":
        raise ValueError(f"lengths must be integers, got dtype {array.dtype}")
    array = array.astype(np.int64, copy=False)
    non_positive = np.flatnonzero(array < 1)
    if non_positive.size:
        first = int(non_positive[0])
        raise ValueError(
            f"lengths[{first}] = {array[first]}: every length must be >= 1 "
            f"(drop empty sequences before packing)"
        )
    if not allow_longer:
        too_long = np.flatnonzero(array > capacity)
        if too_long.size:
            first = int(too_long[0])
            raise ValueError(
                f"lengths[{first}] = {array[first]} exceeds capacity {capacity} "
                f"({too_long.size} sequence(s) too long): increase --capacity, drop or truncate them "
                f"(--too-long drop|truncate), or use --algorithm split"
            )
    return np.ascontiguousarray(array)


def _empty_bins() -> Bins:
    empty = np.zeros(0, dtype=np.int64)
    return Bins(np.zeros(1, dtype=np.int64), empty, empty.copy(), empty.copy())


# --- ordering and bookkeeping ---------------------------------------------------------------------

def _decreasing_order(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """Indices by length descending, ties by index ascending: [6, 5, 6, 2] -> [0, 2, 1, 3]."""
    # Lengths are bounded by capacity, so a counting sort is O(n + C) and beats a comparison sort
    # unless the capacity dwarfs the number of items.
    if capacity <= 4 * len(lengths) + 1024:
        return _counting_sort_descending(lengths, capacity)
    return np.argsort(-lengths, kind="stable").astype(np.int64)


@njit(cache=True)
def _counting_sort_descending(lengths, capacity):
    count_of_length = np.zeros(capacity + 1, np.int64)
    for i in range(lengths.size):
        count_of_length[lengths[i]] += 1
    next_slot = np.empty(capacity + 1, np.int64)
    slots_used = 0
    for length in range(capacity, -1, -1):
        next_slot[length] = slots_used
        slots_used += count_of_length[length]
    order = np.empty(lengths.size, np.int64)
    for i in range(lengths.size):  # ascending i keeps equal lengths in index order
        order[next_slot[lengths[i]]] = i
        next_slot[lengths[i]] += 1
    return order


def _first_fit_bin_bound(lengths: np.ndarray, capacity: int, max_seqs_per_bin: int | None) -> int:
    """Most bins first fit can open, to size its segment tree.

    Of the bins that never reach max_seqs_per_bin, any two hold more than `capacity` together (the
    later one's first item did not fit the earlier one), so at most one is half empty and there are
    at most 2*sum/C + 1 of them. Bins at the sequence limit number at most n // max_seqs_per_bin.
    """
    n = len(lengths)
    bound = 2 * math.ceil(int(lengths.sum()) / capacity) + 2
    if max_seqs_per_bin is not None:
        bound += n // max_seqs_per_bin
    return max(1, min(n, bound))


@njit(cache=True)
def _group_steps_by_bin(bin_of_step, num_bins):
    """Bin offsets, and the steps reordered bin by bin (stable, so insertion order is kept)."""
    offsets = np.zeros(num_bins + 1, np.int64)
    for step in range(bin_of_step.size):
        offsets[bin_of_step[step] + 1] += 1
    for b in range(num_bins):
        offsets[b + 1] += offsets[b]
    next_slot = offsets[:-1].copy()
    steps_by_bin = np.empty(bin_of_step.size, np.int64)
    for step in range(bin_of_step.size):
        b = bin_of_step[step]
        steps_by_bin[next_slot[b]] = step
        next_slot[b] += 1
    return offsets, steps_by_bin


def _whole_items_into_bins(lengths, step_item, bin_of_step, num_bins) -> Bins:
    """Bins from a placement log: at step k, item step_item[k] went into bin bin_of_step[k]."""
    offsets, steps_by_bin = _group_steps_by_bin(bin_of_step, num_bins)
    members = step_item[steps_by_bin]
    return Bins(offsets, members, np.zeros(len(members), dtype=np.int64), lengths[members])


# --- concat ---------------------------------------------------------------------------------------

def _concat(lengths: np.ndarray, capacity: int, max_seqs: int) -> Bins:
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


# --- dynamic batching (--mode batch) --------------------------------------------------------------

def batch_lengths(lengths, max_tokens: int, *, max_seqs_per_bin: int | None = None,
                  buckets: np.ndarray | None = None) -> Bins:
    """Padded micro-batches: items longest first (ties: lower index first), each micro-batch grown
    while rows x its padded length stays within `max_tokens`.

    Without `buckets` the padded length is the longest item (the first); with `buckets` (sorted
    allowed lengths, the largest >= every item) it is the smallest bucket that holds the first
    item, and a micro-batch only takes items of the same bucket (one shape per bucket).

        >>> bins = batch_lengths([3, 8, 5, 4, 2], 12)
        >>> bins.offsets.tolist(), bins.members.tolist()
        ([0, 1, 3, 5], [1, 2, 3, 0, 4])

    i.e. [8] (1 x 8), [5 4] (2 x 5 = 10), [3 2] (2 x 3 = 6): a third row of 5 would need 15 > 12.
    """
    max_tokens = _positive_int(max_tokens, "max_tokens")
    lengths = _validated_lengths(lengths, max_tokens, allow_longer=False)
    n = len(lengths)
    if n == 0:
        return _empty_bins()
    max_seqs = max_seqs_per_bin if max_seqs_per_bin is not None else n + 1
    order = np.argsort(-lengths, kind="stable").astype(np.int64)
    sizes = lengths[order]
    if buckets is None:
        shape = sizes
    else:
        buckets = np.asarray(buckets, dtype=np.int64)
        shape = buckets[np.searchsorted(buckets, sizes, side="left")]
    starts = _batch_kernel(shape, max_tokens, max_seqs, buckets is not None)
    offsets = np.append(starts, n).astype(np.int64)
    return Bins(offsets, order, np.zeros(n, dtype=np.int64), lengths[order])


@njit(cache=True)
def _batch_kernel(shape, max_tokens, max_seqs, one_shape):
    # shape[i]: what item i would pad a micro-batch it opens to; items arrive longest first
    n = shape.size
    starts = np.empty(n, np.int64)
    num = 0
    rows_left = 0
    current = -1
    for i in range(n):
        if rows_left == 0 or (one_shape and shape[i] != current):
            starts[num] = i
            num += 1
            current = shape[i]
            rows_left = min(max_tokens // current, max_seqs)
        rows_left -= 1
    return starts[:num].copy()


def choose_buckets(values, counts, k: int) -> np.ndarray:
    """At most `k` lengths (the largest value among them) that minimize the padding
    sum(counts * (bucket(value) - value)), bucket(v) = the smallest chosen length >= v. Exact
    dynamic program over the distinct values, O(k u^2) for u distinct values.

        >>> choose_buckets([100, 110, 500, 510, 1000], [1, 1, 1, 1, 1], 3).tolist()
        [110, 510, 1000]
    """
    values = np.asarray(values, dtype=np.int64)
    counts = np.asarray(counts, dtype=np.float64)
    keep = counts > 0
    values, counts = values[keep], counts[keep]
    if len(values) == 0:
        return np.zeros(0, np.int64)
    order = np.argsort(values, kind="stable")
    values, counts = values[order], counts[order]
    distinct, inverse = np.unique(values, return_inverse=True)
    weight = np.bincount(inverse, weights=counts)
    if len(distinct) <= k:
        return distinct
    chosen = _bucket_dp(distinct.astype(np.float64), weight, k)
    return distinct[chosen]


@njit(cache=True)
def _bucket_dp(v, c, k):
    u = v.size
    cw = np.zeros(u + 1)
    cs = np.zeros(u + 1)
    for i in range(u):
        cw[i + 1] = cw[i] + c[i]
        cs[i + 1] = cs[i] + c[i] * v[i]
    inf = 1e300
    # best[m, j]: least padding of values 0..j with m+1 buckets, the last one at v[j]
    best = np.full((k, u), inf)
    back = np.full((k, u), -1, np.int64)
    for j in range(u):
        best[0, j] = v[j] * cw[j + 1] - cs[j + 1]
    for m in range(1, k):
        for j in range(m, u):
            for i in range(m - 1, j):
                cost = best[m - 1, i] + v[j] * (cw[j + 1] - cw[i + 1]) - (cs[j + 1] - cs[i + 1])
                if cost < best[m, j]:
                    best[m, j] = cost
                    back[m, j] = i
    m = 0
    for mm in range(k):
        if best[mm, u - 1] < best[m, u - 1]:
            m = mm
    out = np.empty(m + 1, np.int64)
    j = u - 1
    for t in range(m, -1, -1):
        out[t] = j
        j = back[t, j]
    return out


# --- pool ----------------------------------------------------------------------------------------

@njit(cache=True)
def _pool_kernel(lengths, capacity, max_seqs, pool_size, closest):
    """Placement log of `pool`: the pool holds item indices in input order (oldest first)."""
    n = lengths.size
    step_item = np.empty(n, np.int64)
    bin_of_step = np.empty(n, np.int64)
    pool = np.empty(min(pool_size, n), np.int64)  # never more waiting than there are items
    held = 0
    next_item = 0
    step = 0
    num_bins = 0
    while True:
        while held < pool_size and next_item < n:
            pool[held] = next_item
            held += 1
            next_item += 1
        if held == 0:
            break
        pick = 0  # a bin opens with the oldest item
        room = capacity
        count = 0
        while True:
            item = pool[pick]
            step_item[step] = item
            bin_of_step[step] = num_bins
            step += 1
            room -= lengths[item]
            count += 1
            for j in range(pick, held - 1):
                pool[j] = pool[j + 1]
            held -= 1
            while held < pool_size and next_item < n:
                pool[held] = next_item
                held += 1
                next_item += 1
            if count == max_seqs:
                break
            pick = -1
            best = 0
            for j in range(held):
                size = lengths[pool[j]]
                if size <= room and size > best:
                    pick = j
                    best = size
                    if not closest or size == room:
                        break
            if pick < 0:
                break
        num_bins += 1
    return step_item, bin_of_step, num_bins


# --- first fit (ffd, ffs) -------------------------------------------------------------------------

@njit(cache=True)
def _first_fit_kernel(sizes, capacity, max_seqs, max_bins, first_bin):
    """First fit of items with `sizes`, in that order; returns the bin of each step and the number
    of bins.

    A max segment tree over the room left in bins 0..max_bins-1 finds the lowest-indexed bin with
    room >= length by one root-to-leaf descent. Unopened bins have room `capacity` and sit to the
    right of every opened one, so "open a new bin" is simply what the descent finds when no opened
    bin fits. A bin at max_seqs gets room 0 (lengths are >= 1), which takes it out of the search.
    Bins are numbered from `first_bin`.
    """
    leaves = 1
    while leaves < max_bins:
        leaves *= 2
    room = np.zeros(2 * leaves, np.int64)
    room[leaves: leaves + max_bins] = capacity
    for node in range(leaves - 1, 0, -1):
        room[node] = max(room[2 * node], room[2 * node + 1])
    count = np.zeros(max_bins, np.int64)
    bin_of_step = np.empty(sizes.size, np.int64)
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
    return bin_of_step, num_bins


# --- best fit (bfd) -------------------------------------------------------------------------------

@njit(cache=True)
def _mark_room(present, leaves, room):
    node = leaves + room
    while node >= 1 and present[node] == 0:
        present[node] = 1
        node //= 2


@njit(cache=True)
def _unmark_room(present, leaves, room):
    node = leaves + room
    present[node] = 0
    node //= 2
    while node >= 1:
        if present[2 * node] | present[2 * node + 1]:
            break
        present[node] = 0
        node //= 2


@njit(cache=True)
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
def _best_fit_kernel(sizes, capacity, max_seqs):
    """Best fit of items with `sizes`, in that order; returns the bin of each step and the number
    of bins.

    Open bins are filed by the room they have left: a FIFO queue of bins per room value
    (`queue_head`/`queue_tail` per room, `queue_next` per bin), and a presence tree over room values
    0..capacity whose query gives the smallest non-empty room >= length in O(log C). Ties between
    bins with the same room go to the head of the queue: the bin that has had that room the longest.
    Full bins (room 0) and bins at max_seqs are never filed, so they are never offered again.
    """
    n = sizes.size
    leaves = 1
    while leaves < capacity + 1:
        leaves *= 2
    present = np.zeros(2 * leaves, np.uint8)
    queue_head = np.full(capacity + 1, -1, np.int64)
    queue_tail = np.full(capacity + 1, -1, np.int64)
    queue_next = np.empty(n, np.int64)
    count = np.zeros(n, np.int64)
    bin_of_step = np.empty(n, np.int64)
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
    return bin_of_step, num_bins


# --- modified first fit decreasing (mffd) ---------------------------------------------------------

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
def _mffd_kernel(sizes, order, capacity, max_seqs, max_ffd_bins):
    """Johnson & Garey's modified first fit decreasing; returns the placement log (item and bin of
    each step) and the number of bins.

    Size classes: large (> C/2), medium (C/3, C/2], small (C/6, C/3], tiny (<= C/6). Phases:
      1. each large item opens a bin, largest first (the "large bins");
      2. forward through the large bins: each takes the largest remaining medium item that fits;
      3. backward through the large bins that got no medium item: where the two smallest remaining
         small items fit together, the bin takes the smallest one and then the largest remaining
         small item that fits beside it;
      4. forward through the large bins: each keeps taking the largest remaining item that fits
         until none does;
      5. first fit decreasing packs what is left into new bins.
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

    # Phase 5: first fit decreasing for what is left, in new bins.
    leftover = np.empty(n - steps, np.int64)
    leftover_sizes = np.empty(n - steps, np.int64)
    position = _next_alive(next_alive, 0)
    for k in range(leftover.size):
        leftover[k] = order[position]
        leftover_sizes[k] = sizes[position]
        position = _next_alive(next_alive, position + 1)
    num_bins = end_large
    if leftover.size > 0:
        ffd_bins, ffd_count = _first_fit_kernel(leftover_sizes, capacity, max_seqs, max_ffd_bins, end_large)
        step_item[steps:] = leftover
        bin_of_step[steps:] = ffd_bins
        num_bins += ffd_count
    return step_item, bin_of_step, num_bins


# --- split ----------------------------------------------------------------------------------------

def _split(lengths: np.ndarray, capacity: int, align: int, max_seqs: int) -> Bins:
    if len(lengths) == 0:
        return _empty_bins()
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
