"""What a run does with what earlier runs left at OUT, decided under the lock once `recover`
(output/commit.py) has finished or undone an interrupted commit:

    OUT exists and is this run's complete output, with --resume   -> nothing to do: "already complete"
        or without --overwrite
    OUT exists otherwise, no --overwrite                          -> "already exists" (with --resume:
                                                                     naming what differs)
    a complete partial directory (its manifest written):
        no --resume                                               -> refused: pass --resume
        --resume, same options and inputs, every shard intact     -> published (commit steps 4-7)
        --resume, same options and inputs, some shard damaged     -> continued, the intact ones kept
    a partial directory with journaled shards                     -> journal.py `inspect_partial`

"This run's output" is compared as `--resume` compares an interrupted run (journal.py
`differences`): the options but those of where and how a run executes, the layout, the inputs
(paths, rows, sizes, none modified since the output was written), the format and packctl version.
So a scheduler's retry loop may rerun `pack --resume` after success, and a user the command that
made OUT: it exits 0 and changes nothing. `--overwrite` alone replaces OUT whatever it holds; with
`--resume --overwrite`, an OUT that is this run's output is kept as it is, any other OUT is
replaced.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from packctl.contract.manifest import METRICS, ShardEntry
from packctl.errors import PackctlError
from packctl.output.commit import completion_mark, damaged_shards, exists, is_complete, listed_shards, read_manifests
from packctl.output.journal import differences, inspect_partial, partial_dir, read_fingerprint, read_journal


@dataclass(frozen=True)
class Outcome:
    """What the run does: `complete` (OUT already holds its output), `publish` (the partial
    directory does: commit it, then it is complete), or pack, keeping the shards in `done`."""

    complete: bool = False
    publish: bool = False
    done: dict[str, ShardEntry] | None = None


def inspect_output(out: Path, fingerprint: dict, *, resume: bool, overwrite: bool) -> Outcome:
    """The decision of the module docstring; raises PackctlError where the run must not go on."""
    if exists(out):
        keep = resume or not overwrite  # the run would keep OUT if it is its output
        why = not_this_output(out, fingerprint) if keep else None
        if keep and why is None:
            _drop_partial_of_same_run(out, fingerprint)
            return Outcome(complete=True)
        why = why if resume else None  # without --resume: the usual line
        if not overwrite:
            detail = f" and is not the output of this command: {why}" if why else ""
            raise PackctlError(f"{out}: already exists{detail}; pass --overwrite to replace it or choose another -o")
    tmp = partial_dir(out)
    shards = listed_shards(tmp) if tmp.is_dir() else None
    if shards is None:  # not complete: what its journals hold
        return Outcome(done=inspect_partial(out, fingerprint, resume=resume))
    if not resume:
        raise PackctlError(f"{out}: an interrupted run left its complete output ({len(shards)} shards) in {tmp}; "
                           "pass --resume to finish it, or delete that directory to start over")
    differ = _partial_differences(tmp, fingerprint)
    if differ:
        raise PackctlError(f"{out}: --resume refused: the interrupted run in {tmp} used different "
                           f"{_names(differ)}; run with the same options and inputs, or delete that directory "
                           "and run without --resume")
    damaged = set(damaged_shards(tmp, shards))
    if not damaged:
        return Outcome(publish=True)
    return Outcome(done={s.path: s for s in shards if s.path not in damaged})


def not_this_output(out: Path, fingerprint: dict) -> str | None:
    """Why OUT is not the complete output of the run of `fingerprint` (None: it is)."""
    if not out.is_dir() or out.is_symlink():
        return "it is not a directory"
    manifests = read_manifests(out)
    if manifests is None:
        return "it holds no readable _manifest.json"
    shards = listed_shards(out)
    if shards is None or not all(isinstance(m.get("config"), dict) and "format_version" in m for _, m in manifests):
        return "its _manifest.json is not one packctl pack writes"
    written = completion_mark(out).stat().st_mtime_ns
    for _, manifest in manifests:
        differ = differences(manifest, fingerprint, written_ns=written)
        if differ:
            return f"it differs in {_names(differ)}"
    missing = [s.path for s in shards if not (out / s.path).is_file()]
    if missing:
        return f"its shard {missing[0]} is missing"
    try:
        json.loads((out / METRICS).read_text())
    except (OSError, ValueError):
        return f"its {METRICS} cannot be read"
    return None


def _names(differ: list[str], most: int = 6) -> str:
    """The first `most` of what differs, and how many more."""
    more = f" and {len(differ) - most} more" if len(differ) > most else ""
    return ", ".join(differ[:most]) + more


def _partial_differences(tmp: Path, fingerprint: dict) -> list[str]:
    """How a partial directory's run differs from this one: by its run.json, or once the commit has
    removed that, by its manifests."""
    recorded = read_fingerprint(tmp)
    if recorded is not None:
        return differences(recorded, fingerprint)
    manifests = read_manifests(tmp) or []
    written = completion_mark(tmp).stat().st_mtime_ns
    return sorted({d for _, manifest in manifests for d in differences(manifest, fingerprint, written_ns=written)})


def _drop_partial_of_same_run(out: Path, fingerprint: dict) -> None:
    """OUT already holds this run's output: an interrupted attempt at the same output (a
    partial directory of the same options and inputs, or one holding nothing finished) has nothing
    to add, and goes."""
    tmp = partial_dir(out)
    if not tmp.is_dir():
        return
    recorded = read_fingerprint(tmp)
    if is_complete(tmp):
        same = not _partial_differences(tmp, fingerprint)
    elif not read_journal(tmp):
        same = True
    else:
        same = recorded is not None and not differences(recorded, fingerprint)
    if same:
        shutil.rmtree(tmp)
