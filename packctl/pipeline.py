"""`packctl.pack(config)`: scan -> order -> plan -> materialize -> report, on one rank or many.

Every stage receives the communicator (`packctl.dist.comm`); a run without MPI is the same code
with one rank. Only lengths travel through scan, order and plan; tokens are read in materialize.

    rank r:  scan its blocks -> sample-sort (key, gid) -> receive its whole windows -> plan them
             -> request tokens from the ranks that read them -> write its windows' shards
    rank 0:  gathers counts and plans -> metrics.json -> manifest.json (last) -> OUT

Shards are numbered by window order, never by rank, so the output bytes do not depend on the
number of ranks.
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
from packctl.dist.comm import get_comm
from packctl.dist.samplesort import redistribute, sample_sort
from packctl.errors import PackctlError
from packctl.io.manifest import build_manifest, shard_metadata
from packctl.io.reader import SequenceIndex, index_inputs, scan_blocks, split_blocks
from packctl.io.writer import OutputDir, ShardInfo, check_output_path
from packctl.materialize import materialize, shard_bounds
from packctl.metrics import pack_metrics
from packctl.plan.align import pack_lengths_padded, round_up
from packctl.plan.order import order_keys, order_sequences
from packctl.plan.windows import PackPlan, SequenceTooLong, merge_plans, plan_windows

STAGES = ("scan", "order", "plan", "materialize", "report")


class Progress:
    """Receives stage progress; the default shows nothing (the CLI passes a rich display)."""

    def stage(self, name: str, total: int | None) -> Callable[[int], None]:
        return lambda n: None

    def close(self) -> None:
        pass


@dataclass
class PackResult:
    """What a pack run did: where it wrote, the counts of the manifest, metrics and timings.
    Under MPI, rank 0 holds the whole result; other ranks get their own timings only."""

    output: Path
    counts: dict[str, int]
    metrics: dict[str, Any]
    timings: dict[str, float]
    shards: list[ShardInfo] = field(default_factory=list)


def pack(config: PackConfig, *, progress: Progress | None = None, comm=None) -> PackResult:
    """Pack `config.inputs` into `config.output` and return the counts and metrics.

    >>> from packctl import PackConfig, pack
    >>> result = pack(PackConfig(inputs=["sample_data"], output="/tmp/out", capacity=4096,
    ...                          too_long="split", overwrite=True))          # doctest: +SKIP
    >>> result.metrics["utilization"]                                        # doctest: +SKIP
    0.99...

    Under `mpiexec -n N` every rank calls it with the same config. A bad option or input found
    before any rank starts reading raises the same PackctlError on every rank; an error in one
    rank's own data later raises there (the CLI then aborts all ranks).
    """
    comm = comm or get_comm()
    progress = progress if (progress is not None and comm.rank == 0) else Progress()
    timings: dict[str, float] = {}
    started = time.perf_counter()
    out = Path(config.output)

    index = _broadcast_outcome(comm, lambda: _preflight(config, out))

    with _timed(timings, "scan"):
        block_bounds = split_blocks(index.blocks, comm.size)
        lo, hi = int(block_bounds[comm.rank]), int(block_bounds[comm.rank + 1])
        index, source = scan_blocks(index, lo, hi, config.resolved_memory_budget,
                                    progress=progress.stage("scan", hi - lo))
        _check_too_long(comm, index, config)

    with _timed(timings, "order"):
        gids, lengths, first_window = order_and_distribute(comm, index, config)

    with _timed(timings, "plan"):
        plan = plan_windows(gids, lengths, capacity=config.plan_capacity, align=config.align,
                            algorithm=config.algorithm, too_long=config.too_long, window=config.window,
                            first_window=first_window, max_seqs_per_bin=config.max_seqs_per_bin,
                            seed=config.seed, progress=progress.stage("plan", len(gids)))
        pack_lens = pack_lengths_padded(plan.loads(padded=True), config.capacity, config.pad_to,
                                        config.resolved_pack_multiple)
        first_shard = comm.exscan(len(shard_bounds(plan.window_bins, config.shard_rows)) - 1)

    output = _open_output(comm, out, config.overwrite)
    try:
        with _timed(timings, "materialize"):
            written = materialize(comm, plan, pack_lens, index, source, block_bounds, output=output,
                                  metadata=shard_metadata(config, index.labels_column, index.files),
                                  shard_rows=config.shard_rows, first_shard=first_shard,
                                  pad_token_id=config.pad_token_id, budget=config.resolved_memory_budget,
                                  progress=progress.stage("materialize", plan.num_bins))
        with _timed(timings, "report"):
            tokens_in = comm.allreduce_sum(int(index.lengths.sum()))
            parts = comm.allgather((plan, pack_lens, written.shards)) if comm.size > 1 else [
                (plan, pack_lens, written.shards)]
        timings["total"] = time.perf_counter() - started
        ranks = comm.allgather(_rank_report(comm, index, plan, written, timings))
        if comm.rank == 0:
            whole = merge_plans([p[0] for p in parts])
            all_pack_lens = np.concatenate([p[1] for p in parts])
            shards = [s for p in parts for s in p[2]]
            metrics = plan_metrics(whole, all_pack_lens, config, index.num_sequences, tokens_in)
            counts = metrics["counts"]
            metrics["throughput"] = {
                "sequences_per_s": index.num_sequences / timings["total"],
                "tokens_per_s": tokens_in / timings["total"],
                "peak_rss_bytes": max(r["peak_rss_bytes"] for r in ranks),
                "blocks": len(index.blocks),
                "blocks_read_twice": sum(r["blocks_read_twice"] for r in ranks),
                "spill_files": sum(r["spill_files"] for r in ranks),
                "spilled_bytes": sum(r["spilled_bytes"] for r in ranks),
            }
            metrics["timings"] = timings
            if comm.size > 1:
                metrics["ranks"] = ranks
            output.write_json("metrics.json", metrics)
            output.write_json("manifest.json", build_manifest(config, index.labels_column, index.files,
                                                               shards, counts, timings))
            output.commit()
        comm.barrier()
    except BaseException:
        if comm.size == 1:
            output.abort()
        raise
    finally:
        progress.close()
    if comm.rank != 0:
        return PackResult(output=out, counts={}, metrics={"ranks": ranks}, timings=timings)
    return PackResult(output=out, counts=counts, metrics=metrics, timings=timings, shards=shards)


def _preflight(config: PackConfig, out: Path) -> SequenceIndex:
    """Everything decided from options and Parquet footers, before any token is read."""
    config.validate()
    check_output_path(out, overwrite=config.overwrite)
    index = index_inputs(config.inputs, config.tokens_column, config.labels_column)
    check_output_path(out, overwrite=config.overwrite, inputs=[f.path for f in index.files])
    return index


def _broadcast_outcome(comm, fn):
    """Run `fn` on rank 0 and give every rank its result, or raise its PackctlError on every rank
    (so all ranks stop together, and only rank 0 needs to print)."""
    outcome = None
    if comm.rank == 0:
        try:
            outcome = ("ok", fn())
        except PackctlError as exc:
            outcome = ("error", exc)
    if comm.size > 1:
        outcome = comm.bcast(outcome)
    if outcome[0] == "error":
        outcome[1].everywhere = True
        raise outcome[1]
    return outcome[1]


def _check_too_long(comm, index: SequenceIndex, config: PackConfig) -> None:
    """With --too-long error, name the over-long sequence with the smallest gid, on every rank."""
    if config.too_long != "error":
        return
    over = np.flatnonzero(round_up(index.lengths, config.align) > config.plan_capacity)
    mine = (int(index.gid_lo + over[0]), int(index.lengths[over[0]])) if len(over) else None
    found = [f for f in comm.allgather(mine) if f is not None]
    if found:
        gid, length = min(found)
        exc = PackctlError(
            f"{index.describe(gid)}: sequence of {length} tokens (padded to {int(round_up(length, config.align))}) "
            f"is longer than the capacity {config.plan_capacity}; pass --too-long drop|truncate|split or raise "
            f"--capacity")
        exc.everywhere = True
        raise exc


def order_and_distribute(comm, index: SequenceIndex, config: PackConfig) -> tuple[np.ndarray, np.ndarray, int]:
    """This rank's whole windows of the global order: (gids, true lengths, first window index).

    The order is a sample sort of (key, gid) over all ranks (input order needs none: blocks are
    already split in gid order); windows are then moved so each lives whole on one rank, rank r
    holding windows [ceil(r*W/size), ceil((r+1)*W/size)).
    """
    n_local = len(index.lengths)
    gids = index.gid_lo + np.arange(n_local, dtype=np.int64)
    lengths = index.lengths
    if config.order != "input":
        keys = order_keys(gids, round_up(lengths, config.align), config.order, seed=config.seed,
                          curriculum_order=config.curriculum_order)
        _, gids, lengths = sample_sort(comm, keys, gids, payload=lengths)
    total = index.num_sequences
    num_windows = -(-total // config.window)
    if comm.size > 1:
        def owner(positions: np.ndarray) -> np.ndarray:
            return (positions // config.window) * comm.size // num_windows

        gids, lengths = redistribute(comm, [gids, lengths], comm.exscan(len(gids)), owner)
    first_window = -(-comm.rank * num_windows // comm.size)
    return gids, lengths, first_window


def _open_output(comm, out: Path, overwrite: bool) -> OutputDir:
    """Rank 0 creates the temporary output directory; every rank writes its shards into it."""
    created: dict[str, OutputDir] = {}

    def create() -> str:
        created["dir"] = OutputDir(out, overwrite=overwrite)
        return str(created["dir"].tmp)

    tmp = _broadcast_outcome(comm, create)
    return created["dir"] if "dir" in created else OutputDir.attach(out, Path(tmp))


def _rank_report(comm, index: SequenceIndex, plan: PackPlan, written, timings: dict[str, float]) -> dict[str, Any]:
    """One rank's share of the work, for metrics.json's `ranks`."""
    return {
        "rank": comm.rank,
        "sequences_scanned": len(index.lengths),
        "tokens_scanned": int(index.lengths.sum()),
        "packs_written": plan.num_bins,
        "tokens_written": int(plan.piece_len.sum()),
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


def order_corpus(index, config: PackConfig) -> np.ndarray:
    """The sequence order of `config` in one process (depends on the order options and the
    alignment only)."""
    return order_sequences(round_up(index.lengths, config.align), config.order, seed=config.seed,
                           curriculum_order=config.curriculum_order)


def plan_corpus(index, config: PackConfig, permutation: np.ndarray | None = None,
                progress: Callable[[int], None] | None = None) -> tuple[PackPlan, np.ndarray]:
    """The packs of a whole corpus and their final lengths, in one process, exactly as
    `pack(config)` writes them (the what-if of `packctl stats`).

    `index` needs `lengths` (true length by gid) and `describe(gid)` (where a sequence comes
    from, for the over-long error).
    """
    if permutation is None:
        permutation = order_corpus(index, config)
    try:
        plan = plan_windows(permutation, index.lengths[permutation], capacity=config.plan_capacity,
                            align=config.align, algorithm=config.algorithm, too_long=config.too_long,
                            window=config.window, max_seqs_per_bin=config.max_seqs_per_bin, seed=config.seed,
                            progress=progress)
    except SequenceTooLong as exc:
        raise PackctlError(
            f"{index.describe(exc.gid)}: sequence of {exc.length} tokens (padded to {exc.padded}) is longer "
            f"than the capacity {exc.capacity}; pass --too-long drop|truncate|split or raise --capacity"
        ) from None
    pack_lens = pack_lengths_padded(plan.loads(padded=True), config.capacity, config.pad_to,
                                    config.resolved_pack_multiple)
    return plan, pack_lens


def plan_metrics(plan: PackPlan, pack_lens: np.ndarray, config: PackConfig, num_sequences: int,
                 tokens_in: int) -> dict[str, Any]:
    """metrics.json without throughput and timings: what the plan of the whole corpus achieves."""
    metrics = pack_metrics(plan.piece_len, plan.bin_offsets, pack_lens, capacity=config.capacity,
                           align=config.align, input_order=np.argsort(plan.piece_gid, kind="stable"))
    metrics["algorithm"] = config.algorithm
    metrics["order"] = config.order
    metrics["counts"] = plan_counts(plan, num_sequences, tokens_in)
    return metrics


def plan_counts(plan: PackPlan, num_sequences: int, tokens_in: int) -> dict[str, int]:
    """The manifest's `counts`."""
    return {
        "sequences_in": num_sequences,
        "sequences_packed": num_sequences - len(plan.dropped),
        "sequences_dropped": len(plan.dropped),
        "sequences_truncated": len(plan.truncated),
        "sequences_split": len(plan.split_gids()),
        "tokens_in": tokens_in,
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
