"""Run under mpiexec: sample-sort random (key, gid) pairs and compare with a single-process sort.

    mpiexec -n 3 python samplesort_check.py N_TOTAL KEY_RANGE [N_TOTAL KEY_RANGE ...]

prints `ok 3 ranks: N_TOTAL keys in [0, KEY_RANGE)` for each pair (one launch, several sorts).
"""
import sys

import numpy as np

from packctl.mpi.comm import get_comm
from packctl.mpi.samplesort import redistribute, sample_sort


def check(comm, n_total: int, key_range: int) -> None:
    rng = np.random.default_rng(0)
    keys_all = rng.integers(0, key_range, n_total)
    gids_all = rng.permutation(n_total).astype(np.int64)
    # uneven shares, one rank possibly empty
    cuts = np.sort(rng.integers(0, n_total + 1, comm.size - 1))
    bounds = np.concatenate([[0], cuts, [n_total]])
    lo, hi = bounds[comm.rank], bounds[comm.rank + 1]
    keys, gids, payload = sample_sort(comm, keys_all[lo:hi], gids_all[lo:hi], payload=gids_all[lo:hi] * 10)
    assert (payload == gids * 10).all()
    parts = comm.allgather((keys, gids))
    got_keys = np.concatenate([p[0] for p in parts])
    got_gids = np.concatenate([p[1] for p in parts])
    order = np.lexsort((gids_all, keys_all))
    assert np.array_equal(got_keys, keys_all[order]), "keys out of order"
    assert np.array_equal(got_gids, gids_all[order]), "gids out of order"
    # redistribute to fixed ownership: position p -> rank p * size // n_total
    first = comm.exscan(len(keys))
    (k2, g2) = redistribute(comm, [keys, gids], first, lambda pos: pos * comm.size // n_total)
    mine = np.flatnonzero(np.arange(n_total) * comm.size // n_total == comm.rank)
    assert np.array_equal(g2, gids_all[order][mine]), "redistribute"
    if comm.rank == 0:
        print(f"ok {comm.size} ranks: {n_total} keys in [0, {key_range})", flush=True)


comm = get_comm()
args = [int(a) for a in sys.argv[1:]]
for n_total, key_range in zip(args[::2], args[1::2]):
    check(comm, n_total, key_range)
