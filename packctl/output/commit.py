"""The commit protocol: how a finished partial directory becomes OUT, step by durable step, and
the one recovery every `pack` runs, under the lock, before anything else looks at OUT.

Beside OUT while a run writes it:

    .OUT.packctl-lock        the run writing OUT (output/lock.py)
    .OUT.packctl-partial/    OUT being assembled: run.json, journals, shards, then the reports
    .OUT.packctl-old         (--overwrite) the output being replaced, for a moment

The steps, each durable (written, fsynced, renamed, parent fsynced) before the next begins; a
kill after any of them leaves the state its invariant names, and every state has one way on:

    1. shards written, fsynced, renamed, journaled      outdir.py (SHARD_STEPS; JOIN_STEPS under MPI)
       invariant: every journal line names a shard whose bytes have that sha256
    2. `_metrics.json` (and each epoch's)               "commit:metrics-written"
       invariant: as in 1 (reports are rewritten by any later run)
    3. `_manifest.json` (with --epochs: each epoch's, then `_epochs.json`), written last
                                                        "commit:manifest-written"
       invariant: the partial directory is COMPLETE: its manifest lists every shard, each
       journaled and present; run.json and the journals are still there
    4. with an existing OUT (--overwrite): OUT renamed to `.OUT.packctl-old`
                                                        "commit:old-set-aside"
       invariant: `-old` exists only beside a complete partial directory
    5. run.json and the journals removed                "commit:journal-removed"
       invariant: a complete partial directory holds exactly what OUT will hold
    6. the partial directory renamed to OUT, parent fsynced
                                                        "commit:renamed"
    7. `.OUT.packctl-old` removed                       "commit:old-removed"
    8. the lock released (output/lock.py)

`recover(out)` reads the state on disk and finishes or undoes what a killed commit left:

    -old (or a legacy -old-PID), no OUT, partial complete and intact -> steps 5-7: the new output
    -old, no OUT, partial missing, incomplete or damaged           -> -old renamed back to OUT
    -old and OUT                                                   -> -old removed (step 7)
    no -old                                                        -> nothing to do here; a
        partial directory is then continued by `--resume` (journal.py: `inspect_output`), one
        that is complete and intact by steps 4-7 alone (`publish`)

So a rerun after a kill at any step (with `--resume` where a partial directory holds finished
work) ends with the output an uninterrupted run writes, and an OUT being replaced is never lost:
it is OUT, or `-old` beside a complete new output that the next run puts in its place.

`packctl export` swaps its directory in by the same steps 4, 6 and 7 (`EXPORT_STEPS`, its mark
`_packctl_export.json` written last in place of the manifest) and recovers by the same `settle`.

An OUT on an object store has no rename: output/stored.py commits it by one PUT of its manifest
(`STORE_STEPS` are the steps of its own).

Kill points: every step has a name (the tuples below), and `Faults(kill_at=NAME)`
(output/outdir.py) stops the process there: the crash tests iterate these tuples.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable

from packctl.contract.manifest import EPOCHS, MANIFEST, ShardEntry, epoch_dir, sha256_file
from packctl.errors import PackctlError
from packctl.output.fs import write_failed
from packctl.output.journal import RUN_FILE, fsync_dir, partial_dir

OLD_SUFFIX = ".packctl-old"

# Every point where a crash test may stop a run, in the order a run reaches them.
OPEN_STEPS = (
    "lock:taken",                # the lock is held; nothing else done
    "open:created",              # the partial directory and its data/ made, run.json not yet written
)
SHARD_STEPS = (
    "shard:staged",              # `name.tmp` written, not yet fsynced or renamed
    "shard:renamed",             # fsynced and renamed to its name, not yet journaled
    "shard:journal-torn",        # half of its journal line written (a torn line), then the crash
    "shard:journaled",           # its journal line appended and fsynced
)
JOIN_STEPS = (                   # a shard two MPI writers share (pipeline/materialize.py)
    "join:part-written",         # a writer's run of the shard written (`data/.train-0000k.parquet.from-00128`)
    "join:joined",               # the joined shard renamed and journaled, its parts not yet removed
)
RESUME_STEPS = (                 # --resume reusing the partial directory (outdir.py `_keep_only_done`)
    "resume:journal-compacted",  # run.json and a journal of the kept shards written; nothing removed yet
    "resume:cleaning",           # the first file not kept removed
    "resume:cleaned",            # everything not kept removed
)
COMMIT_STEPS = (
    "commit:metrics-written",
    "commit:manifest-written",
    "commit:old-set-aside",
    "commit:journal-removed",
    "commit:renamed",
    "commit:old-removed",
)
STEPS = OPEN_STEPS + SHARD_STEPS + JOIN_STEPS + RESUME_STEPS + COMMIT_STEPS
EXPORT_STEPS = (                 # `packctl export`: the same swap, for a directory of another format
    "export:written",            # the export complete in `.DIR.packctl-export-partial`, its mark written last
    "export:old-set-aside",      # (--overwrite) DIR renamed to `.DIR.packctl-export-old`
    "export:renamed",            # the partial directory renamed to DIR
    "export:old-removed",        # `.DIR.packctl-export-old` removed
)
STORE_STEPS = (                  # OUT on an object store (output/stored.py): the steps not named above
    "store:shard-put",           # a shard PUT under the run prefix, not yet journaled
    "store:replaces-noted",      # run.json PUT again naming the run it replaces; the manifest not yet PUT
    "store:old-removed",         # the manifest PUT and the replaced run's objects deleted
)
KILL_POINTS = STEPS + EXPORT_STEPS + STORE_STEPS  # where `Faults(kill_at=)` may stop pack, materialize or export

Reached = Callable[[str], None]  # called with a step's name as the run passes it (Faults.reached)


def _nothing(step: str) -> None:
    pass


def old_dir(out: Path) -> Path:
    """Where an OUT being replaced waits for the new one: `.OUT.packctl-old` (a fixed name, so the
    next run finds it)."""
    return out.parent / f".{out.name}{OLD_SUFFIX}"


def legacy_old_dirs(out: Path) -> list[Path]:
    """`.OUT.packctl-old-<PID>` left by packctl versions that named the replaced OUT by pid,
    most recently set aside first."""
    found = [p for p in out.parent.glob(f".{out.name}{OLD_SUFFIX}-*") if p.name.rpartition("-")[2].isdigit()]
    return sorted(found, key=lambda p: p.lstat().st_ctime_ns, reverse=True)


def exists(path: Path) -> bool:
    """Whether anything is at `path`, a dangling symbolic link included."""
    return os.path.lexists(path)


def remove(path: Path) -> None:
    """Remove a file, a symbolic link (never what it points to) or a directory tree."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif exists(path):
        path.unlink()


def is_complete(directory: Path) -> bool:
    """Whether a partial directory holds its completion mark: `_manifest.json`, or `_epochs.json`
    for --epochs (each written last, step 3)."""
    return (directory / MANIFEST).is_file() or (directory / EPOCHS).is_file()


def read_manifests(directory: Path) -> list[tuple[str, dict]] | None:
    """(folder inside `directory`, manifest) of a complete directory: its `_manifest.json`, or with
    --epochs each epoch's (`epoch-00001/`); None when it is not complete or they cannot be read."""
    try:
        if (directory / MANIFEST).is_file():
            manifests = [("", json.loads((directory / MANIFEST).read_text()))]
        elif (directory / EPOCHS).is_file():
            epochs = int(json.loads((directory / EPOCHS).read_text())["epochs"])
            manifests = [(f"{epoch_dir(e)}/", json.loads((directory / epoch_dir(e) / MANIFEST).read_text()))
                         for e in range(epochs)]
        else:
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return manifests if all(isinstance(m, dict) for _, m in manifests) else None


def completion_mark(directory: Path) -> Path:
    """The file written last into a complete directory (`_epochs.json` or `_manifest.json`)."""
    return directory / EPOCHS if (directory / EPOCHS).is_file() else directory / MANIFEST


def listed_shards(directory: Path) -> list[ShardEntry] | None:
    """The shards a complete directory's manifest(s) list, with paths inside `directory`
    (`epoch-00001/data/train-00000.parquet` for --epochs); None when it is not complete or its
    manifests cannot be read."""
    manifests = read_manifests(directory)
    if manifests is None:
        return None
    try:
        return [ShardEntry(path=folder + str(s["path"]), rows=int(s["rows"]), tokens=int(s["tokens"]),
                           sha256=str(s["sha256"])) for folder, manifest in manifests for s in manifest["shards"]]
    except (KeyError, TypeError, ValueError):
        return None


def damaged_shards(directory: Path, shards: list[ShardEntry]) -> list[str]:
    """The listed shards whose file is missing or whose bytes no longer have their sha256."""
    return [s.path for s in shards
            if not (directory / s.path).is_file() or sha256_file(directory / s.path) != s.sha256]


def drop_run_files(directory: Path) -> None:
    """Step 5: run.json and every journal (and a `.tmp` a crash left of one) have no place in OUT."""
    for path in sorted(directory.glob(f"{RUN_FILE}*")) + sorted(directory.glob("journal*.jsonl*")):
        path.unlink()
    fsync_dir(directory)


def publish(out: Path, *, overwrite: bool, reached: Reached = _nothing) -> None:
    """Steps 4-7: the complete partial directory of OUT becomes OUT (replacing it with `overwrite`)."""
    tmp, old = partial_dir(out), old_dir(out)
    if exists(out) and not overwrite:
        raise PackctlError(f"{out}: appeared while this run wrote it; the complete output waits in {tmp}: rerun with "
                           "--resume --overwrite to replace OUT, or move OUT away and rerun with --resume")
    try:
        if exists(out):
            os.replace(out, old)
            fsync_dir(out.parent)
        reached("commit:old-set-aside")
        _finish(out, tmp, [old], reached)
    except OSError as exc:
        raise _commit_failed(out, tmp, exc) from None


def _commit_failed(out: Path, tmp: Path, exc: OSError) -> PackctlError:
    if not tmp.is_dir() and not exists(out):
        return write_failed(tmp, exc, "the directory of the output was removed while this run wrote it; run again")
    return write_failed(Path(exc.filename or out), exc)


def _finish(out: Path, tmp: Path, olds: list[Path], reached: Reached) -> None:
    """Steps 5-7 (with the OUT set aside, if any, already in `olds`)."""
    drop_run_files(tmp)
    reached("commit:journal-removed")
    os.replace(tmp, out)
    fsync_dir(out.parent)
    reached("commit:renamed")
    for old in olds:
        remove(old)
    fsync_dir(out.parent)
    reached("commit:old-removed")


def recover(out: Path, reached: Reached = _nothing) -> str | None:
    """Finish or undo a commit that a crash interrupted (module docstring); the caller holds the
    lock. Returns what it did ("finished", "restored", "removed"), or None when no commit was
    under way."""
    tmp = partial_dir(out)

    def intact(directory: Path) -> bool:
        shards = listed_shards(directory)
        return shards is not None and not damaged_shards(directory, shards)

    olds = [p for p in [old_dir(out), *legacy_old_dirs(out)] if exists(p)]
    return settle(out, tmp, olds, complete=intact, finish=lambda: _finish(out, tmp, olds, reached))


def settle(out: Path, tmp: Path, olds: list[Path], *, complete: Callable[[Path], bool],
           finish: Callable[[], None]) -> str | None:
    """The recovery of a swap that a crash interrupted, for any directory swapped in this way (a
    pack's OUT, an export's DIR): `olds` are the set-aside previous outputs that exist, `tmp` the
    new one, `complete(tmp)` whether it may become `out`, `finish()` the rest of the swap."""
    if not olds:
        return None
    try:
        if exists(out):  # the new output is in place: only the old one is left to remove
            for old in olds:
                remove(old)
            fsync_dir(out.parent)
            return "removed"
        if tmp.is_dir() and complete(tmp):
            finish()
            return "finished"
        os.replace(olds[0], out)  # no complete new output: the old one comes back
        fsync_dir(out.parent)
        for old in olds[1:]:
            remove(old)
        return "restored"
    except OSError as exc:
        raise write_failed(Path(exc.filename or out), exc,
                           f"an interrupted commit of {out} could not be finished; fix that and rerun") from None
