"""The raw inputs of `packctl tokenize`: which files INPUT names, how many records each holds, and
reading a run of records from any of them as Python dicts.

    chat.jsonl          one JSON object a line (blank lines are not records); also .json lines,
    chat.jsonl.gz/.zst  compressed (streamed; a shard starting deep in the file reads from its start)
    chat.json           a JSON array of objects (read whole)
    train.parquet       a table (the Hugging Face Hub layout, datasets' to_parquet)
    book.txt            each non-empty line one record {"text": line} (--text-unit document: the
                        whole file one record)

A record is named in messages by its file and 0-based row, and for line formats its line:
'data/chat.jsonl row 17 (line 19)'. The global record id of row r of file f is
`record_offsets[f] + r`, files sorted by path, so ids do not depend on how the work is split.

Each file is fingerprinted by size, modification time and the sha256 of its bytes, taken in the
same pass that counts its records; `--resume` refuses a file whose fingerprint changed.

INPUT may name objects of a store (`s3://`, `gs://`, `hf://`; packctl/store.py): a prefix (every
raw input below it), an object or a glob, read through the store's filesystem as a local file is
read (a prefix holding a packctl output's `_manifest.json` is refused as a directory is).
"""
from __future__ import annotations

import glob
import hashlib
import io
import json
import os
import stat
from dataclasses import dataclass, field
from typing import Iterator

from packctl.enums import StrEnum
from packctl.errors import PackctlError
from packctl.urls import is_url, refuse_url

_CHUNK = 1 << 22


class TextUnit(StrEnum):
    """What one record of a `.txt` file is."""

    LINE = "line"
    """Each non-empty line is one record (as `datasets`' text loader reads lines)."""
    DOCUMENT = "document"
    """The whole file is one record."""


_SUFFIXES = {  # name ending -> (kind, compression); the longest ending wins
    ".jsonl": ("jsonl", None), ".json": ("json", None), ".ndjson": ("jsonl", None),
    ".jsonl.gz": ("jsonl", "gzip"), ".json.gz": ("jsonl", "gzip"), ".ndjson.gz": ("jsonl", "gzip"),
    ".jsonl.zst": ("jsonl", "zstd"), ".json.zst": ("jsonl", "zstd"), ".ndjson.zst": ("jsonl", "zstd"),
    ".parquet": ("parquet", None),
    ".txt": ("txt", None), ".txt.gz": ("txt", "gzip"), ".txt.zst": ("txt", "zstd"),
}


def kind_of(path: str) -> tuple[str, str | None] | None:
    """('jsonl'|'json'|'parquet'|'txt', compression) of a raw input name, or None."""
    for suffix in sorted(_SUFFIXES, key=len, reverse=True):
        if path.endswith(suffix):
            return _SUFFIXES[suffix]
    return None


@dataclass(frozen=True)
class RawFile:
    """One raw input: its path, kind, records and fingerprint. `starts[k]` is the byte offset of
    record k * `stride` and the number of lines before it (uncompressed line formats only: a run
    of records is read from there)."""

    path: str
    kind: str
    compression: str | None
    records: int
    size: int
    mtime_ns: int
    sha256: str
    stride: int = 0
    starts: tuple[tuple[int, int], ...] = ()
    columns: tuple[str, ...] = ()

    def fingerprint(self) -> dict:
        return {"path": self.path, "records": self.records, "bytes": self.size, "mtime_ns": self.mtime_ns,
                "sha256": self.sha256}

    def describe(self, row: int, line: int | None = None) -> str:
        where = f"{self.path} row {row}"
        return f"{where} (line {line})" if line is not None else where


@dataclass(frozen=True)
class Record:
    """A record read from a file: its row in the file, the line it starts on (line formats) and
    its fields."""

    row: int
    line: int | None
    fields: dict


# ---------------------------------------------------------------------------------------------
# Which files


def find_inputs(specs: list[str]) -> list[str]:
    """INPUT -> the raw files, sorted by path, each once: a file (any name), a directory (every
    raw input below it, recursively), or a glob (`**` for any number of directories). A file
    reached twice, by two spellings or two links, is refused naming both."""
    found: dict[str, str] = {}
    urls = [spec for spec in specs if is_url(spec)]
    if urls:
        from packctl.store import is_store_url, normalize_url

        for spec in urls:
            if not is_store_url(spec):
                refuse_url(spec, "input")
        if len(urls) < len(specs):
            raise PackctlError(f"{next(s for s in specs if not is_url(s))}: a local INPUT beside the store INPUT "
                               f"{urls[0]}; one run reads local files or objects of a store, not both")
        for spec in urls:
            for url in _expand_objects(normalize_url(spec)):
                if url in found:
                    raise PackctlError(f"{url}: given twice (by INPUT {found[url]} and by INPUT {spec}); list each "
                                       "input object once")
                found[url] = spec
        return sorted(found)
    for spec in specs:
        for path in _expand(os.path.normpath(spec) if spec else spec):
            found.setdefault(path, spec)
    identities: dict[tuple[int, int], str] = {}
    for path in sorted(found):
        st = os.stat(path)
        first = identities.setdefault((st.st_dev, st.st_ino), path)
        if first != path:
            raise PackctlError(f"{path}: the same file as {first} (a link); each input file is read once: leave one of "
                               "them out of INPUT")
    return sorted(found)


def _expand_objects(spec: str) -> list[str]:
    """The raw input objects one store INPUT reaches: a glob's matches, a prefix's raw inputs (a
    packctl output below it refused), or the object it names."""
    from packctl import store

    if any(c in spec.split("://", 1)[1] for c in "*?["):
        found = [o.url for o in store.glob_objects(spec) if kind_of(o.url) is not None]
        if not found:
            raise PackctlError(f"{spec}: the pattern matches no raw input object")
        return found
    below = store.list_objects(spec)
    if not below:
        if store.stat_object(spec) is None:
            raise PackctlError(f"{spec}: no such object, and no object below that prefix; check the URL")
        if kind_of(spec) is None:
            raise PackctlError(f"{spec}: not a raw input packctl tokenize reads (.jsonl, .json, .jsonl.gz, .jsonl.zst, "
                               ".parquet, .txt)")
        return [spec]
    for item in below:
        if item.url.rsplit("/", 1)[-1] == "_manifest.json":
            _refuse_packctl_output(item.url.rsplit("/", 1)[0])
    found = [o.url for o in below if kind_of(o.url) is not None]
    if not found:
        raise PackctlError(f"{spec}: the prefix holds no raw input (*.jsonl, *.json, *.jsonl.gz, *.jsonl.zst, "
                           "*.parquet, *.txt)")
    return found


def _expand(spec: str) -> list[str]:
    if not spec:
        raise PackctlError("'': no such file or directory; name a JSONL, JSON, Parquet or text file, a directory or "
                           "a glob")
    if any(c in spec for c in "*?["):
        paths = sorted(p for p in glob.glob(spec, recursive=True))
        if not paths:
            raise PackctlError(f"{spec}: the pattern matches no file")
        out = []
        for path in paths:
            out += _walk(path) if os.path.isdir(path) else [_regular(path)]
        return out
    try:
        st = os.stat(spec)
    except FileNotFoundError:
        if os.path.islink(spec):
            raise PackctlError(f"{spec}: a symbolic link whose target does not exist; restore its target, or remove "
                               "the link") from None
        raise PackctlError(f"{spec}: no such file or directory") from None
    except OSError as exc:
        raise PackctlError(f"{spec}: cannot be read ({exc.strerror})") from None
    if stat.S_ISDIR(st.st_mode):
        files = _walk(spec)
        if not files:
            raise PackctlError(f"{spec}: the directory holds no raw input (*.jsonl, *.json, *.jsonl.gz, *.jsonl.zst, "
                               "*.parquet, *.txt)")
        return files
    return [_regular(spec)]


def _regular(path: str) -> str:
    try:
        st = os.stat(path)
    except OSError as exc:
        raise PackctlError(f"{path}: cannot be read ({exc.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise PackctlError(f"{path}: not a regular file; name JSONL, JSON, Parquet or text files")
    if kind_of(path) is None:
        raise PackctlError(f"{path}: not a raw input packctl tokenize reads (.jsonl, .json, .jsonl.gz, .jsonl.zst, "
                           ".parquet, .txt); rename it or leave it out of INPUT")
    return path


def _walk(directory: str) -> list[str]:
    """Every raw input below `directory`, links followed, loops refused; a directory that is a
    packctl output (a `_manifest.json` naming a packctl version) is refused, not read."""
    out: list[str] = []
    seen: set[tuple[int, int]] = set()

    def walk(folder: str) -> None:
        st = os.stat(folder)
        if (st.st_dev, st.st_ino) in seen:
            raise PackctlError(f"{folder}: leads back to a directory that holds it (a symbolic link loop); remove "
                               "the link, or name the directories to read")
        seen.add((st.st_dev, st.st_ino))
        _refuse_packctl_output(folder)
        try:
            names = sorted(os.listdir(folder))
        except OSError as exc:
            raise PackctlError(f"{folder}: cannot list the directory ({exc.strerror})") from None
        for name in names:
            path = os.path.join(folder, name)
            if os.path.isdir(path):
                walk(path)
            elif kind_of(name) is not None and os.path.isfile(path):
                out.append(os.path.normpath(path))
        seen.discard((st.st_dev, st.st_ino))

    walk(directory)
    return out


def _refuse_packctl_output(folder: str) -> None:
    path = f"{folder}/_manifest.json" if is_url(folder) else os.path.join(folder, "_manifest.json")
    try:
        with _open_bytes(path) as fh:
            manifest = json.loads(fh.read())
    except (OSError, ValueError, PackctlError):
        return
    if isinstance(manifest, dict) and "packctl_version" in manifest:
        raise PackctlError(f"{folder}: a packctl output (it holds _manifest.json); packctl outputs are never read as "
                           "raw input: narrow INPUT to leave it out, or move it")


# ---------------------------------------------------------------------------------------------
# Counting and fingerprinting


def index_file(path: str, *, stride: int, text_unit: TextUnit = TextUnit.LINE) -> RawFile:
    """Count the records of one raw file and fingerprint it, in one pass over its bytes.
    `stride`: for uncompressed line formats, the byte offset of every `stride`-th record is kept,
    so that a run of records starting there is read without the lines before it."""
    kind, compression = kind_of(path) or ("jsonl", None)
    try:
        st = _stat(path)
        if kind == "parquet":
            return _index_parquet(path, st)
        digest = hashlib.sha256()
        if kind == "json" and _starts_with_bracket(path):
            with _open_bytes(path) as fh:
                data = fh.read()
            digest.update(data)
            rows = _json_array(path, data)
            columns = tuple(rows[0]) if rows and isinstance(rows[0], dict) else ()
            return RawFile(path, "json-array", None, len(rows), st.st_size, st.st_mtime_ns, digest.hexdigest(),
                           columns=columns)
        if kind == "txt" and text_unit is TextUnit.DOCUMENT:
            with _hashing_stream(path, compression, digest) as stream:
                while stream.read(_CHUNK):
                    pass
            return RawFile(path, "txt-document", compression, 1, st.st_size, st.st_mtime_ns, digest.hexdigest(),
                           columns=("text",))
        records, starts, first, lines = 0, [], None, 0
        with _hashing_stream(path, compression, digest) as stream:
            offset = 0
            for line in stream:
                if line.strip():
                    if stride and records % stride == 0:
                        starts.append((offset, lines))
                    if first is None:
                        first = line
                    records += 1
                offset += len(line)
                lines += 1
        columns = ("text",) if kind == "txt" else _columns_of(path, first)
        line_kind = "txt" if kind == "txt" else "jsonl"
        return RawFile(path, line_kind, compression, records, st.st_size, st.st_mtime_ns, digest.hexdigest(),
                       stride=stride if compression is None else 0,
                       starts=tuple(starts) if compression is None else (), columns=columns)
    except OSError as exc:
        raise PackctlError(f"{path}: cannot be read ({exc.strerror or exc}); the file may be truncated or corrupt"
                           ) from None


class _HashingReader(io.RawIOBase):
    """The bytes of a file as read, fed to a digest on the way (the compressed bytes of a
    compressed file), then decompressed by the layer above."""

    def __init__(self, fh, digest):
        self._fh, self._digest = fh, digest

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        n = self._fh.readinto(buffer)
        if n:
            self._digest.update(memoryview(buffer)[:n])
        return n

    def close(self) -> None:
        self._fh.close()
        super().close()


def _hashing_stream(path: str, compression: str | None, digest):
    raw = io.BufferedReader(_HashingReader(_open_bytes(path, buffering=0), digest), _CHUNK)
    if compression is None:
        return raw
    import pyarrow as pa

    try:
        return io.BufferedReader(pa.CompressedInputStream(pa.PythonFile(raw, mode="r"), compression), _CHUNK)
    except (pa.ArrowException, OSError) as exc:
        raise PackctlError(f"{path}: cannot be decompressed as {compression} ({exc})") from None


def _open_lines(path: str, compression: str | None):
    if compression is None:
        return _open_bytes(path, buffering=_CHUNK)
    import pyarrow as pa

    source = _open_bytes(path, buffering=0) if is_url(path) else path
    return io.BufferedReader(pa.input_stream(source, compression=compression), _CHUNK)


@dataclass(frozen=True)
class _Stat:
    """What a raw file's fingerprint takes of its stat."""

    st_size: int
    st_mtime_ns: int


def _stat(path: str):
    """The file's stat, or an object's size and last-modified time."""
    if not is_url(path):
        return os.stat(path)
    from packctl.store import stat_object

    found = stat_object(path)
    if found is None:
        raise PackctlError(f"{path}: no such object; it was removed during the run: run again")
    return _Stat(found.size, found.mtime_ns)


def _open_bytes(path: str, buffering: int = -1):
    """A binary file over a local path or a store's object (ranged reads, seekable)."""
    if not is_url(path):
        return open(path, "rb", buffering=buffering)
    from packctl.store import open_reader

    handle, _ = open_reader(path)
    return handle if buffering == 0 else io.BufferedReader(_NativeRaw(handle), _CHUNK)


class _NativeRaw(io.RawIOBase):
    """A pyarrow file as a raw Python stream (what io.BufferedReader reads)."""

    def __init__(self, handle):
        self._handle = handle

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        return self._handle.readinto(buffer)

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._handle.seek(offset, whence)

    def tell(self) -> int:
        return self._handle.tell()

    def close(self) -> None:
        self._handle.close()
        super().close()


def _starts_with_bracket(path: str) -> bool:
    with _open_bytes(path) as fh:
        head = fh.read(4096).lstrip()
    return head.startswith(b"[")


def _json_array(path: str, data: bytes) -> list:
    try:
        rows = json.loads(data)
    except ValueError as exc:
        raise PackctlError(f"{path}: not valid JSON ({exc}); fix the file, or write one JSON object a line (.jsonl)"
                           ) from None
    if not isinstance(rows, list):
        raise PackctlError(f"{path}: a JSON file must hold an array of records or one record a line")
    return rows


def _columns_of(path: str, first: bytes | None) -> tuple[str, ...]:
    if first is None:
        return ()
    try:
        record = json.loads(first)
    except ValueError:
        return ()  # reported with its row when read
    return tuple(record) if isinstance(record, dict) else ()


def _index_parquet(path: str, st: os.stat_result) -> RawFile:
    import pyarrow as pa
    import pyarrow.parquet as pq

    digest = hashlib.sha256()
    with _open_bytes(path) as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    try:
        pf = pq.ParquetFile(_open_bytes(path, buffering=0) if is_url(path) else path)
    except (pa.ArrowException, OSError) as exc:
        raise PackctlError(f"{path}: not a readable Parquet file ({exc})") from None
    return RawFile(path, "parquet", None, pf.metadata.num_rows, st.st_size, st.st_mtime_ns, digest.hexdigest(),
                   columns=tuple(pf.schema_arrow.names))


# ---------------------------------------------------------------------------------------------
# Reading records


def read_records(file: RawFile, first: int, count: int) -> list[Record]:
    """Records [first, first + count) of `file`, in order. A line that is not a JSON object is
    refused naming its file, row and line."""
    if count <= 0:
        return []
    try:
        if file.kind == "parquet":
            return _parquet_records(file, first, count)
        if file.kind == "json-array":
            with _open_bytes(file.path) as fh:
                rows = _json_array(file.path, fh.read())
            return [Record(first + k, None, _as_record(file, first + k, None, row))
                    for k, row in enumerate(rows[first:first + count])]
        if file.kind == "txt-document":
            with _open_lines(file.path, file.compression) as fh:
                text = fh.read().decode("utf-8")
            return [Record(0, None, {"text": text})]
        return list(_line_records(file, first, count))
    except UnicodeDecodeError as exc:
        raise PackctlError(f"{file.path}: not UTF-8 text ({exc.reason} at byte {exc.start} of a line)") from None
    except OSError as exc:
        raise PackctlError(f"{file.path}: cannot be read ({exc.strerror or exc}); the file may be truncated or "
                           "corrupt") from None


def _line_records(file: RawFile, first: int, count: int) -> Iterator[Record]:
    row, line_no = 0, 0
    with _open_lines(file.path, file.compression) as fh:
        if file.stride and file.starts and first >= file.stride:
            k = min(first // file.stride, len(file.starts) - 1)
            offset, line_no = file.starts[k]
            fh.seek(offset)
            row = k * file.stride
        taken = 0
        for raw in fh:
            line_no += 1
            if not raw.strip():
                continue
            if row >= first:
                text = raw.decode("utf-8")
                if file.kind == "txt":
                    fields = {"text": text.rstrip("\r\n")}
                else:
                    try:
                        value = json.loads(text)
                    except ValueError as exc:
                        raise PackctlError(f"{file.describe(row, line_no)}: not a JSON object ({exc}); fix the line or "
                                           "remove it") from None
                    fields = _as_record(file, row, line_no, value)
                yield Record(row, line_no, fields)
                taken += 1
                if taken == count:
                    return
            row += 1
    if taken < count:
        raise PackctlError(f"{file.path}: holds {row} records, fewer than when it was counted ({file.records}); the "
                           "file changed during the run: run again")


def _as_record(file: RawFile, row: int, line: int | None, value) -> dict:
    if not isinstance(value, dict):
        raise PackctlError(f"{file.describe(row, line)}: a JSON {type(value).__name__}, not an object with named "
                           "fields; write one object a line")
    return value


def _parquet_records(file: RawFile, first: int, count: int) -> list[Record]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(_open_bytes(file.path, buffering=0) if is_url(file.path) else file.path)
    groups, start, lo = [], 0, None
    for g in range(pf.metadata.num_row_groups):
        n = pf.metadata.row_group(g).num_rows
        if start + n > first and start < first + count:
            groups.append(g)
            lo = start if lo is None else lo
        start += n
    table = pf.read_row_groups(groups).slice(first - (lo or 0), count)
    return [Record(first + k, None, row) for k, row in enumerate(table.to_pylist())]


@dataclass
class RawIndex:
    """The raw inputs of a run: files in path order and the global record id where each starts."""

    files: list[RawFile]
    record_offsets: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.record_offsets:
            total, offsets = 0, [0]
            for f in self.files:
                total += f.records
                offsets.append(total)
            self.record_offsets = offsets

    @property
    def records(self) -> int:
        return self.record_offsets[-1]
