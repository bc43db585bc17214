"""The one reader of a packed output: the loader (`packctl.torch`), `export`, `stats` and `verify`
read OUT through it, so each of them reads exactly the bytes the manifest vouches for.

    output = open_output("out")                  # the manifest read and validated once
    table = output.read_shard(0, ["input_ids"])  # shard 0, checked, as an Arrow table

`open_output` refuses a manifest that `packctl.contract.manifest.manifest_problems` finds anything
wrong with (a field of the wrong type, a path leading out of OUT, shards out of order, counts that
do not add up) and, with `verify` on (the default), an OUT holding a Parquet file its manifest does
not list. `read_shard` reads a shard's file once into memory and, with `verify` on, hashes those
bytes while pyarrow parses the same bytes, then checks what the manifest says of them:

    sha256     the bytes' sha256 is the manifest's `sha256`
    rows       the Parquet footer's row count is the manifest's `rows`
    tokens     sum(num_tokens) is the manifest's `tokens`
    layout     the shard's `packctl` metadata holds the manifest's format version and layout

A table is returned only when all hold: one file read, no second look at the disk between the
check and the parse. Each failure is one PackctlError line naming the shard and what to do;
`verify=False` (`--no-verify-checksums` on the command line) reads through a memory map without
the sha256, tokens and layout checks, for speed; the paths, the manifest's fields and each shard's
row count (free, and what readers index packs by) are checked either way.

`read_row_group` serves random access (the loader) at the cost of one row group, not a shard. The
first time a process touches shard k, the shard is read and checked whole as `read_shard` checks it
(sha256, rows, tokens, layout) and, from the same bytes in memory, its footer is parsed and each
row group's byte range and sha256 kept (a few hundred bytes a row group). Every later read of a row
group reads only its byte range, compares that range's sha256 with the one kept, and parses those
bytes in memory with the kept footer: what it returns is byte for byte what the manifest vouched
for, and a shard changed after its check is refused at the next row group read from it.

    output.read_row_group(0, 1, ["input_ids"])    # shard 0 checked once per process, row group 1 read

`packctl verify` takes the same findings from `shard_findings` and reports them as rules
(`checksum`, `readable`, `metadata`, `manifest-shard`) instead of raising.
"""
from __future__ import annotations

import bisect
import functools
import hashlib
import itertools
import json
import os
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from packctl.contract.manifest import (ShardEntry, epoch_output, inside, manifest_path, metrics_path,
                                       read_manifest)
from packctl.contract.schema import METADATA_KEY, NUM_TOKENS
from packctl.errors import PackctlError
from packctl.urls import is_url

if TYPE_CHECKING:
    from packctl.contract.mirror import StoreMirror

SKIP_CHECKS = "pass verify=False (--no-verify-checksums) to read it unchecked"
# What a reader's error advises for a shard that fails its checks; a reader that never reads
# unchecked (materialize reading a plan) says its own.
REMEDY = f"pack again, or {SKIP_CHECKS}"


@dataclass(frozen=True)
class Finding:
    """One thing a shard's bytes do not do that its manifest entry says: `rule` is the `packctl
    verify` rule (checksum, readable, metadata, manifest-shard), `message` says what differs."""

    rule: str
    message: str


@dataclass
class CheckedShard:
    """What `check_shard_bytes` found in one shard: its table (None when it does not parse) and the
    findings, the checksum's first."""

    table: pa.Table | None
    findings: list[Finding] = field(default_factory=list)


def read_shard_file(path: Path) -> bytes:
    """The bytes of a shard, read once into memory (not a memory map, whose pages the file system
    could change between the hash and the parse)."""
    with open(path, "rb") as fh:
        return fh.read()


def check_shard_bytes(data: bytes, entry: dict[str, Any] | ShardEntry, manifest: dict[str, Any],
                      columns: Sequence[str] | None = None) -> CheckedShard:
    """Parse `data`, the bytes of one shard, into a table (`columns`, or every column) and check
    them against the shard's manifest `entry` and the manifest's format version and layout.

    The sha256 runs in a thread of its own while pyarrow parses the same bytes (both release the
    GIL), so checking costs about the longer of the two instead of their sum. A field of `entry`
    that is not what the manifest contract says (a sha256 that is not 64 hex digits, rows that are
    no integer) is not compared here: `manifest_problems` reports it.

        >>> checked = check_shard_bytes(data, {"rows": 3, "tokens": 5, "sha256": "00..."}, manifest)  # doctest: +SKIP
        >>> [f.rule for f in checked.findings]                                                       # doctest: +SKIP
        ['checksum']
    """
    if isinstance(entry, ShardEntry):
        entry = asdict(entry)
    digest: dict[str, str] = {}
    expected_sha = entry.get("sha256")
    hasher = None
    if isinstance(expected_sha, str):
        hasher = threading.Thread(target=lambda: digest.update(sha256=hashlib.sha256(data).hexdigest()),
                                  name="packctl-sha256", daemon=True)
        hasher.start()
    checked = CheckedShard(None)
    try:
        checked = _parse_and_compare(data, entry, manifest, columns)
    finally:
        if hasher is not None:
            hasher.join()
    if hasher is not None and digest["sha256"] != expected_sha:
        checked.findings.insert(0, Finding("checksum", "sha256 differs from the manifest's: the shard was changed "
                                           "or damaged after packctl pack wrote it"))
    return checked


def _parse_and_compare(data: bytes, entry: dict[str, Any], manifest: dict[str, Any],
                       columns: Sequence[str] | None) -> CheckedShard:
    found: list[Finding] = []
    try:
        parquet = pq.ParquetFile(pa.BufferReader(data))
    except (pa.ArrowException, OSError, ValueError) as exc:
        return CheckedShard(None, [Finding("readable", f"not a readable Parquet file ({_short(exc)})")])
    found += metadata_findings(parquet.schema_arrow.metadata, manifest)
    rows = entry.get("rows")
    if isinstance(rows, int) and parquet.metadata.num_rows != rows:
        found.append(Finding("manifest-shard", f"{parquet.metadata.num_rows} packs, the manifest says {rows}"))
    names = parquet.schema_arrow.names
    wanted = list(names) if columns is None else list(columns)
    missing = [c for c in wanted if c not in names]
    if missing:  # pyarrow would leave them out without a word
        found.append(Finding("schema", f"no column {', '.join(map(repr, missing))}; not a packed shard of this output"))
        return CheckedShard(None, found)
    tokens_expected = entry.get("tokens")
    count_tokens = isinstance(tokens_expected, int) and NUM_TOKENS in names
    read = wanted + ([NUM_TOKENS] if count_tokens and NUM_TOKENS not in wanted else [])
    try:
        table = parquet.read(columns=read)
    except (pa.ArrowException, OSError, ValueError) as exc:
        found.append(Finding("readable", f"cannot read the packs ({_short(exc)}); the file may be truncated or "
                             "corrupt"))
        return CheckedShard(None, found)
    if count_tokens:
        try:
            tokens = int(table.column(NUM_TOKENS).to_numpy().astype(np.int64).sum())
        except (pa.ArrowException, ValueError, TypeError) as exc:  # num_tokens of another type: rule `schema`
            tokens = f"unreadable ({_short(exc)})"
        if tokens != tokens_expected:
            found.append(Finding("manifest-shard", f"{tokens} tokens (sum of num_tokens), the manifest says "
                                 f"{tokens_expected}"))
        if NUM_TOKENS not in wanted:
            table = table.drop_columns([NUM_TOKENS])
    return CheckedShard(table, found)


def metadata_findings(metadata: dict[bytes, bytes] | None, manifest: dict[str, Any]) -> list[Finding]:
    """Rule `metadata`: the shard's `packctl` Parquet metadata holds the manifest's format version
    and layout (a shard of another packing, or of a damaged file, does not)."""
    raw = (metadata or {}).get(METADATA_KEY)
    if raw is None:
        return [Finding("metadata", "no 'packctl' key in the Parquet metadata")]
    try:
        meta = json.loads(raw)
    except ValueError:
        return [Finding("metadata", "the 'packctl' Parquet metadata is not JSON")]
    expected = manifest.get("format_version")
    if not isinstance(meta, dict) or meta.get("format_version") != expected:
        said = meta.get("format_version") if isinstance(meta, dict) else meta
        return [Finding("metadata", f"the 'packctl' metadata says format_version {said!r}, the manifest {expected}")]
    if meta.get("layout") != manifest.get("layout"):
        return [Finding("metadata", "the layout in the 'packctl' metadata differs from the manifest's: the shard "
                        "comes from another packing")]
    return []


def unlisted_parquet(out: Path, listed: Sequence[str]) -> list[str]:
    """Parquet files under OUT (relative, `/`-separated) that the manifest does not list: readers of
    the directory (pyarrow, `datasets`) would take them as packs."""
    names = set(listed)
    return [rel for rel in (p.relative_to(out).as_posix() for p in sorted(out.rglob("*.parquet"))) if rel not in names]


@dataclass(frozen=True)
class RowGroupIndex:
    """Where the row groups of a checked shard lie, taken from its bytes when they were checked
    against the manifest (`PackedOutput.row_group_index`).

    Attributes:
        metadata: the shard's Parquet footer, parsed from the checked bytes.
        starts, ends: each row group's byte range in the file: [start, end) holds its column chunks.
        sha256: each row group's range's sha256 (hex), from the checked bytes.
        rows: each row group's number of packs.

        shard of 300 packs in row groups of 128:  rows [128, 128, 44]   starts [4, 1502215, ...]
    """

    metadata: pq.FileMetaData
    starts: tuple[int, ...]
    ends: tuple[int, ...]
    sha256: tuple[str, ...]
    rows: tuple[int, ...]

    def locate(self, row: int) -> tuple[int, int]:
        """(row group, row inside it) of the shard's row `row`: rows (128, 128, 44), row 130 -> (1, 2)."""
        group = bisect.bisect_right(list(itertools.accumulate(self.rows)), row)
        return group, row - sum(self.rows[:group])

    @classmethod
    def of(cls, data: bytes) -> "RowGroupIndex":
        """The index of a shard from its bytes (which the caller checked)."""
        metadata = pq.ParquetFile(pa.BufferReader(data)).metadata
        starts, ends, rows = [], [], []
        for g in range(metadata.num_row_groups):
            group = metadata.row_group(g)
            chunks = [group.column(c) for c in range(group.num_columns)]
            firsts = [c.data_page_offset if c.dictionary_page_offset is None
                      else min(c.dictionary_page_offset, c.data_page_offset) for c in chunks]
            starts.append(min(firsts, default=0))
            ends.append(max((f + c.total_compressed_size for f, c in zip(firsts, chunks)), default=0))
            rows.append(group.num_rows)
        view = memoryview(data)
        digests = tuple(hashlib.sha256(view[a:b]).hexdigest() for a, b in zip(starts, ends))
        return cls(metadata, tuple(starts), tuple(ends), digests, tuple(rows))


def _checked_range(start: int, data: bytes) -> pa.BufferReader:
    """A file of `start + len(data)` bytes whose only bytes are `data`, the checked byte range of
    one row group, at its place (zeros before it, which the operating system leaves unallocated):
    pyarrow parses the row group from it with the shard's kept footer and has nothing else to read."""
    view = np.zeros(start + len(data), dtype=np.uint8)
    view[start:] = np.frombuffer(data, dtype=np.uint8)
    return pa.BufferReader(pa.py_buffer(view))


def _user_named(method):
    """A reader method whose one-line errors name an output on a store by its URL, not by the
    local mirror the shard was read from."""
    @functools.wraps(method)
    def named(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except PackctlError as exc:
            if self.mirror is None:
                raise
            raise _named(exc, self.mirror) from None
    return named


@dataclass
class PackedOutput:
    """A packed output whose manifest was read and validated (`open_output`).

    Attributes:
        root: OUT (an epoch's folder for `pack --epochs`), as given.
        manifest_file: its `_manifest.json` (`manifest.json` in format version 1).
        manifest: the manifest, every field a reader uses checked.
        shards: the manifest's shard entries, in order.
        verify: whether `read_shard` and `read_row_group` check the bytes they return (sha256,
            rows, tokens, layout).
        remedy: what the error of a shard that fails its checks advises.
    """

    root: Path
    manifest_file: Path
    manifest: dict[str, Any]
    shards: list[ShardEntry]
    verify: bool = True
    remedy: str = REMEDY
    # shard -> its row groups, from the bytes checked in this process (never pickled: a process
    # that receives this output checks each shard again before reading from it)
    _row_groups: dict[int, RowGroupIndex] = field(default_factory=dict, repr=False, compare=False)
    # called with k after `read_shard(k)` returned (a command's progress: export counts shards)
    on_shard_read: Callable[[int], None] | None = field(default=None, repr=False, compare=False)
    # an output on an object store: `root` is its local mirror, each shard fetched at first use
    mirror: StoreMirror | None = field(default=None, repr=False, compare=False)

    @property
    def location(self) -> str:
        """OUT as the user named it: the directory, or the URL of an output on a store."""
        return self.mirror.url if self.mirror is not None else str(self.root)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_row_groups"], state["on_shard_read"] = {}, None
        return state

    @property
    def layout(self) -> dict[str, Any]:
        return self.manifest["layout"]

    @property
    def format_version(self) -> int:
        return self.manifest["format_version"]

    @property
    def num_packs(self) -> int:
        return sum(s.rows for s in self.shards)

    def shard_path(self, k: int) -> Path:
        """Where shard k is: OUT / its manifest path (checked to stay inside OUT when read)."""
        return self.root / self.shards[k].path

    def local_file(self, k: int) -> Path:
        """The local file of shard k, checked to exist inside OUT (fetched into the mirror first for
        an output on a store); unchecked against the manifest: `read_shard` checks."""
        return self._existing(k)

    def _existing(self, k: int) -> Path:
        if self.mirror is not None:
            return self.mirror.fetch(self.shards[k].path, self.shards[k].sha256)
        path = self.shard_path(k)
        # checked again at each read: a link made after open_output must not lead the reader out
        if not inside(os.path.realpath(self.root), path):
            raise PackctlError(f"{path}: leads out of {self.root} through a symbolic link; packctl reads only the "
                               "files inside OUT that pack wrote: pack again")
        if not path.is_file():
            raise PackctlError(f"{path}: listed in {self.manifest_file} but missing; the output was moved or "
                               "damaged: pack again")
        return path

    @_user_named
    def read_shard(self, k: int, columns: Sequence[str] | None = None) -> pa.Table:
        """Shard k as an Arrow table (`columns`, or every column), checked against the manifest when
        `verify` is on; one PackctlError line naming the shard otherwise.

            >>> output.read_shard(0, ["num_tokens"]).num_rows   # doctest: +SKIP
            286
        """
        path = self._existing(k)
        if not self.verify:
            table = self._read_unchecked(path, columns)
            if table.num_rows != self.shards[k].rows:  # free, and what every reader indexes packs by
                raise PackctlError(f"{path}: {table.num_rows} packs, {self.manifest_file.name} says "
                                   f"{self.shards[k].rows}; pack again")
            if self.on_shard_read is not None:
                self.on_shard_read(k)
            return table
        data = self._read_bytes(path)
        checked = check_shard_bytes(data, self.shards[k], self.manifest, columns)
        if checked.findings:
            raise PackctlError(shard_error(path, checked.findings[0], self.manifest_file, self.remedy))
        if self.on_shard_read is not None:
            self.on_shard_read(k)
        return checked.table

    @_user_named
    def row_group_index(self, k: int) -> RowGroupIndex:
        """The row groups of shard k. With `verify` on, the first call in a process reads the shard
        whole and checks it as `read_shard` does (one PackctlError line naming it otherwise), then
        keeps each row group's range and sha256 from those bytes; later calls cost nothing."""
        index = self._row_groups.get(k)
        if index is not None:
            return index
        path = self._existing(k)
        if self.verify:
            data = self._read_bytes(path)
            checked = check_shard_bytes(data, self.shards[k], self.manifest, columns=[])
            if checked.findings:
                raise PackctlError(shard_error(path, checked.findings[0], self.manifest_file, self.remedy))
            index = RowGroupIndex.of(data)
        else:
            try:
                metadata = pq.ParquetFile(path, memory_map=True).metadata
            except (pa.ArrowException, OSError) as exc:
                raise PackctlError(f"{path}: not a readable Parquet file ({_short(exc)}); the file may be truncated "
                                   "or corrupt: pack again") from None
            if metadata.num_rows != self.shards[k].rows:
                raise PackctlError(f"{path}: {metadata.num_rows} packs, {self.manifest_file.name} says "
                                   f"{self.shards[k].rows}; pack again")
            rows = tuple(metadata.row_group(g).num_rows for g in range(metadata.num_row_groups))
            index = RowGroupIndex(metadata, (), (), (), rows)
        self._row_groups[k] = index
        return index

    @_user_named
    def read_row_group(self, k: int, group: int, columns: Sequence[str]) -> pa.Table:
        """Row group `group` of shard k as an Arrow table of `columns`, reading only its bytes: with
        `verify` on, its byte range is read once into memory, its sha256 compared with the one kept
        from the shard's check (`row_group_index`), and those bytes parsed; a range that differs
        raises PackctlError naming the shard. Without `verify`, read through a memory map.

            >>> output.row_group_index(0).rows                          # doctest: +SKIP
            (128, 128, 30)
            >>> output.read_row_group(0, 2, ["num_tokens"]).num_rows    # doctest: +SKIP
            30
        """
        index = self.row_group_index(k)
        path = self._existing(k)
        names = index.metadata.schema.to_arrow_schema().names
        missing = [c for c in columns if c not in names]
        if missing:
            raise PackctlError(f"{path}: no column {', '.join(map(repr, missing))}; not a packed shard of this "
                               "output: pack again")
        if not self.verify:
            try:
                return pq.ParquetFile(path, memory_map=True).read_row_group(group, columns=list(columns))
            except (pa.ArrowException, OSError) as exc:
                raise PackctlError(f"{path}: row group {group} is not readable ({_short(exc)}); the file may be "
                                   "truncated or corrupt: pack again") from None
        start, end = index.starts[group], index.ends[group]
        try:
            with open(path, "rb") as fh:
                fh.seek(start)
                data = fh.read(end - start)
        except OSError as exc:
            raise PackctlError(f"{path}: cannot be read ({exc.strerror or exc}); check its permissions, or pack "
                               "again") from None
        if hashlib.sha256(data).hexdigest() != index.sha256[group]:
            raise PackctlError(shard_error(path, Finding("checksum", f"row group {group} differs from the bytes "
                                                         "checked against the manifest's sha256: the shard was "
                                                         "changed after packctl checked it"), self.manifest_file))
        try:
            parquet = pq.ParquetFile(_checked_range(start, data), metadata=index.metadata)
            return parquet.read_row_group(group, columns=list(columns))
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise PackctlError(f"{path}: row group {group} is not readable ({_short(exc)}); pack again (packctl "
                               "verify OUT tells what else is wrong)") from None

    def _read_bytes(self, path: Path) -> bytes:
        try:
            return read_shard_file(path)
        except OSError as exc:
            raise PackctlError(f"{path}: cannot be read ({exc.strerror or exc}); check its permissions, or pack "
                               "again") from None

    @_user_named
    def read_unchecked(self, k: int, columns: Sequence[str]) -> pa.Table:
        """Columns of shard k read without any check, whatever `verify` says: for what a reader
        plans with before reading the data (PackedDataset's balanced order), never for what it
        hands out."""
        return self._read_unchecked(self._existing(k), columns)

    @_user_named
    def column_names(self, k: int) -> list[str]:
        """The columns of shard k, from its footer (unchecked: what to ask `read_shard` for)."""
        path = self._existing(k)
        try:
            return list(pq.read_schema(path, memory_map=True).names)
        except (pa.ArrowException, OSError) as exc:
            raise PackctlError(f"{path}: not a readable Parquet file ({_short(exc)}); pack again") from None

    def _read_unchecked(self, path: Path, columns: Sequence[str] | None) -> pa.Table:
        try:
            parquet = pq.ParquetFile(path, memory_map=True)
            missing = [c for c in columns or () if c not in parquet.schema_arrow.names]
            if missing:
                raise PackctlError(f"{path}: no column {', '.join(map(repr, missing))}; not a packed shard of "
                                   f"this output: pack again")
            return parquet.read(columns=list(columns) if columns is not None else None)
        except (pa.ArrowException, OSError) as exc:
            raise PackctlError(f"{path}: not a readable Parquet file ({_short(exc)}); the file may be truncated or "
                               "corrupt: pack again") from None

    def recorded_metrics(self) -> dict[str, Any] | None:
        """The packing report (`_metrics.json`) when it is a readable JSON object; None otherwise
        (its figures are then recomputed from the shards, or left out)."""
        try:
            report = json.loads(metrics_path(self.root).read_bytes())
        except (OSError, ValueError):
            return None
        return report if isinstance(report, dict) else None


def shard_error(path: Path, finding: Finding, manifest_file: Path, remedy: str = REMEDY) -> str:
    """The one-line error of a reader for the first finding on a shard."""
    if finding.rule in ("readable", "schema"):  # unreadable unchecked too
        return f"{path}: {finding.message}; pack again (packctl verify OUT tells what else is wrong)"
    return f"{path}: {finding.message} (checked against {manifest_file.name}); {remedy}"


def open_output(path: str | Path, epoch: int | None = None, *, verify: bool = True,
                remedy: str = REMEDY) -> PackedOutput:
    """The packed output at `path` (OUT or its manifest; with `epoch`, that epoch of the OUT of
    `pack --epochs K`), its manifest read and validated once: one PackctlError line (exit 2) naming
    the manifest and the field when a reader cannot trust it. With `verify` (the default), OUT must
    hold no Parquet file the manifest does not list, and `read_shard` checks every shard it reads;
    `remedy` is what their errors advise.

        >>> output = open_output("out")                      # doctest: +SKIP
        >>> len(output.shards), output.layout["capacity"]   # doctest: +SKIP
        (3, 4096)
    """
    mirror = None
    if is_url(path):
        from packctl.contract.mirror import mirror_output

        if epoch is not None:
            raise PackctlError(f"{path}: epoch={epoch} names an output of packctl pack --epochs, which packctl does "
                               "not read from an object store; copy it locally and read the copy")
        mirror = mirror_output(str(path))
        path = mirror.root
    try:
        root, manifest = read_manifest(path if epoch is None else epoch_output(path, epoch))
    except PackctlError as exc:
        raise _named(exc, mirror) from None
    shards = [ShardEntry(path=s["path"], rows=s["rows"], tokens=s["tokens"], sha256=s["sha256"])
              for s in manifest["shards"]]
    output = PackedOutput(root=root, manifest_file=manifest_path(root), manifest=manifest, shards=shards,
                          verify=verify, remedy=remedy, mirror=mirror)
    if verify and mirror is None:  # a store's prefix holds other runs' objects; only the listed are read
        stray = unlisted_parquet(root, [s.path for s in shards])
        if stray:
            raise PackctlError(f"{root / stray[0]}: a Parquet file that {output.manifest_file.name} does not list "
                               f"({len(stray)} such file(s)): a manifest entry was dropped, or another output's "
                               f"shard copied in; {remedy}")
    return output


def _named(exc: PackctlError, mirror: StoreMirror | None) -> PackctlError:
    """`exc` with a mirror's local folder spelled as the URL it mirrors."""
    if mirror is None:
        return exc
    return PackctlError(mirror.local_name(str(exc)), everywhere=exc.everywhere)


def _short(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
