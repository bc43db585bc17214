"""JSONL of token ids: one JSON object a line, its tokens column (`input_ids` unless
--tokens-column) a list of ids and, optionally, a labels column of the same length (`labels` when
every file's first line has one, or --labels-column), checked as Parquet columns are:

    {"input_ids": [17, 4, 9], "labels": [-100, 4, 9]}      row 0
    {"input_ids": [301, 2]}                                 row 1 (no labels here: refused when
                                                            the labels column is in use)

Every line is a row (row R is line R + 1). Indexing reads each file once: its rows, a digest of
its bytes (the fingerprint), and blocks of up to `BLOCK_LINES` lines or `BLOCK_BYTES` bytes,
addressed by the byte offset where they start, so a block is decoded alone. A `.jsonl.gz` file
is one block (gzip cannot be entered in the middle): it is decompressed whole to be decoded.

A block is decoded with `json.loads` line by line, every check naming its row. `polars.read_ndjson`
with the columns' types given is 2x faster (0.36 s against 0.7 s for 2000 lines of 2048 ids) but
starts a thread pool that a forked process (a DataLoader worker on a plan, `--resume` tests)
inherits locked: the child hangs at its first read.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import zlib
from itertools import chain

import numpy as np

from packctl.errors import PackctlError
from packctl.source.blocks import DecodedBlock, first_outside_int32
from packctl.source.files import FileFingerprint, changed_error, stat_unchanged
from packctl.source.index import Block, InputFile, Resolution, SequenceIndex
from packctl.source.kinds import InputOptions, OneFile
from packctl.specs import CarriedColumns

# the keys of the raw records `packctl tokenize` reads (text, chat, prompt-completion, preference)
RAW_KEYS = frozenset({"text", "messages", "prompt", "completion", "chosen", "rejected"})
BLOCK_LINES = 1 << 16
BLOCK_BYTES = 1 << 26
_CHUNK = 1 << 24
_NEWLINE = 10


def _open(path: str):
    try:
        return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")
    except OSError as exc:
        raise PackctlError(f"{path}: cannot be read ({exc.strerror or exc}); make it readable, or leave it out "
                           "of INPUT") from None


def _first_keys(path: str) -> set[str]:
    """The keys of the file's first line (what tells whether it has a labels column)."""
    with _open(path) as handle:
        try:
            line = handle.readline()
        except (OSError, EOFError, zlib.error) as exc:
            raise PackctlError(f"{path}: cannot be read ({exc}); the file may be truncated or corrupt") from None
    try:
        record = json.loads(line) if line.strip() else {}
    except ValueError:
        return set()  # named with its row when the block is decoded
    return set(record) if isinstance(record, dict) else set()


class JsonlKind(OneFile):
    name = "JSONL"
    footer_name = "bytes"  # what the fingerprint's digest is of, in messages
    changed_what = "its bytes differ from those the plan read"

    def claims(self, name: str, options: InputOptions | None = None) -> bool:
        return name.endswith(".jsonl") or name.endswith(".jsonl.gz")

    def read_file(self, path: str, f: int, expected: FileFingerprint | None = None, *,
                  options: InputOptions | None = None) -> tuple[FileFingerprint, list[Block], int]:
        """One read of the file: rows, blocks (byte offsets of their first line) and a digest of
        its bytes. Lines a, b, c (6 bytes each), 2 lines a block -> blocks at bytes 0 and 12."""
        st = stat_unchanged(path, expected)
        digest = hashlib.blake2b(digest_size=16)
        cuts, rows, at, line_start, block_start, block_rows = [], 0, 0, 0, 0, 0
        try:
            with _open(path) as handle:
                while chunk := handle.read(_CHUNK):
                    digest.update(chunk)
                    for end in (np.flatnonzero(np.frombuffer(chunk, np.uint8) == _NEWLINE) + at + 1).tolist():
                        rows, block_rows, line_start = rows + 1, block_rows + 1, end
                        if block_rows == BLOCK_LINES or end - block_start >= BLOCK_BYTES:
                            cuts.append((block_start, block_rows, end - block_start))
                            block_start, block_rows = end, 0
                    at += len(chunk)
        except (OSError, EOFError, zlib.error) as exc:
            raise PackctlError(f"{path}: cannot be read ({exc}); the file may be truncated or corrupt") from None
        if at > line_start:  # a last line without its newline
            rows, block_rows = rows + 1, block_rows + 1
        if block_rows:
            cuts.append((block_start, block_rows, at - block_start))
        if path.endswith(".gz"):  # one block: decompressed whole
            cuts = [(0, rows, at)] if rows else []
        fingerprint = FileFingerprint(size=st.st_size, mtime_ns=st.st_mtime_ns, footer=digest.hexdigest())
        if expected is not None and fingerprint.footer != expected.footer:
            raise changed_error(path, "its bytes differ from those read at the start of the run")
        blocks, first = [], 0
        for g, (start, n, nbytes) in enumerate(cuts):
            blocks.append(Block(file=f, row_group=g, first_row=first, rows=n, nbytes=nbytes, start=start))
            first += n
        return fingerprint, blocks, rows

    def index(self, resolution: Resolution, options: InputOptions, carried: CarriedColumns = CarriedColumns()
              ) -> SequenceIndex:
        labels = options.labels_column
        if labels is None:
            having = [r.path for r in resolution.files if "labels" in _first_keys(r.path)]
            if having and len(having) != len(resolution.files):
                lacking = next(r.path for r in resolution.files if r.path not in having)
                raise PackctlError(f"{lacking}: has no 'labels' column but {having[0]} has one; give every file the "
                                   "same columns, or pass --labels-column to name the labels explicitly")
            labels = "labels" if having else None
        files, blocks = [], []
        for f, resolved in enumerate(resolution.files):
            _, file_blocks, rows = self.read_file(resolved.path, f, resolved.fingerprint)
            files.append(InputFile(path=resolved.path, rows=rows, bytes=resolved.fingerprint.size))
            blocks += file_blocks
        index = SequenceIndex.of_files(files, blocks, [r.fingerprint for r in resolution.files],
                                       tokens_column=options.tokens_column, labels_column=labels)
        if index.num_sequences == 0:
            raise PackctlError(f"{', '.join(resolution.specs)}: the input holds no rows")
        return index

    def decode(self, path: str, block: Block, options: InputOptions, *, skip_empty: bool = False,
               check_values: bool = True, expected: FileFingerprint | None = None) -> DecodedBlock:
        stat_unchanged(path, expected)
        try:
            with _open(path) as handle:
                if block.row_group is None:  # the whole file
                    raw = handle.read()
                else:
                    handle.seek(block.start)
                    raw = handle.read(block.nbytes)
        except (OSError, EOFError, zlib.error) as exc:
            raise PackctlError(f"{path}: cannot be read ({exc}); the file may be truncated or corrupt") from None
        lines = raw.split(b"\n")
        if lines and not lines[-1]:
            lines.pop()
        tokens, labels = [], []
        first, tokens_column, labels_column = block.first_row, options.tokens_column, options.labels_column
        for r, line in enumerate(lines):
            try:
                record = json.loads(line)
            except ValueError as exc:
                raise PackctlError(f"{path} row {first + r}: not a JSON object ({exc}); write one JSON object a "
                                   "line") from None
            if not isinstance(record, dict):
                raise PackctlError(f"{path} row {first + r}: a JSON {type(record).__name__}, not an object; write "
                                   "one JSON object a line")
            tokens.append(_ids(path, first + r, record, tokens_column))
            if labels_column is not None:
                labels.append(_ids(path, first + r, record, labels_column))
        lengths = np.fromiter((len(t) for t in tokens), np.int64, len(tokens))
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        if not skip_empty and (lengths == 0).any():
            r = first + int(np.argmax(lengths == 0))
            raise PackctlError(f"{path} row {r} column '{tokens_column}': empty sequence; remove empty rows or "
                               "pass --skip-empty to leave them out (counted in the manifest)")
        flat_labels = None
        if labels_column is not None:
            label_lengths = np.fromiter((len(v) for v in labels), np.int64, len(labels))
            if not np.array_equal(label_lengths, lengths):
                r = int(np.argmax(label_lengths != lengths))
                raise PackctlError(f"{path} row {first + r} column '{labels_column}': {label_lengths[r]} labels for "
                                   f"{lengths[r]} tokens; labels must have one entry per token")
            flat_labels = _as_int32(path, first, offsets, labels, labels_column, allow_ignore=True)
        flat_tokens = _as_int32(path, first, offsets, tokens, tokens_column, allow_ignore=False)
        return DecodedBlock(offsets=offsets, tokens=flat_tokens, labels=flat_labels)

    def scan_lengths(self, index, lo, hi, progress=None, *, skip_empty=False):
        return None  # a line's length is known by decoding it

    def describe(self, path: str, row: int, column: str | None = None) -> str:
        where = f"{path} row {row}"
        return f"{where} column '{column}'" if column is not None else where

    def check_options(self, resolution, *, tokens_column: str = "input_ids", labels_column: str | None = None,
                      carried: CarriedColumns = CarriedColumns()) -> None:
        given = list(carried.given())
        if given:
            raise PackctlError(f"{given[0]}: not read from JSONL input ({resolution.files[0].path}): packctl reads "
                               "the tokens and labels of JSONL; drop the option, or write the input as Parquet",
                               everywhere=True)


def _ids(path: str, row: int, record: dict, column: str) -> list:
    """The list of integers at `column` of a record, else one line naming row and column."""
    if column not in record:
        keys = ", ".join(sorted(record)) or "none"
        if RAW_KEYS & set(record):  # text or chat records: not token ids yet
            raise PackctlError(f"{path} row {row}: a record of text ({keys}), not token ids; tokenize it first: "
                               f"packctl tokenize {path} -o TOKENIZED --tokenizer DIR, then pack TOKENIZED; or pack "
                               "it as it is with --tokenizer DIR")
        raise PackctlError(f"{path} row {row}: no '{column}' key (keys: {keys}); pass --tokens-column or "
                           "--labels-column naming the key of the token ids")
    value = record[column]
    if value is None:
        raise PackctlError(f"{path} row {row} column '{column}': null instead of a list; drop or fill null rows "
                           "before packing")
    if not isinstance(value, list):
        raise PackctlError(f"{path} row {row} column '{column}': a JSON {type(value).__name__}, not a list of "
                           "token ids; write the column as a list of integers")
    for k, v in enumerate(value):
        if type(v) is not int:
            raise PackctlError(f"{path} row {row} column '{column}': {json.dumps(v)} at position {k} is not an "
                               "integer; token lists hold integers only")
    return value


def _as_int32(path: str, first: int, offsets: np.ndarray, rows: list[list], column: str, *,
              allow_ignore: bool) -> np.ndarray:
    """The rows' values, flat, as int32; outside [0, 2^31) (or -100 where `allow_ignore`) refused
    naming the row as Parquet's check does."""
    from packctl.source.parquet import _value_error, _Where
    flat = list(chain.from_iterable(rows))
    try:
        values = np.array(flat, dtype=np.int64)
    except OverflowError:  # beyond int64: outside the range whatever it is
        k = next(k for k, v in enumerate(flat) if not -(1 << 63) <= v < (1 << 63))
        raise _value_error(_Where(path, first), offsets, column, k, flat[k], allow_ignore) from None
    k = first_outside_int32(values, allow_ignore)  # the int32 conversion must be exact: checked always
    if k >= 0:
        raise _value_error(_Where(path, first), offsets, column, k, int(values[k]), allow_ignore)
    return values.astype(np.int32)


JSONL = JsonlKind()
