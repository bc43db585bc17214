"""What-if analysis of raw tokenized shards: every algorithm at the given settings, before packing.

Only the list lengths of the tokens column are kept (polars, lazy streamed scan of that one
column; labels are never read). Each (capacity, algorithm) is planned with the code `pack` runs
(`packctl.pipeline.plan.plan_corpus`: order, windows, the over-long policy, pack lengths) and measured
with `packctl.pipeline.report.assemble_metrics` (the summaries `pack` adds up over ranks), so a what-if row predicts exactly the packs `pack` would
write with the same
options, and equals the metrics.json it would write (but for `throughput` and `timings`).

    lengths [9, 9, 7, 20, 3, 6, 1], --capacity 16 --seq-multiple 2 --too-long split
    padded  [10, 10, 8, 16 + 4, 4, 6, 2]       (the 20 becomes a full chunk of 16 and a piece of 4)
    concat  [10] [10] [16] [8 4 4] [6 2]  -> 5 packs, utilization 55/80, efficiency 4/5
    ffd     [16] [10 6] [10 4 2] [8 4]    -> 4 packs, utilization 55/64, efficiency 1.0

With `--group-column` the groups are read as `pack` reads them (packctl.source.groups), ordered and
planned whole by the same code, and each row also says what keeping them whole costs: the
Martello-Toth bound over whole groups and the packs of the same options without groups
(`group_cost`). `split` is left out of the algorithms then, as `pack` refuses it with groups.

With `--limit COL=N` the limited columns are read in the same lazy scan as the lengths (one int64
value per row and column, `LengthIndex.extra`), checked as `pack` checks them, and planned with
them: each row has the `limits` and `packs_at_capacity` of pack's metrics.json, and `binding`,
the budget whose total alone needs the most packs (`packctl.stats.packed.binding_budget`).
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np
import polars as pl

from packctl.config import PLANNING_OPTIONS, PackConfig, as_python  # noqa: F401  (PLANNING_OPTIONS re-exported)
from packctl.errors import PackctlError
from packctl.source.files import FileFingerprint, open_parquet
from packctl.source.kinds import PARQUET, InputOptions, check_options, options_of
from packctl.mpi.comm import SingleComm
from packctl.source.parquet import check_limit_column, check_list_column, is_plain_list, list_lengths
from packctl.source.scan import index_inputs, scan_blocks
from packctl.source.resolve import resolve
from packctl.source.groups import read_group_starts
from packctl.specs import CarriedColumns
from packctl.plan.metrics import fill_histogram, length_histogram, length_summary, martello_toth_l2
from packctl.plan.groups import group_ids
from packctl.plan.windows import PackPlan
from packctl.pipeline.order import Ordered, order_corpus
from packctl.pipeline.plan import plan_corpus
from packctl.pipeline.prefix import share_prefix_lengths
from packctl.pipeline.report import Corpus, assemble_metrics
from packctl.plan import ALGORITHMS, pack_lengths
from packctl.plan.algorithms import cuts_items
from packctl.plan.align import round_up
from packctl.stats.lazy import collect_streaming
from packctl.stats.packed import binding_of
from packctl.source.index import InputFile, RowsByGid



@dataclass
class LengthIndex(RowsByGid):
    """Sequence lengths by global sample id, with the files they come from (gid order)."""

    files: list[InputFile]
    file_offsets: np.ndarray  # int64, len(files) + 1: gids of file f are file_offsets[f]:file_offsets[f+1]
    lengths: np.ndarray  # int64, one per gid
    tokens_column: str
    # --group-column: the gid where each group starts, then num_sequences (packctl.source.groups)
    group_starts: np.ndarray | None = None
    gid_lo: int = 0  # every gid is here, as on the one rank of `pack`
    # one per file: what was first read of it (packctl.source.resolve); later reads check it
    fingerprints: list[FileFingerprint] = dataclasses.field(default_factory=list)
    kind: Any = None  # the InputKind of the files (packctl.source.kinds), which names their rows
    # --limit COL=N: the limited columns (--limit order), and each row's value of each (int64 n x k;
    # None without): what pack's scan puts in SequenceIndex.limit_columns and .extra
    limit_columns: tuple[str, ...] = ()
    extra: np.ndarray | None = None
    # --share-prefix: the tokens each row's group stores once (pack's SequenceIndex.shared)
    shared: np.ndarray | None = None


def read_lengths(inputs: list[str], tokens_column: str = "input_ids", group_column: str | None = None, *,
                 skip_empty: bool = False, limit_columns: tuple[str, ...] = (), split: str | None = None,
                 options: InputOptions | None = None) -> LengthIndex:
    """Sequence lengths of raw tokenized shards, in global sample id order (and with
    `group_column`, where each group starts: `packctl.source.groups.read_group_starts`, which refuses
    a null or a group value found again with the error `pack` gives).

    Keeps only the list lengths of `tokens_column` (`pl.col(c).list.len()` over lazy scans of the
    one column, streamed): polars has no lengths-only Parquet read, so it still decompresses and
    decodes the column's pages, but drops them batch by batch, and the result is 8 bytes per
    sequence. Null and empty rows are refused as `pack` refuses them (empty ones kept as length 0
    with `skip_empty`, as `pack --skip-empty` leaves them out); token values are not checked here
    (`pack` checks them as it reads them).

    `limit_columns` (--limit): read in the same scan into `index.extra` (int64, n x k), each a
    per-row integer column with no null and no negative value, as `pack` requires
    (`check_limit_column`, `check_limit_values`).
    """
    options = options or InputOptions(tokens_column)
    resolution = resolve(inputs, split=split, options=options)
    check_options(resolution, tokens_column=tokens_column,
                  carried=CarriedColumns(group=group_column, limits=tuple(limit_columns)))
    if resolution.kind is not PARQUET:
        return _kind_lengths(resolution, options, skip_empty)
    paths = resolution.paths
    files = _checked_files(resolution, tokens_column, limit_columns)
    rows = np.array([f.rows for f in files], dtype=np.int64)
    index = LengthIndex(files=files, file_offsets=np.concatenate([[0], np.cumsum(rows)]).astype(np.int64),
                        lengths=np.zeros(0, np.int64), tokens_column=tokens_column,
                        fingerprints=[r.fingerprint for r in resolution.files], limit_columns=tuple(limit_columns),
                        kind=PARQUET)
    if group_column is not None and index.num_sequences:  # as pack, before any token is read
        index.group_starts = read_group_starts(index, group_column)

    # each limited column as int64, and whether the row holds a value at all (a uint64 above 2^63-1
    # casts to null: refused apart from a null)
    limits = [e for c in limit_columns for e in (pl.col(c).cast(pl.Int64, strict=False).alias(f"limit:{c}"),
                                                 pl.col(c).is_not_null().alias(f"given:{c}"))]

    def scan(path: str) -> pl.LazyFrame:
        if not is_plain_list(open_parquet(path).schema_arrow.field(tokens_column).type):
            # fixed_size_list and list views: polars reads them as arrays, or not at all
            frame = pl.from_arrow(list_lengths(path, tokens_column))
            if limit_columns:
                frame = pl.concat([frame, pl.scan_parquet(path, glob=False, hive_partitioning=False).select(
                    limits).collect()], how="horizontal")
            return frame.lazy()
        return pl.scan_parquet(path, glob=False, hive_partitioning=False).select(
            pl.col(tokens_column).list.len().cast(pl.Int64).alias("length"), *limits)

    try:
        frame = collect_streaming(pl.concat([scan(p) for p in paths]))
        lengths = frame.to_series(0)
    except pl.exceptions.PolarsError:
        for path in paths:  # name the file that fails
            try:
                collect_streaming(scan(path))
            except pl.exceptions.PolarsError as exc:
                raise PackctlError(f"{path}: cannot read column '{tokens_column}' ({_short(exc)}); "
                                   "the file may be truncated or corrupt") from None
        raise
    for f, resolved in enumerate(resolution.files):  # what polars read is what the footers described
        open_parquet(resolved.path, index.fingerprint(f))
    if len(lengths) != index.num_sequences:
        raise PackctlError(f"{', '.join(inputs)}: read {len(lengths)} rows but the Parquet footers count "
                           f"{index.num_sequences}; a file may be corrupt")
    if index.num_sequences == 0:
        raise PackctlError(f"{', '.join(inputs)}: the input holds no rows")
    if lengths.null_count():
        gid = int(lengths.is_null().arg_max())
        raise PackctlError(f"{index.describe(gid)}: null instead of a list; drop or fill null rows before packing")
    index.lengths = lengths.to_numpy().astype(np.int64)
    if limit_columns:
        index.extra = check_limit_values(index, frame, limit_columns)
    if not skip_empty and (index.lengths == 0).any():
        gid = int(np.argmax(index.lengths == 0))
        raise PackctlError(f"{index.describe(gid)}: empty sequence; remove empty rows or pass --skip-empty")
    return index


def _checked_files(resolution, tokens_column: str, limit_columns: tuple[str, ...]) -> list[InputFile]:
    """Each resolved Parquet file as an `InputFile` from its footer, once its tokens column is a
    list and each limited column is one `pack` accepts (refused in one line naming the file)."""
    files = []
    for resolved in resolution.files:
        pf = open_parquet(resolved.path, resolved.fingerprint)
        check_list_column(resolved.path, pf.schema_arrow, tokens_column, "tokens")
        for column in limit_columns:
            check_limit_column(resolved.path, pf.schema_arrow, column)
        files.append(InputFile(path=resolved.path, rows=pf.metadata.num_rows, bytes=resolved.fingerprint.size))
    return files


def check_limit_values(index: LengthIndex, frame: pl.DataFrame, columns: tuple[str, ...]) -> np.ndarray:
    """The limited columns of every row as int64 n x k: no null, no negative value, else the line
    `pack` gives (packctl.source.parquet.read_limit_values), 'FILE row R column C: ...', naming
    the first such row."""
    out = np.empty((index.num_sequences, len(columns)), dtype=np.int64)
    for j, column in enumerate(columns):
        values = frame.get_column(f"limit:{column}")

        def where(gid: int, column: str = column) -> str:
            return index.describe(gid, column)
        too_big = values.is_null() & frame.get_column(f"given:{column}")
        if too_big.any():  # rare: read the value back from its file, to name it as pack does
            gid = int(too_big.arg_max())
            f = int(np.searchsorted(index.file_offsets, gid, side="right") - 1)
            value = open_parquet(index.files[f].path).read(columns=[column]).column(column)[
                gid - int(index.file_offsets[f])].as_py()
            raise PackctlError(f"{where(gid)}: {value} is above 2^63-1; --limit {column}=N counts a sequence's cost "
                               "as int64: fix the value")
        if values.null_count():
            raise PackctlError(f"{where(int(values.is_null().arg_max()))}: null; --limit {column}=N needs a whole "
                               "number >= 0 on every sequence (0 where it has none): fill the row or drop it")
        out[:, j] = values.to_numpy()
        if (out[:, j] < 0).any():
            gid = int(np.argmax(out[:, j] < 0))
            raise PackctlError(f"{where(gid)}: {out[gid, j]} is negative; --limit {column}=N needs a whole number "
                               ">= 0 on every sequence: fix the value")
    return out


def _kind_lengths(resolution, options: InputOptions, skip_empty: bool) -> LengthIndex:
    """`read_lengths` of an input other than Parquet, through its kind (`packctl.source.kinds`):
    indexed and scanned as `pack` scans it, with every check `pack` makes (lengths from the `.idx`
    alone where the kind has them so, `InputKind.scan_lengths`; else each block decoded: raw
    records tokenized as `pack --tokenizer` tokenizes them)."""
    index = index_inputs(resolution, options)
    scanned = index.kind.scan_lengths(index, 0, len(index.blocks), skip_empty=skip_empty)
    if scanned is None:  # empty rows refused by the kind as `pack` refuses them
        scanned, _ = scan_blocks(index, range(len(index.blocks)), 0, skip_empty=skip_empty)
    lengths = LengthIndex(files=index.files, file_offsets=index.file_offsets, lengths=scanned.lengths,
                          tokens_column=index.tokens_column, fingerprints=index.fingerprints, kind=index.kind)
    return lengths


def read_blend_lengths(config: PackConfig) -> tuple[LengthIndex, list[int]]:
    """The lengths of a blend's sources (--source), each read as `read_lengths` reads an INPUT,
    joined in source order as `pack` joins them (packctl/source/mixture.py); and where each
    source's files start. With --group-column the group column is read over every source's files
    as over one input, as `pack` reads it (a value found in two sources is refused)."""
    from packctl.source.mixture import resolve_sources

    entries = config.source_entries()
    options = options_of(dataclasses.asdict(config))
    resolve_sources(entries, split=config.split, options=options)  # a file of two sources is refused as pack refuses it
    parts = [read_lengths(list(e.paths), config.tokens_column, config.group_column, skip_empty=config.skip_empty,
                          limit_columns=tuple(config.limits), split=config.split, options=options) for e in entries]
    files = [f for p in parts for f in p.files]
    rows = np.array([f.rows for f in files], dtype=np.int64)
    starts = np.cumsum([0] + [len(p.files) for p in parts]).tolist()
    extra = None if not config.limits else np.concatenate([p.extra for p in parts], axis=0)
    index = LengthIndex(files=files, file_offsets=np.concatenate([[0], np.cumsum(rows)]).astype(np.int64),
                        lengths=np.concatenate([p.lengths for p in parts]), tokens_column=config.tokens_column,
                        fingerprints=[f for p in parts for f in p.fingerprints], limit_columns=tuple(config.limits),
                        extra=extra, kind=parts[0].kind if parts else None)
    if config.group_column is not None and index.num_sequences:
        index.group_starts = read_group_starts(index, config.group_column)
    return index, starts


def _specs(config: PackConfig, index: LengthIndex, source_files: list[int] | None):
    """The specs `pack` plans with: with a blend, its draw and interleave in the order stage."""
    from packctl.pipeline.mixture import with_mixture

    return with_mixture(config.specs(), config, index, source_files)


def shared_lengths(inputs: list[str], config: PackConfig, group_starts: np.ndarray) -> np.ndarray:
    """--share-prefix: the tokens each row's group stores once, as `pack` finds them (every block
    decoded, each row compared with the one before it: pipeline/prefix.py)."""
    options = options_of(dataclasses.asdict(config))
    resolution = resolve(inputs, split=config.split, options=options)
    index = index_inputs(resolution, options, CarriedColumns(prefix=config.prefix_column))
    scanned, _ = scan_blocks(index, range(len(index.blocks)), 0, skip_empty=config.skip_empty, share_prefix=True)
    scanned.group_starts = group_starts
    return share_prefix_lengths(SingleComm(), scanned)


def what_if_row(index: LengthIndex, config: PackConfig, ordered: Ordered | None = None,
                ungrouped: Ordered | None = None, source_files: list[int] | None = None) -> dict[str, Any]:
    """One row of the what-if table: the `_metrics.json` `pack` writes for `config` (but for
    throughput and timings), plus `plan_seconds` and `fill_histogram`. `ordered` may pass a
    precomputed `order_corpus` result (it depends only on the order options, the alignment and the
    groups, not on capacity or algorithm). Batch mode and balancing (`--mode batch`, `--dp-size`)
    are planned as `pack` plans them, so the row has `batching` and `balance` as pack's metrics do.

    With groups (`index.group_starts`, --group-column) the row has `groups` as pack's metrics do
    (`packctl.pipeline.report.group_report`), and `group_cost` compares it with packing the same
    sequences one by one: the Martello-Toth bound over whole groups, and the packs and utilization
    of the same options without groups (`ungrouped`: a precomputed `order_corpus` of the index
    without groups). `source_files`: where each source of a blend starts (`read_blend_lengths`)."""
    specs = _specs(config, index, source_files)
    t0 = time.perf_counter()
    planned = plan_corpus(index, specs, ordered)
    plan_seconds = time.perf_counter() - t0
    skipped = int(np.count_nonzero(index.lengths == 0)) if config.skip_empty else 0
    corpus = Corpus(sequences=index.num_sequences, tokens=int(index.lengths.sum()), skipped_empty=skipped, blocks=0)
    if specs.order.mixture is not None:  # a blend's counts are of its uses, as pack's
        from packctl.pipeline.mixture import blend_corpus
        corpus = blend_corpus(SingleComm(), index, specs.order, corpus)
    row, plan = assemble_metrics(specs.report, planned, corpus, group_starts=index.group_starts)
    row["fill_histogram"] = fill_histogram(plan.loads(padded=False), config.capacity)
    if "limits" in row:  # --limit: which budget binds (packctl.stats.packed.binding_budget)
        row["binding"] = binding_of(row)
    row["plan_seconds"] = plan_seconds
    if index.group_starts is not None:
        row["group_cost"] = group_cost(index, config, plan, ungrouped)
    return row


def _order(index: LengthIndex, config: PackConfig, source_files: list[int] | None = None) -> Ordered:
    """The order `pack` gives the corpus with these options (the same for every capacity and algorithm)."""
    specs = _specs(config, index, source_files)
    return order_corpus(index, specs.order, specs.groups, specs.windows)


def without_groups(index: LengthIndex, config: PackConfig) -> tuple[LengthIndex, PackConfig]:
    """The same corpus and options, each sequence packed on its own."""
    return (dataclasses.replace(index, group_starts=None, shared=None),
            dataclasses.replace(config, group_column=None, share_prefix=False, prefix_column=None))


def group_cost(index: LengthIndex, config: PackConfig, plan: PackPlan, ungrouped: Ordered | None = None
               ) -> dict[str, Any]:
    """What keeping groups whole costs in a grouped what-if row: the lower bound over whole
    groups (each group one item of its members' padded lengths: L2 over the items `plan` placed)
    and the packs and utilization of the plan without groups.

        capacity 10, six sequences of 3 in pairs {0,1} {2,3} {4,5}: items 6, 6, 6, each above
        half the capacity: L2 3 (while ceil(18/10) = 2), 3 packs; without groups [3 3 3] [3 3 3]: 2 packs
    """
    free_index, free_config = without_groups(index, config)
    t0 = time.perf_counter()
    free = plan_corpus(free_index, free_config.specs(), ungrouped).plan
    seconds = time.perf_counter() - t0
    items = whole_group_items(plan, index.group_starts, config.align)
    tokens = int(free.piece_len.sum())
    return {
        "lower_bound_packs_l2": martello_toth_l2(items, config.capacity) if plan.num_bins else 0,
        "packs_without_groups": free.num_bins,
        "utilization_without_groups": tokens / (free.num_bins * config.capacity) if free.num_bins else 0.0,
        "plan_seconds_without_groups": seconds,
    }


def whole_group_items(plan: PackPlan, group_starts: np.ndarray, align: int) -> np.ndarray:
    """The padded length of each item the grouped planner placed: a group's members (adjacent in
    one pack), or one piece of a sequence alone in its group (--too-long split cuts those)."""
    if len(plan.piece_gid) == 0:
        return np.zeros(0, np.int64)
    pack_of = np.repeat(np.arange(plan.num_bins), np.diff(plan.bin_offsets))
    ids = group_ids(plan.piece_gid, group_starts)
    first = np.ones(len(ids), dtype=bool)
    first[1:] = (ids[1:] != ids[:-1]) | (pack_of[1:] != pack_of[:-1])
    return np.add.reduceat(round_up(plan.piece_len, align), np.flatnonzero(first))


def group_summary(index: LengthIndex, column: str) -> dict[str, Any]:
    """The groups of the corpus: how many, how many sequences share a group with others, and the
    tokens per group (true lengths summed)."""
    starts = index.group_starts
    sizes = np.diff(starts)
    tokens = np.add.reduceat(index.lengths, starts[:-1]) if len(sizes) else np.zeros(0, np.int64)
    return {"column": column, "groups": int(len(sizes)), "grouped_sequences": int(sizes[sizes > 1].sum()),
            "largest": int(sizes.max()) if len(sizes) else 0, "group_tokens": length_summary(tokens)}


def input_stats(inputs: list[str], capacities: Iterable[int], config: PackConfig | None = None,
                algorithms: Iterable[str] | None = None) -> dict[str, Any]:
    """Length distribution and what-if table of raw tokenized shards (keys in docs/stats.md).

    `config` carries the planning options (PackConfig fields: order, window, cp_size, too_long,
    group_column, ...); `capacity` and `algorithm` are taken from `capacities` and `algorithms`
    instead (default every algorithm; with `group_column` every one but split, which `pack`
    refuses with groups).
    """
    started = time.perf_counter()
    config = config or PackConfig()
    grid = _grid(config, capacities, algorithms)
    index, source_files = _read_index(inputs, config)
    read_seconds = time.perf_counter() - started
    grid = _with_stops(grid, index, config)
    rows, planned, ungrouped_seconds = _plan_rows(index, grid, source_files)
    by_capacity = [_capacity_report(index, config, grid, rows, capacity) for capacity in grid.capacities]
    # Across capacities: fewest tokens lost to --too-long drop|truncate, then utilization, then
    # fewest cut sequences; max keeps the first of equals.
    best = max((next(r for r in rows if r["capacity_flag"] == c["capacity"] and r["algorithm"] == c["best"])
                for c in by_capacity),
               key=lambda r: (-_tokens_lost(r), r["utilization"], -r["counts"]["sequences_split"]))
    total = time.perf_counter() - started
    aligned = grid.first()
    return {
        "kind": "input",
        "inputs": [dataclasses.asdict(f) for f in index.files],
        "tokens_column": index.tokens_column,
        "sequences": index.num_sequences,
        "tokens": int(index.lengths.sum()),
        "lengths": length_summary(index.lengths),
        "length_histogram": length_histogram(index.lengths),
        "settings": {**{k: getattr(aligned, k) for k in PLANNING_OPTIONS},
                     "pack_multiple": aligned.resolved_pack_multiple, "align": aligned.align},
        "groups": group_summary(index, config.group_column) if grid.grouped else None,
        **({"mixture": _blend_report(index, aligned, source_files)} if source_files is not None else {}),
        "capacities": by_capacity,
        "what_if": rows,
        "best": {"capacity": best["capacity_flag"], "algorithm": best["algorithm"]},
        "recommendation": recommendation(best, rows) + (
            f"; pass --too-long {'drop' if config.limits else 'split'} (with --too-long error pack stops at "
            f"{grid.stops[best['capacity_flag']]}, over the capacity)" if best["capacity_flag"] in grid.stops
            else ""),
        "stats_seconds": {"read_lengths": read_seconds, **planned, "total": total,
                          **({"plan_without_groups": ungrouped_seconds} if grid.grouped else {})},
    }


@dataclass(frozen=True)
class _Grid:
    """The rows of a what-if before they are planned: each (capacity, algorithm) with its
    PackConfig, checked as pack checks it (`configs`, capacity by capacity); `grouped`: the rows
    keep --group-column's groups whole; `stops`: where pack would stop with --too-long error, the
    first over-long sequence at each capacity that has one.

        --capacity 2048 --capacity 4096, algorithms [ffd, mffd]:
        configs {(2048, ffd), (2048, mffd), (4096, ffd), (4096, mffd)}"""

    capacities: list[int]
    algorithms: list[str]
    configs: dict[tuple[int, str], PackConfig]
    grouped: bool
    stops: dict[int, str] = dataclasses.field(default_factory=dict)

    def first(self, capacity: int | None = None) -> PackConfig:
        """The config of the first algorithm at `capacity` (default the first capacity): what the
        rows of a capacity share (its plan capacity, alignment, --too-long)."""
        return self.configs[self.capacities[0] if capacity is None else capacity, self.algorithms[0]]


def _grid(config: PackConfig, capacities: Iterable[int], algorithms: Iterable[str] | None) -> _Grid:
    """The what-if's rows: every capacity with every algorithm, by default all of them but split
    with groups (pack refuses it there); in batch mode, which forms its micro-batches itself, the
    configured one only."""
    grouped = config.group_column is not None
    capacities = list(dict.fromkeys(as_python(c) for c in capacities))  # each checked below, as pack checks it
    if not capacities:
        raise PackctlError("no --capacity given: pass one or more, e.g. --capacity 4096 --capacity 8192")
    if grouped:  # the configured algorithm too (pack refuses --algorithm split with groups)
        _checked(dataclasses.replace(config, capacity=capacities[0]))
    if config.mode == "batch":  # batch mode forms its micro-batches itself: no algorithm to compare
        algorithms = [config.algorithm]
    algorithms = list(algorithms) if algorithms is not None else [a for a in ALGORITHMS
                                                                  if not (grouped and cuts_items(a))]
    configs = {(c, a): _checked(dataclasses.replace(config, capacity=c, algorithm=a))
               for c in capacities for a in algorithms}
    return _Grid(capacities=capacities, algorithms=algorithms, configs=configs, grouped=grouped)


def _read_index(inputs: list[str], config: PackConfig) -> tuple[LengthIndex, list[int] | None]:
    """The corpus's lengths as pack reads them: INPUT's, or a blend's sources joined as pack joins
    them (with the number of files of each source); with --share-prefix, the tokens each row
    shares with the one before."""
    source_files = None
    if config.sources:  # a blend: its sources' lengths, joined as pack joins them
        index, source_files = read_blend_lengths(config)
    else:
        index = read_lengths(inputs, config.tokens_column, config.group_column, skip_empty=config.skip_empty,
                             limit_columns=tuple(config.limits), split=config.split,
                             options=options_of(dataclasses.asdict(config)))
    if config.share_prefix and index.group_starts is not None:
        index.shared = shared_lengths(inputs, config, index.group_starts)
    return index, source_files


def _with_stops(grid: _Grid, index: LengthIndex, config: PackConfig) -> _Grid:
    """With --too-long error, pack would stop at the first over-long sequence: the what-if reports
    where (`stops`), and plans that capacity's rows with split (every token kept) instead of
    stopping; with --limit split cannot cut media, so drop stands in for it."""
    configs, stops = dict(grid.configs), {}
    for capacity in grid.capacities:
        aligned = grid.first(capacity)
        over = np.flatnonzero(round_up(index.lengths, aligned.align) > aligned.plan_capacity)
        if aligned.too_long == "error" and len(over):
            stops[capacity] = index.describe(int(over[0]))
            instead = "drop" if config.limits else "split"
            for algorithm in grid.algorithms:
                configs[capacity, algorithm] = dataclasses.replace(configs[capacity, algorithm], too_long=instead)
    return dataclasses.replace(grid, configs=configs, stops=stops)


def _plan_rows(index: LengthIndex, grid: _Grid, source_files: list[int] | None
               ) -> tuple[list[dict[str, Any]], dict[str, float], float]:
    """Every row of `grid` planned and measured as pack plans and measures it (`what_if_row`), the
    corpus ordered once for them all (and, grouped, once without groups for `group_cost`); with
    the seconds of loading the kernels, of the plans and of the metrics, and apart those of the
    plans without groups."""
    t0 = time.perf_counter()
    for algorithm in grid.algorithms:  # load the compiled kernels outside the timed plans
        pack_lengths(np.array([2, 1], np.int64), 2, algorithm)
    t1 = time.perf_counter()
    ordered = _order(index, grid.first(), source_files)
    t2 = time.perf_counter()
    ungrouped = None
    if grid.grouped:  # a blend's ungrouped order is its draw of single rows
        ungrouped = _order(*without_groups(index, grid.first()), source_files)
    t2b = time.perf_counter()
    rows = [what_if_row(index, grid.configs[key], ordered, ungrouped, source_files) for key in grid.configs]
    for (capacity, _), row in zip(grid.configs, rows):
        # the --capacity of the row: in batch mode the metrics' capacity is --max-tokens instead
        row["capacity_flag"] = capacity
    t3 = time.perf_counter()
    plan_seconds = (t2 - t1) + sum(r["plan_seconds"] for r in rows)
    ungrouped_seconds = ((t2b - t2) + sum(r["group_cost"]["plan_seconds_without_groups"] for r in rows)
                         if grid.grouped else 0.0)
    seconds = {"load_kernels": t1 - t0, "plan": plan_seconds, "metrics": (t3 - t1) - plan_seconds - ungrouped_seconds}
    return rows, seconds, ungrouped_seconds


def _capacity_report(index: LengthIndex, config: PackConfig, grid: _Grid, rows: list[dict[str, Any]],
                     capacity: int) -> dict[str, Any]:
    """One capacity of the what-if: its plan capacity, the sequences over it, --too-long and where
    pack would stop, its best algorithm, and padded batching of the same sequences beside it."""
    best = _best([r for r in rows if r["capacity_flag"] == capacity], preferred=config.algorithm)
    plan_capacity = grid.first(capacity).plan_capacity
    baseline = best["padded_batching"]
    return {
        "capacity": capacity,
        "plan_capacity": plan_capacity,
        "sequences_over_capacity": int((round_up(index.lengths, config.align) > plan_capacity).sum()),
        "over_capacity": over_capacity(index.lengths, config.align, plan_capacity),
        "too_long": grid.first(capacity).too_long,
        "pack_stops_at": grid.stops.get(capacity),
        "best": best["algorithm"],
        "padded_batching": {
            "batch_size": baseline["batch_size"],
            "batches": math.ceil(best["sequences"] / baseline["batch_size"]),
            "tokens": baseline["tokens"],
            "padding_tokens": baseline["tokens"] - best["tokens"],
            "utilization": best["tokens"] / baseline["tokens"] if baseline["tokens"] else 0.0,
            "estimated_gain": baseline["estimated_gain"],
        },
    }


def _blend_report(index: LengthIndex, config: PackConfig, source_files: list[int]) -> dict[str, Any]:
    """The blend before packing: what each source gives (_metrics.json's `mixture` of `pack`)."""
    from packctl.pipeline.mixture import blend_metrics

    mixture = blend_metrics(SingleComm(), index, _specs(config, index, source_files).order)
    for entry in mixture["sources"]:
        entry["sequences"] = entry["uses"]
    return mixture


def _checked(config: PackConfig) -> PackConfig:
    # validate() wants an output directory; the what-if writes nothing.
    dataclasses.replace(config, inputs=config.inputs or ([] if config.sources else ["-"]),
                        output=config.output or "-").validate()
    return config


def over_capacity(lengths: np.ndarray, align: int, plan_capacity: int) -> dict[str, Any]:
    """The sequences longer than the capacity, by count and by tokens, and what each --too-long
    policy does with them: error stops pack at the first; drop loses all their tokens; truncate
    loses what is past the capacity; split keeps every token, each sequence cut into
    ceil(length / capacity) pieces (`pieces_added` counts the pieces beyond one per sequence)."""
    over = lengths[round_up(lengths, align) > plan_capacity]
    total = int(lengths.sum())
    tokens = int(over.sum())
    return {
        "sequences": int(len(over)),
        "tokens": tokens,
        "token_share": tokens / total if total else 0.0,
        "tokens_lost": {"error": 0, "drop": tokens, "truncate": int((over - plan_capacity).sum()), "split": 0},
        "pieces_added": {"error": 0, "drop": 0, "truncate": 0,
                         "split": int((-(-over // plan_capacity) - 1).sum())},
    }


def _tokens_lost(row: dict[str, Any]) -> int:
    return row["counts"]["tokens_dropped"] + row["counts"]["tokens_truncated"]


def _best(rows: list[dict[str, Any]], preferred: str | None = None) -> dict[str, Any]:
    """Highest utilization among the rows that split the fewest sequences; among equals the
    `preferred` algorithm (the configured one, bfd by default), then the first in ALGORITHMS order.

    `split` fills packs almost perfectly by cutting sequences anywhere; it is the best only when
    it cuts no more sequences than the others (or is the only one asked for).
    """
    fewest = min(r["counts"]["sequences_split"] for r in rows)
    whole = [r for r in rows if r["counts"]["sequences_split"] == fewest]
    top = max(r["utilization"] for r in whole)
    tied = [r for r in whole if r["utilization"] == top]
    return next((r for r in tied if r["algorithm"] == preferred), tied[0])


def recommendation(best: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """One line: the algorithm and capacity to use, and why.

    'bfd at --capacity 4096: 98.61% utilization, 290 packs (1 above the lower bound 289),
    2.03x fewer tokens than padded batching'
    """
    groups = best.get("group_cost")
    packs, bound = best["packs"], (groups or best)["lower_bound_packs_l2"]
    # --limit: no packing holds fewer packs than ceil(total / N) of any limited column either
    bound = max([bound, *(-(-f["total"] // f["limit"]) for f in (best.get("limits") or {}).values())])
    above = f"{packs - bound:,} above" if packs > bound else "at"
    gain = best["padded_batching"]["estimated_gain"]
    text = (f"{best['algorithm']} at --capacity {best.get('capacity_flag', best['capacity'])}: "
            f"{best['utilization']:.2%} utilization, "
            f"{packs:,} packs ({above} the lower bound {bound:,}{' over whole groups' if groups else ''}), "
            f"{gain:.2f}x fewer tokens than padded batching")
    if groups and groups["packs_without_groups"]:
        alone = groups["packs_without_groups"]
        extra = packs - alone
        cost = f"{extra:+,} packs ({extra / alone:+.2%})" if extra else "no extra packs"
        text += f"; keeping groups whole costs {cost} over packing the sequences one by one ({alone:,} packs)"
    shared = best.get("share_prefix")
    if shared:  # --share-prefix
        text += (f"; sharing prefixes saves {shared['tokens_saved']:,} tokens and "
                 f"{shared['attention_saved_fraction']:.1%} of the attention pairs ({shared['groups_shared']:,} groups)")
    counts = best["counts"]
    for what, key in (("drops", "dropped"), ("truncates", "truncated")):
        if counts[f"sequences_{key}"]:
            over_limit = counts.get("over_limit", 0) if key == "dropped" else 0
            kind = ("over-long sequences" if not over_limit else
                    f"sequences, {over_limit:,} over a --limit and {counts[f'sequences_{key}'] - over_limit:,} over-long")
            text += f"; it {what} {counts[f'sequences_{key}']:,} {kind} ({counts[f'tokens_{key}']:,} tokens, --too-long)"
    capacity = best.get("capacity_flag", best["capacity"])
    cutters = [r for r in rows if r.get("capacity_flag", r["capacity"]) == capacity
               and r["utilization"] > best["utilization"]
               and r["counts"]["sequences_split"] > best["counts"]["sequences_split"]]
    if cutters:
        fuller = max(cutters, key=lambda r: r["utilization"])
        cut = fuller["counts"]["sequences_split"] - best["counts"]["sequences_split"]
        text += f"; {fuller['algorithm']} fills {fuller['utilization']:.2%} but cuts {cut:,} more sequences across packs"
    return text


def _short(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
