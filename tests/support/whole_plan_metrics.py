"""metrics.json as packctl computed it from the whole plan gathered on rank 0 (the code of
commit 8f6cf38b4771, before each rank summarized its own windows): the reference the per-rank
summaries are tested against (tests/integration/test_metrics_summaries.py). `shares`: one
`planning.Planned` per rank (or the whole corpus), in window order.

Kept as it was but for `assemble_metrics`, which takes Planned values instead of RankShares.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from packctl.contract.manifest import METRICS
from packctl.contract.schema import BATCH_SIZE, DP_RANK, STEP
from packctl.plan.align import round_up
from packctl.plan.groups import group_ids
from packctl.plan.windows import PackPlan, merge_plans
from packctl.specs import Mode, ReportSpec


def martello_toth_l2(lengths: np.ndarray, capacity: int) -> int:
    """Martello & Toth's L2 lower bound on the number of bins (>= ceil(sum/C), often tighter).

    For every threshold K in [0, C/2]: items above C-K each need a bin of their own (J1), items in
    (C/2, C-K] too (J2), and items in [K, C/2] (J3) can only use J2's free room, the rest needing
    new bins:  L(K) = |J1| + |J2| + max(0, ceil((sum J3 - (|J2| C - sum J2)) / C));  L2 = max_K L(K).

    lengths [6, 6, 6, 4, 4, 4], C = 10: ceil(30/10) = 3, but the three 6s need 3 bins whose free
    room 3*4 = 12 holds the 4s: L2 = 3; with lengths [7, 7, 7, 4, 4, 4] the 4s do not fit next to
    a 7, and L2 = 3 + ceil(12/10) = 5.
    """
    w = np.asarray(lengths, dtype=np.int64)
    if len(w) == 0:
        return 0
    if w.max() > capacity:
        raise ValueError("lengths above the capacity have no bin")
    counts = np.bincount(w, minlength=capacity + 1)
    # count_ge[x], sum_ge[x]: number and total size of items >= x, for x in [0, C + 1]
    count_ge = np.concatenate([np.cumsum(counts[::-1])[::-1], [0]])
    sum_ge = np.concatenate([np.cumsum((counts * np.arange(capacity + 1))[::-1])[::-1], [0]])
    half = capacity // 2
    k = np.arange(0, half + 1)
    j1 = count_ge[capacity - k + 1]  # items > C - K
    j2 = count_ge[half + 1] - j1  # items in (C/2, C - K]
    sum_j2 = sum_ge[half + 1] - sum_ge[capacity - k + 1]
    sum_j3 = sum_ge[k] - sum_ge[half + 1]  # items in [K, C/2]
    spill = sum_j3 - (j2 * capacity - sum_j2)
    extra = np.maximum(0, -(-spill // capacity))
    return int((j1 + j2 + extra).max())


def length_histogram(lengths: np.ndarray) -> dict[str, list[int]]:
    """Sequences and their tokens in power-of-two buckets [1,2) [2,4) [4,8) ...:
    {"edges": [...], "counts": [...], "tokens": [...]}. Lengths [1, 3, 3] -> edges [1, 2, 4],
    counts [1, 2], tokens [1, 6]: few long sequences can hold most of the tokens."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) == 0:
        return {"edges": [1], "counts": [], "tokens": []}
    top = int(np.ceil(np.log2(max(int(lengths.max()), 1) + 1)))
    edges = [2**k for k in range(top + 1)]
    bucket = np.floor(np.log2(np.maximum(lengths, 1))).astype(np.int64)
    counts = np.bincount(bucket, minlength=top)
    tokens = np.bincount(bucket, weights=lengths, minlength=top).astype(np.int64)
    return {"edges": edges, "counts": counts[:top].tolist(), "tokens": tokens[:top].tolist()}


def padded_batching_tokens(lengths: np.ndarray, batch_size: int) -> int:
    """Tokens computed by plain padded batching: consecutive batches of `batch_size` sequences,
    each padded to its longest. lengths [3, 5, 2, 2], batch 2 -> 2*5 + 2*2 = 14."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) == 0:
        return 0
    batch_size = max(1, int(batch_size))
    starts = np.arange(0, len(lengths), batch_size)
    maxima = np.maximum.reduceat(lengths, starts)
    sizes = np.diff(np.append(starts, len(lengths)))
    return int((maxima * sizes).sum())


def pack_metrics(seq_lens: np.ndarray, seq_offsets: np.ndarray, pack_lens: np.ndarray, *,
                 capacity: int, align: int, input_order: np.ndarray | None = None) -> dict[str, Any]:
    """Metrics of a packing.

    Args:
        seq_lens: true length of every packed sequence, pack by pack.
        seq_offsets: CSR offsets of the sequences of each pack (len B+1).
        pack_lens: length of each pack as written (capacity, or rounded to the pack multiple).
        capacity, align: the layout.
        input_order: permutation putting the sequences back in input (sample id) order, for the
            padded-batching baseline; None uses the packed order.
    """
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    seq_offsets = np.asarray(seq_offsets, dtype=np.int64)
    pack_lens = np.asarray(pack_lens, dtype=np.int64)
    packs = len(seq_offsets) - 1
    sequences = len(seq_lens)
    tokens = int(seq_lens.sum())
    padded = round_up(seq_lens, align)
    per_pack = np.diff(seq_offsets)
    loads = pack_loads(seq_lens, seq_offsets)
    utilization = tokens / (packs * capacity) if packs else 0.0
    fill = loads / capacity
    balance = 1.0 - float(fill.std()) / utilization if packs and utilization > 0 else 0.0
    lower_bound = math.ceil(int(padded.sum()) / capacity)
    written = int(pack_lens.sum())
    mean_per_pack = sequences / packs if packs else 0.0
    baseline_lengths = seq_lens if input_order is None else seq_lens[input_order]
    baseline = padded_batching_tokens(baseline_lengths, round(mean_per_pack) or 1)
    return {
        "packs": packs,
        "sequences": sequences,
        "tokens": tokens,
        "capacity": capacity,
        "utilization": utilization,
        "waste_ratio": 1.0 - utilization if packs else 0.0,
        "bin_balance": balance,
        "packing_efficiency": lower_bound / packs if packs else 1.0,
        "lower_bound_packs": lower_bound,
        "lower_bound_packs_l2": martello_toth_l2(padded, capacity) if packs else 0,
        "padding": {
            "alignment_tokens": int((padded - seq_lens).sum()),
            "tail_tokens": written - int(padded.sum()),
            "written_tokens": written,
            "fraction_of_written": (written - tokens) / written if written else 0.0,
        },
        "sequences_per_pack": {
            "min": int(per_pack.min()) if packs else 0,
            "mean": mean_per_pack,
            "max": int(per_pack.max()) if packs else 0,
            "histogram": np.bincount(per_pack).tolist() if packs else [],
        },
        "length_histogram": length_histogram(seq_lens),
        "padded_batching": {
            "batch_size": round(mean_per_pack) or 1,
            "tokens": baseline,
            "packed_tokens": written,
            "estimated_gain": baseline / written if written else 0.0,
        },
    }


def pack_loads(values: np.ndarray, seq_offsets: np.ndarray) -> np.ndarray:
    """Per-pack sums of a per-sequence value: values [3, 2, 5], offsets [0, 2, 3] -> [5, 5].

    The result has the dtype of `values` (int64 for lengths, float64 for costs); a pack without
    sequences sums to 0.
    """
    values = np.asarray(values)
    seq_offsets = np.asarray(seq_offsets, dtype=np.int64)
    cumulative = np.concatenate([np.zeros(1, values.dtype if values.size else np.int64), np.cumsum(values)])
    return cumulative[seq_offsets[1:]] - cumulative[seq_offsets[:-1]]


def batch_metrics(seq_lens: np.ndarray, seq_offsets: np.ndarray, rows: np.ndarray, batch_lens: np.ndarray, *,
                  max_tokens: int, input_order: np.ndarray | None = None) -> dict[str, Any]:
    """Padded micro-batches (`--mode batch`): shapes, padding, and the padding of naive batching
    (the same mean number of sequences per batch, in input order, each batch padded to its
    longest sequence).

    rows [2, 1], batch_lens [10, 8] (padded_len 5 and 8), seq_lens [5, 4, 8]
    -> 18 tokens written for 17: padding 1 (5.6%).
    """
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    rows = np.asarray(rows, dtype=np.int64)
    batch_lens = np.asarray(batch_lens, dtype=np.int64)
    batches = len(rows)
    written = int(batch_lens.sum())
    tokens = int(seq_lens.sum())
    padded_len = np.where(rows > 0, batch_lens // np.maximum(rows, 1), 0)
    mean_seqs = len(seq_lens) / batches if batches else 0.0
    naive_lengths = seq_lens if input_order is None else seq_lens[input_order]
    naive = padded_batching_tokens(naive_lengths, round(mean_seqs) or 1)
    shapes = shape_table(rows, padded_len)
    return {
        "micro_batches": batches,
        "max_tokens": max_tokens,
        "sequences_per_batch": {"min": int(np.diff(seq_offsets).min()) if batches else 0, "mean": mean_seqs,
                                "max": int(np.diff(seq_offsets).max()) if batches else 0},
        "distinct_shapes": len(shapes),
        "shapes": shapes,
        "written_tokens": written,
        "padding_tokens": written - tokens,
        "padding_fraction": (written - tokens) / written if written else 0.0,
        "empty_rows": int(rows.sum() - len(seq_lens)),
        "naive": {"batch_size": round(mean_seqs) or 1, "written_tokens": naive,
                  "padding_fraction": (naive - tokens) / naive if naive else 0.0},
        "padding_saved_vs_naive": 1.0 - (written - tokens) / (naive - tokens) if naive > tokens else 0.0,
    }


def shape_table(rows: np.ndarray, padded_len: np.ndarray) -> list[dict[str, int]]:
    """Distinct (rows, padded_len) with how many micro-batches have each, most frequent first."""
    if len(rows) == 0:
        return []
    pairs, counts = np.unique(np.stack([rows, padded_len], axis=1), axis=0, return_counts=True)
    order = np.lexsort((pairs[:, 1], -counts))
    return [{"rows": int(pairs[i, 0]), "padded_len": int(pairs[i, 1]), "micro_batches": int(counts[i])}
            for i in order]


def imbalance(grid: np.ndarray) -> np.ndarray:
    """max / mean over ranks, per step (a step with no cost counts 1.0)."""
    grid = np.asarray(grid, dtype=np.float64)
    if grid.size == 0:
        return np.zeros(0)
    mean = grid.mean(axis=1)
    return np.where(mean > 0, grid.max(axis=1) / np.where(mean > 0, mean, 1.0), 1.0)


def imbalance_summary(grid: np.ndarray) -> dict:
    """Per-step max/mean summarized: mean and worst over steps, and `weighted` = sum over steps
    of the slowest rank / sum of the mean rank (the share of a run's time spent waiting is
    1 - 1/weighted)."""
    per_step = imbalance(grid)
    if len(per_step) == 0:
        return {"mean": 1.0, "max": 1.0, "weighted": 1.0, "worst_step": None}
    grid = np.asarray(grid, dtype=np.float64)
    mean_total = grid.mean(axis=1).sum()
    worst = int(np.argmax(per_step))
    return {"mean": float(per_step.mean()), "max": float(per_step[worst]),
            "weighted": float(grid.max(axis=1).sum() / mean_total) if mean_total > 0 else 1.0,
            "worst_step": worst}


def plan_metrics(plan: PackPlan, pack_lens: np.ndarray, spec: ReportSpec, num_sequences: int,
                 tokens_in: int, *, skipped_empty: int = 0) -> dict[str, Any]:
    """metrics.json without throughput and timings: what the plan of the whole corpus achieves.
    In batch mode the "capacity" of a row is the micro-batch budget, max_tokens."""
    metrics = pack_metrics(plan.piece_len, plan.bin_offsets, pack_lens, capacity=spec.capacity,
                           align=spec.align, input_order=np.argsort(plan.piece_gid, kind="stable"))
    metrics["algorithm"] = spec.algorithm
    metrics["order"] = str(spec.order)
    metrics["counts"] = plan_counts(plan, num_sequences, tokens_in, skipped_empty=skipped_empty)
    return metrics


def plan_counts(plan: PackPlan, num_sequences: int, tokens_in: int, *, skipped_empty: int = 0) -> dict[str, int]:
    """The manifest's `counts`. Empty sequences left out by --skip-empty are counted on their own
    (`sequences_skipped_empty`) and among `sequences_dropped` (every input sample absent from the
    output), so conservation checks see every sample accounted for."""
    dropped = len(plan.dropped) + skipped_empty
    return {
        "sequences_in": num_sequences,
        "sequences_packed": num_sequences - dropped,
        "sequences_dropped": dropped,
        "sequences_skipped_empty": skipped_empty,
        "sequences_truncated": len(plan.truncated),
        "sequences_split": len(plan.split_gids()),
        "tokens_in": tokens_in,
        "tokens_packed": int(plan.piece_len.sum()),
        "tokens_dropped": plan.tokens_dropped,
        "tokens_truncated": plan.tokens_truncated,
        "packs": plan.num_bins,
        "pieces": len(plan.piece_gid),
    }


def assemble_metrics(spec: ReportSpec, shares: list, ranks: list[dict[str, Any]], corpus, *,
                     plan_figures: dict[str, Any] | None = None,
                     group_starts: np.ndarray | None = None) -> tuple[dict[str, Any], PackPlan]:
    """metrics.json from every rank's share (in rank order), without throughput and timings;
    `plan_figures` may pass `plan_metrics` computed ahead (one process); `group_starts`
    (--group-column) adds `groups`. Returns the whole plan too."""
    whole = merge_plans([s.plan for s in shares])
    pack_lens = np.concatenate([s.pack_lens for s in shares])
    metrics = plan_figures if plan_figures is not None else plan_metrics(
        whole, pack_lens, spec, corpus.sequences, corpus.tokens, skipped_empty=corpus.skipped_empty)
    batch = spec.mode == Mode.BATCH
    batch_sizes = np.concatenate([s.columns[BATCH_SIZE] for s in shares]) if batch else None
    if spec.balance is not None:
        metrics["balance"] = balance_report(spec.balance, [s.balanced.figures for s in shares])
    if batch:
        metrics["batching"] = batch_metrics(whole.piece_len, whole.bin_offsets, batch_sizes, pack_lens,
                                            max_tokens=spec.capacity,
                                            input_order=np.argsort(whole.piece_gid, kind="stable"))
    if spec.balance is not None:
        shapes = pack_lens if not batch else pack_lens // np.maximum(batch_sizes, 1)
        metrics["balance"]["shapes"] = shape_coverage(np.concatenate([s.columns[STEP] for s in shares]),
                                                      np.concatenate([s.columns[DP_RANK] for s in shares]), shapes,
                                                      spec.balance["dp_size"])
    if group_starts is not None:
        metrics["groups"] = group_report(whole, group_starts, str(spec.group_scope))
    if spec.shape_buckets:
        buckets = shares[0].buckets
        metrics["shape_buckets"] = [int(b) for b in buckets] if buckets is not None else []
    return metrics, whole


def group_report(plan: PackPlan, group_starts: np.ndarray, scope: str) -> dict[str, Any]:
    """metrics.json's `groups` (--group-column): how many groups, of how many members, and over
    how many packs each lies (1 with --group-scope pack but for a group of one split by
    --too-long split; with step, how far a group spreads over its step).

        groups {0,1} {2}, packs [0 1 2] -> groups 2, of two or more 1, packs per group 1 / 1.0
    """
    pack = np.repeat(np.arange(plan.num_bins, dtype=np.int64), np.diff(plan.bin_offsets))
    ids = group_ids(plan.piece_gid, group_starts)
    groups, members = np.unique(ids, return_counts=True) if len(ids) else (ids, ids)
    sequences = np.unique(np.stack([ids, plan.piece_gid]), axis=1)[0] if len(ids) else ids
    size = np.bincount(np.searchsorted(groups, sequences), minlength=len(groups))
    spread = np.unique(np.stack([ids, pack]), axis=1)[0] if len(ids) else ids
    packs = np.bincount(np.searchsorted(groups, spread), minlength=len(groups))
    big = size > 1
    return {
        "scope": scope,
        "groups": int(len(groups)),
        "groups_of_two_or_more": int(big.sum()),
        "members": {"mean": float(size.mean()) if len(size) else 0.0, "max": int(size.max()) if len(size) else 0},
        "packs_per_group": {"mean": float(packs[big].mean()) if big.any() else 1.0,
                            "max": int(packs.max()) if len(packs) else 0,
                            "over_one_pack": int((packs[big] > 1).sum())},
    }


def epochs_metrics(spec: ReportSpec, shares: list, ranks: list[dict[str, Any]], corpus,
                   per_epoch: list[dict[str, Any]]) -> dict[str, Any]:
    """OUT/_metrics.json of `--epochs`: the pack metrics of every epoch's packs together (`shares`:
    every rank's share of epoch 0, then of epoch 1, ...), `counts` of one epoch (each packs the
    same sequences) but for `packs`, `pieces` and `tokens_packed`, which are of all epochs, and
    `epochs`: the figures of each."""
    metrics, _ = assemble_metrics(spec, shares, ranks, corpus)
    counts = dict(per_epoch[0]["counts"])
    for key in ("packs", "pieces", "tokens_packed"):
        counts[key] = sum(m["counts"][key] for m in per_epoch)
    counts["epochs"] = spec.epochs
    metrics["counts"] = counts
    metrics["epochs"] = [{"epoch": m["epoch"]["index"], "seed": m["epoch"]["seed"], "packs": m["packs"],
                          "utilization": m["utilization"], "tokens_packed": m["counts"]["tokens_packed"]}
                         for m in per_epoch]
    return metrics


def shape_coverage(step: np.ndarray, dp_rank: np.ndarray, shape: np.ndarray, dp_size: int) -> dict[str, Any]:
    """When every rank has met every shape (pack length, or padded_len in batch mode): the step
    by which rank r has seen shape s, maximized over ranks: `all_seen_by_step` is the step after
    which no rank meets a new shape (no more torch.compile recompiles)."""
    step, dp_rank, shape = (np.asarray(a, dtype=np.int64) for a in (step, dp_rank, shape))
    values = np.unique(shape)
    first_seen = []
    for value in values.tolist():
        sel = shape == value
        per_rank = np.full(dp_size, np.iinfo(np.int64).max)
        np.minimum.at(per_rank, dp_rank[sel], step[sel])
        first_seen.append(int(per_rank.max()) if (per_rank < np.iinfo(np.int64).max).all() else None)
    seen = [f for f in first_seen if f is not None]
    return {"distinct": len(values), "values": values.tolist(), "all_ranks_seen_by_step": first_seen,
            "all_seen_by_step": max(seen) if seen and len(seen) == len(first_seen) else None,
            "steps": int(step.max()) + 1 if len(step) else 0}


def balance_report(options: dict[str, Any], figures: list[dict[str, Any]]) -> dict[str, Any]:
    """metrics.json's `balance`: the --dp-size options (`ReportSpec.balance`), imbalance (max/mean
    over ranks, per step) before, i.e. round robin over the planner's packs, and after; batch sizes
    and lr_scale per step."""
    cat = (lambda key: np.concatenate([f[key] for f in figures]))
    before_tokens, before_attention = cat("before_tokens"), cat("before_attention")
    after_tokens, after_attention = cat("after_tokens"), cat("after_attention")
    packs_per_step = cat("packs_per_step")
    return {
        **{key: options[key] for key in ("dp_size", "micro_batches", "step_tokens", "cost", "attn_coeff", "scope",
                                         "step_grouping", "equal_counts")},
        "steps": int(len(packs_per_step)),
        "unequal_steps": int(sum(f["unequal_steps"] for f in figures)),
        "packs_added": int(sum(f["packs_added"] for f in figures)),
        "before": {"tokens": imbalance_summary(before_tokens), "attention": imbalance_summary(before_attention)},
        "after": {"tokens": imbalance_summary(after_tokens), "attention": imbalance_summary(after_attention)},
        "lr_scaling": options["lr_scaling"], "batch_unit": options["batch_unit"],
        "ref_batch_size": figures[0]["ref_batch_size"],
        "per_step": {
            "packs": packs_per_step.tolist(),
            "sequences": cat("step_sequences").tolist(),
            "tokens": cat("step_tokens").tolist(),
            "lr_scale": [round(float(x), 6) for x in cat("lr_scale")],
            "attention_imbalance": [round(float(x), 6) for x in imbalance(after_attention)],
            "tokens_imbalance": [round(float(x), 6) for x in imbalance(after_tokens)],
        },
    }


def manifest_config(out: Path):
    """The PackConfig OUT's manifest records (the options of the run that wrote it; with --epochs,
    the first epoch's manifest)."""
    import dataclasses

    from packctl import PackConfig

    manifest = min(out.rglob("_manifest.json"), key=lambda p: len(p.parts))
    recorded = json.loads(manifest.read_text())["config"]
    names = {f.name for f in dataclasses.fields(PackConfig)}
    return PackConfig(**{k: v for k, v in recorded.items() if k in names})


def reference_metrics(config) -> dict[str, dict[str, Any]]:
    """Every `_metrics.json` `pack` writes for `config` (a PackConfig), by the code above from the
    whole plan of the corpus planned in one process (`plan_corpus`, per epoch as `pack` plans it),
    without throughput, timings and the per-rank keys: {"_metrics.json": ..., "epoch-00000/_metrics.json": ...}."""
    from packctl.contract.manifest import epoch_dir
    from packctl.pipeline.plan import plan_corpus
    from packctl.plan.order import epoch_seed
    from packctl.stats.whatif import read_lengths

    specs = config.specs()
    index = read_lengths(list(config.inputs), config.tokens_column, config.group_column, skip_empty=config.skip_empty)
    skipped = int(np.count_nonzero(index.lengths == 0)) if config.skip_empty else 0
    corpus = type("Counts", (), dict(sequences=index.num_sequences, tokens=int(index.lengths.sum()),
                                     skipped_empty=skipped))
    epochs = [plan_corpus(index, specs.for_epoch(epoch_seed(specs.order.seed, e)) if e else specs)
              for e in range(specs.order.epochs)]
    if len(epochs) == 1:
        return {METRICS: assemble_metrics(specs.report, epochs, [], corpus, group_starts=index.group_starts)[0]}
    reports = {}
    for e, planned in enumerate(epochs):
        metrics = assemble_metrics(specs.report, [planned], [], corpus, group_starts=index.group_starts)[0]
        metrics["epoch"] = {"index": e, "of": specs.order.epochs, "seed": epoch_seed(specs.order.seed, e)}
        reports[f"{epoch_dir(e)}/{METRICS}"] = metrics
    every = epochs_metrics(specs.report, epochs, [], corpus, list(reports.values()))
    return {METRICS: every, **reports}


RUN_KEYS = ("timings", "throughput", "ranks", "scale_out")  # how the run went, not what the plan is


def written_metrics(out: Path) -> dict[str, dict]:
    """Every _metrics.json under OUT, without the keys of the run."""
    found = {}
    for path in sorted(out.rglob(METRICS)):
        metrics = json.loads(path.read_text())
        for key in RUN_KEYS:
            metrics.pop(key, None)
        found[str(path.relative_to(out))] = metrics
    return found


def assert_same_report(written: dict[str, dict], reference: dict[str, dict]) -> None:
    """The same files, keys in the same order and every value equal, but `bin_balance`, which is
    now computed from exact integer sums instead of a floating-point stdev: within 1e-12."""
    assert sorted(written) == sorted(reference)
    for name in reference:
        mine, theirs = dict(written[name]), dict(reference[name])
        assert mine["bin_balance"] == pytest.approx(theirs["bin_balance"], rel=1e-12, abs=1e-12), name
        mine["bin_balance"] = theirs["bin_balance"]
        assert json.dumps(mine) == json.dumps(theirs), name
