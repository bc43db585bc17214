"""Packing metrics, computed from arrays that any contract-conforming output holds.

With true lengths L (one per packed sequence), B packs, capacity C and align a:

    utilization          sum(L) / (B * C)
    waste_ratio          1 - utilization
    bin_balance          1 - stdev(load_b / C) / utilization      (load_b = true tokens of pack b)
    packing_efficiency   ceil(sum(round_up(L, a)) / C) / B          (1.0 = no pack more than needed)
    lower_bound_packs_l2 Martello-Toth L2 over the padded lengths (a tighter lower bound on B)
    padding_alignment    sum(round_up(L, a) - L)
    padding_tail         sum(pack_len_b) - sum(round_up(L, a))

Worked example: C = 8, a = 2, packs [3, 2] and [5] (pack lengths 8, 8):
    utilization 10/16 = 0.625, loads/C = [0.625, 0.625] -> bin_balance 1.0,
    padded lengths [4, 2] [6] -> ceil(12/8) = 2 bins needed, efficiency 2/2 = 1.0,
    padding_alignment 2 (3->4, 5->6), padding_tail 16 - 12 = 4.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from packctl.plan.align import round_up


def martello_toth_l2(lengths: np.ndarray, capacity: int) -> int:
    """Martello & Toth's L2 lower bound on the number of bins (>= ceil(sum/C), often tighter).

    For every threshold K in [0, C/2]: items above C-K each need a bin of their own (J1), items in
    (C/2, C-K] too (J2), and items in [K, C/2] (J3) can only use J2's free room, the rest needing
    new bins:  L(K) = |J1| + |J2| + max(0, ceil((sum J3 - (|J2| C - sum J2)) / C));  L2 = max_K L(K).

    lengths [6, 6, 6, 4, 4, 4], C = 10: ceil(30/10) = 3, but the three 6s need 3 bins whose free
    room 3*4 = 12 holds the 4s: L2 = 3; with lengths [7, 7, 7, 4, 4, 4] the 4s do not fit next to
    a 7, and L2 = 3 + ceil(12/10) = 5.
    """
    w = np.asarray(lengths, dtype=np.int64)
    if len(w) == 0:
        return 0
    if w.max() > capacity:
        raise ValueError("lengths above the capacity have no bin")
    counts = np.bincount(w, minlength=capacity + 1)
    # count_ge[x], sum_ge[x]: number and total size of items >= x, for x in [0, C + 1]
    count_ge = np.concatenate([np.cumsum(counts[::-1])[::-1], [0]])
    sum_ge = np.concatenate([np.cumsum((counts * np.arange(capacity + 1))[::-1])[::-1], [0]])
    half = capacity // 2
    k = np.arange(0, half + 1)
    j1 = count_ge[capacity - k + 1]  # items > C - K
    j2 = count_ge[half + 1] - j1  # items in (C/2, C - K]
    sum_j2 = sum_ge[half + 1] - sum_ge[capacity - k + 1]
    sum_j3 = sum_ge[k] - sum_ge[half + 1]  # items in [K, C/2]
    spill = sum_j3 - (j2 * capacity - sum_j2)
    extra = np.maximum(0, -(-spill // capacity))
    return int((j1 + j2 + extra).max())


def length_histogram(lengths: np.ndarray) -> dict[str, list[int]]:
    """Counts in power-of-two buckets [1,2) [2,4) [4,8) ...: {"edges": [...], "counts": [...]}."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) == 0:
        return {"edges": [1], "counts": []}
    top = int(np.ceil(np.log2(max(int(lengths.max()), 1) + 1)))
    edges = [2**k for k in range(top + 1)]
    counts = np.bincount(np.floor(np.log2(np.maximum(lengths, 1))).astype(np.int64), minlength=top)
    return {"edges": edges, "counts": counts[:top].tolist()}


def padded_batching_tokens(lengths: np.ndarray, batch_size: int) -> int:
    """Tokens computed by plain padded batching: consecutive batches of `batch_size` sequences,
    each padded to its longest. lengths [3, 5, 2, 2], batch 2 -> 2*5 + 2*2 = 14."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) == 0:
        return 0
    batch_size = max(1, int(batch_size))
    starts = np.arange(0, len(lengths), batch_size)
    maxima = np.maximum.reduceat(lengths, starts)
    sizes = np.diff(np.append(starts, len(lengths)))
    return int((maxima * sizes).sum())


def pack_metrics(seq_lens: np.ndarray, seq_offsets: np.ndarray, pack_lens: np.ndarray, *,
                 capacity: int, align: int, input_order: np.ndarray | None = None) -> dict[str, Any]:
    """Metrics of a packing.

    Args:
        seq_lens: true length of every packed sequence, pack by pack.
        seq_offsets: CSR offsets of the sequences of each pack (len B+1).
        pack_lens: length of each pack as written (capacity, or rounded to the pack multiple).
        capacity, align: the layout.
        input_order: permutation putting the sequences back in input (sample id) order, for the
            padded-batching baseline; None uses the packed order.
    """
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    seq_offsets = np.asarray(seq_offsets, dtype=np.int64)
    pack_lens = np.asarray(pack_lens, dtype=np.int64)
    packs = len(seq_offsets) - 1
    sequences = len(seq_lens)
    tokens = int(seq_lens.sum())
    padded = round_up(seq_lens, align)
    per_pack = np.diff(seq_offsets)
    loads = np.add.reduceat(seq_lens, seq_offsets[:-1]) if packs else np.zeros(0, np.int64)
    utilization = tokens / (packs * capacity) if packs else 0.0
    fill = loads / capacity
    balance = 1.0 - float(fill.std()) / utilization if packs and utilization > 0 else 0.0
    lower_bound = math.ceil(int(padded.sum()) / capacity)
    written = int(pack_lens.sum())
    mean_per_pack = sequences / packs if packs else 0.0
    baseline_lengths = seq_lens if input_order is None else seq_lens[input_order]
    baseline = padded_batching_tokens(baseline_lengths, round(mean_per_pack) or 1)
    return {
        "packs": packs,
        "sequences": sequences,
        "tokens": tokens,
        "capacity": capacity,
        "utilization": utilization,
        "waste_ratio": 1.0 - utilization if packs else 0.0,
        "bin_balance": balance,
        "packing_efficiency": lower_bound / packs if packs else 1.0,
        "lower_bound_packs": lower_bound,
        "lower_bound_packs_l2": martello_toth_l2(padded, capacity) if packs else 0,
        "padding": {
            "alignment_tokens": int((padded - seq_lens).sum()),
            "tail_tokens": written - int(padded.sum()),
            "written_tokens": written,
            "fraction_of_written": (written - tokens) / written if written else 0.0,
        },
        "sequences_per_pack": {
            "min": int(per_pack.min()) if packs else 0,
            "mean": mean_per_pack,
            "max": int(per_pack.max()) if packs else 0,
            "histogram": np.bincount(per_pack).tolist() if packs else [],
        },
        "length_histogram": length_histogram(seq_lens),
        "padded_batching": {
            "batch_size": round(mean_per_pack) or 1,
            "tokens": baseline,
            "packed_tokens": written,
            "estimated_gain": baseline / written if written else 0.0,
        },
    }
