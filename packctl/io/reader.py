"""Scan tokenized Parquet shards: resolve inputs, validate columns, index sequence lengths.

The **global sample id** (gid) of row r of file f is `file_offsets[f] + r`, files sorted by path,
so ids do not depend on how many processes read them:

    a.parquet (3 rows) b.parquet (2 rows)  ->  gids 0 1 2 | 3 4,  file_offsets = [0, 3, 5]

Token values are validated once, where they are decoded; a bad row is reported as
`FILE row R column C: what is wrong; what to do`.
"""
from __future__ import annotations

import glob
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from packctl.arrays import ranges
from packctl.config import IGNORE_INDEX, INT32_MAX
from packctl.errors import PackctlError

_GLOB_CHARS = set("*?[")


@dataclass(frozen=True)
class InputFile:
    path: str
    rows: int
    bytes: int


@dataclass
class SequenceIndex:
    """What scan learns about the corpus: files in gid order and one length per gid."""

    files: list[InputFile]
    file_offsets: np.ndarray  # int64, len(files) + 1
    lengths: np.ndarray  # int64, one per gid
    tokens_column: str
    labels_column: str | None

    @property
    def num_sequences(self) -> int:
        return int(self.file_offsets[-1])

    def locate(self, gids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """gid -> (file index, row in file)."""
        file_idx = np.searchsorted(self.file_offsets, gids, side="right") - 1
        return file_idx, gids - self.file_offsets[file_idx]

    def describe(self, gid: int) -> str:
        f, r = self.locate(np.asarray([gid]))
        return f"{self.files[int(f[0])].path} row {int(r[0])} column '{self.tokens_column}'"


@dataclass
class DecodedFile:
    """One file's tokens (and labels) as flat int32 values with int64 row offsets."""

    offsets: np.ndarray
    tokens: np.ndarray
    labels: np.ndarray | None

    @property
    def nbytes(self) -> int:
        return self.offsets.nbytes + self.tokens.nbytes + (0 if self.labels is None else self.labels.nbytes)


def resolve_inputs(inputs: list[str]) -> list[str]:
    """Files, directories (every *.parquet below) and globs -> sorted, distinct Parquet paths."""
    found: list[str] = []
    for spec in inputs:
        if _GLOB_CHARS & set(spec):
            matches = sorted(glob.glob(spec, recursive=True))
            matches = [m for m in matches if os.path.isfile(m)]
            if not matches:
                raise PackctlError(f"{spec}: the pattern matches no file")
            found += matches
        elif os.path.isdir(spec):
            matches = sorted(str(p) for p in Path(spec).rglob("*.parquet") if p.is_file())
            if not matches:
                raise PackctlError(f"{spec}: the directory holds no *.parquet file")
            found += matches
        elif os.path.isfile(spec):
            found.append(spec)
        else:
            raise PackctlError(f"{spec}: no such file or directory")
    paths = [os.path.normpath(p) for p in found]
    seen: dict[str, str] = {}
    for p in paths:
        key = os.path.realpath(p)
        if key in seen:
            raise PackctlError(f"{p}: given twice (also as {seen[key]}); list each input file once")
        seen[key] = p
    return sorted(paths)


def _open(path: str) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise PackctlError(f"{path}: not a readable Parquet file ({_short(exc)})") from None


def _short(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def _check_list_type(path: str, schema: pa.Schema, column: str, role: str) -> None:
    if column not in schema.names:
        hint = "--tokens-column NAME" if role == "tokens" else "--labels-column NAME (or leave it unset)"
        raise PackctlError(
            f"{path}: no column '{column}' (columns: {', '.join(schema.names)}); pass {hint}")
    typ = schema.field(column).type
    if not (pa.types.is_list(typ) or pa.types.is_large_list(typ)) or not pa.types.is_integer(typ.value_type):
        raise PackctlError(f"{path}: column '{column}' is {_type_name(typ)}; {role} must be a list of integers")


def _type_name(typ: pa.DataType) -> str:
    """Arrow type without child field names: list<element: list<item: int64>> -> list<list<int64>>."""
    if pa.types.is_list(typ) or pa.types.is_large_list(typ) or pa.types.is_fixed_size_list(typ):
        return f"list<{_type_name(typ.value_type)}>"
    return str(typ)


def resolve_labels_column(paths: list[str], requested: str | None) -> str | None:
    """The labels column to use: the requested one (every file must have it), else `labels` when
    every file has it, else none (labels = tokens). Files that disagree are an error."""
    schemas = {p: _open(p).schema_arrow for p in paths}
    if requested is not None:
        for p, schema in schemas.items():
            _check_list_type(p, schema, requested, "labels")
        return requested
    having = [p for p, s in schemas.items() if "labels" in s.names]
    if having and len(having) != len(paths):
        lacking = next(p for p in paths if p not in having)
        raise PackctlError(
            f"{lacking}: has no 'labels' column but {having[0]} has one; give every shard the same "
            "columns, or pass --labels-column to name the labels explicitly")
    return "labels" if having else None


def _flat(path: str, arr: pa.Array, column: str) -> tuple[np.ndarray, pa.Array]:
    """Validated row offsets (int64, starting at 0) and the referenced child values of a list array."""
    if arr.null_count:
        row = int(np.flatnonzero(arr.is_null().to_numpy(zero_copy_only=False))[0])
        raise PackctlError(f"{path} row {row} column '{column}': null instead of a list; "
                           "drop or fill null rows before packing")
    offsets = np.asarray(arr.offsets, dtype=np.int64)
    values = arr.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))
    offsets = offsets - offsets[0]
    if values.null_count:
        k = int(np.flatnonzero(values.is_null().to_numpy(zero_copy_only=False))[0])
        row = int(np.searchsorted(offsets, k, side="right") - 1)
        raise PackctlError(f"{path} row {row} column '{column}': null value at position {k - offsets[row]}; "
                           "token lists must not hold nulls")
    return offsets, values


def _row_of(offsets: np.ndarray, flat_index: int) -> tuple[int, int]:
    row = int(np.searchsorted(offsets, flat_index, side="right") - 1)
    return row, flat_index - int(offsets[row])


def decode_file(path: str, tokens_column: str, labels_column: str | None) -> DecodedFile:
    """Read and validate one file: tokens in [0, 2^31), no nulls, no empty rows, labels aligned."""
    pf = _open(path)
    schema = pf.schema_arrow
    _check_list_type(path, schema, tokens_column, "tokens")
    columns = [tokens_column]
    if labels_column is not None:
        _check_list_type(path, schema, labels_column, "labels")
        columns.append(labels_column)
    try:
        table = pf.read(columns=columns, use_threads=True)
    except (pa.ArrowException, OSError) as exc:
        raise PackctlError(f"{path}: cannot read column(s) {', '.join(columns)} ({_short(exc)}); "
                           "the file may be truncated or corrupt") from None
    tok_arr = table.column(tokens_column).combine_chunks()
    offsets, tok_values = _flat(path, tok_arr, tokens_column)
    lengths = np.diff(offsets)
    if len(lengths) and (lengths == 0).any():
        row = int(np.argmax(lengths == 0))
        raise PackctlError(f"{path} row {row} column '{tokens_column}': empty sequence; remove empty rows")
    tokens = _as_int32(path, tok_values, offsets, tokens_column, allow_ignore=False)
    labels = None
    if labels_column is not None:
        lab_arr = table.column(labels_column).combine_chunks()
        lab_offsets, lab_values = _flat(path, lab_arr, labels_column)
        if not np.array_equal(lab_offsets, offsets):
            row = int(np.argmax(np.diff(lab_offsets) != lengths))
            raise PackctlError(
                f"{path} row {row} column '{labels_column}': {int(np.diff(lab_offsets)[row])} labels for "
                f"{int(lengths[row])} tokens; labels must have one entry per token")
        labels = _as_int32(path, lab_values, offsets, labels_column, allow_ignore=True)
    return DecodedFile(offsets=offsets, tokens=tokens, labels=labels)


def _as_int32(path: str, values: pa.Array, offsets: np.ndarray, column: str, *, allow_ignore: bool) -> np.ndarray:
    arr = values.to_numpy(zero_copy_only=False)
    if len(arr) == 0:
        return arr.astype(np.int32)
    if arr.dtype.kind == "u":
        bad = arr > INT32_MAX
    else:
        bad = (arr < 0) | (arr > INT32_MAX)
        if allow_ignore:
            bad &= arr != IGNORE_INDEX
    if bad.any():
        k = int(np.argmax(bad))
        row, pos = _row_of(offsets, k)
        allowed = f"[0, {INT32_MAX}]" + (f" or {IGNORE_INDEX}" if allow_ignore else "")
        raise PackctlError(f"{path} row {row} column '{column}': value {int(arr[k])} at position {pos} "
                           f"is outside {allowed}")
    return arr.astype(np.int32, copy=False)


class TokenSource:
    """Decoded input files, kept while they fit in `budget` bytes (least recently used go first).

    Scan decodes every file once to learn lengths; when the corpus fits in the budget,
    materialize reuses those arrays and the input is read only once.
    """

    def __init__(self, paths: list[str], tokens_column: str, labels_column: str | None, budget: int):
        self.paths = paths
        self.tokens_column = tokens_column
        self.labels_column = labels_column
        self.budget = budget
        self._cache: OrderedDict[int, DecodedFile] = OrderedDict()
        self._held = 0
        self.files_read = 0

    def offer(self, file_idx: int, decoded: DecodedFile) -> None:
        if decoded.nbytes > self.budget:
            return
        while self._held + decoded.nbytes > self.budget and self._cache:
            _, old = self._cache.popitem(last=False)
            self._held -= old.nbytes
        self._cache[file_idx] = decoded
        self._held += decoded.nbytes

    def file(self, file_idx: int) -> DecodedFile:
        hit = self._cache.get(file_idx)
        if hit is not None:
            self._cache.move_to_end(file_idx)
            return hit
        decoded = decode_file(self.paths[file_idx], self.tokens_column, self.labels_column)
        self.files_read += 1
        self.offer(file_idx, decoded)
        return decoded

    def gather(self, file_idx: np.ndarray, rows: np.ndarray, starts: np.ndarray,
               lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Tokens and labels of pieces (file, row, start, len), concatenated in the given order.

        Pieces (file 0, row 7, start 0, len 3), (file 1, row 2, start 4, len 2)
        -> tokens of row 7 [0:3] of file 0, then row 2 [4:6] of file 1.
        """
        total = int(lens.sum())
        tokens = np.empty(total, dtype=np.int32)
        labels = np.empty(total, dtype=np.int32)
        out_starts = np.cumsum(lens) - lens
        for f in np.unique(file_idx):
            sel = np.flatnonzero(file_idx == f)
            decoded = self.file(int(f))
            src = ranges(decoded.offsets[rows[sel]] + starts[sel], lens[sel])
            dst = ranges(out_starts[sel], lens[sel])
            tokens[dst] = decoded.tokens[src]
            labels[dst] = (decoded.tokens if decoded.labels is None else decoded.labels)[src]
        return tokens, labels



def scan(inputs: list[str], tokens_column: str, labels_column: str | None,
         budget: int, progress=None) -> tuple[SequenceIndex, TokenSource]:
    """Resolve INPUTs, validate every file and return the length index plus the token source."""
    paths = resolve_inputs(inputs)
    labels = resolve_labels_column(paths, labels_column)
    source = TokenSource(paths, tokens_column, labels, budget)
    files: list[InputFile] = []
    lengths: list[np.ndarray] = []
    for f, path in enumerate(paths):
        decoded = decode_file(path, tokens_column, labels)
        files.append(InputFile(path=path, rows=len(decoded.offsets) - 1, bytes=os.path.getsize(path)))
        lengths.append(np.diff(decoded.offsets))
        source.offer(f, decoded)
        if progress is not None:
            progress(1)
    row_counts = np.array([f.rows for f in files], dtype=np.int64)
    index = SequenceIndex(
        files=files,
        file_offsets=np.concatenate([[0], np.cumsum(row_counts)]).astype(np.int64),
        lengths=np.concatenate(lengths).astype(np.int64) if lengths else np.zeros(0, np.int64),
        tokens_column=tokens_column,
        labels_column=labels,
    )
    if index.num_sequences == 0:
        raise PackctlError(f"{', '.join(inputs)}: the input holds no rows")
    return index, source
