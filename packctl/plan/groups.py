"""Groups of sequences packed whole (`--group-column`): arrays only, no I/O.

A group is a run of consecutive gids (`group_starts`, read by packctl.source.groups); its id is the gid
of its first row. In any order packctl makes, a group's members follow each other in gid order,
so a group is a run of the ordered sequences, marked by `starts` (True on each group's first member):

    group_starts [0, 2, 4, 5]   ordered gids [4, 2, 3, 0, 1]
    group_ids    -> [4, 2, 2, 0, 0]
    run_starts   -> [True, True, False, True, False]

The planner packs each run as one item of the summed padded length of its members
(`expand_items` turns the bins of items back into bins of sequences).
"""
from __future__ import annotations

import numpy as np

from packctl.arrays import ranges
from packctl.plan.algorithms import Bins


class GroupTooLong(ValueError):
    """A group of two or more sequences does not fit the capacity."""

    def __init__(self, gid: int, members: int, padded: int, capacity: int):
        self.gid, self.members, self.padded, self.capacity = gid, members, padded, capacity
        super().__init__(f"group at sequence {gid} of {members} sequences ({padded} tokens padded) exceeds "
                         f"capacity {capacity}")


class GroupOverLimit(ValueError):
    """A group of two or more sequences over a limit: its sum of a limited column with
    --group-scope pack (it shares one pack), one member's value with step."""

    def __init__(self, gid: int, members: int, column: int, cost: int, limit: int, whole: bool):
        self.gid, self.members, self.column, self.cost, self.limit = gid, members, column, cost, limit
        what = "together cost" if whole else "hold a member that costs"
        super().__init__(f"group at sequence {gid} of {members} sequences {what} {cost} in limited column {column}, "
                         f"over its limit {limit}")


def group_ids(gids: np.ndarray, group_starts: np.ndarray) -> np.ndarray:
    """The group id (gid of the group's first row) of each gid."""
    gids = np.asarray(gids, dtype=np.int64)
    return group_starts[np.searchsorted(group_starts, gids, side="right") - 1]


def group_sizes(gids: np.ndarray, group_starts: np.ndarray) -> np.ndarray:
    """Rows in the group of each gid (before --skip-empty leaves empty rows out)."""
    at = np.searchsorted(group_starts, np.asarray(gids, dtype=np.int64), side="right") - 1
    return np.diff(group_starts)[at]


def run_starts(ids: np.ndarray, previous: int | None = None) -> np.ndarray:
    """True where a group id differs from the one before (`previous`: the id before ids[0])."""
    ids = np.asarray(ids, dtype=np.int64)
    starts = np.ones(len(ids), dtype=bool)
    starts[1:] = ids[1:] != ids[:-1]
    if len(ids) and previous is not None:
        starts[0] = ids[0] != previous
    return starts


def run_totals(values: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Each run's sum of `values`, repeated on every member: values [1, 2, 3], starts
    [T, F, T] -> [3, 3, 3]."""
    values = np.asarray(values, dtype=np.int64)
    if len(values) == 0:
        return values.copy()
    first = np.flatnonzero(starts)
    return np.repeat(np.add.reduceat(values, first), np.diff(np.append(first, len(values))))


def check_groups_fit(gids: np.ndarray, padded: np.ndarray, starts: np.ndarray, capacity: int) -> None:
    """Raise GroupTooLong for the over-capacity group of two or more members with the smallest
    first gid (a group of one follows --too-long like any sequence)."""
    if len(gids) == 0:
        return
    first = np.flatnonzero(starts)
    sizes = np.diff(np.append(first, len(gids)))
    totals = np.add.reduceat(np.asarray(padded, dtype=np.int64), first)
    over = np.flatnonzero((sizes > 1) & (totals > capacity))
    if len(over):
        k = over[np.argmin(gids[first[over]])]
        raise GroupTooLong(int(gids[first[k]]), int(sizes[k]), int(totals[k]), capacity)


def check_groups_within_limits(gids: np.ndarray, extra: np.ndarray, starts: np.ndarray, limits: np.ndarray, *,
                               whole: bool) -> None:
    """Raise GroupOverLimit for the group of two or more members with the smallest first gid that
    is over a limit: its sum (`whole`: the group shares a pack) or one member (a group of one
    follows --too-long like any sequence).

        extra [[2], [3], [1]], starts [T, F, T], limits [4]: whole -> the group at gids[0] (5 > 4)
    """
    if len(gids) == 0:
        return
    first = np.flatnonzero(starts)
    sizes = np.diff(np.append(first, len(gids)))
    costs = np.add.reduceat(extra, first, axis=0) if whole else np.maximum.reduceat(extra, first, axis=0)
    over = np.flatnonzero((sizes > 1) & (costs > limits).any(axis=1))
    if len(over):
        k = over[np.argmin(gids[first[over]])]
        j = int(np.argmax(costs[k] > limits))
        raise GroupOverLimit(int(gids[first[k]]), int(sizes[k]), j, int(costs[k, j]), int(limits[j]), whole)


def expand_items(bins: Bins, item_first: np.ndarray, item_size: np.ndarray, member_padded: np.ndarray) -> Bins:
    """Bins of items (whole groups) -> bins of their members, in order, each at its padded length.

        items [g0: members 0 1] [g1: member 2]   bins [g1] [g0]  ->  [2] [0 1]
    """
    counts = np.bincount(np.repeat(np.arange(bins.num_bins), np.diff(bins.offsets)),
                         weights=item_size[bins.members], minlength=bins.num_bins).astype(np.int64)
    members = ranges(item_first[bins.members], item_size[bins.members])
    return Bins(offsets=np.concatenate([[0], np.cumsum(counts)]).astype(np.int64), members=members,
                starts=np.zeros(len(members), np.int64), lens=member_padded[members].astype(np.int64))
