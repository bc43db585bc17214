"""Shared prefixes of groups (`--share-prefix`): arrays only, no I/O.

A group of two or more rows whose rows begin with the same p >= 2 tokens (token and label alike)
is stored as a tree: one PREFIX segment of the first p - 1 tokens, then one BRANCH segment per row
holding the rest of the row from token p - 1 on (docs/shared-prefix.md). Each row's `shared` value
is the p - 1 tokens its group stores once (0 for a row stored whole):

    rows  5: [1 2 3 4 7 8]   6: [1 2 3 4 9]      common prefix p = 4, shared [3, 3]
    stored  prefix [1 2 3]   branch 5 [4 7 8]   branch 6 [4 9]        8 tokens instead of 11

Planning places the group as one item of its stored length (`expand_shared` turns the rows into
the segments the planner packs); the writer marks each segment's parent (`tree_parents`).
"""
from __future__ import annotations

import numpy as np

from packctl.jit import njit
from packctl.plan.groups import group_sizes


@njit(cache=True)
def _common_with_previous(offsets, tokens, labels, first_common, out):
    out[0] = first_common
    for r in range(1, len(offsets) - 1):
        a, b = offsets[r - 1], offsets[r]
        n = min(offsets[r] - a, offsets[r + 1] - b)
        k = 0
        while k < n and tokens[a + k] == tokens[b + k] and labels[a + k] == labels[b + k]:
            k += 1
        out[r] = k


def common_with_previous(offsets: np.ndarray, tokens: np.ndarray, labels: np.ndarray,
                         previous: tuple[np.ndarray, np.ndarray] | None) -> np.ndarray:
    """int64 per row: how many leading tokens it shares (token and label alike) with the row
    before it; the first row with `previous` (tokens, labels of the row before the block), or -1
    without it (unknown here).

        rows [1 2 3 4 7 8] [1 2 3 4 9] [5]   ->  [-1, 4, 0]
    """
    offsets = np.asarray(offsets, dtype=np.int64)
    out = np.zeros(max(len(offsets) - 1, 0), dtype=np.int64)
    if len(out) == 0:
        return out
    first = -1
    if previous is not None:
        first = common_length(previous[0], previous[1], tokens[offsets[0]:offsets[1]], labels[offsets[0]:offsets[1]])
    _common_with_previous(offsets, np.asarray(tokens, np.int32), np.asarray(labels, np.int32), first, out)
    return out


def common_length(tokens_a: np.ndarray, labels_a: np.ndarray, tokens_b: np.ndarray, labels_b: np.ndarray) -> int:
    """Leading positions where two rows agree in token and label: [1 2 3] [1 2 4] -> 2."""
    n = min(len(tokens_a), len(tokens_b))
    differ = (tokens_a[:n] != tokens_b[:n]) | (labels_a[:n] != labels_b[:n])
    return int(np.argmax(differ)) if differ.any() else n


def run_prefixes(common: np.ndarray, gids: np.ndarray, ids: np.ndarray, bound: np.ndarray | None = None
                 ) -> tuple[np.ndarray, np.ndarray]:
    """The common prefix p of each run of rows of one group (rows in gid order, `ids` their group
    ids, the gid of each group's first row): the smallest `common` over its rows that are not
    their group's first (the common prefix of all of them), at most the smallest `bound`
    (--prefix-column). Returns (index of each run's first row, its p); a run holding only its
    group's first row has p = int64 max. Runs of one group on several ranks are joined by the
    minimum of their p (pipeline/prefix.py).

        common [-1, 4, 0, 9], gids [0, 1, 2, 3], ids [0, 0, 2, 2]  ->  runs at [0, 2], p [4, 9]
    """
    ids = np.asarray(ids, dtype=np.int64)
    if len(ids) == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    first = np.flatnonzero(np.concatenate([[True], ids[1:] != ids[:-1]]))
    inner = np.asarray(common, dtype=np.int64).copy()
    inner[np.asarray(gids) == ids] = np.iinfo(np.int64).max  # compared with the group before: not a member
    p = np.minimum.reduceat(inner, first)
    if bound is not None:
        p = np.minimum(p, np.minimum.reduceat(np.asarray(bound, dtype=np.int64), first))
    return first, p


def shared_of(p: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """The tokens a group stores once from its common prefix p and its rows: p - 1 for a group of
    two or more rows with p >= 2, else 0 (stored flat). p [4, 1, 9], sizes [2, 2, 1] -> [3, 0, 0]."""
    p = np.asarray(p, dtype=np.int64)
    return np.where((np.asarray(sizes) >= 2) & (p >= 2), p - 1, 0).astype(np.int64)


def expand_shared(lengths: np.ndarray, shared: np.ndarray, new_group: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The segments a plan packs for rows given in order (groups whole, `new_group` True on each
    first row): each shared group gets a prefix segment before its first row, and each of its rows
    becomes its branch. Returns (row of each segment, its start in that row, its length, True on
    each group's first segment). The prefix is a segment of the group's first row, from 0.

        lengths [6, 5, 3], shared [3, 3, 0], new_group [T, F, T]
        -> rows [0, 0, 1, 2], starts [0, 3, 3, 0], lengths [3, 3, 2, 3], new_group [T, F, F, T]
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    shared = np.asarray(shared, dtype=np.int64)
    n = len(lengths)
    prefix_before = np.asarray(new_group, dtype=bool) & (shared > 0)
    extra = np.cumsum(prefix_before)  # segments inserted up to and including row i
    branch_at = np.arange(n) + extra
    total = n + int(extra[-1]) if n else 0
    rows = np.empty(total, np.int64)
    starts = np.empty(total, np.int64)
    seg_lens = np.empty(total, np.int64)
    opens = np.zeros(total, dtype=bool)
    rows[branch_at], starts[branch_at], seg_lens[branch_at] = np.arange(n), shared, lengths - shared
    opens[branch_at] = new_group & ~prefix_before
    prefix_at = branch_at[prefix_before] - 1
    rows[prefix_at], starts[prefix_at], seg_lens[prefix_at] = np.flatnonzero(prefix_before), 0, shared[prefix_before]
    opens[prefix_at] = True
    return rows, starts, seg_lens, opens


def stored_padded(padded_of, lengths: np.ndarray, shared: np.ndarray, new_group: np.ndarray) -> np.ndarray:
    """Each row's share of its group's stored padded length (`padded_of`: lengths -> padded): its
    branch, and on a group's first row the prefix too; a row stored whole, its own padded length.

        align 1: lengths [6, 5], shared [3, 3], first row [T, F] -> [3 + 3, 2]
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    shared = np.asarray(shared, dtype=np.int64)
    own = padded_of(lengths - shared)
    prefix = np.where(np.asarray(new_group, dtype=bool) & (shared > 0), padded_of(shared), 0)
    return own + prefix


def tree_parents(bin_offsets: np.ndarray, piece_start: np.ndarray, in_group: np.ndarray) -> np.ndarray:
    """int32 per piece: the index, within its pack, of the segment it continues, or -1 (a segment
    that starts a row). A branch is a piece of a group of two or more (`in_group`) that starts
    after token 0 (only the rows of groups of one are ever cut, by --too-long split); its parent
    is the piece before its first sibling, the group's prefix.

        one pack: piece_start [0, 0, 3, 3, 0], in_group all  ->  [-1, -1, 1, 1, -1]
    """
    bin_offsets = np.asarray(bin_offsets, dtype=np.int64)
    n = int(bin_offsets[-1]) if len(bin_offsets) else 0
    branch = (np.asarray(piece_start) > 0) & np.asarray(in_group, dtype=bool)
    root_at = np.where(~branch, np.arange(n), -1)
    last_root = np.maximum.accumulate(root_at) if n else root_at
    pack_of = np.repeat(np.arange(len(bin_offsets) - 1), np.diff(bin_offsets))
    return np.where(branch, last_root - bin_offsets[pack_of], -1).astype(np.int32)


def piece_parents(plan, group_starts: np.ndarray) -> np.ndarray:
    """`tree_parents` of a PackPlan's pieces (`group_starts`: --group-column's)."""
    return tree_parents(plan.bin_offsets, plan.piece_start, group_sizes(plan.piece_gid, group_starts) > 1)


def prefix_pieces(bin_offsets: np.ndarray, parents: np.ndarray) -> np.ndarray:
    """True on each piece that another piece of its pack continues (a prefix segment).

        packs [0, 3, 5], parents [-1, 0, 0, -1, -1]  ->  [T, F, F, F, F]
    """
    bin_offsets = np.asarray(bin_offsets, dtype=np.int64)
    parents = np.asarray(parents, dtype=np.int64)
    pack_first = np.repeat(bin_offsets[:-1], np.diff(bin_offsets))
    out = np.zeros(len(parents), dtype=bool)
    child = parents >= 0
    out[pack_first[child] + parents[child]] = True
    return out


def sharing_counts(piece_start: np.ndarray, piece_len: np.ndarray, parents: np.ndarray,
                   prefix: np.ndarray) -> dict[str, int]:
    """What storing trees saves over the pieces of a plan (`parents`: `tree_parents`, `prefix`:
    `prefix_pieces`): groups stored shared, tokens saved ((G - 1) * (p - 1) a group of G rows) and
    the causal attention cost (visible (query, key) pairs) of the rows flat and as trees: a row of
    n tokens n(n+1)/2; a prefix of s = p - 1 tokens s(s+1)/2, a branch of b tokens b*s + b(b+1)/2.

        one group, prefix 3, branches 3 and 2 (rows of 6 and 5 tokens):
        groups 1, tokens saved 3, attention flat 21 + 15 = 36, tree 6 + (9 + 6) + (6 + 3) = 30
    """
    start = np.asarray(piece_start, dtype=np.int64)
    lens = np.asarray(piece_len, dtype=np.int64)
    branch = np.asarray(parents) >= 0
    context = np.where(branch, start, 0)  # a branch's prefix, which its row holds before it
    rows = ~prefix
    whole = lens + context
    flat = int((whole * (whole + 1) // 2)[rows].sum())
    tree = int((lens * context + lens * (lens + 1) // 2).sum())
    return {"groups_shared": int(prefix.sum()), "tokens_saved": int(context.sum() - lens[prefix].sum()),
            "attention_flat": flat, "attention_tree": tree}
