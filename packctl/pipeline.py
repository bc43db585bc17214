"""`packctl.pack(config)`: scan -> order -> plan -> materialize -> report.

Only lengths travel through scan, order and plan; tokens are read in materialize (from the
blocks scan kept within the memory budget, or decoded again) and routed to their shards.
"""
from __future__ import annotations

import resource
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from packctl.config import PackConfig
from packctl.errors import PackctlError
from packctl.io.manifest import build_manifest, shard_metadata
from packctl.io.reader import scan
from packctl.io.writer import OutputDir, ShardInfo, check_output_path
from packctl.materialize import materialize
from packctl.metrics import pack_metrics
from packctl.plan.align import pack_lengths_padded, round_up
from packctl.plan.order import order_sequences
from packctl.plan.windows import PackPlan, SequenceTooLong, plan_windows

STAGES = ("scan", "order", "plan", "materialize", "report")


class Progress:
    """Receives stage progress; the default shows nothing (the CLI passes a rich display)."""

    def stage(self, name: str, total: int | None) -> Callable[[int], None]:
        return lambda n: None

    def close(self) -> None:
        pass


@dataclass
class PackResult:
    """What a pack run did: where it wrote, the counts of the manifest, metrics and timings."""

    output: Path
    counts: dict[str, int]
    metrics: dict[str, Any]
    timings: dict[str, float]
    shards: list[ShardInfo] = field(default_factory=list)


def pack(config: PackConfig, *, progress: Progress | None = None) -> PackResult:
    """Pack `config.inputs` into `config.output` and return the counts and metrics.

    >>> from packctl import PackConfig, pack
    >>> result = pack(PackConfig(inputs=["sample_data"], output="/tmp/out", capacity=4096,
    ...                          too_long="split", overwrite=True))          # doctest: +SKIP
    >>> result.metrics["utilization"]                                        # doctest: +SKIP
    0.99...
    """
    config.validate()
    progress = progress or Progress()
    timings: dict[str, float] = {}
    started = time.perf_counter()
    out = Path(config.output)
    check_output_path(out, overwrite=config.overwrite)

    with _timed(timings, "scan"):
        index, source = scan(config.inputs, config.tokens_column, config.labels_column,
                             config.resolved_memory_budget, progress=progress.stage("scan", None))
    check_output_path(out, overwrite=config.overwrite, inputs=[f.path for f in index.files])

    with _timed(timings, "order"):
        permutation = order_corpus(index, config)

    with _timed(timings, "plan"):
        plan, pack_lens = plan_corpus(index, config, permutation,
                                      progress=progress.stage("plan", index.num_sequences))

    output = OutputDir(out, overwrite=config.overwrite)
    try:
        with _timed(timings, "materialize"):
            written = materialize(plan, pack_lens, index, source, output=output,
                                  metadata=shard_metadata(config, index.labels_column, index.files),
                                  shard_rows=config.shard_rows, pad_token_id=config.pad_token_id,
                                  budget=config.resolved_memory_budget,
                                  progress=progress.stage("materialize", plan.num_bins))
            shards = written.shards
        with _timed(timings, "report"):
            metrics = plan_metrics(index, plan, pack_lens, config)
            counts = metrics["counts"]
        timings["total"] = time.perf_counter() - started
        metrics["throughput"] = {
            "sequences_per_s": index.num_sequences / timings["total"],
            "tokens_per_s": counts["tokens_in"] / timings["total"],
            "peak_rss_bytes": peak_rss_bytes(),
            "blocks": len(index.blocks),
            "blocks_read_twice": written.blocks_reread,
            "spill_files": written.spill_files,
            "spilled_bytes": written.spilled_bytes,
        }
        metrics["timings"] = timings
        output.write_json("metrics.json", metrics)
        output.write_json("manifest.json", build_manifest(config, index.labels_column, index.files,
                                                           shards, counts, timings))
        output.commit()
    except BaseException:
        output.abort()
        raise
    finally:
        progress.close()
    return PackResult(output=out, counts=counts, metrics=metrics, timings=timings, shards=shards)


def order_corpus(index, config: PackConfig) -> np.ndarray:
    """The sequence order of `config` (depends on the order options and the alignment only)."""
    return order_sequences(round_up(index.lengths, config.align), config.order, seed=config.seed,
                           curriculum_order=config.curriculum_order)


def plan_corpus(index, config: PackConfig, permutation: np.ndarray | None = None,
                progress: Callable[[int], None] | None = None) -> tuple[PackPlan, np.ndarray]:
    """The packs of the corpus and their final lengths, exactly as `pack(config)` writes them.

    `index` needs `lengths` (true length by gid) and `describe(gid)` (where a sequence comes
    from, for the over-long error). Shared by `pack` and the what-if of `packctl stats`.
    """
    if permutation is None:
        permutation = order_corpus(index, config)
    try:
        plan = plan_windows(index.lengths, permutation, capacity=config.plan_capacity, align=config.align,
                            algorithm=config.algorithm, too_long=config.too_long, window=config.window,
                            max_seqs_per_bin=config.max_seqs_per_bin, seed=config.seed, progress=progress)
    except SequenceTooLong as exc:
        raise PackctlError(
            f"{index.describe(exc.gid)}: sequence of {exc.length} tokens (padded to {exc.padded}) is longer "
            f"than the capacity {exc.capacity}; pass --too-long drop|truncate|split or raise --capacity"
        ) from None
    pack_lens = pack_lengths_padded(plan.loads(padded=True), config.capacity, config.pad_to,
                                    config.resolved_pack_multiple)
    return plan, pack_lens


def plan_metrics(index, plan: PackPlan, pack_lens: np.ndarray, config: PackConfig) -> dict[str, Any]:
    """metrics.json without throughput and timings: what the plan achieves."""
    metrics = pack_metrics(plan.piece_len, plan.bin_offsets, pack_lens, capacity=config.capacity,
                           align=config.align, input_order=np.argsort(plan.piece_gid, kind="stable"))
    metrics["algorithm"] = config.algorithm
    metrics["order"] = config.order
    metrics["counts"] = plan_counts(index, plan)
    return metrics


def plan_counts(index, plan: PackPlan) -> dict[str, int]:
    """The manifest's `counts`."""
    packed_gids = index.num_sequences - len(plan.dropped)
    return {
        "sequences_in": index.num_sequences,
        "sequences_packed": packed_gids,
        "sequences_dropped": len(plan.dropped),
        "sequences_truncated": len(plan.truncated),
        "sequences_split": len(plan.split_gids()),
        "tokens_in": int(index.lengths.sum()),
        "tokens_packed": int(plan.piece_len.sum()),
        "tokens_dropped": plan.tokens_dropped,
        "tokens_truncated": plan.tokens_truncated,
        "packs": plan.num_bins,
        "pieces": len(plan.piece_gid),
    }


def peak_rss_bytes() -> int:
    """Peak resident memory of this process (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


@contextmanager
def _timed(timings: dict[str, float], name: str) -> Iterator[None]:
    t0 = time.perf_counter()
    try:
        yield
    finally:
        timings[name] = time.perf_counter() - t0
