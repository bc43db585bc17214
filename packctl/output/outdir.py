"""The output directory being written, atomically and resumably (shards, reports, the journal).

Everything goes into the sibling directory `.OUT.packctl-partial`, then it is renamed to OUT:

    .OUT.packctl-lock                  pid and host of the run writing OUT (created with O_EXCL)
    .OUT.packctl-partial/
        run.json                       fingerprint of the run: config and inputs (path, size, mtime)
        journal.jsonl                  one line per finished shard: {"shard", "rows", "tokens", "sha256"}
        journal.rank-00003.jsonl       the same, for the shards rank 3 wrote (under MPI)
        data/train-00000.parquet       finished shards (written as train-00000.parquet.tmp, fsync'd, renamed)
        data/train-00001.parquet.tmp   a shard being written
    -> journal files and run.json are removed, _metrics.json and _manifest.json (last) written,
       and the directory renamed to OUT.

A shard is journaled (line appended and fsync'd) only after its file is complete under its final
name, so after a crash every journaled shard whose sha256 still matches can be kept:
`--resume` checks the fingerprint, keeps those shards and writes the others. A failed run leaves
OUT untouched.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import threading
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from packctl.errors import PackctlError
from packctl.contract.manifest import ShardEntry, sha256_file
from packctl.output.journal import JOURNAL, RUN_FILE, fsync_dir, journal_line, partial_dir, read_journal
from packctl.contract.manifest import DATA_DIR
from packctl.output.paths import check_output_path


@dataclass(frozen=True)
class Faults:
    """Failures to simulate at chosen points of a real run: tests pass one to `pack(..., faults=)`.

    kill_after_shards: send `kill_signal` to this process right after journaling its k-th shard.
    fail_write_after_shards: the write of this process's shard k+1 fails with ENOSPC.
    """

    kill_after_shards: int | None = None
    kill_signal: int = signal.SIGKILL
    fail_write_after_shards: int | None = None


@dataclass(frozen=True)
class StagedShard:
    """A shard written as `name.tmp`, waiting for `OutputDir.commit_shard`."""

    name: str
    rows: int
    tokens: int


class OutputDir:
    """The output directory being written: shards and reports go to `.OUT.packctl-partial`, which
    replaces OUT only in `commit()`.

    `done`: shards an interrupted run finished (from `inspect_partial`); the directory is then
    reused, everything else in it removed, and those shards are not written again.
    """

    def __init__(self, out: str | Path, tmp: Path, *, rank: int = 0, done: dict[str, ShardEntry] | None = None,
                 faults: Faults | None = None):
        """The partial directory `tmp` of OUT, already there: `create` makes it (rank 0); other
        ranks open the one rank 0 made and write their shards into it."""
        self.out, self.tmp, self.rank = Path(out), Path(tmp), rank
        self.done = dict(done or {})
        self.faults = faults or Faults()
        self._journal_lock = threading.Lock()
        self.journaled = 0  # shards this process finished
        self._started = 0  # shard writes this process began

    @classmethod
    def create(cls, out: str | Path, *, overwrite: bool, fingerprint: dict | None = None,
               done: dict[str, ShardEntry] | None = None, faults: Faults | None = None) -> "OutputDir":
        """Make (or, resuming with `done`, clean) the partial directory of OUT."""
        out = Path(out)
        check_output_path(out, overwrite=overwrite)
        self = cls(out, partial_dir(out), done=done, faults=faults)
        try:
            if self.done:
                self._keep_only_done()
            else:
                if self.tmp.exists():
                    shutil.rmtree(self.tmp)
                self.tmp.mkdir(parents=True)
                (self.tmp / DATA_DIR).mkdir()
                self._write_atomic(RUN_FILE, json.dumps({"fingerprint": fingerprint or {}}, indent=2) + "\n")
                fsync_dir(self.tmp.parent)
        except OSError as exc:
            raise PackctlError(f"{self.out}: cannot create the output directory ({exc.strerror or exc}); "
                               "choose a writable -o") from None
        return self

    @property
    def journal_path(self) -> Path:
        return self.tmp / (JOURNAL if self.rank == 0 else f"journal.rank-{self.rank:05d}.jsonl")

    def _keep_only_done(self) -> None:
        """Reuse the partial directory: keep run.json and the verified shards, compact the journal."""
        keep = {RUN_FILE, *self.done}
        keep |= {parent.as_posix() for name in keep for parent in PurePosixPath(name).parents}  # their folders
        for entry in sorted(self.tmp.rglob("*"), reverse=True):  # children before their folder
            if entry.relative_to(self.tmp).as_posix() in keep:
                continue
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
        (self.tmp / DATA_DIR).mkdir(exist_ok=True)
        self._write_atomic(JOURNAL, "".join(journal_line(info) for info in self.done.values()))

    def _write_atomic(self, name: str, text: str) -> None:
        part = self.tmp / f"{name}.tmp"
        with open(part, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(part, self.tmp / name)
        fsync_dir(self.tmp)

    def stage_bytes(self, name: str, data, *, rows: int, tokens: int) -> StagedShard:
        """First half of writing a shard: its encoded bytes (bytes-like, or a list of pieces written
        one after the other) written as `name.tmp`, not yet durable (`commit_shard` makes it so)."""
        part = self.tmp / f"{name}.tmp"
        try:
            with self._journal_lock:
                self._started += 1
                fail_after = self.faults.fail_write_after_shards
                if fail_after is not None and self._started > fail_after:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            part.parent.mkdir(parents=True, exist_ok=True)  # data/ of an epoch's folder (--epochs)
            with open(part, "wb") as fh:
                fh.writelines(data if isinstance(data, list) else [data])
        except OSError as exc:
            part.unlink(missing_ok=True)
            raise self._write_failed(name, exc) from None
        return StagedShard(name=name, rows=rows, tokens=tokens)

    def stage_run_part(self, name: str, data) -> None:
        """A writer's run of a shard it shares with another writer, left for the one that joins it
        (written whole and fsynced before the writers meet; never journaled)."""
        path = self.tmp / name
        try:
            with open(path, "wb") as fh:
                fh.writelines(data if isinstance(data, list) else [data])
                fh.flush()
                os.fsync(fh.fileno())
        except OSError as exc:
            path.unlink(missing_ok=True)
            raise self._write_failed(name, exc) from None

    def commit_shard(self, staged: StagedShard) -> ShardEntry:
        """Second half of `write_shard`: fsync `name.tmp`, rename it to `name`, journal it."""
        path, part = self.tmp / staged.name, self.tmp / f"{staged.name}.tmp"
        try:
            with open(part, "rb+") as fh:
                os.fsync(fh.fileno())
            os.replace(part, path)
            fsync_dir(path.parent)
        except OSError as exc:
            part.unlink(missing_ok=True)
            raise self._write_failed(staged.name, exc) from None
        info = ShardEntry(path=staged.name, rows=staged.rows, tokens=staged.tokens, sha256=sha256_file(path))
        self._journal(info)
        return info

    def _write_failed(self, name: str, exc: OSError) -> PackctlError:
        return PackctlError(f"{self.out / name}: write failed ({exc.strerror or exc}); free space or choose "
                            "another -o")

    def _journal(self, info: ShardEntry) -> None:
        line = journal_line(info)
        with self._journal_lock:
            try:
                with open(self.journal_path, "a") as fh:
                    fh.write(line)
                    fh.flush()
                    os.fsync(fh.fileno())
            except OSError as exc:
                raise PackctlError(f"{self.journal_path}: write failed ({exc.strerror or exc}); free space or "
                                   "choose another -o") from None
            self.journaled += 1
            if self.faults.kill_after_shards is not None and self.journaled == self.faults.kill_after_shards:
                os.kill(os.getpid(), self.faults.kill_signal)

    def finished_shards(self) -> int:
        """Shards recorded in the journals (earlier runs' kept ones included)."""
        return len(read_journal(self.tmp)) if self.tmp.is_dir() else 0

    def write_json(self, name: str, data: dict) -> None:
        try:
            self._write_atomic(name, json.dumps(data, indent=2) + "\n")
        except OSError as exc:
            raise PackctlError(f"{self.out / name}: write failed ({exc.strerror or exc}); free space or choose "
                               "another -o") from None

    def drop_data_dir(self) -> None:
        """Remove OUT/data/ left empty: with --epochs every shard lives in its epoch's folder."""
        (self.tmp / DATA_DIR).rmdir()

    def drop_journal(self) -> None:
        """Before the manifest: the run files have no place in OUT."""
        for path in [self.tmp / RUN_FILE, *self.tmp.glob("journal*.jsonl")]:
            path.unlink(missing_ok=True)

    def commit(self) -> None:
        """Replace OUT with the finished directory (_manifest.json must already be in it)."""
        trash = None
        if self.out.exists():
            trash = self.out.parent / f".{self.out.name}.packctl-old-{os.getpid()}"
            os.replace(self.out, trash)
        os.replace(self.tmp, self.out)
        fsync_dir(self.out.parent)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True) if trash.is_dir() else trash.unlink()

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)
