"""Distributed sample sort of (key, gid) int64 pairs, with a payload that travels along.

    rank 0: keys [5, 1, 9]   rank 1: keys [2, 8, 3, 7]
    1. sort locally                      [1, 5, 9]          [2, 3, 7, 8]
    2. regular samples, allgathered      (evenly spaced in each run) -> sorted -> p-1 splitters
    3. cut each local run at the splitters, Alltoall the counts, Alltoallv the pairs
    4. merge the sorted runs that arrived rank 0: [1, 2, 3, 5]   rank 1: [7, 8, 9]

Step 4 is a k-way merge, not a sort: what arrives is one sorted run per source rank, and a stable
sort by key (timsort, which finds and merges runs) of the runs laid end to end orders them in
O(n log k); 5-7x faster than sorting 8M pairs afresh (benchmarks/bench_mpi.py). Ties in key keep
the source order, which is gid order when each rank's gids are below the next rank's (as scan
gives them); otherwise the pairs are sorted afresh.

Ties in key are broken by gid, so the global order is a total order that does not depend on the
number of ranks: rank r ends up with a contiguous range of it, rank r's range before rank r+1's.
"""
from __future__ import annotations

import numpy as np


def _lex_order(keys: np.ndarray, gids: np.ndarray) -> np.ndarray:
    """Order of (key, gid) pairs. Distinct keys (shuffle's hashes) need no tie-break, and a plain
    argsort is 3-4x faster than lexsort; with ties (curriculum lengths) lexsort decides."""
    order = np.argsort(keys)
    ranked = keys[order]
    if (ranked[1:] != ranked[:-1]).all():
        return order
    return np.lexsort((gids, keys))


# The samples every rank holds while choosing splitters: at most this many (key, gid) pairs in
# all (64 MiB), so that what each rank holds does not grow with the square of the rank count.
SAMPLES_HELD = 1 << 22


def oversampling(ranks: int, oversample: int = 16) -> int:
    """Samples each rank draws per rank: `oversample`, fewer where `oversample * ranks**2` samples
    would exceed SAMPLES_HELD, and at least 1. The sorted order never depends on it, only how
    evenly the sort's buckets come out: with s samples per rank, no bucket exceeds n/p + n/s.

        >>> oversampling(8), oversampling(512), oversampling(1024), oversampling(4096)
        (16, 16, 4, 1)
    """
    return max(1, min(oversample, SAMPLES_HELD // (ranks * ranks)))


def sample_sort(comm, keys: np.ndarray, gids: np.ndarray, payload: np.ndarray | None = None,
                oversample: int = 16) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Globally sort (key, gid) pairs over the ranks of `comm`; `payload` (int64, one per pair, or
    one row of m per pair: n x m) moves with its pair. Returns this rank's contiguous part of the
    sorted sequence. Each rank draws `oversampling(ranks, oversample) * ranks` samples."""
    keys = np.asarray(keys, dtype=np.int64)
    gids = np.asarray(gids, dtype=np.int64)
    order = _lex_order(keys, gids)
    keys, gids = keys[order], gids[order]
    if payload is not None:
        payload = np.asarray(payload, dtype=np.int64)[order]
    if comm.size == 1:
        return keys, gids, payload

    # Regular sampling: `oversampling * p` evenly spaced pairs of each sorted run.
    p = comm.size
    picks = np.linspace(0, len(keys), oversampling(p, oversample) * p, endpoint=False).astype(np.int64) \
        if len(keys) else []
    samples = np.stack([keys[picks], gids[picks]], axis=1) if len(keys) else np.zeros((0, 2), np.int64)
    every = np.concatenate(comm.allgather(samples))
    every = every[_lex_order(every[:, 0], every[:, 1])]
    if len(every):
        at = (np.arange(1, p) * len(every)) // p
        splitters = every[at]
    else:
        splitters = np.zeros((p - 1, 2), np.int64)
    # The run is sorted by (key, gid): rank r gets the pairs from the r-th splitter's place on.
    counts = np.diff(np.concatenate([[0], _places(splitters, keys, gids), [len(keys)]])).astype(np.int64)
    width = 0 if payload is None else 1 if payload.ndim == 1 else payload.shape[1]
    rows = np.zeros((len(keys), 0), np.int64) if payload is None else payload.reshape(len(keys), width)
    columns = [keys, gids, *rows.T]
    packed = np.stack(columns, axis=1).ravel()  # already grouped by destination: the run is sorted
    recv, recv_counts = comm.alltoallv(packed, counts * len(columns))
    recv = recv.reshape(-1, len(columns))
    merged = recv[merge_runs(recv[:, 0], recv[:, 1], recv_counts // len(columns))]
    if payload is None:
        return merged[:, 0].copy(), merged[:, 1].copy(), None
    moved = merged[:, 2:].copy()
    return merged[:, 0].copy(), merged[:, 1].copy(), moved if payload.ndim == 2 else moved[:, 0]


def merge_runs(keys: np.ndarray, gids: np.ndarray, run_lengths: np.ndarray) -> np.ndarray:
    """Order of (key, gid) pairs laid out as consecutive runs, each sorted by (key, gid).
    Runs [1, 5] [2, 9] -> keys [1, 5, 2, 9] -> order [0, 2, 1, 3]."""
    run_lengths = np.asarray(run_lengths, dtype=np.int64)
    starts = (np.cumsum(run_lengths) - run_lengths)[run_lengths > 0]
    lowest = np.minimum.reduceat(gids, starts) if len(gids) else gids
    highest = np.maximum.reduceat(gids, starts) if len(gids) else gids
    if (lowest[1:] > highest[:-1]).all():  # gid ranges in run order: ties in key resolve to gid order
        return np.argsort(keys, kind="stable")
    return _lex_order(keys, gids)


def _places(splitters: np.ndarray, keys: np.ndarray, gids: np.ndarray) -> np.ndarray:
    """For each splitter (key, gid): the number of pairs of the (key, gid)-sorted run that are
    below it, by binary search (O(p log n)). Run (1,0) (2,5) (2,7) (3,1), splitter (2,6) -> 2."""
    lo = np.searchsorted(keys, splitters[:, 0], side="left")
    hi = np.searchsorted(keys, splitters[:, 0], side="right")
    return np.array([a + int(np.searchsorted(gids[a:b], g, side="left"))
                     for a, b, g in zip(lo.tolist(), hi.tolist(), splitters[:, 1].tolist())], dtype=np.int64)


def redistribute(comm, values: list[np.ndarray], first_position: int, owner_of_position) -> list[np.ndarray]:
    """Move rows of a globally ordered sequence (this rank holds positions
    [first_position, first_position + len)) to the rank that owns each position
    (`owner_of_position(positions) -> ranks`, non-decreasing). Columns are int64 arrays."""
    n = len(values[0])
    positions = first_position + np.arange(n, dtype=np.int64)
    dest = owner_of_position(positions) if n else np.zeros(0, np.int64)
    counts = np.bincount(dest, minlength=comm.size).astype(np.int64)
    packed = np.stack(values, axis=1).ravel() if n else np.zeros(0, np.int64)
    recv, _ = comm.alltoallv(packed, counts * len(values))
    recv = recv.reshape(-1, len(values))
    return [recv[:, k].copy() for k in range(len(values))]
