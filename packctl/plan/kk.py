"""Karmarkar-Karp largest differencing, compiled: `kk_parts` gives the parts of
`plan/balance.py` `kk_partition`, item for item, in O(n log n + n k log k).

`kk_partition` (the balancer of `pack --dp-size`, over a step's packs) keeps each k-tuple's members
as Python lists and copies them at every merge: fine for hundreds of packs, 2 s for 100,000
sequences. Here a tuple's parts are linked lists of items (a merge joins two lists in O(1)) and the
tuples wait in a binary heap of arrays, with the same keys (largest spread first, ties: the tuple
made first), the same pairing (the largest part of one with the smallest of the other, ties: the
lower part) and the same float sums, so both return the same parts (tests/unit/plan/test_kk.py):

    >>> kk_parts([8, 7, 6, 5, 4], 2).tolist()
    [1, 0, 1, 0, 0]
"""
from __future__ import annotations

import numpy as np

from packctl.jit import njit


def kk_parts(costs, k: int, *, equal_counts: bool = False) -> np.ndarray:
    """The part (0..k-1) of each item: `kk_partition(costs, k, equal_counts=...)`, compiled."""
    costs = np.ascontiguousarray(costs, dtype=np.float64)
    if k < 1:
        raise ValueError("k must be >= 1")
    if len(costs) == 0 or k == 1:
        return np.zeros(len(costs), np.int64)
    order = np.argsort(-costs, kind="stable").astype(np.int64)
    return _kk(costs, order, int(k), bool(equal_counts))


@njit(cache=True)
def _before(key_a, id_a, key_b, id_b):
    return key_a < key_b or (key_a == key_b and id_a < id_b)

@njit(cache=True)
def _push(heap_key, heap_id, size, key, tid):
    i = size
    heap_key[i] = key
    heap_id[i] = tid
    while i > 0:
        parent = (i - 1) // 2
        if _before(heap_key[i], heap_id[i], heap_key[parent], heap_id[parent]):
            heap_key[i], heap_key[parent] = heap_key[parent], heap_key[i]
            heap_id[i], heap_id[parent] = heap_id[parent], heap_id[i]
            i = parent
        else:
            break
    return size + 1

@njit(cache=True)
def _pop(heap_key, heap_id, size):
    """The id of the first tuple (the largest spread, ties: the tuple made first), and the heap's
    new size."""
    top = heap_id[0]
    size -= 1
    heap_key[0] = heap_key[size]
    heap_id[0] = heap_id[size]
    i = 0
    while True:
        left = 2 * i + 1
        best = i
        if left < size and _before(heap_key[left], heap_id[left], heap_key[best], heap_id[best]):
            best = left
        if left + 1 < size and _before(heap_key[left + 1], heap_id[left + 1], heap_key[best], heap_id[best]):
            best = left + 1
        if best == i:
            break
        heap_key[i], heap_key[best] = heap_key[best], heap_key[i]
        heap_id[i], heap_id[best] = heap_id[best], heap_id[i]
        i = best
    return top, size


@njit(cache=True)
def _spread(sums, t, k):
    low = sums[t, 0]
    high = sums[t, 0]
    for j in range(1, k):
        low = min(low, sums[t, j])
        high = max(high, sums[t, j])
    return high - low


@njit(cache=True)
def _order_parts(sums, t, sign, out):
    """Parts of tuple t by increasing sign * sum, ties: the lower part first (an insertion sort:
    k is the number of ranks)."""
    for j in range(len(out)):
        key = sign * sums[t, j]
        i = j
        while i > 0 and sign * sums[t, out[i - 1]] > key:
            out[i] = out[i - 1]
            i -= 1
        out[i] = j


@njit(cache=True)
def _kk(costs, order, k, equal_counts):
    n = len(costs)
    slots = n  # at most n tuples at once: a merge frees two slots and takes one of them
    sums = np.zeros((slots, k), np.float64)
    head = np.full((slots, k), -1, np.int64)  # first item of each part, -1: empty
    tail = np.empty((slots, k), np.int64)  # its last item (where head is not -1)
    following = np.full(n, -1, np.int64)  # the next item in its part's list
    heap_key = np.empty(slots, np.float64)
    heap_id = np.empty(slots, np.int64)  # the tuples waiting, by the order they were made
    slot_of = np.empty(2 * n, np.int64)  # where tuple t is kept
    size = 0
    created = 0
    if equal_counts:
        for lo in range(0, n, k):
            for j in range(min(k, n - lo)):
                item = order[lo + j]
                sums[created, j] = costs[item]
                head[created, j] = item
                tail[created, j] = item
            slot_of[created] = created
            size = _push(heap_key, heap_id, size, -_spread(sums, created, k), created)
            created += 1
    else:
        for g in range(n):
            item = order[g]
            sums[g, 0] = costs[item]
            head[g, 0] = item
            tail[g, 0] = item
            slot_of[g] = g
            size = _push(heap_key, heap_id, size, -costs[item], g)
        created = n
    desc = np.empty(k, np.int64)
    asc = np.empty(k, np.int64)
    merged_sums = np.empty(k, np.float64)
    merged_head = np.empty(k, np.int64)
    merged_tail = np.empty(k, np.int64)
    while size > 1:
        made, size = _pop(heap_key, heap_id, size)
        a = slot_of[made]
        made, size = _pop(heap_key, heap_id, size)
        b = slot_of[made]
        # a's parts largest first, b's smallest first (ties: the lower part first)
        _order_parts(sums, a, -1.0, desc)
        _order_parts(sums, b, 1.0, asc)
        for j in range(k):
            i, m = desc[j], asc[j]
            merged_sums[j] = sums[a, i] + sums[b, m]
            if head[a, i] < 0:
                merged_head[j], merged_tail[j] = head[b, m], tail[b, m]
            elif head[b, m] < 0:
                merged_head[j], merged_tail[j] = head[a, i], tail[a, i]
            else:
                following[tail[a, i]] = head[b, m]
                merged_head[j], merged_tail[j] = head[a, i], tail[b, m]
        for j in range(k):  # the merged tuple takes a's slot
            sums[a, j], head[a, j], tail[a, j] = merged_sums[j], merged_head[j], merged_tail[j]
        slot_of[created] = a
        size = _push(heap_key, heap_id, size, -_spread(sums, a, k), created)
        created += 1
    parts = np.zeros(n, np.int64)
    last = slot_of[heap_id[0]]
    for j in range(k):
        item = head[last, j]
        while item >= 0:
            parts[item] = j
            item = following[item]
    return parts
