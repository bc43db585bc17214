"""Write packed shards and the output directory, atomically.

Everything goes into a temporary sibling directory `.OUT.packctl-tmp-PID`; `manifest.json` is
written last, then the directory is renamed to OUT. A failed run leaves OUT untouched.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from packctl.errors import PackctlError
from packctl.schema import METADATA_KEY, PACK_SCHEMA
from packctl.thd import PackRows

PARQUET_OPTIONS = dict(compression="zstd", compression_level=3, write_statistics=False)


@dataclass(frozen=True)
class ShardInfo:
    path: str  # relative to OUT
    rows: int
    tokens: int  # true tokens (sum of num_tokens)
    sha256: str


def _list(offsets: np.ndarray, values: np.ndarray, value_type: pa.DataType) -> pa.ListArray:
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32), pa.int32()), pa.array(values, value_type))


def rows_to_table(rows: PackRows, metadata: bytes) -> pa.Table:
    """PackRows -> an Arrow table with the contract's schema and the `packctl` metadata key."""
    i32 = pa.int32()
    columns = [
        _list(rows.token_offsets, rows.input_ids, i32),
        _list(rows.token_offsets, rows.labels, i32),
        _list(rows.token_offsets, rows.position_ids, i32),
        _list(rows.seq_offsets, rows.seq_lens, i32),
        _list(rows.seq_offsets, rows.seq_lens_padded, i32),
        _list(rows.cu_offsets, rows.cu_seqlens, i32),
        _list(rows.cu_offsets, rows.cu_seqlens_padded, i32),
        _list(rows.seq_offsets, rows.sample_ids, pa.int64()),
        pa.array(rows.num_tokens, i32),
    ]
    schema = PACK_SCHEMA.with_metadata({METADATA_KEY: metadata})
    return pa.Table.from_arrays(columns, schema=schema)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class OutputDir:
    """The output directory being written: shards and reports go to a temporary directory that
    replaces OUT only in `commit()`."""

    def __init__(self, out: str | Path, *, overwrite: bool):
        self.out = Path(out)
        self.overwrite = overwrite
        check_output_path(self.out, overwrite=overwrite)
        self.tmp = self.out.parent / f".{self.out.name}.packctl-tmp-{os.getpid()}"
        try:
            if self.tmp.exists():
                shutil.rmtree(self.tmp)
            self.tmp.mkdir(parents=True)
        except OSError as exc:
            raise PackctlError(f"{self.out}: cannot create the output directory ({exc.strerror or exc})") from None

    @classmethod
    def attach(cls, out: str | Path, tmp: Path) -> "OutputDir":
        """The directory another rank created: this rank writes its shards into it."""
        self = cls.__new__(cls)
        self.out, self.tmp, self.overwrite = Path(out), Path(tmp), True
        return self

    def write_shard(self, name: str, table: pa.Table) -> ShardInfo:
        path = self.tmp / name
        try:
            pq.write_table(table, path, **PARQUET_OPTIONS)
        except OSError as exc:
            raise PackctlError(f"{self.out / name}: write failed ({exc.strerror or exc})") from None
        tokens = int(np.asarray(table.column("num_tokens").combine_chunks()).sum())
        return ShardInfo(path=name, rows=table.num_rows, tokens=tokens, sha256=sha256_file(path))

    def write_json(self, name: str, data: dict) -> None:
        try:
            (self.tmp / name).write_text(json.dumps(data, indent=2) + "\n")
        except OSError as exc:
            raise PackctlError(f"{self.out / name}: write failed ({exc.strerror or exc})") from None

    def commit(self) -> None:
        """Replace OUT with the finished directory (manifest.json must already be in it)."""
        trash = None
        if self.out.exists():
            trash = self.out.parent / f".{self.out.name}.packctl-old-{os.getpid()}"
            os.replace(self.out, trash)
        os.replace(self.tmp, self.out)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True) if trash.is_dir() else trash.unlink()

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


def check_output_path(out: Path, *, overwrite: bool, inputs: list[str] | None = None) -> None:
    """Refuse an existing OUT without --overwrite, and an OUT that is or holds an input file."""
    if out.exists() and not overwrite:
        raise PackctlError(f"{out}: already exists; pass --overwrite to replace it or choose another -o")
    if inputs:
        out_real = os.path.realpath(out)
        for path in inputs:
            real = os.path.realpath(path)
            if real == out_real or real.startswith(out_real + os.sep):
                raise PackctlError(f"{out}: the output would replace the input {path}; choose another -o")
