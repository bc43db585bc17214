"""metrics.json of a pack run: what the plan achieves, how the ranks shared the work.

No rank holds the plan of another: every rank summarizes its own windows (`RankSummary`: exact
sums, histograms over bounded domains, per-step and per-shape tables), the summaries are added up
over ranks, the padded-batching baseline is computed over the ranks that scanned each sample
(`input_order_lengths`, `padded_batching_over_ranks`), and rank 0 writes metrics.json from them
(`metrics_of`) with every rank's report (`rank_report`); keys in docs/format.md. The figures are
those of the whole plan to the last digit, for any number of ranks.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from packctl.contract.manifest import epoch_dir
from packctl.plan.metrics import PackSummary, padded_batching_tokens
from packctl.plan.balance import imbalance_summary_of_steps, step_figures
from packctl.plan.groups import group_ids
from packctl.plan.prefix import piece_parents, prefix_pieces, sharing_counts
from packctl.plan.windows import PackPlan
from packctl.runtime import peak_rss_bytes
from packctl.contract.schema import BATCH_SIZE, DP_RANK, FORMAT_VERSION, STEP
from packctl.specs import Mode, ReportSpec
from packctl.version import __version__

STAGES = ("scan", "order", "plan", "assign", "materialize", "report")
SHARE_PREFIX = "share_prefix"  # metrics.json's section of --share-prefix, and its counts' prefix in a summary


@dataclass
class Corpus:
    """Counts of the whole input (every rank's blocks), from scan."""

    sequences: int
    tokens: int
    skipped_empty: int
    blocks: int
    tokens_equal_to_pad_id: int | None = 0  # None: not counted (a plan of Megatron pairs reads no token)


@dataclass(frozen=True)
class Transfer:
    """How tokens reached their writers: read by the writer, or exchanged; and how much reading
    would have decoded over what the output needs."""

    read_own: bool
    amplification: float


@dataclass
class RankSummary:
    """What one rank's windows of one epoch add to metrics.json: exact sums, histograms over
    bounded domains and small tables (per step, per shape), never a pack or a sequence. The
    summaries of all ranks add up (`a + b`, in any order: what is kept per rank is keyed by
    (epoch, rank)) to the summary of the whole output, from which `metrics_of` writes the very
    figures the whole plan gives.

        rank 0: 10 packs, steps 0-4      rank 1: 7 packs, steps 5-8
        -> packs 17, steps {(0, 0): steps 0-4, (0, 1): steps 5-8} laid end to end in that order
    """

    packs: PackSummary
    counts: dict[str, int]  # of the plan: sequences_dropped, ..._truncated, ..._split, tokens_dropped, ..._truncated
    # --dp-size: each (epoch, rank)'s steps; `balance_totals` unequal_steps, packs_added; ref_batch_size
    steps: dict[tuple[int, int], dict[str, np.ndarray]] = field(default_factory=dict)
    balance_totals: dict[str, int] = field(default_factory=dict)
    ref_batch_size: float | None = None
    # --dp-size: the first step at which each DP rank meets each shape; how many steps
    first_seen: dict[int, np.ndarray] | None = None
    num_steps: int = 0
    groups: dict[str, int] | None = None  # --group-column: see `group_summary`
    limits: dict[str, Any] | None = None  # --limit: see `limit_summary`

    @classmethod
    def of(cls, planned, spec: ReportSpec, *, epoch: int, rank: int,
           group_starts: np.ndarray | None = None) -> "RankSummary":
        """The summary of this rank's plan of epoch `epoch` (planning.Planned)."""
        plan, pack_lens, columns = planned.plan, planned.pack_lens, planned.columns
        batch = spec.mode == Mode.BATCH
        rows = columns.get(BATCH_SIZE) if batch else None
        summary = cls(
            packs=PackSummary.of(plan.piece_len, plan.bin_offsets, pack_lens, capacity=spec.capacity,
                                 align=spec.align, rows=rows),
            counts={"sequences_dropped": len(plan.dropped), "sequences_truncated": len(plan.truncated),
                    "sequences_split": plan.split_pieces()[1], "tokens_dropped": int(plan.tokens_dropped),
                    "tokens_truncated": int(plan.tokens_truncated)},
            groups=group_summary(plan, group_starts) if group_starts is not None else None)
        if spec.share_prefix and group_starts is not None:  # a prefix and its first branch are no split
            parents = piece_parents(plan, group_starts)
            prefix = prefix_pieces(plan.bin_offsets, parents)
            gids, counts = np.unique(plan.piece_gid[~prefix], return_counts=True)
            summary.counts["sequences_split"] = int((counts > 1).sum())
            summary.counts.update({f"{SHARE_PREFIX}.{key}": value for key, value in
                                   sharing_counts(plan.piece_start, plan.piece_len, parents, prefix).items()})
        if plan.piece_extra is not None and spec.limits:
            summary.counts["over_limit"] = len(plan.over_limit)
            summary.limits = limit_summary(plan, spec.limits, spec.capacity)
        if planned.balanced is not None:
            figures = planned.balanced.figures
            steps = {f"{key}/{part}": values for key in GRIDS + COST_COLUMN_GRIDS if key in figures
                     for part, values in zip(("imbalance", "mean", "max"), step_figures(figures[key]))}
            steps.update({key: np.asarray(figures[key]) for key in ("packs_per_step", "step_sequences",
                                                                     "step_tokens", "lr_scale")})
            summary.steps = {(epoch, rank): steps}
            summary.balance_totals = {"unequal_steps": int(figures["unequal_steps"]),
                                      "packs_added": int(figures["packs_added"])}
            summary.ref_batch_size = float(figures["ref_batch_size"])
            shapes = pack_lens if not batch else pack_lens // np.maximum(rows, 1)
            summary.first_seen, summary.num_steps = first_seen_steps(columns[STEP], columns[DP_RANK], shapes,
                                                                     spec.balance["dp_size"])
        return summary

    def __add__(self, other: "RankSummary") -> "RankSummary":
        first_seen = None
        if self.first_seen is not None or other.first_seen is not None:
            first_seen = dict(self.first_seen or {})
            for shape, steps in (other.first_seen or {}).items():
                first_seen[shape] = np.minimum(first_seen[shape], steps) if shape in first_seen else steps
        totals = {key: self.balance_totals.get(key, 0) + other.balance_totals.get(key, 0)
                  for key in {**self.balance_totals, **other.balance_totals}}
        refs = [r for r in (self.ref_batch_size, other.ref_batch_size) if r is not None]
        return RankSummary(
            packs=self.packs + other.packs,
            counts={key: self.counts[key] + other.counts[key] for key in self.counts},
            steps={**self.steps, **other.steps}, balance_totals=totals,
            # the same on every rank of an epoch; of epochs added up, the first epoch's (the one _metrics.json reports)
            ref_batch_size=refs[0] if refs else None,
            first_seen=first_seen, num_steps=max(self.num_steps, other.num_steps),
            groups=_add_groups(self.groups, other.groups), limits=_add_limits(self.limits, other.limits))

    def step_column(self, key: str) -> np.ndarray:
        """A per-step figure of every step, in the order of the global steps."""
        parts = [self.steps[k][key] for k in sorted(self.steps)]
        return np.concatenate(parts) if parts else np.zeros(0)


# The cost grids of the balance figures (steps x DP ranks); each rank sends `step_figures` of its rows
GRIDS = ("before_tokens", "before_attention", "after_tokens", "after_attention")
# --balance-cost COL: the same of COL's sum (balance.before.COL, balance.after.COL)
COST_COLUMN_GRIDS = ("before_cost_column", "after_cost_column")


def _add_groups(a: dict[str, int] | None, b: dict[str, int] | None) -> dict[str, int] | None:
    if a is None or b is None:
        return a if b is None else b
    return {key: (max(a[key], b[key]) if key.endswith("_max") else a[key] + b[key]) for key in a}


def limit_summary(plan: PackPlan, limits: dict[str, int], capacity: int) -> dict[str, Any]:
    """What `limit_report` needs of this plan's packs (--limit), as exact sums that add up over
    ranks: each limited column's total, the packs within 1% of each limit (sum >= 0.99 N), and the
    packs within 1% of the capacity in tokens (padded load >= 0.99 C).

        limits {images: 8}, capacity 10, packs of images [8, 3] and padded tokens [10, 6]
        -> totals [11], at_limit [1], at_capacity 1
    """
    bounds = np.asarray(list(limits.values()), dtype=np.int64)
    sums = plan.extra_loads()
    return {"totals": sums.sum(axis=0).astype(np.int64),
            "at_limit": (sums * 100 >= bounds * 99).sum(axis=0).astype(np.int64),
            "at_capacity": int((plan.loads(padded=True) * 100 >= 99 * capacity).sum())}


def _add_limits(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, Any] | None:
    if a is None or b is None:
        return a if b is None else b
    return {key: a[key] + b[key] for key in a}


def limit_report(limits: dict[str, int], summary: dict[str, Any], packs: int) -> dict[str, Any]:
    """metrics.json's `limits` (--limit): per limited column its limit, its total over the packs,
    the utilization of the budget (total / (packs x limit)) and the packs at the limit (sum >= 0.99 N).

        limits {images: 8}, 2 packs of 8 and 3 images -> {images: {limit 8, total 11,
        utilization 11/16 = 0.6875, packs_at_limit 1}}
    """
    return {column: {"limit": limit, "total": int(summary["totals"][j]),
                     "utilization": int(summary["totals"][j]) / (packs * limit) if packs else 0.0,
                     "packs_at_limit": int(summary["at_limit"][j])}
            for j, (column, limit) in enumerate(limits.items())}


def first_seen_steps(step: np.ndarray, dp_rank: np.ndarray, shape: np.ndarray, dp_size: int
                     ) -> tuple[dict[int, np.ndarray], int]:
    """For each shape, the first step at which each DP rank meets it (int64 max: never), and the
    number of steps (last + 1): what `shape_coverage` needs, merged over ranks by the minimum."""
    step, dp_rank, shape = (np.asarray(a, dtype=np.int64) for a in (step, dp_rank, shape))
    never = np.iinfo(np.int64).max
    seen = {}
    for value in np.unique(shape).tolist():
        sel = shape == value
        per_rank = np.full(dp_size, never)
        np.minimum.at(per_rank, dp_rank[sel], step[sel])
        seen[int(value)] = per_rank
    return seen, int(step.max()) + 1 if len(step) else 0


def group_summary(plan: PackPlan, group_starts: np.ndarray) -> dict[str, int]:
    """The sums and maxima of `group_report` over this plan's groups (a group lies whole in the
    windows of one rank): groups, members and packs of each, summed (over groups of two or more
    for packs) and maximized."""
    pack = np.repeat(np.arange(plan.num_bins, dtype=np.int64), np.diff(plan.bin_offsets))
    ids = group_ids(plan.piece_gid, group_starts)
    groups = np.unique(ids) if len(ids) else ids
    sequences = np.unique(np.stack([ids, plan.piece_gid]), axis=1)[0] if len(ids) else ids
    size = np.bincount(np.searchsorted(groups, sequences), minlength=len(groups))
    spread = np.unique(np.stack([ids, pack]), axis=1)[0] if len(ids) else ids
    packs = np.bincount(np.searchsorted(groups, spread), minlength=len(groups))
    big = size > 1
    return {"groups": int(len(groups)), "big": int(big.sum()), "members": int(size.sum()),
            "members_max": int(size.max()) if len(size) else 0, "big_packs": int(packs[big].sum()),
            "packs_max": int(packs.max()) if len(packs) else 0, "over_one_pack": int((packs[big] > 1).sum())}


def share_prefix_report(counts: dict[str, int]) -> dict[str, Any]:
    """metrics.json's `share_prefix` (--share-prefix) from the summed counts of `sharing_counts`:
    groups stored as trees, tokens saved, and the causal attention cost (visible query-key pairs)
    of the rows flat and as stored, with what it saves.

        groups_shared 1, tokens_saved 3, attention 36 -> 30: attention_saved 6, fraction 0.1667
    """
    got = {key.split(".", 1)[1]: value for key, value in counts.items() if key.startswith(SHARE_PREFIX + ".")}
    flat, tree = got.get("attention_flat", 0), got.get("attention_tree", 0)
    return {"groups_shared": got.get("groups_shared", 0), "tokens_saved": got.get("tokens_saved", 0),
            "attention_flat": flat, "attention_tree": tree, "attention_saved": flat - tree,
            "attention_saved_fraction": (flat - tree) / flat if flat else 0.0}


def group_report(summary: dict[str, int], scope: str) -> dict[str, Any]:
    """metrics.json's `groups` (--group-column) from `group_summary`: how many groups, of how
    many members, and over how many packs each lies (1 with --group-scope pack but for a group of
    one split by --too-long split; with step, how far a group spreads over its step).

        groups {0,1} {2}, packs [0 1 2] -> groups 2, of two or more 1, packs per group 1 / 1.0
    """
    groups, big = summary["groups"], summary["big"]
    return {
        "scope": scope,
        "groups": groups,
        "groups_of_two_or_more": big,
        "members": {"mean": summary["members"] / groups if groups else 0.0, "max": summary["members_max"]},
        "packs_per_group": {"mean": summary["big_packs"] / big if big else 1.0, "max": summary["packs_max"],
                            "over_one_pack": summary["over_one_pack"]},
    }


def input_order_lengths(comm, pieces: list[tuple[np.ndarray, np.ndarray]], gid_starts: np.ndarray
                        ) -> tuple[np.ndarray, np.ndarray]:
    """The pieces of this rank's sample ids (rank r: gid_starts[r] <= gid < gid_starts[r + 1], the
    gids it scanned), wherever they were planned, in input order: by gid, then epoch, then plan
    order, as (epoch, true length). `pieces[e]`: (piece_gid, piece_len) of this rank's plan of epoch e.
    Each rank sends each piece once (3 int64): what it receives is about its share."""
    gid = np.concatenate([g for g, _ in pieces]).astype(np.int64)
    length = np.concatenate([n for _, n in pieces]).astype(np.int64)
    epoch = np.repeat(np.arange(len(pieces), dtype=np.int64), [len(g) for g, _ in pieces])
    order = np.lexsort((epoch, gid))  # stable: plan order within (gid, epoch)
    if comm.size == 1:
        return epoch[order], length[order]
    dest = np.searchsorted(gid_starts, gid[order], side="right") - 1
    packed = np.stack([gid[order], epoch[order], length[order]], axis=1).ravel()
    recv, _ = comm.alltoallv(packed, np.bincount(dest, minlength=comm.size).astype(np.int64) * 3)
    recv = recv.reshape(-1, 3)
    # the pieces of one (gid, epoch) were planned on one rank and arrive in its plan order
    order = np.lexsort((recv[:, 1], recv[:, 0]))
    return recv[order, 1], recv[order, 2]


def padded_batching_over_ranks(comm, lengths: np.ndarray, batch_size: int) -> int:
    """`padded_batching_tokens` of every rank's `lengths` laid end to end in rank order: each rank
    sums the batches that lie whole in its part, and the (at most two) batches a rank boundary cuts
    are joined from (batch, longest, sequences) of each side.

        rank 0: [3, 5, 2]  rank 1: [2, 7], batch 2 -> batches [3 5] [2 | 2] [7]: 10 + 4 + 7 = 21
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if comm.size == 1:
        return padded_batching_tokens(lengths, batch_size)
    n, first, total = len(lengths), comm.exscan(len(lengths)), comm.allreduce_sum(len(lengths))
    whole, cut = 0, []
    if n:
        positions = first + np.arange(n, dtype=np.int64)
        starts = np.flatnonzero((positions % batch_size == 0) | (np.arange(n) == 0))
        maxima = np.maximum.reduceat(lengths, starts)
        sizes = np.diff(np.append(starts, n))
        batch = (first + starts) // batch_size
        inside = (batch * batch_size >= first) & (np.minimum((batch + 1) * batch_size, total) <= first + n)
        whole = int((maxima[inside] * sizes[inside]).sum())
        cut = [(int(b), int(m), int(c)) for b, m, c in zip(batch[~inside], maxima[~inside], sizes[~inside])]
    joined: dict[int, tuple[int, int]] = {}
    for b, longest, count in (c for part in comm.allgather(cut) for c in part):
        was = joined.get(b, (0, 0))
        joined[b] = (max(was[0], longest), was[1] + count)
    return comm.allreduce_sum(whole) + sum(longest * count for longest, count in joined.values())


def plan_counts(summary: RankSummary, num_sequences: int, tokens_in: int, *,
                skipped_empty: int = 0) -> dict[str, int]:
    """The manifest's `counts`. Empty sequences left out by --skip-empty are counted on their own
    (`sequences_skipped_empty`) and among `sequences_dropped` (every input sample absent from the
    output), so conservation checks see every sample accounted for."""
    dropped = summary.counts["sequences_dropped"] + skipped_empty
    return {
        "sequences_in": num_sequences,
        "sequences_packed": num_sequences - dropped,
        "sequences_dropped": dropped,
        "sequences_skipped_empty": skipped_empty,
        "sequences_truncated": summary.counts["sequences_truncated"],
        "sequences_split": summary.counts["sequences_split"],
        "tokens_in": tokens_in,
        "tokens_packed": summary.packs.tokens,
        "tokens_dropped": summary.counts["tokens_dropped"],
        "tokens_truncated": summary.counts["tokens_truncated"],
        # --share-prefix: the tokens of shared prefixes stored once instead of with every row
        **({"tokens_shared": summary.counts[f"{SHARE_PREFIX}.tokens_saved"]}
           if f"{SHARE_PREFIX}.tokens_saved" in summary.counts else {}),
        "packs": summary.packs.packs,
        "pieces": summary.packs.sequences,
        # --limit: the samples dropped for being over a limit on their own (among sequences_dropped)
        **({"over_limit": summary.counts["over_limit"]} if "over_limit" in summary.counts else {}),
    }


def rank_report(comm, index, written_plan: PackPlan, written, timings: dict[str, float],
                transfer: Transfer, *, sequences_planned: int) -> dict[str, Any]:
    """One rank's share of the work, for metrics.json's `ranks`: `written_plan` holds the packs it
    wrote; `sequences_planned`: the sequences of the windows it planned (of every epoch)."""
    return {
        "rank": comm.rank,
        "sequences_scanned": len(index.lengths),
        "tokens_scanned": int(index.lengths.sum()),
        "sequences_planned": sequences_planned,
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
    the sequences each planned, of tokens written and of each stage's seconds) and the bytes they
    exchanged. Windows are planned whole: with fewer windows than ranks, or few windows per rank,
    `sequences_planned` max/mean is above 1 (a smaller --window evens it out)."""
    return {
        "ranks": len(ranks),
        "token_transfer": ranks[0]["token_transfer"],
        "read_amplification": ranks[0]["read_amplification"],
        "sequences_planned": _max_mean([r["sequences_planned"] for r in ranks]),
        "tokens_written": _max_mean([r["tokens_written"] for r in ranks]),
        "stage_seconds": {stage: _max_mean([r["timings"].get(stage, 0.0) for r in ranks])
                          for stage in STAGES if any(stage in r["timings"] for r in ranks)},
        "bytes_exchanged": int(sum(r["bytes_sent"] for r in ranks)),
    }


def metrics_of(spec: ReportSpec, summary: RankSummary, baseline_tokens: int, ranks: list[dict[str, Any]],
               corpus: Corpus, *, buckets: np.ndarray | None = None, groups: bool = False) -> dict[str, Any]:
    """metrics.json without throughput and timings, from the summary of every rank's plan
    (`RankSummary`, added up) and the padded-batching baseline of its pieces in input order
    (`padded_batching_over_ranks`, in batches of `summary.packs.baseline_batch_size`);
    `buckets`: the --shape-buckets lengths (the same on every rank); `groups`: add `groups`
    (--group-column)."""
    metrics = summary.packs.metrics(baseline_tokens)
    metrics["algorithm"] = spec.algorithm
    metrics["order"] = str(spec.order)
    metrics["counts"] = plan_counts(summary, corpus.sequences, corpus.tokens, skipped_empty=corpus.skipped_empty)
    if spec.balance is not None:
        metrics["balance"] = balance_report(spec.balance, summary)
    if spec.mode == Mode.BATCH:
        metrics["batching"] = summary.packs.batch_metrics(baseline_tokens, spec.capacity)
    if spec.balance is not None:
        metrics["balance"]["shapes"] = shape_coverage(summary.first_seen or {}, summary.num_steps)
    if groups and summary.groups is not None:
        metrics["groups"] = group_report(summary.groups, str(spec.group_scope))
    if spec.share_prefix:
        metrics[SHARE_PREFIX] = share_prefix_report(summary.counts)
    if spec.limits and summary.limits is not None:
        metrics["limits"] = limit_report(spec.limits, summary.limits, summary.packs.packs)
        metrics["packs_at_capacity"] = summary.limits["at_capacity"]
    if spec.shape_buckets:
        metrics["shape_buckets"] = [int(b) for b in buckets] if buckets is not None else []
    if len(ranks) > 1:
        metrics["scale_out"] = scale_out(ranks)
        metrics["ranks"] = ranks
    return metrics


def assemble_metrics(spec: ReportSpec, planned, corpus: Corpus, *,
                     group_starts: np.ndarray | None = None) -> tuple[dict[str, Any], PackPlan]:
    """metrics.json of the plan of a whole corpus in one process (`planned`: pipeline.plan.Planned;
    the what-if of `packctl stats`), without throughput and timings, by the summary `pack` adds up
    over ranks; `group_starts` (--group-column) adds `groups`. Returns the plan too."""
    summary = RankSummary.of(planned, spec, epoch=0, rank=0, group_starts=group_starts)
    whole = planned.plan
    baseline = padded_batching_tokens(whole.piece_len[np.argsort(whole.piece_gid, kind="stable")],
                                      summary.packs.baseline_batch_size)
    metrics = metrics_of(spec, summary, baseline, [], corpus, buckets=planned.buckets,
                         groups=group_starts is not None)
    return metrics, whole


def epochs_metrics(spec: ReportSpec, summary: RankSummary, baseline_tokens: int, ranks: list[dict[str, Any]],
                   corpus: Corpus, per_epoch: list[dict[str, Any]], buckets: np.ndarray | None) -> dict[str, Any]:
    """OUT/_metrics.json of `--epochs`: the pack metrics of every epoch's packs together (`summary`:
    of every rank's plan of every epoch), `counts` of one epoch (each packs the same sequences)
    but for `packs`, `pieces` and `tokens_packed`, which are of all epochs, and `epochs`: the
    figures of each."""
    metrics = metrics_of(spec, summary, baseline_tokens, ranks, corpus, buckets=buckets)
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
               resumed_shards: int, resumed_tokens: int = 0) -> dict[str, Any]:
    """metrics.json's `throughput`: speed and memory of the run, and facts of this run that
    `packctl stats` cannot recompute from the shards. Speeds leave out the seconds spent compiling
    kernels (the first run after an install), which say nothing of packing. A resumed run counts
    only its own work: every sequence is scanned and planned again, but the `resumed_tokens` of
    the `resumed_shards` an earlier run finished are not written again, so they are left out of
    `tokens_per_s` (10M tokens, 8M of them kept, in 2 s: 1M tok/s)."""
    packing = max(timings["total"] - timings.get("compile", 0.0), 1e-9)
    return {
        "sequences_per_s": corpus.sequences / packing,
        "tokens_per_s": max(corpus.tokens - resumed_tokens, 0) / packing,
        "peak_rss_bytes": max(r["peak_rss_bytes"] for r in ranks),
        "blocks": corpus.blocks,
        "blocks_read_twice": sum(r["blocks_read_twice"] for r in ranks),
        "spill_files": sum(r["spill_files"] for r in ranks),
        "spilled_bytes": sum(r["spilled_bytes"] for r in ranks),
        "resumed_shards": resumed_shards,
        "resumed_tokens": resumed_tokens,
        "tokens_equal_to_pad_id": corpus.tokens_equal_to_pad_id,
    }


def shape_coverage(first_seen: dict[int, np.ndarray], num_steps: int) -> dict[str, Any]:
    """When every rank has met every shape (pack length, or padded_len in batch mode): the step
    by which rank r has seen shape s (`first_seen_steps`, merged over ranks), maximized over
    ranks: `all_seen_by_step` is the step after which no rank meets a new shape (no more
    torch.compile recompiles)."""
    never = np.iinfo(np.int64).max
    values = sorted(first_seen)
    first = [int(first_seen[v].max()) if (first_seen[v] < never).all() else None for v in values]
    seen = [f for f in first if f is not None]
    return {"distinct": len(values), "values": values, "all_ranks_seen_by_step": first,
            "all_seen_by_step": max(seen) if seen and len(seen) == len(first) else None,
            "steps": num_steps}


def balance_report(options: dict[str, Any], summary: RankSummary) -> dict[str, Any]:
    """metrics.json's `balance`: the --dp-size options (`ReportSpec.balance`), imbalance (max/mean
    over ranks, per step) before, i.e. round robin over the planner's packs, and after; batch sizes
    and lr_scale per step."""
    column = summary.step_column

    def summarized(key: str) -> dict[str, Any]:
        return imbalance_summary_of_steps(*(column(f"{key}/{part}") for part in ("imbalance", "mean", "max")))

    packs_per_step = column("packs_per_step")
    cost_column = options.get("balance_cost")  # --balance-cost COL: COL's figures beside the others
    both = {} if cost_column is None else {"balance_cost": cost_column}
    before = {} if cost_column is None else {cost_column: summarized("before_cost_column")}
    after = {} if cost_column is None else {cost_column: summarized("after_cost_column")}
    return {
        **{key: options[key] for key in ("dp_size", "micro_batches", "step_tokens", "cost", "attn_coeff", "scope",
                                         "step_grouping", "equal_counts")},
        **both,
        "steps": int(len(packs_per_step)),
        "unequal_steps": int(summary.balance_totals.get("unequal_steps", 0)),
        "packs_added": int(summary.balance_totals.get("packs_added", 0)),
        "before": {"tokens": summarized("before_tokens"), "attention": summarized("before_attention"), **before},
        "after": {"tokens": summarized("after_tokens"), "attention": summarized("after_attention"), **after},
        "lr_scaling": options["lr_scaling"], "batch_unit": options["batch_unit"],
        "ref_batch_size": summary.ref_batch_size,
        "per_step": {
            "packs": packs_per_step.tolist(),
            "sequences": column("step_sequences").tolist(),
            "tokens": column("step_tokens").tolist(),
            "lr_scale": [round(float(x), 6) for x in column("lr_scale")],
            "attention_imbalance": [round(float(x), 6) for x in column("after_attention/imbalance")],
            "tokens_imbalance": [round(float(x), 6) for x in column("after_tokens/imbalance")],
            **({f"{cost_column}_imbalance": [round(float(x), 6) for x in column("after_cost_column/imbalance")]}
               if cost_column is not None else {}),
        },
    }
