"""Sequence orders: a permutation of global sample ids, independent of how many processes compute it.

    lengths (gid 0..4) = [5, 2, 9, 2, 7]
    input              -> [0, 1, 2, 3, 4]
    curriculum asc     -> [1, 3, 0, 4, 2]   (by padded length, ties by gid)
    curriculum desc    -> [2, 4, 0, 1, 3]
    shuffle seed s     -> gids sorted by splitmix64(gid, s): a fixed pseudo-random permutation
    epoch e of --epochs -> the same with seed epoch_seed(s, e): s for epoch 0, a fresh seed after
"""
from __future__ import annotations

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def splitmix64(values: np.ndarray, seed: int) -> np.ndarray:
    """A well-mixed 64-bit hash of each value for a seed (SplitMix64 finalizer).

    Used as the shuffle key so a sequence's place depends only on (gid, seed).
    """
    with np.errstate(over="ignore"):
        z = values.astype(np.uint64) + np.uint64(seed % 2**64) * _GOLDEN + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def order_keys(gids: np.ndarray, padded_lengths: np.ndarray, order: str, *, seed: int = 0,
               curriculum_order: str = "asc") -> np.ndarray:
    """The int64 sort key of each sequence; the order is by (key, gid).

    input: the gid; shuffle: a seeded hash of the gid; curriculum: the padded length (negated for desc).
    """
    gids = np.asarray(gids, dtype=np.int64)
    if order == "input":
        return gids.copy()
    if order == "shuffle":
        return (splitmix64(gids, seed) >> np.uint64(1)).astype(np.int64)
    if order == "curriculum":
        keys = np.asarray(padded_lengths, dtype=np.int64)
        return keys.copy() if curriculum_order == "asc" else -keys
    raise ValueError(f"unknown order {order!r}")


def order_sequences(padded_lengths: np.ndarray, order: str, *, seed: int = 0,
                    curriculum_order: str = "asc") -> np.ndarray:
    """Permutation of gids 0..n-1 for `order` (see the module docstring for an example)."""
    gids = np.arange(len(padded_lengths), dtype=np.int64)
    if order == "input":
        return gids
    keys = order_keys(gids, padded_lengths, order, seed=seed, curriculum_order=curriculum_order)
    return np.lexsort((gids, keys))


def window_seed(seed: int, window: int) -> int:
    """Seed of one window's randomized algorithm: depends on (seed, window index) only."""
    return int(splitmix64(np.asarray([window], dtype=np.int64), seed)[0] >> np.uint64(1))


def epoch_seed(seed: int, epoch: int) -> int:
    """Seed of epoch `epoch` of `--epochs` (its shuffle, ffs and step grouping): `seed` itself for
    epoch 0, so epoch 0 is the output of one epoch; after that splitmix64(epoch, seed) >> 1, so
    epoch e is packed exactly as a one-epoch run with `--seed epoch_seed(seed, e)`."""
    if epoch == 0:
        return seed
    return int(splitmix64(np.asarray([epoch], dtype=np.int64), seed)[0] >> np.uint64(1))
