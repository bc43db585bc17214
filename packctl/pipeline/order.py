"""The order stage: sequences sorted into the global order of their epoch, cut into windows, and
whole windows handed to ranks; groups checked where they must fit.

Used by `pack` and by the what-if of `packctl stats` (`order_corpus`), through the same function,
so the what-if orders exactly as `pack` does:

    order_and_distribute   sample sort of (key, gid) over every rank, then whole windows to ranks
                           by cost (`window_owners`): rank r of R plans the windows whose middle
                           sequence lies in the r-th of R equal parts of the sequences
    check_too_long         --too-long error: the over-long sequence with the smallest gid, named
"""
from __future__ import annotations

import numpy as np

from packctl.errors import PackctlError
from packctl.mpi.comm import Comm, SingleComm
from packctl.mpi.samplesort import redistribute, sample_sort
from packctl.plan.align import round_up
from packctl.plan.bins import over_limits
from packctl.plan.groups import (GroupOverLimit, GroupTooLong, check_groups_fit, check_groups_within_limits,
                                 group_ids, group_sizes, run_starts, run_totals)
from packctl.plan.order import order_keys
from packctl.plan.prefix import stored_padded
from packctl.plan.windows import GroupTooBigForStep, SequenceOverLimit, UncuttableSequence, check_groups_fit_step
from packctl.pipeline.ordered import Ordered
from packctl.specs import GroupScope, GroupSpec, LengthSpec, Order, OrderSpec, TooLong, WindowOptions
from packctl.source.index import SequenceIndex


def too_long_message(where: str, length: int, padded: int, capacity: int) -> str:
    """The one error for a sequence over the capacity under --too-long error."""
    return (f"{where}: sequence of {length} tokens (padded to {padded}) is longer than the capacity {capacity}; "
            "pass --too-long drop|truncate|split or raise --capacity")


def check_too_long(comm: Comm, index: SequenceIndex, lengths: LengthSpec) -> None:
    """With --too-long error, name the over-long sequence with the smallest gid, on every rank."""
    if lengths.too_long != TooLong.ERROR:
        return
    over = round_up(index.lengths, lengths.align) > lengths.plan_capacity
    if index.group_starts is not None:  # a member of a larger group gets the group's error
        over &= group_sizes(index.gid_lo + np.arange(len(over)), index.group_starts) == 1
    over = np.flatnonzero(over)
    mine = (int(index.gid_lo + over[0]), int(index.lengths[over[0]])) if len(over) else None
    found = [f for f in comm.allgather(mine) if f is not None]
    if found:
        gid, length = min(found)
        raise PackctlError(too_long_message(index.describe(gid), length, int(round_up(length, lengths.align)),
                                            lengths.plan_capacity), everywhere=True)


def over_limit_message(where: str, column: str, cost: int, limit: int, count: int, too_long: str) -> str:
    """The one error for a sequence over a --limit on its own, under --too-long error, truncate or
    split (drop leaves it out and counts it)."""
    why = "" if too_long == "error" else f", and --too-long {too_long} cannot cut media"
    return (f"{where}: the sequence costs {cost}, more than --limit {column}={limit} lets a pack hold{why} "
            f"({count} sequence(s) over a limit); pass --too-long drop to leave them out (counted as over_limit) "
            "or raise the limit")


def uncuttable_message(where: str, length: int, capacity: int, column: str, cost: int, count: int,
                       too_long: str) -> str:
    """The one error for a sequence over the capacity that has media, under --too-long truncate or split."""
    return (f"{where}: sequence of {length} tokens is longer than the capacity {capacity} and costs {cost} "
            f"(--limit {column}): media cannot be cut, so --too-long {too_long} cannot place it ({count} such "
            "sequence(s)); pass --too-long drop or raise --capacity")


def limit_error(index, columns: tuple[str, ...], exc: SequenceOverLimit | UncuttableSequence) -> PackctlError:
    """The PackctlError of a planner's SequenceOverLimit or UncuttableSequence, naming the sample
    and the limited column (`columns`: the --limit columns in order)."""
    column = columns[exc.column] if exc.column < len(columns) else f"#{exc.column}"
    where = index.describe(exc.gid, column)
    if isinstance(exc, UncuttableSequence):
        return PackctlError(uncuttable_message(where, exc.length, exc.capacity, column, exc.cost, exc.count,
                                               str(exc.too_long)), everywhere=True)
    return PackctlError(over_limit_message(where, column, exc.cost, exc.limit, exc.count, str(exc.too_long)),
                        everywhere=True)


def check_limits(comm: Comm, index: SequenceIndex, lengths: LengthSpec, limits: dict[str, int]) -> None:
    """With --limit and --too-long other than drop: name, on every rank, the sequence with the
    smallest gid that cannot be placed: over a limit on its own, or (truncate, split) over the
    capacity with a cost (media cannot be cut); under error an over-long sequence before it is left
    to `check_too_long`. Members of a group of two or more get their group's error."""
    extra = index.extra
    if not limits or extra is None or lengths.too_long == TooLong.DROP:
        return
    bounds = np.asarray(list(limits.values()), dtype=np.int64)
    gids = index.gid_lo + np.arange(len(index.lengths), dtype=np.int64)
    over_capacity = round_up(index.lengths, lengths.align) > lengths.plan_capacity
    over_limit = over_limits(extra, bounds)
    cuttable = lengths.too_long in (TooLong.TRUNCATE, TooLong.SPLIT)
    uncuttable = over_capacity & (extra > 0).any(axis=1) if cuttable else np.zeros(len(gids), dtype=bool)
    if index.group_starts is not None:
        alone = group_sizes(gids, index.group_starts) == 1
        over_capacity, over_limit, uncuttable = over_capacity & alone, over_limit & alone, uncuttable & alone
    counts = comm.allreduce_sum(np.array([over_limit.sum(), uncuttable.sum()], dtype=np.int64))
    mine = []
    if over_limit.any():
        i = int(np.argmax(over_limit))
        j = int(np.argmax(extra[i] > bounds))
        mine.append((int(gids[i]), 0, j, int(extra[i, j]), 0))
    if uncuttable.any():
        i = int(np.argmax(uncuttable))
        j = int(np.argmax(extra[i] > 0))
        mine.append((int(gids[i]), 1, j, int(extra[i, j]), int(index.lengths[i])))
    if lengths.too_long == TooLong.ERROR and over_capacity.any():
        mine.append((int(gids[np.argmax(over_capacity)]), 2, 0, 0, 0))
    found = [f for part in comm.allgather(mine) for f in part]
    if not found:
        return
    gid, kind, j, cost, length = min(found)
    if kind == 2:
        return  # an over-long sequence comes first: check_too_long names it
    exc = (SequenceOverLimit(gid, j, cost, int(bounds[j]), int(counts[0]), str(lengths.too_long)) if kind == 0 else
           UncuttableSequence(gid, length, lengths.plan_capacity, j, cost, int(counts[1]), str(lengths.too_long)))
    raise limit_error(index, tuple(limits), exc)


def order_and_distribute(comm: Comm, index: SequenceIndex, spec: OrderSpec, groups: GroupSpec | None = None,
                         windows: WindowOptions | None = None, epoch: int = 0) -> Ordered:
    """This rank's whole windows of the global order (of epoch `epoch`, ordered with `spec.seed`).

    The order is a sample sort of (key, gid) over all ranks (input order needs none: blocks are
    already split in gid order); windows are then moved so each lives whole on one rank, dealt by
    their sequences so every rank plans an equal share (`window_owners`; writing is dealt out
    later by tokens, pipeline/assign.py). With `spec.epochs` E the sequences of every epoch count after
    those of the epochs before, so each rank's windows of all epochs are one run of the global
    order (epoch 0's packs, then epoch 1's, ...); `first_window` counts within the epoch. Where a
    window is planned never changes its plan: the output is the same for any number of ranks.

    With --group-column every member of a group gets the group's key (hash of its id, or its
    summed padded length), so ties broken by gid keep each group a run of the order, and windows
    count groups: a group never straddles a window, nor a rank; then every group is checked to fit
    where `groups` says it must (`windows` plans the steps of --group-scope step).
    """
    if spec.mixture is not None:  # a blend: the sources' uses, interleaved (pipeline/mixture.py)
        from packctl.pipeline.mixture import order_blend
        ordered = order_blend(comm, index, spec, epoch)
        if ordered.new_group is not None:  # each use of a group whole in one window: does it fit?
            check_groups_fit_everywhere(comm, ordered, index, groups, windows)
        elif windows is not None:
            from packctl.pipeline.mixture import check_uses_fit_step
            check_uses_fit_step(comm, ordered, index, windows)
        return ordered
    n_local = len(index.lengths)
    gids = index.gid_lo + np.arange(n_local, dtype=np.int64)
    lengths = index.lengths
    extra = getattr(index, "extra", None)  # --limit: the costs travel with their sequence
    shared = getattr(index, "shared", None)  # --share-prefix: so do the tokens their group shares
    total = index.num_sequences
    if spec.skip_empty:  # empty sequences take no place in the order (nor in window positions)
        kept = lengths > 0
        gids, lengths = gids[kept], lengths[kept]
        extra = None if extra is None else extra[kept]
        shared = None if shared is None else shared[kept]
        total = comm.allreduce_sum(len(gids))
    group_starts = index.group_starts
    if spec.order != Order.INPUT:
        gids, lengths, extra, shared = _sorted_by_key(comm, spec, group_starts, gids, lengths, extra, shared)
    starts = None
    if group_starts is not None:
        ids = group_ids(gids, group_starts)
        last = comm.allgather(int(ids[-1]) if len(ids) else None)
        starts = run_starts(ids, next((x for x in reversed(last[:comm.rank]) if x is not None), None))
        total = comm.allreduce_sum(int(starts.sum()))
    num_windows = -(-total // spec.window)
    first = 0
    if comm.size > 1:
        # the window of each sequence: by its position, or with groups by its group's
        counted = np.ones(len(gids), dtype=bool) if starts is None else starts
        unit = comm.exscan(int(counted.sum())) + np.cumsum(counted) - 1
        owners = window_owners(comm, unit // spec.window, counted & (unit % spec.window == 0), epoch, spec.epochs)
        columns = [gids, lengths] + ([starts.astype(np.int64)] if starts is not None else [])
        columns += [] if shared is None else [shared]
        costs = [] if extra is None else list(extra.T)
        moved = redistribute(comm, columns + costs, 0, lambda positions: owners[positions])
        gids, lengths = moved[0], moved[1]
        starts = moved[2].astype(bool) if starts is not None else None
        shared = None if shared is None else moved[len(columns) - 1]
        if extra is not None:
            extra = np.ascontiguousarray(np.stack(moved[len(columns):], axis=1), dtype=np.int64)
        # whole windows arrived: the units before this rank's are those of the windows before
        units_before = comm.exscan(len(gids) if starts is None else int(starts.sum()))
        first = -(-units_before // spec.window)
    ordered = Ordered(gids=gids, lengths=lengths, first_window=min(first, num_windows),
                      new_group=starts, group_starts=group_starts, extra=extra, shared=shared)
    if index.group_starts is not None:
        check_groups_fit_everywhere(comm, ordered, index, groups, windows)
    return ordered


def _sorted_by_key(comm: Comm, spec: OrderSpec, group_starts: np.ndarray | None, gids: np.ndarray,
                   lengths: np.ndarray, extra: np.ndarray | None,
                   shared: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """This rank's part of the global order by `spec.order`'s key: (gids, lengths, extra, shared),
    sample-sorted over all ranks with the --limit costs and --share-prefix lengths travelling with
    their sequence; with groups every member sorts by its group's key."""
    padded = round_up(lengths, spec.align)
    if group_starts is not None:
        ids = group_ids(gids, group_starts)
        if shared is not None:  # a shared group sorts by its stored length (its prefix on its first row)
            padded = stored_padded(lambda n: round_up(n, spec.align), lengths, shared, gids == ids)
        keys = order_keys(ids, group_totals(comm, ids, padded), spec.order, seed=spec.seed,
                          curriculum_order=spec.curriculum_order)
    else:
        keys = order_keys(gids, padded, spec.order, seed=spec.seed, curriculum_order=spec.curriculum_order)
    if extra is None and shared is None:
        _, gids, lengths = sample_sort(comm, keys, gids, payload=lengths)
    else:
        carried = [lengths] + ([] if shared is None else [shared]) + ([] if extra is None else list(extra.T))
        _, gids, moved = sample_sort(comm, keys, gids, payload=np.column_stack(carried))
        lengths = moved[:, 0].copy()
        if shared is not None:
            shared = moved[:, 1].copy()
        if extra is not None:
            extra = np.ascontiguousarray(moved[:, 1 + (shared is not None):])
    return gids, lengths, extra, shared


def window_owners(comm: Comm, window: np.ndarray, opens: np.ndarray, epoch: int, epochs: int) -> np.ndarray:
    """The planning rank of each of this rank's sequences (of the global order, cut into windows:
    `window[i]` the window of sequence i, `opens[i]` whether it is its window's first): whole
    windows, in order, dealt by cost, a window's sequences: rank r plans the windows whose middle
    sequence lies in the r-th of `comm.size` equal parts of all the sequences of every epoch
    (epoch e's sequences after those of epochs 0 .. e-1; every epoch packs the same number).

        windows of 4, 4, 2 sequences over 2 ranks: middles 2, 6, 9 of 10 -> ranks 0, 1, 1 (4 and 6;
        by count it would be windows 0, 1 on rank 0: 8 and 2)

    A window is never cut (its plan would change), so a rank plans at most its share plus one
    window: with fewer windows than ranks some plan nothing (a smaller --window evens it out).
    Needs each rank's first and last window start only: O(ranks) travels, never a table of windows."""
    n = len(window)
    position = comm.exscan(n) + np.arange(n, dtype=np.int64)  # in the order of this epoch
    total = comm.allreduce_sum(n)
    opened_w, opened_at = window[opens], position[opens]
    edges = comm.allgather((int(opened_w[0]), int(opened_at[0]), int(opened_w[-1]), int(opened_at[-1]))
                           if len(opened_w) else None)
    start = {w: at for edge in edges if edge is not None for w, at in ((edge[0], edge[1]), (edge[2], edge[3]))}
    start.update(zip(opened_w.tolist(), opened_at.tolist()))
    if n == 0:
        return np.zeros(0, np.int64)
    first, last = int(window[0]), int(window[-1])
    lo = np.array([start[w] for w in range(first, last + 1)], dtype=np.int64)
    hi = np.array([start.get(w + 1, total) for w in range(first, last + 1)], dtype=np.int64)
    middle2 = 2 * epoch * total + lo + hi  # twice the middle, on the axis of every epoch's sequences
    owner = np.minimum(middle2 * comm.size // (2 * epochs * max(total, 1)), comm.size - 1)
    return owner[window - first]


def group_too_long_message(where: str, members: int, padded: int, capacity: int) -> str:
    """The one error for a group over the capacity, whatever --too-long says."""
    return (f"{where}: the group starting here holds {members} sequences of {padded} tokens (padded), more than "
            f"the capacity {capacity}; a group is packed whole into one pack (--too-long applies to single sequences "
            "only): raise --capacity, or keep each group within one optimizer step instead (--group-scope step "
            "with --dp-size)")


def group_too_big_message(where: str, members: int, padded: int, packs: int, groups: GroupSpec) -> str:
    """The one error for a group that does not fit one step (--group-scope step)."""
    return (f"{where}: the group starting here holds {members} sequences of {padded} tokens (padded), which take "
            f"{packs} packs, more than the {groups.dp_size} x {groups.micro_batches} of a step; a group is kept "
            "within one step: raise --micro-batches or --capacity")


def check_groups_fit_everywhere(comm: Comm, ordered: Ordered, index: SequenceIndex, groups: GroupSpec,
                                windows: WindowOptions) -> None:
    """Name the group that cannot be placed with the smallest first gid, on every rank (groups are
    whole on one rank once ordered): over the capacity (--group-scope pack), or with a member
    over the capacity or more packs than a step (--group-scope step); with --limit, over a limit
    (its sum with pack, a member with step)."""
    padded = round_up(ordered.lengths, groups.align)
    if ordered.shared is not None:  # a shared group costs its stored segments
        padded = stored_padded(lambda n: round_up(n, groups.align), ordered.lengths, ordered.shared,
                               ordered.new_group)
    mine = []
    try:
        if groups.scope == GroupScope.STEP:
            check_groups_fit_step(ordered.gids, ordered.lengths, ordered.new_group, windows)
        else:
            check_groups_fit(ordered.gids, padded, ordered.new_group, groups.capacity)
    except GroupTooLong as exc:
        mine.append((exc.gid, 0, exc.members, exc.padded, 0))
    except GroupTooBigForStep as exc:
        mine.append((exc.gid, 0, exc.members, exc.padded, exc.packs))
    limits = np.asarray(windows.limits if windows is not None else (), dtype=np.int64)
    if ordered.extra is not None and len(limits):
        try:
            check_groups_within_limits(ordered.gids, ordered.extra, ordered.new_group, limits,
                                       whole=groups.scope != GroupScope.STEP)
        except GroupOverLimit as exc:
            mine.append((exc.gid, 1, exc.members, exc.cost, exc.column))
    found = [f for part in comm.allgather(mine) for f in part]
    if found:
        gid, kind, members, total, packs = min(found)
        first_row = int(group_ids(np.array([gid]), index.group_starts)[0])  # --skip-empty may have left it out
        if kind == 1:
            column = getattr(index, "limit_columns", ())[packs]
            where = index.describe(first_row, groups.column)
            raise PackctlError(group_over_limit_message(where, members, total, column, int(limits[packs]),
                                                        groups.scope), everywhere=True)
        where = index.describe(first_row, groups.column)
        if packs:
            message = group_too_big_message(where, members, total, packs, groups)
        elif groups.scope == GroupScope.STEP:
            message = (f"{where}: the group starting here holds a sequence longer than the capacity "
                       f"{groups.capacity} (its {members} sequences hold {total} tokens, padded); a group's "
                       "members are packed whole: raise --capacity (--too-long applies to single sequences only)")
        else:
            message = group_too_long_message(where, members, total, groups.capacity)
        raise PackctlError(message, everywhere=True)


def group_over_limit_message(where: str, members: int, cost: int, column: str, limit: int, scope: str) -> str:
    """The one error for a group over a --limit, whatever --too-long says."""
    if scope == GroupScope.STEP:
        return (f"{where}: the group starting here ({members} sequences) holds a sequence that costs {cost}, more "
                f"than --limit {column}={limit} lets a pack hold; a group's members are packed whole (--too-long "
                "applies to single sequences only): raise the limit")
    return (f"{where}: the group starting here holds {members} sequences that together cost {cost}, more than "
            f"--limit {column}={limit} lets a pack hold; a group is packed whole into one pack (--too-long applies "
            "to single sequences only): raise the limit, or keep each group within one optimizer step instead "
            "(--group-scope step with --dp-size)")


def group_totals(comm: Comm, ids: np.ndarray, padded: np.ndarray) -> np.ndarray:
    """Each sequence's group padded length, summed over every rank (`ids` in gid order, as scan
    leaves them: only this rank's first and last group can have members elsewhere)."""
    totals = run_totals(padded, run_starts(ids))
    if comm.size > 1:
        edges = {int(ids[0]): int(totals[0]), int(ids[-1]): int(totals[-1])} if len(ids) else {}
        elsewhere: dict[int, int] = {}
        for r, found in enumerate(comm.allgather(edges)):
            for g, t in found.items():
                if r != comm.rank:
                    elsewhere[g] = elsewhere.get(g, 0) + t
        for g in edges:
            if g in elsewhere:
                totals[ids == g] += elsewhere[g]
    return totals


def order_corpus(index, spec: OrderSpec, groups: GroupSpec | None = None,
                 windows: WindowOptions | None = None) -> Ordered:
    """The sequence order of `spec` for the whole corpus, in one process: `order_and_distribute`
    on a single rank, so the what-if orders exactly as `pack` does (with `index.group_starts`,
    whole groups keyed by their id or summed padded length, `new_group` marking each group's first
    member, and a group over the capacity refused). The order depends on the order options, the
    alignment and the groups only, not on the capacity or the algorithm.

    `index` needs what a single rank's SequenceIndex gives it: `lengths` (true length of every
    gid), `gid_lo` 0, `num_sequences`, `files` and `file_offsets` (where a row comes from) and
    `group_starts` (None without --group-column).
    """
    return order_and_distribute(SingleComm(), index, spec, groups, windows)
