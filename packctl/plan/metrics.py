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

`packctl stats` reports these same functions (docs/stats.md), plus:

    fill_histogram       packs by load_b / C: [0, 0.1) ... [0.9, 0.95) [0.95, 0.99) [0.99, 1.0]
    length_summary       min, mean, max and percentiles (inverted CDF: the smallest length L with
                         at least q% of the lengths <= L)
    dp_balance           per training step, max over DP ranks / mean over DP ranks of the tokens
                         and of the attention cost sum(a*L + L^2) of the packs each rank gets
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
    """Sequences and their tokens in power-of-two buckets [1,2) [2,4) [4,8) ...:
    {"edges": [...], "counts": [...], "tokens": [...]}. Lengths [1, 3, 3] -> edges [1, 2, 4],
    counts [1, 2], tokens [1, 6]: few long sequences can hold most of the tokens."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) == 0:
        return {"edges": [1], "counts": [], "tokens": []}
    top = int(np.ceil(np.log2(max(int(lengths.max()), 1) + 1)))
    edges = [2**k for k in range(top + 1)]
    bucket = np.floor(np.log2(np.maximum(lengths, 1))).astype(np.int64)
    counts = np.bincount(bucket, minlength=top)
    tokens = np.bincount(bucket, weights=lengths, minlength=top).astype(np.int64)
    return {"edges": edges, "counts": counts[:top].tolist(), "tokens": tokens[:top].tolist()}


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
    loads = pack_loads(seq_lens, seq_offsets)
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


def pack_loads(values: np.ndarray, seq_offsets: np.ndarray) -> np.ndarray:
    """Per-pack sums of a per-sequence value: values [3, 2, 5], offsets [0, 2, 3] -> [5, 5].

    The result has the dtype of `values` (int64 for lengths, float64 for costs); a pack without
    sequences sums to 0.
    """
    values = np.asarray(values)
    seq_offsets = np.asarray(seq_offsets, dtype=np.int64)
    cumulative = np.concatenate([np.zeros(1, values.dtype if values.size else np.int64), np.cumsum(values)])
    return cumulative[seq_offsets[1:]] - cumulative[seq_offsets[:-1]]


# Per mille. Finer near full, where good packings put nearly every pack.
FILL_EDGES = (0, 100, 200, 300, 400, 500, 600, 700, 800, 900, 950, 990, 1000)


def fill_histogram(loads: np.ndarray, capacity: int) -> dict[str, list]:
    """Packs by fill `load / capacity` in the buckets [0, 0.1) [0.1, 0.2) ... [0.9, 0.95)
    [0.95, 0.99) [0.99, 1.0]: finer near full, where a good packing puts nearly every pack.

    loads [9, 9, 16, 14, 7], capacity 16 (fills .5625 .5625 1.0 .875 .4375)
    -> counts [0, 0, 0, 0, 1, 2, 0, 0, 1, 0, 0, 1] over edges [0.0, 0.1, ..., 0.9, 0.95, 0.99, 1.0].
    """
    loads = np.asarray(loads, dtype=np.int64)
    # Integer per mille: in floating point 0.3 * 10 is not 3.
    per_mille = loads * 1000 // capacity
    bucket = np.minimum(np.searchsorted(FILL_EDGES, per_mille, side="right") - 1, len(FILL_EDGES) - 2)
    return {"edges": [e / 1000 for e in FILL_EDGES],
            "counts": np.bincount(bucket, minlength=len(FILL_EDGES) - 1)[:len(FILL_EDGES) - 1].tolist()}


PERCENTILES = (10, 50, 90, 99, 99.9)


def length_summary(lengths: np.ndarray) -> dict[str, Any]:
    """min, mean, max and the percentiles of PERCENTILES, by the inverted CDF (always a length of
    the data): lengths [1, 2, 3, 4, 100] -> p50 3, p90 100, p10 1."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) == 0:
        return {"min": 0, "mean": 0.0, "max": 0, "percentiles": {f"p{q:g}": 0 for q in PERCENTILES}}
    values = np.percentile(lengths, PERCENTILES, method="inverted_cdf")
    return {
        "min": int(lengths.min()),
        "mean": float(lengths.mean()),
        "max": int(lengths.max()),
        "percentiles": {f"p{q:g}": int(v) for q, v in zip(PERCENTILES, values)},
    }


def attention_cost(lengths: np.ndarray, attn_coeff: float) -> np.ndarray:
    """Compute cost of each sequence, `a*L + L^2` (float64): the L^2 term is causal attention,
    `a*L` the per-token work. For a transformer layer of hidden size h, a = 12*h puts both in the
    same unit (forward FLOPs 24*L*h^2 for the projections and MLP, 2*L^2*h for causal attention)."""
    lengths = np.asarray(lengths, dtype=np.float64)
    return attn_coeff * lengths + lengths * lengths


def dp_balance(step: np.ndarray, dp_rank: np.ndarray, token_loads: np.ndarray, attention_loads: np.ndarray, *,
               attn_coeff: float, micro_batch: np.ndarray | None = None) -> dict[str, Any]:
    """Data-parallel imbalance of balanced packs, step by step.

    Every pack has a `step` and a `dp_rank`; rank r's load at step s is the sum over its packs. The
    imbalance of a step is max over ranks / mean over ranks (ranks 0 .. max(dp_rank), a rank without
    packs at that step counts 0): 1.0 is perfect, 2.0 means the slowest rank does twice the average,
    so the others wait half the step.

    packs (step, rank, tokens): (0, 0, 9) (0, 1, 9) (1, 0, 16) (1, 1, 14) (2, 0, 7)
    -> tokens per step 9/9 = 1.0, 16/15, 7/3.5 = 2.0: mean 1.356, max 2.0 at step 2.
    """
    step = np.asarray(step, dtype=np.int64)
    dp_rank = np.asarray(dp_rank, dtype=np.int64)
    if len(step) == 0:
        return {"attn_coeff": attn_coeff, "steps": 0, "dp_size": 0, "micro_batches": 0,
                "tokens": {"mean": 1.0, "max": 1.0, "worst_step": None},
                "attention": {"mean": 1.0, "max": 1.0, "worst_step": None},
                "per_step": {"step": [], "tokens": [], "attention": []}}
    steps, step_index = np.unique(step, return_inverse=True)
    dp_size = int(dp_rank.max()) + 1
    cell = step_index * dp_size + dp_rank

    def imbalance(loads: np.ndarray) -> np.ndarray:
        grid = np.bincount(cell, weights=np.asarray(loads, dtype=np.float64),
                           minlength=len(steps) * dp_size).reshape(len(steps), dp_size)
        return grid.max(axis=1) / grid.mean(axis=1)

    def summary(per_step: np.ndarray) -> dict[str, Any]:
        worst = int(np.argmax(per_step))
        return {"mean": float(per_step.mean()), "max": float(per_step[worst]), "worst_step": int(steps[worst])}

    tokens = imbalance(token_loads)
    attention = imbalance(attention_loads)
    return {
        "attn_coeff": attn_coeff,
        "steps": len(steps),
        "dp_size": dp_size,
        "micro_batches": int(np.asarray(micro_batch).max()) + 1 if micro_batch is not None else None,
        "tokens": summary(tokens),
        "attention": summary(attention),
        "per_step": {"step": steps.tolist(), "tokens": tokens.tolist(), "attention": attention.tolist()},
    }


def batch_metrics(seq_lens: np.ndarray, seq_offsets: np.ndarray, rows: np.ndarray, batch_lens: np.ndarray, *,
                  max_tokens: int, input_order: np.ndarray | None = None) -> dict[str, Any]:
    """Padded micro-batches (`--mode batch`): shapes, padding, and the padding of naive batching
    (the same mean number of sequences per batch, in input order, each batch padded to its
    longest sequence).

    rows [2, 1], batch_lens [10, 8] (padded_len 5 and 8), seq_lens [5, 4, 8]
    -> 18 tokens written for 17: padding 1 (5.6%).
    """
    from packctl.plan.shapes import shape_table

    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    rows = np.asarray(rows, dtype=np.int64)
    batch_lens = np.asarray(batch_lens, dtype=np.int64)
    batches = len(rows)
    written = int(batch_lens.sum())
    tokens = int(seq_lens.sum())
    padded_len = np.where(rows > 0, batch_lens // np.maximum(rows, 1), 0)
    mean_seqs = len(seq_lens) / batches if batches else 0.0
    naive_lengths = seq_lens if input_order is None else seq_lens[input_order]
    naive = padded_batching_tokens(naive_lengths, round(mean_seqs) or 1)
    shapes = shape_table(rows, padded_len)
    return {
        "micro_batches": batches,
        "max_tokens": max_tokens,
        "sequences_per_batch": {"min": int(np.diff(seq_offsets).min()) if batches else 0, "mean": mean_seqs,
                                "max": int(np.diff(seq_offsets).max()) if batches else 0},
        "distinct_shapes": len(shapes),
        "shapes": shapes,
        "written_tokens": written,
        "padding_tokens": written - tokens,
        "padding_fraction": (written - tokens) / written if written else 0.0,
        "empty_rows": int(rows.sum() - len(seq_lens)),
        "naive": {"batch_size": round(mean_seqs) or 1, "written_tokens": naive,
                  "padding_fraction": (naive - tokens) / naive if naive else 0.0},
        "padding_saved_vs_naive": 1.0 - (written - tokens) / (naive - tokens) if naive > tokens else 0.0,
    }
