"""Source mixtures over arrays: how often each row of each source is used (`draw_uses`), each
source's uses in the run's order (`source_order`), and the stratified interleave of the sources
(`interleave`) that keeps the blend in every stretch of the output, not only in total.

    web: rows of 100, 100, 100 tokens, weight 0.75; code: rows of 10 x 4, weight 0.25 (tokens)
    no size given: the most that repeats no source is min(300 / 0.75, 40 / 0.25) = 160 tokens
      -> web needs 120 tokens: 1 row (0 whole passes, a seeded subset of 120 tokens: 1 row)
      -> code needs 40 tokens: every row once
    interleave by each use's middle on its source's axis, (tokens before it + half its own) / total:
      web 0.5 | code 0.125 0.375 0.625 0.875  ->  code, code, web, code, code  (ties: source order)

Pure functions over numpy arrays: the pipeline (pipeline/mixture.py) gives them every source's
lengths and names the source in its messages.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from packctl.plan.order import splitmix64

TOKENS, SEQUENCES = "tokens", "sequences"
# a source's subset seed and its shuffle seed are drawn apart from the order's own keys
_SUBSET_SALT, _SHUFFLE_SALT = 0x5EED_0F_5EB5E7, 0x5EED_0F_0DE4


class RepeatOverCap(Exception):
    """Source `source` would have to be read `needed` times (whole passes and a part), more than its cap."""

    def __init__(self, source: int, needed: float, cap: float, size: int, target: float):
        super().__init__(source, needed, cap)
        self.source, self.needed, self.cap, self.size, self.target = source, needed, cap, size, target


class EmptySource(Exception):
    """Source `source` holds nothing to draw from (no row, or no token with weights over tokens)."""

    def __init__(self, source: int):
        super().__init__(source)
        self.source = source


@dataclass(frozen=True)
class Draw:
    """What `draw_uses` decided: per source, each row's number of uses (aligned with its gids),
    the units it was to give (`targets`) and the output's size in units (`size`)."""

    counts: list[np.ndarray]
    targets: np.ndarray  # float64, one per source
    size: float


def draw_uses(sizes: list[np.ndarray], gids: list[np.ndarray], weights: np.ndarray, caps: np.ndarray, *,
              size: int | None = None, epochs_of: int | None = None, seed: int = 0) -> Draw:
    """How often each row of each source is used so that source k gives `weights[k]` of the
    output's units (`sizes[k]`: each row's tokens, or ones for sequences; `weights` sum to 1).

    The output holds `size` units, or (with `epochs_of` k) what source k gives used exactly once,
    or the most that uses no source more than once. Source k needs r = weight * size / its units
    passes: floor(r) whole passes over every row, then a seeded subset (rows by splitmix64 of
    their gid) of the rest: rows taken in that order while the units before a row plus half its
    own stay within the part left, so the source gives its target within half a row.

        sizes [[5, 5, 5, 5]], weights [1.0], size 30 -> r = 1.5: every row once, and two rows a
        second time (10 of the 10 units left)

    Raises RepeatOverCap where r is over the source's cap, EmptySource where a source has no units."""
    totals = np.array([int(s.sum()) for s in sizes], dtype=np.float64)
    for k, total in enumerate(totals):
        if total <= 0:
            raise EmptySource(k)
    if size is not None:
        out = float(size)
    elif epochs_of is not None:
        out = totals[epochs_of] / weights[epochs_of]
    else:
        out = float(np.min(totals / weights))
    targets = weights * out
    counts = []
    for k, (units, ids) in enumerate(zip(sizes, gids)):
        passes = targets[k] / totals[k]
        if passes > caps[k] * (1 + 1e-12):
            raise RepeatOverCap(k, passes, float(caps[k]), int(totals[k]), float(targets[k]))
        whole = math.floor(passes + 1e-12)
        left = targets[k] - whole * totals[k]
        count = np.full(len(units), whole, dtype=np.int64)
        if left > 0:
            picked = np.argsort(splitmix64(np.asarray(ids, dtype=np.int64), seed ^ _SUBSET_SALT), kind="stable")
            drawn = np.asarray(units, dtype=np.float64)[picked]
            middle = np.cumsum(drawn) - drawn / 2
            count[picked[:int(np.searchsorted(middle, left, side="right"))]] += 1
        counts.append(count)
    return Draw(counts=counts, targets=targets, size=out)


@dataclass(frozen=True)
class Blend:
    """What a blend asks of `draw_blend`, one value per source in `weights` and `caps`: the gids of
    source k are gid_starts[k]:gid_starts[k+1]; the output's size in `unit` (`size`, or with
    `epochs_of` k what source k gives used once, or neither: the most that repeats no source);
    `seed` picks each source's part of a pass.

        Blend(gid_starts=(0, 3, 7), weights=(0.75, 0.25), caps=(1.0, 2.0)): rows 0-2 one source,
        rows 3-6 the other, tokens, the largest blend that repeats neither"""

    gid_starts: tuple[int, ...] | list[int] | np.ndarray
    weights: tuple[float, ...] | list[float] | np.ndarray
    caps: tuple[float, ...] | list[float] | np.ndarray
    unit: str = TOKENS
    size: int | None = None
    epochs_of: int | None = None
    seed: int = 0


def draw_blend(lengths: np.ndarray, blend: Blend, *, skip_empty: bool = False,
               group_starts: np.ndarray | None = None) -> tuple[Draw, list[np.ndarray]]:
    """`draw_uses` over a blend's gids (`lengths`: every gid's true length): the draw, and each
    source's gids that may be drawn (with `skip_empty`, the rows that are not empty). The one draw
    of `pack` and of `verify --source`.

    With `group_starts` (--group-column; `blend_groups` cuts them at the sources' edges) the draw
    is of whole groups: a group's units are its rows' (tokens, or rows), its gid is its first
    row's, and every member is used as often as its group (`member_uses`).

        lengths [3, 5, 4], one source, group_starts [0, 2, 3] -> gids [0, 2], sizes [8, 4]"""
    if group_starts is not None:
        gids, sizes = _group_units(lengths, blend, skip_empty, group_starts)
    else:
        gids, sizes = [], []
        for k in range(len(blend.gid_starts) - 1):
            ids = np.arange(blend.gid_starts[k], blend.gid_starts[k + 1], dtype=np.int64)
            if skip_empty:
                ids = ids[lengths[ids] > 0]
            gids.append(ids)
            sizes.append(np.ones(len(ids), np.int64) if blend.unit == SEQUENCES else lengths[ids])
    return draw_uses(sizes, gids, np.asarray(blend.weights, dtype=np.float64),
                     np.asarray(blend.caps, dtype=np.float64), size=blend.size, epochs_of=blend.epochs_of,
                     seed=blend.seed), gids


def blend_groups(group_starts: np.ndarray, gid_starts) -> np.ndarray:
    """The group starts cut at every source's first gid, so no group spans two sources.

        group_starts [0, 3, 6], sources at [0, 2, 6] -> [0, 2, 3, 6]"""
    return np.union1d(np.asarray(group_starts, dtype=np.int64), np.asarray(gid_starts, dtype=np.int64))


def _group_members(lengths: np.ndarray, group_starts: np.ndarray, skip_empty: bool) -> tuple[np.ndarray, np.ndarray]:
    """Each group's rows (with `skip_empty`, those not empty) and tokens."""
    first = group_starts[:-1]
    member = np.diff(group_starts)
    tokens = np.add.reduceat(np.asarray(lengths, dtype=np.int64), first) if len(first) else first.copy()
    if skip_empty:
        member = np.add.reduceat((np.asarray(lengths) > 0).astype(np.int64), first) if len(first) else member
    return member, tokens


def _group_units(lengths, blend: Blend, skip_empty: bool, group_starts) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Each source's groups that may be drawn (their first gids) and their units."""
    member, tokens = _group_members(lengths, group_starts, skip_empty)
    first = group_starts[:-1]
    gids, sizes = [], []
    for k in range(len(blend.gid_starts) - 1):
        inside = (first >= blend.gid_starts[k]) & (first < blend.gid_starts[k + 1])
        if skip_empty:
            inside &= tokens > 0
        gids.append(first[inside])
        sizes.append(member[inside] if blend.unit == SEQUENCES else tokens[inside])
    return gids, sizes


def member_uses(num_rows: int, gids: list[np.ndarray], counts: list[np.ndarray],
                group_starts: np.ndarray | None = None) -> np.ndarray:
    """Each row's number of uses (one value a gid): its own, or its group's (`gids` then hold
    group starts).

        3 rows, gids [[0, 2]], counts [[2, 1]], group_starts [0, 2, 3] -> [2, 2, 1]"""
    uses = np.zeros(num_rows, dtype=np.int64)
    for ids, c in zip(gids, counts):
        uses[ids] = c
    if group_starts is not None:
        first = np.asarray(group_starts[:-1], dtype=np.int64)
        uses = np.repeat(uses[first], np.diff(group_starts))
    return uses


def uses_of(gids: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every use of one source in input order, pass by pass: (gid, pass) of each; a row used c
    times is in passes 0 .. c-1.

        gids [7, 8, 9], counts [2, 1, 0] -> gids [7, 8, 7], passes [0, 0, 1]
    """
    passes = int(counts.max()) if len(counts) else 0
    out_gids, out_passes = [], []
    for p in range(passes):
        chosen = gids[counts > p]
        out_gids.append(chosen)
        out_passes.append(np.full(len(chosen), p, dtype=np.int64))
    if not out_gids:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(out_gids).astype(np.int64), np.concatenate(out_passes)


def source_order(gids: np.ndarray, passes: np.ndarray, padded: np.ndarray, order: str, *, seed: int, source: int,
                 num_sequences: int, curriculum_order: str = "asc") -> np.ndarray:
    """The permutation of one source's uses (in `uses_of` order) for `order`: input keeps them;
    shuffle sorts by a seeded hash of (gid, pass), so the repeats of a row land apart; curriculum
    sorts by padded length (desc: longest first), ties in input order."""
    if order == "input":
        return np.arange(len(gids), dtype=np.int64)
    if order == "shuffle":
        use = gids + passes * np.int64(num_sequences)  # one value per use
        keys = splitmix64(use, seed ^ _SHUFFLE_SALT ^ (source * 0x9E37))
        return np.argsort(keys, kind="stable")
    if order == "curriculum":
        keys = np.asarray(padded, dtype=np.int64)
        return np.argsort(keys if curriculum_order == "asc" else -keys, kind="stable")
    raise ValueError(f"unknown order {order!r}")


def interleave(units: list[np.ndarray]) -> np.ndarray:
    """The blend of the sources' uses, each source's in its own order (`units[k]`: the units of
    its uses, in that order): positions into their concatenation, sorted by each use's middle on
    its source's axis, (units before it + half its own) / the source's units, ties by source.

        units [[2, 2], [1, 1, 1, 1]] -> middles [0.25, 0.75] and [0.125, 0.375, 0.625, 0.875]
        -> [2, 0, 3, 4, 1, 5]

    Every prefix of the result holds each source's units within half its longest use of the
    source's share of the prefix, so a run of consecutive uses (a window) holds each source within
    one longest use of its share, and the sum of all sources' deviations within the longest use of
    each: docs/mixtures.md states the tolerance."""
    keys, sources = [], []
    for k, u in enumerate(units):
        u = np.asarray(u, dtype=np.float64)
        total = float(u.sum())
        middle = (np.cumsum(u) - u / 2) / total if total > 0 else (np.arange(len(u)) + 0.5) / max(len(u), 1)
        keys.append(middle)
        sources.append(np.full(len(u), k, dtype=np.int64))
    if not keys:
        return np.zeros(0, np.int64)
    return np.lexsort((np.concatenate(sources), np.concatenate(keys))).astype(np.int64)


def window_deviation(source_of: np.ndarray, units: np.ndarray, window: int, weights: np.ndarray) -> np.ndarray:
    """Each source's worst |share - weight| over the windows of `window` consecutive uses (the
    output in order: `source_of[i]` the source of use i, `units[i]` its units). One value a source.

        sources [0, 1, 0, 1], units [1, 1, 1, 1], window 2, weights [0.5, 0.5] -> [0.0, 0.0]
    """
    k = len(weights)
    worst = np.zeros(k)
    n = len(source_of)
    if n == 0:
        return worst
    window_of = np.arange(n, dtype=np.int64) // window
    per = np.zeros((int(window_of[-1]) + 1, k))
    np.add.at(per, (window_of, source_of), units)
    totals = per.sum(axis=1, keepdims=True)
    shares = np.divide(per, totals, out=np.zeros_like(per), where=totals > 0)
    return np.abs(shares - weights[None, :]).max(axis=0)
