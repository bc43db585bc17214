"""stats/whatif.py without an input: what each --too-long policy costs, and which row of the
what-if table is recommended."""
from __future__ import annotations

import numpy as np

from packctl.stats.whatif import _best, over_capacity


def test_what_each_too_long_policy_does_with_the_sequences_over_the_capacity():
    report = over_capacity(np.array([5, 10, 11, 25]), align=1, plan_capacity=10)
    assert report["sequences"] == 2 and report["tokens"] == 36 and report["token_share"] == 36 / 51
    assert report["tokens_lost"] == {"error": 0, "drop": 36, "truncate": 1 + 15, "split": 0}
    assert report["pieces_added"] == {"error": 0, "drop": 0, "truncate": 0, "split": 1 + 2}


def test_a_sequence_over_the_capacity_once_aligned_counts_as_over():
    # --pad-to multiple of 8: 9 tokens take 16, over a capacity of 12
    assert over_capacity(np.array([9, 8]), align=8, plan_capacity=12)["sequences"] == 1
    assert over_capacity(np.zeros(0, np.int64), align=1, plan_capacity=12)["token_share"] == 0.0


def _row(algorithm: str, utilization: float, split: int) -> dict:
    return {"algorithm": algorithm, "utilization": utilization, "counts": {"sequences_split": split}}


def test_the_best_row_splits_fewest_then_fills_most_then_is_the_preferred_algorithm():
    rows = [_row("ffd", 0.95, 0), _row("bfd", 0.97, 0), _row("split", 0.999, 40), _row("mffd", 0.97, 0)]
    assert _best(rows)["algorithm"] == "bfd"  # split fills more but cuts 40 sequences
    assert _best(rows, preferred="mffd")["algorithm"] == "mffd"  # tied with bfd: the configured one
    assert _best(rows, preferred="ffd")["algorithm"] == "bfd"  # ffd fills less
    assert _best([_row("split", 0.999, 40)])["algorithm"] == "split"
