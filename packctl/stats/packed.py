"""Stats of a packed output, recomputed from its shards.

Only the small columns are decoded: `seq_lens`, `sample_ids`, `num_tokens`, the last entry of
`cu_seqlens_padded` (the pack lengths) and, when balancing was asked for, `step`, `dp_rank` and
`micro_batch`. The metrics come from `packctl.plan.metrics.pack_metrics`, the function `pack` writes
metrics.json with, so the two agree on any output `pack` wrote, and the report works on any
contract-conforming output whatever wrote it.

    OUT: capacity 16, align 2, packs [9] [9] [16] [7 4 3] [6 1]   (true sequence lengths)
    -> utilization 55/80, packing efficiency ceil(60/16)/5 = 0.8, padding: alignment 5, tail 20

An output packed with `--limit COL=N` (the manifest's `layout.limits`) has each pack's sum in
`COL_sum`; the report gives each budget's utilization and packs at the limit (`limit_figures`,
the `limits` and `packs_at_capacity` of metrics.json) and which budget binds (`binding`: the one
whose total alone needs the most packs).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from packctl.errors import PackctlError
from packctl.plan.align import round_up
from packctl.plan.metrics import (attention_cost, batch_metrics, dp_balance, fill_histogram, length_summary, pack_loads,
                             pack_metrics)
from packctl.contract.manifest import EPOCHS, LEGACY_MANIFEST, MANIFEST, manifest_path
from packctl.contract.reader import PackedOutput, open_output
from packctl.contract.schema import (BALANCE_COLUMNS, BATCH_COLUMNS, BATCH_SIZE, CU_SEQLENS_PADDED, DP_RANK,
                                     METADATA_KEY, MICRO_BATCH, NUM_TOKENS, PADDED_LEN, PARENT_SEGMENTS, SAMPLE_IDS,
                                     SEQ_LENS, SOURCE_IDS, STEP, limit_sum_name)
from packctl.pipeline.report import SHARE_PREFIX, share_prefix_report
from packctl.plan.prefix import prefix_pieces, sharing_counts
from packctl.source.tokenized import is_tokenized_output
from packctl.urls import is_url

READ_COLUMNS = (SEQ_LENS, SAMPLE_IDS, NUM_TOKENS)
LIST_COLUMNS = (SEQ_LENS, SAMPLE_IDS, CU_SEQLENS_PADDED, SOURCE_IDS)


@dataclass
class PackedArrays:
    """The small columns of every pack, in output order (shard by shard, row by row)."""

    seq_lens: np.ndarray  # int64, every sequence, pack by pack
    seq_offsets: np.ndarray  # int64, B+1: sequences of pack b are seq_offsets[b]:seq_offsets[b+1]
    sample_ids: np.ndarray  # int64, one per sequence
    num_tokens: np.ndarray  # int64, one per pack
    pack_lens: np.ndarray  # int64, len(input_ids) of each pack
    balance: dict[str, np.ndarray] | None  # step, dp_rank, micro_batch when present
    limit_sums: dict[str, np.ndarray] = field(default_factory=dict)  # --limit: COL -> each pack's COL_sum
    source_ids: np.ndarray | None = None  # --source: one per sequence


def is_packed_output(path: str | Path) -> bool:
    """A directory holding a manifest (_manifest.json, or a version-1 manifest.json), or the
    manifest file itself; or the OUT of `pack --epochs` (reading it names its epochs' outputs).
    The output of `packctl tokenize` holds a manifest too, and is an input. A URL is a packed
    output when the store holds its `_manifest.json` and that is no tokenized corpus's."""
    if is_url(path):
        from packctl.contract.mirror import store_manifest_kind

        try:
            return store_manifest_kind(str(path)) == "packed"
        except PackctlError:  # a HEAD's errors cannot name their cause: the input's listing says it
            return False
    path = Path(path)
    if is_tokenized_output(path):
        return False
    return (path.is_dir() and (manifest_path(path) is not None or (path / EPOCHS).is_file())) or \
        (path.is_file() and path.name in (MANIFEST, LEGACY_MANIFEST))


def looks_like_unfinished_output(path: str | Path) -> bool:
    """A directory of packctl shards without a manifest: a run that did not finish."""
    if is_url(path):
        return False  # a store run's shards sit under runs/ without a manifest until its commit
    path = Path(path)
    if not path.is_dir() or manifest_path(path) is not None:
        return False
    first = next(iter(sorted([*path.glob("data/train-*.parquet"), *path.glob("part-*.parquet")])), None)
    if first is None:
        return False
    try:
        metadata = pq.read_schema(first).metadata or {}
    except (pa.ArrowException, OSError):  # unreadable: the input reader names the problem
        return False
    return METADATA_KEY in metadata


def read_packed(output: PackedOutput) -> PackedArrays:
    """Read the small columns of every shard listed in the manifest, in order, each shard through
    the output's reader (checked against the manifest unless opened with verify=False)."""
    parts: list[dict[str, np.ndarray]] = []
    balance_columns: tuple[str, ...] | None = None
    sums = [limit_sum_name(name) for name in limit_names(output.layout)]
    for k, entry in enumerate(output.shards):
        path = output.shard_path(k)
        names = output.column_names(k)
        missing = [c for c in (*READ_COLUMNS, CU_SEQLENS_PADDED, *sums) if c not in names]
        if missing:
            raise PackctlError(f"{path}: no column {', '.join(repr(c) for c in missing)}; not a packed "
                               "shard of format version 1 (docs/format.md)")
        present = tuple(c for c in BALANCE_COLUMNS + BATCH_COLUMNS if c in names)
        if balance_columns is None:
            balance_columns = present
        elif present != balance_columns:
            raise PackctlError(f"{path}: balancing columns {list(present)} differ from the first shard's "
                               f"{list(balance_columns)}; pack again")
        # a pack's length is the last entry of cu_seqlens_padded (len(input_ids) by the contract):
        # the token columns, most of a shard's bytes, are never decoded
        blend = [SOURCE_IDS] if SOURCE_IDS in names else []
        table = output.read_shard(k, [*READ_COLUMNS, CU_SEQLENS_PADDED, *present, *sums, *blend])
        parts.append(_shard_arrays(path, table, (*present, *sums), entry.rows))

    def cat(key: str) -> np.ndarray:
        return np.concatenate([p[key] for p in parts]) if parts else np.zeros(0, np.int64)

    counts = cat("seqs_per_pack")
    seq_offsets = np.zeros(len(counts) + 1, np.int64)
    np.cumsum(counts, out=seq_offsets[1:])
    return PackedArrays(
        seq_lens=cat(SEQ_LENS), seq_offsets=seq_offsets, sample_ids=cat(SAMPLE_IDS),
        num_tokens=cat(NUM_TOKENS), pack_lens=cat("pack_len"),
        balance={c: cat(c) for c in balance_columns} if balance_columns else None,
        limit_sums={name: cat(limit_sum_name(name)) for name in limit_names(output.layout)},
        source_ids=cat(SOURCE_IDS) if parts and all(SOURCE_IDS in p for p in parts) else None,
    )


def _input_keys(sample_ids: np.ndarray) -> np.ndarray:
    """The input position of each packed sequence, as `pack` orders its pieces for the padded-batching
    baseline: a sample's id, and a prefix of --share-prefix (id -1) that of the row it is cut from,
    its group's first, the branch after it: sample_ids [-1, 5, 6, 2] -> [5, 5, 6, 2]."""
    keys = np.asarray(sample_ids, dtype=np.int64).copy()
    prefix = np.flatnonzero(keys < 0)
    keys[prefix] = keys[np.minimum(prefix + 1, len(keys) - 1)]
    return keys


def share_prefix_figures(output) -> dict[str, Any]:
    """metrics.json's `share_prefix` of an output of `pack --share-prefix`, from its shards'
    `parent_segments` and `seq_lens` (packctl.pipeline.report.share_prefix_report)."""
    counts: dict[str, int] = {}
    for k in range(len(output.shards)):
        table = output.read_unchecked(k, [SEQ_LENS, PARENT_SEGMENTS])
        lens, per_pack = _flat_list(table.column(SEQ_LENS).combine_chunks())
        parents, _ = _flat_list(table.column(PARENT_SEGMENTS).combine_chunks())
        lens_offsets = np.concatenate([[0], np.cumsum(per_pack)]).astype(np.int64)
        pack_first = np.repeat(lens_offsets[:-1], np.diff(lens_offsets))
        branch = parents >= 0
        context = np.zeros(len(lens), np.int64)
        context[branch] = lens[(pack_first + parents)[branch]]  # depth 1: a branch's prefix
        found = sharing_counts(context, lens, parents, prefix_pieces(lens_offsets, parents))
        for key, value in found.items():
            counts[f"{SHARE_PREFIX}.{key}"] = counts.get(f"{SHARE_PREFIX}.{key}", 0) + value
    return share_prefix_report(counts)


def limit_names(layout: dict[str, Any]) -> list[str]:
    """The limited columns of an output (`layout.limits`, --limit order); none without limits.
    A `limits` that is not a mapping of names to whole numbers >= 1 is refused."""
    limits = layout.get("limits")
    if limits is None:
        return []
    if not isinstance(limits, dict) or not all(isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)
                                               and v >= 1 for k, v in limits.items()):
        raise PackctlError(f"layout.limits {limits!r}: not a mapping of column names to limits >= 1; "
                           "not a valid packctl manifest: pack again")
    return list(limits)


def limit_figures(padded_loads: np.ndarray, capacity: int, limit_sums: dict[str, np.ndarray],
                  limits: dict[str, int]) -> dict[str, Any]:
    """Each budget of an output packed with --limit, from each pack's sums, as `pack` writes them
    in metrics.json (packctl.pipeline.report.limit_summary): `limits` (per COL: limit, total,
    utilization = total / (packs x limit), packs_at_limit = packs whose sum is >= 99% of it) and
    `packs_at_capacity` (packs whose padded load, the aligned lengths of their sequences, is >= 99%
    of the capacity), plus `binding` (`binding_budget`).

        capacity 10, padded loads [10, 4], images_sum [1, 8], limit 8
        -> images: total 9, utilization 9/16, packs_at_limit 1; packs_at_capacity 1;
           binding tokens (14 tokens need 2 packs of 10, 9 images 2 packs of 8; 14/10 > 9/8)
    """
    packs = len(padded_loads)
    out: dict[str, Any] = {"limits": {}}
    for name, limit in limits.items():
        sums = np.asarray(limit_sums[name], dtype=np.int64)
        total = int(sums.sum())
        out["limits"][name] = {"limit": int(limit), "total": total,
                               "utilization": total / (packs * limit) if packs else 0.0,
                               "packs_at_limit": int(np.count_nonzero(sums * 100 >= 99 * int(limit)))}
    loads = np.asarray(padded_loads, np.int64)
    out["packs_at_capacity"] = int(np.count_nonzero(loads * 100 >= 99 * int(capacity)))
    out["binding"] = binding_budget(int(loads.sum()), int(capacity), out["limits"])
    return out


def binding_budget(padded_tokens: int, capacity: int, limits: dict[str, dict[str, Any]]) -> str | None:
    """Which budget binds: the one that alone needs the most packs, its lower bound
    ceil(total / limit) (for tokens ceil(padded tokens / capacity), metrics.json's
    lower_bound_packs), ties going to the fuller budget (total / limit, which is its utilization
    times the packs), then to tokens, then to the first in --limit order. "tokens" or a limited
    column; None when the packs hold nothing.

    The README's example (capacity 16,384, --limit images=8 --limit image_tokens=8192, 3,979
    packs): tokens 42,936,921 -> 2,621 packs (65.9% full), images 18,168 -> 2,271 (57.1%),
    image_tokens 31,502,016 -> 3,846 (96.6%): image_tokens binds, though no pack reaches 99% of
    8,192 (tiles of 576 tokens stop at 8,064).

    Each needs 3 packs below (28/10, 17/8, 23/8), and the image tokens are the fullest:

        >>> binding_budget(28, 10, {"images": {"limit": 8, "total": 17}, "image_tokens": {"limit": 8, "total": 23}})
        'image_tokens'
    """
    need = {"tokens": Fraction(padded_tokens, capacity)}  # packs needed, before rounding up
    need.update((name, Fraction(f["total"], f["limit"])) for name, f in limits.items())
    binding = max(need, key=lambda name: (math.ceil(need[name]), need[name]))  # the first of equals
    return binding if need[binding] > 0 else None


def binding_of(metrics: dict[str, Any]) -> str | None:
    """`binding_budget` of a `_metrics.json` with `limits` (`pack`'s, or a what-if row)."""
    padded = metrics["tokens"] + metrics["padding"]["alignment_tokens"]
    return binding_budget(padded, metrics["capacity"], metrics["limits"])


def _shard_arrays(path: Path, table: pa.Table, balance: tuple[str, ...], rows: int) -> dict[str, np.ndarray]:
    if table.num_rows != rows:
        raise PackctlError(f"{path}: {table.num_rows} packs, the manifest says {rows}; pack again")
    columns = {name: table.column(name).combine_chunks() for name in table.column_names}
    for name, column in columns.items():
        typ = column.type
        listed = pa.types.is_list(typ) or pa.types.is_large_list(typ)
        if (name in LIST_COLUMNS) != listed or not pa.types.is_integer(typ.value_type if listed else typ):
            want = "a list of integers" if name in LIST_COLUMNS else "an integer"
            raise PackctlError(f"{path}: column '{name}' is {typ}, the contract says {want}; not a valid packed "
                               "shard: pack again")
    for name, column in columns.items():
        if column.null_count or (pa.types.is_list(column.type) and column.values.null_count):
            raise PackctlError(f"{path} row {_first_null_row(column)} column '{name}': null; not a valid packed "
                               "shard: pack again")
    seq_lens, seqs_per_pack = _flat_list(columns[SEQ_LENS])
    sample_ids, ids_per_pack = _flat_list(columns[SAMPLE_IDS])
    if not np.array_equal(seqs_per_pack, ids_per_pack):
        row = int(np.argmax(seqs_per_pack != ids_per_pack))
        raise PackctlError(f"{path} row {row}: {ids_per_pack[row]} sample_ids for {seqs_per_pack[row]} seq_lens; "
                           "not a valid packed shard: pack again")
    cu_values, cu_per_pack = _flat_list(columns[CU_SEQLENS_PADDED])
    if (cu_per_pack < 1).any():
        row = int(np.argmax(cu_per_pack < 1))
        raise PackctlError(f"{path} row {row}: an empty cu_seqlens_padded; not a valid packed shard: pack again")
    pack_len = cu_values[np.cumsum(cu_per_pack) - 1]
    offsets = np.concatenate([[0], np.cumsum(seqs_per_pack)])
    num_tokens = columns[NUM_TOKENS].to_numpy(zero_copy_only=False).astype(np.int64)
    sums = pack_loads(seq_lens, offsets)
    if not np.array_equal(sums, num_tokens):
        row = int(np.argmax(sums != num_tokens))
        raise PackctlError(f"{path} row {row}: num_tokens {num_tokens[row]} but seq_lens sum to {sums[row]}; "
                           "not a valid packed shard: pack again")
    out = {SEQ_LENS: seq_lens, "seqs_per_pack": seqs_per_pack, SAMPLE_IDS: sample_ids,
           NUM_TOKENS: num_tokens, "pack_len": pack_len}
    if SOURCE_IDS in columns:  # --source: aligned with sample_ids
        source_ids, per_pack = _flat_list(columns[SOURCE_IDS])
        if not np.array_equal(per_pack, seqs_per_pack):
            row = int(np.argmax(per_pack != seqs_per_pack))
            raise PackctlError(f"{path} row {row}: {per_pack[row]} source_ids for {seqs_per_pack[row]} seq_lens; "
                               "not a valid packed shard: pack again")
        out[SOURCE_IDS] = source_ids
    for column in balance:
        values = columns[column].to_numpy(zero_copy_only=False).astype(np.int64)
        if len(values) and values.min() < 0:
            row = int(np.argmax(values < 0))
            raise PackctlError(f"{path} row {row} column '{column}': {values[row]} is negative; pack again")
        out[column] = values
    return out


def _first_null_row(column: pa.Array) -> int:
    """The first row that is null, or whose list holds a null."""
    nulls = np.asarray(column.is_null(), dtype=bool)
    if pa.types.is_list(column.type):
        offsets = np.asarray(column.offsets, dtype=np.int64)
        inner = np.asarray(column.values.is_null(), dtype=bool)[offsets[0]:offsets[-1]]
        if inner.any():
            nulls[int(np.searchsorted(offsets - offsets[0], int(np.argmax(inner)), side="right") - 1)] = True
    return int(np.argmax(nulls))


def _flat_list(array: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """A list column -> (flat values int64, list lengths int64), through Arrow's offsets."""
    offsets = np.asarray(array.offsets, dtype=np.int64)
    values = array.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0])).to_numpy(zero_copy_only=False)
    return values.astype(np.int64), np.diff(offsets)


def packed_stats(path: str | Path, *, attn_coeff: float | None = None, verify: bool = True) -> dict[str, Any]:
    """The report of one packed output (`_packed_report`); the OUT of `pack --epochs K`: `epochs_stats`."""
    from packctl.contract.manifest import epoch_outputs

    if Path(path).is_dir() and epoch_outputs(path) is not None:
        return epochs_stats(path, attn_coeff=attn_coeff, verify=verify)
    return _packed_report(path, attn_coeff=attn_coeff, verify=verify)[0]


def _packed_report(path: str | Path, *, attn_coeff: float | None = None,
                   verify: bool = True) -> tuple[dict[str, Any], PackedArrays]:
    """The report of one packed output (keys in docs/stats.md): every key of its metrics.json
    except `throughput` and `timings`, recomputed from the shards, plus `path`, `layout`,
    `lengths`, `fill_histogram` and `dp_balance` (None without balancing columns; `a` defaults
    to the `--attn-coeff` the output was balanced with; `round_robin` is the imbalance before
    balancing, from metrics.json, when that was made with the same `a`).

    The shards are read through `packctl.contract.reader`, each checked against the manifest
    (sha256, rows, tokens, layout) unless `verify=False` (`--no-verify-checksums`). Figures only
    metrics.json knows (`round_robin`, `scale_out`) are left out when it is unreadable or garbled."""
    t0 = time.perf_counter()
    output = open_output(path, verify=verify)
    manifest, layout = output.manifest, output.layout
    packed = read_packed(output)
    t1 = time.perf_counter()
    capacity, align = layout["capacity"], layout["align"]
    # Stable: the pieces of a split sample keep their output order, as in `pack`.
    input_order = np.argsort(_input_keys(packed.sample_ids), kind="stable")
    metrics = pack_metrics(packed.seq_lens, packed.seq_offsets, packed.pack_lens, capacity=capacity, align=align,
                           input_order=input_order)
    config = manifest.get("config") or {}
    report: dict[str, Any] = {"kind": "packed", "path": output.location, "format_version": manifest["format_version"]}
    report.update(metrics)
    report.update({
        "algorithm": config.get("algorithm"),
        "order": config.get("order"),
        "counts": manifest["counts"],
        "layout": layout,
        "lengths": length_summary(packed.seq_lens),
        "fill_histogram": fill_histogram(packed.num_tokens, capacity),
        "dp_balance": None,
    })
    if layout.get("tree"):  # --share-prefix: what the trees save, recounted from the shards
        report["share_prefix"] = share_prefix_figures(output)
    if packed.limit_sums:
        padded = pack_loads(round_up(packed.seq_lens, align), packed.seq_offsets)
        report.update(limit_figures(padded, capacity, packed.limit_sums, dict(layout["limits"])))
    recorded = output.recorded_metrics() or {}
    extra = packed.balance or {}
    batch = layout.get("pad_to") == "batch" and set(BATCH_COLUMNS) <= extra.keys()
    if batch:
        report["algorithm"] = "batch"
        report["batching"] = batch_metrics(packed.seq_lens, packed.seq_offsets, extra[BATCH_SIZE], packed.pack_lens,
                                           max_tokens=capacity, input_order=input_order)
    if {STEP, DP_RANK} <= extra.keys():
        a = float(attn_coeff if attn_coeff is not None else config.get("attn_coeff") or 0.0)
        # batch mode balances what the rows cost: every sequence as long as its micro-batch's padded_len
        lengths = np.repeat(extra[PADDED_LEN], np.diff(packed.seq_offsets)) if batch else packed.seq_lens
        costs = pack_loads(attention_cost(lengths, a), packed.seq_offsets)
        tokens = pack_loads(lengths, packed.seq_offsets) if batch else packed.num_tokens
        report["dp_balance"] = dp_balance(extra[STEP], extra[DP_RANK], tokens,
                                          costs, attn_coeff=a, micro_batch=extra.get(MICRO_BATCH))
        balance = recorded.get("balance")
        if _fits(balance, BALANCE_SHAPE) and float(balance["attn_coeff"]) == a:
            report["dp_balance"]["round_robin"] = balance["before"]
    # how the ranks of an MPI run shared it: a fact of the run, not of the shards
    if _fits(recorded.get("scale_out"), SCALE_OUT_SHAPE):
        report["scale_out"] = recorded["scale_out"]
    if packed.source_ids is not None and isinstance(manifest.get("sources"), list):
        report["mixture"] = packed_mixture(packed, manifest, output.shards, recorded.get("mixture"))
    report["pack_order"] = order_quality(longest_per_pack(packed), window_of_pack(manifest, output.shards),
                                         (packed.balance or {}).get(STEP))
    t2 = time.perf_counter()
    report["stats_seconds"] = {"read": t1 - t0, "compute": t2 - t1, "total": t2 - t0}
    return report, packed


def longest_per_pack(packed: PackedArrays) -> np.ndarray:
    """The longest sequence (true tokens) of each pack, in output order."""
    if len(packed.seq_offsets) < 2:
        return np.zeros(0, np.int64)
    return np.maximum.reduceat(packed.seq_lens, packed.seq_offsets[:-1]) if len(packed.seq_lens) else \
        np.zeros(len(packed.seq_offsets) - 1, np.int64)


def window_of_pack(manifest: dict[str, Any], shards: list) -> np.ndarray | None:
    """The planning window of each pack, from the manifest's `window_starts` (the shards that open
    a window; shards never straddle one); None when the manifest does not record them (outputs of
    packctl before it did, or of another writer)."""
    starts = manifest.get("window_starts")
    if not isinstance(starts, list) or not all(isinstance(k, int) and not isinstance(k, bool) for k in starts):
        return None
    opens = np.zeros(len(shards), bool)
    opens[[k for k in starts if 0 <= k < len(shards)]] = True
    if len(shards):
        opens[0] = True
    window_of_shard = np.cumsum(opens) - 1
    return np.repeat(window_of_shard, [s.rows for s in shards]).astype(np.int64)


def packed_mixture(packed: PackedArrays, manifest: dict[str, Any], shards: list,
                   recorded: dict[str, Any] | None) -> dict[str, Any]:
    """The realized blend of an output of `--source`, from its shards: per source its sequences
    and tokens, its share of the tokens against its weight (the manifest's `sources`), and the
    worst |share - weight| over the planning windows and (with --dp-size) the steps; with the
    draw `pack` recorded (rows used, repeats) where its _metrics.json has it.

        sources web 0.75, code 0.25; packs [web 300 | code 100] -> shares 0.75, 0.25"""
    table = manifest["sources"]
    weights = np.array([float(t["weight"]) for t in table])
    k = len(table)
    source = packed.source_ids.astype(np.int64)
    pack_of = np.repeat(np.arange(len(packed.num_tokens)), np.diff(packed.seq_offsets))
    unit = (recorded or {}).get("unit", "tokens")
    units = packed.seq_lens if unit == "tokens" else np.ones(len(source), np.int64)

    def worst(group: np.ndarray | None) -> list[float] | None:
        if group is None or not len(source):
            return None
        at = group[pack_of]
        per = np.zeros((int(at.max()) + 1, k))
        np.add.at(per, (at, source), units)
        totals = per.sum(axis=1, keepdims=True)
        shares = np.divide(per, totals, out=np.zeros_like(per), where=totals > 0)
        return np.abs(shares - weights[None, :])[totals[:, 0] > 0].max(axis=0).tolist()

    by_window = worst(window_of_pack(manifest, shards))
    step = (packed.balance or {}).get(STEP)
    by_step = worst(step) if step is not None else None
    total = max(int(units.sum()), 1)
    drawn = {s.get("name"): s for s in (recorded or {}).get("sources", []) if isinstance(s, dict)}
    sources = []
    for j, entry in enumerate(table):
        mine = source == j
        row = {"name": entry["name"], "weight": float(weights[j]), "sequences": int(mine.sum()),
               "tokens": int(packed.seq_lens[mine].sum()), "realized": float(units[mine].sum() / total),
               "worst_window_deviation": by_window[j] if by_window is not None else None,
               "worst_step_deviation": by_step[j] if by_step is not None else None}
        for key in ("rows", "rows_used", "uses", "repeats", "max_repeat"):
            if key in drawn.get(entry["name"], {}):
                row[key] = drawn[entry["name"]][key]
        sources.append(row)
    return {"unit": unit, "sources": sources,
            "worst_window_deviation": max(by_window) if by_window else None,
            "worst_step_deviation": max(by_step) if by_step else None}


ORDER_BOUND = 0.05  # the |Spearman| a window of --pack-order shuffle stays within (docs/cli.md)


def order_quality(longest: np.ndarray, window: np.ndarray | None, step: np.ndarray | None = None) -> dict[str, Any]:
    """How much pack position says about pack length: Spearman's rank correlation of position and
    longest sequence, over the whole output and in each planning window (`window`: each pack's;
    None: not recorded, the whole output counts as one). Windows under TINY_WINDOW packs are
    counted apart: a correlation over so few packs means nothing. With --dp-size (`step`: each
    pack's) the shuffle orders whole steps, so a window counts by its steps: under TINY_WINDOW
    steps it is counted apart. Packs longest first give -1, ascending +1, a shuffle about 0.

        longest [900 500 300 100], one window -> overall -1.0, worst_abs 1.0
    """
    from packctl.plan.pack_order import TINY_WINDOW, spearman

    if window is None:
        window = np.zeros(len(longest), np.int64)
        recorded = False
    else:
        recorded = True
    bounds = np.flatnonzero(np.diff(window)) + 1
    starts = np.concatenate([[0], bounds]) if len(longest) else np.zeros(0, np.int64)
    ends = np.concatenate([bounds, [len(longest)]]) if len(longest) else np.zeros(0, np.int64)
    rhos = [spearman(longest[lo:hi]) for lo, hi in zip(starts.tolist(), ends.tolist())]
    units = [hi - lo if step is None else len(np.unique(step[lo:hi])) for lo, hi in zip(starts.tolist(), ends.tolist())]
    sized = [(abs(r), k) for k, (r, size) in enumerate(zip(rhos, units)) if size >= TINY_WINDOW]
    worst = max(sized) if sized else None
    return {
        "spearman_overall": spearman(longest),
        "windows": len(rhos),
        "windows_recorded": recorded,
        "tiny_windows": len(rhos) - len(sized),
        "tiny_window_packs": TINY_WINDOW,
        "window_unit": "packs" if step is None else "steps",
        "worst_abs_spearman": worst[0] if worst else None,
        "worst_window": worst[1] if worst else None,
        "windows_over_bound": sum(1 for r, _ in sized if r > ORDER_BOUND),
        "bound": ORDER_BOUND,
        "spearman_by_window": [round(r, 4) for r in rhos],
    }


def pack_fingerprints(packed: PackedArrays) -> np.ndarray:
    """One uint64 per pack that depends only on the set of its sample ids (a sum of mixed ids, so
    the order inside a pack does not matter): equal packs of two outputs have equal fingerprints."""
    ids = packed.sample_ids.astype(np.uint64)
    with np.errstate(over="ignore"):
        z = ids + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
        if len(packed.seq_offsets) < 2:
            return np.zeros(0, np.uint64)
        return np.add.reduceat(z, packed.seq_offsets[:-1]) if len(z) else np.zeros(len(packed.seq_offsets) - 1,
                                                                                      np.uint64)


def epochs_stats(path: str | Path, *, attn_coeff: float | None = None, verify: bool = True) -> dict[str, Any]:
    """The report of the OUT of `pack --epochs K`: every epoch's packed report (`epochs`), and how
    much each epoch repeats epoch 0 (`overlap`: the share of its packs whose set of sample ids is
    that of a pack of epoch 0, over all packs and over packs of two or more sequences; a pack of
    one sequence is that sequence alone in every epoch, whatever the order)."""
    from packctl.contract.manifest import epoch_outputs

    folders = epoch_outputs(path) or []
    reports, overlap, first = [], [], None
    for e, folder in enumerate(folders):
        report, packed = _packed_report(folder, attn_coeff=attn_coeff, verify=verify)
        reports.append(report)
        prints = pack_fingerprints(packed)
        multi = np.diff(packed.seq_offsets) > 1
        if first is None:
            first = np.unique(prints)
        same = np.isin(prints, first)
        overlap.append({"epoch": e, "packs": int(len(prints)),
                        "same_as_epoch_0": float(same.mean()) if len(prints) else 0.0,
                        "same_as_epoch_0_two_or_more": float((same & multi).sum() / len(prints)) if len(prints) else 0.0,
                        "packs_of_one_sequence": float((~multi).mean()) if len(prints) else 0.0})
    return {"kind": "epochs", "path": str(path), "epochs": reports, "overlap": overlap}


# What stats takes from _metrics.json, and the shape it must have to be shown (a garbled report
# is left out, never a traceback): {key: shape}, "*" for every key of a mapping.
NUMBER = (int, float)
_MAX_MEAN = {"max": NUMBER, "mean": NUMBER}
BALANCE_SHAPE = {"attn_coeff": NUMBER, "before": {"tokens": _MAX_MEAN, "attention": _MAX_MEAN}}
SCALE_OUT_SHAPE = {"ranks": int, "token_transfer": str, "read_amplification": NUMBER, "bytes_exchanged": NUMBER,
                   "tokens_written": {**_MAX_MEAN, "max_over_mean": NUMBER}, "stage_seconds": {"*": _MAX_MEAN}}


def _fits(value: Any, shape: Any) -> bool:
    """Whether `value` (parsed JSON) has `shape`: a type (tuple), or {key: shape} of an object
    holding at least those keys, or {"*": shape} of an object whose every value has it.

        >>> _fits({"max": 2, "mean": 1.5}, _MAX_MEAN), _fits({"max": "2"}, _MAX_MEAN)
        (True, False)
    """
    if not isinstance(shape, dict):
        return isinstance(value, shape) and not isinstance(value, bool)
    if not isinstance(value, dict):
        return False
    if "*" in shape:
        return all(_fits(v, shape["*"]) for v in value.values())
    return all(key in value and _fits(value[key], sub) for key, sub in shape.items())


def compare_stats(paths: list[str | Path], *, attn_coeff: float | None = None, verify: bool = True) -> dict[str, Any]:
    """Several packed outputs side by side: {"kind": "compare", "outputs": [packed_stats(p), ...]}."""
    return {"kind": "compare", "outputs": [packed_stats(p, attn_coeff=attn_coeff, verify=verify) for p in paths]}
