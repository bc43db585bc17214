"""Dynamic batching (--mode batch): padded micro-batches instead of packs, and the bucket lengths
that pad least.

A micro-batch is rows of one padded length; it is grown, longest item first, while rows x padded
length stays within `max_tokens`. Max tokens 12:

    lengths [3, 8, 5, 4, 2]
    batch_lengths -> [8] (1 x 8)  [5 4] (2 x 5 = 10)  [3 2] (2 x 3 = 6)

With buckets (at most K allowed padded lengths, `choose_buckets`), a micro-batch pads to the
smallest bucket that holds its first item and takes only items of that bucket.
"""
from __future__ import annotations

import numpy as np

from packctl.jit import njit
from packctl.plan.bins import Bins, empty_bins, positive_int, validated_lengths


def batch_lengths(lengths, max_tokens: int, *, max_seqs_per_bin: int | None = None,
                  buckets: np.ndarray | None = None) -> Bins:
    """Padded micro-batches: items longest first (ties: lower index first), each micro-batch grown
    while rows x its padded length stays within `max_tokens`.

    Without `buckets` the padded length is the longest item (the first); with `buckets` (sorted
    allowed lengths, the largest >= every item) it is the smallest bucket that holds the first
    item, and a micro-batch only takes items of the same bucket (one shape per bucket).

        >>> bins = batch_lengths([3, 8, 5, 4, 2], 12)
        >>> bins.offsets.tolist(), bins.members.tolist()
        ([0, 1, 3, 5], [1, 2, 3, 0, 4])

    i.e. [8] (1 x 8), [5 4] (2 x 5 = 10), [3 2] (2 x 3 = 6): a third row of 5 would need 15 > 12.
    """
    max_tokens = positive_int(max_tokens, "max_tokens")
    lengths = validated_lengths(lengths, max_tokens, allow_longer=False)
    n = len(lengths)
    if n == 0:
        return empty_bins()
    max_seqs = max_seqs_per_bin if max_seqs_per_bin is not None else n + 1
    order = np.argsort(-lengths, kind="stable").astype(np.int64)
    sizes = lengths[order]
    if buckets is None:
        shape = sizes
    else:
        buckets = np.asarray(buckets, dtype=np.int64)
        shape = buckets[np.searchsorted(buckets, sizes, side="left")]
    starts = _batch_kernel(shape, max_tokens, max_seqs, buckets is not None)
    offsets = np.append(starts, n).astype(np.int64)
    return Bins(offsets, order, np.zeros(n, dtype=np.int64), lengths[order])


@njit(cache=True)
def _batch_kernel(shape, max_tokens, max_seqs, one_shape):
    # shape[i]: what item i would pad a micro-batch it opens to; items arrive longest first
    n = shape.size
    starts = np.empty(n, np.int64)
    num = 0
    rows_left = 0
    current = -1
    for i in range(n):
        if rows_left == 0 or (one_shape and shape[i] != current):
            starts[num] = i
            num += 1
            current = shape[i]
            rows_left = min(max_tokens // current, max_seqs)
        rows_left -= 1
    return starts[:num].copy()


def choose_buckets(values, counts, k: int) -> np.ndarray:
    """At most `k` lengths (the largest value among them) that minimize the padding
    sum(counts * (bucket(value) - value)), bucket(v) = the smallest chosen length >= v. Exact
    dynamic program over the distinct values, O(k u^2) for u distinct values.

        >>> choose_buckets([100, 110, 500, 510, 1000], [1, 1, 1, 1, 1], 3).tolist()
        [110, 510, 1000]
    """
    values = np.asarray(values, dtype=np.int64)
    counts = np.asarray(counts, dtype=np.float64)
    keep = counts > 0
    values, counts = values[keep], counts[keep]
    if len(values) == 0:
        return np.zeros(0, np.int64)
    order = np.argsort(values, kind="stable")
    values, counts = values[order], counts[order]
    distinct, inverse = np.unique(values, return_inverse=True)
    weight = np.bincount(inverse, weights=counts)
    if len(distinct) <= k:
        return distinct
    chosen = _bucket_dp(distinct.astype(np.float64), weight, k)
    return distinct[chosen]


@njit(cache=True)
def _bucket_dp(v, c, k):
    u = v.size
    cw = np.zeros(u + 1)
    cs = np.zeros(u + 1)
    for i in range(u):
        cw[i + 1] = cw[i] + c[i]
        cs[i + 1] = cs[i] + c[i] * v[i]
    inf = 1e300
    # best[m, j]: least padding of values 0..j with m+1 buckets, the last one at v[j]
    best = np.full((k, u), inf)
    back = np.full((k, u), -1, np.int64)
    for j in range(u):
        best[0, j] = v[j] * cw[j + 1] - cs[j + 1]
    for m in range(1, k):
        for j in range(m, u):
            for i in range(m - 1, j):
                cost = best[m - 1, i] + v[j] * (cw[j + 1] - cw[i + 1]) - (cs[j + 1] - cs[i + 1])
                if cost < best[m, j]:
                    best[m, j] = cost
                    back[m, j] = i
    m = 0
    for mm in range(k):
        if best[mm, u - 1] < best[m, u - 1]:
            m = mm
    out = np.empty(m + 1, np.int64)
    j = u - 1
    for t in range(m, -1, -1):
        out[t] = j
        j = back[t, j]
    return out
