"""Context parallel: each rank's share of every pack is a valid THD layout, and how evenly the
ranks share the causal attention work.

With cp ranks, Transformer Engine cuts every padded sequence into 2*cp chunks and gives rank r
chunks r and 2cp-1-r (`packctl.contract.thd.cp_partition_indices`). For cp = 2 and one sequence of 8:

    tokens   0 1 | 2 3 | 4 5 | 6 7         rank 0: chunks 0 and 3   rank 1: chunks 1 and 2
    chunk    0   | 1   | 2   | 3

Causal work of a query at position p is p + 1 keys. Over padded positions the zigzag makes the
ranks' work equal; padding is not computed by kernels given cu_seqlens (Transformer Engine's
`cu_seqlens_q`), so the work that counts is that of real tokens, and the padding at the end of
each sequence (in its last chunk, held by rank 0) makes rank 0 the lighter one. The check reports
both, per pack and summed.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from packctl.arrays import positions_in_segments
from packctl.contract.thd import PackRows, cp_partition_indices
from packctl.verify.pack_rules import tiled_starts
from packctl.verify.violation import Violation


@dataclass
class CpWork:
    """Per pack and rank: causal work (sum of position + 1) of the real and of all tokens a rank holds."""

    cp_size: int
    real: list[np.ndarray] = field(default_factory=list)  # (packs, cp) per shard
    padded: list[np.ndarray] = field(default_factory=list)
    shards: list[str] = field(default_factory=list)  # the shard of each entry of `real`

    def add(self, shard: str, real: np.ndarray, padded: np.ndarray) -> None:
        self.shards.append(shard)
        self.real.append(real)
        self.padded.append(padded)

    def summary(self) -> dict:
        if not self.real:
            return {"cp_size": self.cp_size, "packs": 0}
        real = np.concatenate(self.real).astype(np.float64)
        padded = np.concatenate(self.padded).astype(np.float64)
        per_pack = real.max(axis=1) / np.maximum(real.mean(axis=1), 1e-12)
        worst = int(np.argmax(per_pack))
        totals = real.sum(axis=0)
        block_offsets = np.cumsum([0] + [len(r) for r in self.real])
        block = int(np.searchsorted(block_offsets, worst, side="right") - 1)
        return {
            "cp_size": self.cp_size,
            "packs": int(len(real)),
            "rank_work_real": [int(x) for x in totals],
            "rank_work_padded": [int(x) for x in padded.sum(axis=0)],
            "imbalance": float(totals.max() / max(totals.mean(), 1e-12)),
            "mean_pack_imbalance": float(per_pack.mean()),
            "worst_pack_imbalance": float(per_pack[worst]),
            "worst_pack": {"shard": self.shards[block], "row": worst - int(block_offsets[block])},
        }


def check_cp(rows: PackRows, cp_size: int, work: CpWork, *, shard: str) -> list[Violation]:
    """Every pack of a shard split over `cp_size` ranks: the split exists (padded lengths are
    multiples of 2*cp), the ranks' shares partition each pack, each rank holds len/cp tokens of it
    sequence after sequence; adds every pack's per-rank work to `work`."""
    starts = tiled_starts(rows)
    if starts is None:
        return [Violation("cp", "cp-layout", "the packs cannot be split over context-parallel ranks: "
                          "seq_lens_padded do not tile them (see the structure failures)", shard=shard)]
    padded = np.asarray(rows.seq_lens_padded, dtype=np.int64)
    seq_lens = np.asarray(rows.seq_lens, dtype=np.int64)
    seq_offsets = np.asarray(rows.seq_offsets, dtype=np.int64)
    pack_len = np.diff(np.asarray(rows.token_offsets, dtype=np.int64))
    n_rows = len(pack_len)
    row_of_seq = np.repeat(np.arange(n_rows), np.diff(seq_offsets))
    chunks = 2 * cp_size
    bad = padded % chunks != 0
    if bad.any():
        k = int(np.argmax(bad))
        row = int(row_of_seq[k])
        return [Violation("cp", "cp-split", f"seq_lens_padded {padded[k]} is not a multiple of 2*cp = {chunks}, so "
                          f"Transformer Engine cannot split it over {cp_size} ranks; pack with --cp-size {cp_size}",
                          shard=shard, row=row, sequence=k - int(seq_offsets[row]), count=int(bad.sum()))]
    found: list[Violation] = []
    seq_of_token = np.repeat(np.arange(len(padded)), padded)
    row_of_token = row_of_seq[seq_of_token]
    position = positions_in_segments(padded)
    real = position < seq_lens[seq_of_token]
    held = np.zeros(int(starts[-1]), dtype=np.int64)
    work_real = np.zeros((n_rows, cp_size), dtype=np.int64)
    work_padded = np.zeros((n_rows, cp_size), dtype=np.int64)
    for rank in range(cp_size):
        idx = cp_partition_indices(starts, cp_size, rank)
        held[idx] += 1
        share = np.bincount(row_of_token[idx], minlength=n_rows)
        if not np.array_equal(share, pack_len // cp_size):
            r = int(np.argmax(share != pack_len // cp_size))
            found.append(Violation("cp", "cp-share", f"rank {rank} holds {share[r]} tokens of a {pack_len[r]}-token "
                                   f"pack, not {pack_len[r] // cp_size}", shard=shard, row=r))
        per_seq = np.bincount(seq_of_token[idx], minlength=len(padded))
        ordered = np.all(np.diff(seq_of_token[idx]) >= 0)
        if not ordered or not np.array_equal(per_seq, padded // cp_size):
            k = int(np.argmax(per_seq != padded // cp_size)) if ordered else 0
            row = int(row_of_seq[k])
            found.append(Violation("cp", "cp-layout", f"rank {rank}'s share is not a THD layout with "
                                   "cu_seqlens_padded / cp (each sequence's tokens together, len/cp of them)",
                                   shard=shard, row=row, sequence=k - int(seq_offsets[row])))
        cost = position[idx] + 1
        work_padded[:, rank] = np.bincount(row_of_token[idx], weights=cost, minlength=n_rows)
        work_real[:, rank] = np.bincount(row_of_token[idx][real[idx]], weights=cost[real[idx]], minlength=n_rows)
    if not (held == 1).all():
        k = int(np.argmax(held != 1))
        seq = int(seq_of_token[k])
        row = int(row_of_seq[seq])
        found.append(Violation("cp", "cp-partition", f"token {k - int(rows.token_offsets[row])} of the pack is held by "
                               f"{held[k]} ranks; the ranks' shares must partition the pack",
                               shard=shard, row=row, sequence=seq - int(seq_offsets[row])))
    work.add(shard, work_real, work_padded)
    return found
