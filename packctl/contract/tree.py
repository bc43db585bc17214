"""The tree layout of a shared-prefix pack (`pack --share-prefix`): which segment continues which,
the rows rebuilt from their segments, and who attends to whom. numpy only.

A group of rows that agree on their first p tokens (token and label) is stored once for the common
part: a PREFIX segment holding P[0 : p-1], then one BRANCH segment per row holding row[p-1 :]. The
column `parent_segments` names, for each segment of the pack, the segment it continues (-1: it
starts a row). A branch starts with the prefix's last token, so each branch predicts its own first
target from its own position. Two rows with p = 4 (`.` = -100):

    row 5   input_ids 1 2 3 4 7 8    labels . . . . 7 8
    row 6   input_ids 1 2 3 4 9      labels . . . . 9

    stored  segments      prefix [1 2 3] | branch 5 [4 7 8] | branch 6 [4 9]
            input_ids     1 2 3 4 7 8 4 9          seq_lens [3, 3, 2]   parent_segments [-1, 0, 0]
            position_ids  0 1 2 3 4 5 3 4          sample_ids [-1, 5, 6]
            labels        . . . . 7 8 . 9

Row 5 is rebuilt from flat positions [0 1 2 | 3 4 5] (its ancestor chain, root first, then its own
segment), row 6 from [0 1 2 | 6 7]. Attention (`visible`): a query at offset i of segment s sees a
key at offset j of segment t iff t == s and j <= i, or t is an ancestor of s and j < seq_lens[t]:

              k: 1 2 3 4 7 8 4 9
    q: 1         1 . . . . . . .
       2         1 1 . . . . . .
       3         1 1 1 . . . . .
       4         1 1 1 1 . . . .        branch 5 sees the prefix and itself
       7         1 1 1 1 1 . . .
       8         1 1 1 1 1 1 . .
       4         1 1 1 . . . 1 .        branch 6 sees the prefix, never its sibling
       9         1 1 1 . . . 1 1

A flat pack is the tree where every parent is -1: the same functions serve it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from packctl.contract.schema import PARENT_SEGMENTS  # noqa: F401  the column, declared in the schema


def _ints(values) -> np.ndarray:
    return np.asarray(values, dtype=np.int64).reshape(-1)


def check_parents(parent_segments) -> np.ndarray:
    """`parent_segments` as int64 after checking that every parent is -1 or an earlier segment.

    A parent that is the segment itself or a later one (a cycle, or a forward reference) raises
    ValueError naming the segment; parents that precede their children cannot form a cycle.
    """
    parents = _ints(parent_segments)
    index = np.arange(len(parents))
    bad = np.flatnonzero((parents < -1) | (parents >= index))
    if len(bad):
        s, p = int(bad[0]), int(parents[bad[0]])
        if p == s:
            raise ValueError(f"parent_segments: segment {s} names itself as its parent (a cycle)")
        if p > s:
            raise ValueError(f"parent_segments: segment {s} names the later segment {p} as its parent "
                             "(a parent precedes the segments that continue it)")
        raise ValueError(f"parent_segments: segment {s} has parent {p}; a parent is -1 or a segment index")
    return parents


def roots(parent_segments) -> np.ndarray:
    """The root of each segment's chain: [-1, 0, 0, -1, 3] -> [0, 0, 0, 3, 3]."""
    parents = check_parents(parent_segments)
    root = np.where(parents < 0, np.arange(len(parents)), parents)
    while True:  # pointer jumping: log2(depth) rounds
        nxt = root[root]
        if np.array_equal(nxt, root):
            return root
        root = nxt


def depths(parent_segments) -> np.ndarray:
    """How many ancestors each segment has: [-1, 0, 0, -1, 3] -> [0, 1, 1, 0, 1]."""
    parents = check_parents(parent_segments)
    return ancestor_sums(parents, np.ones(len(parents), dtype=np.int64))


def ancestry(parent_segments) -> np.ndarray:
    """Bool [S, S]: [s, t] is True when t is a strict ancestor of s (the segments s continues).

        parent_segments [-1, 0, 0]  ->  . . .
                                        1 . .
                                        1 . .
    """
    parents = check_parents(parent_segments)
    count = len(parents)
    result = np.zeros((count, count), dtype=bool)
    current, alive = parents.copy(), parents >= 0
    while alive.any():  # one step up the chains of every segment at once
        rows = np.flatnonzero(alive)
        result[rows, current[rows]] = True
        current[rows] = parents[current[rows]]
        alive = current >= 0
    return result


def flat_parents(seq_offsets, parent_segments) -> np.ndarray:
    """The `parent_segments` of several packs (CSR over `seq_offsets`) as indices into their
    segments laid end to end; a parent out of place (not an earlier segment of its own pack, rule
    `tree-parents` of verify) becomes -1, so a broken pack is still read as flat segments.

        seq_offsets [0, 3, 5], parent_segments [-1, 0, 0, -1, 0]  ->  [-1, 0, 0, -1, 3]
    """
    offsets = _ints(seq_offsets)
    parents = _ints(parent_segments)
    first = np.repeat(offsets[:-1], np.diff(offsets))
    within = np.arange(len(parents)) - first
    return np.where((parents >= 0) & (parents < within), first + parents, -1)


def ancestor_sums(parent_segments, values) -> np.ndarray:
    """Each segment's sum of `values` over its strict ancestors (the segments its row holds before
    it): parent_segments [-1, 0, 0, -1], values [3, 3, 2, 5] -> [0, 3, 3, 0]. Of `seq_lens`, the
    position of each segment's first token in its row (a branch goes on from its prefix).
    `parent_segments` may index several packs laid end to end (each parent before its child)."""
    parents = check_parents(parent_segments)
    values = np.asarray(values, dtype=np.int64).reshape(-1)
    out = np.zeros(len(parents), dtype=np.int64)
    rows, current = np.flatnonzero(parents >= 0), parents[parents >= 0]
    while len(rows):  # every chain climbed one step at a time
        out[rows] += values[current]
        current = parents[current]
        rows, current = rows[current >= 0], current[current >= 0]
    return out


def continued(parent_segments) -> np.ndarray:
    """True on each segment another one continues (a prefix): [-1, 0, 0, -1] -> [T, F, F, F]."""
    parents = check_parents(parent_segments)
    out = np.zeros(len(parents), dtype=bool)
    out[parents[parents >= 0]] = True
    return out


def chains(parent_segments) -> np.ndarray:
    """Int [S, D] (D = the deepest chain's length): row s lists s's chain root first, -1 after
    its end, so chains[s, depth[t]] == t says whether t is s or one of its ancestors (one lookup,
    what a FlexAttention mask_mod can afford).

        parent_segments [-1, 0, 1, 0]  ->  [[0, -1, -1], [0, 1, -1], [0, 1, 2], [0, 3, -1]]
    """
    parents = check_parents(parent_segments)
    depth = depths(parents)
    table = np.full((len(parents), int(depth.max()) + 1 if len(parents) else 1), -1, dtype=np.int64)
    rows, current = np.arange(len(parents)), np.arange(len(parents))
    while len(rows):  # every chain climbed one step at a time, written at its depth
        table[rows, depth[current]] = current
        current = parents[current]
        keep = current >= 0
        rows, current = rows[keep], current[keep]
    return table


def segment_of(seq_lens_padded) -> np.ndarray:
    """The segment of each token of a pack: seq_lens_padded [3, 3, 2] -> [0 0 0 1 1 1 2 2]."""
    lens = _ints(seq_lens_padded)
    return np.repeat(np.arange(len(lens)), lens)


def offset_in_segment(seq_lens_padded) -> np.ndarray:
    """Each token's offset inside its segment: seq_lens_padded [3, 3, 2] -> [0 1 2 0 1 2 0 1]."""
    lens = _ints(seq_lens_padded)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    return np.arange(int(lens.sum())) - np.repeat(starts, lens)


@dataclass(frozen=True)
class RowPositions:
    """The flat positions of each rebuilt row of a pack: row k is `positions[offsets[k]:offsets[k+1]]`,
    and it is the row of segment `segments[k]` (whose `sample_ids` entry names the input row)."""

    segments: np.ndarray  # int64 [R]
    positions: np.ndarray  # int64 [N], flat token indices into the pack
    offsets: np.ndarray  # int64 [R+1]

    def row(self, k: int) -> np.ndarray:
        return self.positions[self.offsets[k]:self.offsets[k + 1]]


def row_positions(parent_segments, seq_lens, cu_seqlens_padded, sample_ids) -> RowPositions:
    """For each segment that holds an input row (`sample_ids` >= 0), the flat positions of its
    rebuilt row: the true tokens of its ancestors, root first, then its own true tokens.

        parent_segments [-1, 0, 0]  seq_lens [3, 3, 2]  cu_seqlens_padded [0, 3, 6, 8]  sample_ids [-1, 5, 6]
        -> segments [1, 2]   row 5: [0 1 2 3 4 5]   row 6: [0 1 2 6 7]

    `input_ids[positions]` and `labels[positions]` are then the input row's tokens and labels.
    """
    parents = check_parents(parent_segments)
    lens, cu, ids = _ints(seq_lens), _ints(cu_seqlens_padded), _ints(sample_ids)
    if not len(lens) == len(ids) == len(parents) == len(cu) - 1:
        raise ValueError(f"parent_segments ({len(parents)}), seq_lens ({len(lens)}), sample_ids ({len(ids)}) "
                         f"and cu_seqlens_padded ({len(cu)} entries) describe different segment counts")
    segments = np.flatnonzero(ids >= 0).astype(np.int64)
    table = chains(parents)[segments]  # each row's chain, root first, -1 after its end
    row, depth = np.nonzero(table >= 0)  # row-major: the pieces of row 0 in chain order, then row 1...
    pieces = table[row, depth]
    piece_lens = lens[pieces]
    piece_offsets = np.concatenate([[0], np.cumsum(piece_lens)])
    positions = (np.arange(int(piece_offsets[-1]), dtype=np.int64)
                 + np.repeat(cu[pieces] - piece_offsets[:-1], piece_lens))
    sizes = np.bincount(row, weights=piece_lens, minlength=len(segments)).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    return RowPositions(segments, positions, offsets)


def visible(parent_segments, seq_lens, seq_lens_padded) -> np.ndarray:
    """Bool [T, T] (query x key) of one pack, True where the query may attend to the key: same
    segment and causal, or a true token of an ancestor segment (never padding, never a sibling).
    T = sum(seq_lens_padded); the module docstring draws one. It holds T*T booleans: for tests
    and small packs (a FlexAttention mask_mod needs only `segment_of`, `offset_in_segment`,
    `seq_lens` and `ancestry`).
    """
    parents = check_parents(parent_segments)
    lens, padded = _ints(seq_lens), _ints(seq_lens_padded)
    if not len(lens) == len(padded) == len(parents):
        raise ValueError(f"parent_segments ({len(parents)}), seq_lens ({len(lens)}) and seq_lens_padded "
                         f"({len(padded)}) describe different segment counts")
    seg, off = segment_of(padded), offset_in_segment(padded)
    same = (seg[:, None] == seg[None, :]) & (off[None, :] <= off[:, None])
    above = ancestry(parents)[seg[:, None], seg[None, :]] & (off < lens[seg])[None, :]
    return same | above
