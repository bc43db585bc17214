"""pool: near input order. The next `pool_size` items wait in a pool; a bin opens with the oldest,
then takes pool items while one fits: the largest that fits ("closest", best fit) or the oldest
that fits ("first"); the pool refills in input order. Capacity 10, pool_size 3:

    lengths [6, 3, 4, 2, 5]
    closest -> [6 4] [3 5 2]      the 6 opens a bin; of the waiting 3 4 2, the largest that fits is 4
    first   -> [6 3] [4 2] [5]    the oldest that fits beside the 6 is the 3

Every bin opens with the oldest waiting item, so an item is placed at the latest in the
`pool_size`-th bin opened after it entered the pool: order moves little. pool_size 1 is concat.
One numba loop, O(n * pool_size).
"""
from __future__ import annotations

import numpy as np

from packctl.jit import njit
from packctl.plan.bins import Bins, KernelOptions, positive_int, whole_items_into_bins

POOL_STRATEGIES: tuple[str, ...] = ("closest", "first")


def pack_pool(lengths: np.ndarray, capacity: int, max_seqs: int, options: KernelOptions) -> Bins:
    """Pack from a pool of `options.pool_size` waiting items, picked by `options.pool_strategy`:
    `pack_pool_limits` with no budget besides tokens (its cost loops run zero times; as fast as a
    kernel of tokens alone, benchmarks/bench_limits_kernels.py)."""
    return pack_pool_limits(lengths, np.zeros((len(lengths), 0), np.int64), np.zeros(0, np.int64), capacity,
                            max_seqs, options)


def pack_pool_limits(lengths: np.ndarray, extra: np.ndarray, limits: np.ndarray, capacity: int, max_seqs: int,
                     options: KernelOptions) -> Bins:
    """pool under every budget: a bin opens with the oldest waiting item, then takes pool items
    that fit its tokens and every cost: the largest in tokens ("closest"; ties: the oldest) or the
    oldest ("first"). O(n * pool_size * k)."""
    pool_strategy = options.pool_strategy
    if pool_strategy not in POOL_STRATEGIES:
        raise ValueError(f"unknown pool strategy {pool_strategy!r}: choose one of {', '.join(POOL_STRATEGIES)}")
    step_item, bin_of_step, num_bins = _pool_limits_kernel(lengths, extra, limits, capacity, max_seqs,
                                                           positive_int(options.pool_size, "pool_size"),
                                                           pool_strategy == "closest")
    return whole_items_into_bins(lengths, step_item, bin_of_step, num_bins)


@njit(cache=True)
def _pool_limits_kernel(lengths, extra, limits, capacity, max_seqs, pool_size, closest):
    """Placement log of `pool`: the pool holds item indices in input order (oldest first); the open
    bin's room is kept in tokens and in every cost column (k = 0: tokens alone)."""
    n = lengths.size
    k = limits.size
    step_item = np.empty(n, np.int64)
    bin_of_step = np.empty(n, np.int64)
    pool = np.empty(min(pool_size, n), np.int64)  # never more waiting than there are items
    cost_room = np.empty(k, np.int64)
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
        for j in range(k):
            cost_room[j] = limits[j]
        count = 0
        while True:
            item = pool[pick]
            step_item[step] = item
            bin_of_step[step] = num_bins
            step += 1
            room -= lengths[item]
            for j in range(k):
                cost_room[j] -= extra[item, j]
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
            for i in range(held):
                size = lengths[pool[i]]
                if size <= room and size > best:
                    fits = True
                    for j in range(k):
                        fits = fits and extra[pool[i], j] <= cost_room[j]
                    if fits:
                        pick = i
                        best = size
                        if not closest or size == room:
                            break
            if pick < 0:
                break
        num_bins += 1
    return step_item, bin_of_step, num_bins
