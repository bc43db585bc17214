"""`packctl.pack(config)`: scan -> order -> plan -> assign -> materialize -> report, on one rank or many.

Every stage receives the communicator (`packctl.mpi.comm`); a run without MPI is the same code
with one rank. Only lengths travel through scan, order, plan and assign; tokens are read in
materialize.

    rank r:  scan its blocks (by bytes)          source/parquet.py
             order: sample-sort, whole windows   planning.py
             plan its windows                    planning.py (plan/)
             assign: its run of packs to write,  mpi/assign.py
                     equal tokens on every rank
             materialize its packs' row groups   materialize.py
    rank 0:  _metrics.json, _manifest.json (last)  run_report.py, contract/manifest.py -> OUT

With --epochs K, order and plan run once per epoch (each rank's windows of every epoch are one run
of the global order: planning.py), and the joined plan is assigned and materialized as one, so
every block is decoded as often as for one epoch and its sequences are written K times; each epoch
is reported as an output of its own (OUT/epoch-0000e), and OUT/_epochs.json comes last.

Shards are fixed runs of packs in global order (mpi/assign.py), never cut by rank, so the output
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
from packctl.mpi.assign import WriteJob, assign, hand_over, units_of
from packctl.mpi.comm import Comm, broadcast_outcome, get_comm
from packctl.contract.manifest import EPOCHS, MANIFEST, METRICS, epoch_dir
from packctl.pipeline.manifest import build_manifest, shard_metadata
from packctl.jit import CompileClock
from packctl.source.parquet import SequenceIndex, index_inputs, scan_blocks, split_blocks
from packctl.source.groups import read_group_starts
from packctl.contract.manifest import ShardEntry
from packctl.output.journal import inspect_partial
from packctl.output.lock import OutputLock
from packctl.output.outdir import Faults, OutputDir
from packctl.output.paths import check_output_path
from packctl.pipeline.materialize import Scanned, ShardFormat, choose_read_own, materialize, read_amplification
from packctl.plan.order import epoch_seed
from packctl.pipeline.plan import (Planned, check_something_to_pack, check_too_long, config_of_epoch, join_epochs,
                              order_and_distribute, plan_stage)
from packctl.pipeline.step_loss import step_loss_columns
from packctl.pipeline.report import (Corpus, RankShare, Transfer, assemble_metrics, epochs_index, epochs_metrics,
                                plan_metrics, rank_report, throughput)
from packctl.pipeline.runtime import Progress, RunInterrupted, SignalGuard, after_failure, in_background, timed

__all__ = ["PackResult", "Progress", "RunInterrupted", "pack", "run_fingerprint"]


@dataclass
class PackResult:
    """What a pack run did: where it wrote, the counts of the manifest, metrics and timings.
    Under MPI, rank 0 holds the whole result; other ranks get their own timings only."""

    output: Path
    counts: dict[str, int]
    metrics: dict[str, Any]
    timings: dict[str, float]
    shards: list[ShardEntry] = field(default_factory=list)


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
    them there, and `config.resume` continues it (output/journal.py). `faults` simulates a crash or a
    full disk at a chosen point (tests).
    """
    comm = comm or get_comm()
    config.check_types()  # OUT's path is used at once: a value of the wrong type is refused first
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
    started, jit = time.perf_counter(), CompileClock()
    index, fingerprint, done = broadcast_outcome(comm, lambda: _preflight(config, out, lock))

    with timed(timings, "scan"):
        scanned, corpus = _scan(comm, index, config, progress)
    epochs = [_plan_epoch(comm, scanned, corpus, config, epoch, timings, progress) for epoch in range(config.epochs)]
    planned = join_epochs(epochs)
    with timed(timings, "assign"):
        job, transfer = _assign(comm, planned, scanned, config, [e.plan.num_bins for e in epochs])

    output = run.output = _open_output(comm, out, config.overwrite, fingerprint, done, faults)
    # In one process the plan is the whole plan: its metrics are computed beside materialize.
    early_metrics = in_background(plan_metrics, planned.plan, planned.pack_lens, config, corpus.sequences,
                                  corpus.tokens, skipped_empty=corpus.skipped_empty) if (
        comm.size == 1 and config.epochs == 1) else None
    with timed(timings, "materialize"):
        written = materialize(comm, job, scanned, output, _shard_format(config, scanned.index),
                              read_own=transfer.read_own, progress=progress.stage("materialize", job.plan.num_bins))
    with timed(timings, "report"):
        corpus.tokens_equal_to_pad_id = comm.allreduce_sum(scanned.source.tokens_equal_to_pad_id)
        shard_epoch = job.assignment.shard_epoch
        # rank 0 only: the plans are large
        shares = comm.gather([RankShare.of(p, {n: i for n, i in written.shards.items()
                                               if shard_epoch is None or shard_epoch[n] == e})
                              for e, p in enumerate(epochs)])
    timings["total"] = time.perf_counter() - started
    timings["compile"] = jit.seconds  # inside the stages above; throughputs leave it out
    ranks = comm.allgather(rank_report(comm, scanned.index, job.plan, written, timings, transfer))
    if comm.rank != 0:
        comm.barrier()
        return PackResult(output=out, counts={}, metrics={"ranks": ranks}, timings=timings)

    whole_run = throughput(corpus, ranks, timings, resumed_shards=len(done or {}))
    if config.epochs == 1:
        metrics, shards, manifest = _report(config, index, [s[0] for s in shares], ranks, corpus, whole_run, timings,
                                            early_metrics.result() if early_metrics is not None else None)
        reports = [("", metrics, manifest)]
    else:  # each epoch is an output of its own; OUT/_metrics.json is of them all, _epochs.json lists them
        reports, shards = [], []
        for e in range(config.epochs):
            epoch_metrics, epoch_shards, manifest = _report(config, index, [s[e] for s in shares], [], corpus,
                                                            whole_run, timings, None, epoch=e)
            reports.append((f"{epoch_dir(e)}/", epoch_metrics, manifest))
            shards += epoch_shards
        metrics = epochs_metrics(config, [s[e] for e in range(config.epochs) for s in shares], ranks, corpus,
                                 [r[1] for r in reports])
        metrics["throughput"], metrics["timings"] = whole_run, timings
        output.write_json(METRICS, metrics)
    for folder, epoch_metrics, _ in reports:
        output.write_json(folder + METRICS, epoch_metrics)
    with guard.deferred():  # a signal now waits: the output is moments from complete
        output.drop_journal()
        for folder, _, manifest in reports:
            output.write_json(folder + MANIFEST, manifest)
        if config.epochs > 1:  # written last: its presence means every epoch is complete
            output.drop_data_dir()
            output.write_json(EPOCHS, epochs_index(config, metrics, timings))
        output.commit()
    comm.barrier()
    return PackResult(output=out, counts=metrics["counts"], metrics=metrics, timings=timings, shards=shards)


def _plan_epoch(comm: Comm, scanned: Scanned, corpus: Corpus, config: PackConfig, epoch: int,
                timings: dict[str, float], progress: Progress) -> Planned:
    """Order and plan one epoch (this rank's windows of it), with the epoch's seed."""
    config = config_of_epoch(config, epoch)
    with timed(timings, "order"):
        ordered = order_and_distribute(comm, scanned.index, config, epoch)
    with timed(timings, "plan"):
        planned = plan_stage(comm, ordered, config, progress=progress.stage("plan", len(ordered.gids)))
        if epoch == 0:  # every epoch packs the same sequences
            check_something_to_pack(comm, planned.plan, scanned.index, config, corpus.skipped_empty)
        if planned.balanced is not None:  # every pack of a step gets the step's loss tokens
            planned.columns.update(step_loss_columns(comm, planned.plan, planned.balanced.result.step,
                                                     scanned.index, scanned.source, scanned.block_bounds))
    return planned


def _report(config: PackConfig, index: SequenceIndex, shares: list[RankShare], ranks: list[dict], corpus: Corpus,
            whole_run: dict, timings: dict[str, float], plan_figures: dict | None,
            epoch: int | None = None) -> tuple[dict, list[ShardEntry], dict]:
    """Rank 0: the metrics, shards and manifest of one output: all of OUT, or the folder of one
    epoch (its manifest lists the shards relative to the folder, its `epoch` says which)."""
    metrics, _ = assemble_metrics(config, shares, ranks, corpus, plan_figures=plan_figures,
                                  group_starts=index.group_starts)
    metrics["throughput"] = whole_run
    metrics["timings"] = timings
    shards = [info for _, info in sorted((n, i) for s in shares for n, i in s.shards.items())]
    listed = shards if epoch is None else [dataclasses.replace(i, path=i.path.split("/", 1)[1]) for i in shards]
    manifest = build_manifest(config, index.labels_column, index.files, listed, metrics["counts"], timings)
    if epoch is not None:
        manifest["epoch"] = metrics["epoch"] = {"index": epoch, "of": config.epochs,
                                                "seed": epoch_seed(config.seed, epoch)}
    return metrics, shards, manifest


def _scan(comm: Comm, index: SequenceIndex, config: PackConfig, progress: Progress) -> tuple[Scanned, Corpus]:
    """Decode and check this rank's blocks (equal bytes per rank); the corpus counts of all ranks."""
    block_bounds = split_blocks(index.blocks, comm.size)
    lo, hi = int(block_bounds[comm.rank]), int(block_bounds[comm.rank + 1])
    index, source = scan_blocks(index, lo, hi, config.resolved_memory_budget, progress=progress.stage("scan", hi - lo),
                                skip_empty=config.skip_empty, pad_token_id=config.pad_token_id,
                                count_loss_tokens=config.balanced)
    check_too_long(comm, index, config)
    skipped = comm.allreduce_sum(int(np.count_nonzero(index.lengths == 0))) if config.skip_empty else 0
    corpus = Corpus(sequences=index.num_sequences, tokens=comm.allreduce_sum(int(index.lengths.sum())),
                    skipped_empty=skipped, blocks=len(index.blocks))
    return Scanned(index, source, block_bounds), corpus


def _assign(comm: Comm, planned: Planned, scanned: Scanned, config: PackConfig,
            epoch_packs: list[int]) -> tuple[WriteJob, Transfer]:
    """Deal the writing out by tokens (mpi/assign.py), move the plan to its writers, and choose
    how tokens reach them (--token-transfer). `epoch_packs`: this rank's packs of each epoch."""
    pack_epoch = np.repeat(np.arange(config.epochs), epoch_packs) if config.epochs > 1 else None
    assignment = assign(comm.allgather(units_of(planned.plan.window_bins, planned.pack_lens, config.shard_rows,
                                                pack_epoch=pack_epoch)), comm.size)
    job = hand_over(comm, planned.plan, planned.pack_lens, planned.columns, assignment)
    amplification = read_amplification(comm, job.plan, scanned.index) if comm.size > 1 else 1.0
    return job, Transfer(read_own=choose_read_own(config.token_transfer, amplification, config.order, comm.size),
                         amplification=amplification)


def _shard_format(config: PackConfig, index: SequenceIndex) -> ShardFormat:
    # --resume is how a run executes, not what it writes: the shards do not record it.
    content = dataclasses.replace(config, resume=False)
    return ShardFormat(metadata=shard_metadata(content, index.labels_column, index.files),
                       pad_token_id=config.pad_token_id, budget=config.resolved_memory_budget,
                       keep_columns=tuple(config.keep_columns), weight_column=config.weight_column)


def _preflight(config: PackConfig, out: Path, lock: OutputLock) -> tuple[SequenceIndex, dict, dict | None]:
    """Everything decided from options and Parquet footers, before any token is read; takes the
    output lock and checks what an interrupted run left (the shards `--resume` keeps)."""
    config.validate()
    check_output_path(out, overwrite=config.overwrite)
    index = index_inputs(config.inputs, config.tokens_column, config.labels_column, tuple(config.keep_columns),
                         config.weight_column)
    if config.group_column is not None:
        index.group_starts = read_group_starts(index, config.group_column)
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
