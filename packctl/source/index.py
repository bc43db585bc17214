"""What a run knows of its input before reading a token: the files INPUT resolved to, their rows
and blocks, and the global sample ids that name every row, whatever the input's kind (Parquet
files, or Megatron `.bin/.idx` pairs named by their `.idx`).

The **global sample id** (gid) of row r of file f is `file_offsets[f] + r`, files sorted by path,
so ids do not depend on how many processes read them:

    a.parquet (3 rows) b.idx (2 documents)  ->  gids 0 1 2 | 3 4,  file_offsets = [0, 3, 5]
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from packctl.arrays import offsets_of
from packctl.source.files import FileFingerprint
from packctl.specs import CarriedColumns

IDX, BIN = ".idx", ".bin"


@dataclass(frozen=True)
class ResolvedFile:
    """One input file: the path as found (relative if its INPUT was), the INPUT that reached it,
    its identity and its fingerprint."""

    path: str
    spec: str
    device: int
    inode: int
    fingerprint: FileFingerprint


@dataclass(frozen=True)
class Resolution:
    """The INPUT of a run, normalized (`specs`, what the shards record) and resolved (`files`,
    sorted by path: the global sample id order), with the kind that reads them (an `InputKind`
    of `packctl.source.kinds`, decided once by `resolve` from the names and the run's options)."""

    specs: list[str]
    files: list[ResolvedFile]
    kind: Any = None

    @property
    def paths(self) -> list[str]:
        return [f.path for f in self.files]


def is_indexed(path: str) -> bool:
    """Whether a resolved input path names a Megatron pair (by its `.idx`); `.bin` and `.idx` are
    never read as Parquet."""
    return path.endswith(IDX)


def prefix_of(path: str) -> str | None:
    """The dataset prefix of a `.bin` or `.idx` path, else None: data/c.bin -> data/c."""
    for suffix in (IDX, BIN):
        if path.endswith(suffix) and len(path) > len(suffix):
            return path[:-len(suffix)]
    return None


def bin_of(idx_path: str) -> str:
    return idx_path[:-len(IDX)] + BIN


def describe_document(idx_path: str, document: int) -> str:
    """How messages name a document: 'data/c.idx document 7'."""
    return f"{idx_path} document {document}"


@dataclass(frozen=True)
class InputFile:
    path: str
    rows: int
    bytes: int


@dataclass(frozen=True)
class Block:
    """The unit in which tokens are decoded, cached and routed: one Parquet row group, a run of
    documents of a Megatron pair (`packctl.source.megatron.blocks_of`), or a run of lines of a
    JSONL file (`packctl.source.kinds.jsonl`)."""

    file: int
    row_group: int
    first_row: int  # row of the file where the block starts
    rows: int
    nbytes: int  # uncompressed size of its columns (what decoding it costs)
    start: int = 0  # where the kind finds it in its file: a JSONL block's first byte


class RowsByGid:
    """What an index of input rows by global sample id answers from its `files`, `file_offsets`,
    `tokens_column`, `fingerprints` and `kind` (SequenceIndex of pack, LengthIndex of the stats
    what-if)."""

    files: list[InputFile]
    file_offsets: np.ndarray
    tokens_column: str
    fingerprints: list[FileFingerprint]
    kind: Any

    def fingerprint(self, f: int) -> FileFingerprint | None:
        """What the run first read of file f (None when nothing was recorded)."""
        return self.fingerprints[f] if self.fingerprints else None

    @property
    def num_sequences(self) -> int:
        return int(self.file_offsets[-1])

    def describe(self, gid: int, column: str | None = None) -> str:
        """'FILE row R column C' of a gid, as every message names a row (C: `column`, by default
        the tokens column)."""
        return describe_gid(self.kind, [f.path for f in self.files], self.file_offsets, gid,
                            column or self.tokens_column)


@dataclass
class SequenceIndex(RowsByGid):
    """What scan learns about the corpus: files and blocks in gid order (from Parquet footers, the
    same on every rank) and the lengths of gids [gid_lo, gid_lo + len(lengths)) (this rank's)."""

    files: list[InputFile]
    file_offsets: np.ndarray  # int64, len(files) + 1
    blocks: list[Block]
    block_offsets: np.ndarray  # int64, len(blocks) + 1: gids of block b are [block_offsets[b], block_offsets[b+1])
    lengths: np.ndarray  # int64, one per gid of this rank's blocks
    tokens_column: str
    labels_column: str | None
    gid_lo: int = 0
    # the input columns the run reads beside tokens and labels (specs.py): scan checks the weight
    # column and reads the --limit columns (into `extra`) and the --prefix-column of every block
    carried: CarriedColumns = CarriedColumns()
    # with `scan_blocks(count_loss_tokens=True)`: per gid of this rank, the labels that are not -100
    # after its first token (the loss tokens of the sequence as a whole piece of a pack)
    loss_tokens: np.ndarray | None = None
    # --group-column: the gid where each group starts, then num_sequences (all ranks; source/groups.py)
    group_starts: np.ndarray | None = None
    # one per file: what the run first read of it; every later open checks the file against it
    fingerprints: list[FileFingerprint] = field(default_factory=list)
    # --limit COL=N: the values of `carried.limits`, int64, one row per gid of this rank, one
    # column each in --limit order; None without --limit
    extra: np.ndarray | None = None
    # the `InputKind` that reads every file and the `InputOptions` it reads them with
    # (`packctl.source.kinds`): every later decode and message asks these, never a file's name
    kind: Any = None
    options: Any = None
    # --share-prefix: what scan read of every row of this rank (source/prefix.py `PrefixScan`), and
    # from it the tokens each row's group stores once (int64 per gid of this rank; pipeline/prefix.py)
    prefix_scan: Any = None
    shared: np.ndarray | None = None

    @property
    def limit_columns(self) -> tuple[str, ...]:
        """The --limit columns, in --limit order (the columns of `extra`)."""
        return self.carried.limits

    @classmethod
    def of_files(cls, files: list[InputFile], blocks: list[Block], fingerprints: list[FileFingerprint], *,
                 tokens_column: str, labels_column: str | None, **options) -> "SequenceIndex":
        """The index of `files` and their `blocks`, before scan: gid offsets from their rows, no
        lengths yet. `options`: the other fields (carried, kind, options)."""
        return cls(files=files, file_offsets=offsets_of(np.array([f.rows for f in files], dtype=np.int64)),
                   blocks=blocks, block_offsets=offsets_of(np.array([b.rows for b in blocks], dtype=np.int64)),
                   lengths=np.zeros(0, np.int64), tokens_column=tokens_column, labels_column=labels_column,
                   fingerprints=fingerprints, **options)


def describe_gid(kind: Any, paths: list[str], file_offsets: np.ndarray, gid: int, column: str | None = None) -> str:
    """Where a global sample id comes from, as every message names a row, told by the input's
    `kind` (`InputKind.describe`): 'FILE row R column C'. Files a (3 rows), b: gid 4 -> 'b row 1'."""
    f = int(np.searchsorted(file_offsets, gid, side="right") - 1)
    return kind.describe(paths[f], gid - int(file_offsets[f]), column)
