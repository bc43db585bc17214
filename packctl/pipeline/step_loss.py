"""The loss tokens of each optimizer step, from the global plan (`--dp-size`): `step_loss_tokens`
and `step_loss_sequences`, written on every pack of the step (docs/format.md).

A step's packs may be written by several ranks, so the sums cannot come from the writers: they are
computed where the step is planned (a step never leaves its window, and a window is planned whole on
one rank), from the loss tokens of every piece. A piece's loss tokens are its labels that are not
-100 after its first token (the first is masked in the pack); the rank that scanned the piece's
block counts them:

    whole sequence     from scan (`SequenceIndex.loss_tokens`), no token read again
    part of one        (split, truncated) counted in its decoded block, [start + 1, start + len)
    no labels column   len - 1 (labels are the tokens, never -100): nothing asked, nothing read
    --share-prefix     a branch counts its whole row (prefix and branch, as the row unshared), a
                       prefix nothing: the counts are the rows', as `seq_loss_tokens` of a tree

    step 0: packs p0 [a b] and p1 [c] on ranks 0 and 1, loss tokens a 4, b 0, c 6
            step_loss_tokens 10 and step_loss_sequences 2 on p0 and p1 (b has no loss token)
"""
from __future__ import annotations

import numpy as np

from packctl.contract.schema import STEP_LOSS_SEQUENCES, STEP_LOSS_TOKENS
from packctl.mpi.comm import Comm
from packctl.source.scan import TokenSource
from packctl.plan.prefix import prefix_pieces
from packctl.plan.windows import PackPlan
from packctl.source.index import SequenceIndex


def step_loss_columns(comm: Comm, plan: PackPlan, step: np.ndarray, index: SequenceIndex, source: TokenSource,
                      block_bounds: np.ndarray, parents: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """`step_loss_tokens` and `step_loss_sequences` per pack of this rank's plan; `step` is each
    pack's step (the steps of this rank's windows, any numbering); `parents` (--share-prefix) each
    piece's `parent_segments` entry."""
    piece_loss = piece_loss_tokens(comm, plan, index, source, block_bounds, parents)
    piece_pack = np.repeat(np.arange(plan.num_bins), np.diff(plan.bin_offsets))
    piece_step = np.asarray(step, dtype=np.int64)[piece_pack]
    steps = int(piece_step.max()) + 1 if len(piece_step) else 0
    tokens = np.bincount(piece_step, weights=piece_loss, minlength=steps).astype(np.int64)
    sequences = np.bincount(piece_step, weights=piece_loss > 0, minlength=steps).astype(np.int64)
    return {STEP_LOSS_TOKENS: tokens[step], STEP_LOSS_SEQUENCES: sequences[step]}


def piece_loss_tokens(comm: Comm, plan: PackPlan, index: SequenceIndex, source: TokenSource,
                      block_bounds: np.ndarray, parents: np.ndarray | None = None) -> np.ndarray:
    """int64 loss tokens of every piece of `plan`, asked of the ranks that scanned their blocks
    (rank r scanned blocks [block_bounds[r], block_bounds[r + 1])): one Alltoallv of requests
    (gid, start, len) and one of answers. Without a labels column (the same on every rank) each
    piece's count is its length - 1, known here. With `parents` (--share-prefix, each piece's
    `parent_segments`) a branch counts its row from token 0 and a prefix 0:

        prefix (gid 5, 0, 3), branch (5, 3, 3), branch (6, 3, 2)  ->  asked (5, 0, 3) (5, 0, 6) (6, 0, 5)
    """
    start, length = plan.piece_start, plan.piece_len
    if parents is not None:
        branch = np.asarray(parents) >= 0
        start, length = np.where(branch, 0, start), np.where(branch, start + length, length)
    if index.labels_column is None:
        counts = np.maximum(length.astype(np.int64) - 1, 0)
    else:
        counts = _ask_owners(comm, plan.piece_gid, start, length, index, source, block_bounds)
    if parents is not None:
        counts[prefix_pieces(plan.bin_offsets, parents)] = 0
    return counts


def _ask_owners(comm: Comm, gid: np.ndarray, start: np.ndarray, length: np.ndarray, index: SequenceIndex,
                source: TokenSource, block_bounds: np.ndarray) -> np.ndarray:
    """The loss tokens of pieces (gid, start, len), each counted by the rank that scanned it."""
    rank_of_gid_bound = index.block_offsets[block_bounds]
    owner = np.searchsorted(rank_of_gid_bound, gid, side="right") - 1
    order = np.argsort(owner, kind="stable")
    requests = np.stack([gid[order], start[order], length[order]], axis=1)
    received, recv_counts = comm.alltoallv(np.ascontiguousarray(requests.ravel()),
                                           np.bincount(owner, minlength=comm.size).astype(np.int64) * 3)
    answers = _count_here(received.reshape(-1, 3), index, source)
    got, _ = comm.alltoallv(answers, recv_counts // 3)
    out = np.empty(len(order), np.int64)
    out[order] = got
    return out


def _count_here(requests: np.ndarray, index: SequenceIndex, source: TokenSource) -> np.ndarray:
    """Loss tokens of pieces (gid, start, len) of sequences this rank scanned."""
    gid, start, length = requests[:, 0], requests[:, 1], requests[:, 2]
    local = gid - index.gid_lo
    out = index.loss_tokens[local].copy()
    partial = np.flatnonzero((start != 0) | (length != index.lengths[local]))
    if len(partial) == 0:
        return out
    block_of = np.searchsorted(index.block_offsets, gid[partial], side="right") - 1
    for b in np.unique(block_of).tolist():
        sel = partial[block_of == b]
        decoded = source.peek(b) if source.cached(b) else source.decode(index.blocks[b])
        first = decoded.offsets[gid[sel] - index.block_offsets[b]] + start[sel] + 1
        out[sel] = decoded.count_targets(first, np.maximum(length[sel] - 1, 0))
    return out
