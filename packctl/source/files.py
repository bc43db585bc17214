"""An input file, known again: its fingerprint (size, modification time, a digest of its Parquet
footer) taken when the run first reads it, and every later open checked against it, so a file
rewritten or appended to under a run stops the run, naming it.

    fingerprint, footer, st = read_fingerprint("data/a.parquet")   # the first read (source/resolve.py)
    open_parquet("data/a.parquet", fingerprint)                      # every later open: the same file, or
        -> error: data/a.parquet: changed while packctl was reading it (its size went from 706 to 1412 ...)
"""
from __future__ import annotations

import hashlib
import os
import stat
import struct
from dataclasses import dataclass
from typing import Callable

import pyarrow as pa
import pyarrow.parquet as pq

from packctl.errors import PackctlError
from packctl.urls import is_url  # packctl.store is loaded for URLs only: local runs never pay for it

_MAGIC = b"PAR1"


@dataclass(frozen=True)
class FileFingerprint:
    """What an input file was when the run first read it, to know it again: its size, modification
    time and a digest of its Parquet footer (schema, row groups, column chunk offsets and sizes,
    statistics). A file rewritten in place changes its footer even where size and mtime are kept.

        FileFingerprint(size=706, mtime_ns=1732526040123456789, footer="5f0c...")   # 32 hex digits
    """

    size: int
    mtime_ns: int
    footer: str



def _footer_bytes(path: str, size: int, read_at: Callable[[int, int], bytes]) -> bytes:
    """The Parquet footer of a file of `size` bytes, with its length and magic (the last
    `footer length + 8` bytes), read with `read_at(nbytes, offset)`."""
    if size < 12:
        raise PackctlError(f"{path}: not a readable Parquet file ({size} bytes, too small for Parquet)")
    tail = read_at(8, size - 8)
    if len(tail) != 8 or tail[4:] != _MAGIC:
        raise PackctlError(f"{path}: not a readable Parquet file (Parquet magic bytes not found in footer)")
    length = struct.unpack("<I", tail[:4])[0]
    if length + 12 > size:
        raise PackctlError(f"{path}: not a readable Parquet file (the footer claims {length} bytes of a "
                           f"{size}-byte file); the file may be truncated or corrupt")
    footer = read_at(length + 8, size - 8 - length)
    if len(footer) != length + 8:
        raise PackctlError(f"{path}: not a readable Parquet file (short read of the footer)")
    return footer


def _footer_digest(footer: bytes) -> str:
    return hashlib.blake2b(footer, digest_size=16).hexdigest()


def _parse_footer(path: str, footer: bytes) -> pq.FileMetaData:
    try:
        return pq.read_metadata(pa.BufferReader(footer))
    except (pa.ArrowException, OSError) as exc:
        raise PackctlError(f"{path}: not a readable Parquet file ({_short(exc)})") from None


def read_fingerprint(path: str, listed=None) -> tuple[FileFingerprint, pq.FileMetaData, os.stat_result | None]:
    """The first read of an input file (packctl.source.resolve): its fingerprint, its parsed
    footer and its stat (device and inode: the file's identity), all from one open descriptor.
    An object of a store (`s3://...`) has no stat (None): its size and last-modified time come
    from the store (`listed`: the `StoreObject` a listing of the store gave, which saves a HEAD),
    its footer from one ranged read.

    Errors name the file: it cannot be opened (permissions), is not a regular file, or is not
    Parquet. `O_NONBLOCK` keeps a FIFO that replaced the file from blocking the run."""
    if is_url(path):  # resolve refuses the URLs of stores packctl does not read
        from packctl.store import open_object, open_reader

        handle, found = (None, None)
        if listed is not None:
            handle, size = open_reader(path)
            found = listed if size == listed.size else None  # rewritten since the listing: ask again
        if found is None:
            handle, found = open_object(path)
        footer = _store_read(path, lambda: _footer_bytes(path, found.size, _tail_reader(handle, found.size)))
        fingerprint = FileFingerprint(size=found.size, mtime_ns=found.mtime_ns, footer=_footer_digest(footer))
        metadata = _parse_footer(path, footer)
        _FIRST_FOOTERS[(path, fingerprint)] = metadata
        return fingerprint, metadata, None
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise PackctlError(f"{path}: cannot be read ({exc.strerror or _short(exc)}); make it readable, or leave it "
                           "out of INPUT") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise PackctlError(f"{path}: not a regular file ({file_kind(st)}); packctl reads Parquet files only: "
                               "leave it out of INPUT")

        def read_at(n: int, offset: int) -> bytes:
            return os.pread(fd, n, offset)

        try:
            footer = _footer_bytes(path, st.st_size, read_at)
        except OSError as exc:
            raise PackctlError(f"{path}: cannot be read ({exc.strerror or _short(exc)}); make it readable, or leave "
                               "it out of INPUT") from None
    finally:
        os.close(fd)
    fingerprint = FileFingerprint(size=st.st_size, mtime_ns=st.st_mtime_ns, footer=_footer_digest(footer))
    return fingerprint, _parse_footer(path, footer), st


# The footer the first read of a store's object parsed, by URL and fingerprint, until the index of
# the run's input takes it (`take_first_footer`): indexing needs only the object's row groups and
# schema, which it would otherwise fetch again a moment later (a HEAD and a ranged GET an object).
# Each resolve of store INPUT starts it afresh (`forget_first_footers`), so a process that
# resolves without indexing (a what-if) holds one run's footers at most.
_FIRST_FOOTERS: dict[tuple[str, FileFingerprint], pq.FileMetaData] = {}


def take_first_footer(url: str, fingerprint: FileFingerprint) -> pq.FileMetaData | None:
    """The footer `read_fingerprint` parsed for the object at `url` with this fingerprint, once;
    None when it has none (a local file, or taken already)."""
    return _FIRST_FOOTERS.pop((url, fingerprint), None)


def forget_first_footers() -> None:
    _FIRST_FOOTERS.clear()


def file_kind(st: os.stat_result) -> str:
    """What a non-regular file is, in words: 'a FIFO', 'a socket', 'a directory'..."""
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(st.st_mode):
            return name
    return "not a regular file"


def changed_error(path: str, what: str) -> PackctlError:
    """The error of an input that is not what the run first read: `what` says how it differs."""
    return PackctlError(f"{path}: changed while packctl was reading it ({what}); rerun when the input is stable")


def stat_unchanged(path: str, expected: "FileFingerprint | None") -> os.stat_result:
    """The file's stat; with `expected`, refused in one line when its size or modification time
    differs from the fingerprint's, or it is gone (a file of one piece: JSONL, raw records)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        if expected is not None:
            raise changed_error(path, "it was removed after the start of the run") from None
        raise PackctlError(f"{path}: no such file") from None
    if expected is not None and (st.st_size, st.st_mtime_ns) != (expected.size, expected.mtime_ns):
        what = (f"its size went from {expected.size} to {st.st_size} bytes" if st.st_size != expected.size
                else "its modification time changed")
        raise changed_error(path, f"{what} since the start of the run")
    return st


def open_parquet(path: str, expected: FileFingerprint | None = None) -> pq.ParquetFile:
    """Open a Parquet file; with `expected` (the fingerprint taken when the run resolved it),
    first check that the file is still that file: same size, same footer (the footer is read
    to open the file anyway, so the check costs a digest of it). Else exit 2 naming the file.

        open_parquet("a.parquet", fp)  ->  error: a.parquet: changed while packctl was reading it
                                           (its size went from 706 to 1412 bytes since the start of the run); ...
    """
    if is_url(path):
        handle, size = _open_object(path, expected)
    else:
        try:
            handle = pa.OSFile(path)
        except (pa.ArrowException, OSError) as exc:
            if expected is not None and isinstance(exc, FileNotFoundError):
                raise changed_error(path, "it was removed after the start of the run") from None
            raise PackctlError(f"{path}: not a readable Parquet file ({_short(exc)})") from None
        try:
            size = handle.size()
        except (pa.ArrowException, OSError) as exc:
            raise PackctlError(f"{path}: not a readable Parquet file ({_short(exc)})") from None
    if expected is not None and size != expected.size:
        raise changed_error(path, f"its size went from {expected.size} to {size} bytes since the start of the run")
    try:
        footer = _footer_bytes(path, size, _tail_reader(handle, size) if is_url(path) else handle.read_at)
    except (pa.ArrowException, OSError) as exc:
        raise PackctlError(f"{path}: not a readable Parquet file ({_short(exc)})") from None
    except PackctlError:
        if expected is not None:  # it was Parquet at the start of the run
            raise changed_error(path, "its Parquet footer is no longer readable") from None
        raise
    if expected is not None and _footer_digest(footer) != expected.footer:
        raise changed_error(path, "its Parquet footer differs from the one read at the start of the run")
    try:
        # an object's column chunks are fetched by coalesced ranged GETs (pre_buffer), not one a chunk
        return pq.ParquetFile(handle, metadata=_parse_footer(path, footer), pre_buffer=is_url(path))
    except (pa.ArrowException, OSError) as exc:
        raise PackctlError(f"{path}: not a readable Parquet file ({_short(exc)})") from None


def _open_object(url: str, expected: FileFingerprint | None):
    """(a ranged reader of the object at `url`, its size): one HEAD, for its size. With `expected`
    the object must still be the one the run first read, told as a local file is told, by its size
    and its footer (`open_parquet`): an object rewritten with other data has another footer (its
    row groups' offsets, sizes and statistics), whatever its last-modified time says."""
    from packctl.store import open_reader

    try:
        return open_reader(url)
    except PackctlError:
        if expected is not None:
            raise changed_error(url, "it can no longer be read from the store since the start of the run") from None
        raise


_TAIL = 64 * 1024  # one ranged GET of an object's last 64 KiB holds the footer of most Parquet files


def _tail_reader(handle, size: int) -> Callable[[int, int], bytes]:
    """`read_at(nbytes, offset)` over an object that fetches its last 64 KiB once and serves reads
    inside them from memory: a footer in one request instead of two (length, then footer)."""
    start = max(0, size - _TAIL)
    tail = handle.read_at(size - start, start)

    def read_at(n: int, offset: int) -> bytes:
        if offset >= start and offset + n <= size:
            return tail[offset - start:offset - start + n]
        return handle.read_at(n, offset)

    return read_at


def _store_read(url: str, read):
    """`read()` over an object, its transport errors as one line naming the URL."""
    from packctl.store import store_error

    try:
        return read()
    except (pa.ArrowException, OSError) as exc:
        raise store_error(url, exc, "read") from None


def _short(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
