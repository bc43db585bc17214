"""Shapes of the output rows: padded micro-batches (`--mode batch`) and shape buckets.

A padded micro-batch is `rows x padded_len` tokens: its sequences, longest first, each padded to
padded_len, then (with shape buckets) empty rows up to the bucket's fixed row count:

    max_tokens 12, sequences of 5 and 4 tokens, no buckets     padded_len 5, rows 2 (10 tokens)
        a a a a a
        b b b b .
    buckets [4, 8]: a sequence of 3 and one of 2 go to bucket 4, rows 12 // 4 = 3
        c c c .
        d d . .
        . . . .         an empty row (padding only)

`--shape-buckets K` picks the K lengths by `choose_buckets` (least padding); every micro-batch
then has one of K shapes, and so does every pack with `--pad-to multiple`.
"""
from __future__ import annotations

import numpy as np

from packctl.plan.align import round_up
from packctl.plan.windows import PackPlan


def planned_item_lengths(lengths: np.ndarray, capacity: int, align: int, too_long: str) -> np.ndarray:
    """The aligned lengths the planner will see for these sequences under the over-long policy
    (split: full chunks of `capacity` and the rest; truncate: capacity; drop: left out)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    over = round_up(lengths, align) > capacity
    if too_long == "drop":
        return round_up(lengths[~over], align)
    if too_long == "truncate":
        return round_up(np.where(over, capacity, lengths), align)
    if too_long == "split":
        chunks = np.where(over, (lengths - 1) // capacity, 0)
        rest = round_up(lengths - chunks * capacity, align)
        return np.concatenate([rest, np.full(int(chunks.sum()), capacity, np.int64)])
    return round_up(lengths, align)


def length_histogram(values: np.ndarray, align: int, top: int) -> np.ndarray:
    """Counts of each multiple of `align` up to `top` (index v // align): small enough to sum
    over ranks."""
    return np.bincount(np.asarray(values, dtype=np.int64) // align, minlength=top // align + 1)


def buckets_from_histogram(histogram: np.ndarray, align: int, k: int) -> np.ndarray:
    """`choose_buckets` over a histogram of aligned lengths."""
    from packctl.plan.algorithms import choose_buckets

    values = np.flatnonzero(histogram) * align
    return choose_buckets(values, histogram[histogram > 0], k)


def batch_shapes(plan: PackPlan, max_tokens: int, buckets: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """(padded_len, rows) of every micro-batch: the longest aligned sequence (or its bucket) and
    the number of sequences (or the bucket's fixed max_tokens // padded_len rows)."""
    if plan.num_bins == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    longest = np.maximum.reduceat(plan.piece_padded, plan.bin_offsets[:-1])
    count = np.diff(plan.bin_offsets)
    if buckets is None or len(buckets) == 0:
        return longest.astype(np.int64), count.astype(np.int64)
    padded_len = np.asarray(buckets, dtype=np.int64)[np.searchsorted(buckets, longest, side="left")]
    return padded_len, np.maximum(max_tokens // padded_len, count)


def with_row_length(plan: PackPlan, padded_len: np.ndarray) -> PackPlan:
    """The plan with every piece padded to its micro-batch's padded_len (one row each)."""
    return PackPlan(window_bins=plan.window_bins, bin_offsets=plan.bin_offsets, piece_gid=plan.piece_gid,
                    piece_start=plan.piece_start, piece_len=plan.piece_len,
                    piece_padded=np.repeat(np.asarray(padded_len, dtype=np.int64), np.diff(plan.bin_offsets)),
                    dropped=plan.dropped, truncated=plan.truncated, tokens_dropped=plan.tokens_dropped,
                    tokens_truncated=plan.tokens_truncated, piece_extra=plan.piece_extra, over_limit=plan.over_limit)


def shape_table(rows: np.ndarray, padded_len: np.ndarray) -> list[dict[str, int]]:
    """Distinct (rows, padded_len) with how many micro-batches have each, most frequent first."""
    if len(rows) == 0:
        return []
    pairs, counts = np.unique(np.stack([rows, padded_len], axis=1), axis=0, return_counts=True)
    return shape_rows({(int(r), int(p)): int(c) for (r, p), c in zip(pairs, counts)})


def shape_rows(counts: dict[tuple[int, int], int]) -> list[dict[str, int]]:
    """`shape_table` from {(rows, padded_len): micro-batches}: most frequent first, then by padded
    length, then by rows. {(2, 5): 1, (1, 8): 3} -> (1, 8) x3, then (2, 5) x1."""
    order = sorted(counts, key=lambda shape: (-counts[shape], shape[1], shape[0]))
    return [{"rows": r, "padded_len": p, "micro_batches": counts[(r, p)]} for r, p in order]
