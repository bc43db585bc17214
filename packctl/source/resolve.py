"""INPUT -> the files a run reads: the one resolver of pack, stats (what-if), verify --source and groups.

An INPUT is a file, a directory (every file an input kind claims below it, recursively:
`*.parquet`, `.bin/.idx` pairs, `*.jsonl[.gz]`; `packctl.source.kinds`), a glob (`*`, `?`,
`[...]` within a name, `**` for any number of directories), or the PREFIX of a Megatron indexed dataset (`PREFIX.bin` + `PREFIX.idx`). The result is the sorted list
of distinct inputs, each with its identity (device, inode) and its fingerprint (size, mtime, digest
of the Parquet footer: `packctl.source.files.FileFingerprint`; for a pair
`packctl.source.megatron.PairFingerprint`), which every later open checks.

    data/a.parquet  data/sub -> /mnt/b (a symlinked directory)  data/sub/b.parquet  data/README.md
    resolve(["./data/"])  ->  specs ["data"], files data/a.parquet, data/sub/b.parquet

The rules (docs/errors.md, "Input resolution"); nothing is ever skipped silently:

- Spelling: each INPUT is normalized (`os.path.normpath`; relative stays relative), so `DIR`,
  `DIR/` and `./DIR` are one input and record the same bytes in the shards.
- Identity: one file reached twice (the same path from two INPUTs; two paths to one (device,
  inode): a hard link, a symbolic link) is refused naming both paths. Reading it once would make
  the sample order and the recorded input depend on which spelling wins.
- Links are followed: a symlinked directory is walked, a symlinked file read. A link back to a
  directory above it (it would loop), a link whose target is missing, a `*.parquet` that is not a
  regular file (FIFO, socket, device), a file that cannot be read and a directory that cannot be
  listed are refused naming the path.
- Hidden names (`.x`, `_x`) are read like any other name, by directory walks and by patterns alike
  (unlike the shell's `*`): every file read is listed in the manifest's `inputs`.
- A pattern that matches a directory walks it, as a directory INPUT does; files it matches are
  read whatever their name.
- Megatron pairs: `PREFIX.idx`, `PREFIX.bin` or a bare `PREFIX` names the pair, which is one input
  (recorded by its `.idx` path, sorted among the others by it). A `.bin` or `.idx` found without
  its partner is refused naming the missing file. One run reads Parquet or Megatron input, not
  both: the two kinds are refused together.
- packctl outputs are never input: a file whose Parquet metadata has the `packctl` key (a shard),
  a file in a directory holding packctl's `_manifest.json` or `_epochs.json` (a complete output)
  or `_packctl_export.json` (an export: `packctl export --format nemo|olmo|megatron`), or in
  `.OUT.packctl-partial` or `.DIR.packctl-export-partial` (a run or an export in progress or
  interrupted) is refused naming the output.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
import re
import stat
from dataclasses import dataclass
from typing import Callable, Iterable

from packctl.contract.manifest import EPOCHS, EXPORT_MARK, LEGACY_MANIFEST, MANIFEST
from packctl.contract.schema import METADATA_KEY
from packctl.errors import PackctlError
from packctl.source.index import ResolvedFile, Resolution
from packctl.source.tokenized import TOKENIZED
from packctl.source.files import changed_error, file_kind, read_fingerprint
from packctl.source.index import BIN, IDX, is_indexed, prefix_of
from packctl.source.kinds import PARQUET, InputKind, InputOptions, claimed, kind_of, kind_of_paths
from packctl.source.splits import select_split
from packctl.urls import is_url, refuse_url

_GLOB_CHARS = frozenset("*?[")
# what packctl keeps beside an OUT it is writing or replacing: .OUT.packctl-partial, .OUT.packctl-old-PID,
# and beside an export's DIR: .DIR.packctl-export-partial, .DIR.packctl-export-old
_BESIDE_OUT = re.compile(r"^\.(?P<out>.+)\.packctl-(?P<what>partial|old-\d+|export-partial|export-old)$")


@dataclass(frozen=True)
class _Found:
    """A file a spec reached, before it is read: `root` bounds the directories searched for an
    enclosing packctl output (the directory INPUT, a pattern's fixed prefix, a file's folder)."""

    path: str
    spec: str
    root: str
    st: os.stat_result


def normalize_spec(spec: str | os.PathLike) -> str:
    """An INPUT as the run records it: `./data/` -> `data`, `/abs/data//x.parquet` -> `/abs/data/x.parquet`."""
    text = os.fspath(spec)
    if is_url(text):
        from packctl import store

        if store.is_store_url(text):
            return store.normalize_url(text)
        refuse_url(text, "input")  # normpath would make s3://b/x "s3:/b/x", which does not exist
    return os.path.normpath(text) if text else text


def resolve(inputs: Iterable[str | os.PathLike], *, split: str | None = None,
            options: InputOptions | None = None) -> Resolution:
    """INPUT specs -> the run's input files (module docstring): found, checked not to belong to a
    packctl output, distinct by identity, then each opened once for its fingerprint (a shard of
    packctl is recognised by its Parquet metadata here). A directory INPUT holding dataset splits
    gives the files of `split` (`--split`, source/splits.py). The kind of the files is decided
    here, once, from their names and `options` (a tokenizer makes `*.jsonl` raw records), and
    the resolution carries it."""
    specs = [normalize_spec(s) for s in inputs]
    if any(is_url(spec) for spec in specs):
        from packctl.source.stored import resolve_objects

        return resolve_objects(specs, split=split, options=options)
    found: list[_Found] = []
    for spec in specs:
        found += _in_split(spec, _expand(spec, options), split)
    found = _with_partners(found)
    _refuse_outputs(found)
    files = []
    distinct = _distinct(found)
    by_path = {item.path: item for item in distinct}
    inputs = sorted((item for item in distinct if kind_of(item.path, options).is_input(item.path)),
                    key=lambda f: f.path)
    kind = kind_of_paths([item.path for item in inputs], options)  # one kind of input a run
    for item in inputs:
        if kind is not PARQUET:  # Parquet below: its metadata also tells a packctl shard
            files.append(_resolve_by_kind(kind, [by_path[p] for p in kind.partners(item.path)], options))
            continue
        fingerprint, metadata, st = read_fingerprint(item.path)
        if (st.st_dev, st.st_ino) != (item.st.st_dev, item.st.st_ino):
            raise changed_error(item.path, "replaced by another file while packctl listed the input")
        if METADATA_KEY in (metadata.metadata or {}):
            raise PackctlError(
                f"{item.path}: a shard written by packctl (its Parquet metadata has the 'packctl' key); packctl "
                f"outputs are never read as input: leave it out of INPUT {item.spec} (narrow it, or move the file)")
        files.append(ResolvedFile(path=item.path, spec=item.spec, device=st.st_dev, inode=st.st_ino,
                                  fingerprint=fingerprint))
    return Resolution(specs=specs, files=files, kind=kind)


def _in_split(spec: str, found: list[_Found], split: str | None) -> list[_Found]:
    """The files of a directory INPUT that `select_split` keeps (all, without splits); the files
    of any other INPUT as they are.

        data/train-0.parquet, data/test-0.parquet, split "train"  ->  data/train-0.parquet
    """
    if _is_pattern(spec) or not os.path.isdir(spec):
        return found
    below = {os.path.relpath(item.path, spec).replace(os.sep, "/"): item for item in found}
    return [below[path] for path in select_split(spec, sorted(below), split)]


def _with_partners(found: list[_Found]) -> list[_Found]:
    """`found` with the partner of every `.bin` and `.idx` in it (`data/*.idx` names the pairs too);
    a partner that does not exist is refused naming it."""
    paths = {item.path for item in found}
    more = []
    for item in found:
        prefix = prefix_of(item.path)
        if prefix is None:
            continue
        partner = prefix + (BIN if is_indexed(item.path) else IDX)
        if partner in paths:
            continue
        st = _stat(partner, named=True)
        if st is None:
            this, missing = ("index", "data file") if is_indexed(item.path) else ("data file", "index")
            raise PackctlError(f"{item.path}: a Megatron {this} without its {missing} {partner}; packctl reads "
                               f".bin/.idx pairs: restore {partner}, or leave {item.path} out of INPUT")
        if not stat.S_ISREG(st.st_mode):
            raise _not_regular(partner, st)
        paths.add(partner)
        more.append(_Found(partner, item.spec, item.root, st))
    return found + more


def _resolve_by_kind(kind: InputKind, found: list[_Found], options: InputOptions | None) -> ResolvedFile:
    """An input and its partner files (a Megatron pair's `.idx` and `.bin`), read once by its kind
    for its fingerprint (`InputKind.read_file` checks its layout), each still the file listed."""
    first = found[0]
    fingerprint, _, _ = kind.read_file(first.path, 0, options=options)
    for item in found:
        st = os.stat(item.path)
        if (st.st_dev, st.st_ino) != (item.st.st_dev, item.st.st_ino):
            raise changed_error(item.path, "replaced by another file while packctl listed the input")
    return ResolvedFile(path=first.path, spec=first.spec, device=first.st.st_dev, inode=first.st.st_ino,
                        fingerprint=fingerprint)


def respell(resolution: Resolution, specs: list[str], paths: list[str]) -> Resolution:
    """`resolution` spelled as an earlier run recorded it (its INPUT `specs` and file `paths`), when
    both are the same files: each recorded path leads (from here) to the real path of one of ours.
    Else `resolution` unchanged. `--resume` uses it so that `data` after `/abs/data` (or the
    reverse, or `'data/*.parquet'` after `data`) continues the run with the bytes it started with.

        ours ["/abs/data/a.parquet"], recorded ["data/a.parquet"] (cwd /abs) -> ["data/a.parquet"]
    """
    if len(paths) != len(resolution.files):
        return resolution
    ours = {os.path.realpath(f.path): f for f in resolution.files}
    respelled = []
    for path in paths:
        mine = ours.pop(os.path.realpath(path), None)
        if mine is None:
            return resolution
        respelled.append(dataclasses.replace(mine, path=path))
    return Resolution(specs=list(specs), files=sorted(respelled, key=lambda f: f.path), kind=resolution.kind)


def pattern_reaching(specs: list[str], path: str) -> str | None:
    """The first pattern of `specs` that would reach `path` (a file path that need not exist):
    it matches the path, or a directory above it (which it would walk). Relative specs and paths
    are compared from the working directory.

        pattern_reaching(["data/*"], "data/packed/data/train-00000.parquet")        -> "data/*"
        pattern_reaching(["data/*.parquet"], "data/packed/data/train-00000.parquet") -> None
    """
    target = os.path.abspath(path).split(os.sep)
    for spec in specs:
        if _is_pattern(spec) and _reaches(os.path.abspath(spec).split(os.sep), target):
            return spec
    return None


def _reaches(pattern: list[str], path: list[str]) -> bool:
    """Whether glob parts `pattern` match `path` or one of its leading directories."""
    if not pattern:
        return True  # the pattern matched a directory above (or the path itself)
    if not path:
        return all(part == "**" for part in pattern)
    part = pattern[0]
    if part == "**":
        return _reaches(pattern[1:], path) or _reaches(pattern, path[1:])
    return bool(re.match(fnmatch.translate(part), path[0])) and _reaches(pattern[1:], path[1:])


def _is_pattern(text: str) -> bool:
    return bool(_GLOB_CHARS & set(text))


def _expand(spec: str, options: InputOptions | None = None) -> list[_Found]:
    """The files one INPUT reaches, each path once."""
    if not spec:
        raise PackctlError("'': no such file or directory; name a Parquet file, a directory or a glob")
    found: dict[str, _Found] = {}  # a pattern may reach a file directly and through a directory it matches

    def add(item: _Found) -> None:
        found.setdefault(item.path, item)

    if _is_pattern(spec):
        _expand_pattern(spec, add, options)
        if not found:
            raise PackctlError(f"{spec}: the pattern matches no file")
        return list(found.values())
    st = _stat(spec, named=True)
    if st is None:
        for suffix in (IDX, BIN):  # a Megatron PREFIX: its partner is found after
            pair_st = _stat(spec + suffix, named=True)
            if pair_st is not None:
                if not stat.S_ISREG(pair_st.st_mode):
                    raise _not_regular(spec + suffix, pair_st)
                return [_Found(spec + suffix, spec, os.path.dirname(spec) or ".", pair_st)]
        raise PackctlError(f"{spec}: no such file or directory")
    if stat.S_ISDIR(st.st_mode):
        _walk(spec, spec, spec, ((st.st_dev, st.st_ino),), add, options)
        if not found:
            raise PackctlError(f"{spec}: the directory holds no *.parquet file, no Megatron .bin/.idx pair and no "
                               "*.jsonl file")
    elif stat.S_ISREG(st.st_mode):
        add(_Found(spec, spec, os.path.dirname(spec) or ".", st))
    else:
        raise _not_regular(spec, st)
    return list(found.values())


def _stat(path: str, *, named: bool) -> os.stat_result | None:
    """stat(path), links followed. A link whose target is missing, or that loops, is refused
    (it may have led to input); a path that is simply absent is None when `named` (the caller
    says what is missing). Anything else that cannot be stat'ed is refused naming it."""
    try:
        return os.stat(path)
    except FileNotFoundError:
        if os.path.islink(path):
            raise PackctlError(f"{path}: a symbolic link to {_link_target(path)}, which does not exist; restore its "
                               "target, or remove the link") from None
        if named:
            return None
        raise changed_error(path, "removed while packctl listed the input") from None
    except OSError as exc:
        if os.path.islink(path):
            raise PackctlError(f"{path}: a symbolic link that cannot be followed ({exc.strerror}); fix or remove "
                               "the link") from None
        raise PackctlError(f"{path}: cannot be read ({exc.strerror}); make it readable, or leave it out of "
                           "INPUT") from None


def _link_target(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return "a missing path"


def _not_regular(path: str, st: os.stat_result) -> PackctlError:
    return PackctlError(f"{path}: not a regular file ({file_kind(st)}); packctl reads Parquet files and Megatron "
                        ".bin/.idx pairs: remove it or leave it out of INPUT")


def _list(directory: str) -> list[str]:
    """The names in a directory, sorted (so the first problem reported does not depend on the
    filesystem's order). A directory that cannot be listed is refused: it may hold input."""
    try:
        with os.scandir(directory) as entries:
            return sorted(entry.name for entry in entries)
    except OSError as exc:
        raise PackctlError(f"{directory}: cannot list the directory ({exc.strerror}); make it readable, or leave it "
                           "out of INPUT") from None


def _join(directory: str, name: str) -> str:
    return os.path.normpath(os.path.join(directory, name))


def _into(path: str, st: os.stat_result, ancestors: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    """The ancestors of a directory's entries; a directory that is already one of them (reached
    again through a symbolic link) would be walked forever."""
    key = (st.st_dev, st.st_ino)
    if key in ancestors:
        raise PackctlError(f"{path}: leads back to a directory that holds it (a symbolic link loop); remove the link, "
                           "or name the directories to read")
    return ancestors + (key,)


def _walk(directory: str, spec: str, root: str, ancestors: tuple[tuple[int, int], ...],
          add: Callable[[_Found], None], options: InputOptions | None = None) -> None:
    """Every file a kind claims under `options` below `directory` (`*.parquet`, `*.bin` and
    `*.idx`, `*.jsonl`; with a tokenizer, raw records), symbolic links followed."""
    for name in _list(directory):
        path = _join(directory, name)
        st = _stat(path, named=False)
        if stat.S_ISDIR(st.st_mode):
            if options is not None and options.tokenizer is not None and _same_file(path, options.tokenizer):
                continue  # the tokenizer's own files (tokenizer.json) are not records
            _walk(path, spec, root, _into(path, st, ancestors), add, options)
        elif claimed(name, options):
            if not stat.S_ISREG(st.st_mode):
                raise _not_regular(path, st)
            add(_Found(path, spec, root, st))


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _expand_pattern(spec: str, add: Callable[[_Found], None], options: InputOptions | None = None) -> None:
    """The matches of a glob: its fixed leading directories, then each part matched name by name
    (`**`: any number of directories). A matched directory is walked, a matched file taken."""
    parts = spec.split(os.sep)
    fixed = 0
    while not _is_pattern(parts[fixed]):
        fixed += 1
    root = os.sep.join(parts[:fixed]) or (os.sep if spec.startswith(os.sep) else ".")
    try:
        st = os.stat(root)
    except OSError:
        return
    if not stat.S_ISDIR(st.st_mode):
        return

    def take(path: str, st: os.stat_result, ancestors: tuple[tuple[int, int], ...]) -> None:
        """A match: `ancestors` are those of its folder."""
        if stat.S_ISDIR(st.st_mode):
            _walk(path, spec, root, _into(path, st, ancestors), add, options)
        elif stat.S_ISREG(st.st_mode):
            add(_Found(path, spec, root, st))
        else:
            raise _not_regular(path, st)

    def files_below(directory: str, ancestors: tuple[tuple[int, int], ...]) -> None:
        """A trailing `**` matches every file below `directory`, whatever its name (its
        directories hold nothing more: `_walk(directory)` reached their *.parquet)."""
        for name in _list(directory):
            path = _join(directory, name)
            st = _stat(path, named=False)
            if stat.S_ISDIR(st.st_mode):
                files_below(path, _into(path, st, ancestors))
            else:
                take(path, st, ancestors)

    def match(directory: str, rest: list[str], ancestors: tuple[tuple[int, int], ...]) -> None:
        part, more = rest[0], rest[1:]
        if part == "**":
            if not more:  # `directory` is in `ancestors` already
                _walk(directory, spec, root, ancestors, add, options)
                files_below(directory, ancestors)
                return
            match(directory, more, ancestors)
            for name in _list(directory):
                path = _join(directory, name)
                st = _stat(path, named=False)
                if stat.S_ISDIR(st.st_mode):
                    match(path, rest, _into(path, st, ancestors))
            return
        if _is_pattern(part):
            wanted = re.compile(fnmatch.translate(part))
            names = [n for n in _list(directory) if wanted.match(n)]
        else:
            names = [part] if os.path.lexists(_join(directory, part)) else []
        for name in names:
            path = _join(directory, name)
            st = _stat(path, named=False)
            if more:
                if stat.S_ISDIR(st.st_mode):
                    match(path, more, _into(path, st, ancestors))
            else:
                take(path, st, ancestors)

    match(root, parts[fixed:], ((st.st_dev, st.st_ino),))


def _refuse_outputs(found: list[_Found]) -> None:
    """No file may come from a packctl output: a directory between the file and its INPUT's root
    holding packctl's manifest, or a `.OUT.packctl-partial` anywhere in its path."""
    marker_of: dict[str, str | None] = {}
    for item in sorted(found, key=lambda f: f.path):
        parts = item.path.split(os.sep)
        for k, part in enumerate(parts[:-1]):
            beside = _BESIDE_OUT.match(part)
            if beside:
                where = os.sep.join(parts[:k + 1])
                out = os.path.join(os.path.dirname(where), beside["out"])
                run = "packctl export" if beside["what"].startswith("export") else "packctl run"
                raise PackctlError(
                    f"{item.path}: inside {where}, the unfinished output of a {run} writing {out}; packctl "
                    f"outputs are never read as input: narrow INPUT {item.spec} to leave it out, or move it")
        outputs = []  # from the file's folder up: the last is the output the user named (an epoch's is inside)
        for directory in _directories_up_to(item.path, item.root):
            if directory not in marker_of:
                marker_of[directory] = _packctl_marker(directory)
            if marker_of[directory] is not None:
                outputs.append(directory)
        if outputs:
            what = "export" if marker_of[outputs[-1]] == EXPORT_MARK else "output"
            raise PackctlError(
                f"{item.path}: part of the packctl {what} {outputs[-1]} (it holds {marker_of[outputs[-1]]}); packctl "
                f"outputs are never read as input: narrow INPUT {item.spec} to leave it out, or move the {what}")


def _directories_up_to(path: str, root: str) -> list[str]:
    """The directories from `path`'s folder up to `root` (inclusive): a/b/c.parquet, a -> [a/b, a]."""
    root = os.path.normpath(root)
    found, directory = [], os.path.dirname(path) or "."
    while True:
        found.append(directory)
        parent = os.path.dirname(directory) or "."
        if directory == root or parent == directory:
            return found
        directory = parent


def _packctl_marker(directory: str) -> str | None:
    """The name of the file that makes `directory` a complete packctl output (a manifest, the
    _epochs.json of --epochs, or the _packctl_export.json of `packctl export`: JSON naming a
    `packctl_version`), or None."""
    for name in (MANIFEST, EPOCHS, EXPORT_MARK, LEGACY_MANIFEST):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            continue
        try:
            with open(path, encoding="utf-8") as fh:
                content = json.load(fh)
        except (OSError, ValueError):
            continue
        if isinstance(content, dict) and "packctl_version" in content and content.get("kind") != TOKENIZED:
            return name  # a tokenized corpus (`packctl tokenize`) is input to pack, not one of its outputs
    return None


def _distinct(found: list[_Found]) -> list[_Found]:
    """Each file once: the same path from two INPUTs, or two paths to one file, is refused."""
    by_path: dict[str, _Found] = {}
    by_identity: dict[tuple[int, int], _Found] = {}
    for item in sorted(found, key=lambda f: f.path):
        if item.path in by_path:
            first = by_path[item.path]
            raise PackctlError(f"{item.path}: given twice (by INPUT {first.spec} and by INPUT {item.spec}); list each "
                               "input file once")
        by_path[item.path] = item
        key = (item.st.st_dev, item.st.st_ino)
        first = by_identity.setdefault(key, item)
        if first is not item:
            how = ("symbolic links lead to one file" if os.path.realpath(first.path) == os.path.realpath(item.path)
                   else f"hard links to one file, inode {item.st.st_ino}")
            raise PackctlError(f"{item.path}: the same file as {first.path} ({how}); each input file is read once: "
                               "leave one of them out of INPUT, or remove the extra link")
    return list(by_path.values())
