"""`packctl export OUT -o DIR --format F`: a packed output rewritten in the packed format another
trainer reads itself, pack for pack, in output order (docs/training.md "Exports").

    nemo       NeMo / Megatron-Bridge packed SFT: DIR/train-00000.idx.parquet ... (input_ids,
               seq_start_id, loss_mask) and DIR/packing_metadata.json
    nemo-npy   the same rows as NeMo's legacy DIR/train.npy (an array of dicts)
    olmo       OLMo-core numpy token files: DIR/part-00000.npy ... (flat tokens), label masks and
               document boundaries

Every format is read back by an independent reader in tests/integration/test_export.py.
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa

from packctl.config import as_python
from packctl.contract.schema import INT32_MAX
from packctl.contract.reader import PackedOutput, open_output
from packctl.contract.schema import CU_SEQLENS_PADDED, INPUT_IDS, LABELS, SEQ_LENS
from packctl.errors import PackctlError

FORMATS = ("nemo", "nemo-npy", "olmo")


@dataclass
class ShardPacks:
    """The columns of one shard an export needs, as flat numpy arrays (CSR offsets per pack)."""

    name: str
    token_offsets: np.ndarray  # int64, packs + 1: pack r is input_ids[token_offsets[r]:token_offsets[r+1]]
    input_ids: np.ndarray  # int32
    labels: np.ndarray  # int32, unshifted, -100 where no loss
    seq_offsets: np.ndarray  # int64, packs + 1: the sequences of pack r
    seq_lens: np.ndarray  # int64, true lengths
    seq_starts: np.ndarray  # int64, each sequence's offset inside its pack (cu_seqlens_padded[:-1])

    @property
    def num_packs(self) -> int:
        return len(self.token_offsets) - 1

    def flat_starts(self) -> np.ndarray:
        """Each sequence's offset in `input_ids`."""
        pack_of = np.repeat(np.arange(self.num_packs), np.diff(self.seq_offsets))
        return self.token_offsets[pack_of] + self.seq_starts


def _list(table: pa.Table, name: str) -> tuple[np.ndarray, np.ndarray]:
    array = table.column(name).combine_chunks()
    offsets = np.asarray(array.offsets, dtype=np.int64)
    return offsets - offsets[0], array.values.to_numpy()[offsets[0]:offsets[-1]]


def read_packs(output: PackedOutput) -> Iterator[ShardPacks]:
    """The shards of a packed output, in manifest order, each read through the output's reader
    (checked against the manifest unless it was opened with verify=False)."""
    for k, entry in enumerate(output.shards):
        table = output.read_shard(k, [INPUT_IDS, LABELS, SEQ_LENS, CU_SEQLENS_PADDED])
        token_offsets, input_ids = _list(table, INPUT_IDS)
        _, labels = _list(table, LABELS)
        seq_offsets, seq_lens = _list(table, SEQ_LENS)
        cu_offsets, cu = _list(table, CU_SEQLENS_PADDED)
        # cu_seqlens_padded has one more entry per pack than seq_lens: drop each pack's last
        keep = np.ones(len(cu), dtype=bool)
        keep[cu_offsets[1:] - 1] = False
        yield ShardPacks(entry.path, token_offsets, input_ids, labels, seq_offsets,
                         seq_lens.astype(np.int64), cu[keep].astype(np.int64))


def check_options(fmt: str, *, overwrite: bool = False, eos_token_id: int | None = None) -> int | None:
    """The options of an export, refused before anything is read or written; returns the EOS id as
    a Python int (a numpy integer is taken too)."""
    if fmt not in FORMATS:
        raise PackctlError(f"--format {fmt!r}: choose one of {', '.join(FORMATS)}")
    if not isinstance(overwrite, bool):
        raise PackctlError(f"--overwrite {overwrite!r}: must be true or false")
    if eos_token_id is not None:
        eos_token_id = as_python(eos_token_id)
        if not isinstance(eos_token_id, int) or isinstance(eos_token_id, bool):
            raise PackctlError(f"--eos-token-id {eos_token_id!r}: must be a whole number")
        if not 0 <= eos_token_id <= INT32_MAX:
            raise PackctlError(f"--eos-token-id {eos_token_id}: must be in [0, {INT32_MAX:,}] (token ids are int32)")
    return eos_token_id


def export(out: str | Path, target: str | Path, fmt: str, *, overwrite: bool = False,
           eos_token_id: int | None = None, verify: bool = True) -> dict:
    """Write the packed output `out` to `target` in format `fmt`; returns what was written.

    Every shard is read checked against the manifest (sha256, rows, tokens, layout) unless
    `verify=False` (`--no-verify-checksums`). A failure part-way removes what the export wrote,
    so `target` never holds part of an export.
    """
    from packctl.export import nemo, olmo

    eos_token_id = check_options(fmt, overwrite=overwrite, eos_token_id=eos_token_id)
    output = open_output(out, verify=verify)
    out = output.root
    target = Path(target)
    if target.resolve() == out.resolve() or out.resolve() in target.resolve().parents:
        raise PackctlError(f"{target}: inside the packed output {out}; choose a -o outside it")
    if target.exists():
        if not overwrite:
            raise PackctlError(f"{target}: exists; choose another -o or pass --overwrite")
        if not target.is_dir():
            raise PackctlError(f"{target}: exists and is not a directory")
        for child in target.iterdir():
            if child.is_dir():
                raise PackctlError(f"{target}: holds the directory {child.name}; export writes files only, "
                                   "choose an empty or new -o")
    if output.layout.get("pad_to") == "batch":
        raise PackctlError(f"{out}: a batch-mode output (padded micro-batches); exports take packs: pack "
                           "without --mode batch")
    created = not target.exists()
    if not created:
        for child in target.iterdir():
            child.unlink()
    target.mkdir(parents=True, exist_ok=True)
    try:
        if fmt in ("nemo", "nemo-npy"):
            return nemo.write(output, target, npy=fmt == "nemo-npy", eos_token_id=eos_token_id)
        return olmo.write(output, target, eos_token_id=eos_token_id)
    except BaseException:
        _remove_written(target, created)
        raise


def _remove_written(target: Path, created: bool) -> None:
    """Undo a failed export: `target` held nothing of anyone else's (new, or emptied by --overwrite)."""
    if created:
        shutil.rmtree(target, ignore_errors=True)
        return
    for child in target.iterdir():
        if child.is_dir():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)
