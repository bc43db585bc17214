"""The per-pack rules of the output contract (docs/format.md), as a table of small functions.

A pack these rules accept (capacity 16, align 4, pad id 0; `.` = -100):

    input_ids      a0 a1 a2 a3 a4  0  0  0 b0 b1 b2 b3 b4 b5  0  0
    labels          .  a1 a2 a3 a4  .  .  .  .  b1 b2 b3 b4 b5  .  .
    position_ids    0  1  2  3  4  5  6  7  0  1  2  3  4  5  6  7
    seq_lens [5, 6]   seq_lens_padded [8, 8]   cu_seqlens [0, 5, 11]   cu_seqlens_padded [0, 8, 16]

A rule is a function of `Packs` (the columns of a run of packs as flat numpy arrays, and what the
rules derive from them, each computed once) that returns a mask over rows, sequences, cu entries or
tokens, True where the rule is broken, and how to describe the first offender. `PACK_RULES` lists
them in the order they report, each with its rule id, the level its mask is over and what it needs
(`Need`: the layout's cp_size or pad_to, the manifest's sequences_in, sequences that tile the
packs). `check_pack_rows` runs the table: a broken rule is reported once, at its first offending
row / sequence / token, with the number of places it breaks.

Adding a rule: a function here, its row in PACK_RULES, its line in docs/verify.md (a test holds
the docs against the table).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable

import numpy as np

from packctl.arrays import offsets_of, positions_in_segments, row_cumsums
from packctl.contract import tree
from packctl.contract.layout import Layout
from packctl.contract.schema import CU_ENTRY, CU_SEQLENS, CU_SEQLENS_PADDED, PACK, SEQUENCE, TOKEN
from packctl.contract.thd import PackRows
from packctl.verify.violation import Violation

Broken = tuple[np.ndarray, Callable[[int], str]]  # (mask of the places that break a rule, message of place k)


@dataclass(frozen=True)
class Need:
    """What a rule needs to apply, in words (docs/verify.md) and as a test of what it reads."""

    text: str
    holds: Callable[[Any], bool]


class Packs:
    """The columns of a run of packs as the rules read them (int64 views of `PackRows`), with the
    arrays derived from them computed on first use, once for all rules."""

    def __init__(self, rows: PackRows, layout: Layout, *, sequences_in: int | None = None,
                 batch_shape: tuple[np.ndarray, np.ndarray] | None = None):
        self.rows, self.layout = rows, layout
        self.sequences_in, self.batch_shape = sequences_in, batch_shape
        self.token_offsets = np.asarray(rows.token_offsets, dtype=np.int64)
        self.seq_offsets = np.asarray(rows.seq_offsets, dtype=np.int64)
        self.cu_offsets = np.asarray(rows.cu_offsets, dtype=np.int64)
        self.pack_len = np.diff(self.token_offsets)
        self.n_seq = np.diff(self.seq_offsets)
        self.n_cu = np.diff(self.cu_offsets)
        self.seq_lens = np.asarray(rows.seq_lens, dtype=np.int64)
        self.padded = np.asarray(rows.seq_lens_padded, dtype=np.int64)
        self.row_of_seq = np.repeat(np.arange(len(self.n_seq)), self.n_seq)

    # ---- sequences

    @cached_property
    def aligned(self) -> np.ndarray:
        """Each sequence's length rounded up to the layout's align."""
        align = self.layout.align
        return (self.seq_lens + align - 1) // align * align

    @cached_property
    def last(self) -> np.ndarray:
        """True for the last sequence of each pack (it also holds the tail padding)."""
        last = np.zeros(len(self.seq_lens), dtype=bool)
        last[self.seq_offsets[1:][self.n_seq > 0] - 1] = True
        return last

    @cached_property
    def seq_sum(self) -> np.ndarray:
        return np.bincount(self.row_of_seq, weights=self.seq_lens, minlength=len(self.n_seq)).astype(np.int64)

    @cached_property
    def padded_load(self) -> np.ndarray:
        return np.bincount(self.row_of_seq, weights=self.padded, minlength=len(self.n_seq)).astype(np.int64)

    @cached_property
    def cu_matches(self) -> bool:
        """Every pack has one cu entry more than sequences, so the cu columns can be recomputed."""
        return np.array_equal(self.n_cu, self.n_seq + 1)

    @cached_property
    def tiles(self) -> bool:
        """The padded sequences tile every pack, so every token belongs to one sequence."""
        return np.array_equal(self.padded_load, self.pack_len) and bool((self.padded >= 0).all())

    @cached_property
    def batch(self) -> tuple[np.ndarray, np.ndarray]:
        """(padded_len, batch_size) of every micro-batch: the shard's columns, or read off the packs
        (the first sequence's padded length) when it has none."""
        first = np.zeros(len(self.pack_len), dtype=np.int64)
        has = self.n_seq > 0
        first[has] = self.padded[np.concatenate([[0], np.cumsum(self.n_seq)[:-1]])[has]]
        if self.batch_shape is None:
            return first, np.where(first > 0, self.pack_len // np.maximum(first, 1), 0)
        padded_len, batch_size = (np.asarray(a, dtype=np.int64) for a in self.batch_shape)
        return padded_len, batch_size

    # ---- tokens (only once the sequences tile the packs)

    @cached_property
    def seq_token_offsets(self) -> np.ndarray:
        return offsets_of(self.padded)

    @cached_property
    def position(self) -> np.ndarray:
        """Each token's position in its padded sequence: what position_ids must hold."""
        return positions_in_segments(self.padded)

    # ---- trees (--share-prefix: parent_segments)

    @cached_property
    def parents(self) -> np.ndarray | None:
        """Each sequence's parent within its pack (-1: it starts a row); None for flat packs."""
        parents = self.rows.parent_segments
        return None if parents is None else np.asarray(parents, dtype=np.int64)

    @cached_property
    def parent_ok(self) -> np.ndarray:
        """True where a sequence's parent is -1 or an earlier sequence of its pack."""
        within = np.arange(len(self.seq_lens)) - self.seq_offsets[self.row_of_seq]
        return (self.parents >= -1) & (self.parents < within)

    @cached_property
    def flat_parents(self) -> np.ndarray:
        """Each sequence's parent as an index over the shard's sequences, -1 where it starts a row
        or its parent is out of place (`packctl.contract.tree.flat_parents`)."""
        return tree.flat_parents(self.seq_offsets, self.parents)

    @cached_property
    def has_children(self) -> np.ndarray:
        """True on each sequence another one continues (a prefix)."""
        return tree.continued(self.flat_parents)

    @cached_property
    def chain_start(self) -> np.ndarray:
        """The position of each sequence's first token in its row: the true tokens of its ancestors
        (0 for a flat pack, or where a parent is out of place: the tree rule reports it)."""
        if self.parents is None:
            return np.zeros(len(self.seq_lens), dtype=np.int64)
        return tree.ancestor_sums(self.flat_parents, self.seq_lens)

    @cached_property
    def starts_row(self) -> np.ndarray:
        """True on each sequence that starts a row (every one of a flat pack)."""
        return np.ones(len(self.seq_lens), dtype=bool) if self.parents is None else self.parents < 0

    @cached_property
    def is_pad(self) -> np.ndarray:
        seq_of_token = np.repeat(np.arange(len(self.padded)), self.padded)
        return self.position >= self.seq_lens[seq_of_token]

    @cached_property
    def input_ids(self) -> np.ndarray:
        return np.asarray(self.rows.input_ids)

    @cached_property
    def labels(self) -> np.ndarray:
        return np.asarray(self.rows.labels)

    # ---- where a flat index is

    def locate(self, level: str, k: int) -> tuple[int, int | None]:
        """(row, sequence in the row) of flat index k over rows, sequences, cu entries or tokens."""
        if level == PACK:
            return k, None
        if level == SEQUENCE:
            return self.seq(k)
        if level == CU_ENTRY:
            row, entry = self.cu(k)
            return row, max(entry - 1, 0)
        seq = int(np.searchsorted(self.seq_token_offsets, k, side="right") - 1)
        return self.seq(seq)

    def seq(self, k: int) -> tuple[int, int]:
        row = int(np.searchsorted(self.seq_offsets, k, side="right") - 1)
        return row, k - int(self.seq_offsets[row])

    def cu(self, k: int) -> tuple[int, int]:
        row = int(np.searchsorted(self.cu_offsets, k, side="right") - 1)
        return row, k - int(self.cu_offsets[row])

    def at(self, k: int) -> str:
        """Where flat token k is, in words."""
        seq = int(np.searchsorted(self.seq_token_offsets, k, side="right") - 1)
        row, _ = self.seq(seq)
        return (f"token {k - int(self.token_offsets[row])} of the pack (position "
                f"{k - int(self.seq_token_offsets[seq])} of the sequence)")


CP = Need("cp_size > 1", lambda p: p.layout.cp_size > 1)
PAD_TO_CAPACITY = Need("pad_to is capacity", lambda p: p.layout.pad_to == "capacity")
PAD_TO_MULTIPLE = Need("pad_to is multiple", lambda p: p.layout.pad_to not in ("capacity", "batch"))
PACK_MODE = Need("pad_to is capacity or multiple", lambda p: p.layout.pad_to != "batch")
BATCH_MODE = Need("pad_to is batch (batch mode)", lambda p: p.layout.pad_to == "batch")
SEQUENCES_IN = Need("the manifest gives sequences_in", lambda p: p.sequences_in is not None)
CU_MATCH = Need("every pack has len(seq_lens) + 1 cu entries", lambda p: p.cu_matches)
TILED = Need("seq_lens_padded tile every pack", lambda p: p.tiles)
TREE = Need("the packs have parent_segments (--share-prefix)", lambda p: p.parents is not None)


# ---- the rules; each docstring's first line is the contract's sentence it checks (docs/format.md)


def pack_not_empty(p: Packs) -> Broken:
    """A pack holds at least one sequence."""
    return p.n_seq < 1, lambda r: "the pack holds no sequence"


def pack_within_capacity(p: Packs) -> Broken:
    """No pack is longer than the capacity."""
    cap = p.layout.capacity
    return p.pack_len > cap, lambda r: f"pack length {p.pack_len[r]} exceeds the capacity {cap}"


def pack_of_capacity(p: Packs) -> Broken:
    """With --pad-to capacity every pack is exactly capacity tokens."""
    cap = p.layout.capacity
    return p.pack_len != cap, lambda r: (f"pack length {p.pack_len[r]}, but pad_to=capacity makes every pack {cap} "
                                         "tokens")


def pack_of_multiple(p: Packs) -> Broken:
    """With --pad-to multiple a pack is its padded load rounded up to --pack-multiple."""
    m = p.layout.pack_multiple
    return p.pack_len % m != 0, lambda r: f"pack length {p.pack_len[r]} is not a multiple of pack_multiple {m}"


def pack_cp_aligned(p: Packs) -> Broken:
    """With cp > 1 every pack length is a multiple of 2*cp."""
    two_cp = 2 * p.layout.cp_size
    return p.pack_len % two_cp != 0, lambda r: f"pack length {p.pack_len[r]} is not a multiple of 2*cp = {two_cp}"


def sequence_cp_aligned(p: Packs) -> Broken:
    """With cp > 1 every seq_lens_padded entry is a multiple of 2*cp."""
    two_cp = 2 * p.layout.cp_size
    return p.padded % two_cp != 0, lambda k: (f"seq_lens_padded {p.padded[k]} is not a multiple of 2*cp = {two_cp} "
                                              "(Transformer Engine's THD context-parallel split needs it)")


def sequence_not_empty(p: Packs) -> Broken:
    """seq_lens: true lengths (a sequence holds at least one token)."""
    return p.seq_lens < 1, lambda k: f"seq_lens {p.seq_lens[k]}: every sequence holds at least one token"


def padded_covers_sequence(p: Packs) -> Broken:
    """seq_lens_padded: lengths after alignment (never below the true length)."""
    return p.padded < p.seq_lens, lambda k: f"seq_lens_padded {p.padded[k]} is smaller than seq_lens {p.seq_lens[k]}"


def micro_batch_holds_its_rows(p: Packs) -> Broken:
    """Batch mode: the row is batch_size rows of padded_len tokens laid end to end."""
    padded_len, batch_size = p.batch
    return p.pack_len != padded_len * batch_size, lambda r: (
        f"the micro-batch holds {p.pack_len[r]} tokens, not batch_size {batch_size[r]} x padded_len {padded_len[r]}")


def micro_batch_fits_its_sequences(p: Packs) -> Broken:
    """Batch mode: batch_size rows hold the sequences, padded_len is a multiple of the alignment."""
    padded_len, batch_size = p.batch
    align = p.layout.align
    return (batch_size < p.n_seq) | (padded_len % align != 0) | (padded_len < 1), lambda r: (
        f"batch_size {batch_size[r]} / padded_len {padded_len[r]} cannot hold {p.n_seq[r]} sequences "
        f"padded to a multiple of {align}")


def sequence_padded_to_row(p: Packs) -> Broken:
    """Batch mode: every sequence is padded to padded_len (the last one also holds the empty rows)."""
    row_len = p.batch[0][p.row_of_seq]
    padded, last = p.padded, p.last
    bad = ((~last & (padded != row_len)) | (last & ((padded < row_len) | (padded % np.maximum(row_len, 1) != 0)))
           | (p.aligned > row_len))
    return bad, lambda k: (f"seq_lens_padded {padded[k]} in a micro-batch of padded_len {row_len[k]}: every sequence "
                           "is padded to padded_len (the last one also holds the empty rows)")


def sequence_aligned(p: Packs) -> Broken:
    """seq_lens_padded is seq_lens rounded up to the alignment; the last one also holds the tail padding."""
    padded, aligned, last, align = p.padded, p.aligned, p.last, p.layout.align
    bad = (~last & (padded != aligned)) | (last & (padded < aligned)) | (padded % align != 0)
    return bad, lambda k: (f"seq_lens_padded {padded[k]} for a sequence of {p.seq_lens[k]} tokens with align {align} "
                           f"(expected {aligned[k]}{', plus the tail padding' if last[k] else ''})")


def num_tokens_sum(p: Packs) -> Broken:
    """num_tokens is sum(seq_lens)."""
    num_tokens = np.asarray(p.rows.num_tokens, dtype=np.int64)
    return num_tokens != p.seq_sum, lambda r: f"num_tokens {num_tokens[r]} != sum(seq_lens) {p.seq_sum[r]}"


def sample_ids_in_range(p: Packs) -> Broken:
    """sample_ids are global sample ids: in [0, sequences_in)."""
    sids, n = np.asarray(p.rows.sample_ids, dtype=np.int64), p.sequences_in
    prefix = np.zeros(len(sids), dtype=bool) if p.parents is None else p.has_children & (sids == -1)
    return ((sids < 0) & ~prefix) | (sids >= n), lambda k: (f"sample id {sids[k]} is outside [0, {n}) (the "
                                                            "manifest's sequences_in)")


def tree_parents_precede(p: Packs) -> Broken:
    """parent_segments: -1 or the index of an earlier sequence of the same pack."""
    return ~p.parent_ok, lambda k: (f"parent_segments is {p.parents[k]} for sequence {p.seq(k)[1]} of the pack: a "
                                    "parent is -1 or an earlier sequence of the pack")


def tree_prefix_no_sample(p: Packs) -> Broken:
    """sample_ids is -1 exactly on the segments others continue (the prefixes)."""
    sids = np.asarray(p.rows.sample_ids, dtype=np.int64)
    bad = (sids == -1) != p.has_children
    return bad, lambda k: (f"sample id {sids[k]} on a segment that {'is' if p.has_children[k] else 'is not'} "
                           "continued by another: a prefix segment has sample id -1, every other segment its row's")


def cu_one_longer(p: Packs) -> Broken:
    """cu_seqlens and cu_seqlens_padded have one entry more than the pack has sequences."""
    return p.n_cu != p.n_seq + 1, lambda r: (f"cu_seqlens has {p.n_cu[r]} entries for {p.n_seq[r]} sequences "
                                             "(must be len(seq_lens) + 1)")


def _cumulative(p: Packs, column: str, lens: np.ndarray, formula: str) -> Broken:
    actual = np.asarray(getattr(p.rows, column), dtype=np.int64)
    expected = row_cumsums(lens, p.seq_offsets)

    def describe(k: int) -> str:
        _, entry = p.cu(k)
        return f"{column}[{entry}] is {actual[k]}, expected {expected[k]}: {column} must be {formula}"

    return actual != expected, describe


def cu_seqlens_cumsum(p: Packs) -> Broken:
    """cu_seqlens is [0, cumsum(seq_lens)]."""
    return _cumulative(p, CU_SEQLENS, p.seq_lens, "[0, cumsum(seq_lens)]")


def cu_seqlens_padded_cumsum(p: Packs) -> Broken:
    """cu_seqlens_padded is [0, cumsum(seq_lens_padded)]."""
    return _cumulative(p, CU_SEQLENS_PADDED, p.padded, "[0, cumsum(seq_lens_padded)]")


def cu_seqlens_padded_ends_the_pack(p: Packs) -> Broken:
    """The last entry of cu_seqlens_padded is len(input_ids)."""
    cu_padded = np.asarray(p.rows.cu_seqlens_padded, dtype=np.int64)
    cu_last = cu_padded[p.cu_offsets[1:][p.n_cu > 0] - 1] if len(cu_padded) else np.zeros(0, np.int64)
    if len(cu_last) != len(p.pack_len):
        return np.zeros(len(p.pack_len), dtype=bool), lambda r: ""
    return cu_last != p.pack_len, lambda r: (f"cu_seqlens_padded[-1] is {cu_last[r]}, but the pack holds "
                                             f"{p.pack_len[r]} tokens")


def padded_lengths_tile(p: Packs) -> Broken:
    """seq_lens_padded sum to len(input_ids)."""
    return p.padded_load != p.pack_len, lambda r: (f"seq_lens_padded sum to {p.padded_load[r]} but the pack holds "
                                                   f"{p.pack_len[r]} tokens")


def positions_restart(p: Packs) -> Broken:
    """position_ids restart at 0 at each sequence and continue through its padding (and the tail)."""
    position_ids = np.asarray(p.rows.position_ids)
    expected = p.position if p.parents is None else p.position + np.repeat(p.chain_start, p.padded)
    return position_ids != expected, lambda k: (
        f"position_ids is {position_ids[k]} at {p.at(k)}, expected {expected[k]}: positions restart at 0 "
        "at each sequence (a branch of a shared prefix goes on from its parent) and count through its padding")


def padding_is_pad_token(p: Packs) -> Broken:
    """input_ids: alignment and tail padding are pad_token_id."""
    pad = p.layout.pad_token_id
    return p.is_pad & (p.input_ids != pad), lambda k: (f"padding token is {p.input_ids[k]} at {p.at(k)}, not "
                                                       f"pad_token_id {pad}")


def padding_is_ignored(p: Packs) -> Broken:
    """labels: -100 on every padding token."""
    ignore = p.layout.ignore_index
    return p.is_pad & (p.labels != ignore), lambda k: f"padding label is {p.labels[k]} at {p.at(k)}, not {ignore}"


def first_label_ignored(p: Packs) -> Broken:
    """labels: -100 on the first token of every sequence that starts a row."""
    ignore, labels = p.layout.ignore_index, p.labels
    starts = p.seq_token_offsets[:-1][(p.seq_lens > 0) & p.starts_row]
    bad = np.zeros(len(labels), dtype=bool)
    bad[starts[labels[starts] != ignore]] = True
    return bad, lambda k: (f"the first token of the sequence has label {labels[k]}; it must be {ignore} so that no "
                           "position predicts across a sequence boundary")


def token_ids_in_range(p: Packs) -> Broken:
    """input_ids of real tokens are >= 0."""
    return ~p.is_pad & (p.input_ids < 0), lambda k: (f"input_ids holds {p.input_ids[k]} at {p.at(k)}; token ids are "
                                                     ">= 0")


def labels_in_range(p: Packs) -> Broken:
    """labels of real tokens are >= 0 or -100."""
    ignore, labels = p.layout.ignore_index, p.labels
    return ~p.is_pad & (labels < 0) & (labels != ignore), lambda k: (
        f"labels holds {labels[k]} at {p.at(k)}; labels are >= 0 or {ignore}")


@dataclass(frozen=True)
class PackRule:
    """One row of the table: the rule id a failure reports, the level its mask is over (a pack,
    sequence, cu entry or token: what the failure is located at), the function and what it needs."""

    rule: str
    level: str
    check: Callable[[Packs], Broken]
    needs: tuple[Need, ...] = ()

    @property
    def doc(self) -> str:
        """The contract sentence the rule checks."""
        return (self.check.__doc__ or "").strip().splitlines()[0]


PACK_RULES = (
    PackRule("pack-not-empty", PACK, pack_not_empty),
    PackRule("pack-length", PACK, pack_within_capacity),
    PackRule("pack-length", PACK, pack_of_capacity, (PAD_TO_CAPACITY,)),
    PackRule("pack-length", PACK, pack_of_multiple, (PAD_TO_MULTIPLE,)),
    PackRule("cp-alignment", PACK, pack_cp_aligned, (CP,)),
    PackRule("cp-alignment", SEQUENCE, sequence_cp_aligned, (CP,)),
    PackRule("seq-lens", SEQUENCE, sequence_not_empty),
    PackRule("seq-lens", SEQUENCE, padded_covers_sequence),
    PackRule("batch-shape", PACK, micro_batch_holds_its_rows, (BATCH_MODE,)),
    PackRule("batch-shape", PACK, micro_batch_fits_its_sequences, (BATCH_MODE,)),
    PackRule("alignment", SEQUENCE, sequence_padded_to_row, (BATCH_MODE,)),
    PackRule("alignment", SEQUENCE, sequence_aligned, (PACK_MODE,)),
    PackRule("num-tokens", PACK, num_tokens_sum),
    PackRule("sample-ids", SEQUENCE, sample_ids_in_range, (SEQUENCES_IN,)),
    PackRule("tree-parents", SEQUENCE, tree_parents_precede, (TREE,)),
    PackRule("tree-prefix", SEQUENCE, tree_prefix_no_sample, (TREE,)),
    PackRule("cu-length", PACK, cu_one_longer),
    # the rules of the cu columns are named after them
    PackRule(CU_SEQLENS, CU_ENTRY, cu_seqlens_cumsum, (CU_MATCH,)),
    PackRule(CU_SEQLENS_PADDED, CU_ENTRY, cu_seqlens_padded_cumsum, (CU_MATCH,)),
    PackRule(CU_SEQLENS_PADDED, PACK, cu_seqlens_padded_ends_the_pack, (CU_MATCH,)),
    PackRule("tiling", PACK, padded_lengths_tile),
    # token-level rules need the sequences to tile the packs (every token in one sequence)
    PackRule("position-ids", TOKEN, positions_restart, (TILED,)),
    PackRule("padding-tokens", TOKEN, padding_is_pad_token, (TILED,)),
    PackRule("labels-padding", TOKEN, padding_is_ignored, (TILED,)),
    PackRule("labels-boundary", TOKEN, first_label_ignored, (TILED,)),
    PackRule("token-range", TOKEN, token_ids_in_range, (TILED,)),
    PackRule("label-range", TOKEN, labels_in_range, (TILED,)),
)


def check_pack_rows(rows: PackRows, layout: Layout, *, shard: str | None = None,
                    sequences_in: int | None = None,
                    batch_shape: tuple[np.ndarray, np.ndarray] | None = None) -> list[Violation]:
    """Every per-pack rule of the contract (`PACK_RULES`), over all rows at once; [] when the packs
    are valid. It does no I/O: the writer can assert its own rows before writing them,
    `check_pack_rows(rows, Layout.from_dict(layout_of(config)))`. `batch_shape`: the shard's
    (padded_len, batch_size) columns in batch mode.

    Example (the pack drawn in the module docstring, with its first label left in):

        >>> rows = ...  # PackRows of that pack, labels[0] = a0
        >>> [v.rule for v in check_pack_rows(rows, layout)]   # doctest: +SKIP
        ['labels-boundary']
    """
    packs = Packs(rows, layout, sequences_in=sequences_in, batch_shape=batch_shape)
    found: list[Violation] = []
    for rule in PACK_RULES:
        if not all(need.holds(packs) for need in rule.needs):
            continue
        bad, describe = rule.check(packs)
        count = int(np.count_nonzero(bad))
        if count:
            k = int(np.argmax(bad))
            row, seq = packs.locate(rule.level, k)
            found.append(Violation("structure", rule.rule, describe(k), shard=shard, row=row, sequence=seq,
                                   count=count))
    return found


def tiled_starts(rows: PackRows) -> np.ndarray | None:
    """Flat offset of every padded sequence in `rows.input_ids`, from `seq_lens_padded`; None when the
    padded lengths do not tile the packs (a structure violation that `check_pack_rows` reports).

    Two packs [4, 4] and [8] -> [0, 4, 8, 16]: sequence i occupies [starts[i], starts[i + 1]).
    """
    padded = np.asarray(rows.seq_lens_padded, dtype=np.int64)
    seq_offsets = np.asarray(rows.seq_offsets, dtype=np.int64)
    pack_len = np.diff(np.asarray(rows.token_offsets, dtype=np.int64))
    per_row = np.diff(seq_offsets)
    if (padded < 0).any() or (np.asarray(rows.seq_lens) > padded).any() or (np.asarray(rows.seq_lens) < 0).any():
        return None
    load = np.bincount(np.repeat(np.arange(len(per_row)), per_row), weights=padded, minlength=len(per_row))
    if not np.array_equal(load.astype(np.int64), pack_len):
        return None
    return offsets_of(padded)
