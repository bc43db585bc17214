"""The inputs of a blend (`--source NAME=PATH:WEIGHT`, `--blend FILE`; docs/mixtures.md): each
source's PATH resolved as an INPUT of its own (source/resolve.py), the sources' files joined in
source order, so the gids of source k are one run:

    --source web=data/web:0.6 --source code=data/code:0.4
    web: a.parquet (3 rows), b.parquet (2)   code: c.parquet (4)
    -> files a b | c, gids 0..4 | 5..8, source file starts [0, 2, 3]

A file reached by two sources is refused (it would be drawn twice under two names).
"""
from __future__ import annotations

import math
import os
from pathlib import Path

from packctl.config import PackConfig, SourceEntry
from packctl.errors import PackctlError
from packctl.source.index import Resolution
from packctl.source.resolve import normalize_spec, resolve


def read_blend(path: str) -> dict[str, dict]:
    """A Megatron blend file (`weight prefix weight prefix ...`, whitespace or newlines between,
    as Megatron's `--data-path` takes them) as sources named by each prefix's file name
    (`data/web_text_document` -> web_text_document; a name taken twice gets `-2`, `-3`), each
    read as its pair `PREFIX.idx`:

        0.7 data/web 0.3 data/code  ->  {'web': {'path': 'data/web.idx', 'weight': 0.7}, 'code': ...}
    """
    try:
        words = Path(path).read_text().split()
    except OSError as exc:
        raise PackctlError(f"--blend {path}: cannot read it ({exc.strerror or exc})") from None
    except UnicodeDecodeError:
        raise PackctlError(f"--blend {path}: not a text file; a blend file is 'weight prefix weight prefix ...'") \
            from None
    if not words or len(words) % 2:
        raise PackctlError(f"--blend {path}: expected pairs of 'weight prefix' (Megatron's --data-path), found "
                           f"{len(words)} words")
    sources: dict[str, dict] = {}
    for i in range(0, len(words), 2):
        weight, prefix = words[i], words[i + 1]
        try:
            value = float(weight)
        except ValueError:
            raise PackctlError(f"--blend {path}: {weight!r} (word {i + 1}) is not a weight; expected "
                               "'weight prefix weight prefix ...'") from None
        if not math.isfinite(value):
            raise PackctlError(f"--blend {path}: weight {weight!r} of {prefix} must be a finite number > 0")
        name = base = os.path.basename(prefix.removesuffix(".idx").removesuffix(".bin")) or prefix
        n = 2
        while name in sources:
            name, n = f"{base}-{n}", n + 1
        target = prefix if prefix.endswith(".idx") else prefix.removesuffix(".bin") + ".idx"
        sources[name] = {"path": target, "weight": value}
    return sources


def with_blend(config: PackConfig) -> PackConfig:
    """`config` with the sources of its --blend file, when it names one."""
    if config.blend is None:
        return config
    if config.sources:
        raise PackctlError(f"--blend {config.blend} with --source: give the sources one way")
    import dataclasses

    return dataclasses.replace(config, sources=read_blend(config.blend))


def resolve_sources(entries: list[SourceEntry], split: str | None = None, **options) -> tuple[Resolution, list[int]]:
    """Each source's paths resolved on their own (identity checks, links and outputs as for INPUT),
    the files joined in source order; and where each source's files start (len(entries) + 1).
    `options`: the other keywords of `resolve`, passed on as they are."""
    specs: list[str] = []
    files = []
    starts = [0]
    seen: dict[tuple[int, int], str] = {}
    kind, first = None, None
    for entry in entries:
        resolution = resolve([normalize_spec(p) for p in entry.paths], split=split, **options)
        if kind is None:
            kind, first = resolution.kind, entry.name
        elif resolution.files and resolution.kind is not kind:  # one run reads one kind of input
            raise PackctlError(f"--source {entry.name} holds {resolution.kind.name} files and --source {first} "
                               f"{kind.name} files; a blend reads one kind of input")
        for f in resolution.files:
            if (f.device, f.inode) in seen:
                raise PackctlError(f"--source {entry.name}: {f.path} is read by --source {seen[(f.device, f.inode)]} "
                                   "too; every file belongs to one source")
            seen[(f.device, f.inode)] = entry.name
        if not resolution.files:
            raise PackctlError(f"--source {entry.name}: {', '.join(entry.paths)} holds no input file")
        specs += resolution.specs
        files += resolution.files
        starts.append(len(files))
    return Resolution(specs=specs, files=files, kind=kind), starts
