"""Bins, the result of every packing algorithm, and what the kernel files share.

Every algorithm's runner (`pack_<name>` in its family file, listed in `algorithms.KERNELS`) takes
lengths already checked by `validated_lengths` and returns `Bins`, CSR over pieces. Most kernels
log one placement per step (item, bin) and leave the CSR to `whole_items_into_bins`:

    lengths      [6, 5, 4, 3, 2]     capacity 10, ffd
    step_item    [0, 1, 2, 3, 4]     the decreasing order
    bin_of_step  [0, 1, 0, 1, 1]     6 -> bin 0, 5 -> bin 1, 4 -> bin 0, ...
    -> offsets [0, 2, 5], members [0, 2, 1, 3, 4]: bins [6 4] and [5 3 2]
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import numpy as np

from packctl.jit import njit


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

    def extra_loads(self, extra: np.ndarray) -> np.ndarray:
        """Each bin's sum of each cost column (int64, B x k) for the items' costs `extra` (n x k):
        a piece counts its item's cost (only items of no cost are ever cut, so once per item).
        Members [0, 2 | 1], extra [[1], [4], [2]] -> [[3], [4]]."""
        extra = np.asarray(extra, dtype=np.int64)
        per_piece = extra[self.members]
        cumulative = np.concatenate((np.zeros((1, extra.shape[1]), np.int64), np.cumsum(per_piece, axis=0)))
        return cumulative[self.offsets[1:]] - cumulative[self.offsets[:-1]]


@dataclass(frozen=True)
class KernelOptions:
    """The options of `pack_lengths` that only some algorithms read, passed to every runner."""

    seed: int  # the shuffle of ffs
    align: int  # >= 1, cut granularity of split
    pool_size: int  # pool: items waiting (checked by the pool runner)
    pool_strategy: str  # pool: "closest" or "first" (checked by the pool runner)


# --- validation -----------------------------------------------------------------------------------

def positive_int(value, name: str) -> int:
    """`value` as an int, or ValueError naming `name`: positive_int(4.0, "capacity") raises."""
    try:
        value = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}") from None
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def validated_lengths(lengths, capacity: int, *, allow_longer: bool) -> np.ndarray:
    """The lengths as a contiguous int64 array, checked: 1-D integers, each >= 1 and, unless
    `allow_longer`, <= capacity. [4, 0, 2] raises naming lengths[1]; [] gives an empty array."""
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


class OverLimit(ValueError):
    """An item costs more than a limit on its own (`validated_extra`): no bin can take it.

    `item` is its index, `column` the cost column (0..k-1), `count` how many items are over a limit.
    The pipeline drops such sequences under --too-long drop (and counts them) and refuses the
    others, naming the sample and the column."""

    def __init__(self, item: int, column: int, cost: int, limit: int, count: int):
        self.item, self.column, self.cost, self.limit, self.count = item, column, cost, limit, count
        super().__init__(f"extra[{item}, {column}] = {cost} exceeds limit {limit} of cost column {column} "
                         f"({count} item(s) over a limit): raise the limit or leave these items out")


def validated_extra(extra, limits, n: int) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The per-item costs (int64, C-contiguous, n x k) and their limits (int64, k), checked, or
    (None, None) when there is no budget besides tokens (both None, or k = 0).

    Every cost and limit is an integer >= 0; an item over a limit on its own raises `OverLimit`
    naming the first one (the lowest index, then the lowest column):

        validated_extra([[1], [0]], [1], 2)   -> (array([[1], [0]]), array([1]))
        validated_extra([[2], [0]], [1], 2)   -> OverLimit: extra[0, 0] = 2 exceeds limit 1 ...
    """
    if extra is None and limits is None:
        return None, None
    if extra is None or limits is None:
        raise ValueError("extra and limits go together: pass both (n x k costs and k limits) or neither")
    limits = np.asarray(limits)
    extra = np.asarray(extra)
    if limits.ndim != 1:
        raise ValueError(f"limits must be a 1-D array, got shape {limits.shape}")
    if extra.ndim != 2 or extra.shape != (n, limits.size):
        raise ValueError(f"extra must be an array of shape (n items, k limits) = ({n}, {limits.size}), "
                         f"got shape {extra.shape}")
    if limits.size == 0:
        return None, None
    for name, array in (("extra", extra), ("limits", limits)):
        if array.size and array.dtype.kind not in "iu":
            raise ValueError(f"{name} must be integers, got dtype {array.dtype}")
        if array.size and array.min() < 0:
            raise ValueError(f"{name} must be >= 0, got {array.min()}")
    extra = np.ascontiguousarray(extra, dtype=np.int64)
    limits = np.ascontiguousarray(limits, dtype=np.int64)
    over = extra > limits
    if over.any():
        item, column = (int(i) for i in np.argwhere(over)[0])
        raise OverLimit(item, column, int(extra[item, column]), int(limits[column]), int(over.any(axis=1).sum()))
    return extra, limits


def over_limits(extra, limits) -> np.ndarray:
    """True for each item that costs more than a limit on its own (no bin can take it):
    over_limits([[3, 0], [1, 9]], [2, 8]) -> [True, True]; k = 0 -> all False."""
    extra = np.asarray(extra, dtype=np.int64)
    if extra.ndim != 2:
        raise ValueError(f"extra must be an array of shape (n items, k limits), got shape {extra.shape}")
    if extra.shape[1] == 0:
        return np.zeros(extra.shape[0], dtype=bool)
    return (extra > np.asarray(limits, dtype=np.int64)).any(axis=1)


def empty_bins() -> Bins:
    """No bins: offsets [0], no pieces."""
    empty = np.zeros(0, dtype=np.int64)
    return Bins(np.zeros(1, dtype=np.int64), empty, empty.copy(), empty.copy())


# --- placement log -> Bins ------------------------------------------------------------------------

@njit(cache=True)
def _group_steps_by_bin(bin_of_step, num_bins, offsets, next_slot, steps_by_bin):
    """Bin `offsets` (zeroed, num_bins + 1), and the steps reordered bin by bin into
    `steps_by_bin` (stable, so insertion order is kept). The caller allocates (packctl/plan/fit.py)."""
    for step in range(bin_of_step.size):
        offsets[bin_of_step[step] + 1] += 1
    for b in range(num_bins):
        offsets[b + 1] += offsets[b]
    for b in range(num_bins):  # an element loop: a slice assignment compiles numba's shape checks (1.7 s)
        next_slot[b] = offsets[b]
    for step in range(bin_of_step.size):
        b = bin_of_step[step]
        steps_by_bin[next_slot[b]] = step
        next_slot[b] += 1


def whole_items_into_bins(lengths, step_item, bin_of_step, num_bins) -> Bins:
    """Bins from a placement log: at step k, item step_item[k] went into bin bin_of_step[k]."""
    offsets = np.zeros(num_bins + 1, np.int64)
    steps_by_bin = np.empty(bin_of_step.size, np.int64)
    _group_steps_by_bin(bin_of_step, num_bins, offsets, np.empty(num_bins, np.int64), steps_by_bin)
    members = step_item[steps_by_bin]
    return Bins(offsets, members, np.zeros(len(members), dtype=np.int64), lengths[members])
