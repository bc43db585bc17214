"""Write packed shards and the output directory, atomically and resumably.

Everything goes into the sibling directory `.OUT.packctl-partial`, then it is renamed to OUT:

    .OUT.packctl-lock                  pid and host of the run writing OUT (created with O_EXCL)
    .OUT.packctl-partial/
        run.json                       fingerprint of the run: config and inputs (path, size, mtime)
        journal.jsonl                  one line per finished shard: {"shard", "rows", "tokens", "sha256"}
        journal.rank-00003.jsonl       the same, for the shards rank 3 wrote (under MPI)
        part-00000.parquet             finished shards (written as part-00000.parquet.tmp, fsync'd, renamed)
        part-00001.parquet.tmp         a shard being written
    -> journal files and run.json are removed, metrics.json and manifest.json (last) written,
       and the directory renamed to OUT.

A shard is journaled (line appended and fsync'd) only after its file is complete under its final
name, so after a crash every journaled shard whose sha256 still matches can be kept:
`--resume` checks the fingerprint, keeps those shards and writes the others. A failed run leaves
OUT untouched.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
import socket
import threading
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


@dataclass(frozen=True)
class StagedShard:
    """A shard written as `name.tmp`, waiting for `OutputDir.commit_shard`."""

    name: str
    rows: int
    tokens: int


def _list(offsets: np.ndarray, values: np.ndarray, value_type: pa.DataType) -> pa.ListArray:
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32), pa.int32()), pa.array(values, value_type))


def rows_to_table(rows: PackRows, metadata: bytes, extra: dict[str, np.ndarray] | None = None) -> pa.Table:
    """PackRows -> an Arrow table with the contract's schema and the `packctl` metadata key, plus
    `extra` per-row columns (step, dp_rank, micro_batch as int32, lr_scale as float32)."""
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
    schema = PACK_SCHEMA
    for name, values in (extra or {}).items():
        array = pa.array(values)
        columns.append(array)
        schema = schema.append(pa.field(name, array.type, nullable=False))
    return pa.Table.from_arrays(columns, schema=schema.with_metadata({METADATA_KEY: metadata}))


def encode_table(table: pa.Table) -> bytes:
    """A table as the bytes of a Parquet file of one row group (PARQUET_OPTIONS)."""
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, row_group_size=max(table.num_rows, 1), **PARQUET_OPTIONS)
    return sink.getvalue().to_pybytes()


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


PARTIAL_SUFFIX = ".packctl-partial"
LOCK_SUFFIX = ".packctl-lock"
RUN_FILE = "run.json"
JOURNAL = "journal.jsonl"

# Test hooks (environment variables, read when a run opens its output): simulate a crash or a full
# disk at a chosen point of a real run.
#   PACKCTL_TEST_KILL_AFTER_SHARDS=k[:SIG]   send SIGKILL (or SIG, e.g. SIGTERM) to this process right
#                                            after journaling its k-th shard
#   PACKCTL_TEST_FAIL_WRITE_AFTER_SHARDS=k   the write of this process's shard k+1 fails with ENOSPC
KILL_AFTER_SHARDS_ENV = "PACKCTL_TEST_KILL_AFTER_SHARDS"
FAIL_WRITE_AFTER_SHARDS_ENV = "PACKCTL_TEST_FAIL_WRITE_AFTER_SHARDS"


def partial_dir(out: Path) -> Path:
    """Where OUT is assembled: `.OUT.packctl-partial` beside it (the same name for every attempt, so
    `--resume` finds it)."""
    return out.parent / f".{out.name}{PARTIAL_SUFFIX}"


def lock_path(out: Path) -> Path:
    return out.parent / f".{out.name}{LOCK_SUFFIX}"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _env_int(name: str) -> int | None:
    value = os.environ.get(name, "").split(":")[0]
    return int(value) if value else None


def _env_signal(name: str) -> int:
    _, _, sig = os.environ.get(name, "").partition(":")
    return int(getattr(signal, sig)) if sig else int(signal.SIGKILL)


class OutputLock:
    """`.OUT.packctl-lock`: one run at a time writes OUT.

    Created with O_EXCL and holding {"pid", "host"}. A lock left by a process of this host that no
    longer exists (a crash, SIGKILL) is stale and taken over; a live one is an error.
    """

    def __init__(self, out: str | Path):
        self.out = Path(out)
        self.path = lock_path(self.out)
        self.held = False

    def acquire(self) -> "OutputLock":
        me = {"pid": os.getpid(), "host": socket.gethostname()}
        for _ in range(2):
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                owner = self._owner()
                if owner is not None and self._is_stale(owner):
                    self.path.unlink(missing_ok=True)
                    continue
                who = f"pid {owner.get('pid')} on {owner.get('host')}" if owner else "unknown process"
                raise PackctlError(
                    f"{self.out}: another packctl run ({who}) is writing it (lock {self.path}); wait for it to "
                    "finish, or delete the lock file if that run is gone") from None
            except OSError as exc:
                raise PackctlError(f"{self.out}: cannot create the lock file {self.path} "
                                   f"({exc.strerror or exc}); choose a writable -o") from None
            with os.fdopen(fd, "w") as fh:
                fh.write(json.dumps(me) + "\n")
            self.held = True
            return self
        raise PackctlError(f"{self.out}: cannot take the lock {self.path}; delete it if no packctl run is writing OUT")

    def _owner(self) -> dict | None:
        try:
            owner = json.loads(self.path.read_text())
            return owner if isinstance(owner, dict) else None
        except (OSError, ValueError):
            return None

    @staticmethod
    def _is_stale(owner: dict) -> bool:
        if owner.get("host") != socket.gethostname() or not isinstance(owner.get("pid"), int):
            return False  # another machine's process: cannot tell, so never take it over
        try:
            os.kill(owner["pid"], 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False

    def release(self) -> None:
        if self.held:
            owner = self._owner()
            if owner is None or owner.get("pid") == os.getpid():
                self.path.unlink(missing_ok=True)
            self.held = False


def read_journal(tmp: Path) -> list[ShardInfo]:
    """Every shard the journals of `tmp` record (a torn last line, from a crash, is ignored)."""
    shards: dict[str, ShardInfo] = {}
    for path in sorted(tmp.glob("journal*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                entry = json.loads(line)
                info = ShardInfo(path=str(entry["shard"]), rows=int(entry["rows"]), tokens=int(entry["tokens"]),
                                 sha256=str(entry["sha256"]))
            except (ValueError, KeyError, TypeError):
                continue
            shards[info.path] = info
    return [shards[name] for name in sorted(shards)]


def inspect_partial(out: Path, fingerprint: dict, *, resume: bool) -> dict[str, ShardInfo] | None:
    """What an earlier, interrupted run left beside OUT, checked against this run.

    Returns the shards to keep (name -> ShardInfo: journaled, and the file still has its sha256),
    or None when there is nothing to resume (no partial directory, or one without finished shards).
    Raises when finished shards exist but `resume` is off, or the fingerprint differs.
    """
    tmp = partial_dir(out)
    if not tmp.is_dir():
        return None
    journaled = read_journal(tmp)
    if not journaled:
        return None
    if not resume:
        raise PackctlError(
            f"{out}: an interrupted run left {len(journaled)} finished shard(s) in {tmp}; pass --resume to "
            "continue it, or delete that directory to start over")
    try:
        earlier = json.loads((tmp / RUN_FILE).read_text())["fingerprint"]
    except (OSError, ValueError, KeyError, TypeError):
        raise PackctlError(f"{tmp}: no readable {RUN_FILE}, so it cannot be resumed; delete it and run again "
                           "without --resume") from None
    if earlier != fingerprint:
        differs = sorted(k for k in set(earlier.get("config", {})) | set(fingerprint["config"])
                         if earlier.get("config", {}).get(k) != fingerprint["config"].get(k))
        if earlier.get("inputs") != fingerprint["inputs"]:
            differs.append("inputs (paths, sizes or modification times)")
        for key in ("format_version", "packctl_version"):
            if earlier.get(key) != fingerprint.get(key):
                differs.append(key)
        raise PackctlError(
            f"{out}: --resume refused: the interrupted run in {tmp} used different {', '.join(differs)}; "
            "run with the same options and inputs, or delete that directory and run without --resume")
    kept = {}
    for info in journaled:
        path = tmp / info.path
        if path.is_file() and sha256_file(path) == info.sha256:
            kept[info.path] = info
    return kept


class OutputDir:
    """The output directory being written: shards and reports go to `.OUT.packctl-partial`, which
    replaces OUT only in `commit()`.

    `done`: shards an interrupted run finished (from `inspect_partial`); the directory is then
    reused, everything else in it removed, and those shards are not written again.
    """

    def __init__(self, out: str | Path, *, overwrite: bool, fingerprint: dict | None = None,
                 done: dict[str, ShardInfo] | None = None):
        self.out = Path(out)
        self.overwrite = overwrite
        self.rank = 0
        check_output_path(self.out, overwrite=overwrite)
        self.tmp = partial_dir(self.out)
        self.done = dict(done or {})
        try:
            if self.done:
                self._keep_only_done()
            else:
                if self.tmp.exists():
                    shutil.rmtree(self.tmp)
                self.tmp.mkdir(parents=True)
                self._write_atomic(RUN_FILE, json.dumps({"fingerprint": fingerprint or {}}, indent=2) + "\n")
                _fsync_dir(self.tmp.parent)
        except OSError as exc:
            raise PackctlError(f"{self.out}: cannot create the output directory ({exc.strerror or exc}); "
                               "choose a writable -o") from None
        self._hooks()

    @classmethod
    def attach(cls, out: str | Path, tmp: Path, rank: int = 0, done: dict[str, ShardInfo] | None = None) -> "OutputDir":
        """The directory another rank created: this rank writes its shards into it."""
        self = cls.__new__(cls)
        self.out, self.tmp, self.overwrite, self.rank = Path(out), Path(tmp), True, rank
        self.done = dict(done or {})
        self._hooks()
        return self

    def _hooks(self) -> None:
        self._journal_lock = threading.Lock()
        self.journaled = 0  # shards this process finished
        self._kill_after = _env_int(KILL_AFTER_SHARDS_ENV)
        self._kill_signal = _env_signal(KILL_AFTER_SHARDS_ENV)
        self._fail_after = _env_int(FAIL_WRITE_AFTER_SHARDS_ENV)
        self._started = 0

    @property
    def journal_path(self) -> Path:
        return self.tmp / (JOURNAL if self.rank == 0 else f"journal.rank-{self.rank:05d}.jsonl")

    def _keep_only_done(self) -> None:
        """Reuse the partial directory: keep run.json and the verified shards, compact the journal."""
        for entry in self.tmp.iterdir():
            if entry.name in self.done or entry.name == RUN_FILE:
                continue
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
        lines = "".join(json.dumps({"shard": i.path, "rows": i.rows, "tokens": i.tokens, "sha256": i.sha256}) + "\n"
                        for i in self.done.values())
        self._write_atomic(JOURNAL, lines)

    def _write_atomic(self, name: str, text: str) -> None:
        part = self.tmp / f"{name}.tmp"
        with open(part, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(part, self.tmp / name)
        _fsync_dir(self.tmp)

    def stage_bytes(self, name: str, data: bytes, *, rows: int, tokens: int) -> StagedShard:
        """First half of writing a shard: its encoded bytes written as `name.tmp`, not yet durable
        (`commit_shard` makes it so)."""
        part = self.tmp / f"{name}.tmp"
        try:
            with self._journal_lock:
                self._started += 1
                if self._fail_after is not None and self._started > self._fail_after:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            with open(part, "wb") as fh:
                fh.write(data)
        except OSError as exc:
            part.unlink(missing_ok=True)
            raise self._write_failed(name, exc) from None
        return StagedShard(name=name, rows=rows, tokens=tokens)

    def stage_run_part(self, name: str, data: bytes) -> None:
        """A writer's run of a shard it shares with another writer, left for the one that joins it
        (written whole and fsynced before the writers meet; never journaled)."""
        path = self.tmp / name
        try:
            with open(path, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
        except OSError as exc:
            path.unlink(missing_ok=True)
            raise self._write_failed(name, exc) from None

    def commit_shard(self, staged: StagedShard) -> ShardInfo:
        """Second half of `write_shard`: fsync `name.tmp`, rename it to `name`, journal it."""
        path, part = self.tmp / staged.name, self.tmp / f"{staged.name}.tmp"
        try:
            with open(part, "rb+") as fh:
                os.fsync(fh.fileno())
            os.replace(part, path)
            _fsync_dir(self.tmp)
        except OSError as exc:
            part.unlink(missing_ok=True)
            raise self._write_failed(staged.name, exc) from None
        info = ShardInfo(path=staged.name, rows=staged.rows, tokens=staged.tokens, sha256=sha256_file(path))
        self._journal(info)
        return info

    def _write_failed(self, name: str, exc: OSError) -> PackctlError:
        return PackctlError(f"{self.out / name}: write failed ({exc.strerror or exc}); free space or choose "
                            "another -o")

    def _journal(self, info: ShardInfo) -> None:
        line = json.dumps({"shard": info.path, "rows": info.rows, "tokens": info.tokens, "sha256": info.sha256})
        with self._journal_lock:
            try:
                with open(self.journal_path, "a") as fh:
                    fh.write(line + "\n")
                    fh.flush()
                    os.fsync(fh.fileno())
            except OSError as exc:
                raise PackctlError(f"{self.journal_path}: write failed ({exc.strerror or exc}); free space or "
                                   "choose another -o") from None
            self.journaled += 1
            if self._kill_after is not None and self.journaled == self._kill_after:
                os.kill(os.getpid(), self._kill_signal)

    def finished_shards(self) -> int:
        """Shards recorded in the journals (earlier runs' kept ones included)."""
        return len(read_journal(self.tmp)) if self.tmp.is_dir() else 0

    def write_json(self, name: str, data: dict) -> None:
        try:
            self._write_atomic(name, json.dumps(data, indent=2) + "\n")
        except OSError as exc:
            raise PackctlError(f"{self.out / name}: write failed ({exc.strerror or exc}); free space or choose "
                               "another -o") from None

    def drop_journal(self) -> None:
        """Before the manifest: the run files have no place in OUT."""
        for path in [self.tmp / RUN_FILE, *self.tmp.glob("journal*.jsonl")]:
            path.unlink(missing_ok=True)

    def commit(self) -> None:
        """Replace OUT with the finished directory (manifest.json must already be in it)."""
        trash = None
        if self.out.exists():
            trash = self.out.parent / f".{self.out.name}.packctl-old-{os.getpid()}"
            os.replace(self.out, trash)
        os.replace(self.tmp, self.out)
        _fsync_dir(self.out.parent)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True) if trash.is_dir() else trash.unlink()

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


def check_output_path(out: Path, *, overwrite: bool, inputs: list[str] | None = None,
                      input_dirs: list[str] | None = None) -> None:
    """Refuse an existing OUT without --overwrite, an OUT that is or holds an input file, an OUT
    inside an input directory (its shards would be read as input next time), and an OUT whose
    parent cannot be written."""
    if out.exists() and not overwrite:
        raise PackctlError(f"{out}: already exists; pass --overwrite to replace it or choose another -o")
    ancestor = out.absolute().parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise PackctlError(f"{out}: cannot be created: {ancestor} is not a directory; choose another -o")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise PackctlError(f"{out}: cannot be created: no write permission in {ancestor}; choose another -o")
    for spec in input_dirs or []:
        spec_real = os.path.realpath(spec)
        if os.path.isdir(spec) and (os.path.realpath(out) + os.sep).startswith(spec_real + os.sep):
            raise PackctlError(f"{out}: inside the input directory {spec}, so its shards would be read as input "
                               "by the next run; choose an -o outside it")
    if inputs:
        out_real = os.path.realpath(out)
        for path in inputs:
            real = os.path.realpath(path)
            if real == out_real or real.startswith(out_real + os.sep):
                raise PackctlError(f"{out}: the output would replace the input {path}; choose another -o")
