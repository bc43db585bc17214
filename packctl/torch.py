"""Train on packctl output with PyTorch: a dataset over the packed shards and one collate function
per kind of trainer (flash-attn, Hugging Face padding-free, Transformer Engine / Megatron THD), and
`collate_tree` for shared-prefix packs (a mask and a per-row loss: docs/training.md).

    from torch.utils.data import DataLoader
    from packctl.torch import PackedDataset, collate_flash_attn

    loader = DataLoader(PackedDataset("packed"), batch_size=2, collate_fn=collate_flash_attn)

Every collate function lays the packs of a batch end to end in one row of shape [1, T] (the THD
layout: no batch dimension, sequences told apart by cumulative lengths). Two packs, pad id 0,
`.` = -100 (docs/format.md draws one pack column by column):

    pack 0   input_ids  a0 a1 a2  0 b0 b1 b2 b3     cu_seqlens_padded [0, 4, 8]   seq_lens [3, 4]
    pack 1   input_ids  c0 c1 c2 c3 c4 c5  0  0     cu_seqlens_padded [0, 8]      seq_lens [6]

    collate_flash_attn([pack 0, pack 1])
      input_ids     [[a0 a1 a2  0 b0 b1 b2 b3 c0 c1 c2 c3 c4 c5  0  0]]       int64 [1, 16]
      labels        [[ . a1 a2  .  . b1 b2 b3  . c1 c2 c3 c4 c5  .  .]]       int64 [1, 16]
      position_ids  [[ 0  1  2  3  0  1  2  3  0  1  2  3  4  5  6  7]]       int64 [1, 16]
      cu_seqlens    [0, 4, 8, 16]   int32 (from cu_seqlens_padded)            max_seqlen 8 (int)

Padding belongs to the sequence it follows, so a padded segment is attended as one causal
sequence whose real tokens come first: padding never sees into another sequence and no real token
sees padding. Its labels are -100, so it adds nothing to the loss or the gradients.

torch is an optional extra: importing this module without it fails with the pip line.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from packctl.errors import PackctlError, require
from packctl.contract.reader import open_output
from packctl.contract.schema import (BALANCE_COLUMNS, COLUMN, COLUMNS, CU_SEQLENS, CU_SEQLENS_PADDED, DP_RANK,
                                     GROUP_IDS, IGNORE_INDEX, INPUT_IDS, LABELS, LR_SCALE, MICRO_BATCH,
                                     NUM_LOSS_TOKENS, POSITION_IDS, SAMPLE_IDS, SEQ_LENS, SEQ_LOSS_TOKENS, SEQ_STARTS, SEQ_WEIGHTS, STEP, STEP_LOSS_COLUMNS,
                                     STEP_LOSS_SEQUENCES, STEP_LOSS_TOKENS, TOKEN_COLUMNS, limit_sum_name)
from packctl.contract import tree
from packctl.contract.thd import cp_partition_indices
from packctl.contract.tree import PARENT_SEGMENTS
from packctl.source.pieces import BlockCache, plan_rows, plan_source

torch = require("torch", "torch", "packctl.torch")

__all__ = [
    "thd_batch",
    "PackedDataset", "RowGroupShuffle", "collate_flash_attn", "collate_hf", "collate_thd", "cp_slice", "packed_seq_params",
    "block_causal_mask", "varlen_attention", "read_lr_scales", "apply_lr_scale", "loss_fn", "split_loss_fields",
    "split_limit_fields",
    "collate_tree", "tree_attention_mask", "tree_mask_mod", "tree_block_mask", "tree_loss", "row_logprobs",
]


class PackedDataset(torch.utils.data.Dataset):
    """Map-style dataset over the packs of a packctl output directory; item i is one pack.

    The shards are those listed in `OUT/_manifest.json`, in that order. An item costs about one
    row group (128 packs), not a shard: the row group holding it is read and decoded, and the last
    `cache_row_groups` decoded row groups are kept, per process (each DataLoader worker holds its
    own). In order, a row group is decoded once for its 128 packs; in random order (`shuffle=True`)
    about once per item, unless it is still cached; `RowGroupShuffle` shuffles at in-order cost. `len()` comes from the manifest's row counts (a
    balanced output also has its three small balance columns read once, to find the rank's packs).

    What is read is what the manifest vouches for (`packctl.contract.reader`): the manifest is
    validated when the dataset is built (shard paths inside OUT, fields of the right type, shards in
    order, counts that add up, no unlisted shard in OUT). The first item a process reads from a
    shard has the shard read once into memory, its sha256 compared with the manifest's, its rows,
    tokens and layout compared too; a shard that differs raises PackctlError naming it, before any
    of its packs is returned. From those bytes each row group's sha256 is kept, and every later
    read of a row group compares the bytes it reads with it. `verify=False` skips the sha256, tokens
    and layout checks (and reads through a memory map); the row counts, which items are indexed by,
    are always compared.

    Which packs a data-parallel rank sees, and in which order:

    - the output was balanced (it has `step`, `dp_rank`, `micro_batch` columns): rank r sees the
      packs whose `dp_rank` is r, ordered by (`step`, `micro_batch`); without `dp_rank` every pack,
      ordered by (`step`, `dp_rank`, `micro_batch`). Ties keep output order.
    - otherwise, with `dp_size` given: the packs are strided over the ranks exactly as
      `torch.utils.data.DistributedSampler(dataset, dp_size, dp_rank, shuffle=False,
      drop_last=drop_last)` strides them: rank r sees packs r, r + dp_size, r + 2*dp_size, ...
      With `drop_last=False` the list is first extended by wrapping around to its start until its
      length divides by dp_size (every rank gets ceil(N / dp_size) packs, a few packs twice);
      with `drop_last=True` the last N % dp_size packs are left out (floor(N / dp_size) each).
      Equal lengths keep the ranks' steps in lockstep.
    - otherwise: every pack, in output order.

        7 packs, dp_size 3, drop_last False:  rank 0 -> [0, 3, 6]  rank 1 -> [1, 4, 0]  rank 2 -> [2, 5, 1]

    An item is a dict of the pack's columns (docs/format.md, `packctl.contract.schema.COLUMNS`):
    every declared column the output has, a column of one value per pack as a Python int or float
    (`num_tokens`, and `step`, `dp_rank`, `micro_batch`, `lr_scale`, the loss counts ... when the
    output has them), a list column as a numpy array (`input_ids`, `labels`, `position_ids`,
    `seq_lens`, `seq_lens_padded`, `cu_seqlens`, `cu_seqlens_padded`, `sample_ids`, `seq_lengths`,
    `seq_loss_tokens`, `seq_weights`, `group_ids` ...), plus `index` (the pack's row in output
    order). An output packed with `--limit COL=N` also carries, for each limited COL (the
    manifest's `layout.limits`), `COL` (int64 array, one value per sequence, aligned with
    `seq_lens` and `sample_ids`) and `COL_sum` (int, the pack's sum). Kept input columns
    (--keep-columns) are not carried. The arrays are read-only views of
    the decoded shard; the collate functions copy them.

    A plan (`packctl pack --plan-only`) is read the same way, its token columns gathered from the
    source it was made from (`packctl.source.pieces`), so an item holds exactly what it holds in the
    output `packctl materialize` writes of the plan: the same keys, the same arrays byte for byte.
    The source must be the files the plan read: a file missing, or whose size or Parquet footer
    differ from what the plan recorded, raises PackctlError naming it when the dataset is built.
    Decoded source blocks are kept up to `source_cache_bytes` (per process), the most recently used.

    Args:
        path: the output directory OUT (or its `_manifest.json`), or a plan.
        epoch: with the OUT of `packctl pack --epochs K`, the epoch to read (0 to K-1: one full
            pass, in that epoch's order; docs/training.md); None for an output of one epoch.
        dp_rank: this process's data-parallel rank (None: all packs).
        dp_size: the data-parallel world size; needed with `dp_rank` unless the output is balanced.
        drop_last: with strided ranks, leave out the remainder instead of wrapping around.
        cache_row_groups: decoded row groups kept in memory (per process), the most recently used.
        verify: check each shard against the manifest when it is loaded (sha256, rows, tokens,
            layout); False reads faster, trusting the files (docs/training.md).
        source_cache_bytes: with a plan, the decoded source blocks kept in memory.
    """

    def __init__(self, path: str | Path, dp_rank: int | None = None, dp_size: int | None = None, *,
                 drop_last: bool = False, cache_row_groups: int = 16, epoch: int | None = None, verify: bool = True,
                 source_cache_bytes: int = 1 << 30):
        self.output = open_output(path, epoch, verify=verify)
        self.root, self.manifest = self.output.root, self.output.manifest
        self.manifest_path = self.output.manifest_file
        self.layout: dict[str, Any] = self.output.layout
        self.shard_paths = [self.output.shard_path(k) for k in range(len(self.output.shards))]
        rows = np.array([s.rows for s in self.output.shards], dtype=np.int64)
        self._shard_offsets = np.concatenate([[0], np.cumsum(rows)])
        self.num_packs = int(self._shard_offsets[-1])
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.cache_row_groups = max(1, int(cache_row_groups))
        self._cache: OrderedDict[tuple[int, int], dict[str, Any]] = OrderedDict()

        names = self.output.column_names(0) if self.shard_paths else []
        self.balanced = all(name in names for name in BALANCE_COLUMNS)
        self.is_plan = self.manifest.get("kind") == "plan"
        self._blocks: BlockCache | None = None
        if self.is_plan:  # the token columns come from the source, the rest from the plan
            index, source = plan_source(self.manifest, self.manifest_path)
            self._blocks = BlockCache(index, source, budget=source_cache_bytes)
            names = [n for n in names if n != SEQ_STARTS] + list(TOKEN_COLUMNS)
        self._columns = [c.name for c in COLUMNS if c.name in names]  # what an item carries
        # --limit COL=N: each COL per sequence (a list column) and its sum per pack
        self.limits: dict[str, int] = dict(self.layout.get("limits") or {})
        self._limit_lists = [name for name in self.limits if name in names]
        self._limit_sums = [limit_sum_name(name) for name in self.limits if limit_sum_name(name) in names]
        self._planned_balance: np.ndarray | None = None  # the balance columns the order was planned from
        if self.balanced:
            self.order = self._balanced_order(dp_rank, dp_size)
        else:
            self.order = _strided_order(self.num_packs, dp_rank, dp_size, drop_last)

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, i: int) -> dict[str, Any]:
        n = len(self.order)
        if not -n <= i < n:
            raise IndexError(f"pack {i} out of range for a dataset of {n} packs")
        row = int(self.order[i])
        shard = int(np.searchsorted(self._shard_offsets, row, side="right") - 1)
        group, local = self.output.row_group_index(shard).locate(row - int(self._shard_offsets[shard]))
        columns = self._row_group(shard, group)
        item: dict[str, Any] = {}
        for name in self._columns:
            if COLUMN[name].is_list:
                offsets, values = columns[name]
                item[name] = values[offsets[local]:offsets[local + 1]]
            else:
                item[name] = columns[name][local].item()
        for name in self._limit_lists:
            offsets, values = columns[name]
            item[name] = values[offsets[local]:offsets[local + 1]]
        for name in self._limit_sums:
            item[name] = columns[name][local].item()
        item["index"] = row
        return item

    def __repr__(self) -> str:
        rank = "" if self.dp_rank is None else f", dp_rank={self.dp_rank}, dp_size={self.dp_size}"
        return f"PackedDataset({self.output.location!r}{rank}: {len(self)} of {self.num_packs} packs)"

    def __getstate__(self) -> dict[str, Any]:
        # DataLoader workers receive a copy: send the index, not the decoded row groups (each
        # worker checks the shards it reads itself: packctl.contract.reader.PackedOutput).
        state = dict(self.__dict__)
        state["_cache"] = OrderedDict()
        return state

    def _row_group(self, shard: int, group: int) -> dict[str, Any]:
        """The decoded columns of one row group of a shard (the shard checked once per process
        first), from the cache of the `cache_row_groups` most recently used."""
        key = (shard, group)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        limited = self._limit_lists + self._limit_sums
        if self.is_plan:
            read = [n for n in self._columns if n not in TOKEN_COLUMNS] + [SEQ_STARTS] + limited
        else:
            read = self._columns + limited
        table = self.output.read_row_group(shard, group, read)
        columns: dict[str, Any] = self._plan_tokens(table) if self.is_plan else {}
        for name in self._columns:
            if name in columns:
                continue
            if COLUMN[name].is_list:
                array = table.column(name).combine_chunks()
                columns[name] = (array.offsets.to_numpy(), array.values.to_numpy())
            else:
                columns[name] = table.column(name).to_numpy()
        for name in self._limit_lists:
            array = table.column(name).combine_chunks()
            columns[name] = (array.offsets.to_numpy(), array.values.to_numpy())
        for name in self._limit_sums:
            columns[name] = table.column(name).to_numpy()
        if self._planned_balance is not None:
            self._check_planned_balance(shard, group, columns)
        self._cache[key] = columns
        while len(self._cache) > self.cache_row_groups:
            self._cache.popitem(last=False)
        return columns

    def _plan_tokens(self, table) -> dict[str, Any]:
        """The token columns of a plan's shard, gathered from the source by the build `packctl
        materialize` writes them with (`packctl.source.pieces`)."""
        rows = plan_rows(table, self._blocks, int(self.layout["pad_token_id"]))
        offsets = rows.token_offsets.astype(np.int32)
        offsets.setflags(write=False)
        columns = {}
        for name in TOKEN_COLUMNS:
            values = getattr(rows, name)
            values.setflags(write=False)  # as the arrays of a decoded shard: read-only views
            columns[name] = (offsets, values)
        return columns

    def _check_planned_balance(self, shard: int, group: int, columns: dict[str, Any]) -> None:
        """The order was planned from balance columns read unchecked at construction: the checked
        row group must hold the same, or its packs would go to the wrong rank or step."""
        rows = self.output.row_group_index(shard).rows
        lo = int(self._shard_offsets[shard]) + sum(rows[:group])
        hi = lo + rows[group]
        checked = np.stack([np.asarray(columns[name], dtype=np.int64) for name in BALANCE_COLUMNS])
        if checked.shape != (len(BALANCE_COLUMNS), hi - lo) or not np.array_equal(checked,
                                                                               self._planned_balance[:, lo:hi]):
            raise PackctlError(f"{self.shard_paths[shard]}: its {', '.join(BALANCE_COLUMNS)} differ from those read "
                               "when the dataset was built (the shard changed since): build the dataset again")

    def _balanced_order(self, dp_rank: int | None, dp_size: int | None) -> np.ndarray:
        # Unchecked reads of three small columns (the shards are checked when their packs are read,
        # against these values: _check_planned_balance), so that building the dataset reads no
        # token and hashes no shard.
        tables = [self.output.read_unchecked(k, BALANCE_COLUMNS) for k in range(len(self.shard_paths))]
        cols = {name: np.concatenate([t.column(name).to_numpy() for t in tables]).astype(np.int64)
                for name in BALANCE_COLUMNS}
        if len(cols[STEP]) != self.num_packs:
            raise PackctlError(f"{self.root}: the shards hold {len(cols[STEP])} packs, {self.manifest_path.name} "
                               f"says {self.num_packs}; pack again")
        if self.output.verify:
            self._planned_balance = np.stack([cols[name] for name in BALANCE_COLUMNS]).astype(np.int32)
        ranks_in_output = int(cols[DP_RANK].max()) + 1 if len(cols[DP_RANK]) else 0
        if dp_size is not None and ranks_in_output != dp_size:
            raise PackctlError(f"{self.root}: the packs were balanced over {ranks_in_output} data-parallel ranks, "
                               f"not dp_size={dp_size}: repack for {dp_size} ranks or pass dp_size={ranks_in_output}")
        rows = np.arange(self.num_packs, dtype=np.int64)
        if dp_rank is None:
            return rows[np.lexsort((rows, cols[MICRO_BATCH], cols[DP_RANK], cols[STEP]))]
        if dp_rank < 0 or (dp_size is not None and dp_rank >= dp_size):
            raise PackctlError(f"dp_rank {dp_rank} is not in [0, dp_size={dp_size})")
        mine = rows[cols[DP_RANK] == dp_rank]
        return mine[np.lexsort((mine, cols[MICRO_BATCH][mine], cols[STEP][mine]))]


class RowGroupShuffle(torch.utils.data.Sampler):
    """A shuffled order of a PackedDataset's items that reads at about in-order speed: the row
    groups (128 packs each) are shuffled, then the items of each `window` of consecutive row groups
    in that shuffled order are shuffled together. Every item comes once per epoch; a row group is
    decoded once per epoch as long as the dataset caches `window` of them (`cache_row_groups`, the
    default window). `set_epoch(e)` gives epoch e its own order, as DistributedSampler does.

        row groups 0 1 2 3 4 5, window 2:  shuffled 4 1 | 0 5 | 3 2
        items:     those of 4 and 1 in random order, then those of 0 and 5, then of 3 and 2

    A batch then draws its packs from `window` random row groups rather than from the whole
    output (a uniform shuffle, `shuffle=True`, decodes about one row group per item:
    docs/training.md, "What random access costs").

        loader = DataLoader(ds, batch_size=2, sampler=RowGroupShuffle(ds, seed=0), collate_fn=collate_hf)

    Args:
        dataset: the PackedDataset (its items in its order: a rank's packs, or every pack).
        seed: the seed of epoch 0; epoch e uses seed + e.
        window: row groups shuffled together (None: the dataset's `cache_row_groups`).
        row_group_packs: packs per row group of a packctl shard (128, from its start).
    """

    def __init__(self, dataset: PackedDataset, *, seed: int = 0, window: int | None = None,
                 row_group_packs: int = 128):
        self.dataset, self.seed, self.epoch = dataset, int(seed), 0
        self.window = max(1, int(window if window is not None else dataset.cache_row_groups))
        rows = np.asarray(dataset.order, dtype=np.int64)
        shard = np.searchsorted(dataset._shard_offsets, rows, side="right") - 1
        local = rows - dataset._shard_offsets[shard]
        # one id per (shard, row group): the row groups of a shard before those of the next
        per_shard = -(-np.diff(dataset._shard_offsets) // row_group_packs)
        self._group = (np.concatenate([[0], np.cumsum(per_shard)])[shard] + local // row_group_packs).astype(np.int64)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return len(self._group)

    def __iter__(self):
        rng = np.random.default_rng(self.seed + self.epoch)
        groups = np.unique(self._group)
        place = np.empty(int(groups.max()) + 1 if len(groups) else 0, dtype=np.int64)
        place[groups] = rng.permutation(len(groups)) // self.window  # the window of each row group
        order = np.lexsort((rng.random(len(self._group)), place[self._group]))
        return iter(order.tolist())


def _strided_order(num_packs: int, dp_rank: int | None, dp_size: int | None, drop_last: bool) -> np.ndarray:
    """The indices DistributedSampler(shuffle=False) gives rank `dp_rank` of `dp_size`."""
    rows = np.arange(num_packs, dtype=np.int64)
    if dp_rank is None and dp_size is None:
        return rows
    if dp_rank is None or dp_size is None:
        raise PackctlError("pass both dp_rank and dp_size (this output has no dp_rank column to follow)")
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise PackctlError(f"dp_rank {dp_rank} is not in [0, dp_size={dp_size})")
    if drop_last:
        total = num_packs // dp_size * dp_size
    else:
        total = math.ceil(num_packs / dp_size) * dp_size
        if num_packs:
            rows = np.resize(rows, total)  # np.resize repeats the array from its start
    return rows[:total][dp_rank::dp_size]


# ---- collate functions -------------------------------------------------------------------------


def _concat_offsets(cus: Iterable[np.ndarray]) -> np.ndarray:
    """Cumulative offsets of several packs laid end to end: [0, 4, 8] + [0, 8] -> [0, 4, 8, 16]."""
    parts, base = [np.zeros(1, np.int64)], 0
    for cu in cus:
        cu = np.asarray(cu, dtype=np.int64)
        parts.append(cu[1:] + base)
        base += int(cu[-1])
    return np.concatenate(parts)


def _flat(packs: Sequence[Mapping[str, Any]], name: str) -> np.ndarray:
    return np.concatenate([np.asarray(p[name]) for p in packs]).astype(np.int64)


def _row(values: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64)).unsqueeze(0)


def _padded_offsets(packs: Sequence[Mapping[str, Any]], *, trees: bool = False) -> np.ndarray:
    """The packs' segment offsets end to end, after checking each spans its tokens; unless
    `trees`, a shared-prefix pack (a segment that continues another) is refused: the segments of
    cu_seqlens cannot say that a branch sees its prefix."""
    if not packs:
        raise ValueError("cannot collate an empty list of packs")
    for p in packs:
        cu, n = np.asarray(p[CU_SEQLENS_PADDED]), len(p[INPUT_IDS])
        if len(cu) < 2 or cu[0] != 0 or cu[-1] != n:
            raise ValueError(f"a pack's cu_seqlens_padded {cu[:3].tolist()}..{cu[-1:].tolist()} does not span its "
                             f"{n} tokens; collate packs read from a packctl output (PackedDataset)")
        if not trees and PARENT_SEGMENTS in p and (np.asarray(p[PARENT_SEGMENTS]) >= 0).any():
            raise PackctlError("a shared-prefix pack (packed with --share-prefix): its branches attend their prefix, "
                               "which cu_seqlens cannot express; collate it with collate_tree "
                               "(docs/training.md, Shared-prefix packs)")
    return _concat_offsets(p[CU_SEQLENS_PADDED] for p in packs)


def _tail_split_offsets(packs: Sequence[Mapping[str, Any]]) -> np.ndarray:
    """Segment offsets of packs laid end to end, with each pack's padding after its last true token
    (its alignment padding and the tail up to the pack length) cut off the last sequence into
    segments of padding no longer than the longest sequence: `max_seqlen` is then the longest
    sequence, not the last one plus the tail. Pack [0, 4, 16] with a last sequence of 5 true tokens
    -> segments 4, 5, then the 7 pad tokens as 5 + 2."""
    parts, base = [np.zeros(1, np.int64)], 0
    cuts = []
    for p in packs:
        cu = np.asarray(p[CU_SEQLENS_PADDED], dtype=np.int64)
        lens = np.asarray(p[SEQ_LENS], dtype=np.int64)
        end = int(cu[-2] + lens[-1])  # the last true token of the pack, + 1
        cuts.append((cu[:-1], end, int(cu[-1])))
    longest = max(max(int(np.diff(np.append(c, e)).max()), 1) for c, e, _ in cuts)
    for starts, end, total in cuts:
        pads = np.arange(end, total, longest)
        bounds = np.concatenate([starts[1:], [end], pads[1:] if len(pads) else pads, [total]])
        bounds = np.unique(bounds[bounds > 0])
        parts.append(bounds + base)
        base += total
    return np.concatenate(parts)


def collate_flash_attn(packs: Sequence[Mapping[str, Any]], *, split_tail: bool = False) -> dict[str, Any]:
    """Packs -> the inputs of a model built on `flash_attn_varlen_func`.

    Returns `input_ids`, `labels`, `position_ids` (int64, [1, T]), `cu_seqlens` (int32, [S+1], the
    segment offsets `cu_seqlens_padded` of all packs laid end to end) and `max_seqlen` (Python
    int, the longest padded segment). The attention call is

        flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, causal=True)

    with q, k, v of shape [T, heads, head_dim] (`varlen_attention` does it, with an SDPA fallback).
    `labels` are not shifted: logits[i] predicts labels[i + 1] (see the module docstring).

    With an output that has the loss columns, the batch also carries what `loss_fn` needs
    (`_loss_fields`): `num_loss_tokens`, `seq_loss_tokens`, `seq_index`, and `step`,
    `step_loss_tokens`, `step_loss_sequences`, `seq_weights` when the output has them.

    The last segment of a pack holds the pack's tail padding (with `--pad-to capacity`, up to the
    capacity), so `max_seqlen` can be far above the longest sequence (1,334 where
    `DataCollatorWithFlattening` says 22 on short chat turns). `split_tail=True` cuts the padding
    after each pack's last true token into segments of its own, no longer than the longest
    sequence: the true tokens attend exactly as before (the padding came after them), and
    `max_seqlen` is the longest sequence. Not for CP (`cp_slice` needs the aligned boundaries).

    With an output packed with `--limit COL=N` the batch also carries `COL` (int64 [S]: one value
    per sequence, the packs' sequences end to end, aligned with the segments of `cu_seqlens_padded`,
    and so with `cu_seqlens` unless `split_tail` adds segments of padding) and `COL_sum` (int64
    [B]: one per pack, in batch order): `_limit_fields`.
    """
    cu = _padded_offsets(packs)  # checks every pack spans its tokens
    loss_fields = _loss_fields(packs, cu)
    if split_tail:
        cu = _tail_split_offsets(packs)
    return {
        INPUT_IDS: _row(_flat(packs, INPUT_IDS)),
        LABELS: _row(_flat(packs, LABELS)),
        POSITION_IDS: _row(_flat(packs, POSITION_IDS)),
        CU_SEQLENS: torch.from_numpy(cu.astype(np.int32)),
        "max_seqlen": int(np.diff(cu).max()),
        **loss_fields,
        **_limit_fields(packs),
    }


def collate_hf(packs: Sequence[Mapping[str, Any]], *, split_tail: bool = False,
               loss_counts: bool = False) -> dict[str, Any]:
    """Packs -> the batch `transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)`
    makes: `input_ids`, `labels`, `position_ids` (int64, [1, T]), `cu_seq_lens_q` and
    `cu_seq_lens_k` (the same int32 tensor, [S+1]) and `max_length_q`, `max_length_k` (Python ints).

    Pass it whole to a Hugging Face causal LM: `model(**batch, use_cache=False).loss`. With
    `attn_implementation="flash_attention_2"` the model calls flash-attn's varlen kernel with the
    cu_seq_lens; with "sdpa", "eager" or "flex_attention", transformers >= 4.53 finds the sequence
    boundaries from `position_ids` (a position that does not follow its predecessor starts a
    sequence) and builds the block-causal mask from them, but only when it creates no KV cache:
    with `use_cache` on, the whole row is one causal sequence (docs/training.md).

    The differences from that collator: each segment carries its alignment padding (the
    boundaries are `cu_seqlens_padded`), and the first label of each sequence is already -100 in
    the pack (the collator's `separator_id`). `split_tail=True`: see `collate_flash_attn`.

    `loss_counts=True` adds what `loss_fn` needs (see `collate_flash_attn`); take those keys out
    before `model(**batch)` (`split_loss_fields`). By default the batch holds the collator's keys
    only, and, with an output packed with `--limit`, `COL` and `COL_sum` of each limited column
    (shapes as in `collate_flash_attn`): they tell the vision side which media each sequence
    holds; take them out before `model(**batch)` with `split_limit_fields`.
    """
    out = collate_flash_attn(packs, split_tail=split_tail)
    loss_fields = split_loss_fields(out)
    cu = out.pop(CU_SEQLENS)
    max_len = out.pop("max_seqlen")
    out.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max_len, max_length_k=max_len)
    if loss_counts:
        out.update(loss_fields)
    return out


def collate_thd(packs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Packs -> a Transformer Engine / Megatron THD micro-batch (Megatron's `get_batch` keys).

    Returns:
        tokens, position_ids: int64 [1, T].
        labels: int64 [1, T], **already shifted** as Megatron's GPT loss expects: labels[i] is the
            target of position i (the pack's label i + 1), -100 where there is none.
        loss_mask: float32 [1, T], 1 where labels[i] is a target.
        cu_seqlens: int32 [S+1], cumulative true lengths (TE's `cu_seqlens_q`).
        cu_seqlens_padded: int32 [S+1], offsets of the sequences in `tokens` (`cu_seqlens_q_padded`).
        max_seqlen: Python int, the longest padded sequence.
        qkv_format: "thd".

        pack   tokens  a0 a1 a2  0 b0 b1 b2 b3      cu_seqlens [0, 3, 7]  cu_seqlens_padded [0, 4, 8]
               labels  a1 a2  .  .  b1 b2 b3  .     loss_mask   1  1  0  0  1  1  1  0

    The shift happens here, before any context-parallel split (`cp_slice`), because after the
    split a rank no longer holds the next token of its last position in a chunk.
    `packed_seq_params(batch)` turns the batch into Megatron's `PackedSeqParams`. The loss fields
    of `collate_flash_attn` come along (`seq_index` [1, T] is cut by `cp_slice` with the tokens),
    and so do the `--limit` columns: `COL` int64 [S] aligned with `cu_seqlens` and
    `cu_seqlens_padded`, `COL_sum` int64 [B] (`cp_slice` leaves both whole: they are per sequence
    and per pack, not per token).
    """
    cu_padded = _padded_offsets(packs)
    labels = _flat(packs, LABELS)
    shifted = np.full_like(labels, IGNORE_INDEX)
    shifted[:-1] = labels[1:]
    # position i's target is the next token, of the same sequence (a sequence's first label is -100)
    return {**_loss_fields(packs, cu_padded),
        "tokens": _row(_flat(packs, INPUT_IDS)),
        LABELS: _row(shifted),
        "loss_mask": torch.from_numpy((shifted != IGNORE_INDEX).astype(np.float32)).unsqueeze(0),
        POSITION_IDS: _row(_flat(packs, POSITION_IDS)),
        CU_SEQLENS: torch.from_numpy(_concat_offsets(p[CU_SEQLENS] for p in packs).astype(np.int32)),
        CU_SEQLENS_PADDED: torch.from_numpy(cu_padded.astype(np.int32)),
        "max_seqlen": int(np.diff(cu_padded).max()),
        "qkv_format": "thd",
        **_limit_fields(packs),
    }


def thd_batch(sequences: Sequence[torch.Tensor], packs, pack_ids: Sequence[int] | None = None, *,
              labels: Sequence[torch.Tensor] | None = None, pad_to: int | None = None, pad_token_id: int = 0,
              shift_labels: bool = False, device: Any = None) -> dict[str, Any]:
    """A micro-batch in THD layout from a batch's own token tensors and its plan (`packctl.plan_packs`,
    or `plan_steps(...).packs`): what `collate_flash_attn` makes of packs read from an output, made
    in the training loop from the rollouts themselves.

    `sequences[i]` holds sequence i's tokens (a 1-D tensor of `lengths[i]` ids, on any device) and
    `labels[i]`, when given, its labels (-100 where no loss is taken, a masked prompt); without
    labels every token is a target. The packs `pack_ids` (default: every pack) are laid end to end
    in one row; each piece is padded to its aligned length and, with `pad_to`, each pack to
    `pad_to` tokens (static shapes; its tail padding belongs to its last sequence, as in
    docs/format.md):

        lengths [3, 2], capacity 8, align 1, one pack [0, 1], pad_to 8, `.` = -100
        input_ids     [[a0 a1 a2 b0 b1  0  0  0]]      position_ids [[0 1 2 0 1 2 3 4]]
        labels        [[ . a1 a2  . b1  .  .  .]]      cu_seqlens   [0, 3, 8]   max_seqlen 5
        seq_lens      [3, 2]    seq_loss_tokens [2, 1]    num_loss_tokens 3    sample_ids [0, 1]

    The first label of every sequence is -100 (no position predicts across a boundary) and so is
    every padding label; `labels` are not shifted (logits[i] predicts labels[i + 1]), unless
    `shift_labels`: then labels[i] is the target of position i (Megatron's GPT loss, `collate_thd`)
    and `loss_mask` (float32, 1 where labels[i] is a target) comes along.

    Returns `input_ids`, `labels`, `position_ids` (int64 [1, T]), `cu_seqlens` (int32 [S+1], the
    padded segments: flash-attn's cu_seqlens, as `collate_flash_attn`), `max_seqlen` (int),
    `seq_lens` (int32 [S], true tokens), `sample_ids` (int64 [S], the index of each piece's
    sequence), `seq_loss_tokens` (int64 [S]), `num_loss_tokens` (int) and `seq_index` (int64 [1, T],
    the segment of each token), on `device` (default: that of the sequences). The tokens are
    gathered with one copy per piece and the rest is built with tensor operations, no Python loop
    over tokens, so it runs on the GPU where the rollouts are.
    """
    pack_ids = _batch_pack_ids(packs, pack_ids)
    _check_batch_of_plan(packs, sequences, labels)
    pieces = _BatchPieces.of(packs, pack_ids, pad_to)
    tokens = pieces.gathered(sequences)
    device = tokens.device if device is None else torch.device(device)
    tokens = tokens.to(device=device, dtype=torch.int64)
    targets = tokens if labels is None else pieces.gathered(labels).to(device=device, dtype=torch.int64)
    out = pieces.thd_row(tokens, targets, pad_token_id, device)
    if shift_labels:
        out.update(_shifted_labels(out[LABELS][0]))
    return out


def _batch_pack_ids(packs, pack_ids: Sequence[int] | None) -> np.ndarray:
    """The packs of `thd_batch`'s micro-batch as int64 (every pack of the plan when None), each
    checked to be a pack of the plan."""
    num_packs = len(packs.offsets) - 1
    pack_ids = np.arange(num_packs) if pack_ids is None else np.asarray(pack_ids, dtype=np.int64).reshape(-1)
    if len(pack_ids) == 0:
        raise PackctlError("thd_batch: pack_ids is empty; pass the packs of the micro-batch")
    if pack_ids.min() < 0 or pack_ids.max() >= num_packs:
        raise PackctlError(f"thd_batch: pack_ids {pack_ids.tolist()[:8]} are not all in [0, {num_packs}), the "
                           f"packs of this plan")
    return pack_ids


def _check_batch_of_plan(packs, sequences: Sequence[torch.Tensor], labels: Sequence[torch.Tensor] | None) -> None:
    """Refuse a batch that is not the one `packs` was planned from: too few sequences, one whose
    length differs from its planned pieces' (a sequence dropped or truncated by the plan is not
    compared), or labels that do not match their sequences one for one."""
    sequence = np.asarray(packs.sequence, dtype=np.int64)
    given = np.array([int(t.shape[0]) for t in sequences], dtype=np.int64)
    if len(given) <= int(sequence.max(initial=-1)):
        raise PackctlError(f"thd_batch: the plan has sequence {int(sequence.max())} and {len(given)} sequences came: "
                           f"pass the batch the plan was made of")
    planned = np.bincount(sequence, weights=packs.length, minlength=len(given)).astype(np.int64)
    whole = np.ones(len(given), dtype=bool)
    whole[np.asarray(packs.truncated, dtype=np.int64)] = False
    whole[np.asarray(packs.dropped, dtype=np.int64)] = False
    wrong = np.flatnonzero(whole & (planned != given))
    if wrong.size:
        i = int(wrong[0])
        raise PackctlError(f"thd_batch: sequences[{i}] has {given[i]} tokens, the plan {planned[i]}: plan the lengths "
                           f"of these very sequences")
    if labels is not None and [int(t.shape[0]) for t in labels] != given.tolist():
        raise PackctlError("thd_batch: labels must hold one tensor per sequence, of its sequence's length")


@dataclass(frozen=True, eq=False)
class _BatchPieces:
    """The pieces of `thd_batch`'s packs in row order, one entry a piece (int64): the sequence it
    comes from, its first token there, its true length and its segment in the row (its aligned
    length, the pack's tail padding added to the pack's last piece). Two packs [3, 2] and [4],
    align 1, pad_to 8: length [3, 2, 4], segment [3, 5, 8], cu [0, 3, 8, 16]."""

    sequence: np.ndarray
    start: np.ndarray
    length: np.ndarray
    segment: np.ndarray

    @classmethod
    def of(cls, packs, pack_ids: np.ndarray, pad_to: int | None) -> _BatchPieces:
        """The pieces of packs `pack_ids` of the plan `packs`, each pack padded to `pad_to`."""
        from packctl.arrays import ranges

        offsets = np.asarray(packs.offsets, dtype=np.int64)
        counts = offsets[pack_ids + 1] - offsets[pack_ids]
        pieces = ranges(offsets[pack_ids], counts)
        segment = np.asarray(packs.padded, dtype=np.int64)[pieces].copy()
        if pad_to is not None:
            loads = np.add.reduceat(segment, np.cumsum(counts) - counts)
            if (loads > pad_to).any():
                raise PackctlError(f"thd_batch: pad_to {pad_to} is less than a pack's {int(loads.max())} tokens; "
                                   f"pass the capacity the packs were planned with")
            segment[np.cumsum(counts) - 1] += pad_to - loads
        return cls(sequence=np.asarray(packs.sequence, dtype=np.int64)[pieces],
                   start=np.asarray(packs.start, dtype=np.int64)[pieces],
                   length=np.asarray(packs.length, dtype=np.int64)[pieces], segment=segment)

    @property
    def cu(self) -> np.ndarray:
        return np.concatenate(([0], np.cumsum(self.segment))).astype(np.int64)

    def gathered(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """The pieces' tokens of `tensors` (one tensor a sequence) end to end: one copy a piece."""
        return torch.cat([tensors[s][a:a + n] for s, a, n in
                          zip(self.sequence.tolist(), self.start.tolist(), self.length.tolist())])

    def thd_row(self, tokens: torch.Tensor, targets: torch.Tensor, pad_token_id: int, device) -> dict[str, Any]:
        """`thd_batch`'s fields from the gathered `tokens` and `targets`, padding put in with tensor
        operations on `device`: each segment's true tokens first, then its padding."""
        cu = self.cu
        total, count = int(cu[-1]), len(self.sequence)
        seq_index = torch.repeat_interleave(torch.arange(count, device=device),
                                            torch.as_tensor(self.segment, device=device))
        cu_t = torch.as_tensor(cu, device=device)
        position = torch.arange(total, device=device) - cu_t[:-1][seq_index]
        real = position < torch.as_tensor(self.length, device=device)[seq_index]
        input_ids = torch.full((total,), pad_token_id, dtype=torch.int64, device=device)
        input_ids[real] = tokens
        label_row = torch.full((total,), IGNORE_INDEX, dtype=torch.int64, device=device)
        label_row[real] = targets
        label_row[cu_t[:-1]] = IGNORE_INDEX  # a sequence's first token is nobody's target
        seq_loss_tokens = torch.zeros(count, dtype=torch.int64, device=device).index_add_(
            0, seq_index, (label_row != IGNORE_INDEX).to(torch.int64))
        return {
            INPUT_IDS: input_ids.unsqueeze(0),
            LABELS: label_row.unsqueeze(0),
            POSITION_IDS: position.unsqueeze(0),
            CU_SEQLENS: cu_t.to(torch.int32),
            "max_seqlen": int(self.segment.max()),
            SEQ_LENS: torch.as_tensor(self.length, dtype=torch.int32, device=device),
            SAMPLE_IDS: torch.as_tensor(self.sequence, device=device),
            SEQ_LOSS_TOKENS: seq_loss_tokens,
            NUM_LOSS_TOKENS: int(seq_loss_tokens.sum()),
            "seq_index": seq_index.unsqueeze(0),
        }


def _shifted_labels(label_row: torch.Tensor) -> dict[str, torch.Tensor]:
    """`labels` shifted for Megatron's GPT loss (labels[i] the target of position i) and their
    `loss_mask`: labels [. a1 a2 . b1] -> [a1 a2 . b1 .], loss_mask [1 1 0 1 0]."""
    shifted = torch.full_like(label_row, IGNORE_INDEX)
    shifted[:-1] = label_row[1:]
    return {LABELS: shifted.unsqueeze(0), "loss_mask": (shifted != IGNORE_INDEX).to(torch.float32).unsqueeze(0)}

def cp_slice(batch: Mapping[str, Any], cp_size: int, cp_rank: int) -> dict[str, Any]:
    """Context-parallel rank `cp_rank`'s share of a `collate_thd` batch.

    Every tensor of shape [1, T, ...] keeps the tokens `packctl.contract.thd.cp_partition_indices` gives the
    rank (chunks r and 2*cp_size-1-r of each padded sequence, Transformer Engine's split) and
    becomes [1, T / cp_size, ...]; `cu_seqlens`, `cu_seqlens_padded` and `max_seqlen` stay global,
    as Transformer Engine's context-parallel attention expects them. Needs an output packed with
    `--cp-size` (every padded sequence a multiple of 2*cp_size); cp_size 1 returns the batch.

        cu_seqlens_padded [0, 8, 16], cp_size 2:  rank 0 keeps tokens 0 1 6 7 8 9 14 15
    """
    if cp_size == 1 and cp_rank == 0:
        return dict(batch)  # nothing to split (and no 2*cp alignment to ask for)
    cu_padded = batch[CU_SEQLENS_PADDED]
    try:
        index = cp_partition_indices(np.asarray(cu_padded.cpu() if torch.is_tensor(cu_padded) else cu_padded),
                                     cp_size, cp_rank)
    except ValueError as exc:
        raise PackctlError(str(exc)) from None
    out = dict(batch)
    total = int(cu_padded[-1])
    for name, value in batch.items():
        if torch.is_tensor(value) and value.dim() >= 2 and tuple(value.shape[:2]) == (1, total):
            out[name] = value[:, torch.from_numpy(index).to(value.device)]
    return out


def packed_seq_params(batch: Mapping[str, Any], *, padded_boundaries: bool = False):
    """Megatron's `PackedSeqParams` for a `collate_thd` batch (needs megatron-core).

        model(input_ids=batch["tokens"], position_ids=batch["position_ids"], attention_mask=None,
              labels=batch["labels"], packed_seq_params=packed_seq_params(batch))

    Transformer Engine tells "padding between sequences" by identity (`cu_seqlens_q_padded is
    cu_seqlens_q`) and, with padding, turns FlashAttention and unfused attention off. So when the
    padded boundaries equal the true ones (no alignment padding) the same tensor is passed for
    both and `pad_between_seqs=False` is set where the field exists; otherwise they differ and
    `pad_between_seqs=True`. `padded_boundaries=True` follows Megatron's own packed-SFT
    convention, `cu_seqlens_q = cu_seqlens_padded`: every sequence with its alignment padding, which
    causal attention of the true tokens never sees (the padding comes after them), and no padding
    between sequences for TE to handle.
    """
    try:
        from megatron.core.packed_seq_params import PackedSeqParams
    except ImportError:
        raise PackctlError("packed_seq_params needs megatron-core, which is not installed: "
                           "pip install megatron-core") from None
    cu, cu_padded, max_len = batch[CU_SEQLENS], batch[CU_SEQLENS_PADDED], batch["max_seqlen"]
    if padded_boundaries:
        cu = cu_padded
        max_len = int((cu_padded[1:] - cu_padded[:-1]).max()) if len(cu_padded) > 1 else 0
    same = cu is cu_padded or (cu.shape == cu_padded.shape and bool(torch.equal(cu, cu_padded)))
    if same:
        cu_padded = cu
    values = dict(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_padded,
                  cu_seqlens_kv_padded=cu_padded, max_seqlen_q=max_len, max_seqlen_kv=max_len)
    if "pad_between_seqs" in _field_names(PackedSeqParams):
        values["pad_between_seqs"] = not same
    return PackedSeqParams(**values)


def _field_names(cls) -> set[str]:
    import dataclasses
    import inspect

    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    return set(inspect.signature(cls).parameters)


# ---- loss normalization --------------------------------------------------------------------------

BATCH_LOSS_KEYS = (NUM_LOSS_TOKENS, SEQ_LOSS_TOKENS, "seq_index", STEP, MICRO_BATCH, *STEP_LOSS_COLUMNS, SEQ_WEIGHTS,
                   GROUP_IDS)


def _loss_fields(packs: Sequence[Mapping[str, Any]], seq_offsets: np.ndarray) -> dict[str, Any]:
    """What `loss_fn` needs of a batch, from the packs' loss columns (none for outputs written
    before them). `seq_offsets`: the sequences' offsets in the row (packs' cu_seqlens_padded laid
    end to end).

        seq_loss_tokens  int64 [S]     loss tokens of each sequence of the batch
        seq_index        int64 [1, T]  the sequence each token belongs to (padding: the one it follows)
        num_loss_tokens  int           sum(seq_loss_tokens)
        step, step_loss_tokens, step_loss_sequences   int, the packs' step and its counts (--dp-size)
        micro_batch      int           the last micro-batch of the packs (--dp-size)
        seq_weights      float64 [S]   --weight-column
        group_ids        int64 [S]     --group-column: sequences sharing an id form one group (a
                                       DPO pair, a prompt's rollouts), adjacent, in input order
    """
    if not all(SEQ_LOSS_TOKENS in p for p in packs):
        return {}
    counts = _flat(packs, SEQ_LOSS_TOKENS)
    out: dict[str, Any] = {
        NUM_LOSS_TOKENS: int(counts.sum()),
        SEQ_LOSS_TOKENS: torch.from_numpy(counts),
        "seq_index": _row(np.repeat(np.arange(len(counts)), np.diff(seq_offsets))),
        **_step_fields(packs),
    }
    for name in (SEQ_WEIGHTS, GROUP_IDS):
        if all(name in p for p in packs):
            dtype = np.dtype(COLUMN[name].value)
            out[name] = torch.from_numpy(np.concatenate([np.asarray(p[name], dtype=dtype) for p in packs]))
    return out


def _step_fields(packs: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """`step`, `step_loss_tokens`, `step_loss_sequences` of the packs (one step a batch) and their
    last `micro_batch`, those the output has (--dp-size)."""
    out: dict[str, int] = {}
    for name in (STEP, *STEP_LOSS_COLUMNS):
        if all(name in p for p in packs):
            values = sorted({int(p[name]) for p in packs})
            if len(values) > 1 and name == STEP:
                raise ValueError(f"one batch holds packs of steps {values}: no single step count normalizes its "
                                 "loss; use a batch size that divides the packs a rank gets per step "
                                 "(--micro-batches), e.g. batch_size=1")
            out[name] = values[0]
    if all(MICRO_BATCH in p for p in packs):  # the batch's last: a step ends after micro-batch M - 1
        out[MICRO_BATCH] = max(int(p[MICRO_BATCH]) for p in packs)
    return out


def limit_columns(pack: Mapping[str, Any]) -> list[str]:
    """The `--limit` columns a pack carries: every COL that comes with its `COL_sum` (no declared
    column of the format has such a pair, so the pair identifies a limited column)."""
    return [name for name in pack if isinstance(name, str) and limit_sum_name(name) in pack]


def _limit_fields(packs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The `--limit` columns of a batch (none for an output without limits):

        COL      int64 [S]  each sequence's value, the packs' sequences end to end (the order of
                            seq_lens, sample_ids and the segments of cu_seqlens_padded)
        COL_sum  int64 [B]  each pack's sum, in batch order

        packs {images [2, 0], images_sum 2} {images [1], images_sum 1}
        -> images tensor([2, 0, 1]), images_sum tensor([2, 1])
    """
    names = [n for n in limit_columns(packs[0]) if all(n in p and limit_sum_name(n) in p for p in packs)]
    out: dict[str, Any] = {}
    for name in names:
        out[name] = torch.from_numpy(_flat(packs, name))
        out[limit_sum_name(name)] = torch.tensor([int(p[limit_sum_name(name)]) for p in packs], dtype=torch.int64)
    return out


def split_limit_fields(batch: dict[str, Any]) -> dict[str, Any]:
    """Remove the `--limit` fields (`COL`, `COL_sum`) from `batch` (in place) and return them, so
    the batch can go whole into a text model's forward and the fields to the vision side.

        media = split_limit_fields(batch)      # {"images": tensor([...]), "images_sum": tensor([...])}
        logits = model(**batch, use_cache=False).logits
    """
    return {key: batch.pop(key) for name in limit_columns(batch) for key in (name, limit_sum_name(name))}


def split_loss_fields(batch: dict[str, Any]) -> dict[str, Any]:
    """Remove the loss fields from `batch` (in place) and return them: the batch can then go whole
    into a model's forward, the fields into `loss_fn`.

        fields = split_loss_fields(batch)
        logits = model(**batch, use_cache=False).logits
        loss = loss_fn(logits, {**batch, **fields})
    """
    return {name: batch.pop(name) for name in BATCH_LOSS_KEYS if name in batch}


def loss_fn(logits: torch.Tensor, batch: Mapping[str, Any], mode: str = "token", *,
            denominator: float | None = None, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """The causal-LM loss of one micro-batch, normalized so that summing it over the micro-batches
    and data-parallel ranks of an optimizer step gives the loss of the whole step, however the
    sequences were packed (docs/training.md, "Loss normalization").

    mode "token": every loss token weighs the same (pre-training, SFT):
        sum of the per-token cross-entropy / the loss tokens of the step
    mode "sequence": every sequence weighs the same (per-sample averaging of some SFT and RL losses):
        sum over sequences of (their mean token loss) / the sequences of the step

    The step's count is the batch's `step_loss_tokens` / `step_loss_sequences` (outputs packed with
    `--dp-size`), else `denominator` (e.g. Hugging Face's `num_items_in_batch`, the loss tokens of the
    step summed over ranks, in token mode; the number of sequences with a loss token, in sequence
    mode), else the batch's own count (one micro-batch, one rank: a plain mean). `denominator`, when
    given, wins. With `seq_weights` (--weight-column), each sequence's term is multiplied by its
    weight, in both modes (the count stays unweighted, so weights of 1 change nothing). A
    sequence without a loss token adds nothing.

        two sequences, losses a: [1, 3] and b: [2], step of this batch alone
        token:    (1 + 3 + 2) / 3 = 2.0        sequence: ((1 + 3) / 2 + 2 / 1) / 2 = 2.0

    Args:
        logits: [1, T, V] or [T, V], the model's output over the batch's row.
        batch: from `collate_flash_attn`, `collate_hf(loss_counts=True)` or `collate_thd` (whose
            labels are already shifted: it has a `loss_mask`), or its `cp_slice`.
        mode: "token" or "sequence".
        denominator: the step's loss tokens (token mode) or sequences (sequence mode), overriding
            the batch's.

    The result is a scalar tensor in float32 (the logits are upcast). Backward through it on every
    micro-batch and sum the gradients over ranks; with DDP or FSDP, which average gradients over
    ranks, multiply it by the data-parallel size.
    """
    if mode not in ("token", "sequence"):
        raise ValueError(f"mode {mode!r}: use 'token' or 'sequence'")
    if SEQ_LOSS_TOKENS not in batch:
        raise PackctlError("the batch has no loss counts: the output predates the loss columns (repack it), or "
                           "it comes from collate_hf without loss_counts=True")
    logits = logits.reshape(-1, logits.shape[-1])
    labels = batch[LABELS].reshape(-1).to(logits.device)
    seq_index = batch["seq_index"].reshape(-1).to(logits.device)
    if "loss_mask" not in batch:  # not shifted: logits[i] predicts labels[i + 1]
        logits, labels, seq_index = logits[:-1], labels[1:], seq_index[1:]
    target = labels != ignore_index
    losses = torch.nn.functional.cross_entropy(logits[target].float(), labels[target], reduction="none")
    seq_of = seq_index[target]
    seq_counts = batch[SEQ_LOSS_TOKENS].to(logits.device)
    if SEQ_WEIGHTS in batch:
        losses = losses * batch[SEQ_WEIGHTS].to(logits.device, torch.float32)[seq_of]
    if mode == "token":
        count = denominator if denominator is not None else batch.get(STEP_LOSS_TOKENS, batch[NUM_LOSS_TOKENS])
        return losses.sum() / max(count, 1)  # a step without loss tokens: 0, not nan
    per_token = losses / seq_counts.clamp(min=1).to(torch.float32)[seq_of]  # each sequence's mean, spread
    count = denominator if denominator is not None else batch.get(
        STEP_LOSS_SEQUENCES, int((seq_counts > 0).sum()))
    return per_token.sum() / max(count, 1)


# ---- attention -----------------------------------------------------------------------------------


def block_causal_mask(cu_seqlens: torch.Tensor | np.ndarray, total: int | None = None, *,
                      causal: bool = True, device: Any = None) -> torch.Tensor:
    """Boolean [T, T] mask, True where query i may attend to key j: same segment and j <= i.

        cu_seqlens [0, 2, 5]      1 . . . .
                                  1 1 . . .
                                  . . 1 . .
                                  . . 1 1 .
                                  . . 1 1 1

    For SDPA (`attn_mask=`) and Hugging Face models (`attention_mask=mask[None, None]` with
    `attn_implementation="sdpa"`). It holds T*T booleans: fine for tests and CPU runs, use
    flash-attn (`varlen_attention`) for long packs. Tokens past cu_seqlens[-1] form one more segment.
    """
    cu = torch.as_tensor(np.asarray(cu_seqlens.cpu() if torch.is_tensor(cu_seqlens) else cu_seqlens),
                         dtype=torch.int64)
    total = int(cu[-1]) if total is None else int(total)
    index = torch.arange(total)
    segment = torch.searchsorted(cu[1:], index, right=True)
    mask = segment[:, None] == segment[None, :]
    if causal:
        mask &= index[None, :] <= index[:, None]
    return mask.to(device) if device is not None else mask


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     max_seqlen: int, *, causal: bool = True, softmax_scale: float | None = None,
                     backend: str = "auto") -> torch.Tensor:
    """Attention over the segments of a THD row: q [T, Hq, D], k and v [T, Hkv, D] -> [T, Hq, D].

    The kernels of `packctl verify` (packctl/verify/backends.py), so a training loop runs what
    verify checked: "flash-attn" (`flash_attn_varlen_func`, FlashAttention 2 or 4; CUDA,
    fp16/bf16, the `gpu` extra), "torch-varlen" (torch's varlen_attn, CUDA), "flex", "sdpa" (any
    device and dtype; the mask is built in row blocks, so memory stays bounded at any length);
    "auto" picks the fastest varlen kernel installed on CUDA in fp16/bf16, SDPA otherwise.
    Grouped-query attention (Hq a multiple of Hkv) works with all.
    """
    from packctl.verify.backends import DTYPE_NAMES, attention_backend

    device = "cuda" if q.is_cuda else "cpu"
    kernel = attention_backend(backend, device, DTYPE_NAMES.get(str(q.dtype).removeprefix("torch."), "fp32"))
    return kernel(q, k, v, torch.as_tensor(cu_seqlens, device=q.device), int(max_seqlen), causal=causal,
                  softmax_scale=softmax_scale)


# ---- shared-prefix packs (the tree layout) -------------------------------------------------------


def collate_tree(packs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Packs of a `pack --share-prefix` output -> one row [1, T] with what attention over the
    tree and a per-row loss need (packctl/contract/tree.py draws the layout). Flat packs (no
    `parent_segments`) collate too: every segment then starts a row.

    A group of two rows sharing p = 4 tokens (`.` = -100):

        row 5 [1 2 3 4 7 8]  row 6 [1 2 3 4 9]   stored: prefix [1 2 3] | branch 5 [4 7 8] | branch 6 [4 9]

        input_ids     [[1 2 3 4 7 8 4 9]]      position_ids [[0 1 2 3 4 5 3 4]]
        row_positions [0 1 2 3 4 5  0 1 2 6 7]                 row_offsets [0, 6, 11]
        row_targets   [. . . 7 8 .  . . . 9 .]                 row_loss_tokens [2, 1]

    Position 2 (token 3) predicts 4 for both rows; its logits are computed once and used by each.
    Flash-attn's varlen kernel cannot express a tree (a branch sees its prefix, not its sibling):
    pass the model `tree_attention_mask(batch)` (a dense 4-D mask, Hugging Face eager or sdpa)
    or `tree_block_mask(batch)` (FlexAttention), then `tree_loss` or `row_logprobs` on its logits.
    The masks are built after the DataLoader, on the training device: a mask_mod is a closure,
    which does not travel between worker processes.

    Returns:
        input_ids, labels, position_ids: int64 [1, T], the packs end to end.
        parent_segments: int64 [S], indices into the batch's segments (-1: starts a row).
        seq_lens: int64 [S]; cu_seqlens_padded: int32 [S+1], the segments' offsets in the row.
        token_segments: int64 [T], the segment of each token; true_tokens: bool [T], not padding.
        segment_chains, segment_depths: `packctl.contract.tree.chains` and `depths` of the batch.
        row_positions, row_targets, row_index: int64 [N], every rebuilt row's flat positions end
            to end, the target each predicts (the row's next label; -100 at its last), its row.
        row_offsets: int64 [R+1]; row_sample_ids: int64 [R]; row_loss_tokens: int64 [R], targets
            that are not -100; num_loss_tokens: int, their sum (a shared token once per row,
            as the unshared rows count it). A tree pack's `seq_loss_tokens` holds the same
            count on each row's segment (0 on a prefix), so the two agree.
        step, step_loss_tokens, step_loss_sequences, micro_batch: int, as `collate_flash_attn`
            carries them (--dp-size): the step's rows' targets and its rows with a target.
        row_group_ids (int64 [R], --group-column), row_weights (float64 [R], --weight-column).
    """
    cu_padded = _padded_offsets(packs, trees=True)  # checks every pack spans its tokens
    parents = _batch_parents(packs)
    seq_lens, sample_ids = _flat(packs, SEQ_LENS), _flat(packs, SAMPLE_IDS)
    labels = _flat(packs, LABELS)
    rows = tree.row_positions(parents, seq_lens, cu_padded, sample_ids)
    targets, row_index, loss_tokens = _row_targets(rows, labels)
    segments = tree.segment_of(np.diff(cu_padded))
    true_tokens = np.arange(int(cu_padded[-1])) - cu_padded[:-1][segments] < seq_lens[segments]
    return {
        INPUT_IDS: _row(_flat(packs, INPUT_IDS)),
        LABELS: _row(labels),
        POSITION_IDS: _row(_flat(packs, POSITION_IDS)),
        PARENT_SEGMENTS: _tensor(parents),
        SEQ_LENS: _tensor(seq_lens),
        CU_SEQLENS_PADDED: _tensor(cu_padded, torch.int32),
        "token_segments": _tensor(segments),
        "true_tokens": _tensor(true_tokens, torch.bool),
        "segment_chains": _tensor(tree.chains(parents)),
        "segment_depths": _tensor(tree.depths(parents)),
        "row_positions": _tensor(rows.positions),
        "row_targets": _tensor(targets),
        "row_index": _tensor(row_index),
        "row_offsets": _tensor(rows.offsets),
        "row_sample_ids": _tensor(sample_ids[rows.segments]),
        "row_loss_tokens": _tensor(loss_tokens),
        NUM_LOSS_TOKENS: int(loss_tokens.sum()),
        **_step_fields(packs),
        **_row_values(packs, rows.segments),
    }


def _tensor(values, dtype=torch.int64) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(values)).to(dtype)


def _batch_parents(packs: Sequence[Mapping[str, Any]]) -> np.ndarray:
    """Each segment's parent as an index into the batch's segments (-1: it starts a row), every
    pack's `parent_segments` checked and moved by the segments of the packs before it (a flat
    pack's are all -1). Packs of 2 and 3 segments, parents [-1, 0] and [-1, 0, 0] -> [-1, 0, -1, 2, 2]."""
    parents, base = [], 0
    for i, p in enumerate(packs):
        local = np.asarray(p[PARENT_SEGMENTS] if PARENT_SEGMENTS in p else np.full(len(p[SEQ_LENS]), -1), np.int64)
        if len(local) != len(p[SEQ_LENS]):
            raise ValueError(f"pack {i} of the batch has {len(local)} parent_segments for {len(p[SEQ_LENS])} segments")
        try:
            tree.check_parents(local)
        except ValueError as exc:
            raise ValueError(f"pack {i} of the batch: {exc}") from None
        parents.append(np.where(local >= 0, local + base, -1))
        base += len(local)
    return np.concatenate(parents)


def _row_targets(rows: tree.RowPositions, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per position of the rebuilt rows: the target it predicts (the label of the row's next
    position; -100 at a row's last) and its row; and per row, its targets that are not -100.
    Rows [1 2 3 4 7 8] and [1 2 3 4 9], their labels [. . . . 7 8] and [. . . . 9] -> targets
    [. . . 7 8 .  . . . 9 .], row_index [0 0 0 0 0 0  1 1 1 1 1], row_loss_tokens [2, 1]."""
    targets = np.full(len(rows.positions), IGNORE_INDEX, dtype=np.int64)
    targets[:-1] = labels[rows.positions[1:]]
    targets[rows.offsets[1:] - 1] = IGNORE_INDEX  # a row's last position predicts nothing
    row_index = np.repeat(np.arange(len(rows.segments)), np.diff(rows.offsets))
    loss_tokens = np.bincount(row_index[targets != IGNORE_INDEX], minlength=len(rows.segments)).astype(np.int64)
    return targets, row_index, loss_tokens


def _row_values(packs: Sequence[Mapping[str, Any]], row_segments: np.ndarray) -> dict[str, torch.Tensor]:
    """`row_group_ids` (--group-column) and `row_weights` (--weight-column) of the rebuilt rows,
    those the packs carry: each row takes the value of the segment that ends it."""
    out = {}
    for name, key in ((GROUP_IDS, "row_group_ids"), (SEQ_WEIGHTS, "row_weights")):
        if all(name in p for p in packs):
            values = np.concatenate([np.asarray(p[name], dtype=COLUMN[name].value) for p in packs])
            out[key] = torch.from_numpy(values[row_segments])
    return out

def _tree_sees(batch: Mapping[str, Any], q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Whether query q may attend to key k (flat indices, any broadcastable shapes): k lies on q's
    segment chain, k <= q, and k is a true token unless it is in q's own segment."""
    segment = batch["token_segments"]
    sq, sk = segment[q], segment[k]
    on_chain = batch["segment_chains"][sq, batch["segment_depths"][sk]] == sk
    return on_chain & (k <= q) & ((sq == sk) | batch["true_tokens"][k])


def _tree_tensors(batch: Mapping[str, Any], device: Any) -> dict[str, torch.Tensor]:
    names = ("token_segments", "segment_chains", "segment_depths", "true_tokens")
    return {name: batch[name].to(device) if device is not None else batch[name] for name in names}


def tree_attention_mask(batch: Mapping[str, Any], *, dtype: torch.dtype = torch.bool,
                        device: Any = None) -> torch.Tensor:
    """The dense 4-D mask [1, 1, T, T] of a `collate_tree` batch: query i may attend to key j.

    `dtype=torch.bool` (True: attend) suits Hugging Face "sdpa"; a float dtype gives the additive
    mask "eager" needs (0 where seen, the dtype's lowest value elsewhere). transformers passes a
    4-D mask to attention as it is, and the rotary embeddings follow `position_ids`:

        mask = tree_attention_mask(batch, dtype=model.dtype)       # eager, fp32 or bf16
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                       attention_mask=mask, use_cache=False).logits

    It holds T*T values: for T up to a few thousand; beyond, `tree_block_mask` with FlexAttention.
    """
    parts = _tree_tensors(batch, device)
    segment, chains, depths = parts["token_segments"], parts["segment_chains"], parts["segment_depths"]
    count = len(depths)
    # [s, t]: t is s or one of its ancestors; then gathered per token, rows before columns (bool all along)
    on_chain = chains[:, depths] == torch.arange(count, device=segment.device)[None, :]
    index = torch.arange(len(segment), device=segment.device)
    seen = on_chain[segment][:, segment] & (index[None, :] <= index[:, None])
    seen &= (segment[:, None] == segment[None, :]) | parts["true_tokens"][None, :]
    seen = seen[None, None]
    if dtype == torch.bool:
        return seen
    zero = torch.zeros((), dtype=dtype, device=seen.device)
    return torch.where(seen, zero, torch.finfo(dtype).min)


def tree_mask_mod(batch: Mapping[str, Any], *, device: Any = None):
    """FlexAttention's `mask_mod(b, h, q_idx, kv_idx)` for a `collate_tree` batch (one row: b and
    h are ignored). It reads four small tensors of the batch, moved to `device` first."""
    parts = _tree_tensors(batch, device)

    def mask_mod(b, h, q_idx, kv_idx):
        return _tree_sees(parts, q_idx, kv_idx)

    return mask_mod


def tree_block_mask(batch: Mapping[str, Any], *, device: Any = None, block_size: int = 128):
    """FlexAttention's BlockMask of a `collate_tree` batch (torch >= 2.5):

        block_mask = tree_block_mask(batch, device="cuda")
        out = flex_attention(q, k, v, block_mask=block_mask)        # q, k, v [1, H, T, D]

    Hugging Face models with `attn_implementation="flex_attention"` take it as `attention_mask`.
    """
    try:
        from torch.nn.attention.flex_attention import create_block_mask
    except ImportError:
        raise PackctlError(f"FlexAttention needs torch >= 2.5 (this is {torch.__version__}): pip install -U torch, "
                           "or use tree_attention_mask") from None
    total = len(batch["token_segments"])
    device = device if device is not None else batch["token_segments"].device
    return create_block_mask(tree_mask_mod(batch, device=device), None, None, total, total, device=device,
                             BLOCK_SIZE=block_size)


def _row_token_losses(logits: torch.Tensor, batch: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """The cross entropy of every target of every rebuilt row (float32) and the row it belongs to."""
    logits = logits.reshape(-1, logits.shape[-1])
    targets = batch["row_targets"].to(logits.device)
    valid = targets != IGNORE_INDEX
    at = batch["row_positions"].to(logits.device)[valid]
    losses = torch.nn.functional.cross_entropy(logits[at].float(), targets[valid], reduction="none")
    return losses, batch["row_index"].to(logits.device)[valid]


def row_logprobs(logits: torch.Tensor, batch: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per rebuilt row of a `collate_tree` batch: (sum of log p of its target tokens, float32 [R];
    their count, int64 [R]), in the order of `row_sample_ids`. What DPO and GRPO losses take:

        logps, counts = row_logprobs(logits, batch)        # a DPO pair: rows c and r of one group
        margin = (logps[c] - ref_logps[c]) - (logps[r] - ref_logps[r])
    """
    losses, rows = _row_token_losses(logits, batch)
    count = len(batch["row_loss_tokens"])
    sums = torch.zeros(count, dtype=torch.float32, device=losses.device).index_add(0, rows, -losses)
    return sums, batch["row_loss_tokens"].to(losses.device)


def tree_loss(logits: torch.Tensor, batch: Mapping[str, Any], mode: str = "token", *,
              denominator: float | None = None) -> torch.Tensor:
    """The causal-LM loss of a `collate_tree` batch, equal to `loss_fn` over the same rows unshared:

        token:  the sum of every row's target losses / the step's loss tokens
        row:    the sum of each row's mean target loss / the step's rows with a target

    Each row's targets are gathered from the logits at its own positions (`row_positions`), not
    by the flat shift, which would have a branch's last token predict its sibling's first. A
    token of a shared prefix counts once per row, as it does unshared. The step's count is the
    batch's `step_loss_tokens` / `step_loss_sequences` (--dp-size; a tree's counts are its rows',
    so they equal those of the rows packed flat), else `denominator`, else the batch's own
    (`num_loss_tokens`, the rows with a target); `denominator`, when given, wins. With
    `row_weights` (--weight-column) each row's terms are multiplied by its weight. Summed over
    the micro-batches and ranks of a step it is the step's loss, as `loss_fn`'s:

        rows a: losses [1, 3], b: [2] in one micro-batch, c: [4] in the other; step_loss_tokens 4
        token: (1 + 3 + 2) / 4 + 4 / 4 = 2.5
    """
    if mode not in ("token", "row"):
        raise ValueError(f"mode {mode!r}: use 'token' or 'row'")
    losses, rows = _row_token_losses(logits, batch)
    if "row_weights" in batch:
        losses = losses * batch["row_weights"].to(losses.device, torch.float32)[rows]
    counts = batch["row_loss_tokens"].to(losses.device)
    if mode == "token":
        count = denominator if denominator is not None else batch.get(STEP_LOSS_TOKENS, batch[NUM_LOSS_TOKENS])
        return losses.sum() / max(count, 1)
    per_token = losses / counts.clamp(min=1).to(torch.float32)[rows]
    count = denominator if denominator is not None else batch.get(STEP_LOSS_SEQUENCES, int((counts > 0).sum()))
    return per_token.sum() / max(count, 1)


# ---- learning-rate scale -------------------------------------------------------------------------


def read_lr_scales(path: str | Path, *, epoch: int | None = None, verify: bool = True) -> dict[int, float] | None:
    """The learning-rate scale of each step, when the output records one; None otherwise.

    Outputs packed with `--lr-scaling linear|sqrt` carry an `lr_scale` column with their `step`
    column (one value per step); a manifest's `lr_scale` (a list indexed by step, or a {step:
    scale} mapping) is read first. The shards are read as `PackedDataset` reads them: checked
    against the manifest unless `verify=False`.

        scales = read_lr_scales("packed")            # {0: 1.0, 1: 0.96, ...} or None
        base_lrs = [g["lr"] for g in optimizer.param_groups]
        apply_lr_scale(optimizer, scales.get(step, 1.0) if scales else 1.0, base_lrs)
    """
    output = open_output(path, epoch, verify=verify)
    recorded = output.manifest.get(LR_SCALE)  # the manifest's record, when it has one
    if isinstance(recorded, list):
        return {step: float(s) for step, s in enumerate(recorded)}
    if isinstance(recorded, dict):
        return {int(step): float(s) for step, s in recorded.items()}
    scales: dict[int, float] = {}
    for k in range(len(output.shards)):
        shard_path = output.shard_path(k)
        names = output.column_names(k)
        if LR_SCALE not in names:
            return None
        if STEP not in names:
            raise PackctlError(f"{shard_path}: an {LR_SCALE} column without a {STEP} column; repack the output")
        table = output.read_shard(k, [STEP, LR_SCALE])
        for step, scale in zip(table.column(STEP).to_numpy().tolist(), table.column(LR_SCALE).to_numpy().tolist()):
            if scales.setdefault(step, scale) != scale:
                raise PackctlError(f"{shard_path}: step {step} has two lr_scale values "
                                   f"({scales[step]} and {scale}); repack the output")
    return scales or None


def apply_lr_scale(optimizer: torch.optim.Optimizer, scale: float, base_lrs: Sequence[float]) -> None:
    """Set each param group's lr to `base_lrs[g] * scale` (the base lrs read once, before training;
    with a scheduler, pass the lrs it set for this step)."""
    groups = optimizer.param_groups
    if len(base_lrs) != len(groups):
        raise ValueError(f"{len(base_lrs)} base lrs for {len(groups)} param groups")
    for group, base in zip(groups, base_lrs):
        group["lr"] = base * scale
