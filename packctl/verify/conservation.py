"""Conservation: every input sample is in the output exactly once, with its own tokens and labels,
or is accounted for by the manifest as dropped, truncated or split.

The output is read shard by shard and the source file by file, so memory holds one shard or one
source file plus a few integers per sequence, never the corpus. Each side is reduced to a 64-bit
fingerprint per output sequence (order-sensitive: a hash of every (position, value) pair, summed),
computed with numpy over the whole shard or file; fingerprints that differ are then read again
token by token to say where.

    source  sample 7: t0 t1 t2 t3 t4 t5 t6 t7 t8 t9       labels  .  .  l2 l3 ... l9   (a masked prompt)
    output  sample 7 split in two pieces (in output order):
            piece 0 = t0..t5  labels  .  .  l2 l3 l4 l5
            piece 1 = t6..t9  labels  .  l7 l8 l9          (-100 at every sequence start)

The global sample id of row r of input file f is `rows before f + r`, files in the manifest's
`inputs` order; the pieces of a sample are matched to consecutive slices of it in output order.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from packctl.arrays import offsets_of, positions_in_segments, ranges
from packctl.config import FIELDS, PackConfig, parse_sources
from packctl.contract import tree
from packctl.contract.schema import IGNORE_INDEX, INPUT_IDS, LABELS, PARENT_SEGMENTS, SEQ_LENS, SEQ_LENS_PADDED
from packctl.errors import PackctlError
from packctl.source import parquet as reader
from packctl.source.files import open_parquet
from packctl.source.resolve import resolve
from packctl.contract.thd import PackRows
from packctl.verify.pack_rules import tiled_starts
from packctl.verify.violation import Violation
from packctl.source.index import Block, describe_gid
from packctl.source.kinds import InputKind, InputOptions, kind_of_paths, options_of

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_LABEL_SALT = np.uint64(0xD6E8FEB86659FD93)


def splitmix64(z: np.ndarray) -> np.ndarray:
    """The splitmix64 finalizer, elementwise over uint64 (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = z + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _MIX1
        z = (z ^ (z >> np.uint64(27))) * _MIX2
        return z ^ (z >> np.uint64(31))


def segment_fingerprints(values: np.ndarray, lens: np.ndarray, salt: np.uint64 = np.uint64(0)) -> np.ndarray:
    """One uint64 per segment of `values` (segments of `lens`, concatenated): the wrapping sum of
    splitmix64(value ^ splitmix64(position in segment)). Equal segments give equal fingerprints;
    a changed, moved, missing or extra value changes it (but for a 2^-64 chance).

        segment_fingerprints([5, 6, 7], [2, 1]) -> [fp(5, 6), fp(7)]
    """
    lens = np.asarray(lens, dtype=np.int64)
    values = np.asarray(values).astype(np.int64, copy=False).view(np.uint64)
    longest = int(lens.max()) if len(lens) else 0
    position_keys = splitmix64(np.arange(longest, dtype=np.uint64) ^ salt)
    mixed = splitmix64(values ^ position_keys[positions_in_segments(lens)])
    with np.errstate(over="ignore"):
        sums = np.concatenate([np.zeros(1, np.uint64), np.cumsum(mixed, dtype=np.uint64)])
        ends = offsets_of(lens)
        return sums[ends[1:]] - sums[ends[:-1]]


@dataclass
class OutputPieces:
    """Every sequence of the output, in output order: where it is, its sample, length and fingerprints."""

    shard_names: list[str] = field(default_factory=list)
    unreadable: list[str] = field(default_factory=list)
    _parts: list[tuple[np.ndarray, ...]] = field(default_factory=list)

    def add(self, shard: str, rows: PackRows | None) -> None:
        """Fingerprint the real tokens and labels of every sequence of one shard."""
        index = len(self.shard_names)
        self.shard_names.append(shard)
        starts = None if rows is None else tiled_starts(rows)
        if starts is None:
            self.unreadable.append(shard)
            return
        lens = np.asarray(rows.seq_lens, dtype=np.int64)
        real = ranges(starts[:-1], lens)
        seq_offsets = np.asarray(rows.seq_offsets, dtype=np.int64)
        row = np.repeat(np.arange(len(seq_offsets) - 1), np.diff(seq_offsets))
        keep = np.arange(len(lens))
        if rows.parent_segments is not None:  # --share-prefix: each row is its chain of segments
            keep, real, lens = _rebuilt_rows(rows, starts)
        self._parts.append((
            np.full(len(keep), index, dtype=np.int32), row[keep], keep - seq_offsets[row[keep]],
            np.asarray(rows.sample_ids, dtype=np.int64)[keep], lens,
            segment_fingerprints(np.asarray(rows.input_ids)[real], lens),
            segment_fingerprints(np.asarray(rows.labels)[real], lens, _LABEL_SALT),
        ))

    def arrays(self) -> tuple[np.ndarray, ...]:
        """(shard, row, sequence in row, sample id, length, token fp, label fp), concatenated."""
        if not self._parts:
            empty = np.zeros(0, np.int64)
            return (empty.astype(np.int32), empty, empty, empty, empty, empty.view(np.uint64), empty.view(np.uint64))
        return tuple(np.concatenate([p[k] for p in self._parts]) for k in range(7))


def _rebuilt_rows(rows: PackRows, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rows of tree packs (--share-prefix): the sequences that hold an input row (sample id >= 0)
    and, for each, the flat positions of its chain (ancestors root first, then itself) and its
    length (`packctl.contract.tree.row_positions`); a prefix segment (sample id -1) is in the rows
    that continue it. A parent out of place (rule `tree-parents`) leaves the sequence as it is.

        segments [1 2 3] [4 7 8] [4 9], parents [-1 0 0], sample ids [-1 5 6]
        -> sequences [1, 2], positions [0 1 2 3 4 5 | 0 1 2 6 7], lengths [6, 5]
    """
    parents = tree.flat_parents(rows.seq_offsets, rows.parent_segments)
    found = tree.row_positions(parents, rows.seq_lens, starts, rows.sample_ids)
    return found.segments, found.positions, np.diff(found.offsets)


def _suffix_match(a: str, b: str) -> int:
    """How many trailing path components a and b share: data/x/a.parquet, x/a.parquet -> 2."""
    pa_, pb = Path(os.path.normpath(a)).parts, Path(os.path.normpath(b)).parts
    n = 0
    while n < min(len(pa_), len(pb)) and pa_[-1 - n] == pb[-1 - n]:
        n += 1
    return n


def source_options(manifest: dict[str, Any], tokenizer: str | None = None) -> InputOptions:
    """How the output's source is read: the manifest's options (its tokenizer, for an output
    packed from raw records), `tokenizer` given replacing the recorded one."""
    config = manifest.get("config") if isinstance(manifest.get("config"), dict) else {}
    return options_of(config, tokenizer)


def match_sources(manifest: dict[str, Any], sources: list[str], split: str | None = None,
                  tokenizer: str | None = None) -> list[str]:
    """The --source files in the manifest's `inputs` order (the global sample id order); of a
    directory holding dataset splits, those of `split`, by default the split the output was packed
    from (its manifest's `config.split`).

    A file matches a manifest input by its real path, else by the longest common path suffix (so
    the output can be verified from another working directory). Every input must be matched and
    every source file must be an input.
    """
    inputs = manifest.get("inputs")
    if not isinstance(inputs, list) or not inputs or not all(isinstance(i, dict) and "path" in i for i in inputs):
        raise PackctlError("the manifest lists no inputs, so --source cannot be matched to sample ids")
    config = manifest.get("config") if isinstance(manifest.get("config"), dict) else {}
    sources = _source_paths(manifest, sources)
    resolved = resolve(sources, split=split if split is not None else config.get("split"),
                       options=source_options(manifest, tokenizer)).paths
    by_real = {os.path.realpath(p): p for p in resolved}
    matched: list[str] = []
    for entry in inputs:
        want = str(entry["path"])
        hit = by_real.get(os.path.realpath(want))
        if hit is None:
            scores = [(_suffix_match(p, want), p) for p in resolved]
            best = max((s for s, _ in scores), default=0)
            candidates = [p for s, p in scores if s == best and best > 0]
            if len(candidates) != 1:
                raise PackctlError(
                    f"--source: {'no file' if not candidates else 'several files'} matches the input {want} of "
                    "this output; pass the INPUT given to packctl pack (the manifest lists them under 'inputs')")
            hit = candidates[0]
        matched.append(hit)
    if len(set(matched)) != len(matched):
        raise PackctlError("--source: one file matches several inputs of the manifest; pass the INPUT given to "
                           "packctl pack")
    extra = sorted(set(resolved) - set(matched))
    if extra:
        raise PackctlError(f"--source: {extra[0]} is not an input of this output (the manifest lists "
                           f"{len(inputs)} inputs); pass the INPUT given to packctl pack")
    return matched


def _source_paths(manifest: dict[str, Any], given: list[str]) -> list[str]:
    """The paths of --source as `pack --source` spells them for a blend, NAME=PATH[:WEIGHT[:CAP]]
    with NAME one of the manifest's sources (web=data/web:0.6 -> data/web); any other as it is."""
    table = manifest.get("sources")
    names = {t.get("name") for t in table if isinstance(t, dict)} if isinstance(table, list) else set()
    paths = []
    for text in given:
        name, sign, _ = str(text).partition("=")
        if sign and name in names and ":" in text:
            paths.append(parse_sources([text])[name]["path"])
        elif sign and name in names:
            paths.append(str(text).partition("=")[2])
        else:
            paths.append(text)
    return paths


def _pack_config(manifest: dict[str, Any]) -> PackConfig:
    config = manifest.get("config")
    if not isinstance(config, dict):
        raise PackctlError("the manifest has no 'config' object, so the over-long policy is unknown")
    try:
        return PackConfig(**{k: v for k, v in config.items() if k in FIELDS})
    except TypeError as exc:
        raise PackctlError(f"the manifest's config is not a packctl config ({exc})") from None


@dataclass
class ConservationResult:
    violations: list[Violation]
    summary: dict[str, Any]


def check_conservation(out: Path, manifest: dict[str, Any], paths: list[str], pieces: OutputPieces, *,
                       details: int = 5, advance: Callable[[int], None] = lambda n: None,
                       tokenizer: str | None = None) -> ConservationResult:
    """Every source sample against the output's pieces; see the module docstring. `advance(1)`
    after each source file is compared (progress).

    `paths` are the source files in the manifest's `inputs` order (`match_sources`); `details`
    bounds how many differing sequences are read again to name their first differing token.
    """
    config = _pack_config(manifest)
    tokens_column = config.tokens_column
    labels_column = manifest["config"].get("labels_column")
    options = dataclasses.replace(source_options(manifest, tokenizer), tokens_column=tokens_column,
                                  labels_column=labels_column)
    kind = kind_of_paths(paths, options)
    skip_empty = bool(manifest["config"].get("skip_empty", False))
    shard_of, row_of, seq_of, sample_ids, lens, token_fp, label_fp = pieces.arrays()
    found: list[Violation] = []
    names = pieces.shard_names

    def where(p: int) -> str:
        return f"{names[shard_of[p]]} row {row_of[p]} sequence {seq_of[p]}"

    for shard in pieces.unreadable:
        found.append(Violation("conservation", "shard-unreadable", "the shard's sequences could not be read, so "
                               "its samples count as missing (see the structure failures)", shard=shard))

    # Source rows per file, in manifest order: the gid ranges.
    file_rows = np.array([_source_rows(kind, p, options) for p in paths], dtype=np.int64)
    for entry, path, rows in zip(manifest["inputs"], paths, file_rows):
        if "rows" in entry and int(entry["rows"]) != rows:
            raise PackctlError(f"--source {path}: {rows} rows, but the output was packed from {entry['rows']}; "
                               "the source changed since packing, so sample ids no longer match")
    file_offsets = offsets_of(file_rows)
    n_src = int(file_offsets[-1])

    in_range = (sample_ids >= 0) & (sample_ids < n_src)
    if not in_range.all():
        p = int(np.argmax(~in_range))
        found.append(Violation("conservation", "sample-ids", f"sample id {sample_ids[p]} is outside the source's "
                               f"{n_src} samples", shard=names[shard_of[p]], row=int(row_of[p]),
                               sequence=int(seq_of[p]), count=int(np.count_nonzero(~in_range))))
    valid = np.flatnonzero(in_range)
    order = valid[np.argsort(sample_ids[valid], kind="stable")]  # pieces by sample, in output order
    sorted_ids = sample_ids[order]
    piece_start = np.zeros(len(sample_ids), dtype=np.int64)
    if len(order):
        before = np.cumsum(lens[order]) - lens[order]
        first_of_sample = np.searchsorted(sorted_ids, sorted_ids, side="left")
        piece_start[order] = before - before[first_of_sample]

    blend = _blend_of(manifest, config)
    src_len = np.zeros(n_src, dtype=np.int64)
    src_token_fp = np.zeros(len(sample_ids), dtype=np.uint64)
    src_label_fp = np.zeros(len(sample_ids), dtype=np.uint64)
    for f, path in enumerate(paths):
        # The whole file, validated; an output packed with --skip-empty left its empty rows out.
        decoded = _decode_source(kind, path, int(file_rows[f]), options, skip_empty)
        src_len[file_offsets[f]:file_offsets[f + 1]] = np.diff(decoded.offsets)
        lo, hi = np.searchsorted(sorted_ids, [file_offsets[f], file_offsets[f + 1]])
        sel = order[lo:hi]
        rows = sample_ids[sel] - file_offsets[f]
        if blend is not None:  # a row drawn u times: u runs of pieces, each a whole use of it
            piece_start[sel] %= np.maximum(_per_use(np.diff(decoded.offsets), config)[rows], 1)
        take = np.clip(np.minimum(lens[sel], np.diff(decoded.offsets)[rows] - piece_start[sel]), 0, None)
        idx = ranges(decoded.offsets[rows] + piece_start[sel], take)
        src_token_fp[sel] = segment_fingerprints(decoded.tokens[idx], take)
        labels = (decoded.tokens if decoded.labels is None else decoded.labels)[idx].copy()
        labels[offsets_of(take)[:-1][take > 0]] = IGNORE_INDEX
        src_label_fp[sel] = segment_fingerprints(labels, take, _LABEL_SALT)
        advance(1)

    count = np.bincount(sample_ids[valid], minlength=n_src)
    covered = np.bincount(sample_ids[valid], weights=lens[valid], minlength=n_src).astype(np.int64)
    if blend is not None:
        check = _BlendCheck(out=out, manifest=manifest, config=config, blend=blend, pieces=pieces, kind=kind,
                            paths=paths, file_offsets=file_offsets, where=where, details=details)
        held = _Coverage(src_len=src_len, covered=covered, count=count, sample_ids=sample_ids, valid=valid, lens=lens,
                         piece_start=piece_start, tokens_differ=src_token_fp != token_fp,
                         labels_differ=src_label_fp != label_fp)
        return _blend_conservation(check, held, found)
    over_long = (src_len + config.align - 1) // config.align * config.align > config.plan_capacity

    def describe(gid: int) -> str:
        return f"sample {gid} ({describe_gid(kind, paths, file_offsets, gid)}, {src_len[gid]} tokens)"

    def pieces_of(gid: int, limit: int = 3) -> str:
        lo, hi = np.searchsorted(sorted_ids, [gid, gid + 1])
        shown = "; ".join(where(int(p)) for p in order[lo:min(hi, lo + limit)])
        return shown + (" ..." if hi - lo > limit else "")

    missing = count == 0
    allowed_drop = over_long if config.too_long == "drop" else np.zeros(n_src, dtype=bool)
    limits = dict(config.limits or {})
    src_extra = _source_limit_values(paths, file_rows, tuple(limits)) if limits else None
    if src_extra is not None and config.too_long == "drop":  # a sample over a --limit is dropped too
        allowed_drop = allowed_drop | (src_extra > np.array(list(limits.values()), np.int64)).any(axis=1)
    allowed_drop |= (src_len == 0) & skip_empty
    unexpected = missing & ~allowed_drop
    if unexpected.any():
        gid = int(np.argmax(unexpected))
        why = ("it fits the capacity" + (" and every --limit" if limits else "") if not over_long[gid]
               else f"the over-long policy is too_long={config.too_long}, which drops nothing")
        found.append(Violation("conservation", "sample-missing", f"{describe(gid)} is not in the output; {why}",
                               count=int(unexpected.sum())))
    def at_last_piece(gid: int) -> dict[str, Any]:
        p = int(order[np.searchsorted(sorted_ids, gid, side="right") - 1])
        return {"shard": names[shard_of[p]], "row": int(row_of[p]), "sequence": int(seq_of[p])}

    duplicated = covered > src_len
    if duplicated.any():
        gid = int(np.argmax(duplicated))
        found.append(Violation(
            "conservation", "sample-duplicated",
            f"{describe(gid)} appears {count[gid]} times holding {covered[gid]} tokens: duplicated "
            f"(at {pieces_of(gid)})", **at_last_piece(gid), count=int(duplicated.sum())))
    short = (count > 0) & (covered < src_len)
    # A truncated sample keeps its first plan_capacity tokens (which --algorithm split may cut in pieces).
    truncated = short & over_long & (covered == config.plan_capacity) & (config.too_long == "truncate")
    incomplete = short & ~truncated
    if incomplete.any():
        gid = int(np.argmax(incomplete))
        found.append(Violation("conservation", "sample-incomplete",
                               f"{describe(gid)}: the output holds only {covered[gid]} of its tokens "
                               f"(at {pieces_of(gid)})", **at_last_piece(gid), count=int(incomplete.sum())))
    split = (count > 1) & ~duplicated & ~incomplete

    counts = manifest.get("counts", {})
    for name, actual in (("sequences_dropped", int(missing.sum())), ("sequences_truncated", int(truncated.sum())),
                         ("sequences_split", int(split.sum())), ("tokens_dropped", int(src_len[missing].sum())),
                         ("tokens_truncated", int((src_len - covered)[truncated].sum())),
                         ("tokens_in", int(src_len.sum())), ("sequences_in", n_src),
                         ("sequences_skipped_empty", int((missing & (src_len == 0)).sum()))):
        if name in counts and int(counts[name]) != actual:
            found.append(Violation("conservation", "manifest-counts",
                                   f"the source and output give {name} = {actual}, the manifest says {counts[name]}"))

    if src_extra is not None:
        found += _limit_values(out, pieces, limits, src_extra, sample_ids, in_range, where)

    # Content, for pieces of samples whose coverage is right (the others are reported above).
    flagged = duplicated | incomplete
    content_bad = (src_token_fp != token_fp) | (src_label_fp != label_fp)
    content_bad[valid[flagged[sample_ids[valid]]]] = False
    content_bad[~in_range] = False
    bad = np.flatnonzero(content_bad)
    for p in bad[:details]:
        found.append(_diagnose(out, names[shard_of[p]], int(row_of[p]), int(seq_of[p]), int(sample_ids[p]),
                               int(piece_start[p]), describe(int(sample_ids[p])), paths, file_offsets,
                               kind, options))
    if len(bad) > details:
        found.append(Violation("conservation", "content", f"{len(bad) - details} more sequences differ from the "
                               "source", count=len(bad) - details))
    summary = {
        "source_files": len(paths), "samples": n_src, "samples_packed": int((count > 0).sum()),
        "dropped": int(missing.sum()), "truncated": int(truncated.sum()), "split": int(split.sum()),
        "tokens_compared": int(lens[valid].sum()), "sequences_differing": int(len(bad)),
    }
    return ConservationResult(found, summary)


def _blend_of(manifest: dict[str, Any], config: PackConfig) -> dict[str, Any] | None:
    """The blend an output of `--source` was drawn from: its sources' gid runs (the manifest's
    `sources`), weights, caps and size (its config); None for an output of one INPUT."""
    table = manifest.get("sources")
    if not isinstance(table, list) or not config.sources:
        return None
    entries = config.source_entries()
    total = sum(e.weight for e in entries)
    names = [e.name for e in entries]
    try:
        starts = [int(table[0]["gids"][0])] + [int(t["gids"][1]) for t in table]
    except (KeyError, IndexError, TypeError, ValueError):
        raise PackctlError("the manifest's sources table has no gid runs, so the blend cannot be drawn again") \
            from None
    return {"names": names, "starts": starts, "weights": [e.weight / total for e in entries],
            "caps": [e.max_repeat if e.max_repeat is not None else config.max_repeat for e in entries],
            "epochs_of": names.index(config.epochs_of) if config.epochs_of is not None else None}


def _per_use(lengths: np.ndarray, config: PackConfig) -> np.ndarray:
    """The tokens one use of each sample puts in the output: all of them, the capacity of an
    over-long one that --too-long truncate cuts, none of one that drop leaves out."""
    per_use = np.asarray(lengths, dtype=np.int64).copy()
    over = (per_use + config.align - 1) // config.align * config.align > config.plan_capacity
    if config.too_long == "truncate":
        per_use[over] = config.plan_capacity
    elif config.too_long == "drop":
        per_use[over] = 0
    return per_use


def _source_group_starts(paths: list[str], column: str) -> np.ndarray:
    """The gid where each run of equal values of `column` starts over the source files, plus the
    number of rows (source/groups.py reads them so for pack)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    try:
        values = pa.chunked_array([c for p in paths for c in pq.read_table(p, columns=[column]).column(column).chunks])
    except (pa.ArrowException, OSError, KeyError) as exc:
        raise PackctlError(f"--group-column {column}: cannot read it from the sources ({exc}); pass the sources "
                           "given to packctl pack") from None
    values = values.combine_chunks()
    n = len(values)
    changed = pc.not_equal(values.slice(1), values.slice(0, n - 1)).to_numpy(zero_copy_only=False) if n else []
    return np.concatenate([[0], np.flatnonzero(changed) + 1, [n]]).astype(np.int64) if n else np.zeros(1, np.int64)


@dataclass(frozen=True)
class _BlendCheck:
    """What a blend's conservation checks against: the output (`out`, its `manifest` and `pieces`),
    the options it was verified with, the blend read from the manifest (`_blend_of`), and the
    sources' files (`paths`, read as `kind`; file f holds gids file_offsets[f]:file_offsets[f+1]);
    `where` names a piece, `details` caps the differing sequences diagnosed one by one."""

    out: Path
    manifest: dict[str, Any]
    config: PackConfig
    blend: dict[str, Any]
    pieces: OutputPieces
    kind: InputKind
    paths: list[str]
    file_offsets: np.ndarray
    where: Callable[[int], str]
    details: int


@dataclass(frozen=True)
class _Coverage:
    """What the output holds of the sources, one value a source gid (`src_len`: its true length,
    `covered`: its tokens in the output, `count`: its pieces) or one a piece (`sample_ids`, `lens`,
    `piece_start` within its use, whether its tokens or labels differ from the source's); `valid`:
    the pieces whose sample id is a gid of the sources.

        gid 7 of 40 tokens drawn twice, each use one piece: covered[7] = 80, count[7] = 2"""

    src_len: np.ndarray
    covered: np.ndarray
    count: np.ndarray
    sample_ids: np.ndarray
    valid: np.ndarray
    lens: np.ndarray
    piece_start: np.ndarray
    tokens_differ: np.ndarray
    labels_differ: np.ndarray


def _blend_conservation(check: _BlendCheck, held: _Coverage, found: list[Violation]) -> ConservationResult:
    """Conservation of a blend, source by source: the draw done again from the source's lengths
    (plan/mixture.py `draw_blend`, the one draw of pack), and every row in the output exactly as
    many times as it was drawn, each use whole (or cut as --too-long says), with its own tokens.

        web row 7 drawn twice, 40 tokens: the output holds 80 tokens of sample 7, in pieces that
        rebuild it twice"""
    from packctl.plan.mixture import Blend, EmptySource, RepeatOverCap, blend_groups, draw_blend, member_uses

    out, manifest, config, blend, pieces = check.out, check.manifest, check.config, check.blend, check.pieces
    kind, paths, file_offsets, where, details = check.kind, check.paths, check.file_offsets, check.where, check.details
    src_len, covered, count, sample_ids, valid = held.src_len, held.covered, held.count, held.sample_ids, held.valid
    lens, piece_start = held.lens, held.piece_start

    groups = None
    if config.group_column is not None:  # whole groups are drawn: every row as often as its group
        groups = blend_groups(_source_group_starts(paths, config.group_column), blend["starts"])
    try:
        asked = Blend(gid_starts=blend["starts"], weights=blend["weights"], caps=blend["caps"], unit=config.mix_unit,
                      size=config.tokens, epochs_of=blend["epochs_of"], seed=config.seed)
        draw, gids = draw_blend(src_len, asked, skip_empty=config.skip_empty, group_starts=groups)
    except (RepeatOverCap, EmptySource) as exc:
        raise PackctlError(f"--source: the source does not give the blend the output was drawn from "
                           f"({blend['names'][exc.source]}: {type(exc).__name__}); pass the sources given to "
                           "packctl pack") from None
    uses = member_uses(len(src_len), gids, draw.counts, groups)
    if config.skip_empty:
        uses[src_len == 0] = 0
    expected = uses * _per_use(src_len, config)
    source_of = np.searchsorted(np.asarray(blend["starts"]), np.arange(len(src_len)), side="right") - 1
    wrong = covered != expected
    if wrong.any():
        gid = int(np.argmax(wrong))
        found.append(Violation(
            "conservation", "source-uses",
            f"sample {gid} ({describe_gid(kind, paths, file_offsets, gid)}, {src_len[gid]} tokens) of source "
            f"{blend['names'][source_of[gid]]}: the output holds {covered[gid]} of its tokens in {count[gid]} "
            f"pieces, the blend draws it {uses[gid]} times ({expected[gid]} tokens)", count=int(wrong.sum())))
    content_bad = held.tokens_differ | held.labels_differ
    content_bad[valid[wrong[sample_ids[valid]]]] = False
    in_range = np.zeros(len(sample_ids), dtype=bool)
    in_range[valid] = True
    content_bad[~in_range] = False
    bad = np.flatnonzero(content_bad)
    shard_of, row_of, seq_of = pieces.arrays()[:3]
    for p in bad[:details]:
        gid = int(sample_ids[p])
        found.append(_diagnose(out, pieces.shard_names[shard_of[p]], int(row_of[p]), int(seq_of[p]), gid,
                               int(piece_start[p]), f"sample {gid} ({describe_gid(kind, paths, file_offsets, gid)})",
                               paths, file_offsets, config.tokens_column, manifest["config"].get("labels_column")))
    if len(bad) > details:
        found.append(Violation("conservation", "content", f"{len(bad) - details} more sequences differ from the "
                               "source", count=len(bad) - details))
    limits = dict(config.limits or {})
    if limits:  # each use of a sample carries its value of every limited column
        src_extra = _source_limit_values(paths, np.diff(file_offsets), tuple(limits))
        found += _limit_values(out, pieces, limits, src_extra, sample_ids, in_range, where)
    counts = manifest.get("counts", {})
    for name, actual in (("tokens_in", int((uses * src_len).sum())), ("sequences_in", int(uses.sum()))):
        if name in counts and int(counts[name]) != actual:
            found.append(Violation("conservation", "manifest-counts",
                                   f"the source and output give {name} = {actual}, the manifest says {counts[name]}"))
    summary = {
        "source_files": len(paths), "samples": len(src_len), "samples_packed": int((count > 0).sum()),
        "tokens_compared": int(lens[valid].sum()), "sequences_differing": int(len(bad)),
        "sources": [{"name": name, "rows_used": int(np.count_nonzero(uses[source_of == k])),
                     "uses": int(uses[source_of == k].sum())} for k, name in enumerate(blend["names"])],
    }
    return ConservationResult(found, summary)


def _source_limit_values(paths: list[str], file_rows: np.ndarray, columns: tuple[str, ...]) -> np.ndarray:
    """The --limit columns of every source sample (int64, samples x k), checked as pack checks them."""
    parts = []
    for path, rows in zip(paths, file_rows.tolist()):
        pf = open_parquet(path)
        for column in columns:
            reader.check_limit_column(path, pf.schema_arrow, column)
        first = 0  # the file's row where row group g starts
        for g in range(pf.metadata.num_row_groups):
            group_rows = pf.metadata.row_group(g).num_rows
            parts.append(reader.read_limit_values(path, g, first, columns, group_rows))
            first += group_rows
    return np.concatenate(parts) if parts else np.zeros((0, len(columns)), np.int64)


def _limit_values(out: Path, pieces: OutputPieces, limits: dict[str, int], src_extra: np.ndarray,
                  sample_ids: np.ndarray, in_range: np.ndarray, where) -> list[Violation]:
    """Rule `limit-values`: every sequence's value of each --limit column is its sample's in the
    source. The output's columns are read shard by shard (a shard that lacks them is `schema`)."""
    values = []
    for shard in pieces.shard_names:
        if shard in pieces.unreadable:
            continue
        try:
            table = pq.read_table(out / shard, columns=list(limits))
        except (OSError, ValueError, KeyError, pa.ArrowException):
            return []  # structure reports the shard's columns
        values.append(np.stack([table.column(c).combine_chunks().flatten().to_numpy().astype(np.int64)
                                for c in limits], axis=1))
    got = np.concatenate(values) if values else np.zeros((0, len(limits)), np.int64)
    if got.shape[0] != len(sample_ids):
        return []  # ragged columns: structure reports them (limit-sums)
    expected = np.zeros_like(got)
    expected[in_range] = src_extra[sample_ids[in_range]]
    bad = (got != expected).any(axis=1) & in_range
    if not bad.any():
        return []
    p = int(np.argmax(bad))
    j = int(np.argmax(got[p] != expected[p]))
    column = list(limits)[j]
    return [Violation("conservation", "limit-values", f"{where(p)}: {column} is {got[p, j]}, the source's sample "
                      f"{sample_ids[p]} has {expected[p, j]}", count=int(bad.sum()))]


def _source_rows(kind: InputKind, path: str, options: InputOptions) -> int:
    """The samples of one source input, as its kind counts them (a Megatron pair's documents)."""
    return kind.read_file(path, 0, options=options)[2]


def _decode_source(kind: InputKind, path: str, rows: int, options: InputOptions, skip_empty: bool):
    """A whole source input, validated as pack validates it (a Parquet file, or a Megatron pair's
    documents); an output packed with --skip-empty left its empty samples out."""
    whole = Block(file=0, row_group=None, first_row=0, rows=rows, nbytes=0)  # row_group None: the whole file
    return kind.decode(path, whole, options, skip_empty=skip_empty)


def _diagnose(out: Path, shard: str, row: int, seq: int, gid: int, start: int, sample: str, paths: list[str],
              file_offsets: np.ndarray, kind: InputKind, options: InputOptions) -> Violation:
    """Read one differing sequence and its source slice again, and say at which token they part."""
    is_tree = PARENT_SEGMENTS in pq.read_schema(out / shard).names
    columns = [INPUT_IDS, LABELS, SEQ_LENS, SEQ_LENS_PADDED] + ([PARENT_SEGMENTS] if is_tree else [])
    table = pq.read_table(out / shard, columns=columns).slice(row, 1)
    seq_lens = table.column(SEQ_LENS)[0].as_py()
    starts = offsets_of(np.asarray(table.column(SEQ_LENS_PADDED)[0].as_py(), dtype=np.int64))
    chain = [seq]  # with --share-prefix the row is its chain of segments, root first
    parents = table.column(PARENT_SEGMENTS)[0].as_py() if is_tree else [-1] * len(seq_lens)
    while 0 <= parents[chain[-1]] < chain[-1]:
        chain.append(parents[chain[-1]])
    where = np.concatenate([np.arange(starts[t], starts[t] + seq_lens[t]) for t in reversed(chain)]).astype(np.int64)
    n = len(where)
    out_tokens = np.asarray(table.column(INPUT_IDS)[0].as_py(), dtype=np.int64)[where]
    out_labels = np.asarray(table.column(LABELS)[0].as_py(), dtype=np.int64)[where]
    f = int(np.searchsorted(file_offsets, gid, side="right") - 1)
    src_tokens, src_labels = _source_row(kind, paths[f], gid - int(file_offsets[f]), options)
    src_tokens, src_labels = src_tokens[start:start + n], src_labels[start:start + n]
    if len(src_labels):
        src_labels[0] = IGNORE_INDEX
    span = f"{sample}, tokens {start}..{start + n - 1} of the sample"
    if len(src_tokens) != n:
        message = f"{span}: the source has only {len(src_tokens)} of these tokens"
        rule = "sample-incomplete"
    elif not np.array_equal(out_tokens, src_tokens):
        k = int(np.argmax(out_tokens != src_tokens))
        message = (f"{span}: token {k} of the sequence is {out_tokens[k]}, the source has {src_tokens[k]} "
                   f"({int(np.count_nonzero(out_tokens != src_tokens))} tokens differ)")
        rule = "tokens"
    else:
        k = int(np.argmax(out_labels != src_labels))
        message = (f"{span}: label {k} of the sequence is {out_labels[k]}, expected {src_labels[k]} (the source "
                   f"label; {IGNORE_INDEX} at the first token of every sequence)")
        rule = LABELS  # the rule is named after the column
    return Violation("conservation", rule, message, shard=shard, row=row, sequence=seq)


def _source_row(kind: InputKind, path: str, row: int, options: InputOptions) -> tuple[np.ndarray, np.ndarray]:
    """Tokens and labels (int64) of one row of a source input, from the one block that holds it."""
    _, blocks, _ = kind.read_file(path, 0, options=options)
    block = next(b for b in blocks if b.first_row <= row < b.first_row + b.rows)
    decoded = kind.decode(path, block, options, skip_empty=True)
    r = row - block.first_row
    tokens, labels = decoded.gather(np.array([r]), np.array([0]), np.diff(decoded.offsets)[r:r + 1])
    return tokens.astype(np.int64), labels.astype(np.int64)

