"""What `--share-prefix` reads of every row during scan: how many leading tokens it shares with the
row before it, and with `--prefix-column C` its prompt length.

Scan decodes every block once, in gid order on each rank; a block's rows are compared with the row
before them there (plan/prefix.py `common_with_previous`), its first row with the last row of the
block before. A rank's first row is compared with the previous rank's last row afterwards
(pipeline/prefix.py), since a group may straddle blocks, files and ranks:

    block 0 rows [1 2 3 4 7 8] [1 2 3 4 9]   block 1 rows [1 2 3 4 5]
    common  [-1, 4] then [4]                 (-1: the row before lives on another rank, or none)
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from packctl.errors import PackctlError
from packctl.plan.prefix import common_length, common_with_previous
from packctl.source.blocks import DecodedBlock
from packctl.source.files import FileFingerprint, _short, open_parquet

Row = tuple[np.ndarray, np.ndarray]  # a row's int32 tokens and labels


@dataclass
class BlockPrefixes:
    """One block's rows compared with each other: `common` (its first row -1), its first and last row."""

    common: np.ndarray
    first: Row | None
    last: Row | None


def block_prefixes(decoded: DecodedBlock) -> BlockPrefixes:
    """The rows of a decoded block (any form) compared with the row before each."""
    rows = len(decoded.offsets) - 1
    if rows == 0:
        return BlockPrefixes(np.zeros(0, np.int64), None, None)
    lens = np.diff(decoded.offsets)
    tokens, labels = decoded.gather(np.arange(rows), np.zeros(rows, np.int64), lens)
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    common = common_with_previous(offsets, tokens, labels, None)
    last = slice(int(offsets[-2]), int(offsets[-1]))
    return BlockPrefixes(common, (tokens[:offsets[1]].copy(), labels[:offsets[1]].copy()),
                         (tokens[last].copy(), labels[last].copy()))


@dataclass
class PrefixScan:
    """This rank's rows as --share-prefix needs them, in gid order: `common` (leading tokens shared
    with the row before; -1 for the rank's first row until `pipeline.prefix` fills it in), `bound`
    (--prefix-column values, or None), and the rank's first and last row."""

    common: np.ndarray
    bound: np.ndarray | None
    first: Row | None = None
    last: Row | None = None

    @classmethod
    def empty(cls, rows: int, bounded: bool) -> "PrefixScan":
        return cls(np.full(rows, -1, np.int64), np.zeros(rows, np.int64) if bounded else None)

    def add(self, rows: slice, block: BlockPrefixes, bound: np.ndarray | None) -> None:
        """Blocks come in gid order: the block's first row is compared with the last row before it."""
        common = block.common.copy()
        if len(common) and self.last is not None:
            common[0] = common_length(*self.last, *block.first)
        self.common[rows] = common
        if self.bound is not None and bound is not None:
            self.bound[rows] = bound
        if block.first is not None:
            self.first = self.first if self.first is not None else block.first
            self.last = block.last


def read_prefix_lengths(path: str, row_group: int, first_row: int, column: str, rows: int,
                        expected: FileFingerprint | None = None) -> np.ndarray:
    """The --prefix-column values of one row group as int64, each a whole number >= 0; a missing
    column, another type, a null or a negative value is refused as 'FILE row R column C: ...'."""
    pf = open_parquet(path, expected)
    if column not in pf.schema_arrow.names:
        raise PackctlError(f"{path}: no column '{column}' for --prefix-column (columns: "
                           f"{', '.join(pf.schema_arrow.names)}); write each row's prompt length (packctl tokenize "
                           "writes prompt_length), or drop --prefix-column")
    try:
        array = pf.read_row_group(row_group, columns=[column]).column(column).combine_chunks()
    except (pa.ArrowException, OSError) as exc:
        raise PackctlError(f"{path}: cannot read column '{column}' ({_short(exc)}); the file may be truncated or "
                           "corrupt") from None
    if not pa.types.is_integer(array.type):
        raise PackctlError(f"{path}: column '{column}' is {array.type}; --prefix-column needs one whole number per "
                           "row (its prompt length in tokens)")
    if array.null_count:
        row = int(np.flatnonzero(array.is_null().to_numpy(zero_copy_only=False))[0])
        raise PackctlError(f"{path} row {first_row + row} column '{column}': null; --prefix-column needs each row's "
                           "prompt length (0 to share nothing): fill the row")
    values = array.to_numpy(zero_copy_only=False).astype(np.int64)
    if len(values) and values.min() < 0:
        row = int(np.argmax(values < 0))
        raise PackctlError(f"{path} row {first_row + row} column '{column}': {int(values[row])} is negative; "
                           "--prefix-column needs each row's prompt length in tokens: fix the value")
    return values
