"""stats/packed.py without an output: the figures `packctl stats` computes from the small columns of
the packs (PackedArrays built by hand), worked through on a few packs."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from packctl.stats.packed import (ORDER_BOUND, PackedArrays, binding_budget, limit_figures, longest_per_pack,
                                  order_quality, pack_fingerprints, window_of_pack)


def _packed(*packs: list[int], ids: list[list[int]] | None = None) -> PackedArrays:
    """Packs of the given sequence lengths; sample ids numbered through the packs unless given."""
    lens = np.array([n for p in packs for n in p], np.int64)
    ids = np.array([g for p in ids for g in p] if ids else np.arange(len(lens)), np.int64)
    offsets = np.concatenate([[0], np.cumsum([len(p) for p in packs])]).astype(np.int64)
    loads = np.array([sum(p) for p in packs], np.int64)
    return PackedArrays(seq_lens=lens, seq_offsets=offsets, sample_ids=ids, num_tokens=loads, pack_lens=loads,
                        balance=None)


def test_the_longest_sequence_of_each_pack():
    assert longest_per_pack(_packed([3, 9, 1], [4], [2, 2])).tolist() == [9, 4, 2]
    assert longest_per_pack(_packed()).tolist() == []


def test_a_pack_fingerprint_is_the_set_of_its_sample_ids():
    a = pack_fingerprints(_packed([1, 1], [1], ids=[[4, 9], [7]]))
    b = pack_fingerprints(_packed([1], [1, 1], ids=[[7], [9, 4]]))
    assert a.dtype == np.uint64 and a.tolist() == b[::-1].tolist()  # the same packs, in another order
    assert pack_fingerprints(_packed([1, 1], ids=[[4, 8]]))[0] != a[0]


def test_packs_get_the_window_their_shard_opens_or_continues():
    shards = [SimpleNamespace(rows=r) for r in (2, 1, 3)]
    assert window_of_pack({"window_starts": [0, 2]}, shards).tolist() == [0, 0, 0, 1, 1, 1]
    assert window_of_pack({"window_starts": [2]}, shards).tolist() == [0, 0, 0, 1, 1, 1]  # shard 0 opens one
    assert window_of_pack({}, shards) is None
    assert window_of_pack({"window_starts": [0, True]}, shards) is None  # not written by packctl


def test_order_quality_of_the_docstring():
    quality = order_quality(np.array([900, 500, 300, 100]), None)
    assert quality["spearman_overall"] == pytest.approx(-1.0)
    assert quality["windows"] == 1 and quality["windows_recorded"] is False and quality["window_unit"] == "packs"


def test_order_quality_judges_each_window_and_counts_tiny_ones_apart():
    from packctl.plan.pack_order import TINY_WINDOW

    descending = np.arange(TINY_WINDOW, 0, -1)
    longest = np.concatenate([descending, [5, 1]])  # a whole window sorted, then a window of 2 packs
    window = np.array([0] * TINY_WINDOW + [1, 1])
    quality = order_quality(longest, window)
    assert quality["windows"] == 2 and quality["tiny_windows"] == 1
    assert quality["worst_window"] == 0 and quality["worst_abs_spearman"] == pytest.approx(1.0)
    assert quality["windows_over_bound"] == 1 and quality["bound"] == ORDER_BOUND


def test_limit_figures_of_the_docstring():
    figures = limit_figures(np.array([10, 4]), 10, {"images": np.array([1, 8])}, {"images": 8})
    assert figures == {"limits": {"images": {"limit": 8, "total": 9, "utilization": 9 / 16, "packs_at_limit": 1}},
                       "packs_at_capacity": 1, "binding": "tokens"}


@pytest.mark.parametrize("tokens, limits, binding", [
    (28, {"images": {"limit": 8, "total": 17}, "image_tokens": {"limit": 8, "total": 23}}, "image_tokens"),
    (30, {"images": {"limit": 8, "total": 17}}, "tokens"),       # 3 packs each: tokens are fuller (3.0 > 2.1)
    (20, {"images": {"limit": 8, "total": 16}}, "tokens"),       # 2 packs each, equally full: tokens first
    (0, {"images": {"limit": 8, "total": 0}}, None),             # nothing packed
])
def test_the_binding_budget_needs_the_most_packs(tokens, limits, binding):
    assert binding_budget(tokens, 10, limits) == binding
