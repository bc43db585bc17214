"""Packing metrics, computed from arrays that any contract-conforming output holds.

With true lengths L (one per packed sequence), B packs, capacity C and align a:

    utilization          sum(L) / (B * C)
    waste_ratio          1 - utilization
    bin_balance          1 - stdev(load_b / C) / utilization      (load_b = true tokens of pack b)
                         = 1 - sqrt(B * sum(load_b^2) - sum(L)^2) / sum(L), from exact integer sums
    packing_efficiency   ceil(sum(round_up(L, a)) / C) / B          (1.0 = no pack more than needed)
    lower_bound_packs_l2 Martello-Toth L2 over the padded lengths (a tighter lower bound on B)
    padding_alignment    sum(round_up(L, a) - L)
    padding_tail         sum(pack_len_b) - sum(round_up(L, a))

Worked example: C = 8, a = 2, packs [3, 2] and [5] (pack lengths 8, 8):
    utilization 10/16 = 0.625, loads/C = [0.625, 0.625] -> bin_balance 1.0,
    padded lengths [4, 2] [6] -> ceil(12/8) = 2 bins needed, efficiency 2/2 = 1.0,
    padding_alignment 2 (3->4, 5->6), padding_tail 16 - 12 = 4.

Every figure comes from a `PackSummary`: exact integer sums, exact histograms over bounded domains
(padded lengths 0..C, sequences per pack, power-of-two length buckets), so the summaries of the
packs of every rank merge (`+`) into the figures of all packs, the same to the last digit whatever
the number of ranks. The one figure that needs the packs in input order, the padded-batching
baseline, is computed apart (`padded_batching_tokens`; pipeline/report.py over ranks).

`packctl stats` reports these same functions (docs/stats.md), plus:

    fill_histogram       packs by load_b / C: [0, 0.1) ... [0.9, 0.95) [0.95, 0.99) [0.99, 1.0]
    length_summary       min, mean, max and percentiles (inverted CDF: the smallest length L with
                         at least q% of the lengths <= L)
    dp_balance           per training step, max over DP ranks / mean over DP ranks of the tokens
                         and of the attention cost sum(a*L + L^2) of the packs each rank gets
"""
from __future__ import annotations

import math
from dataclasses import dataclass
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
    return martello_toth_l2_of_counts(np.bincount(w, minlength=capacity + 1), capacity)


def martello_toth_l2_of_counts(counts: np.ndarray, capacity: int) -> int:
    """`martello_toth_l2` from the histogram of the lengths (`counts[x]`: items of length x):
    the histograms of several runs of packs add up to that of all of them."""
    counts = np.asarray(counts, dtype=np.int64)
    if not counts.any():
        return 0
    if len(counts) > capacity + 1 and counts[capacity + 1:].any():
        raise ValueError("lengths above the capacity have no bin")
    counts = counts[:capacity + 1]
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
    counts, tokens = length_buckets(lengths)
    return length_histogram_of_buckets(counts, tokens)


LENGTH_BUCKETS = 64  # [2^k, 2^(k+1)) for k < 64: every int64 length (0 counts in [1, 2))


def length_buckets(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sequences and tokens in each of the LENGTH_BUCKETS power-of-two buckets: the histograms
    of several runs add up to that of all of them. Lengths [1, 3, 3] -> counts [1, 2, 0, ...],
    tokens [1, 6, 0, ...]."""
    lengths = np.asarray(lengths, dtype=np.int64)
    bucket = np.floor(np.log2(np.maximum(lengths, 1))).astype(np.int64)
    counts = np.bincount(bucket, minlength=LENGTH_BUCKETS)
    tokens = np.bincount(bucket, weights=lengths, minlength=LENGTH_BUCKETS).astype(np.int64)
    return counts, tokens


def length_histogram_of_buckets(counts: np.ndarray, tokens: np.ndarray) -> dict[str, list[int]]:
    """`length_histogram` from `length_buckets`: buckets up to the longest length's."""
    filled = np.flatnonzero(counts)
    if len(filled) == 0:
        return {"edges": [1], "counts": [], "tokens": []}
    top = int(filled[-1]) + 1
    return {"edges": [2**k for k in range(top + 1)], "counts": [int(c) for c in counts[:top]],
            "tokens": [int(t) for t in tokens[:top]]}


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
    summary = PackSummary.of(seq_lens, seq_offsets, pack_lens, capacity=capacity, align=align)
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    baseline_lengths = seq_lens if input_order is None else seq_lens[input_order]
    return summary.metrics(padded_batching_tokens(baseline_lengths, summary.baseline_batch_size))


@dataclass
class PackSummary:
    """What `pack_metrics` (and `batch_metrics`) need of a run of packs, as exact integer sums and
    histograms over bounded domains: the summaries of consecutive runs add up (`a + b`) to the
    summary of all of them, so each rank summarizes its own packs and the sum gives the figures of
    the whole output, to the last digit (`metrics`), without any rank holding every pack.

        packs [3, 2] [5], capacity 8, align 2: packs 2, sequences 3, tokens 10, padded_tokens 12,
        loads_squared 5^2 + 5^2 = 50, padded_counts[2] = padded_counts[4] = padded_counts[6] = 1
    """

    capacity: int
    packs: int
    sequences: int
    tokens: int
    padded_tokens: int
    written_tokens: int
    loads_squared: int  # sum over packs of (true tokens of the pack)^2: the spread of the fill
    padded_counts: np.ndarray  # int64, capacity + 1 (or more): pieces of each padded length
    per_pack_counts: np.ndarray  # int64: packs of each number of sequences
    length_counts: np.ndarray  # int64, LENGTH_BUCKETS: `length_buckets` of the true lengths
    length_tokens: np.ndarray
    # --mode batch: rows of every micro-batch summed, and micro-batches of each (rows, padded_len)
    rows: int = 0
    shapes: dict[tuple[int, int], int] | None = None

    @classmethod
    def of(cls, seq_lens: np.ndarray, seq_offsets: np.ndarray, pack_lens: np.ndarray, *, capacity: int,
           align: int, rows: np.ndarray | None = None) -> "PackSummary":
        """The summary of these packs (arguments as for `pack_metrics`); `rows`: the rows of each
        micro-batch (--mode batch), whose padded length is its written length / rows."""
        seq_lens = np.asarray(seq_lens, dtype=np.int64)
        seq_offsets = np.asarray(seq_offsets, dtype=np.int64)
        pack_lens = np.asarray(pack_lens, dtype=np.int64)
        padded = round_up(seq_lens, align)
        loads = pack_loads(seq_lens, seq_offsets)
        counts, tokens = length_buckets(seq_lens)
        shapes = None
        if rows is not None:
            rows = np.asarray(rows, dtype=np.int64)
            padded_len = np.where(rows > 0, pack_lens // np.maximum(rows, 1), 0)
            shapes = {}
            if len(rows):
                pairs, times = np.unique(np.stack([rows, padded_len], axis=1), axis=0, return_counts=True)
                shapes = {(int(r), int(p)): int(t) for (r, p), t in zip(pairs, times)}
        return cls(capacity=capacity, packs=len(seq_offsets) - 1, sequences=len(seq_lens), tokens=int(seq_lens.sum()),
                   padded_tokens=int(padded.sum()), written_tokens=int(pack_lens.sum()),
                   loads_squared=exact_sum_of_squares(loads),
                   padded_counts=np.bincount(padded, minlength=capacity + 1).astype(np.int64),
                   per_pack_counts=np.bincount(np.diff(seq_offsets)).astype(np.int64) if len(seq_offsets) > 1
                   else np.zeros(0, np.int64),
                   length_counts=counts.astype(np.int64), length_tokens=tokens,
                   rows=int(rows.sum()) if rows is not None else 0, shapes=shapes)

    def __add__(self, other: "PackSummary") -> "PackSummary":
        shapes = None
        if self.shapes is not None or other.shapes is not None:
            shapes = dict(self.shapes or {})
            for shape, times in (other.shapes or {}).items():
                shapes[shape] = shapes.get(shape, 0) + times
        return PackSummary(
            capacity=self.capacity, packs=self.packs + other.packs, sequences=self.sequences + other.sequences,
            tokens=self.tokens + other.tokens, padded_tokens=self.padded_tokens + other.padded_tokens,
            written_tokens=self.written_tokens + other.written_tokens,
            loads_squared=self.loads_squared + other.loads_squared,
            padded_counts=_add_counts(self.padded_counts, other.padded_counts),
            per_pack_counts=_add_counts(self.per_pack_counts, other.per_pack_counts),
            length_counts=self.length_counts + other.length_counts, length_tokens=self.length_tokens + other.length_tokens,
            rows=self.rows + other.rows, shapes=shapes)

    @property
    def baseline_batch_size(self) -> int:
        """Sequences per batch of the padded-batching baseline: the mean per pack, rounded."""
        return round(self.sequences / self.packs if self.packs else 0.0) or 1

    def metrics(self, baseline_tokens: int) -> dict[str, Any]:
        """`pack_metrics` of the summarized packs; `baseline_tokens`: `padded_batching_tokens` of
        their lengths in input order, in batches of `baseline_batch_size`."""
        packs, sequences, tokens, capacity = self.packs, self.sequences, self.tokens, self.capacity
        utilization = tokens / (packs * capacity) if packs else 0.0
        # stdev(load / C) / utilization = sqrt(B * sum(load^2) - sum(load)^2) / sum(load), in integers
        spread = packs * self.loads_squared - tokens * tokens
        balance = 1.0 - math.sqrt(spread) / tokens if packs and tokens > 0 else 0.0
        lower_bound = math.ceil(self.padded_tokens / capacity)
        written = self.written_tokens
        mean_per_pack = sequences / packs if packs else 0.0
        filled = np.flatnonzero(self.per_pack_counts)
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
            "lower_bound_packs_l2": martello_toth_l2_of_counts(self.padded_counts, capacity) if packs else 0,
            "padding": {
                "alignment_tokens": self.padded_tokens - tokens,
                "tail_tokens": written - self.padded_tokens,
                "written_tokens": written,
                "fraction_of_written": (written - tokens) / written if written else 0.0,
            },
            "sequences_per_pack": {
                "min": int(filled[0]) if packs else 0,
                "mean": mean_per_pack,
                "max": int(filled[-1]) if packs else 0,
                "histogram": [int(c) for c in self.per_pack_counts[:filled[-1] + 1]] if packs else [],
            },
            "length_histogram": length_histogram_of_buckets(self.length_counts, self.length_tokens),
            "padded_batching": {
                "batch_size": self.baseline_batch_size,
                "tokens": baseline_tokens,
                "packed_tokens": written,
                "estimated_gain": baseline_tokens / written if written else 0.0,
            },
        }

    def batch_metrics(self, baseline_tokens: int, max_tokens: int) -> dict[str, Any]:
        """`batch_metrics` of the summarized micro-batches (made `of(..., rows=...)`)."""
        from packctl.plan.shapes import shape_rows

        batches, tokens, written = self.packs, self.tokens, self.written_tokens
        mean_seqs = self.sequences / batches if batches else 0.0
        naive = baseline_tokens
        filled = np.flatnonzero(self.per_pack_counts)
        shapes = shape_rows(self.shapes or {})
        return {
            "micro_batches": batches,
            "max_tokens": max_tokens,
            "sequences_per_batch": {"min": int(filled[0]) if batches else 0, "mean": mean_seqs,
                                    "max": int(filled[-1]) if batches else 0},
            "distinct_shapes": len(shapes),
            "shapes": shapes,
            "written_tokens": written,
            "padding_tokens": written - tokens,
            "padding_fraction": (written - tokens) / written if written else 0.0,
            "empty_rows": self.rows - self.sequences,
            "naive": {"batch_size": self.baseline_batch_size, "written_tokens": naive,
                      "padding_fraction": (naive - tokens) / naive if naive else 0.0},
            "padding_saved_vs_naive": 1.0 - (written - tokens) / (naive - tokens) if naive > tokens else 0.0,
        }


def _add_counts(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Two histograms over 0, 1, 2, ... of any lengths, added."""
    if len(a) < len(b):
        a, b = b, a
    out = a.copy()
    out[:len(b)] += b
    return out


def exact_sum_of_squares(values: np.ndarray) -> int:
    """sum(v^2) of non-negative int64 values below 2^31, exactly (a Python int): each square fits
    int64, and their high and low 32-bit halves are summed apart so no sum overflows.
    [3, 4] -> 25."""
    values = np.asarray(values, dtype=np.int64)
    squares = values * values
    return (int((squares >> 32).sum()) << 32) + int((squares & 0xFFFFFFFF).sum())


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
    summary = PackSummary.of(seq_lens, seq_offsets, batch_lens, capacity=max_tokens, align=1, rows=rows)
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    naive_lengths = seq_lens if input_order is None else seq_lens[input_order]
    return summary.batch_metrics(padded_batching_tokens(naive_lengths, summary.baseline_batch_size), max_tokens)
