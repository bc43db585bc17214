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
    source = _open_source(manifest, config, paths, tokenizer)
    table = _PieceTable.of(pieces)
    found = [Violation("conservation", "shard-unreadable", "the shard's sequences could not be read, so its "
                       "samples count as missing (see the structure failures)", shard=shard)
             for shard in pieces.unreadable]
    found += _ids_outside(table, source.samples)
    blend = _blend_of(manifest, config)
    held = _coverage(source, table, config, drawn=blend is not None, advance=advance)
    check = _Check(out=out, manifest=manifest, config=config, blend=blend, pieces=pieces, table=table,
                   source=source, details=details)
    if blend is not None:
        return _blend_conservation(check, held, found)
    return _input_conservation(check, held, found)


@dataclass(frozen=True)
class _Source:
    """The source of an output as verify reads it: its files (`paths`, in the manifest's `inputs`
    order) read as `kind` with `options`, file f holding the gids file_offsets[f]:file_offsets[f+1];
    `skip_empty`: the output was packed with --skip-empty, which left the empty samples out.

        files of 3 and 2 rows: file_offsets [0 3 5]; gid 4 is row 1 of the second file"""

    kind: InputKind
    options: InputOptions
    paths: list[str]
    file_offsets: np.ndarray
    skip_empty: bool

    @property
    def samples(self) -> int:
        return int(self.file_offsets[-1])

    def sample(self, gid: int, tokens: int) -> str:
        """A sample as messages name it: 'sample 4 (data/b.parquet row 1, 40 tokens)'."""
        return f"sample {gid} ({describe_gid(self.kind, self.paths, self.file_offsets, gid)}, {tokens} tokens)"

    def decode(self, f: int):
        """The whole of file f, validated as pack validates it (a Parquet file, or a Megatron pair's
        documents)."""
        rows = int(self.file_offsets[f + 1] - self.file_offsets[f])
        whole = Block(file=0, row_group=None, first_row=0, rows=rows, nbytes=0)  # row_group None: the whole file
        return self.kind.decode(self.paths[f], whole, self.options, skip_empty=self.skip_empty)

    def row(self, gid: int) -> tuple[np.ndarray, np.ndarray]:
        """Tokens and labels (int64) of sample `gid`, from the one block of its file that holds it."""
        f = int(np.searchsorted(self.file_offsets, gid, side="right") - 1)
        path, row = self.paths[f], gid - int(self.file_offsets[f])
        _, blocks, _ = self.kind.read_file(path, 0, options=self.options)
        block = next(b for b in blocks if b.first_row <= row < b.first_row + b.rows)
        decoded = self.kind.decode(path, block, self.options, skip_empty=True)
        r = row - block.first_row
        tokens, labels = decoded.gather(np.array([r]), np.array([0]), np.diff(decoded.offsets)[r:r + 1])
        return tokens.astype(np.int64), labels.astype(np.int64)


def _open_source(manifest: dict[str, Any], config: PackConfig, paths: list[str], tokenizer: str | None) -> _Source:
    """The output's source read with the manifest's options and token and label columns; each
    file's rows are checked against those the manifest recorded, as sample ids count them."""
    options = dataclasses.replace(source_options(manifest, tokenizer), tokens_column=config.tokens_column,
                                  labels_column=manifest["config"].get("labels_column"))
    kind = kind_of_paths(paths, options)
    file_rows = np.array([_source_rows(kind, p, options) for p in paths], dtype=np.int64)
    for entry, path, rows in zip(manifest["inputs"], paths, file_rows):
        if "rows" in entry and int(entry["rows"]) != rows:
            raise PackctlError(f"--source {path}: {rows} rows, but the output was packed from {entry['rows']}; "
                               "the source changed since packing, so sample ids no longer match")
    return _Source(kind=kind, options=options, paths=paths, file_offsets=offsets_of(file_rows),
                   skip_empty=bool(manifest["config"].get("skip_empty", False)))


@dataclass(frozen=True)
class _PieceTable:
    """The output's pieces (`OutputPieces.arrays`), one value a piece in output order: where it is
    (shard `names[shard[p]]`, `row`, `sequence` in the row), its sample id, length and fingerprints."""

    names: list[str]
    shard: np.ndarray
    row: np.ndarray
    sequence: np.ndarray
    sample_ids: np.ndarray
    lens: np.ndarray
    token_fp: np.ndarray
    label_fp: np.ndarray

    @classmethod
    def of(cls, pieces: OutputPieces) -> "_PieceTable":
        return cls(pieces.shard_names, *pieces.arrays())

    def where(self, p: int) -> str:
        """'data/train-00000.parquet row 3 sequence 1'."""
        return f"{self.names[self.shard[p]]} row {self.row[p]} sequence {self.sequence[p]}"

    def place(self, p: int) -> dict[str, Any]:
        """Piece p as a Violation locates it (shard, row, sequence)."""
        return {"shard": self.names[self.shard[p]], "row": int(self.row[p]), "sequence": int(self.sequence[p])}

    def listed(self, pieces: np.ndarray, limit: int = 3) -> str:
        """The first `limit` of `pieces`, where each is, '...' after them if there are more."""
        shown = "; ".join(self.where(int(p)) for p in pieces[:limit])
        return shown + (" ..." if len(pieces) > limit else "")


def _ids_outside(table: _PieceTable, samples: int) -> list[Violation]:
    """Rule `sample-ids`: every piece's sample id is a gid of the source (0 <= id < samples)."""
    outside = (table.sample_ids < 0) | (table.sample_ids >= samples)
    if not outside.any():
        return []
    p = int(np.argmax(outside))
    return [Violation("conservation", "sample-ids", f"sample id {table.sample_ids[p]} is outside the source's "
                      f"{samples} samples", **table.place(p), count=int(np.count_nonzero(outside)))]


@dataclass(frozen=True)
class _Check:
    """What conservation checks against: the output (`out`, its `manifest`, the `config` it was
    packed with, its `pieces` and their `table`), its `source`, and the blend it was drawn from
    (`_blend_of`; None for an output of one INPUT); `details` caps the differing sequences
    diagnosed one by one."""

    out: Path
    manifest: dict[str, Any]
    config: PackConfig
    blend: dict[str, Any] | None
    pieces: OutputPieces
    table: _PieceTable
    source: _Source
    details: int


@dataclass(frozen=True)
class _Coverage:
    """What the output holds of the sources, one value a source gid (`src_len`: its true length,
    `covered`: its tokens in the output, `count`: its pieces) or one a piece (`sample_ids`, `lens`,
    `piece_start` within its use, whether its tokens or labels differ from the source's); `valid`:
    the pieces whose sample id is a gid of the sources, `order` the same sorted by sample id (the
    pieces of a sample in output order) and `sorted_ids` their sample ids.

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
    order: np.ndarray
    sorted_ids: np.ndarray

    @property
    def in_range(self) -> np.ndarray:
        """One bool a piece: its sample id is a gid of the sources."""
        in_range = np.zeros(len(self.sample_ids), dtype=bool)
        in_range[self.valid] = True
        return in_range

    def pieces_of(self, gid: int) -> np.ndarray:
        """The pieces of sample `gid`, in output order."""
        lo, hi = np.searchsorted(self.sorted_ids, [gid, gid + 1])
        return self.order[lo:hi]

    def differing(self, flagged: np.ndarray) -> np.ndarray:
        """The pieces whose tokens or labels differ from the source's, but those of the samples
        `flagged` (one bool a gid: a wrong coverage, reported as such) and those outside the source."""
        content_bad = self.tokens_differ | self.labels_differ
        content_bad[self.valid[flagged[self.sample_ids[self.valid]]]] = False
        content_bad[~self.in_range] = False
        return np.flatnonzero(content_bad)


def _coverage(source: _Source, table: _PieceTable, config: PackConfig, *, drawn: bool,
              advance: Callable[[int], None]) -> _Coverage:
    """Each source file decoded once and compared with the pieces of its samples: a piece holds
    the slice of its sample that starts where the sample's pieces before it end; in a blend
    (`drawn`) within one use of the sample. `advance(1)` after each file.

        sample 7 of 10 tokens, pieces of 6 and 4: slices 0..5 and 6..9
        the same drawn twice, pieces of 10 and 10: slices 0..9 and 0..9"""
    sample_ids, lens, offsets = table.sample_ids, table.lens, source.file_offsets
    valid = np.flatnonzero((sample_ids >= 0) & (sample_ids < source.samples))
    order = valid[np.argsort(sample_ids[valid], kind="stable")]  # pieces by sample, in output order
    sorted_ids = sample_ids[order]
    piece_start = _piece_starts(lens, order, sorted_ids, len(sample_ids))
    src_len = np.zeros(source.samples, dtype=np.int64)
    src_token_fp = np.zeros(len(sample_ids), dtype=np.uint64)
    src_label_fp = np.zeros(len(sample_ids), dtype=np.uint64)
    for f in range(len(source.paths)):
        decoded = source.decode(f)
        lengths = np.diff(decoded.offsets)
        src_len[offsets[f]:offsets[f + 1]] = lengths
        lo, hi = np.searchsorted(sorted_ids, [offsets[f], offsets[f + 1]])
        sel = order[lo:hi]
        rows = sample_ids[sel] - offsets[f]
        if drawn:  # a row drawn u times: u runs of pieces, each a whole use of it
            piece_start[sel] %= np.maximum(_per_use(lengths, config)[rows], 1)
        src_token_fp[sel], src_label_fp[sel] = _slice_fingerprints(decoded, rows, piece_start[sel], lens[sel])
        advance(1)
    return _Coverage(
        src_len=src_len, sample_ids=sample_ids, valid=valid, lens=lens, piece_start=piece_start,
        covered=np.bincount(sample_ids[valid], weights=lens[valid], minlength=source.samples).astype(np.int64),
        count=np.bincount(sample_ids[valid], minlength=source.samples),
        tokens_differ=src_token_fp != table.token_fp, labels_differ=src_label_fp != table.label_fp,
        order=order, sorted_ids=sorted_ids)


def _piece_starts(lens: np.ndarray, order: np.ndarray, sorted_ids: np.ndarray, pieces: int) -> np.ndarray:
    """Where each piece starts in its sample: the tokens of the sample's pieces before it in output
    order (0 for a piece outside the source). Sample 7 in pieces of 6 and 4: starts 0 and 6."""
    piece_start = np.zeros(pieces, dtype=np.int64)
    if len(order):
        before = np.cumsum(lens[order]) - lens[order]
        first_of_sample = np.searchsorted(sorted_ids, sorted_ids, side="left")
        piece_start[order] = before - before[first_of_sample]
    return piece_start


def _slice_fingerprints(decoded, rows: np.ndarray, starts: np.ndarray, lens: np.ndarray
                        ) -> tuple[np.ndarray, np.ndarray]:
    """Token and label fingerprints of the source slices the pieces hold: of row rows[i] of a
    decoded file, lens[i] tokens from token starts[i] (fewer where the row ends), the first label
    of each IGNORE_INDEX, as the output has it at every sequence start."""
    take = np.clip(np.minimum(lens, np.diff(decoded.offsets)[rows] - starts), 0, None)
    idx = ranges(decoded.offsets[rows] + starts, take)
    labels = (decoded.tokens if decoded.labels is None else decoded.labels)[idx].copy()
    labels[offsets_of(take)[:-1][take > 0]] = IGNORE_INDEX
    return segment_fingerprints(decoded.tokens[idx], take), segment_fingerprints(labels, take, _LABEL_SALT)


@dataclass(frozen=True)
class _Fates:
    """What became of each sample of one INPUT in the output, one bool a gid: `over_long` (its
    aligned length over the capacity), `missing` (no piece), `duplicated` (more of its tokens than
    it has), `truncated` (its first plan_capacity tokens, as --too-long truncate keeps them),
    `incomplete` (fewer tokens, not so truncated), `split` (whole, in several pieces)."""

    over_long: np.ndarray
    missing: np.ndarray
    duplicated: np.ndarray
    truncated: np.ndarray
    incomplete: np.ndarray
    split: np.ndarray

    @classmethod
    def of(cls, held: _Coverage, config: PackConfig) -> "_Fates":
        over_long = (held.src_len + config.align - 1) // config.align * config.align > config.plan_capacity
        duplicated = held.covered > held.src_len
        short = (held.count > 0) & (held.covered < held.src_len)
        # A truncated sample keeps its first plan_capacity tokens (which --algorithm split may cut in pieces).
        truncated = short & over_long & (held.covered == config.plan_capacity) & (config.too_long == "truncate")
        incomplete = short & ~truncated
        return cls(over_long=over_long, missing=held.count == 0, duplicated=duplicated, truncated=truncated,
                   incomplete=incomplete, split=(held.count > 1) & ~duplicated & ~incomplete)


def _input_conservation(check: _Check, held: _Coverage, found: list[Violation]) -> ConservationResult:
    """Conservation of an output of one INPUT: every sample in it once, whole or split in pieces,
    or truncated or left out as --too-long, --limit and --skip-empty say, with its own tokens."""
    config, src_len, covered = check.config, held.src_len, held.covered
    fates = _Fates.of(held, config)
    limits = dict(config.limits or {})
    src_extra = (_source_limit_values(check.source.paths, np.diff(check.source.file_offsets), tuple(limits))
                 if limits else None)
    found += _missing(check, held, fates, src_extra)
    found += _first_sample(check, held, "sample-duplicated", fates.duplicated, lambda gid: (
        f" appears {held.count[gid]} times holding {covered[gid]} tokens: duplicated"))
    found += _first_sample(check, held, "sample-incomplete", fates.incomplete, lambda gid: (
        f": the output holds only {covered[gid]} of its tokens"))
    missing, truncated = fates.missing, fates.truncated
    found += _manifest_counts(check.manifest, {
        "sequences_dropped": int(missing.sum()), "sequences_truncated": int(truncated.sum()),
        "sequences_split": int(fates.split.sum()), "tokens_dropped": int(src_len[missing].sum()),
        "tokens_truncated": int((src_len - covered)[truncated].sum()), "tokens_in": int(src_len.sum()),
        "sequences_in": check.source.samples,
        "sequences_skipped_empty": int((missing & (src_len == 0)).sum())})
    if src_extra is not None:
        found += _limit_values(check.out, check.pieces, limits, src_extra, held.sample_ids, held.in_range,
                               check.table.where)
    # Content, for pieces of samples whose coverage is right (the others are reported above).
    bad = held.differing(fates.duplicated | fates.incomplete)
    found += _content(check, held, bad)
    summary = {
        "source_files": len(check.source.paths), "samples": check.source.samples,
        "samples_packed": int((held.count > 0).sum()), "dropped": int(missing.sum()),
        "truncated": int(truncated.sum()), "split": int(fates.split.sum()),
        "tokens_compared": int(held.lens[held.valid].sum()), "sequences_differing": int(len(bad)),
    }
    return ConservationResult(found, summary)


def _missing(check: _Check, held: _Coverage, fates: _Fates, src_extra: np.ndarray | None) -> list[Violation]:
    """Rule `sample-missing`: a sample is left out only where pack leaves it out, over the capacity
    or a --limit (`src_extra`: the source's --limit values) with --too-long drop, or empty with
    --skip-empty."""
    config = check.config
    limits = dict(config.limits or {})
    drops = config.too_long == "drop"
    allowed = fates.over_long & drops
    if src_extra is not None:  # a sample over a --limit is dropped too
        allowed |= (src_extra > np.array(list(limits.values()), np.int64)).any(axis=1) & drops
    allowed |= (held.src_len == 0) & check.source.skip_empty
    unexpected = fates.missing & ~allowed
    if not unexpected.any():
        return []
    gid = int(np.argmax(unexpected))
    why = ("it fits the capacity" + (" and every --limit" if limits else "") if not fates.over_long[gid]
           else f"the over-long policy is too_long={config.too_long}, which drops nothing")
    return [Violation("conservation", "sample-missing", f"{check.source.sample(gid, held.src_len[gid])} is not in "
                      f"the output; {why}", count=int(unexpected.sum()))]


def _first_sample(check: _Check, held: _Coverage, rule: str, flagged: np.ndarray,
                  wrong: Callable[[int], str]) -> list[Violation]:
    """`rule` broken by the samples `flagged` (one bool a gid), told of the first one, located at
    its last piece: the sample, `wrong(gid)`, and where its pieces are."""
    if not flagged.any():
        return []
    gid = int(np.argmax(flagged))
    pieces = held.pieces_of(gid)
    return [Violation("conservation", rule, f"{check.source.sample(gid, held.src_len[gid])}{wrong(gid)} "
                      f"(at {check.table.listed(pieces)})", **check.table.place(int(pieces[-1])),
                      count=int(flagged.sum()))]


def _manifest_counts(manifest: dict[str, Any], actual: dict[str, int]) -> list[Violation]:
    """Rule `manifest-counts`: each of the manifest's `counts` named in `actual` is the number
    that the source and output give."""
    counts = manifest.get("counts", {})
    return [Violation("conservation", "manifest-counts",
                      f"the source and output give {name} = {value}, the manifest says {counts[name]}")
            for name, value in actual.items() if name in counts and int(counts[name]) != value]


def _content(check: _Check, held: _Coverage, bad: np.ndarray) -> list[Violation]:
    """The first `details` of the differing pieces `bad`, each read again to say at which token
    it parts from its source, and one violation that counts the rest."""
    found = []
    for p in bad[:check.details]:
        gid = int(held.sample_ids[p])
        found.append(_diagnose(check, check.table.place(int(p)), gid, int(held.piece_start[p]),
                               check.source.sample(gid, held.src_len[gid])))
    if len(bad) > check.details:
        found.append(Violation("conservation", "content", f"{len(bad) - check.details} more sequences differ from "
                               "the source", count=len(bad) - check.details))
    return found


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


def _blend_conservation(check: _Check, held: _Coverage, found: list[Violation]) -> ConservationResult:
    """Conservation of a blend, source by source: the draw done again from the source's lengths
    (plan/mixture.py `draw_blend`, the one draw of pack), and every row in the output exactly as
    many times as it was drawn, each use whole (or cut as --too-long says), with its own tokens.

        web row 7 drawn twice, 40 tokens: the output holds 80 tokens of sample 7, in pieces that
        rebuild it twice"""
    config, blend, src_len = check.config, check.blend, held.src_len
    uses = _drawn_uses(check, src_len)
    expected = uses * _per_use(src_len, config)
    source_of = np.searchsorted(np.asarray(blend["starts"]), np.arange(len(src_len)), side="right") - 1
    wrong = held.covered != expected
    if wrong.any():
        gid = int(np.argmax(wrong))
        found.append(Violation(
            "conservation", "source-uses",
            f"{check.source.sample(gid, src_len[gid])} of source {blend['names'][source_of[gid]]}: the output holds "
            f"{held.covered[gid]} of its tokens in {held.count[gid]} pieces, the blend draws it {uses[gid]} times "
            f"({expected[gid]} tokens)", count=int(wrong.sum())))
    bad = held.differing(wrong)
    found += _content(check, held, bad)
    limits = dict(config.limits or {})
    if limits:  # each use of a sample carries its value of every limited column
        src_extra = _source_limit_values(check.source.paths, np.diff(check.source.file_offsets), tuple(limits))
        found += _limit_values(check.out, check.pieces, limits, src_extra, held.sample_ids, held.in_range,
                               check.table.where)
    found += _manifest_counts(check.manifest, {"tokens_in": int((uses * src_len).sum()),
                                               "sequences_in": int(uses.sum())})
    summary = {
        "source_files": len(check.source.paths), "samples": len(src_len),
        "samples_packed": int((held.count > 0).sum()), "tokens_compared": int(held.lens[held.valid].sum()),
        "sequences_differing": int(len(bad)),
        "sources": [{"name": name, "rows_used": int(np.count_nonzero(uses[source_of == k])),
                     "uses": int(uses[source_of == k].sum())} for k, name in enumerate(blend["names"])],
    }
    return ConservationResult(found, summary)


def _drawn_uses(check: _Check, src_len: np.ndarray) -> np.ndarray:
    """How many times the blend draws each source row (one count a gid), drawn again as pack drew
    it from the rows' lengths: whole groups with --group-column, no empty row with --skip-empty."""
    from packctl.plan.mixture import Blend, EmptySource, RepeatOverCap, blend_groups, draw_blend, member_uses

    config, blend = check.config, check.blend
    groups = None
    if config.group_column is not None:  # whole groups are drawn: every row as often as its group
        groups = blend_groups(_source_group_starts(check.source.paths, config.group_column), blend["starts"])
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
    return uses


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


def _diagnose(check: _Check, place: dict[str, Any], gid: int, start: int, sample: str) -> Violation:
    """Read one differing sequence (`place`: its shard, row and sequence) and the slice of its
    sample `gid` from token `start` again, and say at which token they part."""
    out_tokens, out_labels = _read_sequence(check.out / place["shard"], place["row"], place["sequence"])
    n = len(out_tokens)
    src_tokens, src_labels = check.source.row(gid)
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
    return Violation("conservation", rule, message, **place)


def _read_sequence(shard: Path, row: int, seq: int) -> tuple[np.ndarray, np.ndarray]:
    """Tokens and labels (int64) of sequence `seq` of row `row` of a shard; in a tree pack
    (--share-prefix), of the input row it rebuilds: its chain of segments, root first."""
    is_tree = PARENT_SEGMENTS in pq.read_schema(shard).names
    columns = [INPUT_IDS, LABELS, SEQ_LENS, SEQ_LENS_PADDED] + ([PARENT_SEGMENTS] if is_tree else [])
    table = pq.read_table(shard, columns=columns).slice(row, 1)
    seq_lens = table.column(SEQ_LENS)[0].as_py()
    starts = offsets_of(np.asarray(table.column(SEQ_LENS_PADDED)[0].as_py(), dtype=np.int64))
    chain = [seq]
    parents = table.column(PARENT_SEGMENTS)[0].as_py() if is_tree else [-1] * len(seq_lens)
    while 0 <= parents[chain[-1]] < chain[-1]:
        chain.append(parents[chain[-1]])
    where = np.concatenate([np.arange(starts[t], starts[t] + seq_lens[t]) for t in reversed(chain)]).astype(np.int64)
    tokens = np.asarray(table.column(INPUT_IDS)[0].as_py(), dtype=np.int64)[where]
    return tokens, np.asarray(table.column(LABELS)[0].as_py(), dtype=np.int64)[where]
