"""`export`: a packed output written in another trainer's packed format (a row of `EXPORTERS`,
export/formats.py) into a directory of its own, swapped in by the commit protocol of pack; the
options of the formats checked against the table; the shards read as flat arrays (`read_packs`)."""
from __future__ import annotations

import json
import os
import shutil
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa

from packctl.config import as_python
from packctl.contract.schema import INT32_MAX
from packctl.contract.reader import PackedOutput, open_output
from packctl.contract.schema import CU_SEQLENS_PADDED, INPUT_IDS, LABELS, SEQ_LENS
from packctl.contract.manifest import EXPORT_MARK
from packctl.export.formats import EXPORTERS, FORMATS
from packctl.errors import PackctlError
from packctl.output.commit import exists, remove, settle
from packctl.output.fs import write_failed
from packctl.output.journal import fsync_dir
from packctl.output.lock import OutputLock
from packctl.output.outdir import Faults
from packctl.output.paths import check_output_location, missing_parents, remove_empty
from packctl.source.kinds import input_files
from packctl.runtime import Interrupted, RunInterrupted, SignalGuard
from packctl.urls import refuse_url
from packctl.version import __version__


@dataclass
class ShardPacks:
    """The columns of one shard an export needs, as flat numpy arrays (CSR offsets per pack)."""

    name: str
    token_offsets: np.ndarray  # int64, packs + 1: pack r is input_ids[token_offsets[r]:token_offsets[r+1]]
    input_ids: np.ndarray  # int32
    labels: np.ndarray  # int32, unshifted, -100 where no loss
    seq_offsets: np.ndarray  # int64, packs + 1: the sequences of pack r
    seq_lens: np.ndarray  # int64, true lengths
    seq_starts: np.ndarray  # int64, each sequence's offset inside its pack (cu_seqlens_padded[:-1])

    @property
    def num_packs(self) -> int:
        return len(self.token_offsets) - 1

    def flat_starts(self) -> np.ndarray:
        """Each sequence's offset in `input_ids`."""
        pack_of = np.repeat(np.arange(self.num_packs), np.diff(self.seq_offsets))
        return self.token_offsets[pack_of] + self.seq_starts


def _list(table: pa.Table, name: str) -> tuple[np.ndarray, np.ndarray]:
    array = table.column(name).combine_chunks()
    offsets = np.asarray(array.offsets, dtype=np.int64)
    return offsets - offsets[0], array.values.to_numpy()[offsets[0]:offsets[-1]]


def read_packs(output: PackedOutput) -> Iterator[ShardPacks]:
    """The shards of a packed output, in manifest order, each read through the output's reader
    (checked against the manifest unless it was opened with verify=False)."""
    for k, entry in enumerate(output.shards):
        table = output.read_shard(k, [INPUT_IDS, LABELS, SEQ_LENS, CU_SEQLENS_PADDED])
        token_offsets, input_ids = _list(table, INPUT_IDS)
        _, labels = _list(table, LABELS)
        seq_offsets, seq_lens = _list(table, SEQ_LENS)
        cu_offsets, cu = _list(table, CU_SEQLENS_PADDED)
        # cu_seqlens_padded has one more entry per pack than seq_lens: drop each pack's last
        keep = np.ones(len(cu), dtype=bool)
        keep[cu_offsets[1:] - 1] = False
        yield ShardPacks(entry.path, token_offsets, input_ids, labels, seq_offsets,
                         seq_lens.astype(np.int64), cu[keep].astype(np.int64))


@dataclass(frozen=True)
class ExportOptions:
    """The token ids and vocabulary an export is written for (checked, as Python ints)."""

    eos_token_id: int | None = None
    bos_token_id: int | None = None
    vocab_size: int | None = None


def _whole(name: str, value, low: int, high: int, why: str) -> int | None:
    if value is None:
        return None
    value = as_python(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise PackctlError(f"{name} {value!r}: must be a whole number")
    if not low <= value <= high:
        raise PackctlError(f"{name} {value}: must be in [{low:,}, {high:,}] ({why})")
    return value


def check_options(fmt: str, *, overwrite: bool = False, eos_token_id: int | None = None,
                  bos_token_id: int | None = None, vocab_size: int | None = None) -> ExportOptions:
    """The options of an export, refused before anything is read or written (numpy integers are
    taken as their Python value)."""
    if fmt not in FORMATS:
        raise PackctlError(f"--format {fmt!r}: choose one of {', '.join(FORMATS)}")
    if not isinstance(overwrite, bool):
        raise PackctlError(f"--overwrite {overwrite!r}: must be true or false")
    options = ExportOptions(
        eos_token_id=_whole("--eos-token-id", eos_token_id, 0, INT32_MAX, "token ids are int32"),
        bos_token_id=_whole("--bos-token-id", bos_token_id, 0, INT32_MAX, "token ids are int32"),
        vocab_size=_whole("--vocab-size", vocab_size, 1, INT32_MAX + 1, "token ids are int32"),
    )
    for name in ("eos_token_id", "bos_token_id", "vocab_size"):
        if getattr(options, name) is not None and name not in EXPORTERS[fmt].uses:
            takers = [e.name for e in EXPORTERS.values() if name in e.uses]
            names = ", ".join(takers[:-1]) + " and " * (len(takers) > 1) + takers[-1]
            raise PackctlError(f"--{name.replace('_', '-')}: applies to --format {names} only; {fmt} does not use it")
    return options


def export(out: str | Path, target: str | Path, fmt: str, *, overwrite: bool = False,
           eos_token_id: int | None = None, bos_token_id: int | None = None, vocab_size: int | None = None,
           verify: bool = True, faults: Faults | None = None, progress=None) -> dict:
    """Write the packed output `out` to `target` in format `fmt`; returns what was written.
    `progress` (a `packctl.pipeline.Progress`) shows the shards read as stage `export`.

    Every shard is read checked against the manifest (sha256, rows, tokens, layout) unless
    `verify=False` (`--no-verify-checksums`). The export is written into a directory of its own
    beside `target` (`.TARGET.packctl-export-partial`), marked complete (`_packctl_export.json`,
    which keeps INPUT from reading it back) and swapped in by the commit protocol of pack
    (output/commit.py `EXPORT_STEPS`), so a refusal, a failure or SIGINT/SIGTERM part-way leaves
    nothing: no `target`, no partial files, and with --overwrite the previous export untouched; a
    SIGKILL is finished or undone by the next export of `target`. A `target` that is or holds an
    input of `out` is refused. `faults` stops the process at a named step (tests).
    """
    options = check_options(fmt, overwrite=overwrite, eos_token_id=eos_token_id, bos_token_id=bos_token_id,
                            vocab_size=vocab_size)
    refuse_url(target, "output")
    output = open_output(out, verify=verify)  # an OUT on a store is read through its mirror
    try:
        return _export(output, Path(target), fmt, options, overwrite=overwrite, faults=faults, progress=progress)
    except PackctlError as exc:
        if output.mirror is None or type(exc) is not PackctlError:
            raise
        raise PackctlError(output.mirror.local_name(str(exc)), everywhere=exc.everywhere) from None


def _export(output: PackedOutput, target: Path, fmt: str, options, *, overwrite: bool, faults: Faults | None,
            progress) -> dict:
    _refuse(output, target, overwrite)
    exporter = EXPORTERS[fmt]
    exporter.check_layout(output, options)  # refusals that need no shard, before anything is created
    reached = (faults or Faults()).reached
    if progress is not None:
        advance = progress.stage("export", len(output.shards))
        output.on_shard_read = lambda k: advance(1)
    guard = SignalGuard()
    made = _make_parents(target)
    lock = OutputLock(target)
    staging = None
    try:
        with guard.installed():
            try:
                lock.acquire()
                with guard.deferred(stop_after=True):  # finishing an interrupted swap: a signal waits for it
                    recover(target)
                if target.exists() or target.is_symlink():
                    if not overwrite:
                        raise PackctlError(f"{target}: exists; choose another -o or pass --overwrite")
                    _check_replaceable(target)
                staging = partial_export(target)
                staging.mkdir()
            except OSError as exc:
                raise PackctlError(f"{target.parent}: cannot write there ({exc.strerror or exc}); "
                                   "choose another -o") from None
            result = exporter.write(output, staging, options)
            _write_mark(staging, fmt, output.location)
            reached("export:written")
            with guard.deferred():
                _put_in_place(staging, target, reached)
            staging = None
    except Interrupted as exc:
        _undo(staging, made, lock)
        name = signal.Signals(exc.signum).name
        raise RunInterrupted(f"{target}: export interrupted by {name}; nothing was written", exc.signum) from None
    except KeyboardInterrupt:
        _undo(staging, made, lock)
        raise RunInterrupted(f"{target}: export interrupted by SIGINT; nothing was written",
                             signal.SIGINT) from None
    except OSError as exc:  # a full disk, a quota, a read-only place: said in one line, nothing left
        _undo(staging, made, lock)
        raise write_failed(Path(exc.filename or target), exc,
                           "nothing was written: free space or choose another -o") from None
    except BaseException:
        _undo(staging, made, lock)
        raise
    lock.release()
    result["output"] = str(target)
    return result


def _refuse(output: PackedOutput, target: Path, overwrite: bool) -> None:
    """What no format exports, and a -o that must not be written, refused before anything is
    created: a plan (no tokens), a -o inside the output or holding its inputs, an existing -o
    without --overwrite, a batch-mode output, a tree output (--share-prefix)."""
    out = output.root
    if output.manifest.get("kind") == "plan":  # no tokens to export: they are in its source
        raise PackctlError(f"{out}: a plan (packctl pack --plan-only) holds no tokens; run packctl materialize "
                           f"{out} -o OUT first, and export OUT")
    if target.resolve() == out.resolve() or out.resolve() in target.resolve().parents:
        raise PackctlError(f"{target}: inside the packed output {out}; choose a -o outside it")
    _refuse_replacing_inputs(target, out, output.manifest)
    if (target.exists() or target.is_symlink()) and not overwrite:
        raise PackctlError(f"{target}: exists; choose another -o or pass --overwrite")
    if output.layout.get("pad_to") == "batch":
        raise PackctlError(f"{out}: a batch-mode output (padded micro-batches); exports take packs: pack "
                           "without --mode batch")
    if output.layout.get("tree"):  # a branch read flat would lose its prefix
        raise PackctlError(f"{out}: packed with --share-prefix (segments form trees: parent_segments); exports hold "
                           "flat sequences only: pack without --share-prefix to export")


def partial_export(target: Path) -> Path:
    """Where an export of `target` is written before it becomes `target`: `.TARGET.packctl-export-partial`
    (a fixed name, so the next export of `target` finds what a killed one left)."""
    return target.parent / f".{target.name}.packctl-export-partial"


def old_export(target: Path) -> Path:
    """Where a `target` being replaced (--overwrite) waits for the new one."""
    return target.parent / f".{target.name}.packctl-export-old"


def recover(target: Path) -> str | None:
    """Under the lock of `target`: finish or undo the swap of an export that a crash interrupted
    (output/commit.py `settle`: the old DIR back, or the complete new one in place), and remove the
    partial directory of an export killed while writing (nothing in it is kept: an export is rerun
    whole)."""
    staging, old = partial_export(target), old_export(target)
    done = settle(target, staging, [old] if exists(old) else [], complete=lambda d: (d / EXPORT_MARK).is_file(),
                  finish=lambda: _swap(staging, target, old, lambda step: None))
    if exists(staging):
        remove(staging)
        fsync_dir(target.parent)
    return done


def _write_mark(directory: Path, fmt: str, source: str) -> None:
    """The mark of a complete export (written last, durable): what reads INPUT recognises it by."""
    path = directory / EXPORT_MARK
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(json.dumps({"packctl_version": __version__, "format": fmt, "source": str(source)}, indent=2) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    fsync_dir(directory)


def _refuse_replacing_inputs(target: Path, out: Path, manifest: dict) -> None:
    """An export must not replace the corpus `out` was packed from: a -o that is, or holds, one of
    its input files is refused, as pack and materialize refuse an OUT that would replace INPUT."""
    paths = [entry.get("absolute_path") or entry.get("path") for entry in manifest.get("inputs") or []
             if isinstance(entry, dict)]
    check_output_location(target, inputs=[p for path in paths if isinstance(path, str) for p in input_files(path)])


def _check_replaceable(target: Path) -> None:
    """--overwrite replaces a directory of what an export writes: files, and an olmo export's
    `label_mask/` of files; never a directory holding anything else."""
    if target.is_symlink():
        raise PackctlError(f"{target}: a symbolic link; --overwrite replaces a directory an export wrote: choose "
                           "another -o")
    if not target.is_dir():
        raise PackctlError(f"{target}: exists and is not a directory")
    for child in target.iterdir():
        if child.is_dir() and not child.is_symlink():
            inner = child.name == "label_mask" and all(c.is_file() and not c.is_symlink() for c in child.iterdir())
            if not inner:
                raise PackctlError(f"{target}: holds the directory {child.name}, which packctl export does not write; "
                                   "choose an empty or new -o")


def _make_parents(target: Path) -> list[Path]:
    """Create the missing directories above the export; returns them, deepest first, so a failed
    export removes them again."""
    missing, parent = missing_parents(target), target.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PackctlError(f"{parent}: cannot be created ({exc.strerror or exc}); choose another -o") from None
    return missing


def _put_in_place(staging: Path, target: Path, reached) -> None:
    """The complete export becomes `target` by the steps of output/commit.py `EXPORT_STEPS`; a
    previous one (--overwrite) is set aside first and removed after, so a crash at any step
    leaves `target` or what the next export's `recover` puts in its place."""
    _swap(staging, target, old_export(target), reached)


def _swap(staging: Path, target: Path, old: Path, reached) -> None:
    if exists(target) and not exists(old):
        os.replace(target, old)
        fsync_dir(target.parent)
        reached("export:old-set-aside")
    os.replace(staging, target)
    fsync_dir(target.parent)
    reached("export:renamed")
    if exists(old):
        remove(old)
        fsync_dir(target.parent)
    reached("export:old-removed")


def _undo(staging: Path | None, made: list[Path], lock: OutputLock) -> None:
    """Remove what a failed export created: its partial directory, its lock and the parents it made."""
    if staging is not None:
        shutil.rmtree(staging, ignore_errors=True)
    lock.release()
    remove_empty(made)


# The formats' modules last: each reads shards with `read_packs` above. Loaded with this module, so
# that a signal never arrives inside their imports (cli/app.py `loading_modules`).
from packctl.export import megatron, nemo, olmo  # noqa: E402,F401
