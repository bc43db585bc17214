"""Build THD pack rows (flat tokens + cumulative sequence lengths) from planned pieces.

Everything is vectorized over a whole shard: no per-pack or per-token Python loop.
See `packctl.contract.schema` for a drawn pack.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from packctl.arrays import Scratch, copy_segments, count_not_equal, offsets_of, row_cumsums, segment_positions
from packctl.contract import tree
from packctl.contract.schema import IGNORE_INDEX, INPUT_IDS, LABELS, POSITION_IDS


@dataclass
class PackRows:
    """Column values (flat numpy) and row offsets for a run of packs."""

    token_offsets: np.ndarray  # int64, R+1 over input_ids / labels / position_ids
    input_ids: np.ndarray | None  # None: the rows of a plan (`lay_out_sequences`)
    labels: np.ndarray | None
    position_ids: np.ndarray | None
    seq_offsets: np.ndarray  # int64, R+1 over seq_lens / seq_lens_padded / sample_ids
    seq_lens: np.ndarray
    seq_lens_padded: np.ndarray
    sample_ids: np.ndarray
    cu_offsets: np.ndarray  # int64, R+1 over cu_seqlens / cu_seqlens_padded
    cu_seqlens: np.ndarray
    cu_seqlens_padded: np.ndarray
    num_tokens: np.ndarray
    # --share-prefix: per sequence (CSR over seq_offsets), the index in its pack of the segment it
    # continues or -1 (contract/tree.py); None for a pack of flat sequences
    parent_segments: np.ndarray | None = None

    @property
    def num_rows(self) -> int:
        return len(self.token_offsets) - 1


def build_pack_rows(bin_offsets: np.ndarray, piece_len: np.ndarray, piece_padded: np.ndarray,
                    piece_gid: np.ndarray, tokens: np.ndarray, labels: np.ndarray, pack_lens: np.ndarray,
                    *, pad_token_id: int) -> PackRows:
    """Lay pieces out as packs.

    Args:
        bin_offsets: CSR offsets of the pieces of each pack (starting at 0).
        piece_len, piece_padded, piece_gid: true length, aligned length and sample id of each piece.
        tokens, labels: the pieces' source tokens and labels, concatenated in piece order.
        pack_lens: final length of each pack (>= its padded load).

    Example: one pack of capacity 8, pieces of 3 and 2 tokens, align 2:

        seq_lens [3, 2]  seq_lens_padded [4, 4] (2 + 2 tail)  cu_seqlens_padded [0, 4, 8]
        input_ids    t t t 0 u u 0 0      position_ids 0 1 2 3 0 1 2 3
    """
    src_starts = offsets_of(piece_len)[:-1]

    def place(input_ids: np.ndarray, out_labels: np.ndarray, piece_flat_start: np.ndarray) -> None:
        copy_segments(tokens, src_starts, input_ids, piece_flat_start, piece_len)
        copy_segments(labels, src_starts, out_labels, piece_flat_start, piece_len)

    return lay_out_packs(lay_out_sequences(bin_offsets, piece_len, piece_padded, piece_gid, pack_lens), place,
                         pad_token_id=pad_token_id)


def lay_out_packs(rows: PackRows, place: Callable[[np.ndarray, np.ndarray, np.ndarray], None], *, pad_token_id: int,
                  scratch: Scratch | None = None, position_starts: np.ndarray | None = None) -> PackRows:
    """The packs `rows` lays out (`lay_out_sequences`), their tokens put in place by
    `place(input_ids, labels, piece_flat_start)`: it writes piece i's tokens and labels at
    piece_flat_start[i] (int64) of the pad-filled int32 columns, straight from wherever they are
    (no intermediate concatenation); `rows` gets the three token columns and is returned. With
    `scratch`, they are `scratch` buffers (valid until its next use).

    `position_starts` (--share-prefix, int64 per piece): the position of each piece's first token;
    a piece whose first position is above 0 continues its parent segment (a branch of a shared
    prefix, docs/shared-prefix.md), so its positions go on from there and its first label is the
    row's own: branch [4 9] at position 3 -> position_ids 3 4, labels keep the label of 4."""
    piece_flat_start = offsets_of(rows.seq_lens_padded)[:-1]
    total = int(rows.token_offsets[-1])

    scratch = scratch or Scratch()
    input_ids = scratch.take(INPUT_IDS, total, np.int32)
    input_ids.fill(pad_token_id)
    out_labels = scratch.take(LABELS, total, np.int32)
    out_labels.fill(IGNORE_INDEX)
    place(input_ids, out_labels, piece_flat_start)
    # The first token of each sequence has no predecessor in that sequence: after the usual shift
    # its label would be predicted from the previous sequence's last token, so it is ignored.
    continues = None if position_starts is None else np.asarray(position_starts) > 0
    out_labels[piece_flat_start if continues is None else piece_flat_start[~continues]] = IGNORE_INDEX
    rows.input_ids, rows.labels = input_ids, out_labels
    rows.position_ids = segment_positions(rows.seq_lens_padded, out=scratch.take(POSITION_IDS, total, np.int32))
    if continues is not None and continues.any():
        rows.position_ids += np.repeat(np.asarray(position_starts, np.int32), rows.seq_lens_padded)
    return rows


def lay_out_sequences(bin_offsets: np.ndarray, piece_len: np.ndarray, piece_padded: np.ndarray,
                      piece_gid: np.ndarray, pack_lens: np.ndarray) -> PackRows:
    """The packs' layout without their tokens: every column of one value per pack, per sequence
    or per cu_seqlens entry; `input_ids`, `labels` and `position_ids` are None (a plan's rows,
    `pack --plan-only`; `lay_out_packs` fills them). The last piece of a pack takes the tail
    padding: pieces of 3 and 2 tokens, align 2, pack length 8 -> seq_lens_padded [4, 4]."""
    bin_offsets = np.asarray(bin_offsets, dtype=np.int64)
    rows = len(bin_offsets) - 1
    pieces_per_row = np.diff(bin_offsets)
    if (pieces_per_row < 1).any():
        raise ValueError("every pack needs at least one piece")
    last_piece = bin_offsets[1:] - 1

    loads = np.add.reduceat(piece_padded, bin_offsets[:-1]) if rows else np.zeros(0, np.int64)
    tail = np.asarray(pack_lens, dtype=np.int64) - loads
    if (tail < 0).any():
        raise ValueError("a pack is longer than its pack length")
    seq_lens_padded = piece_padded.astype(np.int64).copy()
    seq_lens_padded[last_piece] += tail

    cu_offsets = bin_offsets + np.arange(rows + 1)
    cu_seqlens = row_cumsums(piece_len, bin_offsets, np.int32)
    cu_seqlens_padded = row_cumsums(seq_lens_padded, bin_offsets, np.int32)
    num_tokens = np.add.reduceat(piece_len, bin_offsets[:-1]) if rows else np.zeros(0, np.int64)
    return PackRows(
        token_offsets=offsets_of(pack_lens), input_ids=None, labels=None, position_ids=None,
        seq_offsets=bin_offsets, seq_lens=piece_len.astype(np.int32),
        seq_lens_padded=seq_lens_padded.astype(np.int32), sample_ids=piece_gid.astype(np.int64),
        cu_offsets=cu_offsets, cu_seqlens=cu_seqlens, cu_seqlens_padded=cu_seqlens_padded,
        num_tokens=num_tokens.astype(np.int32),
    )


def cp_partition_indices(cu_seqlens_padded: np.ndarray, cp_size: int, cp_rank: int) -> np.ndarray:
    """Indices of the tokens that context-parallel rank `cp_rank` of `cp_size` holds.

    The split of Transformer Engine's THD context parallelism (`thd_get_partitioned_indices`):
    every padded sequence is cut into 2*cp_size equal chunks and rank r keeps chunks r and
    2*cp_size-1-r, so each rank gets an early (cheap) and a late (expensive) chunk of every causal
    sequence. The result lists the kept tokens sequence after sequence, ascending, and holds
    `cu_seqlens_padded[-1] / cp_size` indices: the rank's local THD layout, whose own
    cu_seqlens_padded is `cu_seqlens_padded / cp_size`.

        cu_seqlens_padded [0, 8, 16], cp_size 2 (chunks of 2 tokens):
        index   0 1 | 2 3 | 4 5 | 6 7 || 8 9 | 10 11 | 12 13 | 14 15
        chunk   0   | 1   | 2   | 3   || 0   | 1     | 2     | 3
        rank 0 -> [0, 1, 6, 7, 8, 9, 14, 15]      rank 1 -> [2, 3, 4, 5, 10, 11, 12, 13]

    Args:
        cu_seqlens_padded: `[0, cumsum(seq_lens_padded)]` of one pack (indices are then positions in
            that pack's `input_ids`), or of several packs laid end to end (positions in the
            concatenated tokens).
        cp_size: context-parallel size (>= 1).
        cp_rank: the rank, in [0, cp_size).

    Raises ValueError when cu_seqlens_padded decreases or a padded length is not a multiple of
    2*cp_size (pack with `--cp-size` so packctl pads every sequence to it).
    """
    cu = np.asarray(cu_seqlens_padded, dtype=np.int64)
    if cu.ndim != 1 or len(cu) < 1:
        raise ValueError("cu_seqlens_padded must be a 1-D array with at least one entry")
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} is not in [0, cp_size={cp_size})")
    lens = np.diff(cu)
    if (lens < 0).any():
        i = int(np.argmax(lens < 0))
        raise ValueError(f"cu_seqlens_padded decreases at sequence {i} ({int(cu[i])} -> {int(cu[i + 1])})")
    if cp_size == 1:  # no split: the rank holds every token
        return np.arange(int(cu[-1] - cu[0]), dtype=np.int64) + cu[0]
    chunks = 2 * cp_size
    if (lens % chunks).any():
        i = int(np.argmax(lens % chunks != 0))
        raise ValueError(f"sequence {i} has padded length {int(lens[i])}, not a multiple of 2*cp_size = {chunks}; "
                         f"pack with --cp-size {cp_size} so every sequence is padded to it")
    chunk = lens // chunks
    kept = np.array([cp_rank, chunks - 1 - cp_rank], dtype=np.int64)
    starts = (cu[:-1, None] + kept[None, :] * chunk[:, None]).ravel()  # early then late chunk of each sequence
    sizes = np.repeat(chunk, 2)
    return np.arange(int(sizes.sum()), dtype=np.int64) + np.repeat(starts - (np.cumsum(sizes) - sizes), sizes)


@dataclass
class LossColumns:
    """What a pack holds for loss normalization, one value per pack or per sequence.

    num_loss_tokens  per pack: labels that are not -100 (the targets that carry loss)
    seq_loss_tokens  per sequence (CSR over `PackRows.seq_offsets`): the same, sequence by sequence
    sum_sq_seqlen    per pack: sum of seq_lens**2, the causal-attention cost of the pack

    The pack drawn in `packctl.contract.schema` (5 and 6 tokens, each first label -100, nothing else
    masked): seq_loss_tokens [4, 5], num_loss_tokens 9, sum_sq_seqlen 25 + 36 = 61.
    """

    num_loss_tokens: np.ndarray  # int32 per pack
    seq_loss_tokens: np.ndarray  # int32 per sequence
    sum_sq_seqlen: np.ndarray  # int64 per pack


def loss_columns(rows: PackRows) -> LossColumns:
    """The loss-normalization columns of `rows`, counted from the labels as written (the boundary
    mask included). The sequences' padded lengths must tile the packs (`check_pack_rows` rule
    `tiling`), so sequence k owns the labels [offsets[k], offsets[k + 1]) of the flat column."""
    padded = np.asarray(rows.seq_lens_padded, dtype=np.int64)
    per_seq = count_not_equal(np.asarray(rows.labels), offsets_of(padded)[:-1], padded, IGNORE_INDEX)
    seq_offsets = np.asarray(rows.seq_offsets, dtype=np.int64)
    seq_lens = np.asarray(rows.seq_lens, dtype=np.int64)
    if rows.parent_segments is not None:
        return _tree_loss_columns(per_seq, seq_lens, seq_offsets, rows.parent_segments)
    return LossColumns(num_loss_tokens=_row_sums(per_seq, seq_offsets).astype(np.int32),
                       seq_loss_tokens=per_seq.astype(np.int32),
                       sum_sq_seqlen=_row_sums(seq_lens * seq_lens, seq_offsets))


def _tree_loss_columns(stored: np.ndarray, seq_lens: np.ndarray, seq_offsets: np.ndarray,
                       parent_segments: np.ndarray) -> LossColumns:
    """The loss columns of tree packs (--share-prefix), counted per input row as its rows hold
    them unshared: a segment that holds a row counts the targets of its whole chain (`stored`: the
    labels that are not -100 in each segment as written), a prefix counts 0, so `num_loss_tokens`
    and the step sums are those of the rows packed flat. The attention cost of a segment of L
    tokens after c tokens of its ancestors is L^2 + 2 L c (the pairs it sees, doubled as L^2 is;
    the balance's cost): a row of n = c + L tokens alone costs n^2 = c^2 + 2 L c + L^2.

        prefix [1 2 3] | branch 5 [4 7 8] | branch 6 [4 9]   labels . . . | . 7 8 | . 9
        stored [0, 2, 1] -> seq_loss_tokens [0, 2, 1], num_loss_tokens 3
        the prompt trained on (labels . 2 3 | 4 7 8 | 4 9): stored [2, 3, 2] -> seq_loss_tokens [0, 5, 4], 9
        sum_sq_seqlen 9 + (9 + 2*3*3) + (4 + 2*2*3) = 52  (rows alone: 6^2 + 5^2 = 61)
    """
    parents = tree.flat_parents(seq_offsets, parent_segments)
    per_row = np.where(tree.continued(parents), 0, stored + tree.ancestor_sums(parents, stored))
    context = tree.ancestor_sums(parents, seq_lens)
    return LossColumns(num_loss_tokens=_row_sums(per_row, seq_offsets).astype(np.int32),
                       seq_loss_tokens=per_row.astype(np.int32),
                       sum_sq_seqlen=_row_sums(seq_lens * seq_lens + 2 * seq_lens * context, seq_offsets))


def counted_loss_columns(rows: PackRows, piece_loss: np.ndarray) -> LossColumns:
    """The loss-normalization columns of `rows` from each sequence's loss tokens counted elsewhere
    (a plan's rows have no labels): the labels that are not -100 in [start + 1, start + len) of its
    source sequence, `loss_columns` of the packed labels, whose first label and padding are -100.
    Without a labels column that is len - 1: pieces of 5 and 6 tokens -> seq_loss_tokens [4, 5]."""
    per_seq = np.asarray(piece_loss, dtype=np.int64)
    seq_offsets = np.asarray(rows.seq_offsets, dtype=np.int64)
    seq_lens = np.asarray(rows.seq_lens, dtype=np.int64)
    return LossColumns(num_loss_tokens=_row_sums(per_seq, seq_offsets).astype(np.int32),
                       seq_loss_tokens=per_seq.astype(np.int32),
                       sum_sq_seqlen=_row_sums(seq_lens * seq_lens, seq_offsets))


def _row_sums(values: np.ndarray, seq_offsets: np.ndarray) -> np.ndarray:
    """Sum of each row's values, rows being CSR over `values`: [3, 2, 4] with offsets [0, 2, 3] -> [5, 4]."""
    sums = np.concatenate([[0], np.cumsum(values, dtype=np.int64)])
    return sums[seq_offsets[1:]] - sums[seq_offsets[:-1]]
