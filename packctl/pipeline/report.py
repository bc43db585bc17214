"""metrics.json of a pack run: what the plan achieves, how the ranks shared the work.

Every rank hands rank 0 a `RankShare` (its planned windows and what it wrote) and a rank report
(`rank_report`); `assemble_metrics` turns them into metrics.json (keys in docs/format.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from packctl.contract.manifest import ShardEntry
from packctl.contract.manifest import epoch_dir
from packctl.plan.metrics import batch_metrics, pack_metrics
from packctl.plan.balance import imbalance, imbalance_summary
from packctl.plan.groups import group_ids
from packctl.plan.windows import PackPlan, merge_plans
from packctl.pipeline.runtime import peak_rss_bytes
from packctl.contract.schema import BATCH_SIZE, DP_RANK, FORMAT_VERSION, STEP
from packctl.specs import Mode, ReportSpec
from packctl.version import __version__

STAGES = ("scan", "order", "plan", "assign", "materialize", "report")


@dataclass
class Corpus:
    """Counts of the whole input (every rank's blocks), from scan."""

    sequences: int
    tokens: int
    skipped_empty: int
    blocks: int
    tokens_equal_to_pad_id: int = 0


@dataclass(frozen=True)
class Transfer:
    """How tokens reached their writers: read by the writer, or exchanged; and how much reading
    would have decoded over what the output needs."""

    read_own: bool
    amplification: float


@dataclass
class RankShare:
    """What one rank planned (its windows, in global window order) and which shards it committed."""

    plan: PackPlan
    pack_lens: np.ndarray
    shards: dict[int, ShardEntry]
    balance_figures: dict[str, Any] | None
    batch_size: np.ndarray | None
    buckets: np.ndarray | None
    step: np.ndarray | None
    dp_rank: np.ndarray | None

    @classmethod
    def of(cls, planned, shards: dict[int, ShardEntry]) -> "RankShare":
        """This rank's share from its planning result (planning.Planned) and the shards it committed."""
        columns = planned.columns
        return cls(plan=planned.plan, pack_lens=planned.pack_lens, shards=shards,
                   balance_figures=planned.balanced.figures if planned.balanced is not None else None,
                   batch_size=columns.get(BATCH_SIZE), buckets=planned.buckets, step=columns.get(STEP),
                   dp_rank=columns.get(DP_RANK))


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


def rank_report(comm, index, written_plan: PackPlan, written, timings: dict[str, float],
                transfer: Transfer) -> dict[str, Any]:
    """One rank's share of the work, for metrics.json's `ranks`: `written_plan` holds the packs it wrote."""
    return {
        "rank": comm.rank,
        "sequences_scanned": len(index.lengths),
        "tokens_scanned": int(index.lengths.sum()),
        "packs_written": written_plan.num_bins,
        "tokens_written": int(written_plan.piece_len.sum()),
        "token_transfer": "read" if transfer.read_own else "exchange",
        "read_amplification": round(transfer.amplification, 4),  # of all ranks: blocks decoded by reading / needed
        "blocks_read": written.blocks_read,
        "shards_written": len(written.shards),
        "bytes_sent": int(comm.bytes_sent),
        "bytes_received": int(comm.bytes_received),
        "exchange_rounds": written.rounds,
        "blocks_read_twice": written.blocks_reread,
        "spill_files": written.spill_files,
        "spilled_bytes": written.spilled_bytes,
        "peak_rss_bytes": peak_rss_bytes(),
        "timings": dict(timings),
    }


def _max_mean(values: list[float]) -> dict[str, float]:
    mean = sum(values) / len(values) if values else 0.0
    return {"max": round(max(values), 6) if values else 0.0, "mean": round(mean, 6),
            "max_over_mean": round(max(values) / mean, 4) if mean > 0 else 1.0}


def scale_out(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """metrics.json's `scale_out`: how evenly the ranks shared the run (max/mean over ranks of
    tokens written and of each stage's seconds) and the bytes they exchanged."""
    return {
        "ranks": len(ranks),
        "token_transfer": ranks[0]["token_transfer"],
        "read_amplification": ranks[0]["read_amplification"],
        "tokens_written": _max_mean([r["tokens_written"] for r in ranks]),
        "stage_seconds": {stage: _max_mean([r["timings"].get(stage, 0.0) for r in ranks])
                          for stage in STAGES if any(stage in r["timings"] for r in ranks)},
        "bytes_exchanged": int(sum(r["bytes_sent"] for r in ranks)),
    }


def assemble_metrics(spec: ReportSpec, shares: list[RankShare], ranks: list[dict[str, Any]], corpus: Corpus, *,
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
    batch_sizes = np.concatenate([s.batch_size for s in shares]) if batch else None
    if spec.balance is not None:
        metrics["balance"] = balance_report(spec.balance, [s.balance_figures for s in shares])
    if batch:
        metrics["batching"] = batch_metrics(whole.piece_len, whole.bin_offsets, batch_sizes, pack_lens,
                                            max_tokens=spec.capacity,
                                            input_order=np.argsort(whole.piece_gid, kind="stable"))
    if spec.balance is not None:
        shapes = pack_lens if not batch else pack_lens // np.maximum(batch_sizes, 1)
        metrics["balance"]["shapes"] = shape_coverage(np.concatenate([s.step for s in shares]),
                                                      np.concatenate([s.dp_rank for s in shares]), shapes,
                                                      spec.balance["dp_size"])
    if group_starts is not None:
        metrics["groups"] = group_report(whole, group_starts, str(spec.group_scope))
    if spec.shape_buckets:
        buckets = shares[0].buckets
        metrics["shape_buckets"] = [int(b) for b in buckets] if buckets is not None else []
    if len(ranks) > 1:
        metrics["scale_out"] = scale_out(ranks)
        metrics["ranks"] = ranks
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


def epochs_metrics(spec: ReportSpec, shares: list[RankShare], ranks: list[dict[str, Any]], corpus: Corpus,
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


def epochs_index(spec: ReportSpec, metrics: dict[str, Any], timings: dict[str, float]) -> dict[str, Any]:
    """OUT/_epochs.json, written last: which output holds which epoch (docs/format.md)."""
    return {
        "format_version": FORMAT_VERSION,
        "packctl_version": __version__,
        "epochs": spec.epochs,
        "seed": spec.seed,
        "outputs": [{"path": epoch_dir(e["epoch"]), **e} for e in metrics["epochs"]],
        "counts": metrics["counts"],
        "timings": timings,
    }


def throughput(corpus: Corpus, ranks: list[dict[str, Any]], timings: dict[str, float], *,
               resumed_shards: int) -> dict[str, Any]:
    """metrics.json's `throughput`: speed and memory of the run, and facts of this run that
    `packctl stats` cannot recompute from the shards. Speeds leave out the seconds spent compiling
    kernels (the first run after an install), which say nothing of packing."""
    packing = max(timings["total"] - timings.get("compile", 0.0), 1e-9)
    return {
        "sequences_per_s": corpus.sequences / packing,
        "tokens_per_s": corpus.tokens / packing,
        "peak_rss_bytes": max(r["peak_rss_bytes"] for r in ranks),
        "blocks": corpus.blocks,
        "blocks_read_twice": sum(r["blocks_read_twice"] for r in ranks),
        "spill_files": sum(r["spill_files"] for r in ranks),
        "spilled_bytes": sum(r["spilled_bytes"] for r in ranks),
        "resumed_shards": resumed_shards,
        "tokens_equal_to_pad_id": corpus.tokens_equal_to_pad_id,
    }


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
