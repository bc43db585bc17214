"""The sample sort's pieces that need no MPI: where each splitter cuts a sorted run, and how many
samples a rank draws (in-process ranks: tests/support/threadcomm.py)."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings, strategies as st

from packctl.mpi.samplesort import SAMPLES_HELD, _places, oversampling, sample_sort
from support.threadcomm import run_ranks


def _sorted_run(keys, gids):
    order = np.lexsort((gids, keys))
    return keys[order], gids[order]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 40)), max_size=60, unique=True),
       st.lists(st.tuples(st.integers(0, 6), st.integers(0, 40)), min_size=1, max_size=8))
def test_each_splitter_cuts_the_run_where_the_pairs_below_it_end(pairs, splitters):
    keys = np.array([k for k, _ in pairs], dtype=np.int64)
    gids = np.array([g for _, g in pairs], dtype=np.int64)
    keys, gids = _sorted_run(keys, gids)
    cuts = np.array(sorted(splitters), dtype=np.int64).reshape(-1, 2)
    below = [sum((k, g) < (int(s), int(t)) for k, g in zip(keys.tolist(), gids.tolist())) for s, t in cuts]
    assert _places(cuts, keys, gids).tolist() == below


def test_the_samples_held_stay_bounded_whatever_the_rank_count():
    for ranks in (1, 2, 8, 64, 511, 512, 1024, 4096, 65536):
        s = oversampling(ranks)
        assert 1 <= s <= 16
        assert s * ranks * ranks <= SAMPLES_HELD or s == 1
    assert oversampling(64) == 16 and oversampling(1024) == 4


def test_fewer_samples_sort_the_same():
    """The order never depends on the samples: one sample per rank gives the single-process order."""
    rng = np.random.default_rng(5)
    keys, gids = rng.integers(0, 50, 3000), np.arange(3000)
    want_keys, want_gids = _sorted_run(keys, gids)
    for oversample in (1, 16):
        parts = run_ranks(4, lambda comm: sample_sort(comm, keys[comm.rank::4], gids[comm.rank::4],
                                                      payload=gids[comm.rank::4] * 3, oversample=oversample))
        got_keys = np.concatenate([p[0] for p in parts])
        got_gids = np.concatenate([p[1] for p in parts])
        assert got_keys.tolist() == want_keys.tolist() and got_gids.tolist() == want_gids.tolist()
        assert np.concatenate([p[2] for p in parts]).tolist() == (want_gids * 3).tolist()
