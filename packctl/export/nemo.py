"""NeMo / Megatron-Bridge offline packed SFT (`GPTSFTPackedParquetDataset`, `GPTSFTPackedDataset`).

Their convention, from Megatron-Bridge's data/datasets (packing_utils.fill_packing_strategy, the
packed datasets' collate_fn, packed_sequence.tokenize_dataset):

- a row is one pack: `input_ids` (list<int32>) the sub-sequences end to end, `seq_start_id`
  (list<int32>) their start offsets, without a final offset, `loss_mask` (list<int8>);
- a sub-sequence is stored with one token more than the positions it trains: at run time its
  tokens are `input_ids[b:e-1]`, its labels `input_ids[b+1:e]` and its loss mask
  `loss_mask[b:e-1]`, so `loss_mask` is stored pre-shifted (loss_mask[j] says whether the token
  j + 1 is a target);
- with context parallelism (`pad_seq_to_mult` m > 1) each sub-sequence's run-time length is padded
  to a multiple of m with the tokenizer's EOS id (loss 0), so a sub-sequence of n tokens is stored
  as ceil((n - 1) / m) * m + 1 tokens; the reader takes trailing unsupervised EOS tokens as padding;
- the metadata file is a JSON list with one dict per packed dataset: `dataset_max_seqlen`,
  `max_samples_per_bin`, `packing_factor`, `packing_efficiency`, `pack_size`, `min_packed_seqlen`.

A packctl pack holds each sequence's n true tokens (labels unshifted, -100 on the first token and
where the source masks it) plus its alignment padding; the export writes the n tokens, pads to the
NeMo length with the EOS id, and sets loss_mask[j] = (labels[j + 1] != -100). m is the output's
alignment (layout.align: 2*cp, cp*tp with sequence parallelism, --seq-multiple); capacity budgets are unchanged (ceil((n-1)/m)*m <= the
padded length packctl planned with).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from packctl.arrays import copy_segments, offsets_of, ranges
from packctl.contract.reader import PackedOutput
from packctl.errors import PackctlError
from packctl.contract.schema import IGNORE_INDEX

METADATA_FILE = "packing_metadata.json"


def _rows(shard, align: int, eos: int | None, out: Path, first_pack: int):
    """One shard's packs in NeMo's layout: (row offsets, input_ids, loss_mask, seq_start offsets,
    seq_start_id, run-time lengths). `out` and `first_pack` (the output's number of the shard's
    first pack) name a pack that cannot be exported: `out/data/train-00001.parquet row 3 (pack 43
    of the output)`."""
    n = shard.seq_lens
    runtime = -(-(n - 1) // align) * align  # positions each sub-sequence trains, NeMo's padding
    stored = runtime + 1
    if eos is None and (stored != n).any():
        raise PackctlError(f"{out / shard.name}: the output is aligned to {align} (--cp-size/--tp-size/"
                           "--seq-multiple), and NeMo pads sub-sequences with the tokenizer's EOS id: pass "
                           "--eos-token-id")
    src = shard.flat_starts()
    per_pack = np.diff(shard.seq_offsets)
    pack_of = np.repeat(np.arange(shard.num_packs), per_pack)
    row_lens = np.bincount(pack_of, weights=stored, minlength=shard.num_packs).astype(np.int64)
    row_offsets = offsets_of(row_lens)
    dst = offsets_of(stored)[:-1]  # each sub-sequence's offset in the flat output
    tokens = np.full(int(row_offsets[-1]), eos if eos is not None else 0, dtype=np.int32)
    copy_segments(shard.input_ids, src, tokens, dst, n)
    # targets: token j + 1 of each sub-sequence, for j in 0 .. n-2
    targets = ranges(src + 1, n - 1)
    supervised = shard.labels[targets] != IGNORE_INDEX
    differ = supervised & (shard.labels[targets] != shard.input_ids[targets])
    if differ.any():
        at = int(targets[np.argmax(differ)])  # the first differing token, in the shard's flat input_ids
        pack = int(np.searchsorted(shard.token_offsets, at, side="right")) - 1
        raise PackctlError(f"{out / shard.name} row {pack} (pack {first_pack + pack} of the output): a label "
                           f"differs from its token (label {int(shard.labels[at])}, token {int(shard.input_ids[at])}), "
                           "and NeMo's format derives labels from input_ids (labels = the next token); such outputs "
                           "cannot be exported to nemo: read them with packctl.torch's PackedDataset")
    loss_mask = np.zeros(len(tokens), dtype=np.int8)
    loss_mask[ranges(dst, n - 1)[supervised]] = 1
    seq_start_id = (dst - row_offsets[pack_of]).astype(np.int32)
    return row_offsets, tokens, loss_mask, shard.seq_offsets, seq_start_id, runtime, pack_of


def check_layout(output: PackedOutput, options) -> None:
    """NeMo's rows hold packs of any layout: what it cannot hold is found pack by pack (`_rows`)."""


def write_npy(output: PackedOutput, target: Path, options) -> dict:
    """The rows of `write` as NeMo's legacy train.npy."""
    return write(output, target, options, npy=True)


def write(output: PackedOutput, target: Path, options, *, npy: bool = False) -> dict:
    from packctl.export import read_packs

    eos_token_id = options.eos_token_id

    layout = output.layout
    align, capacity = int(layout["align"]), int(layout["capacity"])
    files, rows_npy = [], []
    packs = sequences = 0
    max_seqlen = max_per_bin = 0
    min_packed = None
    runtime_total = 0
    first_pack = 0
    for k, shard in enumerate(read_packs(output)):
        row_offsets, tokens, loss_mask, seq_offsets, seq_start_id, runtime, pack_of = _rows(
            shard, align, eos_token_id, output.root, first_pack)
        first_pack += shard.num_packs
        packed = np.bincount(pack_of, weights=runtime, minlength=shard.num_packs).astype(np.int64)
        packs += shard.num_packs
        sequences += len(runtime)
        runtime_total += int(packed.sum())
        max_seqlen = max(max_seqlen, int(runtime.max()))
        max_per_bin = max(max_per_bin, int(np.diff(seq_offsets).max()))
        min_packed = int(packed.min()) if min_packed is None else min(min_packed, int(packed.min()))
        if npy:
            for r in range(shard.num_packs):
                a, b = row_offsets[r], row_offsets[r + 1]
                rows_npy.append({"input_ids": tokens[a:b].tolist(), "loss_mask": loss_mask[a:b].tolist(),
                                 "seq_start_id": seq_start_id[seq_offsets[r]:seq_offsets[r + 1]].tolist()})
            continue
        table = pa.table({
            "input_ids": pa.ListArray.from_arrays(pa.array(row_offsets, pa.int32()), pa.array(tokens)),
            "seq_start_id": pa.ListArray.from_arrays(pa.array(seq_offsets, pa.int32()), pa.array(seq_start_id)),
            "loss_mask": pa.ListArray.from_arrays(pa.array(row_offsets, pa.int32()), pa.array(loss_mask)),
        })
        name = f"train-{k:05d}.idx.parquet"
        pq.write_table(table, target / name, row_group_size=500, compression="zstd")
        files.append(name)
    if npy:
        name = "train.npy"
        array = np.empty(len(rows_npy), dtype=object)
        array[:] = rows_npy
        np.save(target / name, array, allow_pickle=True)
        files.append(name)
    metadata = [{
        "dataset_max_seqlen": max_seqlen,
        "max_samples_per_bin": max_per_bin,
        "packing_factor": round(sequences / packs, 2),
        "packing_efficiency": round(runtime_total / packs / capacity * 100, 2),
        "pack_size": capacity,
        "min_packed_seqlen": min_packed,
    }]
    (target / METADATA_FILE).write_text(json.dumps(metadata) + "\n")
    return {"format": "nemo-npy" if npy else "nemo", "output": str(target), "files": files,
            "metadata": METADATA_FILE, "packs": packs, "sequences": sequences, "pad_seq_to_mult": align,
            "packing_metadata": metadata[0]}
