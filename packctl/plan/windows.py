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
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from packctl.arrays import ranges
from packctl.plan.algorithms import batch_lengths, pack_lengths
from packctl.plan.align import round_up
from packctl.plan.groups import check_groups_fit, expand_items
from packctl.plan.order import window_seed


class SequenceTooLong(ValueError):
    """A sequence does not fit the capacity and the policy is `error`."""

    def __init__(self, gid: int, length: int, padded: int, capacity: int):
        self.gid, self.length, self.padded, self.capacity = gid, length, padded, capacity
        super().__init__(f"sequence {gid} of {length} tokens (padded {padded}) exceeds capacity {capacity}")


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

    def split_gids(self) -> np.ndarray:
        """gids that appear in more than one piece."""
        if len(self.piece_gid) == 0:
            return np.zeros(0, np.int64)
        gids, counts = np.unique(self.piece_gid, return_counts=True)
        return gids[counts > 1]


def merge_plans(plans: list[PackPlan]) -> PackPlan:
    """Plans of consecutive runs of windows (one per rank, in rank order) -> the plan of all."""
    if len(plans) == 1:
        return plans[0]
    window_bins, bin_offsets = [np.zeros(1, np.int64)], [np.zeros(1, np.int64)]
    bins = pieces = 0
    for p in plans:
        window_bins.append(p.window_bins[1:] + bins)
        bin_offsets.append(p.bin_offsets[1:] + pieces)
        bins += p.num_bins
        pieces += len(p.piece_gid)
    cat = (lambda name: np.concatenate([getattr(p, name) for p in plans]))
    return PackPlan(
        window_bins=np.concatenate(window_bins), bin_offsets=np.concatenate(bin_offsets),
        piece_gid=cat("piece_gid"), piece_start=cat("piece_start"), piece_len=cat("piece_len"),
        piece_padded=cat("piece_padded"), dropped=np.sort(cat("dropped")), truncated=np.sort(cat("truncated")),
        tokens_dropped=sum(p.tokens_dropped for p in plans), tokens_truncated=sum(p.tokens_truncated for p in plans),
    )


@dataclass(frozen=True)
class WindowOptions:
    """How a run plans its windows (packctl.planning.window_options makes them from a PackConfig).

    `capacity` must be a multiple of `align`; algorithm "batch" (`--mode batch`) makes padded
    micro-batches of at most `max_tokens` (`batch_lengths`, with optional `buckets`)."""

    capacity: int
    align: int
    algorithm: str
    too_long: str
    window: int
    max_seqs_per_bin: int | None = None
    seed: int = 0
    pool_size: int = 128
    pool_strategy: str = "closest"
    max_tokens: int | None = None
    buckets: np.ndarray | None = None


def plan_windows(gids: np.ndarray, lengths: np.ndarray, options: WindowOptions, *, first_window: int = 0,
                 progress=None, new_group: np.ndarray | None = None) -> PackPlan:
    """Pack sequences given in order (`gids[i]` has true length `lengths[i]`), window by window.

    The items are whole windows, the first being window `first_window` of the global order (its
    index seeds `ffs`), so any run of whole windows plans the same wherever it is computed.
    Raises SequenceTooLong for the over-long sequence with the smallest gid when `too_long == "error"`.

    `new_group` (bool, True on the first member of each group; members follow each other):
    each group is packed whole as one item, and a window is `window` groups. A group of two or
    more over the capacity raises GroupTooLong; --too-long applies to groups of one.
    """
    o = options
    capacity, align, too_long, window = o.capacity, o.align, o.too_long, o.window
    gids = np.asarray(gids, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    if new_group is not None:
        check_groups_fit(gids, round_up(lengths, align), new_group, capacity)
        cuts = np.flatnonzero(new_group)[::window]
    else:
        cuts = np.arange(0, len(gids), window)
    over = round_up(lengths, align) > capacity
    if too_long == "error" and over.any():
        i = int(np.flatnonzero(over)[np.argmin(gids[over])])
        raise SequenceTooLong(int(gids[i]), int(lengths[i]), int(round_up(lengths[i], align)), capacity)
    dropped = np.sort(gids[over]) if too_long == "drop" else np.zeros(0, np.int64)
    truncated = np.sort(gids[over]) if too_long == "truncate" else np.zeros(0, np.int64)

    parts: list[tuple[np.ndarray, ...]] = []
    window_bins = [0]
    for w, (lo, hi) in enumerate(zip(cuts.tolist(), [*cuts[1:].tolist(), len(gids)])):
        result = _plan_one_window(gids[lo:hi], lengths[lo:hi], capacity=capacity, align=align,
                                  algorithm=o.algorithm, too_long=too_long, max_seqs_per_bin=o.max_seqs_per_bin,
                                  seed=window_seed(o.seed, first_window + w), pool_size=o.pool_size,
                                  pool_strategy=o.pool_strategy, max_tokens=o.max_tokens, buckets=o.buckets,
                                  new_group=None if new_group is None else new_group[lo:hi])
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
    return PackPlan(
        window_bins=np.asarray(window_bins, dtype=np.int64),
        bin_offsets=np.concatenate(bin_offsets),
        piece_gid=cat(1), piece_start=cat(2), piece_len=cat(3), piece_padded=cat(4),
        dropped=dropped, truncated=truncated,
        tokens_dropped=int(lengths[over].sum()) if too_long == "drop" else 0,
        tokens_truncated=int((lengths[over] - capacity).sum()) if too_long == "truncate" else 0,
    )


def _plan_one_window(gids, lengths, *, capacity, align, algorithm, too_long, max_seqs_per_bin, seed, pool_size=128,
                     pool_strategy="closest", max_tokens=None, buckets=None, new_group=None):
    """One window -> (bin_offsets, piece gid, start, len, padded). With `new_group`, the
    algorithm packs whole groups (only groups of one can be over-long: plan_windows checked)."""
    padded = round_up(lengths, align)
    over = padded > capacity
    start = np.zeros(len(gids), np.int64)
    full_chunks = np.zeros(len(gids), np.int64)
    if too_long == "drop":
        keep = ~over
        gids, lengths, start, full_chunks = gids[keep], lengths[keep], start[keep], full_chunks[keep]
        new_group = None if new_group is None else new_group[keep]
    elif too_long == "truncate":
        lengths = np.where(over, capacity, lengths)
    elif too_long == "split" and algorithm != "split":
        # Full chunks of `capacity` fill a pack each; only the last piece is packed by the algorithm.
        full_chunks = np.where(over, (lengths - 1) // capacity, 0)
        start = full_chunks * capacity
        lengths = lengths - start
    item_padded = round_up(lengths, align)

    if algorithm == "batch":
        bins = batch_lengths(item_padded, max_tokens, max_seqs_per_bin=max_seqs_per_bin, buckets=buckets)
    elif new_group is not None:
        first = np.flatnonzero(new_group)
        size = np.diff(np.append(first, len(gids)))
        group_padded = np.add.reduceat(item_padded, first) if len(first) else item_padded
        bins = expand_items(pack_lengths(group_padded, capacity, algorithm, seed=seed, pool_size=pool_size,
                                         pool_strategy=pool_strategy), first, size, item_padded)
    else:
        bins = pack_lengths(item_padded, capacity, algorithm, max_seqs_per_bin=max_seqs_per_bin,
                            seed=seed, align=align, pool_size=pool_size, pool_strategy=pool_strategy)
    members = bins.members
    p_gid = gids[members]
    p_start = start[members] + bins.starts
    p_len = np.minimum(bins.lens, lengths[members] - bins.starts)
    p_padded = bins.lens.astype(np.int64)
    offsets = bins.offsets.astype(np.int64)
    if not full_chunks.any():
        return offsets, p_gid, p_start, p_len, p_padded

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
    return new_offsets, all_gid[take], all_start[take], all_len[take], all_padded[take]

