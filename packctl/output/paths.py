"""Where OUT may be: checked before anything is read or written."""
from __future__ import annotations

import os
from pathlib import Path

from packctl.errors import PackctlError
from packctl.urls import is_url


def is_store_output(output: object) -> bool:
    """Whether `-o` names a store packctl writes (`s3://...`); packctl.store is loaded for URLs only."""
    if not is_url(output):
        return False
    from packctl.store import is_written_url
    return is_written_url(output)


def on_store(out: object) -> bool:
    """Whether a run's OUT is on an object store: a local OUT is a Path, a store's an
    output/stored.py `StoreOutput` (that module loads only for `-o s3://...`)."""
    return not isinstance(out, Path)


def check_output_path(out: Path, *, overwrite: bool, inputs: list[str] | None = None,
                      input_dirs: list[str] | None = None) -> None:
    """Refuse an existing OUT (a dangling symbolic link too) without --overwrite, and whatever
    `check_output_location` refuses."""
    if os.path.lexists(out) and not overwrite:
        raise PackctlError(f"{out}: already exists; pass --overwrite to replace it or choose another -o")
    check_output_location(out, inputs=inputs, input_dirs=input_dirs)


def check_output_location(out: Path, *, inputs: list[str] | None = None, input_dirs: list[str] | None = None) -> None:
    """Refuse an OUT that is or holds the working directory (`-o .`, `-o ..`: OUT is written beside
    itself and renamed into place, which a directory the process stands in cannot be), an OUT
    that is or holds an input file, an OUT inside an input directory (its shards would be read as
    input next time), and an OUT whose parent cannot be written. (Whether OUT exists is decided
    under the lock, once an interrupted commit is finished: pipeline/run.py.)"""
    _refuse_working_directory(out)
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


def _refuse_working_directory(out: Path) -> None:
    real, here = os.path.realpath(out), os.path.realpath(os.getcwd())
    if real == here or here.startswith(real.rstrip(os.sep) + os.sep):
        what = "the working directory" if real == here else f"a directory above the working directory {here}"
        raise PackctlError(f"{out}: is {what}; OUT is a directory packctl writes whole and puts in place (replaces, "
                           "with --overwrite): choose an -o inside it, e.g. -o packed")


def missing_parents(out: Path) -> list[Path]:
    """The directories above OUT that do not exist yet, deepest first: a run creates them, and a
    run that fails removes them again (`remove_empty`), so a refused input leaves no trace.

        missing_parents(Path("nope2/deeper/out"))  ->  [nope2/deeper, nope2]   (neither exists)
    """
    missing = []
    for parent in out.absolute().parents:
        if os.path.lexists(parent):
            break
        missing.append(parent)
    return missing


def remove_empty(directories: list[Path]) -> None:
    """Remove `directories` (deepest first) while each is empty: those a failed run created;
    one that holds something (a partial directory kept for --resume) stays, with those above it."""
    for directory in directories:
        try:
            directory.rmdir()
        except OSError:
            return
