"""Plan the whole corpus window by window: over-long policy, padding, packing, pieces.

The ordered sequences are cut into windows of `window` sequences at global positions; each window
is packed on its own and its bins follow the previous window's. A *piece* is a whole sequence, or
a part of one when it was split; every piece becomes one sequence of a pack.

    capacity 8, align 1, algorithm concat, too_long split, window 10
    lengths by gid: [3, 19, 4]   (gid 1 is over-long: full chunks of 8 and 8, then a last piece of 3)
    concat packs the items [3, 3 (last piece of gid 1), 4] as [3, 3] [4]; the full chunks go
    right before the pack that holds the sequence's last piece, so its pieces stay in order:
             bin 0: (gid 1, start 0, len 8)
             bin 1: (gid 1, start 8, len 8)
             bin 2: (gid 0, start 0, len 3) (gid 1, start 16, len 3)
             bin 3: (gid 2, start 0, len 4)

With limits (`WindowOptions.limits`, --limit COL=N), each sequence also costs `extra[i, j]` in
limited column j: every window is packed under every budget (pack_lengths extra=, limits=), the
plan keeps each piece's costs (`piece_extra`) and each pack's sums (`extra_loads`). A sequence
over a limit on its own follows --too-long: error, or drop (counted in `dropped` and
`over_limit`); truncate and split refuse it (`SequenceOverLimit`), as they refuse a sequence over
the capacity that has a cost (`UncuttableSequence`): media cannot be cut.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from packctl.arrays import ranges
from packctl.plan.algorithms import batch_lengths, cuts_items, pack_lengths
from packctl.plan.align import round_up
from packctl.plan.bins import over_limits
from packctl.plan.exchange import exchange_pieces
from packctl.plan.groups import (
    GroupTooLong,
    check_groups_fit,
    check_groups_within_limits,
    expand_items,
)
from packctl.plan.prefix import expand_shared, stored_padded
from packctl.plan.order import window_seed
from packctl.specs import WindowOptions


class SequenceTooLong(ValueError):
    """A sequence does not fit the capacity and the policy is `error`."""

    def __init__(self, gid: int, length: int, padded: int, capacity: int):
        self.gid, self.length, self.padded, self.capacity = gid, length, padded, capacity
        super().__init__(f"sequence {gid} of {length} tokens (padded {padded}) exceeds capacity {capacity}")


class SequenceOverLimit(ValueError):
    """A sequence costs more than a limit on its own, and --too-long is not `drop`: `column` is the
    index of the limited column (in `WindowOptions.limits` order), `count` how many sequences are
    over a limit."""

    def __init__(self, gid: int, column: int, cost: int, limit: int, count: int, too_long: str):
        self.gid, self.column, self.cost, self.limit, self.count, self.too_long = gid, column, cost, limit, count, too_long
        why = "" if too_long == "error" else f" (--too-long {too_long} cannot cut media)"
        super().__init__(f"sequence {gid} costs {cost} in limited column {column}, over its limit {limit}{why}; "
                         f"{count} sequence(s) over a limit")


class UncuttableSequence(ValueError):
    """--too-long truncate or split would cut a sequence over the capacity that has a cost (media):
    `column` its first limited column > 0."""

    def __init__(self, gid: int, length: int, capacity: int, column: int, cost: int, count: int, too_long: str):
        self.gid, self.length, self.capacity, self.column, self.cost, self.count, self.too_long = (
            gid, length, capacity, column, cost, count, too_long)
        super().__init__(f"sequence {gid} of {length} tokens exceeds capacity {capacity} and costs {cost} in limited "
                         f"column {column}: --too-long {too_long} would cut its media; {count} such sequence(s)")


@dataclass
class PackPlan:
    """Every pack of the corpus as CSR over pieces, with the window each pack belongs to."""

    window_bins: np.ndarray  # int64, W+1: packs of window w are window_bins[w]:window_bins[w+1]
    bin_offsets: np.ndarray  # int64, B+1: pieces of pack b are bin_offsets[b]:bin_offsets[b+1]
    piece_gid: np.ndarray  # int64
    piece_start: np.ndarray  # int64, first token of the piece inside its sequence
    piece_len: np.ndarray  # int64, true tokens
    piece_padded: np.ndarray  # int64, after alignment padding
    dropped: np.ndarray  # gids left out (too long, policy drop)
    truncated: np.ndarray  # gids cut to the capacity (policy truncate)
    tokens_dropped: int
    tokens_truncated: int
    # --group-scope step: the first pack of every step (plus the end), steps inside windows; the
    # balancer takes these steps as they are instead of cutting its own
    step_bins: np.ndarray | None = None
    # with limits: int64 pieces x k, each piece's value of each limited column (a sequence's value
    # on its one piece: only sequences of no cost are ever cut); None without limits
    piece_extra: np.ndarray | None = None
    over_limit: np.ndarray | None = None  # gids dropped for being over a limit on their own (also in `dropped`)

    @property
    def num_bins(self) -> int:
        return len(self.bin_offsets) - 1

    @property
    def num_windows(self) -> int:
        return len(self.window_bins) - 1

    def loads(self, padded: bool = True) -> np.ndarray:
        """Per-pack sum of padded (or true) piece lengths."""
        values = self.piece_padded if padded else self.piece_len
        sums = np.concatenate([[0], np.cumsum(values)])
        return sums[self.bin_offsets[1:]] - sums[self.bin_offsets[:-1]]

    def extra_loads(self) -> np.ndarray:
        """Per-pack sum of each limited column (int64, B x k; k = 0 without limits): what the
        output's per-pack sums hold, each <= its limit."""
        if self.piece_extra is None:
            return np.zeros((self.num_bins, 0), np.int64)
        sums = np.concatenate([np.zeros((1, self.piece_extra.shape[1]), np.int64),
                               np.cumsum(self.piece_extra, axis=0, dtype=np.int64)])
        return sums[self.bin_offsets[1:]] - sums[self.bin_offsets[:-1]]

    def take_pieces(self, take: np.ndarray) -> np.ndarray | None:
        """`piece_extra` of the pieces `take` (None without limits): what a reordering passes on."""
        return None if self.piece_extra is None else self.piece_extra[take]

    def split_gids(self) -> np.ndarray:
        """gids that appear in more than one piece."""
        if len(self.piece_gid) == 0:
            return np.zeros(0, np.int64)
        gids, counts = np.unique(self.piece_gid, return_counts=True)
        return gids[counts > 1]

    def split_pieces(self) -> tuple[np.ndarray, int]:
        """Whether each piece belongs to a sequence cut in pieces, and how many such sequences,
        each window on its own: a (window, gid) with a piece that does not start at its sequence's
        first token. The same as `split_gids` where every sequence is planned once; a blend
        (--source) may plan a row twice, in one window or two, and each window's answer must not
        depend on which other windows a rank plans.

            window 0: gid 4 [0:9], gid 4 [9:12], gid 5 [0:3]; window 1: gid 5 [0:3]
            -> [True, True, False, False], 1
        """
        split = np.zeros(len(self.piece_gid), dtype=bool)
        later = np.flatnonzero(self.piece_start > 0)
        if len(later) == 0:
            return split, 0
        pack_of = np.repeat(np.arange(self.num_bins, dtype=np.int64), np.diff(self.bin_offsets))
        window_of = np.repeat(np.arange(self.num_windows, dtype=np.int64), np.diff(self.window_bins))[pack_of]
        keys = np.unique(np.stack([window_of[later], self.piece_gid[later]], axis=1), axis=0)
        candidates = np.flatnonzero(np.isin(self.piece_gid, keys[:, 1]))
        pairs = np.stack([window_of[candidates], self.piece_gid[candidates]], axis=1)
        found = (pairs[:, None, :] == keys[None, :, :]).all(axis=2).any(axis=1) if len(keys) <= 64 else \
            np.isin(pairs.view([("w", np.int64), ("g", np.int64)]).ravel(),
                    np.ascontiguousarray(keys).view([("w", np.int64), ("g", np.int64)]).ravel())
        split[candidates[found]] = True
        return split, len(keys)


def merge_plans(plans: list[PackPlan]) -> PackPlan:
    """Plans of consecutive runs of windows (one per rank, in rank order) -> the plan of all."""
    if len(plans) == 1:
        return plans[0]
    window_bins, bin_offsets = [np.zeros(1, np.int64)], [np.zeros(1, np.int64)]
    step_bins = [np.zeros(1, np.int64)]
    bins = pieces = 0
    for p in plans:
        window_bins.append(p.window_bins[1:] + bins)
        bin_offsets.append(p.bin_offsets[1:] + pieces)
        if p.step_bins is not None:
            step_bins.append(p.step_bins[1:] + bins)
        bins += p.num_bins
        pieces += len(p.piece_gid)
    cat = (lambda name: np.concatenate([getattr(p, name) for p in plans]))
    stepped = [p.step_bins is not None for p in plans]
    if any(stepped) and not all(stepped):
        raise ValueError("merge_plans: plans with and without planned steps")
    limited = [p.piece_extra is not None for p in plans]
    if any(limited) and not all(limited):
        raise ValueError("merge_plans: plans with and without limits")
    return PackPlan(
        window_bins=np.concatenate(window_bins), bin_offsets=np.concatenate(bin_offsets),
        piece_gid=cat("piece_gid"), piece_start=cat("piece_start"), piece_len=cat("piece_len"),
        piece_padded=cat("piece_padded"), dropped=np.sort(cat("dropped")), truncated=np.sort(cat("truncated")),
        tokens_dropped=sum(p.tokens_dropped for p in plans), tokens_truncated=sum(p.tokens_truncated for p in plans),
        step_bins=np.concatenate(step_bins) if all(stepped) else None,
        piece_extra=cat("piece_extra") if all(limited) else None,
        over_limit=np.sort(cat("over_limit")) if all(limited) else None,
    )


class GroupTooBigForStep(ValueError):
    """--group-scope step: a group of two or more sequences takes more packs than a step holds."""

    def __init__(self, gid: int, members: int, padded: int, packs: int, step_packs: int):
        self.gid, self.members, self.padded, self.packs, self.step_packs = gid, members, padded, packs, step_packs
        super().__init__(f"group at sequence {gid} of {members} sequences ({padded} tokens padded) takes {packs} "
                         f"packs, more than the {step_packs} of a step")


def plan_windows(gids: np.ndarray, lengths: np.ndarray, options: WindowOptions, *, first_window: int = 0,
                 progress=None, new_group: np.ndarray | None = None, extra: np.ndarray | None = None,
                 shared: np.ndarray | None = None) -> PackPlan:
    """Pack sequences given in order (`gids[i]` has true length `lengths[i]`), window by window.

    The items are whole windows, the first being window `first_window` of the global order (its
    index seeds `ffs`), so any run of whole windows plans the same wherever it is computed.
    Raises SequenceTooLong for the over-long sequence with the smallest gid when `too_long == "error"`.

    `new_group` (bool, True on the first member of each group; members follow each other):
    each group is packed whole as one item, and a window is `window` groups. A group of two or
    more over the capacity raises GroupTooLong; --too-long applies to groups of one. With
    `options.step_packs` or `step_tokens` (--group-scope step) each window is cut into steps
    that keep their groups whole instead (`plan_window_steps`), recorded in `step_bins`.

    `extra` (n x k integers >= 0, k = len(options.limits)): each sequence's value of each limited
    column; every pack's sum of column j stays <= options.limits[j] (module docstring). A group of
    two or more over a limit (its sum with --group-scope pack, a member with step) raises
    GroupOverLimit; a sequence over a limit raises SequenceOverLimit unless --too-long drop.

    `shared` (--share-prefix, with `new_group`): the tokens each row's group stores once
    (plan/prefix.py); a shared group is packed as its prefix segment and one branch per row, and
    costs its stored length.
    """
    o = options
    capacity, align, too_long, window = o.capacity, o.align, o.too_long, o.window
    gids = np.asarray(gids, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    limits = np.asarray(o.limits, dtype=np.int64)
    extra = _checked_extra(extra, limits, len(gids))
    if new_group is not None:
        if not o.step_scope:
            padded = (round_up(lengths, align) if shared is None
                      else stored_padded(lambda n: round_up(n, align), lengths, shared, new_group))
            check_groups_fit(gids, padded, new_group, capacity)
        if extra is not None:
            check_groups_within_limits(gids, extra, new_group, limits, whole=not o.step_scope)
        cuts = np.flatnonzero(new_group)[::window]
    else:
        cuts = np.arange(0, len(gids), window)
    over_capacity = round_up(lengths, align) > capacity
    over_limit = over_limits(extra, limits) if extra is not None else np.zeros(len(gids), dtype=bool)
    if too_long != "drop" and extra is not None:
        _refuse_cutting_media(gids, lengths, extra, limits, over_capacity, over_limit, capacity, too_long)
    if too_long == "error" and over_capacity.any():
        i = int(np.flatnonzero(over_capacity)[np.argmin(gids[over_capacity])])
        raise SequenceTooLong(int(gids[i]), int(lengths[i]), int(round_up(lengths[i], align)), capacity)
    over = over_capacity | over_limit  # what --too-long drop leaves out
    dropped = np.sort(gids[over]) if too_long == "drop" else np.zeros(0, np.int64)
    truncated = np.sort(gids[over_capacity]) if too_long == "truncate" else np.zeros(0, np.int64)

    parts: list[tuple[np.ndarray, ...]] = []
    window_bins = [0]
    step_bins = [np.zeros(1, np.int64)]
    for w, (lo, hi) in enumerate(zip(cuts.tolist(), [*cuts[1:].tolist(), len(gids)])):
        kwargs = dict(capacity=capacity, align=align, algorithm=o.algorithm, too_long=too_long,
                      max_seqs_per_bin=o.max_seqs_per_bin, seed=window_seed(o.seed, first_window + w),
                      pool_size=o.pool_size, pool_strategy=o.pool_strategy, max_tokens=o.max_tokens,
                      buckets=o.buckets, limits=limits if extra is not None else None)
        window_extra = None if extra is None else extra[lo:hi]
        if o.step_scope:  # without groups (a blend's steps) every sequence is a group of one
            starts = np.ones(hi - lo, dtype=bool) if new_group is None else new_group[lo:hi]
            result, steps = plan_window_steps(gids[lo:hi], lengths[lo:hi], starts, o.step_packs,
                                              o.step_tokens, extra=window_extra, consecutive=new_group is None,
                                              **kwargs)
            step_bins.append(steps[1:] + window_bins[-1])
        else:
            steps = None
            result = _plan_one_window(gids[lo:hi], lengths[lo:hi],
                                      new_group=None if new_group is None else new_group[lo:hi], extra=window_extra,
                                      shared=None if shared is None else shared[lo:hi], **kwargs)
        if o.exchanges and o.algorithm != "batch":
            result = _exchanged(result, o, kwargs["seed"], steps,
                                None if new_group is None or o.step_scope else new_group[lo:hi], gids[lo:hi],
                                lengths[lo:hi])
        parts.append(result)
        window_bins.append(window_bins[-1] + len(result[0]) - 1)
        if progress is not None:
            progress(hi - lo)

    bin_offsets = [np.zeros(1, np.int64)]
    base = 0
    for part in parts:
        bin_offsets.append(part[0][1:] + base)
        base += int(part[0][-1])
    cat = (lambda k: np.concatenate([p[k] for p in parts]) if parts else np.zeros(0, np.int64))
    piece_extra = None
    if extra is not None:
        piece_extra = (np.concatenate([p[5] for p in parts]) if parts else np.zeros((0, len(limits)), np.int64))
    return PackPlan(
        window_bins=np.asarray(window_bins, dtype=np.int64),
        bin_offsets=np.concatenate(bin_offsets),
        piece_gid=cat(1), piece_start=cat(2), piece_len=cat(3), piece_padded=cat(4),
        dropped=dropped, truncated=truncated,
        tokens_dropped=int(lengths[over].sum()) if too_long == "drop" else 0,
        tokens_truncated=int((lengths[over_capacity] - capacity).sum()) if too_long == "truncate" else 0,
        step_bins=np.concatenate(step_bins) if o.step_scope else None,
        piece_extra=piece_extra,
        over_limit=None if extra is None else np.sort(gids[over_limit]) if too_long == "drop" else np.zeros(0, np.int64),
    )


def _checked_extra(extra, limits: np.ndarray, n: int) -> np.ndarray | None:
    """`extra` as int64 n x k for k = len(limits) >= 1, or None with no limits."""
    if len(limits) == 0:
        if extra is not None and np.asarray(extra).size:
            raise ValueError("extra given without limits (WindowOptions.limits)")
        return None
    if extra is None:
        raise ValueError(f"WindowOptions.limits has {len(limits)} limit(s): pass extra, n x {len(limits)}")
    extra = np.asarray(extra)
    if extra.shape != (n, len(limits)) or (extra.size and extra.dtype.kind not in "iu"):
        raise ValueError(f"extra must be integers of shape ({n}, {len(limits)}), got {extra.dtype} {extra.shape}")
    if extra.size and extra.min() < 0:
        raise ValueError(f"extra must be >= 0, got {extra.min()}")
    return np.ascontiguousarray(extra, dtype=np.int64)


def _refuse_cutting_media(gids, lengths, extra, limits, over_capacity, over_limit, capacity, too_long) -> None:
    """Raise for the sequence with the smallest gid that --too-long (not drop) cannot place:
    SequenceOverLimit for one over a limit; with truncate or split, UncuttableSequence for one over
    the capacity that has a cost (with error, SequenceTooLong comes after, from the caller)."""
    found = []
    if over_limit.any():
        i = int(np.flatnonzero(over_limit)[np.argmin(gids[over_limit])])
        j = int(np.argmax(extra[i] > limits))
        found.append((int(gids[i]), SequenceOverLimit(int(gids[i]), j, int(extra[i, j]), int(limits[j]),
                                                      int(over_limit.sum()), too_long)))
    if too_long in ("truncate", "split"):
        uncuttable = over_capacity & (extra > 0).any(axis=1)
        if uncuttable.any():
            i = int(np.flatnonzero(uncuttable)[np.argmin(gids[uncuttable])])
            j = int(np.argmax(extra[i] > 0))
            found.append((int(gids[i]), UncuttableSequence(int(gids[i]), int(lengths[i]), capacity, j,
                                                           int(extra[i, j]), int(uncuttable.sum()), too_long)))
    elif over_capacity.any():  # error: the first over-long sequence may come before the first over a limit
        found.append((int(gids[over_capacity].min()), None))
    if found:
        error = min(found, key=lambda f: f[0])[1]
        if error is not None:
            raise error


def _exchanged(result: tuple[np.ndarray, ...], options: WindowOptions, seed: int, steps: np.ndarray | None,
               new_group: np.ndarray | None, gids: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, ...]:
    """One window's planned pieces (`_plan_one_window`) after the seeded exchanges of
    plan/exchange.py: inside each step of --group-scope step (`steps`: its pack offsets), else
    across the window. Pieces of a split sequence never move, nor (pack scope, `new_group`) the
    members of a group of two or more, which share their pack."""
    offsets, p_gid, p_start, p_len, p_padded = result[:5]
    p_extra = result[5] if len(result) > 5 else None
    limits = np.asarray(options.limits, dtype=np.int64) if p_extra is not None else None
    if cuts_items(options.algorithm):  # any sequence may be cut
        unique, counts = np.unique(p_gid, return_counts=True)
        movable = ~np.isin(p_gid, unique[counts > 1])
    elif options.too_long == "split":  # only the over-long ones are
        movable = ~np.isin(p_gid, gids[round_up(lengths, options.align) > options.capacity])
    else:
        movable = np.ones(len(p_gid), dtype=bool)
    if new_group is not None:
        first = np.flatnonzero(new_group)
        size = np.diff(np.append(first, len(gids)))
        movable &= ~np.isin(p_gid, gids[np.repeat(size, size) > 1])
    max_seqs = options.max_seqs_per_bin if options.max_seqs_per_bin is not None else len(p_gid) + 1
    segments = steps if steps is not None else np.array([0, len(offsets) - 1])
    takes, new_offsets = [], [np.zeros(1, np.int64)]
    for k, (lo, hi) in enumerate(zip(segments[:-1].tolist(), segments[1:].tolist())):
        a, b = int(offsets[lo]), int(offsets[hi])
        take, cut = exchange_pieces(offsets[lo:hi + 1] - a, p_padded[a:b], movable[a:b], options.capacity,
                                    max_seqs, window_seed(seed, k), None if p_extra is None else p_extra[a:b], limits)
        takes.append(take + a)
        new_offsets.append(cut[1:] + a)
    take = np.concatenate(takes)
    exchanged = (np.concatenate(new_offsets), p_gid[take], p_start[take], p_len[take], p_padded[take])
    return exchanged if p_extra is None else (*exchanged, p_extra[take])


def check_groups_fit_step(gids: np.ndarray, lengths: np.ndarray, new_group: np.ndarray, options: WindowOptions) -> None:
    """--group-scope step: raise for the unplaceable group of two or more members with the smallest
    first gid: GroupTooLong when a member is over the capacity, GroupTooBigForStep when its members,
    packed alone first-fit-decreasing, take more than `options.step_packs` packs (only a group
    over half a step can: any-fit packing leaves at most one pack half empty)."""
    if len(gids) == 0:
        return
    padded = round_up(np.asarray(lengths, dtype=np.int64), options.align)
    first = np.flatnonzero(new_group)
    sizes = np.diff(np.append(first, len(gids)))
    totals = np.add.reduceat(padded, first)
    longest = np.maximum.reduceat(padded, first)
    found = []
    over = np.flatnonzero((sizes > 1) & (longest > options.capacity))
    if len(over):
        k = over[np.argmin(gids[first[over]])]
        found.append((int(gids[first[k]]), GroupTooLong(int(gids[first[k]]), int(sizes[k]), int(totals[k]),
                                                         options.capacity)))
    if options.step_packs is not None:
        for k in np.flatnonzero((sizes > 1) & (longest <= options.capacity)
                                & (2 * totals > options.step_packs * options.capacity)).tolist():
            lo, hi = int(first[k]), int(first[k] + sizes[k])
            packs = pack_lengths(padded[lo:hi], options.capacity, "ffd").num_bins
            if packs > options.step_packs:
                found.append((int(gids[lo]), GroupTooBigForStep(int(gids[lo]), hi - lo, int(totals[k]), packs,
                                                                options.step_packs)))
    if found:
        raise min(found, key=lambda f: f[0])[1]


STEP_LOOKAHEAD = 256  # groups a step may reach ahead of the first one waiting, to fill its room
STEP_MISSES = 4  # groups tried in vain (they fit the room, not the packs) before a step closes


def plan_window_steps(gids, lengths, new_group, step_packs: int | None, step_tokens: int | None, *, seed: int,
                      extra: np.ndarray | None = None, consecutive: bool = False,
                      **options) -> tuple[tuple[np.ndarray, ...], np.ndarray]:
    """One window under --group-scope step: its groups cut into steps, each step's sequences packed
    on their own by the algorithm (a group's members may share packs with other groups and spread
    over several packs, never over two steps).

    A step takes, in order, the waiting groups that fit its room (`step_packs` M: M packs of
    padded tokens; `step_tokens` T: T padded tokens), looking up to STEP_LOOKAHEAD groups past the
    first one waiting, so a group too big for what is left waits for the next step while smaller
    ones fill the room. With M, if the algorithm needs more than M packs for them, the step keeps
    the longest run of the groups it took, from the first, that fits M packs (binary search),
    then tries the groups still waiting one by one (each kept if the step still fits M packs,
    until STEP_MISSES do not); a group alone that the algorithm cannot fit is packed
    first-fit-decreasing, which `check_groups_fit_step` vouched for. Step k of the window packs
    with seed window_seed(seed, k).
    Returns `_plan_one_window`'s tuple for the whole window and the first pack of every step
    (plus the end). With limits (`extra`, `options["limits"]`) every step's packs keep them; the
    room of a step stays in tokens.

        capacity 8, step_packs 2, groups of padded lengths [5 3] [6] [4 4] [7]
        step 0: [5 3] [6] (14 of 16), [4 4] would make 22: it waits; [7] would make 21: it waits
        step 1: [4 4] [7] (15 of 16)
        -> packs [5 3] [6] | [4 4] [7], step bins [0, 2, 4]

    `consecutive` (a blend's steps, every use a group of one): a step takes the waiting groups in
    order up to the first that does not fit, never one further on, so every step is a run of
    consecutive uses of the blend and holds the blend within the tolerance of a run of its size.

        groups [5 3] [6] [4 4] [2]: step 0 takes [5 3] [6] and, past [4 4], [2] (16 of 16);
        consecutive: step 0 [5 3] [6], step 1 [4 4] [2]
    """
    capacity, align, too_long = options["capacity"], options["align"], options["too_long"]
    padded = round_up(lengths, align)
    over = padded > capacity
    if extra is not None and too_long == "drop":  # a sequence over a limit is dropped: it takes no room
        over |= over_limits(extra, options["limits"])
    size = np.where(over, 0 if too_long == "drop" else capacity, padded)  # room each takes after --too-long
    first = np.flatnonzero(new_group)
    ends = np.append(first[1:], len(gids))
    totals = np.add.reduceat(size, first).tolist() if len(first) else []
    room = step_packs * capacity if step_packs is not None else step_tokens
    n = len(first)
    waiting = np.asarray(totals, dtype=np.int64) > 0  # a group dropped whole (--too-long drop) takes no room
    parts, steps = [], [0]
    g = int(np.argmax(waiting)) if waiting.any() else n
    k = 0

    def pack_groups(taken: list[int], **overrides):
        take = np.concatenate([np.arange(first[t], ends[t]) for t in taken])
        return _plan_one_window(gids[take], lengths[take], extra=None if extra is None else extra[take],
                                **{**options, "seed": window_seed(seed, k), **overrides})

    def _fill_step(taken: list[int], held: int, result):
        """Try the groups still waiting that fit the room, one by one, until STEP_MISSES of them did
        not fit the packs; `taken` grows in place. Returns the step's packing."""
        if consecutive:  # a later group would leave a gap in the run
            return result
        misses = 0
        given_back = set(taken)
        for j in range(taken[0] + 1, min(n, taken[0] + STEP_LOOKAHEAD)):
            if misses >= STEP_MISSES or held >= room:
                break
            if not waiting[j] or j in given_back or held + totals[j] > room:
                continue
            trial = pack_groups([*taken, j])
            if len(trial[0]) - 1 <= step_packs:
                taken.append(j)
                held += totals[j]
                result = trial
            else:
                misses += 1
        return result

    while g < n:
        taken, held = [g], totals[g]
        for j in range(g + 1, min(n, g + STEP_LOOKAHEAD)):
            if held >= room:
                break
            if waiting[j] and held + totals[j] <= room:
                taken.append(j)
                held += totals[j]
            elif consecutive:
                break
        result = pack_groups(taken)
        if step_packs is not None and len(result[0]) - 1 > step_packs:
            # the longest run of the groups taken, from the first, that the algorithm packs into M
            # packs (binary search; one group alone always fits first-fit-decreasing)
            fits, over = 0, len(taken)
            while over - fits > 1:
                mid = (fits + over) // 2
                trial = pack_groups(taken[:mid])
                if len(trial[0]) - 1 <= step_packs:
                    fits, result = mid, trial
                else:
                    over = mid
            if fits == 0:
                taken = taken[:1]
                result = pack_groups(taken, algorithm="ffd", seed=0)
                if len(result[0]) - 1 > step_packs:
                    raise GroupTooBigForStep(int(gids[first[g]]), int(ends[g] - first[g]), totals[g],
                                             len(result[0]) - 1, step_packs)
            else:
                taken = taken[:fits]
                result = _fill_step(taken, sum(totals[t] for t in taken), result)
        waiting[taken] = False
        if len(result[0]) > 1:
            parts.append(result)
            steps.append(steps[-1] + len(result[0]) - 1)
            k += 1
        while g < n and not waiting[g]:
            g += 1
    if not parts:
        empty = np.zeros(0, np.int64)
        nothing = (np.zeros(1, np.int64), empty, empty, empty, empty)
        if extra is not None:
            nothing = (*nothing, np.zeros((0, extra.shape[1]), np.int64))
        return nothing, np.zeros(1, np.int64)
    offsets, base = [np.zeros(1, np.int64)], 0
    for part in parts:
        offsets.append(part[0][1:] + base)
        base += int(part[0][-1])
    joined = (np.concatenate(offsets), *(np.concatenate([p[i] for p in parts]) for i in range(1, len(parts[0]))))
    return joined, np.asarray(steps, dtype=np.int64)


def _plan_one_window(gids, lengths, *, capacity, align, algorithm, too_long, max_seqs_per_bin, seed, pool_size=128,
                     pool_strategy="closest", max_tokens=None, buckets=None, new_group=None, extra=None, limits=None,
                     shared=None):
    """One window -> (bin_offsets, piece gid, start, len, padded), and with limits (`extra` n x k,
    `limits` k) each piece's costs (pieces x k) after them. With `new_group`, the algorithm packs
    whole groups (only groups of one can be over-long: plan_windows checked); with `shared` too,
    the segments of each shared group (`expand_shared`)."""
    padded = round_up(lengths, align)
    over = padded > capacity
    if extra is not None and too_long == "drop":
        over = over | over_limits(extra, limits)
    start = np.zeros(len(gids), np.int64)
    full_chunks = np.zeros(len(gids), np.int64)
    if too_long == "drop":
        keep = ~over
        gids, lengths, start, full_chunks = gids[keep], lengths[keep], start[keep], full_chunks[keep]
        new_group = None if new_group is None else new_group[keep]
        extra = None if extra is None else extra[keep]
    elif too_long == "truncate":
        lengths = np.where(over, capacity, lengths)
    elif too_long == "split" and not cuts_items(algorithm):
        # Full chunks of `capacity` fill a pack each; only the last piece is packed by the algorithm.
        full_chunks = np.where(over, (lengths - 1) // capacity, 0)
        start = full_chunks * capacity
        lengths = lengths - start
    if shared is not None and new_group is not None:  # only groups of one are cut above: they share nothing
        rows, seg_start, lengths, new_group = expand_shared(lengths, shared[keep] if too_long == "drop" else shared,
                                                            new_group)
        gids, start, full_chunks = gids[rows], start[rows] + seg_start, full_chunks[rows]
    item_padded = round_up(lengths, align)

    budgets = {} if extra is None else {"limits": limits}
    if algorithm == "batch":
        if extra is not None:
            raise ValueError("limits apply to packs: batch mode (padded micro-batches) takes none")
        bins = batch_lengths(item_padded, max_tokens, max_seqs_per_bin=max_seqs_per_bin, buckets=buckets)
    elif new_group is not None:
        first = np.flatnonzero(new_group)
        size = np.diff(np.append(first, len(gids)))
        group_padded = np.add.reduceat(item_padded, first) if len(first) else item_padded
        if extra is not None:  # a group costs the sum of its members
            budgets["extra"] = np.add.reduceat(extra, first, axis=0) if len(first) else extra
        bins = expand_items(pack_lengths(group_padded, capacity, algorithm, seed=seed, pool_size=pool_size,
                                         pool_strategy=pool_strategy, **budgets), first, size, item_padded)
    else:
        if extra is not None:
            budgets["extra"] = extra
        bins = pack_lengths(item_padded, capacity, algorithm, max_seqs_per_bin=max_seqs_per_bin,
                            seed=seed, align=align, pool_size=pool_size, pool_strategy=pool_strategy, **budgets)
    members = bins.members
    p_gid = gids[members]
    p_start = start[members] + bins.starts
    p_len = np.minimum(bins.lens, lengths[members] - bins.starts)
    p_padded = bins.lens.astype(np.int64)
    offsets = bins.offsets.astype(np.int64)
    p_extra = None if extra is None else extra[members]  # a cut sequence costs nothing (plan_windows checked)
    if not full_chunks.any():
        return (offsets, p_gid, p_start, p_len, p_padded) + (() if p_extra is None else (p_extra,))

    # Insert each split sequence's full-chunk packs right before the pack holding its last piece.
    n_bins, n_pieces = len(offsets) - 1, len(members)
    chunks_per_piece = full_chunks[members]
    piece_bin = np.repeat(np.arange(n_bins), np.diff(offsets))
    chunk_piece = np.repeat(np.arange(n_pieces), chunks_per_piece)
    chunk_j = np.arange(len(chunk_piece)) - np.repeat(np.cumsum(chunks_per_piece) - chunks_per_piece,
                                                      chunks_per_piece)
    # records: main bins (bin, 1, 0, 0) and chunk bins (bin of the piece, 0, piece, j)
    rec_bin = np.concatenate([np.arange(n_bins), piece_bin[chunk_piece]])
    rec_kind = np.concatenate([np.ones(n_bins, np.int64), np.zeros(len(chunk_piece), np.int64)])
    rec_piece = np.concatenate([np.zeros(n_bins, np.int64), chunk_piece])
    rec_j = np.concatenate([np.zeros(n_bins, np.int64), chunk_j])
    rec_first = np.concatenate([offsets[:-1], n_pieces + np.arange(len(chunk_piece))])
    rec_count = np.concatenate([np.diff(offsets), np.ones(len(chunk_piece), np.int64)])
    rank = np.lexsort((rec_j, rec_piece, rec_kind, rec_bin))
    take = ranges(rec_first[rank], rec_count[rank])
    all_gid = np.concatenate([p_gid, p_gid[chunk_piece]])
    all_start = np.concatenate([p_start, chunk_j * capacity])
    all_len = np.concatenate([p_len, np.full(len(chunk_piece), capacity, np.int64)])
    all_padded = np.concatenate([p_padded, np.full(len(chunk_piece), capacity, np.int64)])
    new_offsets = np.concatenate([[0], np.cumsum(rec_count[rank])]).astype(np.int64)
    planned = (new_offsets, all_gid[take], all_start[take], all_len[take], all_padded[take])
    if p_extra is None:
        return planned
    all_extra = np.concatenate([p_extra, np.zeros((len(chunk_piece), p_extra.shape[1]), np.int64)])
    return (*planned, all_extra[take])

