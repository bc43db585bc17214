"""Shared-prefix packs built by hand, exactly per the tree layout (packctl/contract/tree.py): the
reference the torch collate and the real-model proofs run on, written without packctl's writer.

    pack = tree_pack([Group([Row(5, [1, 2, 3, 4, 7, 8]), Row(6, [1, 2, 3, 4, 9])], p=4)])
    pack["input_ids"]        [1 2 3 4 7 8 4 9]
    pack["parent_segments"]  [-1 0 0]

A `Row`'s labels default to its tokens with the first -100; the pack writes -100 at the first
label of every segment that starts a row, as flat packs do.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

IGNORE_INDEX = -100


@dataclass
class Row:
    gid: int
    tokens: list[int]
    labels: list[int] | None = None

    def __post_init__(self):
        self.tokens = [int(t) for t in self.tokens]
        if self.labels is None:
            self.labels = [IGNORE_INDEX] + self.tokens[1:]
        self.labels = [int(v) for v in self.labels]
        assert len(self.labels) == len(self.tokens) >= 1

    @property
    def packed_labels(self) -> list[int]:
        """The labels a pack holds for this row, rebuilt: the first is -100."""
        return [IGNORE_INDEX] + self.labels[1:]


@dataclass
class Group:
    """Rows stored with their first p tokens shared: p >= 2, within their common prefix of tokens
    and labels (a row of exactly p tokens has a branch of one token, P[p-1])."""

    rows: list[Row]
    p: int
    gid: int | None = None  # the group id (`group_ids`); the first row's gid by default

    def __post_init__(self):
        assert len(self.rows) >= 2 and self.p >= 2
        first = self.rows[0]
        for row in self.rows:
            assert len(row.tokens) >= self.p, "p is longer than a row"
            assert row.tokens[:self.p] == first.tokens[:self.p], "the rows differ inside p"
            assert row.packed_labels[:self.p] == first.packed_labels[:self.p], "the labels differ inside p"
        if self.gid is None:
            self.gid = first.gid


@dataclass
class _Segment:
    tokens: list[int]
    labels: list[int]
    positions: list[int]
    sample_id: int
    group_id: int
    parent: int


def common_prefix(rows: list[Row]) -> int:
    """The longest prefix on which every row agrees, token and (packed) label."""
    n = min(len(r.tokens) for r in rows)
    for k in range(n):
        if any(r.tokens[k] != rows[0].tokens[k] or r.packed_labels[k] != rows[0].packed_labels[k] for r in rows):
            return k
    return n


def tree_pack(items: list[Row | Group], *, align: int = 1, length: int | None = None,
              pad_token_id: int = 0) -> dict[str, np.ndarray]:
    """One pack holding `items` in order: a Row is a flat segment, a Group a prefix segment and one
    branch per row. Each segment is padded to a multiple of `align`; the last also holds the tail
    padding up to `length`. Returns the pack's columns as numpy arrays (the dict PackedDataset yields).
    """
    segments: list[_Segment] = []
    for item in items:
        if isinstance(item, Row):
            segments.append(_Segment(item.tokens, item.packed_labels, list(range(len(item.tokens))),
                                     item.gid, item.gid, -1))
            continue
        p, first = item.p, item.rows[0]
        prefix = len(segments)
        segments.append(_Segment(first.tokens[:p - 1], first.packed_labels[:p - 1], list(range(p - 1)),
                                 -1, item.gid, -1))
        for row in sorted(item.rows, key=lambda r: r.gid):
            segments.append(_Segment(row.tokens[p - 1:], row.packed_labels[p - 1:],
                                     list(range(p - 1, len(row.tokens))), row.gid, item.gid, prefix))
    lens = [len(s.tokens) for s in segments]
    padded = [-(-n // align) * align for n in lens]
    if length is not None:
        assert length >= sum(padded), "the pack is longer than length"
        padded[-1] += length - sum(padded)
    input_ids, labels, position_ids = [], [], []
    for s, n in zip(segments, padded):
        pad = n - len(s.tokens)
        input_ids += s.tokens + [pad_token_id] * pad
        labels += s.labels + [IGNORE_INDEX] * pad
        position_ids += s.positions + list(range(s.positions[-1] + 1, s.positions[-1] + 1 + pad))
    # the loss columns count rows (docs/format.md): a row's segment its whole row's targets, a prefix 0;
    # the attention cost of a segment of L tokens after c of its parent's is L^2 + 2 L c
    stored = [sum(v != IGNORE_INDEX for v in s.labels) for s in segments]
    continued = {s.parent for s in segments}
    seq_loss = [0 if k in continued else stored[k] + (stored[s.parent] if s.parent >= 0 else 0)
                for k, s in enumerate(segments)]
    context = [lens[s.parent] if s.parent >= 0 else 0 for s in segments]

    def i32(values):
        return np.asarray(values, dtype=np.int32)

    return {
        "input_ids": i32(input_ids), "labels": i32(labels), "position_ids": i32(position_ids),
        "seq_lens": i32(lens), "seq_lens_padded": i32(padded), "seq_lengths": i32(padded),
        "cu_seqlens": i32(np.concatenate([[0], np.cumsum(lens)])),
        "cu_seqlens_padded": i32(np.concatenate([[0], np.cumsum(padded)])),
        "sample_ids": np.asarray([s.sample_id for s in segments], dtype=np.int64),
        "group_ids": np.asarray([s.group_id for s in segments], dtype=np.int64),
        "parent_segments": i32([s.parent for s in segments]),
        "num_tokens": np.int32(sum(lens)),
        "seq_loss_tokens": i32(seq_loss), "num_loss_tokens": np.int32(sum(seq_loss)),
        "sum_sq_seqlen": np.int64(sum(n * n + 2 * n * c for n, c in zip(lens, context))),
    }


def rows_of(items: list[Row | Group]) -> list[Row]:
    """The input rows of `items`, in the order the pack stores them (a group's rows by gid)."""
    out: list[Row] = []
    for item in items:
        out.extend([item] if isinstance(item, Row) else sorted(item.rows, key=lambda r: r.gid))
    return out


def random_items(rng: np.random.Generator, *, vocab: int = 50, max_groups: int = 3, max_rows: int = 4,
                 max_len: int = 12, first_gid: int = 0) -> list[Row | Group]:
    """A random mix of flat rows and shared groups (p >= 2), labels partly masked as prompts are."""
    items: list[Row | Group] = []
    gid = first_gid
    for _ in range(int(rng.integers(1, max_groups + 1))):
        if rng.random() < 0.3:
            n = int(rng.integers(1, max_len + 1))
            items.append(Row(gid, rng.integers(1, vocab, n).tolist()))
            gid += 1
            continue
        p = int(rng.integers(2, max_len))
        prompt = rng.integers(1, vocab, p).tolist()
        masked = int(rng.integers(0, p + 1))  # the prompt's first `masked` labels are -100
        rows = []
        for _ in range(int(rng.integers(2, max_rows + 1))):
            tokens = prompt + rng.integers(1, vocab, int(rng.integers(0, max_len - p + 1))).tolist()
            labels = [IGNORE_INDEX] * masked + tokens[masked:]
            rows.append(Row(gid, tokens, labels))
            gid += 1
        items.append(Group(rows, p))
    return items
