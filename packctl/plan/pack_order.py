"""The order packs are written in, window by window (`--pack-order`).

The planner opens packs in an order of its own (the decreasing algorithms longest first, so a
window's packs run from long sequences to short ones). `--pack-order` then reorders each window's
packs, or with `--dp-size` each window's steps (whole, as balanced):

    planner   as the algorithm made them
    shuffle   a stratified seeded shuffle (`stratified_permutation`): no trend of length with position
    longest   ascending by the longest sequence of the pack (of the step), ties by planner order
    mean      ascending by the mean sequence length of the pack (of the step), ties by planner order

The permutation of a window depends only on (seed, window index) and the window's packs, so it is
the same on any number of ranks and after --resume. The pieces of a split sequence keep their
order: the packs holding them are ordered as one unit (keyed by their longest sequence) and stand
side by side in planner order (`split_units`).

    keys of 9 packs (longest sequence)   [900 800 700 600 500 400 300 200 100]   (bfd: longest first)
    shuffle: strata of 3 by key, {100 200 300} {400 500 600} {700 800 900}, one of each dealt into
    each block of 3 positions, random order inside a block:
                                          [500 100 900 | 200 700 600 | 800 300 400]
    longest: [100 200 300 400 500 600 700 800 900]
"""
from __future__ import annotations

import math

import numpy as np

from packctl.plan.windows import PackPlan

PACK_ORDERS = ("planner", "shuffle", "longest", "mean")

STRATIFY_MIN = 4  # below this many packs (steps) a window gets a plain seeded permutation
TINY_WINDOW = 20  # below this many packs (steps) no bound on |Spearman| means anything (RHO_TARGET is not promised)
RHO_TARGET = 0.01  # |Spearman(position, key)| the stratified shuffle brings each window to (n >= STRATIFY_MIN)


def average_ranks(values: np.ndarray) -> np.ndarray:
    """Ranks 0..n-1 with ties given their mean rank (as Spearman's rho counts them): [5, 1, 5] -> [1.5, 0, 1.5]."""
    values = np.asarray(values)
    order = np.argsort(values, kind="stable")
    _, inverse, counts = np.unique(values[order], return_inverse=True, return_counts=True)
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])
    ranks = np.empty(len(values), dtype=np.float64)
    ranks[order] = (first + (counts - 1) / 2)[inverse]
    return ranks


def spearman(values: np.ndarray) -> float:
    """Spearman's rank correlation between position and value (0.0 for fewer than 2 values or all equal).

        >>> spearman(np.array([1, 2, 3])), spearman(np.array([3, 2, 1]))
        (1.0, -1.0)
    """
    n = len(values)
    if n < 2:
        return 0.0
    r = average_ranks(values)
    r -= r.mean()
    p = np.arange(n, dtype=np.float64) - (n - 1) / 2
    norm = math.sqrt(float((r * r).sum()) * float((p * p).sum()))
    return float((p * r).sum() / norm) if norm > 0 else 0.0


def stratified_permutation(keys: np.ndarray, rng: np.random.Generator, before: Precedence | None = None,
                           values: np.ndarray | None = None) -> np.ndarray:
    """A seeded order of n items (perm[position] = item) in which position says nothing about key.

    n < STRATIFY_MIN: a plain permutation. Otherwise, with B = ceil(sqrt(n)) blocks of positions:
    the items sorted by key (ties in random order) are cut into ceil(n / B) strata of consecutive
    keys; each stratum deals one item into each of B (or, when short, B - 1) random blocks; each
    block is in random order. So every stretch of about sqrt(n) positions holds one item of every
    length stratum. A plain permutation has |Spearman| about 1/sqrt(n) (0.06 at 286 packs): here it
    is about 1.4/n, and swaps of two items inside one block (which keep every block's strata) then
    bring it under RHO_TARGET, so the bound holds in every window, not on average.

    `before` (pairs (a, b): item a must come before item b, the packs of a split sequence): the
    items it links are dealt as one unit (`split_units`, keyed by its longest item) and placed
    side by side in index order, which keeps every pair. Spread over the window, a split
    sequence's first packs (full pieces, the longest) would always come before its last (a
    shorter tail with other sequences): a trend of length with position that grows with the
    number of split sequences (-0.02 over 5,916 packs with 200 of them).

    `values` (default the ranks of `keys`): what the swaps bring uncorrelated with position,
    |Pearson(position, values)| <= RHO_TARGET; the steps of --dp-size give the sums of their
    packs' ranks (plan/balance.py `_step_priority`).
    """
    keys = np.asarray(keys, dtype=np.float64)
    unit_of, members = split_units(len(keys), before)
    unit_keys = np.full(len(members) - 1, -np.inf)
    np.maximum.at(unit_keys, unit_of, keys)
    n = len(unit_keys)
    if n < STRATIFY_MIN:
        return _expand(rng.permutation(n), unit_of, members)
    blocks = math.isqrt(n - 1) + 1
    by_key = np.lexsort((rng.random(n), unit_keys))
    block_of = np.empty(n, dtype=np.int64)
    for stratum in np.array_split(by_key, -(-n // blocks)):
        block_of[stratum] = rng.permutation(blocks)[:len(stratum)]
    perm = _expand(np.lexsort((rng.random(n), block_of)), unit_of, members)
    sizes = np.diff(members)
    fixed = None if n == len(keys) else (sizes[unit_of] > 1)[perm]
    block_sizes = np.bincount(block_of, weights=sizes, minlength=blocks).astype(np.int64)
    return _decorrelate(perm, average_ranks(keys) if values is None else np.asarray(values, np.float64), block_sizes,
                        fixed)


Precedence = np.ndarray  # int64 (k, 2): item [i, 0] must come before item [i, 1]


def split_units(n: int, before: Precedence | None) -> tuple[np.ndarray, np.ndarray]:
    """The units n items are ordered in: the items `before` links (directly or through others)
    are one unit, every other item one of its own. Returns (unit_of, members): unit u holds
    members[u + 1] - members[u] items; units are numbered by their first item.

        n = 5, before [[1, 3]]  ->  unit_of [0, 1, 2, 1, 3], members [0, 1, 3, 4, 5]
    """
    parent = np.arange(n)
    if before is not None and len(before):
        def find(x: int) -> int:
            while parent[x] != x:
                parent[x] = parent[parent[x]]
                x = int(parent[x])
            return x

        for a, b in before.tolist():
            ra, rb = find(a), find(b)
            if ra != rb:
                parent[max(ra, rb)] = min(ra, rb)
        for x in np.unique(before).tolist():
            parent[x] = find(x)
    _, unit_of = np.unique(parent, return_inverse=True)  # a unit's root is its first item: units in order
    members = np.concatenate([[0], np.cumsum(np.bincount(unit_of))]).astype(np.int64)
    return unit_of.astype(np.int64), members


def _expand(units: np.ndarray, unit_of: np.ndarray, members: np.ndarray) -> np.ndarray:
    """The items of `units` (an order of units), each unit's items side by side in index order
    (the planner's order, which has the pieces of a split sequence in order)."""
    by_unit = np.argsort(unit_of, kind="stable")  # items grouped by unit, in index order inside one
    starts, sizes = members[units], np.diff(members)[units]
    take = np.repeat(starts - np.concatenate([[0], np.cumsum(sizes)[:-1]]), sizes) + np.arange(int(sizes.sum()))
    return by_unit[take].astype(np.int64)


def unit_order(keys: np.ndarray, before: Precedence | None) -> np.ndarray:
    """Items ascending by key, the items `before` links side by side in index order at the place
    of their largest key: `--pack-order longest|mean`."""
    unit_of, members = split_units(len(keys), before)
    unit_keys = np.full(len(members) - 1, -np.inf)
    np.maximum.at(unit_keys, unit_of, np.asarray(keys, dtype=np.float64))
    return _expand(np.argsort(unit_keys, kind="stable"), unit_of, members)


def _decorrelate(perm: np.ndarray, ranks: np.ndarray, block_sizes: np.ndarray, fixed: np.ndarray | None) -> np.ndarray:
    """Swap items inside blocks until |Spearman(position, rank)| <= RHO_TARGET (or no swap helps);
    positions `fixed` are left alone. When swaps inside blocks cannot get there (heavy ties: one
    odd item in a block at the end), swaps across the window may, up to GLOBAL_SWAPS_UPTO items.

    Swapping positions i < j changes sum((p - mean) * (r - mean)) by -(j - i) * (r_j - r_i): each
    round takes, over every block, the swap that leaves that sum nearest zero."""
    n = len(perm)
    r = ranks[perm] - ranks.mean()
    p = np.arange(n, dtype=np.float64) - (n - 1) / 2
    norm = math.sqrt(float((r * r).sum()) * float((p * p).sum()))
    if norm == 0:
        return perm
    perm = perm.copy()
    cov = float((p * r).sum())
    cov = _swap_within(perm, r, cov, norm, np.concatenate([[0], np.cumsum(block_sizes)]), fixed)
    if abs(cov) > RHO_TARGET * norm and n <= GLOBAL_SWAPS_UPTO:
        _swap_within(perm, r, cov, norm, np.array([0, n]), fixed)
    return perm


GLOBAL_SWAPS_UPTO = 2000
# Rounds of swaps at most. The stratified deal leaves |Spearman| about 1.4/n, so a window needs
# a few swaps at most; the bound keeps a window whose packs cannot get there (all of them fixed
# by split sequences, say) from spending n rounds of O(n^1.5) on it.
SWAP_ROUNDS = 64


def _swap_within(perm: np.ndarray, r: np.ndarray, cov: float, norm: float, bounds: np.ndarray,
                 fixed: np.ndarray | None) -> float:
    """The swaps of `_decorrelate` inside each [bounds[k], bounds[k+1]), in place; returns the sum left."""
    pairs: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for _ in range(min(len(perm), SWAP_ROUNDS)):
        if abs(cov) <= RHO_TARGET * norm:
            break
        best = (abs(cov), -1, -1, 0.0)
        for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
            size = hi - lo
            if size < 2:
                continue
            if size not in pairs:
                pairs[size] = np.triu_indices(size, 1)
            i, j = pairs[size]
            change = (j - i) * (r[lo + j] - r[lo + i])
            if fixed is not None:
                change = np.where(fixed[lo + i] | fixed[lo + j], np.inf, change)
            k = int(np.argmin(np.abs(cov - change)))
            if abs(cov - change[k]) < best[0]:
                best = (abs(cov - change[k]), lo + int(i[k]), lo + int(j[k]), float(change[k]))
        _, a, b, change = best
        if a < 0:
            break
        perm[[a, b]] = perm[[b, a]]
        r[[a, b]] = r[[b, a]]
        if fixed is not None:
            fixed[[a, b]] = fixed[[b, a]]
        cov -= change
    return cov


def window_permutation(keys: np.ndarray, pack_order: str, rng: np.random.Generator,
                       before: Precedence | None = None, values: np.ndarray | None = None) -> np.ndarray:
    """The order of one window's packs (or steps), perm[position] = planner index, for `pack_order`;
    the packs `before` links side by side in index order (`split_units`). `values`: what the
    shuffle leaves uncorrelated with position (default the ranks of `keys`)."""
    n = len(keys)
    if pack_order == "planner" or n < 2:
        return np.arange(n, dtype=np.int64)
    if pack_order == "shuffle":
        return stratified_permutation(keys, rng, before, values)
    if pack_order in ("longest", "mean"):
        return unit_order(keys, before)
    raise ValueError(f"unknown pack order {pack_order!r}")


def pack_keys(plan: PackPlan, pack_order: str) -> np.ndarray:
    """Each pack's key: its longest sequence (true tokens), or for "mean" its mean sequence length."""
    counts = np.diff(plan.bin_offsets)
    if len(counts) == 0:
        return np.zeros(0, dtype=np.float64)
    starts = plan.bin_offsets[:-1]
    if pack_order == "mean":
        return np.add.reduceat(plan.piece_len, starts).astype(np.float64) / counts
    return np.maximum.reduceat(plan.piece_len, starts).astype(np.float64)


def order_seed(seed: int, window: int) -> list[int]:
    """The generator words of window `window`'s pack order: apart from every other draw of the run."""
    return [seed, window, 0x5A5A]


def split_precedence(plan: PackPlan, lo: int, hi: int) -> Precedence | None:
    """The order packs lo..hi must keep for split sequences: (a, b), counted from lo, when pack a
    holds a piece of a sequence and pack b its next piece. None when no sequence is split there.

        packs 0: [x piece 0]  1: [y, z piece 0]  2: [x piece 1, z piece 1]  ->  [[0, 2], [1, 2]]
    """
    p_lo, p_hi = int(plan.bin_offsets[lo]), int(plan.bin_offsets[hi])
    gids = plan.piece_gid[p_lo:p_hi]
    if len(gids) == 0:
        return None
    unique, counts = np.unique(gids, return_counts=True)
    split = np.flatnonzero(np.isin(gids, unique[counts > 1]))
    if len(split) == 0:
        return None
    split = split[np.lexsort((plan.piece_start[p_lo + split], gids[split]))]  # by sequence, then piece
    pack = np.searchsorted(plan.bin_offsets, split + p_lo, side="right") - 1 - lo
    same = (gids[split][1:] == gids[split][:-1]) & (pack[1:] != pack[:-1])
    pairs = np.stack([pack[:-1][same], pack[1:][same]], axis=1).astype(np.int64)
    return np.unique(pairs, axis=0) if len(pairs) else None


def reorder_packs(plan: PackPlan, pack_order: str, seed: int, first_window: int = 0) -> PackPlan:
    """`plan` with each window's packs in `pack_order` (window w of the plan is window
    first_window + w of its epoch, which seeds it). Pieces of a split sequence keep their order."""
    if pack_order == "planner" or plan.num_bins < 2:
        return plan
    keys = pack_keys(plan, pack_order)
    perm = np.concatenate([lo + window_permutation(keys[lo:hi], pack_order,
                                                   np.random.default_rng(order_seed(seed, first_window + w)),
                                                   split_precedence(plan, lo, hi))
                           for w, (lo, hi) in enumerate(zip(plan.window_bins[:-1].tolist(),
                                                            plan.window_bins[1:].tolist()))])
    starts = plan.bin_offsets[perm]
    counts = plan.bin_offsets[perm + 1] - starts
    take = np.repeat(starts - np.concatenate([[0], np.cumsum(counts)[:-1]]), counts) + np.arange(int(counts.sum()))
    return PackPlan(window_bins=plan.window_bins, bin_offsets=np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
                    piece_gid=plan.piece_gid[take], piece_start=plan.piece_start[take],
                    piece_len=plan.piece_len[take], piece_padded=plan.piece_padded[take],
                    dropped=plan.dropped, truncated=plan.truncated, tokens_dropped=plan.tokens_dropped,
                    tokens_truncated=plan.tokens_truncated, step_bins=plan.step_bins,
                    piece_extra=plan.take_pieces(take), over_limit=plan.over_limit)
