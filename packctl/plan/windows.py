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

from dataclasses import dataclass, replace

import numpy as np

from packctl.arrays import ranges
from packctl.plan.algorithms import batch_lengths, cuts_items, pack_lengths
from packctl.plan.align import round_up
from packctl.plan.bins import Bins, over_limits
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
    limits = np.asarray(options.limits, dtype=np.int64)
    gids = np.asarray(gids, dtype=np.int64)
    sequences = _Sequences(gids, np.asarray(lengths, dtype=np.int64), new_group,
                           _checked_extra(extra, limits, len(gids)), shared)
    if new_group is not None:
        _check_groups(sequences, options, limits)
        cuts = np.flatnonzero(new_group)[::options.window]
    else:
        cuts = np.arange(0, len(gids), options.window)
    over_long = _OverLong.of(sequences, options, limits)

    parts: list[tuple[np.ndarray, ...]] = []
    window_bins = [0]
    step_bins = [np.zeros(1, np.int64)]
    for w, (lo, hi) in enumerate(zip(cuts.tolist(), [*cuts[1:].tolist(), len(gids)])):
        result, steps = _plan_window(sequences.window(lo, hi), options, window_seed(options.seed, first_window + w))
        if steps is not None:
            step_bins.append(steps[1:] + window_bins[-1])
        parts.append(result)
        window_bins.append(window_bins[-1] + len(result[0]) - 1)
        if progress is not None:
            progress(hi - lo)
    bin_offsets, piece_gid, piece_start, piece_len, piece_padded, *piece_extra = _joined(
        parts, None if sequences.extra is None else len(limits))
    return PackPlan(
        window_bins=np.asarray(window_bins, dtype=np.int64), bin_offsets=bin_offsets,
        piece_gid=piece_gid, piece_start=piece_start, piece_len=piece_len, piece_padded=piece_padded,
        dropped=over_long.dropped, truncated=over_long.truncated,
        tokens_dropped=over_long.tokens_dropped, tokens_truncated=over_long.tokens_truncated,
        step_bins=np.concatenate(step_bins) if options.step_scope else None,
        piece_extra=piece_extra[0] if piece_extra else None, over_limit=over_long.over_limit,
    )


@dataclass(frozen=True)
class _Sequences:
    """Sequences in planning order (`gids`, true `lengths`, int64) with what travels beside each:
    `new_group` (True on a group's first member), `extra` (its value of each limited column, n x k)
    and `shared` (the tokens its group stores once, --share-prefix); None where not given."""

    gids: np.ndarray
    lengths: np.ndarray
    new_group: np.ndarray | None = None
    extra: np.ndarray | None = None
    shared: np.ndarray | None = None

    def window(self, lo: int, hi: int) -> _Sequences:
        """The sequences lo..hi, each with what travels beside it."""
        def cut(values):
            return None if values is None else values[lo:hi]

        return _Sequences(self.gids[lo:hi], self.lengths[lo:hi], cut(self.new_group), cut(self.extra), cut(self.shared))


def _check_groups(sequences: _Sequences, options: WindowOptions, limits: np.ndarray) -> None:
    """Raise for the group of two or more that no window can place: GroupTooLong for one over the
    capacity, packed whole (--group-scope pack; with a shared prefix, at its stored length), and
    GroupOverLimit for one over a limit (its sum with pack scope, a member with step)."""
    gids, lengths, new_group, shared = sequences.gids, sequences.lengths, sequences.new_group, sequences.shared
    if not options.step_scope:
        align = options.align
        padded = (round_up(lengths, align) if shared is None
                  else stored_padded(lambda n: round_up(n, align), lengths, shared, new_group))
        check_groups_fit(gids, padded, new_group, options.capacity)
    if sequences.extra is not None:
        check_groups_within_limits(gids, sequences.extra, new_group, limits, whole=not options.step_scope)


@dataclass(frozen=True)
class _OverLong:
    """What --too-long does to the sequences over the capacity or over a limit on their own: the
    fields of PackPlan that say so (`dropped`, `truncated`, their tokens, `over_limit`)."""

    dropped: np.ndarray
    truncated: np.ndarray
    tokens_dropped: int
    tokens_truncated: int
    over_limit: np.ndarray | None

    @classmethod
    def of(cls, sequences: _Sequences, options: WindowOptions, limits: np.ndarray) -> _OverLong:
        """--too-long's outcome for `sequences`; raises for the first sequence (smallest gid) it
        cannot place: over a limit or media that would be cut (`_refuse_cutting_media`), over the
        capacity with `error` (SequenceTooLong)."""
        gids, lengths, extra = sequences.gids, sequences.lengths, sequences.extra
        capacity, too_long = options.capacity, options.too_long
        over_capacity = round_up(lengths, options.align) > capacity
        over_limit = over_limits(extra, limits) if extra is not None else np.zeros(len(gids), dtype=bool)
        if too_long != "drop" and extra is not None:
            _refuse_cutting_media(gids, lengths, extra, limits, over_capacity, over_limit, capacity, too_long)
        if too_long == "error" and over_capacity.any():
            i = int(np.flatnonzero(over_capacity)[np.argmin(gids[over_capacity])])
            raise SequenceTooLong(int(gids[i]), int(lengths[i]), int(round_up(lengths[i], options.align)), capacity)
        over = over_capacity | over_limit  # what --too-long drop leaves out
        drop, truncate = too_long == "drop", too_long == "truncate"
        return cls(
            dropped=np.sort(gids[over]) if drop else np.zeros(0, np.int64),
            truncated=np.sort(gids[over_capacity]) if truncate else np.zeros(0, np.int64),
            tokens_dropped=int(lengths[over].sum()) if drop else 0,
            tokens_truncated=int((lengths[over_capacity] - capacity).sum()) if truncate else 0,
            over_limit=None if extra is None else np.sort(gids[over_limit]) if drop else np.zeros(0, np.int64),
        )


def _plan_window(window: _Sequences, options: WindowOptions,
                 seed: int) -> tuple[tuple[np.ndarray, ...], np.ndarray | None]:
    """One window's planned pieces (`_plan_one_window`'s tuple) and, under --group-scope step, the
    first pack of each of its steps (plus the end), else None; with `options.exchanges` after the
    seeded exchanges between its packs (`_exchanged`)."""
    steps = None
    if options.step_scope:  # without groups (a blend's steps) every sequence is a group of one
        starts = np.ones(len(window.gids), dtype=bool) if window.new_group is None else window.new_group
        result, steps = plan_window_steps(window.gids, window.lengths, starts, options, seed=seed,
                                          extra=window.extra, consecutive=window.new_group is None)
    else:
        result = _plan_one_window(window.gids, window.lengths, options, seed=seed, new_group=window.new_group,
                                  extra=window.extra, shared=window.shared)
    if options.exchanges and options.algorithm != "batch":
        result = _exchanged(result, options, seed, steps, None if options.step_scope else window.new_group,
                            window.gids, window.lengths)
    return result, steps


def _joined(parts: list[tuple[np.ndarray, ...]], extra_columns: int | None) -> tuple[np.ndarray, ...]:
    """Planned pieces of consecutive runs of packs (each `_plan_one_window`'s tuple) as one tuple,
    the packs of each part after those of the parts before; `extra_columns` (k with limits, else
    None) shapes the costs of no pieces at all.

        ([0, 2], gids [4, 5], ...) and ([0, 1], gids [6], ...) -> ([0, 2, 3], gids [4, 5, 6], ...)
    """
    if not parts:
        nothing = (np.zeros(1, np.int64), *(np.zeros(0, np.int64) for _ in range(4)))
        return nothing if extra_columns is None else (*nothing, np.zeros((0, extra_columns), np.int64))
    offsets, base = [np.zeros(1, np.int64)], 0
    for part in parts:
        offsets.append(part[0][1:] + base)
        base += int(part[0][-1])
    return (np.concatenate(offsets), *(np.concatenate([p[i] for p in parts]) for i in range(1, len(parts[0]))))


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


def plan_window_steps(gids, lengths, new_group, options: WindowOptions, *, seed: int, extra: np.ndarray | None = None,
                      consecutive: bool = False) -> tuple[tuple[np.ndarray, ...], np.ndarray]:
    """One window under --group-scope step: its groups cut into steps, each step's sequences packed
    on their own by the algorithm (a group's members may share packs with other groups and spread
    over several packs, never over two steps).

    A step takes, in order, the waiting groups that fit its room (`options.step_packs` M: M packs
    of padded tokens; `options.step_tokens` T: T padded tokens), looking up to STEP_LOOKAHEAD
    groups past the first one waiting, so a group too big for what is left waits for the next step
    while smaller ones fill the room. With M, if the algorithm needs more than M packs for them,
    the step keeps the longest run of the groups it took, from the first, that fits M packs
    (binary search), then tries the groups still waiting one by one (each kept if the step still
    fits M packs, until STEP_MISSES do not); a group alone that the algorithm cannot fit is packed
    first-fit-decreasing, which `check_groups_fit_step` vouched for. Step k of the window packs
    with seed window_seed(seed, k).
    Returns `_plan_one_window`'s tuple for the whole window and the first pack of every step
    (plus the end). With limits (`extra`, `options.limits`) every step's packs keep them; the
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
    groups = _StepGroups.of(gids, lengths, new_group, options, seed, extra, consecutive)
    parts, steps = [], [0]
    g = groups.next_waiting(0)
    while g < groups.count:
        taken, result = groups.step_from(g, len(parts))
        groups.waiting[taken] = False
        if len(result[0]) > 1:
            parts.append(result)
            steps.append(steps[-1] + len(result[0]) - 1)
        g = groups.next_waiting(g)
    return _joined(parts, None if extra is None else extra.shape[1]), np.asarray(steps, dtype=np.int64)


@dataclass
class _StepGroups:
    """One window's groups as `plan_window_steps` cuts them into steps: group t is the sequences
    first[t]:ends[t] and takes `totals[t]` padded tokens of a step's `room` (a sequence dropped by
    --too-long drop takes none, one over the capacity otherwise takes the capacity); `waiting`
    (updated by the caller) says which groups no step holds yet."""

    gids: np.ndarray
    lengths: np.ndarray
    extra: np.ndarray | None
    options: WindowOptions
    seed: int
    consecutive: bool
    first: np.ndarray
    ends: np.ndarray
    totals: list[int]
    room: int
    waiting: np.ndarray

    @classmethod
    def of(cls, gids, lengths, new_group, options: WindowOptions, seed: int, extra: np.ndarray | None,
           consecutive: bool) -> _StepGroups:
        """The groups of `new_group` (True on each group's first sequence), all waiting but those
        that --too-long drop leaves empty."""
        capacity, too_long = options.capacity, options.too_long
        padded = round_up(lengths, options.align)
        over = padded > capacity
        if extra is not None and too_long == "drop":  # a sequence over a limit is dropped: it takes no room
            over |= over_limits(extra, np.asarray(options.limits, dtype=np.int64))
        size = np.where(over, 0 if too_long == "drop" else capacity, padded)  # room each takes after --too-long
        first = np.flatnonzero(new_group)
        totals = np.add.reduceat(size, first).tolist() if len(first) else []
        return cls(gids=gids, lengths=lengths, extra=extra, options=options, seed=seed, consecutive=consecutive,
                   first=first, ends=np.append(first[1:], len(gids)), totals=totals,
                   room=options.step_packs * capacity if options.step_packs is not None else options.step_tokens,
                   waiting=np.asarray(totals, dtype=np.int64) > 0)  # a group dropped whole takes no room

    @property
    def count(self) -> int:
        return len(self.first)

    def next_waiting(self, g: int) -> int:
        """The first group from g on that is still waiting (`count` when none is)."""
        while g < self.count and not self.waiting[g]:
            g += 1
        return g

    def pack(self, taken: list[int], k: int, *, alone: bool = False) -> tuple[np.ndarray, ...]:
        """The groups `taken` packed as step k (`_plan_one_window`): by the algorithm, seeded
        window_seed(seed, k), or (`alone`: one group the algorithm cannot fit) first-fit-decreasing."""
        take = np.concatenate([np.arange(self.first[t], self.ends[t]) for t in taken])
        options = replace(self.options, algorithm="ffd") if alone else self.options
        return _plan_one_window(self.gids[take], self.lengths[take], options,
                                seed=0 if alone else window_seed(self.seed, k),
                                extra=None if self.extra is None else self.extra[take])

    def step_from(self, g: int, k: int) -> tuple[list[int], tuple[np.ndarray, ...]]:
        """Step k, opened by the waiting group g: the groups it takes and their packing."""
        taken = self._within_room(g)
        result = self.pack(taken, k)
        if self.options.step_packs is None or len(result[0]) - 1 <= self.options.step_packs:
            return taken, result
        # the longest run of the groups taken, from the first, that the algorithm packs into M
        # packs (binary search; one group alone always fits first-fit-decreasing)
        fits, over = 0, len(taken)
        while over - fits > 1:
            mid = (fits + over) // 2
            trial = self.pack(taken[:mid], k)
            if len(trial[0]) - 1 <= self.options.step_packs:
                fits, result = mid, trial
            else:
                over = mid
        if fits == 0:
            result = self.pack(taken[:1], k, alone=True)
            if len(result[0]) - 1 > self.options.step_packs:
                raise GroupTooBigForStep(int(self.gids[self.first[g]]), int(self.ends[g] - self.first[g]),
                                         self.totals[g], len(result[0]) - 1, self.options.step_packs)
            return taken[:1], result
        taken = taken[:fits]
        return taken, self._filled(taken, sum(self.totals[t] for t in taken), result, k)

    def _within_room(self, g: int) -> list[int]:
        """From group g on, the waiting groups that fit the room, in order (up to the first that
        does not, with `consecutive`), looking STEP_LOOKAHEAD groups ahead."""
        taken, held = [g], self.totals[g]
        for j in range(g + 1, min(self.count, g + STEP_LOOKAHEAD)):
            if held >= self.room:
                break
            if self.waiting[j] and held + self.totals[j] <= self.room:
                taken.append(j)
                held += self.totals[j]
            elif self.consecutive:
                break
        return taken

    def _filled(self, taken: list[int], held: int, result: tuple[np.ndarray, ...], k: int) -> tuple[np.ndarray, ...]:
        """Try the groups still waiting that fit the room, one by one, until STEP_MISSES of them did
        not fit the packs; `taken` grows in place. Returns the step's packing."""
        if self.consecutive:  # a later group would leave a gap in the run
            return result
        misses = 0
        in_step = set(taken)
        for j in range(taken[0] + 1, min(self.count, taken[0] + STEP_LOOKAHEAD)):
            if misses >= STEP_MISSES or held >= self.room:
                break
            if not self.waiting[j] or j in in_step or held + self.totals[j] > self.room:
                continue
            trial = self.pack([*taken, j], k)
            if len(trial[0]) - 1 <= self.options.step_packs:
                taken.append(j)
                held += self.totals[j]
                result = trial
            else:
                misses += 1
        return result


def _plan_one_window(gids, lengths, options: WindowOptions, *, seed: int, new_group=None, extra=None,
                     shared=None) -> tuple[np.ndarray, ...]:
    """One window -> (bin_offsets, piece gid, start, len, padded), and with limits (`extra` n x k,
    `options.limits` k) each piece's costs (pieces x k) after them. With `new_group`, the algorithm
    packs whole groups (only groups of one can be over-long: plan_windows checked); with `shared`
    too, the segments of each shared group (`expand_shared`)."""
    items = _WindowItems.of(gids, lengths, options, new_group, extra, shared)
    bins = items.packed(options, seed)
    members = bins.members
    planned = (bins.offsets.astype(np.int64), items.gids[members], items.start[members] + bins.starts,
               np.minimum(bins.lens, items.lengths[members] - bins.starts), bins.lens.astype(np.int64))
    if items.extra is not None:
        planned = (*planned, items.extra[members])  # a cut sequence costs nothing (plan_windows checked)
    if not items.full_chunks.any():
        return planned
    return _with_full_chunks(planned, items.full_chunks[members], options.capacity)


@dataclass(frozen=True)
class _WindowItems:
    """A window's sequences after --too-long, as the algorithm packs them: per item its sequence
    (`gids`), its first token in it (`start`), its true tokens (`lengths`), the full packs of
    `capacity` tokens that come before the item's pack (`full_chunks`: --too-long split, when the
    algorithm cuts nothing itself), and what travels with it (`new_group`, `extra`).

        capacity 8, --too-long split, a sequence of 19 tokens: start 16, length 3, full_chunks 2
    """

    gids: np.ndarray
    start: np.ndarray
    lengths: np.ndarray
    full_chunks: np.ndarray
    new_group: np.ndarray | None
    extra: np.ndarray | None

    @classmethod
    def of(cls, gids, lengths, options: WindowOptions, new_group, extra, shared) -> _WindowItems:
        """--too-long applied (drop leaves a sequence out, truncate cuts it to the capacity, split
        keeps its last piece), then each shared group cut into its segments (`expand_shared`)."""
        capacity, too_long = options.capacity, options.too_long
        over = round_up(lengths, options.align) > capacity
        if extra is not None and too_long == "drop":
            over = over | over_limits(extra, np.asarray(options.limits, dtype=np.int64))
        start = np.zeros(len(gids), np.int64)
        full_chunks = np.zeros(len(gids), np.int64)
        if too_long == "drop":
            keep = ~over
            gids, lengths, start, full_chunks = gids[keep], lengths[keep], start[keep], full_chunks[keep]
            new_group = None if new_group is None else new_group[keep]
            extra = None if extra is None else extra[keep]
            shared = None if shared is None else shared[keep]
        elif too_long == "truncate":
            lengths = np.where(over, capacity, lengths)
        elif too_long == "split" and not cuts_items(options.algorithm):
            # Full chunks of `capacity` fill a pack each; only the last piece is packed by the algorithm.
            full_chunks = np.where(over, (lengths - 1) // capacity, 0)
            start = full_chunks * capacity
            lengths = lengths - start
        if shared is not None and new_group is not None:  # only groups of one are cut above: they share nothing
            rows, seg_start, lengths, new_group = expand_shared(lengths, shared, new_group)
            gids, start, full_chunks = gids[rows], start[rows] + seg_start, full_chunks[rows]
        return cls(gids=gids, start=start, lengths=lengths, full_chunks=full_chunks, new_group=new_group,
                   extra=extra)

    def packed(self, options: WindowOptions, seed: int) -> Bins:
        """The items' bins: padded micro-batches (algorithm batch), the algorithm over whole groups,
        each costing the sum of its members (`new_group`), else over the items one by one."""
        item_padded = round_up(self.lengths, options.align)
        budgets = {} if self.extra is None else {"limits": np.asarray(options.limits, dtype=np.int64)}
        if options.algorithm == "batch":
            if self.extra is not None:
                raise ValueError("limits apply to packs: batch mode (padded micro-batches) takes none")
            return batch_lengths(item_padded, options.max_tokens, max_seqs_per_bin=options.max_seqs_per_bin,
                                 buckets=options.buckets)
        if self.new_group is not None:
            first = np.flatnonzero(self.new_group)
            size = np.diff(np.append(first, len(self.gids)))
            group_padded = np.add.reduceat(item_padded, first) if len(first) else item_padded
            if self.extra is not None:
                budgets["extra"] = np.add.reduceat(self.extra, first, axis=0) if len(first) else self.extra
            return expand_items(pack_lengths(group_padded, options.capacity, options.algorithm, seed=seed,
                                             pool_size=options.pool_size, pool_strategy=options.pool_strategy,
                                             **budgets), first, size, item_padded)
        if self.extra is not None:
            budgets["extra"] = self.extra
        return pack_lengths(item_padded, options.capacity, options.algorithm,
                            max_seqs_per_bin=options.max_seqs_per_bin, seed=seed, align=options.align,
                            pool_size=options.pool_size, pool_strategy=options.pool_strategy, **budgets)


def _with_full_chunks(planned: tuple[np.ndarray, ...], chunks_per_piece: np.ndarray,
                      capacity: int) -> tuple[np.ndarray, ...]:
    """The planned pieces (`_plan_one_window`'s tuple) with each split sequence's full chunks
    (`chunks_per_piece`, on its last piece) as packs of their own right before the pack holding
    its last piece, in order, so its pieces stay in order (module docstring: bins 0 and 1)."""
    offsets, p_gid, p_start, p_len, p_padded = planned[:5]
    p_extra = planned[5] if len(planned) > 5 else None
    n_bins, n_pieces = len(offsets) - 1, len(p_gid)
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
    moved = (new_offsets, all_gid[take], all_start[take], all_len[take], all_padded[take])
    if p_extra is None:
        return moved
    all_extra = np.concatenate([p_extra, np.zeros((len(chunk_piece), p_extra.shape[1]), np.int64)])
    return (*moved, all_extra[take])
