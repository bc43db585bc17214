"""The output directory being written, atomically and resumably (shards, reports, the journal).

Everything goes into the sibling directory `.OUT.packctl-partial`, then it becomes OUT by the
commit protocol (output/commit.py):

    .OUT.packctl-lock                  pid and host of the run writing OUT (output/lock.py)
    .OUT.packctl-partial/
        run.json                       fingerprint of the run: config and inputs (path, size, mtime)
        journal.jsonl                  one line per finished shard: {"shard", "rows", "tokens", "sha256"}
        journal.rank-00003.jsonl       the same, for the shards rank 3 wrote (under MPI)
        data/train-00000.parquet       finished shards (written as train-00000.parquet.tmp, fsync'd, renamed)
        data/train-00001.parquet.tmp   a shard being written
    -> _metrics.json, _manifest.json (the directory is then complete), OUT set aside as
       .OUT.packctl-old (--overwrite), run.json and journals removed, renamed to OUT, -old removed.

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
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Callable

from packctl.contract.manifest import DATA_DIR, ShardEntry, sha256_file
from packctl.errors import PackctlError
from packctl.output import commit as protocol
from packctl.output.commit import KILL_POINTS
from packctl.output.fs import write_failed
from packctl.output.journal import (JOURNAL, RUN_FILE, fsync_dir, journal_line, partial_dir, read_journal,
                                    write_block_digests)
from packctl.output.paths import check_output_path


@dataclass(frozen=True)
class Faults:
    """Failures to simulate at chosen points of a real run: tests pass one to `pack(..., faults=)`.

    kill_at: a step of `KILL_POINTS` (output/commit.py); this process sends itself `kill_signal` the
        `kill_count`-th time it passes that step (under MPI: only on `kill_rank`, if given).
        At "shard:journal-torn" half of the journal line is written first.
    kill_after_shards: the same as kill_at="shard:journaled", kill_count=k.
    fail_write_after_shards: the write of this process's shard k+1 fails with ENOSPC.
    on_step: called with every step's name as the run passes it (in-process tests change the
        disk under a run with it).

        Faults(kill_at="commit:manifest-written")      # SIGKILL once the manifest is written
    """

    kill_after_shards: int | None = None
    kill_signal: int = signal.SIGKILL
    fail_write_after_shards: int | None = None
    kill_at: str | None = None
    kill_count: int = 1
    kill_rank: int | None = None
    on_step: Callable[[str], None] | None = None
    _passed: dict = field(default_factory=dict, compare=False, repr=False)  # step -> times passed, per process

    def __post_init__(self) -> None:
        if self.kill_at is not None and self.kill_at not in KILL_POINTS:
            raise ValueError(f"kill_at={self.kill_at!r}: not a step; steps: {', '.join(KILL_POINTS)}")
        if self.kill_after_shards is not None:
            if self.kill_at is not None:
                raise ValueError("give kill_after_shards or kill_at, not both")
            object.__setattr__(self, "kill_at", "shard:journaled")
            object.__setattr__(self, "kill_count", self.kill_after_shards)

    def due(self, step: str, rank: int = 0) -> bool:
        """Count a pass of `step`; whether the kill is due now."""
        if step not in KILL_POINTS:
            raise AssertionError(f"unnamed step {step!r}: add it to output/commit.py")
        if self.on_step is not None:
            self.on_step(step)
        if self.kill_at != step or (self.kill_rank is not None and self.kill_rank != rank):
            return False
        with _PASSES:
            self._passed[step] = self._passed.get(step, 0) + 1
            return self._passed[step] == self.kill_count

    def kill(self) -> None:
        os.kill(os.getpid(), self.kill_signal)

    def reached(self, step: str, rank: int = 0) -> None:
        """The run has passed `step`: the crash, if this is where it is wanted."""
        if self.due(step, rank):
            self.kill()


_PASSES = threading.Lock()


@dataclass(frozen=True)
class StagedShard:
    """A shard written as `name.tmp`, waiting for `OutputDir.commit_shard`."""

    name: str
    rows: int
    tokens: int


class OutputDir:
    """The output directory being written: shards and reports go to `.OUT.packctl-partial`, which
    becomes OUT only in `commit()`.

    `done`: shards an interrupted run finished (from `inspect_output`); the directory is then
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
        run_file = json.dumps({"fingerprint": fingerprint or {}}, indent=2) + "\n"
        try:
            if self.done:
                self._keep_only_done(run_file)
            else:
                if protocol.exists(self.tmp):
                    protocol.remove(self.tmp)
                self.tmp.mkdir(parents=True)
                (self.tmp / DATA_DIR).mkdir()
                self.reached("open:created")
                self._write_atomic(RUN_FILE, run_file)
                fsync_dir(self.tmp.parent)
        except OSError as exc:
            if not self.done:  # nothing finished in it: nothing is left behind
                shutil.rmtree(self.tmp, ignore_errors=True)
            raise write_failed(Path(exc.filename or self.tmp), exc) from None
        return self

    @property
    def where(self) -> Path:
        """Where the finished work of this run waits for `--resume`: the partial directory."""
        return self.tmp

    def keep_block_digests(self, digests: list[int]) -> None:
        """Record the digest of every input block beside run.json (journal.py), for `--resume`."""
        write_block_digests(self.tmp, digests)

    def reached(self, step: str) -> None:
        """This process has passed `step` (output/commit.py): a simulated crash, if one is wanted there."""
        self.faults.reached(step, self.rank)

    @property
    def journal_path(self) -> Path:
        return self.tmp / (JOURNAL if self.rank == 0 else f"journal.rank-{self.rank:05d}.jsonl")

    def _keep_only_done(self, run_file: str) -> None:
        """Reuse the partial directory: keep the verified shards, everything else removed.

        The journal of the kept shards is written first, so a crash at any moment of the cleanup
        leaves a directory that the next `--resume` keeps the same shards of."""
        self._write_atomic(RUN_FILE, run_file)
        self._write_atomic(JOURNAL, "".join(journal_line(info) for info in self.done.values()))
        self.reached("resume:journal-compacted")
        keep = {RUN_FILE, JOURNAL, *self.done}
        keep |= {parent.as_posix() for name in keep for parent in PurePosixPath(name).parents}  # their folders
        removed = 0
        for entry in sorted(self.tmp.rglob("*"), reverse=True):  # children before their folder
            if entry.relative_to(self.tmp).as_posix() in keep:
                continue
            protocol.remove(entry)
            removed += 1
            if removed == 1:
                self.reached("resume:cleaning")
        (self.tmp / DATA_DIR).mkdir(exist_ok=True)
        fsync_dir(self.tmp)
        self.reached("resume:cleaned")

    def _write_atomic(self, name: str, text: str) -> None:
        target = self.tmp / name
        part = target.with_name(target.name + ".tmp")
        with open(part, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(part, target)
        fsync_dir(target.parent)

    def _make_folders(self, path: Path) -> None:
        """The folders of `path` inside the partial directory (an epoch's data/), never the
        partial directory itself: if it is gone, the run must stop, not start over in a new one."""
        missing = []
        folder = path.parent
        while folder != self.tmp and not folder.is_dir():
            missing.append(folder)
            folder = folder.parent
        for folder in reversed(missing):
            folder.mkdir(exist_ok=True)

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
            self._make_folders(part)
            with open(part, "wb") as fh:
                fh.writelines(data if isinstance(data, list) else [data])
        except OSError as exc:
            part.unlink(missing_ok=True)
            raise self._write_failed(name, exc) from None
        self.reached("shard:staged")
        return StagedShard(name=name, rows=rows, tokens=tokens)

    def stage_run_part(self, name: str, data) -> None:
        """A writer's run of a shard it shares with another writer, left for the one that joins it
        (written whole and fsynced before the writers meet; never journaled)."""
        path = self.tmp / name
        try:
            self._make_folders(path)
            with open(path, "wb") as fh:
                fh.writelines(data if isinstance(data, list) else [data])
                fh.flush()
                os.fsync(fh.fileno())
        except OSError as exc:
            path.unlink(missing_ok=True)
            raise self._write_failed(name, exc) from None
        self.reached("join:part-written")

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
        self.reached("shard:renamed")
        info = ShardEntry(path=staged.name, rows=staged.rows, tokens=staged.tokens, sha256=sha256_file(path))
        self._journal(info)
        return info

    def commit_joined(self, staged: StagedShard, parts: list[Path]) -> ShardEntry:
        """`commit_shard` of a shard joined from the runs of several writers, then its runs removed."""
        info = self.commit_shard(staged)
        self.reached("join:joined")
        for path in parts:
            path.unlink()
        return info

    def _write_failed(self, name: str, exc: OSError) -> PackctlError:
        if not self.tmp.is_dir():
            return write_failed(self.tmp, exc, "the directory of the output was removed while this run wrote "
                                               "it; run again")
        return write_failed(self.tmp / name, exc)

    def _journal(self, info: ShardEntry) -> None:
        line = journal_line(info)
        with self._journal_lock:
            torn = self.faults.due("shard:journal-torn", self.rank)
            try:
                with open(self.journal_path, "a") as fh:
                    fh.write(line[:len(line) // 2] if torn else line)
                    fh.flush()
                    os.fsync(fh.fileno())
            except OSError as exc:
                raise self._write_failed(self.journal_path.name, exc) from None
            if torn:
                self.faults.kill()
            self.journaled += 1
            self.reached("shard:journaled")

    def finished_shards(self) -> int:
        """Shards recorded in the journals (earlier runs' kept ones included), or listed by the
        manifest of a complete directory (whose journals the commit may have removed)."""
        if not self.tmp.is_dir():
            return 0
        return len(read_journal(self.tmp)) or len(protocol.listed_shards(self.tmp) or [])

    def is_complete(self) -> bool:
        return self.tmp.is_dir() and protocol.is_complete(self.tmp)

    def write_json(self, name: str, data: dict) -> None:
        try:
            self._write_atomic(name, json.dumps(data, indent=2) + "\n")
        except OSError as exc:
            raise self._write_failed(name, exc) from None

    def commit(self, *, reports: list[tuple[str, dict]], manifests: list[tuple[str, dict]],
               shards: list[ShardEntry], overwrite: bool) -> None:
        """Steps 2-7 of the commit protocol (output/commit.py): the reports, the manifests (the
        last of `manifests` marks the directory complete), then the directory becomes OUT.

        `shards`: every shard the manifests list; each must be journaled with its sha256 and present,
        or nothing is committed."""
        journaled = {info.path: info.sha256 for info in read_journal(self.tmp)} if self.tmp.is_dir() else {}
        for info in shards:
            if journaled.get(info.path) != info.sha256 or not (self.tmp / info.path).is_file():
                raise PackctlError(f"{self.tmp / info.path}: finished by this run but not in its journal or no "
                                   "longer there, so the partial directory was changed under the run; run the "
                                   "same command with --resume")
        for name, data in reports:
            self.write_json(name, data)
        self.reached("commit:metrics-written")
        data_dir = self.tmp / DATA_DIR
        if data_dir.is_dir() and not any(data_dir.iterdir()):  # --epochs: every shard is in its epoch's folder
            data_dir.rmdir()
        for name, data in manifests:
            self.write_json(name, data)
        self.reached("commit:manifest-written")
        protocol.publish(self.out, overwrite=overwrite, reached=self.reached)

    def close(self) -> None:
        """The run is over, whatever its end: nothing to release here (a store output removes its
        local scratch directory)."""

    def abort(self) -> None:
        """Remove the partial directory: only when it holds nothing finished (`after_failure`)."""
        if not self.is_complete():
            shutil.rmtree(self.tmp, ignore_errors=True)
