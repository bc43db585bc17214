"""`packctl.pack(config)`: scan -> order -> plan -> assign -> materialize -> report, on one rank or many.

Every stage receives the communicator (`packctl.dist.comm`); a run without MPI is the same code
with one rank. Only lengths travel through scan, order, plan and assign; tokens are read in
materialize.

    rank r:  scan its blocks (by bytes)          io/reader.py
             order: sample-sort, whole windows   planning.py
             plan its windows                    planning.py (plan/)
             assign: its run of packs to write,  dist/assign.py
                     equal tokens on every rank
             materialize its packs' row groups   materialize.py
    rank 0:  metrics.json, manifest.json (last)  run_report.py, io/manifest.py -> OUT

Shards are fixed runs of packs in global order (dist/assign.py), never cut by rank, so the output
bytes do not depend on the number of ranks.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from packctl.config import PackConfig
from packctl.dist.assign import assign, hand_over, units_of
from packctl.dist.comm import Comm, broadcast_outcome, get_comm
from packctl.io.manifest import build_manifest, shard_metadata
from packctl.io.reader import SequenceIndex, index_inputs, scan_blocks, split_blocks
from packctl.io.journal import ShardInfo, inspect_partial
from packctl.io.lock import OutputLock
from packctl.io.outdir import Faults, OutputDir
from packctl.io.paths import check_output_path
from packctl.materialize import Scanned, ShardFormat, choose_read_own, materialize, read_amplification
from packctl.planning import check_something_to_pack, check_too_long, order_and_distribute, plan_stage
from packctl.run_report import RankShare, assemble_metrics, plan_metrics, rank_report
from packctl.runtime import Progress, RunInterrupted, SignalGuard, after_failure, in_background, timed

__all__ = ["PackResult", "Progress", "RunInterrupted", "pack", "run_fingerprint"]


@dataclass
class PackResult:
    """What a pack run did: where it wrote, the counts of the manifest, metrics and timings.
    Under MPI, rank 0 holds the whole result; other ranks get their own timings only."""

    output: Path
    counts: dict[str, int]
    metrics: dict[str, Any]
    timings: dict[str, float]
    shards: list[ShardInfo] = field(default_factory=list)


def pack(config: PackConfig, *, progress: Progress | None = None, comm: Comm | None = None,
         faults: Faults | None = None) -> PackResult:
    """Pack `config.inputs` into `config.output` and return the counts and metrics.

    >>> from packctl import PackConfig, pack
    >>> result = pack(PackConfig(inputs=["sample_data"], output="/tmp/out", capacity=4096,
    ...                          too_long="split", overwrite=True))          # doctest: +SKIP
    >>> result.metrics["utilization"]                                        # doctest: +SKIP
    0.99...

    Under `mpiexec -n N` every rank calls it with the same config. A bad option or input found
    before any rank starts reading raises the same PackctlError on every rank; an error in one
    rank's own data later raises there (the CLI then aborts all ranks).

    Shards are journaled as they are finished in `.OUT.packctl-partial`; a run that fails or is
    interrupted (SIGINT, SIGTERM: `RunInterrupted`, exit 130 / 143) after finishing some keeps
    them there, and `config.resume` continues it (io/journal.py). `faults` simulates a crash or a
    full disk at a chosen point (tests).
    """
    comm = comm or get_comm()
    progress = progress if (progress is not None and comm.rank == 0) else Progress()
    out = Path(config.output)
    lock = OutputLock(out)
    guard = SignalGuard()
    run = _Run()
    try:
        with guard.installed():
            return _pack(config, comm, progress, out, lock, guard, run, faults)
    except BaseException as exc:
        failure = after_failure(comm, run.output, exc)
        if failure is exc:
            raise
        raise failure from None
    finally:
        lock.release()
        progress.close()


@dataclass
class _Run:
    output: OutputDir | None = None


def _pack(config: PackConfig, comm: Comm, progress: Progress, out: Path, lock: OutputLock, guard: SignalGuard,
          run: _Run, faults: Faults | None) -> PackResult:
    timings: dict[str, float] = {}
    started = time.perf_counter()
    index, fingerprint, done = broadcast_outcome(comm, lambda: _preflight(config, out, lock))

    with timed(timings, "scan"):
        block_bounds = split_blocks(index.blocks, comm.size)
        lo, hi = int(block_bounds[comm.rank]), int(block_bounds[comm.rank + 1])
        index, source = scan_blocks(index, lo, hi, config.resolved_memory_budget,
                                    progress=progress.stage("scan", hi - lo), skip_empty=config.skip_empty,
                                    pad_token_id=config.pad_token_id)
        check_too_long(comm, index, config)
        skipped_empty = comm.allreduce_sum(int(np.count_nonzero(index.lengths == 0))) if config.skip_empty else 0
        tokens_in = comm.allreduce_sum(int(index.lengths.sum()))

    with timed(timings, "order"):
        ordered = order_and_distribute(comm, index, config)

    with timed(timings, "plan"):
        planned = plan_stage(comm, ordered, config, progress=progress.stage("plan", len(ordered.gids)))
        check_something_to_pack(comm, planned.plan, index, config, skipped_empty)

    with timed(timings, "assign"):
        assignment = assign(comm.allgather(units_of(planned.plan.window_bins, planned.pack_lens, config.shard_rows)),
                            comm.size)
        job = hand_over(comm, planned.plan, planned.pack_lens, planned.columns, assignment)
        amplification = read_amplification(comm, job.plan, index) if comm.size > 1 else 1.0
        read_own = choose_read_own(config.token_transfer, amplification, config.order, comm.size)

    output = run.output = _open_output(comm, out, config.overwrite, fingerprint, done, faults)
    # --resume is how a run executes, not what it writes: the shards do not record it.
    content = dataclasses.replace(config, resume=False)
    # In one process the plan is the whole plan: its metrics are computed beside materialize.
    early_metrics = in_background(plan_metrics, planned.plan, planned.pack_lens, config, index.num_sequences,
                                  tokens_in, skipped_empty=skipped_empty) if comm.size == 1 else None
    with timed(timings, "materialize"):
        fmt = ShardFormat(metadata=shard_metadata(content, index.labels_column, index.files),
                          pad_token_id=config.pad_token_id, budget=config.resolved_memory_budget)
        written = materialize(comm, job, Scanned(index, source, block_bounds), output, fmt, read_own=read_own,
                              progress=progress.stage("materialize", job.plan.num_bins))

    with timed(timings, "report"):
        pad_like = comm.allreduce_sum(source.tokens_equal_to_pad_id)
        balanced, columns = planned.balanced, planned.columns
        share = RankShare(plan=planned.plan, pack_lens=planned.pack_lens, shards=written.shards,
                          balance_figures=balanced.figures if balanced is not None else None,
                          batch_size=columns.get("batch_size"), buckets=planned.buckets,
                          step=columns.get("step"), dp_rank=columns.get("dp_rank"))
        shares = comm.allgather(share) if comm.size > 1 else [share]
    timings["total"] = time.perf_counter() - started
    ranks = comm.allgather(rank_report(comm, index, job.plan, written, timings, read_own, amplification))
    if comm.rank != 0:
        comm.barrier()
        return PackResult(output=out, counts={}, metrics={"ranks": ranks}, timings=timings)

    metrics, _ = assemble_metrics(config, shares, ranks, num_sequences=index.num_sequences, tokens_in=tokens_in,
                                  skipped_empty=skipped_empty,
                                  plan_figures=early_metrics.result() if early_metrics is not None else None)
    counts = metrics["counts"]
    shards = [info for _, info in sorted((n, i) for s in shares for n, i in s.shards.items())]
    metrics["throughput"] = {
        "sequences_per_s": index.num_sequences / timings["total"],
        "tokens_per_s": tokens_in / timings["total"],
        "peak_rss_bytes": max(r["peak_rss_bytes"] for r in ranks),
        "blocks": len(index.blocks),
        "blocks_read_twice": sum(r["blocks_read_twice"] for r in ranks),
        "spill_files": sum(r["spill_files"] for r in ranks),
        "spilled_bytes": sum(r["spilled_bytes"] for r in ranks),
        # facts of this run, not of the packing (`packctl stats` cannot recompute them)
        "resumed_shards": len(done or {}),
        "tokens_equal_to_pad_id": pad_like,
    }
    metrics["timings"] = timings
    if comm.size > 1:
        metrics["ranks"] = ranks
    output.write_json("metrics.json", metrics)
    with guard.deferred():  # a signal now waits: the output is moments from complete
        output.drop_journal()
        output.write_json("manifest.json", build_manifest(config, index.labels_column, index.files,
                                                           shards, counts, timings))
        output.commit()
    comm.barrier()
    return PackResult(output=out, counts=counts, metrics=metrics, timings=timings, shards=shards)


def _preflight(config: PackConfig, out: Path, lock: OutputLock) -> tuple[SequenceIndex, dict, dict | None]:
    """Everything decided from options and Parquet footers, before any token is read; takes the
    output lock and checks what an interrupted run left (the shards `--resume` keeps)."""
    config.validate()
    check_output_path(out, overwrite=config.overwrite)
    index = index_inputs(config.inputs, config.tokens_column, config.labels_column)
    check_output_path(out, overwrite=config.overwrite, inputs=[f.path for f in index.files],
                      input_dirs=[str(i) for i in config.inputs])
    lock.acquire()
    fingerprint = run_fingerprint(config, index)
    done = inspect_partial(out, fingerprint, resume=config.resume)
    return index, fingerprint, done


def run_fingerprint(config: PackConfig, index: SequenceIndex) -> dict[str, Any]:
    """What must not change between an interrupted run and its `--resume`: everything the shards
    record (format, packctl version, config without execution-only options, layout, inputs) plus
    each input's modification time."""
    fingerprint = json.loads(shard_metadata(dataclasses.replace(config, resume=False), index.labels_column,
                                            index.files))
    for entry in fingerprint["inputs"]:
        try:
            entry["mtime_ns"] = os.stat(entry["path"]).st_mtime_ns
        except OSError:
            entry["mtime_ns"] = None
    return fingerprint


def _open_output(comm: Comm, out: Path, overwrite: bool, fingerprint: dict, done: dict | None,
                 faults: Faults | None) -> OutputDir:
    """Rank 0 creates (or, resuming, cleans) the partial output directory; every rank writes its
    shards into it, skipping those in `done`."""
    created: dict[str, OutputDir] = {}

    def create() -> str:
        created["dir"] = OutputDir.create(out, overwrite=overwrite, fingerprint=fingerprint, done=done, faults=faults)
        return str(created["dir"].tmp)

    tmp = broadcast_outcome(comm, create)
    return created["dir"] if "dir" in created else OutputDir(out, Path(tmp), rank=comm.rank, done=done, faults=faults)
